"""Replay for the loops people run (issue 32), on every runtime.

Each loop trains 40 steps on 4 replicas with dropout, once with replay on (the
default) and once with `XLADIST_REPLAY=0`, in this process from the same seeds:

* AdamW with torch's defaults, a `CosineAnnealingLR` stepped after every step
  and `clip_grad_norm_` inside the step;
* Adam with torch's defaults and a `OneCycleLR` (it cycles the learning rate
  and `betas[0]` at every step);
* SGD with momentum and a `LambdaLR` that changes the learning rate at every step.

With replay `fn` runs at most 3 times (the optimizer's first step makes its
state, the next two are captured), the run compiles at most 2 programs beyond
those of the run without replay (run first, in the same process), and the
losses and final weights equal that run's to rtol 1e-5. The replay-off run is
also compared with plain PyTorch on the CPU (the same loop on the global
batch), so both are right.

Run by `make test` on torch_xla and by `make test-jax` on the jax runtime.
TF's counterpart: an optimizer's hyperparameters are values the traced step
reads (tensorflow/python/keras/optimizer_v2/optimizer_v2.py, `_set_hyper` /
`_get_hyper`; a `LearningRateSchedule` is evaluated on the `iterations`
variable inside the step), so a schedule never re-traces a `tf.function`.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xladist as xd
from xladist import runtime as _runtime

N, B, STEPS = 4, 4, 40


def _model():
  torch.manual_seed(0)
  return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 5))


def _adamw(params):
  opt = torch.optim.AdamW(params, lr=1e-2)
  return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


def _adam(params):
  opt = torch.optim.Adam(params, lr=1e-2)
  return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS)


def _sgd(params):
  opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
  return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


LOOPS = {
  "adamw-cosine-clip": (_adamw, True),
  "adam-onecycle": (_adam, False),
  "sgd-lambda": (_sgd, False),
}


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


def _one_step(model, opt, clip, x, y):
  """The loop's step: cross-entropy, backward, optional clipping, the update."""
  loss = F.cross_entropy(model(x), y)
  opt.zero_grad()
  loss.backward()
  if clip:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
  opt.step()
  return loss


def _train(monkeypatch, name, replay, dropout=True):
  make_opt, clip = LOOPS[name]
  monkeypatch.setenv("XLADIST_REPLAY", "1" if replay else "0")
  strategy = xd.MirroredStrategy()
  assert strategy.num_replicas_in_sync == N
  torch.manual_seed(0)
  _runtime.set_seed(0)
  with strategy.scope():
    model = _model()
    if not dropout:
      model[2].p = 0.0
    opt, sched = make_opt(model.parameters())

  def step(x, y):
    return _one_step(model, opt, clip, x, y)

  compiles = _runtime.compile_count()
  losses = []
  for x, y in _data():
    losses.append(
      strategy.reduce(
        "mean", strategy.run(step, args=(_split(strategy, x), _split(strategy, y))), axis=None
      )
    )
    sched.step()
  losses = torch.stack([l.cpu() for l in losses])
  compiles = _runtime.compile_count() - compiles
  weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
  return losses, weights, compiles, strategy.extended.experimental_replay_counts


def _reference(name):
  """The same loop in plain PyTorch on the CPU (global batches, no dropout)."""
  make_opt, clip = LOOPS[name]
  model = _model()
  model[2].p = 0.0
  opt, sched = make_opt(model.parameters())
  losses = []
  for x, y in _data():
    loss = _one_step(model, opt, clip, x, y)
    sched.step()
    losses.append(loss.detach())
  return torch.stack(losses), copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("name", list(LOOPS))
def test_the_loop_replays_and_equals_the_run_without_replay(monkeypatch, name):
  """The loop with replay traces at most 3 of its steps, compiles no program of
  its own beyond 2 (the runtimes keep compiled programs across strategies in a
  process: run after the loop without replay, whatever compiled before, the
  replayed run finds that run's programs and compiles only what replay adds;
  the other order measured the cache, not replay), and computes the same."""
  want, want_w, _, counts_off = _train(monkeypatch, name, replay=False)
  got, got_w, compiles, counts = _train(monkeypatch, name, replay=True)
  assert counts["traced"] <= 3 and counts["replayed"] == STEPS - counts["traced"], counts
  assert counts_off == {
    "traced": STEPS,
    "replayed": 0,
    "traced_for_writes": 0,
    "traced_unfollowed": 0,
  }
  assert compiles <= 2, compiles
  torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
  for k in want_w:
    torch.testing.assert_close(got_w[k], want_w[k], rtol=1e-5, atol=1e-7, msg=k)
  with pytest.raises(AssertionError):  # it trained
    torch.testing.assert_close(got_w["0.weight"], _model().state_dict()["0.weight"])


@pytest.mark.parametrize("name", list(LOOPS))
def test_without_dropout_the_replayed_loop_equals_plain_pytorch(monkeypatch, name):
  """The replayed loop computes what torch computes (the bias corrections of
  Adam and AdamW from their host step counters, in float64, fed as inputs):
  equal to plain PyTorch on the CPU within float32 rounding over 40 steps."""
  got, got_w, _, counts = _train(monkeypatch, name, replay=True, dropout=False)
  want, want_w = _reference(name)
  assert counts["replayed"] >= STEPS - 3
  torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
  for k in want_w:
    torch.testing.assert_close(got_w[k], want_w[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("setting", [None, "0", "1e6"])
def test_a_program_that_would_give_up_little_donates_nothing(monkeypatch, setting):
  """Donation (issue 41) costs a replay something on every runtime (jax: one more
  compilation per captured program, its donating variant; torch_xla: a sync
  before each capture and a check of every donated input before each replay), so
  a program whose donated inputs come to less than 16 MiB
  (`XLADIST_DONATE_MIN_BYTES`, global shapes; 0: always) donates nothing. A bad
  setting raises at the first capture, naming the variable. (Each case has a model
  of its own shape: programs are cached by their structure.)"""
  if setting is None:
    monkeypatch.delenv("XLADIST_DONATE_MIN_BYTES", raising=False)
  else:
    monkeypatch.setenv("XLADIST_DONATE_MIN_BYTES", setting)
  strategy = xd.MirroredStrategy()
  width = {None: 5, "0": 6, "1e6": 7}[setting]
  with strategy.scope():
    model = nn.Linear(9, width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
  x = strategy.experimental_distribute_values_from_function(lambda ctx: torch.randn(4, 9))

  def step(x):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  if setting == "1e6":
    with pytest.raises(ValueError, match=r"XLADIST_DONATE_MIN_BYTES must be an int .*got '1e6'"):
      for _ in range(3):
        strategy.run(step, args=(x,))
    return
  for _ in range(5):
    strategy.run(step, args=(x,))
  _runtime.wait()
  rep = strategy.extended._engine._replayer
  assert rep.replays >= 2, list(rep.reasons)
  (entry,) = [e for e in rep._entries.values() if e.promoted]
  program = entry.program.runtime_program[0]
  # weight, bias, their exp_avg and exp_avg_sq (AdamW's step counters are host tensors)
  want = 6 if setting == "0" else 0
  assert len(entry.program.donate) == want
  if _runtime.BACKEND == "jax":
    assert len(program.donating) == min(want, 1)  # the donating variant, compiled or not
  else:
    assert len(program.donate) == want  # the buffer donors it was compiled with
