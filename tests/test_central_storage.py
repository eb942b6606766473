"""CentralStorageStrategy: variables and optimizer state in host memory, compute mirrored.

TF's semantics come from tensorflow/python/distribute/central_storage_strategy.py
and its tests in tensorflow/python/distribute/parameter_server_strategy_test.py
(CentralStorageStrategyTest, the local device-assignment and increment tests:
variables on the CPU, compute on every replica device, SUM-aggregated
`assign_add` from each replica adding up on the one copy) and
tensorflow/python/keras/distribute/central_storage_strategy_test.py (training
with the strategy's distributed datasets). The reference for the numbers is
plain PyTorch on the CPU trained on the global batch, and MirroredStrategy.
"""

import gc
import sys
from pathlib import Path

import _models
import pytest
import torch
import torch.nn.functional as F
import torch_xla

import xladist as xd
import xladist.checkpoint as xc

sys.path.insert(0, str(Path(__file__).parent / "shared"))
import test_model_parts as parts  # noqa: E402  (the model-part cases, tests/shared)

N = 4


@pytest.fixture
def central():
  s = xd.experimental.CentralStorageStrategy()
  assert s.num_replicas_in_sync == N
  return s


def _live_xla_tensors():
  """How many XLA tensors torch_xla's graph executor holds (each owns its
  device data or a pending computation)."""
  return len(torch_xla._XLAC._check_device_tensor_need_materialization(""))


def _host_state(model, optimizer):
  tensors = list(model.state_dict().values())
  for state in optimizer.state.values():
    tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
  return tensors


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_training_equals_plain_pytorch_and_mirrored(central, kind):
  state = _models.initial_state(kind)
  xs, ys = _models.make_data(kind, N, steps=6)
  ref_losses, ref_state = _models.train_reference(kind, state, xs, ys)
  losses, final = _models.train_xladist(central, kind, state, xs, ys)
  m_losses, m_final = _models.train_xladist(xd.MirroredStrategy(), kind, state, xs, ys)
  torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
  torch.testing.assert_close(losses, m_losses, rtol=1e-5, atol=1e-5)
  for k, v in ref_state.items():
    torch.testing.assert_close(final[k], v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final[k], m_final[k], rtol=1e-5, atol=1e-5)


def test_adam_with_a_distributed_dataset_matches_plain_pytorch(central):
  """The keras test's loop: the strategy's distributed dataset feeding `run`."""
  torch.manual_seed(3)
  data = torch.randn(32, 8)
  target = torch.randn(32, 2)
  loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(data, target), batch_size=8, shuffle=False
  )
  torch.manual_seed(0)
  ref = torch.nn.Linear(8, 2)
  ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
  with central.scope():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)

  def step(x, y):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  for _ in range(2):
    for (x, y), (rx, ry) in zip(central.experimental_distribute_dataset(loader), loader):
      central.run(step, args=(x, y))
      loss = F.mse_loss(ref(rx), ry)
      ref_opt.zero_grad()
      loss.backward()
      ref_opt.step()
  torch.testing.assert_close(model.weight, ref.weight, rtol=1e-5, atol=1e-5)
  torch.testing.assert_close(model.bias, ref.bias, rtol=1e-5, atol=1e-5)
  for p in model.parameters():
    assert p.device.type == "cpu"
    assert all(v.device.type == "cpu" for v in opt.state[p].values())
  assert int(opt.state[model.weight]["step"]) == 8


def test_devices_as_tf(central):
  """TF: parameter_devices is the one variable device, worker_devices the replicas'."""
  mirrored = xd.MirroredStrategy()
  assert central.extended.parameter_devices == ("cpu",)
  assert central.parameter_devices == ("cpu",)
  assert central.extended.worker_devices == mirrored.extended.worker_devices
  assert len(central.extended.worker_devices) == N
  with central.scope():
    model = torch.nn.Linear(3, 2)
  assert model.weight.device.type == "cpu"
  assert central.extended.variable_created_in_scope(model.weight)
  assert central.experimental_local_results(model.weight) == (model.weight,)


