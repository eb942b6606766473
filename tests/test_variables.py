"""Variables: mirrored and sync-on-read state, writes, updates, BatchNorm and SyncBatchNorm."""

import re

import _models
import pytest
import torch
import torch.nn.functional as F
from conftest import local_values

import xladist as xd
from xladist.runtime import xla as _runtime

VS, VA = xd.VariableSynchronization, xd.VariableAggregation

# Traced and left lazy (replay off for this run): its program's HLO is readable.
LAZY = xd.RunOptions(experimental_replay=False)


def _bn_model(sync=False):
  torch.manual_seed(5)
  norm = torch.nn.BatchNorm1d(6)
  model = torch.nn.Sequential(torch.nn.Linear(4, 6), norm, torch.nn.ReLU(), torch.nn.Linear(6, 3))
  return xd.nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def _batches(steps=3, n=4, b=5):
  g = torch.Generator().manual_seed(9)
  return [
    (torch.randn(n * b, 4, generator=g), torch.randint(0, 3, (n * b,), generator=g))
    for _ in range(steps)
  ]


def _train(strategy, model, opt, batches):
  step = _models.make_step(model, opt)
  losses = []
  for x, y in batches:
    out = strategy.run(step, args=(_models.split(strategy, x), _models.split(strategy, y)))
    losses.append(strategy.reduce("mean", out, axis=None))
    _runtime.sync()
  return torch.stack([l.cpu() for l in losses])


def test_batchnorm_running_stats_read_as_the_mean_of_the_replicas(strategy):
  batches = _batches()
  with strategy.scope():
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
  init = {k: v.cpu().clone() for k, v in model.state_dict().items()}
  _train(strategy, model, opt, batches)
  # Reference: each replica as a plain model on its own rows, gradients averaged,
  # run with plain torch_xla (no xladist) so that each replica's statistics
  # come from the same BatchNorm kernel. (torch_xla 2.9's kernel updates
  # running_var with the biased batch variance; PyTorch on the CPU uses the
  # unbiased one.)
  replicas = [_bn_model().to("xla") for _ in range(4)]
  for m in replicas:
    m.load_state_dict(init)
  for x, y in batches:
    grads = []
    for r, m in enumerate(replicas):
      m.zero_grad()
      rows = slice(r * 5, (r + 1) * 5)
      F.cross_entropy(m(x[rows].to("xla")), y[rows].to("xla")).backward()
      grads.append([p.grad for p in m.parameters()])
    mean_grads = [torch.stack(g).mean(0) for g in zip(*grads)]
    for m in replicas:
      with torch.no_grad():
        for p, g in zip(m.parameters(), mean_grads):
          p -= 0.1 * g
    _runtime.sync()
  replicas = [m.cpu() for m in replicas]
  for name in ("running_mean", "running_var"):
    expected = torch.stack([getattr(m[1], name) for m in replicas]).mean(0)
    torch.testing.assert_close(
      getattr(model[1], name).cpu(), expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}"
    )
    torch.testing.assert_close(
      model.state_dict()[f"1.{name}"].cpu(), expected, rtol=1e-5, atol=1e-6
    )
  # The replicas' statistics really differ: the mean is not any one of them.
  assert not torch.allclose(replicas[0][1].running_mean, replicas[1][1].running_mean)
  assert int(model[1].num_batches_tracked.cpu()) == 3


def test_sync_batchnorm_on_4_replicas_equals_batchnorm_on_the_global_batch(strategy):
  batches = _batches()
  with strategy.scope():
    model = _bn_model(sync=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  assert isinstance(model[1], xd.nn.SyncBatchNorm)
  losses = _train(strategy, model, opt, batches)
  ref = _bn_model()
  ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
  ref_losses = []
  for x, y in batches:
    loss = F.cross_entropy(ref(x), y)
    ropt.zero_grad()
    loss.backward()
    ropt.step()
    ref_losses.append(loss.detach())
  _models.assert_close_to_scale(losses, torch.stack(ref_losses), 1e-5)
  got = {k: v.cpu() for k, v in model.state_dict().items()}
  _models.assert_close_to_scale(
    got, {k: v for k, v in ref.state_dict().items() if v.is_floating_point()}, 1e-5
  )
  # In evaluation the running statistics are used, as in BatchNorm.
  model.eval()
  ref.eval()
  x = batches[0][0]
  out = strategy.run(lambda v: model(v), args=(_models.split(strategy, x),))
  _models.assert_close_to_scale(strategy.gather(out, 0).cpu(), ref(x).detach(), 1e-5)


def test_sync_on_read_sum_counter_reads_n_times_steps(strategy):
  with strategy.scope():
    counter = xd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
    seen = xd.Variable(0, synchronization="on_read", aggregation="sum")
  assert counter.synchronization is VS.ON_READ and not counter.value_.requires_grad

  def step(x):
    counter.assign_add(1.0)
    seen.assign_add(x.shape[0])

  x = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(3))
  for _ in range(5):
    strategy.run(step, args=(x,))
    _runtime.sync()
  assert counter.value.item() == 20.0
  assert seen.value.item() == 60 and seen.value.dtype == torch.int64
  assert strategy.extended.read_var(counter).item() == 20.0
  counter.assign(2.0)  # cross-replica write: the next steps start from it
  strategy.run(step, args=(x,))
  assert counter.value.item() == 6.0


