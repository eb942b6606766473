"""Training loops whose steps read host state the replay recorder must guard (issue 59).

Each loop is what users write in eager PyTorch: 16 steps on 4 replicas
(MirroredStrategy, the global batch split over them) with replay on, against the
same step function and host code in plain PyTorch on the CPU on the global
batch. The host changes what the step reads before step 7 and changes it back
before step 13, through a path the recorder did not follow before issue 59: an
attribute read by a computed name, dict items at computed keys, a nested
subscript, a list item rebound, a forward hook, a `functools.partial`'s keyword,
a numpy array and a CPU tensor changed in place, an environment variable, a
property over a `_`-prefixed attribute, train/eval of a module reached through
an object, a generator advanced in the step, a global weight and flag; and three
loops whose step writes host state (a global counter, the host random generator),
traced at every step.

This file is self-contained so that it also runs as `python -c "$(cat this file)"`:
then every function here, the model's `forward` included, is code from
`<string>`, as in a REPL or a notebook, which the recorder skipped before.
`main()` (run as a script or as `-c`) prints one line per loop:
`LOOP name ok traced replayed` or `LOOP name FAIL reason`.
"""

import functools
import os
import random
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import xladist as xd
from xladist import runtime as _runtime

N, B, STEPS = 4, 4, 16
MAX_TRACED = 6  # of 16, for a loop whose host state changes twice
ENV = "XLADIST_TEST_CLOSED_WORLD_W"


def phase(i, a, b):
  """The value of the host state before step i+1: a for steps 1-6 and 13-16, b for 7-12."""
  return b if 6 <= i < 12 else a


class Net(nn.Module):
  """Linear 8->16, Tanh, Linear 16->5, with host settings its forward reads."""

  def __init__(self):
    super().__init__()
    self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    self.head = nn.Linear(16, 5)
    self.scale = torch.tensor(1.0)  # a CPU tensor, not a buffer
    self._progress = 1.0

  @property
  def alpha(self):
    return self._progress

  def forward(self, x):
    return self.head(self.body(x))


class Halve(nn.Module):
  """Halves its input in training mode, the identity in eval mode."""

  def forward(self, x):
    return x * 0.5 if self.training else x


class Cfg:
  def __init__(self):
    self.w_ce, self.w_reg = 1.0, 0.1


class Reg:
  def __init__(self, w):
    self.w = w


class Trainer:
  def __init__(self, net):
    self.net = net


LW = {"ce": 1.0, "reg": 0.1}
CONF = {"loss": {"l2": 0.1}}
REGS = [Reg(0.1)]
W = np.array([0.1, 0.0], dtype=np.float32)
SMOOTH = functools.partial(F.smooth_l1_loss, beta=1.0)


def data():
  g = torch.Generator().manual_seed(1)
  return [
    (torch.randn(N * B, 8, generator=g), torch.randint(0, 5, (N * B,), generator=g))
    for _ in range(STEPS)
  ]


def reg_of(out):
  return out.square().mean()


class Loop:
  def __init__(self, model, opt, step, host):
    self.model, self.opt, self.step, self.host = model, opt, step, host


def _made(step_of, host):
  """A Loop factory: model and optimizer made (under the scope when distributed),
  then `step_of(model, opt)` and the host code."""

  def make():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Loop(model, opt, step_of(model, opt), host(model))

  return make


def _train(model, opt, loss):
  opt.zero_grad()
  loss.backward()
  opt.step()
  return loss


def _weighted(weight):
  """A step function factory: cross-entropy plus `weight(model) * reg_of(out)`, the
  weight read inside the step (so by the step's own code, as the recorder sees it)."""

  def step_of(model, opt):
    def fn(x, y):
      out = model(x)
      return _train(model, opt, F.cross_entropy(out, y) + weight(model) * reg_of(out))

    return fn

  return step_of


# -- the loops ----------------------------------------------------------------------------------


def computed_getattr():
  def host(model):
    model.cfg = Cfg()
    return lambda i: setattr(model.cfg, "w_reg", phase(i, 0.1, 0.5))

  return _made(_weighted(lambda m: sum(getattr(m.cfg, "w_" + k) for k in ("reg",))), host)


def dict_at_computed_key():
  def step(model, opt):
    def fn(x, y):
      out = model(x)
      terms = {"ce": F.cross_entropy(out, y), "reg": reg_of(out)}
      loss = sum(LW[k] * terms[k] for k in ("ce", "reg"))
      return _train(model, opt, loss)

    return fn

  return _made(step, lambda m: lambda i: LW.__setitem__("reg", phase(i, 0.1, 0.5)))


def nested_subscript():
  host = lambda m: lambda i: CONF["loss"].__setitem__("l2", phase(i, 0.1, 0.5))  # noqa: E731
  return _made(_weighted(lambda m: CONF["loss"]["l2"]), host)


