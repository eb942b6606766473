"""TF 2 custom-training-loop semantics that must hold on every runtime (run by
`make test` on torch_xla and by `make test-jax` with XLADIST_BACKEND=jax), 4
replicas on 4 virtual CPU devices.

Public API only; every expected value is computed here with numpy or plain
torch on the CPU. The TF test (or TF source) each case mirrors is named in its
docstring (tensorflow/python/distribute/...).
"""

import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import xladist as xd

N = 4


@pytest.fixture(scope="module")
def strategy():
  s = xd.MirroredStrategy()
  assert s.num_replicas_in_sync == N
  return s


def host(strategy, value):
  return [torch.as_tensor(v).detach().cpu() for v in strategy.experimental_local_results(value)]


def _per_replica(strategy, rows):
  """A PerReplica whose component r is rows[r] (a CPU tensor)."""
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: rows[ctx.replica_id_in_sync_group]
  )


def _data(seed=0, b=2):
  g = torch.Generator().manual_seed(seed)
  x = torch.randn(N * b, 3, generator=g)
  y = torch.randn(N * b, 1, generator=g)
  return x, y


# -- variables passed to run ---------------------------------------------------------


def test_a_variable_passed_to_run_stays_a_variable(strategy):
  """custom_training_loop_models_test.py test_variable_run_argument: the
  model's variables passed to run arrive as variables, so gradients with
  respect to them and an optimizer step through them work and update the
  model. Four steps (the later ones may be replayed) match plain torch on the
  global batch; each replica's gradient is its own slice's."""
  torch.manual_seed(3)
  with strategy.scope():
    net = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
  w0, b0 = net.weight.detach().cpu().clone(), net.bias.detach().cpu().clone()
  x, y = _data()
  xs, ys = _per_replica(strategy, x.chunk(N)), _per_replica(strategy, y.chunk(N))

  def replica_step(variables, features, targets):
    loss = F.mse_loss(net(features), targets)
    grads = torch.autograd.grad(loss, list(variables))
    for v, g in zip(variables, grads):
      v.grad = g
    optimizer.step()
    same = all(v is m for v, m in zip(variables, (net.weight, net.bias)))
    return loss.detach(), grads[0].detach(), same

  grads_seen = []
  for _ in range(4):
    loss, grad_w, same = strategy.run(replica_step, args=((net.weight, net.bias), xs, ys))
    assert same is True
    grads_seen.append([g.numpy() for g in host(strategy, grad_w)])

  ref = torch.nn.Linear(3, 1)
  with torch.no_grad():
    ref.weight.copy_(w0)
    ref.bias.copy_(b0)
  ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
  for step in range(4):
    for r, (xr, yr) in enumerate(zip(x.chunk(N), y.chunk(N))):
      (g,) = torch.autograd.grad(F.mse_loss(ref(xr), yr), [ref.weight])
      np.testing.assert_allclose(grads_seen[step][r], g.numpy(), rtol=1e-5, atol=1e-6)
    ref_opt.zero_grad()
    F.mse_loss(ref(x), y).backward()  # equal slices: the mean of the replicas' gradients
    ref_opt.step()
  np.testing.assert_allclose(
    net.weight.detach().cpu().numpy(), ref.weight.detach().numpy(), atol=1e-6
  )
  np.testing.assert_allclose(net.bias.detach().cpu().numpy(), ref.bias.detach().numpy(), atol=1e-6)


def test_a_variable_in_a_nest_and_by_keyword_is_the_variable(strategy):
  """custom_training_loop_models_test.py test_variable_run_argument, with the
  variables in a dict and passed by keyword: backward() through them fills
  their gradients, and a plain tensor argument is still a copy."""
  with strategy.scope():
    net = torch.nn.Linear(2, 1, bias=False)
  with torch.no_grad():
    net.weight.copy_(torch.tensor([[1.0, -2.0]]).to(net.weight.device))
  plain = torch.ones(1, 2)

  def fn(params, *, extra):
    w = params["w"]
    (w * torch.tensor([[3.0, 4.0]], device=w.device)).sum().backward()
    g = w.grad.detach().clone()
    w.grad = None
    return g, w is net.weight, extra is plain

  g, is_var, is_plain = strategy.run(fn, args=({"w": net.weight},), kwargs={"extra": plain})
  assert is_var is True and is_plain is False
  for part in host(strategy, g):
    np.testing.assert_array_equal(part.numpy(), [[3.0, 4.0]])
  np.testing.assert_array_equal(net.weight.detach().cpu().numpy(), [[1.0, -2.0]])


# -- strategy.reduce of a nest -------------------------------------------------------------


def test_reduce_maps_over_a_nest(strategy):
  """custom_training_loop_input_test.py testNestedOutput: run returns a list of
  a dict; strategy.reduce of that nest gives the same nest of reduced tensors
  (sum over replicas, and mean over replicas and the batch axis)."""
  rows = [torch.tensor([float(r), 10.0 * r]) for r in range(N)]
  xs = _per_replica(strategy, rows)
  out = strategy.run(lambda x: [{"a": x - 1, "b": x + 1}], args=(xs,))
  stacked = np.stack([r.numpy() for r in rows])

  summed = strategy.reduce("sum", out, axis=None)
  assert isinstance(summed, list) and len(summed) == 1 and sorted(summed[0]) == ["a", "b"]
  np.testing.assert_allclose(summed[0]["a"].cpu().numpy(), (stacked - 1).sum(0))
  np.testing.assert_allclose(summed[0]["b"].cpu().numpy(), (stacked + 1).sum(0))

  means = strategy.reduce(xd.ReduceOp.MEAN, out, axis=0)
  np.testing.assert_allclose(float(means[0]["a"]), (stacked - 1).mean(), rtol=1e-6)
  np.testing.assert_allclose(float(means[0]["b"]), (stacked + 1).mean(), rtol=1e-6)

  # A tuple mixing a PerReplica and a plain tensor (which every replica has).
  loss = strategy.run(lambda x: x.sum(), args=(xs,))
  m = strategy.reduce("mean", (loss, torch.tensor([2.0, 4.0])), axis=None)
  assert isinstance(m, tuple) and len(m) == 2
  np.testing.assert_allclose(float(m[0]), stacked.sum(1).mean(), rtol=1e-6)
  np.testing.assert_array_equal(m[1].cpu().numpy(), [2.0, 4.0])