def test_tower_local_var_scope_makes_sync_on_read_state_from_one_initial_value(strategy):
  with strategy.scope():
    with strategy.tower_local_var_scope("mean"):
      noise = xd.Variable(torch.randn(3))  # random, yet one value for all replicas
      lin = torch.nn.Linear(2, 2)
    plain = xd.Variable(torch.zeros(2))
  assert strategy.extended.variable_created_in_scope(lin.weight)
  assert noise.synchronization is VS.ON_READ and noise.aggregation is VA.MEAN
  assert plain.synchronization is VS.ON_WRITE
  initial = noise.value.cpu().clone()
  locals_ = strategy.run(lambda: noise.value * 1)
  for v in local_values(strategy, locals_):
    torch.testing.assert_close(v, initial, rtol=0, atol=0)

  def step():
    rid = xd.get_replica_context().replica_id_in_sync_group.float()
    noise.assign_add(rid.expand(3))  # each replica writes its own copy

  strategy.run(step)
  # The mean of 0, 1, 2, 3 added.
  torch.testing.assert_close(noise.value.cpu(), initial + 1.5, rtol=1e-5, atol=1e-8)
  with pytest.raises(
    RuntimeError,
    match=re.escape("tower_local_var_scope must be entered inside this strategy's scope()"),
  ):
    with strategy.tower_local_var_scope("sum"):
      pass
  assert strategy.tower_local_variable_scope == strategy.tower_local_var_scope


def test_sum_aggregated_raw_write_in_a_replica_context_raises(strategy):
  with strategy.scope():
    v = xd.Variable(1.0, aggregation="sum", name="total")
  with pytest.raises(
    RuntimeError,
    match=re.escape(
      "strategy.run: Variable('total', shape=(), dtype=torch.float32, "
      "synchronization=ON_WRITE, aggregation=SUM) is a mirrored variable with "
      "aggregation SUM and was written in place inside the step"
    ),
  ):
    strategy.run(lambda: v.value.data.add_(1.0))
  assert v.value.item() == 1.0  # nothing was written


@pytest.mark.parametrize(
  "aggregation,expected",
  [("sum", 1.0 + 10.0), ("mean", 1.0 + 2.5), (VA.ONLY_FIRST_REPLICA, 1.0 + 1.0)],
)
def test_aggregated_mirrored_writes_keep_replicas_identical(strategy, aggregation, expected):
  with strategy.scope():
    v = xd.Variable(1.0, aggregation=aggregation)

  def step():
    rid = xd.get_replica_context().replica_id_in_sync_group
    v.assign_add(rid.float() + 1)  # replicas add 1, 2, 3, 4
    return v.value * 1

  values = [t.item() for t in local_values(strategy, strategy.run(step))]
  assert values == [expected] * 4
  assert v.value.item() == expected