def list_item_rebound():
  first = REGS[0]

  def step(model, opt):
    def fn(x, y):
      out = model(x)
      loss = F.cross_entropy(out, y)
      for reg in REGS:
        loss = loss + reg.w * reg_of(out)
      return _train(model, opt, loss)

    return fn

  def host(model):
    other = Reg(0.5)
    return lambda i: REGS.__setitem__(0, phase(i, first, other))

  return _made(step, host)


def forward_hook_added_and_removed():
  def step(model, opt):
    def fn(x, y):
      return _train(model, opt, F.cross_entropy(model(x), y))

    return fn

  def host(model):
    handle = []

    def h(i):
      if i == 6:
        handle.append(model.head.register_forward_hook(lambda mod, args, out: out * 0.5))
      if i == 12:
        handle.pop().remove()

    return h

  return _made(step, host)


def partial_keyword():
  def step(model, opt):
    def fn(x, y):
      out = model(x)
      loss = F.cross_entropy(out, y) + SMOOTH(out, torch.zeros_like(out))
      return _train(model, opt, loss)

    return fn

  return _made(step, lambda m: lambda i: SMOOTH.keywords.__setitem__("beta", phase(i, 1.0, 0.1)))


def numpy_array_in_place():
  host = lambda m: lambda i: W.__setitem__(0, phase(i, 0.1, 0.5))  # noqa: E731
  return _made(_weighted(lambda m: float(torch.from_numpy(W).sum())), host)


def cpu_tensor_filled():
  host = lambda m: lambda i: m.scale.fill_(phase(i, 1.0, 0.25))  # noqa: E731
  return _made(_weighted(lambda m: float(m.scale)), host)


def environment_variable():
  def host(model):
    def h(i):
      if 6 <= i < 12:
        os.environ[ENV] = "0.5"
      else:
        os.environ.pop(ENV, None)

    return h

  return _made(_weighted(lambda m: float(os.environ.get(ENV, "0.1"))), host)


def property_over_private():
  host = lambda m: lambda i: setattr(m, "_progress", phase(i, 1.0, 0.25))  # noqa: E731
  return _made(_weighted(lambda m: m.alpha), host)


TRAINERS = []  # the trainer object of mode_through_an_object, for its host code


def mode_through_an_object():
  def step(model, opt):
    trainer = Trainer(nn.Sequential(model, Halve()))
    TRAINERS[:] = [trainer]

    def fn(x, y):
      return _train(model, opt, F.cross_entropy(trainer.net(x), y))

    return fn

  return _made(step, lambda m: lambda i: TRAINERS[0].net.train(not 6 <= i < 12))


def generator_advanced():
  def step(model, opt):
    betas = iter([0.1 * (k % 3) for k in range(STEPS)])

    def fn(x, y):
      out = model(x)
      return _train(model, opt, F.cross_entropy(out, y) + next(betas) * reg_of(out))

    return fn

  return _made(step, lambda m: lambda i: None)


KL = 0.1  # a global weight, annealed (python -c: the global of `<string>`)


def global_weight():
  def host(model):
    def h(i):
      global KL
      KL = phase(i, 0.1, 0.5)

    return h

  return _made(_weighted(lambda m: KL), host)


MICRO = 0  # the accumulation loop's micro-step counter, updated by its step


def accumulation_counter():
  def step(model, opt):
    def fn(x, y):
      global MICRO
      loss = F.cross_entropy(model(x), y)
      loss.backward()
      MICRO += 1
      if MICRO == 2:
        opt.step()
        opt.zero_grad()
        MICRO = 0
      return loss

    return fn

  return _made(step, lambda m: lambda i: None)


def host_random():
  def step(model, opt):
    def fn(x, y):
      out = model(x)
      loss = F.cross_entropy(out, y)
      if random.random() < 0.5:
        loss = loss + 0.5 * reg_of(out)
      return _train(model, opt, loss)

    return fn

  return _made(step, lambda m: lambda i: None)


USE_REG = False  # a global flag read by a helper, flipped by the host


def _extra(out):
  return reg_of(out) if USE_REG else 0.0


def global_flag():
  def step(model, opt):
    def fn(x, y):
      out = model(x)
      return _train(model, opt, F.cross_entropy(out, y) + _extra(out))

    return fn

  def host(model):
    def h(i):
      global USE_REG
      USE_REG = phase(i, False, True)

    return h

  return _made(step, host)


