"""BatchNorm in evaluation mode inside a training step (issue 50), on every runtime.

A loop that calls `model.train()` on even steps and `model.eval()` on odd ones
(on the host, between `strategy.run` calls) and trains on every step backpropagates
through BatchNorm's frozen statistics on the odd steps: `(x - running_mean) /
sqrt(running_var + eps) * weight + bias`, with gradients for x, weight and bias and
the running statistics left as they are. torch_xla 2.9 cannot build that backward
(runtime/xla_lowerings.py `batch_norm`); these cases train it.

Each case trains a Conv2d + BatchNorm2d + Linear + BatchNorm1d + Linear model 16
steps with SGD (momentum 0.9) on 4 replicas of 4 rows (`MirroredStrategy`, the
default MEAN aggregation), once with replay on (the default) and once with
`XLADIST_REPLAY=0`, and compares every replica's loss at every step, the final
parameters and the BatchNorm buffers with plain PyTorch on the CPU running the same
loop in float64, to 1e-4 of each tensor's scale (its largest magnitude):

* `sync`: the BatchNorm layers are `xd.nn.SyncBatchNorm` (converted), so the
  training steps normalise over the global batch; the reference is one model on
  the global batch of 16 rows.
* `frozen`: plain `nn.BatchNorm` put back in evaluation mode after every
  `model.train()` (fine-tuning with frozen statistics); evaluation
  mode is per example, so the reference is again one model on the global batch,
  and the running statistics stay bit for bit what they were.
* `per_replica`: plain `nn.BatchNorm`, alternating. A training step normalises
  each replica's 4 rows by their own statistics and updates that replica's
  component of the running statistics (buffers are sync-on-read, MEAN); an
  evaluation step normalises by that replica's component. The reference runs each
  replica's rows through the model with that replica's copy of the buffers
  (DDP-style), averages the gradients, and reads the buffers as the mean of the
  copies.

TF's counterparts: tensorflow/python/keras/layers/normalization/
batch_normalization_test.py `test_batchnorm_non_trainable_with_fit` (a frozen
BatchNorm trains in inference mode: its training loss equals the evaluation loss)
and tensorflow/python/distribute/minimize_loss_test.py
`testTrainNetworkWithBatchNorm` (moving statistics updated in the replicas and
reduced across them). Run by `make test` on torch_xla and by `make test-jax` on the
jax runtime.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import xladist as xd
from xladist import runtime as _runtime

N, B, STEPS = 4, 4, 16
CLASSES = 3
SCALE_TOL = 1e-4
CASES = ("sync", "frozen", "per_replica")


class _Net(nn.Module):
  def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(2, 4, 3)  # 6x6 -> 4x4
    self.bn2d = nn.BatchNorm2d(4)
    self.fc = nn.Linear(64, 8)
    self.bn1d = nn.BatchNorm1d(8)
    self.out = nn.Linear(8, CLASSES)

  def forward(self, x):
    h = torch.tanh(self.bn2d(self.conv(x))).flatten(1)
    return self.out(torch.tanh(self.bn1d(self.fc(h))))


def _make():
  """The model, with running statistics and affine parameters away from their
  defaults (so that evaluation mode is not the identity)."""
  torch.manual_seed(0)
  model = _Net()
  g = torch.Generator().manual_seed(2)
  with torch.no_grad():
    for bn in _batch_norms(model):
      c = bn.num_features
      bn.running_mean.copy_(torch.randn(c, generator=g) * 0.3)
      bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
      bn.weight.copy_(torch.rand(c, generator=g) + 0.5)
      bn.bias.copy_(torch.randn(c, generator=g) * 0.1)
  return model


def _batch_norms(model):
  return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def _data():
  g = torch.Generator().manual_seed(1)
  return [
    (torch.randn(N * B, 2, 6, 6, generator=g), torch.randint(0, CLASSES, (N * B,), generator=g))
    for _ in range(STEPS)
  ]


def _set_mode(model, step, case):
  """train() on even steps, eval() on odd ones; `frozen` keeps BatchNorm in eval()."""
  model.train(step % 2 == 0)
  if case == "frozen":
    for bn in _batch_norms(model):
      bn.eval()


def _sgd(model):
  return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _split(strategy, t):
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: t[ctx.replica_id_in_sync_group * B : (ctx.replica_id_in_sync_group + 1) * B]
  )


def _train(monkeypatch, case, replay):
  """The loop under xladist: (losses (STEPS, N), state_dict, replay counts)."""
  monkeypatch.setenv("XLADIST_REPLAY", "1" if replay else "0")
  strategy = xd.MirroredStrategy()
  assert strategy.num_replicas_in_sync == N
  with strategy.scope():
    model = _make()
    if case == "sync":
      model = xd.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    opt = _sgd(model)

  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  results = []
  for i, (x, y) in enumerate(_data()):
    _set_mode(model, i, case)
    results.append(strategy.run(step, args=(_split(strategy, x), _split(strategy, y))))
  local = strategy.experimental_local_results
  losses = torch.stack([torch.stack([l.detach().cpu() for l in local(r)]) for r in results])
  state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
  return losses, state, strategy.extended.experimental_replay_counts


def _buffers(model):
  return {k: v.clone() for k, v in model.named_buffers()}


def _load_buffers(model, buffers):
  with torch.no_grad():
    for k, v in model.named_buffers():
      v.copy_(buffers[k])


def _record_batch_variances(model):
  """A list that each training-mode BatchNorm forward of `model` appends to:
  (layer, running_var before, biased batch variance)."""
  seen = []

  def hook(bn, args):
    if bn.training:
      x = args[0].detach()
      seen.append((bn, bn.running_var.clone(), x.var([0, *range(2, x.dim())], unbiased=False)))

  for bn in _batch_norms(model):
    bn.register_forward_pre_hook(hook)
  return seen


def _use_biased_variances(seen):
  """Moves running_var toward the biased batch variances in `seen` instead (after
  backward: autograd saved running_var), and empties it."""
  with torch.no_grad():
    for bn, before, var in seen:
      bn.running_var.copy_(before * (1 - bn.momentum) + var * bn.momentum)
  seen.clear()


def _reference(case):
  """The same loop in plain PyTorch on the CPU in float64: (losses (STEPS, N), state_dict)."""
  model = _make().double()
  opt = _sgd(model)
  # torch_xla 2.9's own training-mode BatchNorm kernel moves running_var toward
  # the *biased* batch variance, torch's CPU kernel toward the unbiased one
  # (docs/architecture.md, SyncBatchNorm): plain nn.BatchNorm trained by xladist on
  # torch_xla inherits that, so there the per-replica reference does the same
  # (xd.nn.SyncBatchNorm, the `sync` case, uses the unbiased one on every runtime).
  biased = case == "per_replica" and _runtime.BACKEND == "torch_xla"
  batch_variances = _record_batch_variances(model) if biased else None
  copies = [_buffers(model) for _ in range(N)]  # each replica's buffers (per_replica)
  losses = []
  for i, (x, y) in enumerate(_data()):
    _set_mode(model, i, case)
    x = x.double()
    opt.zero_grad()
    if case == "per_replica":
      step_losses = []
      for r in range(N):
        rows = slice(r * B, (r + 1) * B)
        _load_buffers(model, copies[r])
        loss = F.cross_entropy(model(x[rows]), y[rows])
        (loss / N).backward()
        if biased:
          _use_biased_variances(batch_variances)
        copies[r] = _buffers(model)
        step_losses.append(loss.detach())
      losses.append(torch.stack(step_losses))
    else:
      per_row = F.cross_entropy(model(x), y, reduction="none")
      per_row.mean().backward()
      losses.append(per_row.detach().view(N, B).mean(1))
    opt.step()
  if case == "per_replica":  # sync-on-read MEAN: the mean of the replicas' components
    mean = {k: torch.stack([c[k] for c in copies]).mean(0, dtype=torch.float64) for k in copies[0]}
    _load_buffers(model, mean)
  return torch.stack(losses), copy.deepcopy(model.state_dict())


def _assert_close_to_scale(got, want, name):
  if not want.is_floating_point():
    assert torch.equal(got, want.to(got.dtype)), (name, got, want)
    return
  want = want.to(torch.float64)
  err = (got.to(torch.float64) - want).abs().max().item()
  scale = max(want.abs().max().item(), 1e-6)
  assert err <= SCALE_TOL * scale, f"{name}: largest error {err:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("case", CASES)
def test_train_and_eval_steps_alternate_like_plain_pytorch(monkeypatch, case, replay):
  """Losses of every replica at every step, the parameters and the BatchNorm
  buffers after 16 alternating steps equal plain PyTorch's (float64) to 1e-4 of
  each tensor's scale, with replay on and off."""
  got_losses, got, counts = _train(monkeypatch, case, replay)
  want_losses, want = _reference(case)
  assert got_losses.shape == (STEPS, N)
  for i in range(STEPS):
    _assert_close_to_scale(got_losses[i], want_losses[i], f"losses of step {i} ({counts})")
  assert set(got) == set(want)
  for name in want:
    _assert_close_to_scale(got[name], want[name], f"{name} ({counts})")
  # It trained, and the statistics moved exactly when some BatchNorm trained.
  init = _make().state_dict()
  assert not torch.allclose(got["out.weight"], init["out.weight"])
  for name in ("bn2d.running_mean", "bn2d.running_var", "bn1d.running_mean", "bn1d.running_var"):
    if case == "frozen":
      assert torch.equal(got[name], init[name]), name
    else:
      assert not torch.allclose(got[name], init[name]), name
  if replay:
    assert counts["replayed"] > 0, counts
  else:
    assert (counts["traced"], counts["replayed"]) == (STEPS, 0), counts


