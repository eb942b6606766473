"""EMA helpers whose shadow copies are plain tensors (torch_ema's pattern), on every runtime.

A user makes the model under `strategy.scope()` and then an EMA helper whose
shadow copies are plain tensors, not variables:

    self.shadow = [p.detach().clone() for p in params]
    ...
    @torch.no_grad()
    def update(self, params):
      self.num_updates += 1
      d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
      for s, p in zip(self.shadow, params):
        s.sub_((1 - d) * (s - p))

and calls `ema.update(model.parameters())` in the step after `opt.step()`.
Before, writing such a tensor in a step aborted torch_xla 2.9 at the next sync
(hlo_sharding.cc "Check failed: !IsManual()": the tensor held a value of the
step's manual region) and left a traced value in it on the jax runtime
("'sharding' attribute is not available on traced array" at the next step);
made under the scope (before placement) the shadows were host tensors, and the
step's `sub_` was refused as a host read (torchax: "mixed math").

Now a device tensor made before the step that the step writes in place is
entered like a mirrored variable (`Region.enter_outside`) and leaves the step
replicated, as written; a host tensor written with the step's device values is
moved to the device first (in place), so shadows cloned under the scope work
too. Each loop runs 16 steps on 4 replicas (MirroredStrategy, SGD with
momentum, the global batch split over the replicas), with replay on and off,
and is compared with the same loop in plain PyTorch on the CPU on the global
batch: losses (rtol 1e-4), parameters and shadow tensors (the largest
difference within 1e-4 of each tensor's scale), and `num_updates` 16.

What cannot be made right is refused with an error that says what to do: a
write of a value that differs between replicas (a replica's loss, a gradient
before its aggregation) to such a tensor, which holds one value for all
replicas, and a write through a view of it.

TF's counterpart: `tf.train.ExponentialMovingAverage` under a strategy keeps
its shadow copies as mirrored variables made under the scope, and
`assign_moving_average` called in a replica context updates them from the
replicas' mean of the value (tensorflow/python/distribute/moving_averages_test.py:
`ExponentialMovingAverageTest.testReplicaContextEager` applies the EMA inside
`distribution.run`; `AssignMovingAveragesTest.testReplicaMode`, a value that
differs between replicas, gives their mean). The decay rule with a step
counter, `min(decay, (1 + num_updates) / (10 + num_updates))`, is TF's
(tensorflow/python/training/moving_averages_test.py,
`testAverageVariablesNumUpdates_Scalar`). With mirrored parameters every
replica's value is the same, so the plain tensors here equal TF's shadow
variables; a value that differs between replicas needs a variable whose
aggregation says how to combine it (a module buffer: the mean, as TF).

Run by `make test` on torch_xla and by `make test-jax` on the jax runtime.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xladist as xd
from xladist import runtime as _runtime

N, B, STEPS = 4, 4, 16


class EMA:
  """torch_ema's ExponentialMovingAverage, reduced to what the step uses."""

  def __init__(self, params, decay=0.999):
    self.shadow = [p.detach().clone() for p in params]  # plain tensors, not variables
    self.num_updates = 0
    self.decay = decay

  @torch.no_grad()
  def update(self, params):
    self.num_updates += 1
    d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
    for s, p in zip(self.shadow, params):
      s.sub_((1 - d) * (s - p))


class FixedEMA:
  """An EMA with a fixed decay: the step writes no Python state (a step replay
  could capture, were the shadows not written)."""

  def __init__(self, params, decay=0.9):
    self.shadow = [p.detach().clone() for p in params]
    self.decay = decay

  @torch.no_grad()
  def update(self, params):
    for s, p in zip(self.shadow, params):
      s.mul_(self.decay).add_(p, alpha=1 - self.decay)


def _model():
  torch.manual_seed(0)
  return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))


def _data():
  g = torch.Generator().manual_seed(1)
  return [
    (torch.randn(N * B, 8, generator=g), torch.randint(0, 5, (N * B,), generator=g))
    for _ in range(STEPS)
  ]


def _split(strategy, t):
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: t[ctx.replica_id_in_sync_group * B : (ctx.replica_id_in_sync_group + 1) * B]
  )


def _step_fn(model, opt, ema, counter=None):
  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    ema.update(model.parameters())
    if counter is not None:
      with torch.no_grad():
        counter.add_(1)
    return loss

  return step


def _reference(make_ema):
  """The loop in plain PyTorch on the CPU, on the global batch (run after the
  strategy is made: a CPU backward before the runtime starts leaves torch's
  autograd engine without a queue for its device, which a later backward
  outside a step, in another test of the process, trips on)."""
  model = _model()
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  ema = make_ema(model.parameters())
  step = _step_fn(model, opt, ema)
  losses = torch.stack([step(x, y).detach() for x, y in _data()])
  return losses, [p.detach() for p in model.parameters()], ema


def _distributed(monkeypatch, replay, make_ema, under_scope, counter=False):
  """The loop with `strategy.run` on 4 replicas; the EMA made after the scope
  (its shadows cloned from placed parameters: device tensors) or under it
  (cloned before placement: host tensors)."""
  monkeypatch.setenv("XLADIST_REPLAY", "1" if replay else "0")
  strategy = xd.MirroredStrategy()
  assert strategy.num_replicas_in_sync == N
  with strategy.scope():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if under_scope:
      ema = make_ema(model.parameters())
  if not under_scope:
    ema = make_ema(model.parameters())
  count = torch.zeros((), device=model[0].weight.device) if counter else None
  step = _step_fn(model, opt, ema, count)
  losses = []
  for x, y in _data():
    out = strategy.run(step, args=(_split(strategy, x), _split(strategy, y)))
    losses.append(strategy.reduce("mean", out, axis=None).cpu())
  counts = dict(strategy.extended.experimental_replay_counts)
  params = [p.detach().cpu() for p in model.parameters()]
  return torch.stack(losses), params, ema, count, counts