# name -> (the loop's factory, the most steps of 16 it may trace, or None: any number).
# CONF['loss']['l2'] and the global weight are floats read at a constant path: once one
# changes it is made a program input (hyper.py), confirmed by one more trace when it
# changes again.
LOOPS = {
  "getattr(cfg, 'w_' + name)": (computed_getattr, MAX_TRACED),
  "LW[k] in a loop": (dict_at_computed_key, MAX_TRACED),
  "CONF['loss']['l2']": (nested_subscript, MAX_TRACED + 1),
  "for reg in REGS, REGS[0] rebound": (list_item_rebound, MAX_TRACED),
  "a forward hook added at step 7, removed at 13": (forward_hook_added_and_removed, MAX_TRACED),
  "functools.partial keywords['beta']": (partial_keyword, MAX_TRACED),
  "torch.from_numpy(W), W changed in place": (numpy_array_in_place, MAX_TRACED),
  "float(self.scale), a CPU tensor filled": (cpu_tensor_filled, MAX_TRACED),
  "os.environ.get in the step": (environment_variable, MAX_TRACED),
  "a property over self._progress": (property_over_private, MAX_TRACED),
  "trainer.net.train() / .eval()": (mode_through_an_object, MAX_TRACED),
  "next(betas) in the step": (generator_advanced, None),
  "a global weight": (global_weight, MAX_TRACED + 1),
  "gradient accumulation on a global counter": (accumulation_counter, None),
  "random.random() in the step": (host_random, None),
  "a global flag read by a helper": (global_flag, MAX_TRACED),
}


# -- running and comparing ------------------------------------------------------------------------


def _split(strategy, t):
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: t[ctx.replica_id_in_sync_group * B : (ctx.replica_id_in_sync_group + 1) * B]
  )


def _tensors(loop):
  out = {k: v.detach().cpu() for k, v in loop.model.state_dict().items()}
  params = [p for g in loop.opt.param_groups for p in g["params"]]
  for i, p in enumerate(params):
    for k, v in loop.opt.state.get(p, {}).items():
      if torch.is_tensor(v):
        out[f"opt.{i}.{k}"] = v.detach().cpu()
  return out


def distributed(make):
  """The loop with strategy.run: (losses, tensors, replay counts)."""
  strategy = xd.MirroredStrategy()
  torch.manual_seed(0)
  _runtime.set_seed(0)
  with strategy.scope():
    loop = make()
  losses = []
  for i, (x, y) in enumerate(data()):
    loop.host(i)
    out = strategy.run(loop.step, args=(_split(strategy, x), _split(strategy, y)))
    losses.append(strategy.reduce("mean", out, axis=None).cpu())
  return torch.stack(losses), _tensors(loop), dict(strategy.extended.experimental_replay_counts)


def reference(make):
  """The same loop in plain PyTorch on the CPU, on the global batch."""
  loop = make()
  losses = []
  for i, (x, y) in enumerate(data()):
    loop.host(i)
    losses.append(loop.step(x, y).detach())
  return torch.stack(losses), _tensors(loop)


def _reset():
  global KL, MICRO, USE_REG
  KL, MICRO, USE_REG = 0.1, 0, False
  random.seed(0)
  LW["reg"] = 0.1
  CONF["loss"]["l2"] = 0.1
  REGS[:] = [REGS[0] if isinstance(REGS[0], Reg) and REGS[0].w == 0.1 else Reg(0.1)]
  W[0] = 0.1
  SMOOTH.keywords["beta"] = 1.0
  os.environ.pop(ENV, None)


def compare(name):
  """Runs loop `name` both ways; returns (None or what differs, replay counts)."""
  factory, most = LOOPS[name]
  _reset()
  want_losses, want = reference(factory())
  _reset()
  losses, got, counts = distributed(factory())
  _reset()
  if counts["traced"] + counts["replayed"] != STEPS:
    return f"counted {counts}", counts
  scale = max(want_losses.abs().max().item(), 1e-3)
  err = (losses.double() - want_losses.double()).abs().max().item()
  if err > 1e-4 * scale:
    return f"losses {err:.3g} from the reference (scale {scale:.3g})", counts
  if sorted(got) != sorted(want):
    return f"tensors {sorted(got)} against {sorted(want)}", counts
  for key, w in want.items():
    scale = max(w.abs().max().item(), 1e-3)
    err = (got[key].double() - w.double()).abs().max().item()
    if err > 1e-4 * scale:
      return f"{key} is {err:.3g} from the reference (scale {scale:.3g})", counts
  replay_on = os.environ.get("XLADIST_REPLAY", "1") not in ("0", "off")
  if replay_on and most is not None and counts["traced"] > most:
    return f"traced {counts['traced']} of {STEPS} (at most {most})", counts
  return None, counts


def main(names=None):
  failed = 0
  for name in names or LOOPS:
    why, counts = compare(name)
    failed += why is not None
    state = "ok" if why is None else f"FAIL {why}"
    print(f"LOOP {name} | {state} | traced {counts['traced']} replayed {counts['replayed']}")
  sys.stdout.flush()
  return failed


if __name__ == "__main__":
  sys.exit(1 if main() else 0)
