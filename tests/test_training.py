"""PyTorch training under MirroredStrategy on 4 devices against plain PyTorch on the CPU."""

import re

import _models
import pytest
import torch
import torch.nn.functional as F

import xladist as xd
from xladist.runtime import xla as _runtime

# Traced and left lazy (replay off for this run): its program's HLO is readable.
LAZY = xd.RunOptions(experimental_replay=False)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_matches_single_device_training_on_global_batch(strategy, kind):
  state = _models.initial_state(kind)
  xs, ys = _models.make_data(kind, 4)
  ref_losses, ref_state = _models.train_reference(kind, state, xs, ys)
  losses, final = _models.train_xladist(strategy, kind, state, xs, ys)
  assert losses.shape == (_models.STEPS,)
  _models.assert_close_to_scale(losses, ref_losses, 1e-5)
  _models.assert_close_to_scale(final, ref_state, 1e-5)
  # The model did move: the comparison is not between two initial states.
  with pytest.raises(AssertionError):
    _models.assert_close_to_scale(final, state, 1e-2)


@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "traced"])
def test_twenty_steps_after_warmup_add_no_compilation(strategy, monkeypatch, replay):
  monkeypatch.setenv("XLADIST_REPLAY", "1" if replay else "0")
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=22)
  counts = {}

  def on_step(i):
    _runtime.wait()  # executions are counted when they finish
    counts[i] = (_runtime.compile_count(), _runtime.execute_count())

  _models.train_xladist(strategy, "mlp", state, xs, ys, on_step=on_step)
  assert counts[21][0] - counts[1][0] == 0
  if replay:
    # The replayed step is one execution; the reduction of its loss (code
    # outside fn, traced as always) is a second one at the sync.
    assert counts[21][1] - counts[1][1] == 40
    assert strategy.extended._engine._replayer.replays >= 19
  else:
    # One execution per step: the step (with the reduction of its loss) is one program.
    assert counts[21][1] - counts[1][1] == 20


def _traced_step(strategy, kind="mlp"):
  """Traces one training step without executing it; returns (model, loss)."""
  state = _models.initial_state(kind)
  model, opt = _models.build_xladist(strategy, kind, state)
  xs, ys = _models.make_data(kind, 4, steps=1)
  out = strategy.run(
    _models.make_step(model, opt),
    args=(_models.split(strategy, xs[0]), _models.split(strategy, ys[0])),
    options=LAZY,
  )
  return model, out


def test_step_hlo_all_reduces_gradients_over_the_replica_group(strategy):
  model, out = _traced_step(strategy)
  hlo = _runtime.hlo_text([p for p in model.parameters()])
  all_reduces = [l for l in hlo.splitlines() if " all-reduce(" in l]
  assert all_reduces, hlo[-2000:]
  for line in all_reduces:
    assert "replica_groups={{0,1,2,3}}" in line
    assert "use_global_device_ids=true" in line
  # Six gradients of one dtype are packed into a single all-reduce.
  assert len(all_reduces) == 1
  # No host round trip inside the step: no transfers, callbacks or infeeds.
  for op in ("send(", "recv(", "outfeed(", "infeed(", "host-compute", "HostCallback"):
    assert op not in hlo
  _runtime.sync()


def test_no_device_to_host_transfer_during_steps(strategy):
  import torch_xla.debug.metrics as met

  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=6)
  model, opt = _models.build_xladist(strategy, "mlp", state)
  step = _models.make_step(model, opt)
  inputs = [(_models.split(strategy, x), _models.split(strategy, y)) for x, y in zip(xs, ys)]

  def transfers(options):
    _runtime.sync()
    _runtime.wait()
    before = met.metric_data("TransferFromDeviceTime")
    for x, y in inputs:
      strategy.run(step, args=(x, y), options=options)
      _runtime.sync()
    _runtime.wait()
    after = met.metric_data("TransferFromDeviceTime")
    return (after[0] if after else 0) - (before[0] if before else 0)

  # Traced steps (replay off), then replayed ones: nothing is read back. (The
  # steps that capture a program for replay, in between, read its scalar
  # constants once, to find the optimizer's hyperparameters among them.)
  assert transfers(LAZY) == 0
  for x, y in inputs[:3]:
    strategy.run(step, args=(x, y))
  assert transfers(None) == 0
  assert strategy.extended.experimental_replay_counts["replayed"] >= len(inputs)


def test_sum_aggregation_scales_the_update_by_the_replica_count(strategy):
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=1)
  # With SUM, a per-replica mean loss gives N times the mean gradient; a plain
  # SGD step with lr/N is then the single-device step.
  model, _ = _models.build_xladist(strategy, "mlp", state)
  opt = torch.optim.SGD(model.parameters(), lr=_models.LR / 4)
  strategy.extended.experimental_gradient_aggregation = "sum"
  assert strategy.extended.experimental_gradient_aggregation is xd.ReduceOp.SUM

  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

  strategy.run(step, args=(_models.split(strategy, xs[0]), _models.split(strategy, ys[0])))
  ref = _models.MODELS["mlp"][0]()
  ref.load_state_dict(state)
  F.cross_entropy(ref(xs[0]), ys[0]).backward()
  with torch.no_grad():
    for p in ref.parameters():
      p -= _models.LR * p.grad
  got = {k: v.cpu() for k, v in model.state_dict().items()}
  _models.assert_close_to_scale(got, ref.state_dict(), 1e-5)