def test_reduce_of_a_nest_names_the_leaf_it_refuses(strategy):
  """distribute_lib.py reduce: a non-distributed value cannot be SUMmed over
  several replicas; in a nest the error names the leaf."""
  xs = _per_replica(strategy, [torch.ones(2)] * N)
  out = strategy.run(lambda x: x * 2, args=(xs,))
  with pytest.raises(ValueError, match=r"strategy.reduce: value\['plain'\]: a non-distributed"):
    strategy.reduce("sum", {"ok": out, "plain": torch.ones(2)}, axis=None)
  assert strategy.reduce("sum", {"ok": out}, axis=None)["ok"].cpu().tolist() == [8.0, 8.0]


# -- experimental endpoint ------------------------------------------------------------------


def test_experimental_multi_worker_mirrored_strategy_is_the_same_class(monkeypatch):
  """collective_all_reduce_strategy_test.py (tf.distribute.experimental.
  MultiWorkerMirroredStrategy): the experimental endpoint is kept, and an
  instance of either name passes isinstance checks against both."""
  monkeypatch.delenv("TF_CONFIG", raising=False)
  assert xd.experimental.MultiWorkerMirroredStrategy is xd.MultiWorkerMirroredStrategy
  assert "MultiWorkerMirroredStrategy" in xd.experimental.__all__
  s = xd.experimental.MultiWorkerMirroredStrategy()
  assert isinstance(s, xd.MultiWorkerMirroredStrategy)
  assert isinstance(s, xd.experimental.MultiWorkerMirroredStrategy)
  assert s.num_replicas_in_sync == N


# -- copy.deepcopy ----------------------------------------------------------------------------


def test_deepcopy_of_a_strategy_that_ran_steps_is_a_working_strategy(strategy):
  """distribute_lib.py StrategyBase.__deepcopy__ / __copy__ (which Keras' clone
  paths use): a deep copy is a strategy of the same kind and configuration
  whose extended object belongs to it; a shallow copy is refused. Before, a
  strategy whose steps captured a tensor in a closure could not be copied
  ("cannot pickle 'cell' object")."""
  with strategy.scope():
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
  with torch.no_grad():
    model.weight.copy_(torch.tensor([[1.0, 1.0]]).to(model.weight.device))
  scale = torch.tensor(2.0).to(model.weight.device)  # captured by the step: a closure cell

  def step():
    loss = (model(torch.ones(1, 2, device=scale.device)) * scale).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()

  for _ in range(3):
    strategy.run(step)
  before = model.weight.detach().cpu().clone()  # 1 - 3 * 0.5 * 2 = -2 per entry
  np.testing.assert_allclose(before.numpy(), [[-2.0, -2.0]])

  clone = copy.deepcopy(strategy)
  assert type(clone) is type(strategy) and clone is not strategy
  assert clone.extended is not strategy.extended
  assert clone.num_replicas_in_sync == N
  assert clone.extended.worker_devices == strategy.extended.worker_devices
  # The copy works on its own: a model made under its scope trains there.
  with clone.scope():
    other = torch.nn.Linear(2, 1, bias=False)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.5)
  with torch.no_grad():
    other.weight.copy_(torch.tensor([[0.0, 3.0]]).to(other.weight.device))

  def other_step():
    loss = other(torch.ones(1, 2, device=scale.device)).sum()
    other_opt.zero_grad()
    loss.backward()
    other_opt.step()
    return loss.detach()

  losses = clone.run(other_step)
  assert [float(v) for v in host(clone, losses)] == [3.0] * N
  np.testing.assert_allclose(other.weight.detach().cpu().numpy(), [[-0.5, 2.5]])
  with pytest.raises(RuntimeError, match="Mixing different strategies"):
    with clone.scope():
      strategy.run(step)
  # The original and its model are untouched by the copy, and go on.
  np.testing.assert_array_equal(model.weight.detach().cpu().numpy(), before.numpy())
  strategy.run(step)
  np.testing.assert_allclose(model.weight.detach().cpu().numpy(), [[-3.0, -3.0]])
  # A structure holding the strategy copies it once (the memo).
  pair = copy.deepcopy({"a": strategy, "b": [strategy]})
  assert pair["a"] is pair["b"][0] and pair["a"] is not strategy

  with pytest.raises(RuntimeError, match=r"copy.copy\(MirroredStrategy.*copy.deepcopy"):
    copy.copy(strategy)
  default = xd.get_strategy()
  assert copy.deepcopy(default) is default


def test_the_runtime_is_the_one_selected():
  from xladist import runtime

  assert runtime.BACKEND == (os.environ.get("XLADIST_BACKEND") or "torch_xla")