def test_device_memory_holds_no_variable_or_optimizer_state_between_steps(central):
  """Measured with torch_xla's own list of live XLA tensors: what training
  leaves on the device does not depend on the model (a few tensors of the
  strategy itself), while MirroredStrategy keeps every parameter and momentum
  buffer there."""

  def live_after_training(strategy, depth):
    torch.manual_seed(0)
    gc.collect()  # tensors left by earlier tests must not be freed while counting
    torch_xla.sync()
    before = _live_xla_tensors()
    with strategy.scope():
      model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(depth)])
      opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x):
      loss = model(x).square().mean()
      opt.zero_grad()
      loss.backward()
      opt.step()

    x = _models.split(strategy, torch.randn(N * 2, 16))
    for _ in range(3):
      strategy.run(step, args=(x,))
    del x
    gc.collect()
    torch_xla.sync()
    return _live_xla_tensors() - before, model, opt

  small, model, opt = live_after_training(central, 2)
  big, _, _ = live_after_training(xd.experimental.CentralStorageStrategy(), 8)
  assert small == big <= 2  # the strategy's replica-id iota, nothing of the model
  assert all(t.device.type == "cpu" for t in _host_state(model, opt))
  assert len(opt.state) == 4  # the momentum buffers exist, on the host
  mirrored, _, mirrored_opt = live_after_training(xd.MirroredStrategy(), 8)
  print("live XLA tensors left by training: central", small, big, "mirrored", mirrored)
  assert mirrored >= 16 + 16  # 16 parameters and 16 momentum buffers on the device
  assert all(v.device.type == "xla" for s in mirrored_opt.state.values() for v in s.values())


def test_sum_aggregated_increment_from_every_replica_adds_up_on_the_one_copy(central):
  """TF's local simple-increment test: each replica's assign_add of a value it
  computed is summed onto the central variable."""
  with central.scope():
    x = xd.Variable(10.0, aggregation=xd.VariableAggregation.SUM)

  def step():
    c = torch.ones((), device=x.value.device) + 2.0  # 3.0, made by each replica
    x.assign_add(c)
    return x.value + c

  out = central.run(step)
  assert x.value_.device.type == "cpu"
  assert float(x.value.detach()) == 10.0 + 3.0 * N
  got = [float(v) for v in central.experimental_local_results(out)]
  assert got == [10.0 + 3.0 * N + 3.0] * N


def test_sync_on_read_state_matches_mirrored(central):
  """BatchNorm statistics (sync-on-read MEAN) and a sync-on-read SUM counter
  train to MirroredStrategy's values; their components live on the host."""

  def train(strategy):
    torch.manual_seed(0)
    with strategy.scope():
      model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
      )
      opt = torch.optim.SGD(model.parameters(), lr=0.1)
      seen = xd.Variable(
        0.0,
        synchronization=xd.VariableSynchronization.ON_READ,
        aggregation=xd.VariableAggregation.SUM,
      )

    def step(x):
      loss = model(x).square().mean()
      opt.zero_grad()
      loss.backward()
      opt.step()
      seen.assign_add(torch.ones((), device=x.device) * x.shape[0])
      return loss

    g = torch.Generator().manual_seed(1)
    for _ in range(3):
      strategy.run(step, args=(_models.split(strategy, torch.randn(N * 3, 6, generator=g)),))
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return state, float(strategy.extended.read_var(seen)), model

  state, seen, model = train(central)
  m_state, m_seen, _ = train(xd.MirroredStrategy())
  assert seen == m_seen == 3 * N * 3
  for k, v in m_state.items():
    torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5)
  bn = model[1]
  assert bn.running_mean.device.type == "cpu"
  components = central.experimental_local_results(bn.running_mean)
  assert len(components) == N and all(c.device.type == "cpu" for c in components)
  torch.testing.assert_close(torch.stack(components).mean(0), bn.running_mean)


def test_checkpoint_resumes_training_exactly(central, tmp_path):
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", N, steps=6)

  def run_steps(model, opt, lo, hi):
    step = _models.make_step(model, opt)
    for x, y in zip(xs[lo:hi], ys[lo:hi]):
      central.run(step, args=(_models.split(central, x), _models.split(central, y)))

  model, opt = _models.build_xladist(central, "mlp", state)
  run_steps(model, opt, 0, 3)
  path = xc.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
  run_steps(model, opt, 3, 6)
  expected = {k: v.clone() for k, v in model.state_dict().items()}

  model2, opt2 = _models.build_xladist(central, "mlp", _models.initial_state("mlp", seed=5))
  xc.Checkpoint(model=model2, optimizer=opt2).restore(path)
  run_steps(model2, opt2, 3, 6)
  for k, v in expected.items():
    torch.testing.assert_close(model2.state_dict()[k], v, rtol=0, atol=0)


