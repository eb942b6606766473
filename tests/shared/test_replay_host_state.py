"""Replay and the Python state a step reads and writes (issue 50), on every runtime.

A replayed step runs its compiled program without running `fn`'s Python. Before
issue 50 replay silently ignored Python state outside the program: a value the
step reads through a helper, a module attribute or a config object kept the
value of the step's trace, and what the step's Python writes (a global counter,
a helper object's attribute, a list, the host's random generator, printing)
happened on traced steps only. Each loop here is what users write in eager
PyTorch, run 16 steps on 4 replicas (MirroredStrategy, the global batch split
over the replicas) with replay on (the default) and compared with the same step
function and the same host code in plain PyTorch on the CPU on the global batch:

1. gradient accumulation counted by a module global the step updates and wraps
   (`global micro; micro += 1; if micro == 2: opt.step() ...`);
2. `model.drop.p` (a Dropout, no parameters) switched on the host between steps;
3. a flag on the top module read in `forward` (`if self.use_aux:`), flipped
   before step 9 (off then on, on then off);
4. a KL-style weight annealed on the host at every step, read by the step from
   a config object (`cfg.beta`) or by a helper from its own module global;
5. an EMA helper object (torch_ema's ExponentialMovingAverage, reduced) updated
   in the step after `opt.step()`: `self.num_updates += 1`, a decay computed
   from it on the host, its shadow tensors updated in place (a decay that
   changes at every step, and one that reaches its cap at step 8);
6. a host random decision in the step (`random.random() < 0.5`);
7. a list append and a `print` in the step (of the step number, a global the
   step reads by name, or of the loss's dtype and shape, the same at every step);
8. a global flag read by a helper, flipped once before step 9.

Before (c66e9be, torch_xla and jax 0.10.2 alike) 8 of the 12 cases failed, each
test's docstring says how; 4 passed only because their step was never replayed
(a value that changes at every step kept it from being promoted).

Each test asserts the losses (rtol 1e-4) and every final tensor (the model's
parameters and buffers, the optimizer's state, the EMA's shadow tensors: the
largest difference within 1e-4 of the tensor's scale, as
test_optimizers_and_schedulers.py) equal to the reference's, and the host state
the loop keeps (counters, lists, printed lines, `random.getstate()`) equal to
the reference's. `strategy.extended.experimental_replay_counts` must count 16
steps; a loop whose host state changes only now and then (2, 3, 8) traces at
most 6 of them (step 1 makes the optimizer's state, 2 and 3 are captured, a
change is traced and captured again: at most 3 more), while a loop whose step
writes host state at every step (1, 5, 6, 7) or whose host changes a value the
step reads at every step (4) may trace every step. Under `XLADIST_REPLAY=0`
every test passes too, every step traced (that checks the tests and their
references).

Dropout (2) draws other masks on XLA than on the CPU, so that loop is compared
with the same loop run with `XLADIST_REPLAY=0` in this process from the same
seeds (as test_replay_loops.py does: replay draws the masks the traced steps
draw, bit for bit), and up to the first step with `p > 0` (steps 1-6, p 0.0)
with plain PyTorch on the CPU.

The EMA's shadow tensors are buffers of a module made under `strategy.scope()`
(so they are variables, placed on the replicas with the model: sync-on-read,
MEAN, every replica writes the same value). Plain tensors cannot be: made under
the scope (`p.detach().clone()` before placement) they stay CPU tensors, and the
step's `sub_` is refused as a host read; cloned from a placed parameter they are
XLA tensors outside the step's variables: writing one in a step aborted
torch_xla 2.9 (hlo_sharding.cc "Check failed: !IsManual()"; checked at c66e9be) and is
refused with a message since issue 59 (test_replay_closed_world.py).

TF's counterpart: `tf.function` runs a function's Python side effects only when
it traces (tensorflow/python/eager/polymorphic_function/polymorphic_function_test.py,
`testPythonCallWithSideEffects`: a list append happens at the first call, not at
the second, which calls the graph), and a Python global or attribute read by the
traced function is captured by value at the trace (the tf.function guide,
"Depending on Python global and free variables"). A TF 2 custom loop calls
`strategy.run` eagerly unless the user wraps it in `tf.function`, and xladist
replays by default, so it keeps the eager semantics instead: what the trace
read is guarded, and a step that writes Python state is traced at every call.

Run by `make test` on torch_xla and by `make test-jax` on the jax runtime.
"""