def test_extended_update_and_the_update_context(strategy):
  with strategy.scope():
    lin = torch.nn.Linear(2, 2)
  seen = []

  def fn(var, delta):
    seen.append(xd.current_update_device())
    with torch.no_grad():
      var.add_(delta)
    return var.sum()

  before = lin.bias.detach().cpu().clone()
  out = strategy.extended.update(lin.bias, fn, args=(torch.ones(2),))
  assert isinstance(out, xd.Mirrored)
  torch.testing.assert_close(lin.bias.cpu(), before + 1, rtol=1e-5, atol=1e-8)
  assert seen[0].type == "xla" and xd.current_update_device() is None
  per = strategy.extended.update(lin.bias, lambda var: var.sum(), group=False)
  assert isinstance(per, tuple) and len(per) == 4

  # In merge context, inside a step: traced once for all replicas.
  def merge_fn(s, delta):
    return s.extended.update(lin.bias, fn, args=(s.reduce("sum", delta, axis=None),))

  strategy.run(lambda: xd.get_replica_context().merge_call(merge_fn, args=(torch.ones(2),)))
  torch.testing.assert_close(lin.bias.cpu(), before + 5, rtol=1e-5, atol=1e-8)

  # PerReplica arguments: each replica's component updates its own copy (TF 2).
  v = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.full((2,), float(ctx.replica_id_in_sync_group))
  )
  per = strategy.extended.update(lin.bias, fn, args=(v,))
  assert isinstance(per, xd.PerReplica)
  copies = strategy.experimental_local_results(lin.bias)
  for r, c in enumerate(copies):
    torch.testing.assert_close(c, before + 5 + r, rtol=1e-5, atol=1e-8)
  with pytest.raises(ValueError, match=re.escape("is not a variable of MirroredStrategy")):
    strategy.extended.update(torch.ones(2), fn, args=(1,))
  with pytest.raises(
    RuntimeError, match=re.escape("extended.update requires being in cross-replica context")
  ):
    strategy.run(lambda: strategy.extended.update(lin.bias, fn, args=(1,)))
  assert strategy.update_non_slot(lin, lambda a: a * 2, 3) == 6


def test_variable_bookkeeping_api(strategy):
  with strategy.scope():
    lin = torch.nn.Linear(2, 2)
    v = xd.Variable(3.0)
    with strategy.colocate_vars_with(lin.weight):
      w = xd.Variable(1.0)
  ext = strategy.extended
  assert ext.variable_created_in_scope(lin.weight) and ext.variable_created_in_scope(v)
  assert ext.variable_created_in_scope(w.value_)
  assert not ext.variable_created_in_scope(torch.nn.Linear(2, 2).weight)
  assert ext.value_container(v.value_) is v and ext.value_container(lin.weight) is lin.weight
  assert ext.read_var(v).item() == 3.0 and ext.read_var(lin.weight).shape == (2, 2)
  assert ext.non_slot_devices([v]) == ext.worker_devices == strategy.non_slot_devices([v])
  with pytest.raises(
    ValueError, match=re.escape("colocate_vars_with: a Tensor of shape (2,) is not a variable")
  ):
    ext.colocate_vars_with(torch.ones(2))
  assert xd.Variable(1.0, trainable=True, synchronization="ON_READ").trainable  # as TF
  with pytest.raises(
    ValueError, match=re.escape("aggregation must be one of VariableAggregation.NONE")
  ):
    xd.Variable(1.0, aggregation="median")


def test_unwritten_variables_stay_out_of_the_program(strategy):
  with strategy.scope():
    model = _bn_model()
    unused = torch.nn.Linear(64, 64)  # alive, but not used by the step
  model.eval()
  x = _models.split(strategy, torch.randn(8, 4))
  out = strategy.run(lambda v: model(v), args=(x,), options=LAZY)
  hlo = _runtime.hlo_text([out._stacked] + list(model.parameters()) + list(model.buffers()))
  # Only the output leaves the region: no variable was written, and the unused
  # model's weights are not in the program at all.
  assert hlo.count('custom_call_target="SPMDShardToFullShape"') == 1
  assert "f32[64,64]" not in hlo
  assert unused.weight.device.type == "xla"
  _runtime.sync()


def test_state_dict_is_plain_and_loading_under_scope_re_replicates(strategy):
  with strategy.scope():
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
  _train(strategy, model, opt, _batches(steps=1))
  state = {k: v.cpu() for k, v in model.state_dict().items()}
  plain = _bn_model()
  plain.load_state_dict(state)  # loads into plain PyTorch
  plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
  plain_opt.load_state_dict(opt.state_dict())  # XLA tensors: cast to the CPU params
  assert plain_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
  other = _bn_model()
  with torch.no_grad():
    for p in other.parameters():
      p.add_(1.0)
  with strategy.scope():
    model.load_state_dict(other.state_dict())
  assert all(p.device.type == "xla" for p in model.parameters())
  copies = strategy.run(lambda: model[0].weight * 1)
  for c in local_values(strategy, copies):
    torch.testing.assert_close(c, other[0].weight.detach(), rtol=0, atol=0)
  _train(strategy, model, opt, _batches(steps=1))  # training goes on