def test_gradients_accumulated_over_runs_match_mirrored(central):
  """A run that only calls backward() leaves the reduced gradient on the one
  copy; the next run's optimizer.step() counts it once (MEAN and SUM)."""

  def train(strategy, op):
    strategy.extended.experimental_gradient_aggregation = op
    torch.manual_seed(0)
    with strategy.scope():
      model = torch.nn.Linear(4, 1)
      opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def accumulate(x):
      model(x).sum().backward()

    def apply(x):
      model(x).sum().backward()
      opt.step()
      opt.zero_grad()

    g = torch.Generator().manual_seed(2)
    batches = [_models.split(strategy, torch.randn(N * 2, 4, generator=g)) for _ in range(2)]
    strategy.run(accumulate, args=(batches[0],))
    strategy.run(apply, args=(batches[1],))
    return [p.detach().cpu() for p in model.parameters()]

  for op in ("mean", "sum"):
    got = train(central, op)
    want = train(xd.MirroredStrategy(), op)
    for a, b in zip(got, want):
      torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_failing_step_changes_nothing(central):
  with central.scope():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  before = {k: v.clone() for k, v in model.state_dict().items()}

  def step(x):
    model(x).sum().backward()
    opt.step()
    raise ValueError("boom in the step")

  x = _models.split(central, torch.randn(N, 3))
  with pytest.raises(ValueError, match="boom in the step"):
    central.run(step, args=(x,))
  for k, v in model.state_dict().items():
    assert v.device.type == "cpu"
    torch.testing.assert_close(v, before[k], rtol=0, atol=0)
  assert not opt.state
  assert all(p.grad is None for p in model.parameters())

  def good(x):
    model(x).sum().backward()
    opt.step()

  central.run(good, args=(x,))
  assert not torch.equal(model.weight, before["weight"])


def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="parameter_device='xla:0'.*host memory"):
    xd.experimental.CentralStorageStrategy(parameter_device="xla:0")
  with pytest.raises(ValueError, match="CentralStorageStrategy.*every local XLA device"):
    xd.experimental.CentralStorageStrategy(compute_devices=["xla:0"])
  with pytest.raises(TypeError, match="communication_options"):
    xd.experimental.CentralStorageStrategy(communication_options=3)
  s = xd.experimental.CentralStorageStrategy(parameter_device="cpu")
  assert s.extended.parameter_devices == ("cpu",)


def test_a_read_after_optimizer_step_in_the_same_step_is_refused(central):
  """Issue 24: the update runs on the host after the step's program, so a
  parameter read after optimizer.step() inside the same step would see the
  old value (MirroredStrategy's sees the new one). It raises instead, naming
  the parameter; reads before the step, zero_grad() after it, parameters the
  step did not update, and reads in the next run work (the next run sees the
  updated values, as plain PyTorch)."""
  torch.manual_seed(0)
  ref = torch.nn.Linear(3, 2)
  with central.scope():
    model = torch.nn.Linear(3, 2)
    head = torch.nn.Linear(2, 1)
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
  x = torch.randn(N, 3)
  before = {k: v.clone() for k, v in model.state_dict().items()}

  def second_forward(x):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return model(x).sum()  # reads model.weight after the update

  with pytest.raises(RuntimeError, match=r"reads the parameter weight after optimizer.step\(\)"):
    central.run(second_forward, args=(_models.split(central, x),))
  for k, v in model.state_dict().items():  # a refused step changes nothing
    torch.testing.assert_close(v, before[k], rtol=0, atol=0)

  def returns_parameter(x):
    model(x).square().mean().backward()
    opt.step()
    return model.bias

  with pytest.raises(RuntimeError, match="the step function returns the parameter bias"):
    central.run(returns_parameter, args=(_models.split(central, x),))

  def good(x):
    out = model(x)
    loss = out.square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach(), head(out.detach()).sum()  # head was not updated

  central.run(good, args=(_models.split(central, x),))
  ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
  ref_opt.zero_grad()
  ref(x).square().mean().backward()
  ref_opt.step()

  def forward(x):
    return model(x)

  out = central.run(forward, args=(_models.split(central, x),))
  got = torch.cat([o.cpu() for o in central.experimental_local_results(out)])
  torch.testing.assert_close(got, ref(x).detach(), rtol=1e-5, atol=1e-5)


def test_tied_weights_are_one_variable_on_central_storage():
  """A tensor shared by two modules is moved to the devices and back once per step
  (it was swapped twice: its gradient reached a host tensor)."""
  model = parts.assert_trains_like_one_device(
    xd.experimental.CentralStorageStrategy(), parts._TiedLM, parts._tokens, classes=20
  )
  assert model.head.weight is model.emb.weight