@pytest.mark.parametrize("shape", [(8, 3), (8, 3, 5), (4, 3, 4, 4)], ids=["1d", "1d-seq", "2d"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_eval_mode_batch_norm_op_outside_a_step(shape, affine):
  """`F.batch_norm(..., training=False)` with a backward on the device outside any
  step (a strategy has started the runtime): torch's CPU values and gradients of
  x, weight and bias (1e-5), the running statistics unchanged."""
  xd.MirroredStrategy()
  device = _runtime.device()
  g = torch.Generator().manual_seed(3)
  c = shape[1]
  x = torch.randn(*shape, generator=g)
  mean, var = torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5
  params = [torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g)] if affine else []
  weights = torch.linspace(-1, 1, x.numel()).reshape(shape)
  results = []
  for dev in ("cpu", device):
    inputs = [t.detach().to(dev).requires_grad_() for t in [x, *params]]
    stats = [mean.to(dev), var.to(dev)]
    out = F.batch_norm(inputs[0], *stats, *(inputs[1:] or [None, None]), training=False, eps=1e-3)
    # (autograd in this thread, as in a step: a CPU backward an earlier test ran before
    # torch_xla registered its device left torch's engine without a queue for it)
    with torch.autograd.set_multithreading_enabled(False):
      (out * weights.to(dev)).sum().backward()
    results.append(
      [out.detach().cpu()] + [t.grad.cpu() for t in inputs] + [t.detach().cpu() for t in stats]
    )
  got, want = results
  for g_, w_ in zip(got, want):
    torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)
  torch.testing.assert_close(got[-2:], [mean, var], rtol=0, atol=0)