import contextlib
import io
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xladist as xd
from xladist import _settings
from xladist import runtime as _runtime

N, B, STEPS, FLIP = 4, 4, 16, 8  # FLIP: the index of step 9, before which flags flip
MAX_TRACED = 6  # of 16, for the loops whose host state changes now and then


def _replay_on():
  """Whether replay is on in this environment (`XLADIST_REPLAY`, on unless 0/off)."""
  return _settings.switch("XLADIST_REPLAY", True)


# -- the model, the data, the two ways to run a loop -------------------------------------------


class _Net(nn.Module):
  """Linear 8->16, Tanh, Dropout (p 0: the identity unless a test sets it),
  Linear 16->5; `aux`: a second head (Linear 8->5) added when `use_aux`."""

  def __init__(self, aux=False):
    super().__init__()
    self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    self.drop = nn.Dropout(0.0)
    self.head = nn.Linear(16, 5)
    self.use_aux = False
    if aux:
      self.aux = nn.Linear(8, 5)

  def forward(self, x):
    out = self.head(self.drop(self.body(x)))
    if self.use_aux:
      out = out + self.aux(x)
    return out


def _net(aux=False):
  torch.manual_seed(0)
  return _Net(aux)


def _sgd(model):
  return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _adamw(model):
  return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


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