def _assert_close(got, want, what):
  """Each tensor's largest difference within 1e-4 of its scale."""
  assert len(got) == len(want)
  for i, (g, w) in enumerate(zip(got, want)):
    scale = max(w.abs().max().item(), 1e-3)
    err = (g.detach().cpu().double() - w.double()).abs().max().item()
    assert err <= 1e-4 * scale, f"{what} {i}: {err:.3g} from the reference (scale {scale:.3g})"


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("under_scope", [False, True], ids=["after-scope", "under-scope"])
def test_torch_ema_shadow_tensors_follow_plain_pytorch(monkeypatch, replay, under_scope):
  """torch_ema's pattern: the shadows, the parameters and the losses after 16
  steps equal plain PyTorch's on the global batch, and `num_updates` is 16 (the
  step writes it: traced at every call). Made under the scope the shadows start
  on the host and are on the device after the first step. Before: torch_xla
  aborted at the second step ("Check failed: !IsManual()"), jax failed there;
  under the scope the first step was refused as a host read."""
  losses, params, ema, _, counts = _distributed(monkeypatch, replay, EMA, under_scope)
  want_losses, want_params, want_ema = _reference(EMA)
  torch.testing.assert_close(
    losses, want_losses, rtol=1e-4, atol=1e-5, msg=lambda m: f"{counts}\n{m}"
  )
  _assert_close(params, want_params, "parameter")
  _assert_close(ema.shadow, want_ema.shadow, "shadow tensor")
  assert ema.num_updates == STEPS
  assert all(_runtime.is_device_tensor(s) for s in ema.shadow)
  assert counts["traced"] + counts["replayed"] == STEPS, counts


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_fixed_decay_ema_and_a_device_counter(monkeypatch, replay):
  """An EMA with a fixed decay (the step writes no Python state) and a counter
  made with `torch.zeros((), device=...)` after the scope, both written in the
  step: the shadows equal plain PyTorch's and the counter is 16. Replay must
  not skip the writes (a replayed program would not write these tensors)."""
  losses, params, ema, count, counts = _distributed(
    monkeypatch, replay, FixedEMA, under_scope=False, counter=True
  )
  want_losses, want_params, want_ema = _reference(FixedEMA)
  torch.testing.assert_close(
    losses, want_losses, rtol=1e-4, atol=1e-5, msg=lambda m: f"{counts}\n{m}"
  )
  _assert_close(params, want_params, "parameter")
  _assert_close(ema.shadow, want_ema.shadow, "shadow tensor")
  assert count.cpu().item() == STEPS


def _one_replica_value_step(model, opt, total):
  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    total.add_(loss.detach())  # each replica's own loss
    return loss

  return step


def _gradient_step(model, opt, total):
  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    with torch.no_grad():
      total.add_(model[0].weight.grad)  # before optimizer.step() aggregates it
    opt.step()
    return loss

  return step


def _view_step(model, opt, total):
  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    with torch.no_grad():
      total[0].add_(1.0)  # a view of the tensor
    return loss

  return step


@pytest.mark.parametrize(
  "make_step, shape, match",
  [
    (_one_replica_value_step, (), r"shape \(\) made before the step .* differs between replicas"),
    (_gradient_step, (16, 8), r"shape \(16, 8\) made before the step .* differs between replicas"),
    (_view_step, (16, 8), r"writes a view of shape \(8,\) of a tensor of shape \(16, 8\)"),
  ],
  ids=["a-replica-loss", "a-gradient-before-aggregation", "through-a-view"],
)
def test_writes_that_cannot_be_made_right_are_refused(make_step, shape, match):
  """A value that differs between replicas written to a plain tensor (which holds
  one value for all replicas), or a write through a view of it: strategy.run
  raises a RuntimeError naming the tensor's shape and `strategy.scope()`, the
  tensor and the model keep their values, and the next steps run (no abort at
  the next sync). Before: torch_xla aborted the process."""
  strategy = xd.MirroredStrategy()
  with strategy.scope():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  total = torch.zeros(shape, device=model[0].weight.device)
  before = [p.detach().cpu().clone() for p in model.parameters()]
  (x, y), (x2, y2) = _data()[:2]
  with pytest.raises(RuntimeError, match=match) as info:
    strategy.run(make_step(model, opt, total), args=(_split(strategy, x), _split(strategy, y)))
  assert "strategy.scope()" in str(info.value)
  assert total.cpu().abs().max().item() == 0.0
  _assert_close([p.detach().cpu() for p in model.parameters()], before, "parameter")
  ema = EMA(model.parameters())
  step = _step_fn(model, opt, ema, total)  # `total` counts the steps now: the same everywhere
  for _ in range(2):
    strategy.run(step, args=(_split(strategy, x2), _split(strategy, y2)))
  assert total.cpu().flatten()[0].item() == 2.0
  assert ema.num_updates == 2 and torch.isfinite(ema.shadow[0].cpu()).all()