def test_parameters_are_identical_on_every_replica(strategy):
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=3)
  model, opt = _models.build_xladist(strategy, "mlp", state)
  step = _models.make_step(model, opt)
  for x, y in zip(xs, ys):
    strategy.run(step, args=(_models.split(strategy, x), _models.split(strategy, y)))
  # Read every replica's own copy of the first weight back through the step.
  copies = strategy.run(lambda: model[0].weight * 1.0)
  values = [v.cpu() for v in strategy.experimental_local_results(copies)]
  assert len(values) == 4
  for v in values[1:]:
    torch.testing.assert_close(v, values[0], rtol=0, atol=0)


def test_optimizer_over_parameters_made_outside_scope_is_rejected(strategy):
  import xladist.runtime.xla as rt

  w = torch.nn.Parameter(torch.ones(3, device=rt.device()))
  opt = torch.optim.SGD([w], lr=0.1)

  def step():
    loss = (w * 2).sum()
    loss.backward()
    opt.step()

  # Refused at its first use in the step, before any gradient reaches it.
  with pytest.raises(
    RuntimeError,
    match=re.escape(
      "strategy.run: mul got a Parameter of shape (3,) that requires gradients and is on "
      "the XLA device, but not made under this strategy's scope"
    ),
  ):
    strategy.run(step)
  assert w.grad is None


def test_adam_state_is_created_in_the_step_and_training_matches(strategy):
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=5)
  with strategy.scope():
    model = _models.make_mlp()
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
  step = _models.make_step(model, opt)
  for x, y in zip(xs, ys):
    strategy.run(step, args=(_models.split(strategy, x), _models.split(strategy, y)))
    _runtime.sync()
  ref = _models.make_mlp()
  ref.load_state_dict(state)
  ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
  for x, y in zip(xs, ys):
    loss = F.cross_entropy(ref(x), y)
    ropt.zero_grad()
    loss.backward()
    ropt.step()
  got = {k: v.cpu() for k, v in model.state_dict().items()}
  _models.assert_close_to_scale(got, ref.state_dict(), 1e-5)
  exp_avg = opt.state[model[0].weight]["exp_avg"]
  assert exp_avg.shape == model[0].weight.shape
  _models.assert_close_to_scale(exp_avg.cpu(), ropt.state[ref[0].weight]["exp_avg"], 1e-4)


def _encoder():
  torch.manual_seed(3)
  layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
  return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def test_transformer_encoder_with_copied_layers_trains_like_pytorch(strategy):
  # nn.TransformerEncoder deep-copies its layer: the copies register no
  # parameter under the scope, only the submodule.
  ref = _encoder()
  with strategy.scope():
    model = _encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
  assert {p.device.type for p in model.parameters()} == {"xla"}
  ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
  g = torch.Generator().manual_seed(0)
  xs = [torch.randn(8, 5, 8, generator=g) for _ in range(3)]

  def step(x):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

  for x in xs:
    strategy.run(step, args=(_models.split(strategy, x),))
    _runtime.sync()
    loss = ref(x).pow(2).mean()
    ropt.zero_grad()
    loss.backward()
    ropt.step()
  got = {k: v.cpu() for k, v in model.state_dict().items()}
  _models.assert_close_to_scale(got, ref.state_dict(), 1e-5)


def test_gradients_are_released_after_a_step_and_kept_for_accumulation(strategy):
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=2)
  model, _ = _models.build_xladist(strategy, "mlp", state)
  opt = torch.optim.SGD(model.parameters(), lr=_models.LR)

  def accumulate(x, y):  # backward only: gradients accumulate across run calls
    (F.cross_entropy(model(x), y) / 2).backward()

  def accumulate_and_step(x, y):
    accumulate(x, y)
    opt.step()
    return model[0].weight.grad * 1.0  # the aggregated gradient, read inside

  strategy.run(accumulate, args=(_models.split(strategy, xs[0]), _models.split(strategy, ys[0])))
  assert all(p.grad is not None for p in model.parameters())
  grad = strategy.run(
    accumulate_and_step, args=(_models.split(strategy, xs[1]), _models.split(strategy, ys[1]))
  )
  # Consumed by optimizer.step(): released, as zero_grad(set_to_none=True) would.
  assert all(p.grad is None for p in model.parameters())

  ref = _models.make_mlp()
  ref.load_state_dict(state)
  for x, y in zip(xs, ys):
    (F.cross_entropy(ref(x), y) / 2).backward()
  with torch.no_grad():
    expected_grad = ref[0].weight.grad.clone()
    for p in ref.parameters():
      p -= _models.LR * p.grad
  for g in strategy.experimental_local_results(grad):
    _models.assert_close_to_scale(g.cpu(), expected_grad, 1e-5)
  got = {k: v.cpu() for k, v in model.state_dict().items()}
  _models.assert_close_to_scale(got, ref.state_dict(), 1e-5)