class _Loop:
  """One loop: its model and optimizer, the step function, the host code run
  before step i (`host(i)`), the host state it keeps (`state()`) and tensors
  beyond the model's and the optimizer's (`extra()`)."""

  def __init__(self, model, opt, step, host=None, state=None, extra=None):
    self.model, self.opt, self.step = model, opt, step
    self.host = host or (lambda i: None)
    self.state = state or (lambda: {})
    self.extra = extra or (lambda: {})

  def tensors(self):
    """Every tensor of the loop, read back to the host: the model's parameters
    and buffers, the optimizer's state (by parameter index), the extra ones."""
    out = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
    params = [p for g in self.opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
      for k, v in self.opt.state.get(p, {}).items():
        if torch.is_tensor(v):
          out[f"opt.{i}.{k}"] = v.detach().cpu()
    out.update({k: v.detach().cpu() for k, v in self.extra().items()})
    return out


def _distributed(make, snapshot_after=None):
  """The loop with `strategy.run`, 4 replicas of B rows; replay as the
  environment says (`XLADIST_REPLAY`, on by default). Returns the losses (the
  replicas' mean), the final tensors, the host state, the replay counts and the
  tensors after `snapshot_after` steps (or None)."""
  strategy = xd.MirroredStrategy()
  assert strategy.num_replicas_in_sync == N
  torch.manual_seed(0)
  _runtime.set_seed(0)
  with strategy.scope():
    loop = make()
  losses, snapshot = [], None
  for i, (x, y) in enumerate(_data()):
    loop.host(i)
    out = strategy.run(loop.step, args=(_split(strategy, x), _split(strategy, y)))
    losses.append(strategy.reduce("mean", out, axis=None).cpu())
    if i + 1 == snapshot_after:
      snapshot = loop.tensors()
  counts = dict(strategy.extended.experimental_replay_counts)
  return torch.stack(losses), loop.tensors(), loop.state(), counts, snapshot


def _reference(make, steps=STEPS):
  """The same loop in plain PyTorch on the CPU, on the global batch."""
  loop = make()
  losses = []
  for i, (x, y) in enumerate(_data()[:steps]):
    loop.host(i)
    losses.append(loop.step(x, y).detach())
  return torch.stack(losses), loop.tensors(), loop.state()


def _assert_tensors_close(got, want, what):
  """Each tensor's largest difference within 1e-4 of its scale (its largest
  magnitude, at least 1e-3)."""
  assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
  for key, w in want.items():
    scale = max(w.abs().max().item(), 1e-3)
    err = (got[key].double() - w.double()).abs().max().item()
    assert err <= 1e-4 * scale, f"{what}: {key} is {err:.3g} from the reference (scale {scale:.3g})"


def _assert_counts(counts, bounded):
  """16 steps counted; with replay on, at most MAX_TRACED traced where `bounded`
  (the host state changes only now and then); with replay off, all traced."""
  assert counts["traced"] + counts["replayed"] == STEPS, counts
  if not _replay_on():
    assert counts["traced"] == STEPS, counts
  elif bounded:
    assert counts["traced"] <= MAX_TRACED, (counts, "XLADIST_REPLAY_DEBUG=1 says why")


def _check(make, bounded):
  """Trains `make`'s loop distributed and plain; asserts losses, tensors, host
  state and the replay counts. Returns the distributed run's host state and counts."""
  want_losses, want, want_state = _reference(make)
  losses, got, state, counts, _ = _distributed(make)
  torch.testing.assert_close(
    losses, want_losses, rtol=1e-4, atol=1e-5, msg=lambda m: f"{counts}\n{m}"
  )
  _assert_tensors_close(got, want, f"{make.__name__} {counts}")
  assert state == want_state, (counts, state, want_state)
  _assert_counts(counts, bounded)
  return state, counts


# -- 1. gradient accumulation counted by a module global ----------------------------------------

micro = 0  # the accumulation loop's micro-step counter, updated by its step


def _accumulation():
  global micro
  micro = 0
  model = _net()
  opt = _sgd(model)

  def step(x, y):
    global micro
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    micro += 1
    if micro == 2:
      opt.step()
      opt.zero_grad()
      micro = 0
    return loss

  seen = []  # micro as the host sees it before each step

  def state():
    return {"micro": micro, "micro before each step": list(seen)}

  return _Loop(model, opt, step, host=lambda i: seen.append(micro), state=state)


def test_gradient_accumulation_counted_by_a_global_the_step_updates():
  """`global micro; micro += 1; if micro == 2: opt.step(); opt.zero_grad(); micro = 0`
  with `loss.backward()` at every step: the optimizer steps at every second step,
  as in plain PyTorch, and `micro` (seen before each step) follows the reference's
  0, 1, 0, 1, ... The step writes a global at every step: it may trace every step.
  Before: `micro` is part of the replay key (read by name), so keys (micro, has
  gradients) were replayed without their Python: `micro` before steps 8-16 was
  0 0 1 0 0 1 1 0 0, not 1 0 1 0 1 0 1 0 1, the optimizer stepped at the wrong
  steps (losses off by up to 0.015 from step 9, a momentum buffer 2.3x its scale
  off; 10 traced)."""
  state, _ = _check(_accumulation, bounded=False)
  assert state["micro"] == 0 and state["micro before each step"] == [0, 1] * (STEPS // 2)


# -- 2. Dropout.p switched between steps --------------------------------------------------------

P_PHASES = (0.0, 0.5, 0.0)  # p for steps 1-6, 7-11, 12-16


def _p(i, phases=P_PHASES):
  return phases[0] if i < 6 else phases[1] if i < 11 else phases[2]


def _dropout_switch(phases=P_PHASES):
  model = _net()
  opt = _sgd(model)

  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  def host(i):
    model.drop.p = _p(i, phases)

  return _Loop(model, opt, step, host=host, state=lambda: {"p": model.drop.p})


def test_dropout_p_switched_between_steps(monkeypatch):
  """`model.drop.p` set on the host before each step: 0.0 for steps 1-6, 0.5 for
  7-11, 0.0 again for 12-16 (the Dropout owns no parameters: only the program
  changes). Equal to the same loop with `XLADIST_REPLAY=0` (same seeds, same
  masks), and for steps 1-6 (no dropout) to plain PyTorch on the CPU. p changes
  twice: at most 6 traced steps (1-3, 7-8; 12 finds the program of p 0.0).
  Before: `p` was in no key; steps 7-11 replayed the program of p 0.0 (no
  dropout): losses off by 0.066 from step 7 (jax: 0.107); 3 traced."""
  got_losses, got, state, counts, got_6 = _distributed(_dropout_switch, snapshot_after=6)
  monkeypatch.setenv("XLADIST_REPLAY", "0")
  want_losses, want, want_state, counts_off, want_6 = _distributed(
    _dropout_switch, snapshot_after=6
  )
  monkeypatch.undo()
  assert (counts_off["traced"], counts_off["replayed"]) == (STEPS, 0), counts_off
  torch.testing.assert_close(
    got_losses, want_losses, rtol=1e-4, atol=1e-5, msg=lambda m: f"{counts}\n{m}"
  )
  _assert_tensors_close(got_6, want_6, f"after 6 steps, against replay off {counts}")
  _assert_tensors_close(got, want, f"against replay off {counts}")
  assert state == want_state == {"p": 0.0}
  cpu_losses, cpu_6, _ = _reference(_dropout_switch, steps=6)
  torch.testing.assert_close(got_losses[:6], cpu_losses, rtol=1e-4, atol=1e-5)
  _assert_tensors_close(got_6, cpu_6, f"after 6 steps, against plain PyTorch {counts}")
  # p 0.5 dropped units: from step 7 the losses leave those of p 0.0 throughout
  still, _, _ = _reference(lambda: _dropout_switch((0.0, 0.0, 0.0)))
  assert (want_losses[6:11] - still[6:11]).abs().min() > 1e-3, (want_losses, still)
  _assert_counts(counts, bounded=True)


# -- 3. a flag on the top module read in forward ------------------------------------------------


def _aux_flag(first):
  def make():
    model = _net(aux=True)
    model.use_aux = first
    opt = _sgd(model)

    def step(x, y):
      loss = F.cross_entropy(model(x), y)
      opt.zero_grad()
      loss.backward()
      opt.step()
      return loss

    def host(i):
      if i == FLIP:
        model.use_aux = not first

    return _Loop(model, opt, step, host=host, state=lambda: {"use_aux": model.use_aux})

  make.__name__ = f"aux_flag_{first}"
  return make


@pytest.mark.parametrize("first", [False, True], ids=["off-then-on", "on-then-off"])
def test_a_flag_on_the_module_read_in_forward_flipped_at_step_9(first):
  """`if self.use_aux: out = out + self.aux(x)` in the top module's forward;
  `model.use_aux` flipped on the host before step 9. Off then on: the aux head
  trains from step 9 (its momentum made then); on then off: it stops. One
  change: at most 6 traced steps. Before: the flag was in no key and the program
  of steps 1-3 was replayed to the end (3 traced): off then on, the aux head
  never added or trained (losses off by 0.17 from step 9, no momentum for it);
  on then off, still added (0.29)."""
  state, _ = _check(_aux_flag(first), bounded=True)
  assert state == {"use_aux": not first}


# -- 4. a KL-style weight annealed on the host at every step ------------------------------------


class _Config:
  """The run's settings, as a training script keeps them."""

  def __init__(self):
    self.beta = 0.0


_beta = 0.0  # the weight _kl_weight reads (4b)


def _kl_weight():
  """A helper of the loss: the weight from its own module's global."""
  return _beta


def _annealed(where):
  def make():
    global _beta
    _beta = 0.0
    cfg = _Config()
    model = _net()
    opt = _adamw(model)

    def step(x, y):
      out = model(x)
      ce = F.cross_entropy(out, y)
      reg = out.square().mean() + model.body[0].weight.square().sum()
      if where == "config":
        loss = ce + cfg.beta * reg
      else:
        loss = ce + _kl_weight() * reg
      opt.zero_grad()
      loss.backward()
      opt.step()
      return loss

    def host(i):
      global _beta
      if where == "config":
        cfg.beta = i / STEPS
      else:
        _beta = i / STEPS

    def state():
      return {"beta": cfg.beta if where == "config" else _beta}

    return _Loop(model, opt, step, host=host, state=state)

  make.__name__ = f"annealed_{where}"
  return make


@pytest.mark.parametrize("where", ["config", "helper-global"])
def test_a_loss_weight_annealed_on_the_host_at_every_step(where):
  """`loss = ce + cfg.beta * reg` (a config object the step closes over), or the
  weight from `_kl_weight()`, a module-level helper returning its module's global;
  the host sets it to step / 16 before each step (AdamW). The weight changes at
  every step: equality only. Before: right, and never replayed (16 traced: the
  weight is a constant of the program that differed between its captures)."""
  state, _ = _check(_annealed(where), bounded=False)
  assert state == {"beta": (STEPS - 1) / STEPS}


# -- 5. an EMA helper object updated in the step ------------------------------------------------


class _Shadow(nn.Module):
  """The EMA's shadow copies, buffers of a module (variables under a strategy)."""

  def __init__(self, params):
    super().__init__()
    for i, p in enumerate(params):
      self.register_buffer(f"s{i}", p.detach().clone())


class _EMA:
  """torch_ema's ExponentialMovingAverage, reduced to `update`: the decay warms
  up with the number of updates, a Python number kept on the helper."""

  def __init__(self, params, decay=0.99):
    self.decay = decay
    self.num_updates = 0
    self.shadow = _Shadow(params)

  @torch.no_grad()
  def update(self, params):
    self.num_updates += 1
    n = self.num_updates
    decay = min(self.decay, (1 + n) / (10 + n))
    for s, p in zip(self.shadow.buffers(), params):
      s.sub_((1 - decay) * (s - p))


def _ema_loop(decay):
  def make():
    model = _net()
    opt = _adamw(model)
    ema = _EMA(model.parameters(), decay)

    def step(x, y):
      loss = F.cross_entropy(model(x), y)
      opt.zero_grad()
      loss.backward()
      opt.step()
      ema.update(model.parameters())
      return loss

    return _Loop(
      model,
      opt,
      step,
      state=lambda: {"num_updates": ema.num_updates},
      extra=lambda: {f"ema.{k}": v for k, v in ema.shadow.state_dict().items()},
    )

  make.__name__ = f"ema_{decay}"
  return make


@pytest.mark.parametrize("decay", [0.999, 0.5], ids=["warming-up", "capped-at-step-8"])
def test_an_ema_helper_updated_in_the_step(decay):
  """After `opt.step()` the step updates an EMA helper: `self.num_updates += 1`,
  `decay = min(self.decay, (1 + n) / (10 + n))` on the host, `shadow.sub_((1 -
  decay) * (shadow - param))` under no_grad. After 16 steps `num_updates` is 16
  and the shadow tensors equal the reference's (the decay of every step applied).
  With `self.decay` 0.999 the decay changes at every step; with 0.5 it stays 0.5
  from step 8 (n = 8), so only the counter tells the steps apart. The step
  writes the helper at every step: equality only. Before: 0.999 was right and
  never replayed (the decay, a constant of the program, differed between
  captures); with 0.5 steps 10-16 were replayed: `num_updates` 9, not 16
  (the shadow tensors right: the decay stayed 0.5)."""
  state, _ = _check(_ema_loop(decay), bounded=False)
  assert state == {"num_updates": STEPS}


# -- 6. a host random decision in the step ------------------------------------------------------


def _host_random():
  random.seed(0)
  model = _net()
  opt = _sgd(model)

  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    if random.random() < 0.5:
      loss = loss * 2
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  return _Loop(model, opt, step, state=lambda: {"random": random.getstate()})


def test_a_host_random_decision_in_the_step():
  """`if random.random() < 0.5: loss = loss * 2` in the step, `random.seed(0)`
  before each run: the same draws at the same steps (the loss and its gradient
  doubled where the reference's are), and `random.getstate()` after the loop
  equal to the reference's (16 draws). Draws at every step: equality only.
  Before: 4 traced, then the replays kept a trace's decision and drew nothing
  (the Python did not run): losses off by up to
  1.79 from step 5, `random.getstate()` 4 draws on, not 16."""
  state, _ = _check(_host_random, bounded=False)
  random.seed(0)
  for _ in range(STEPS):
    random.random()
  assert state == {"random": random.getstate()}


# -- 7. a list append and a print in the step ---------------------------------------------------

_step_no = -1  # the step number, set by the host before each step


def _logging(what):
  history = []

  def make():
    global _step_no
    _step_no = -1
    history.clear()
    model = _net()
    opt = _sgd(model)

    def train(x, y):
      loss = F.cross_entropy(model(x), y)
      opt.zero_grad()
      loss.backward()
      opt.step()
      return loss

    def step_number(x, y):  # reads the global by name
      loss = train(x, y)
      history.append(_step_no)
      print(f"replay-host-state: {_step_no}")
      return loss

    def loss_metadata(x, y):  # what the loss is without its value: the same at every step
      loss = train(x, y)
      entry = (str(loss.dtype), tuple(loss.shape))
      history.append(entry)
      print(f"replay-host-state: {entry}")
      return loss

    step = step_number if what == "step-number" else loss_metadata

    def host(i):
      global _step_no
      _step_no = i

    return _Loop(model, opt, step, host=host, state=lambda: {"history": list(history)})

  make.__name__ = f"logging_{what}"
  return make


@pytest.mark.parametrize("what", ["step-number", "loss-metadata"])
def test_a_list_append_and_a_print_in_the_step(what):
  """`history.append(entry)` and `print(entry)` in the step, the entry the step
  number (a module global the host sets before each step) or the loss's dtype
  and shape (the same at every step): after 16 steps the history and the 16
  printed lines are plain PyTorch's. Writes at every step: equality only.
  Before: the step number (read by name, in the key) kept the step from being
  promoted, so it was right; the loss's metadata was appended and printed by
  the 3 traced steps only (3 entries, 3 lines)."""
  make = _logging(what)
  with contextlib.redirect_stdout(io.StringIO()) as printed:
    want_losses, want, want_state = _reference(make)
  want_lines = printed.getvalue().splitlines()
  with contextlib.redirect_stdout(io.StringIO()) as printed:
    losses, got, state, counts, _ = _distributed(make)
  lines = [l for l in printed.getvalue().splitlines() if l.startswith("replay-host-state:")]
  entries = list(range(STEPS)) if what == "step-number" else [("torch.float32", ())] * STEPS
  assert want_state == {"history": entries}
  assert want_lines == [f"replay-host-state: {e}" for e in entries]
  assert state == want_state, (counts, state)
  assert len(lines) == STEPS and lines == want_lines, (counts, lines)
  torch.testing.assert_close(losses, want_losses, rtol=1e-4, atol=1e-5)
  _assert_tensors_close(got, want, f"{make.__name__} {counts}")
  _assert_counts(counts, bounded=False)


# -- 8. a global flag read by a helper, flipped once --------------------------------------------

_penalize = False  # read by _loss_of, flipped by the host before step 9


def _loss_of(out, y):
  """The loss helper: cross-entropy, plus an output penalty once `_penalize`."""
  loss = F.cross_entropy(out, y)
  if _penalize:
    loss = loss + 0.5 * out.square().mean()
  return loss


def _helper_flag():
  global _penalize
  _penalize = False
  model = _net()
  opt = _sgd(model)

  def step(x, y):
    loss = _loss_of(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  def host(i):
    global _penalize
    if i == FLIP:
      _penalize = True

  return _Loop(model, opt, step, host=host, state=lambda: {"penalize": _penalize})


def test_a_global_flag_read_by_a_helper_flipped_once():
  """`_loss_of` (a module-level helper the step calls) adds a penalty when its
  module's global `_penalize` is set; the host sets it before step 9. The loss
  and the weights follow from step 9 on; one change: at most 6 traced steps.
  Before: the helper's global was in no key; the program without the penalty
  was replayed to the end (3 traced): losses off by 0.040 from step 9, the
  head's bias 0.79 of its scale off."""
  state, _ = _check(_helper_flag, bounded=True)
  assert state == {"penalize": True}
