"""After a step's trace: which scalars of its program are optimizer hyperparameters
(hyper.py's expressions), and what a step must not change in the optimizers' groups.

A program scalar is matched by value to the Hypers torch functions took while the
step was traced (`match`): its candidates are the distinct expressions whose value,
in the scalar's dtype, equals it. Two captures of one key agree when each input keeps
a candidate both saw (`compatible`); the later one keeps the common candidates and
is proven when its value changed with them (`agree`). Inputs with the same
candidates share one tuple of them, so a replay evaluates each set once (`evaluator`,
one generated function for all of a program's inputs; `Input.current` is one input's
value, its memo the same sharing): every parameter's bias correction matches every
parameter's step counter.
"""

import numpy as np
import torch

from xladist._step.hyper import _number, describe, evaluate, places
from xladist._step.hyper_compile import compiled


class Input:
  """A scalar of a captured program that is a hyperparameter (or arithmetic on
  some): its candidate expressions (equal values at the capture), dtype, the
  value it had, and whether two agreeing captures saw it follow them."""

  __slots__ = ("exprs", "dtype", "value", "proven", "placed", "origin")

  def __init__(self, exprs, dtype, value):
    self.exprs, self.dtype, self.value = exprs, dtype, value
    self.proven = False
    self.placed = None  # (value, the runtime's scalar holding it)
    self.origin = None  # the capture's constant entry (handle, scalar) it was matched from

  def names(self):
    """The hyperparameters the input is made of, as "'lr', 'betas'[0]"."""
    return ", ".join(dict.fromkeys(describe(p) for e in self.exprs for p in places(e)))

  def current(self, groups, memo=None):
    """The value now (in the program's dtype), or None when the candidates
    that were equal at the capture differ now. `memo` (one per replay): inputs
    that share their candidates (every parameter's bias correction matches every
    parameter's step counter: n inputs of n candidates) evaluate them once."""
    key = (id(self.exprs), self.dtype)
    if memo is not None and key in memo:
      return memo[key]
    values = {_cast(evaluate(e, groups), self.dtype) for e in self.exprs}
    value = values.pop() if len(values) == 1 else None
    if memo is not None:
      memo[key] = value
    return value


def evaluator(inputs):
  """`fn(groups) -> [value or None]`: each input's `current` value, all of them in one
  call (one generated function evaluates every distinct candidate once: a replay
  evaluates its hyperparameters at every step, issue 61)."""
  spans, where, exprs = [], {}, []
  for h in inputs:
    key = (id(h.exprs), h.dtype)
    if key not in where:
      where[key] = len(spans)
      spans.append((len(exprs), len(exprs) + len(h.exprs), h.dtype))
      exprs.extend(h.exprs)
  order = [where[(id(h.exprs), h.dtype)] for h in inputs]
  raw = compiled(exprs)

  def values(groups):
    got = raw(groups)
    out = []
    for a, b, dtype in spans:
      value = _cast(got[a], dtype)
      for i in range(a + 1, b):
        if _cast(got[i], dtype) != value:
          value = None  # candidates equal at the capture differ now
          break
      out.append(value)
    return [out[i] for i in order]

  return values


_NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}


def _cast(value, dtype):
  """`value` rounded to `dtype`, as a Python float (numpy where it has the dtype:
  this runs for every hyperparameter input of every replayed step)."""
  if dtype is None:
    return value
  to = _NUMPY.get(dtype)
  if to is not None:
    return float(to(value))
  return torch.tensor(value, dtype=dtype).item()


def match(scalars, made):
  """For each program scalar (value, torch dtype), the `Input` it is, or None.

  `made`: the Hypers the traced step made. Candidates are the distinct
  expressions whose value, in the scalar's dtype, equals it."""
  by_dtype = {}
  shared = {}  # (dtype, value) -> one tuple of candidates, shared by its inputs
  out = []
  for value, dtype in scalars:
    if dtype is None or not dtype.is_floating_point:
      out.append(None)
      continue
    table = by_dtype.get(dtype)
    if table is None:
      table = by_dtype[dtype] = {}
      for h in made:
        table.setdefault(_cast(float(h), dtype), {}).setdefault(h.expr, None)
    exprs = table.get(value)
    if not exprs:
      out.append(None)
      continue
    if (dtype, value) not in shared:
      shared[(dtype, value)] = tuple(exprs)
    out.append(Input(shared[(dtype, value)], dtype, value))
  return out


def compatible(old, new):
  """Whether two captures' hyperparameter inputs can be the same: each input has
  a candidate expression both captures saw (equal values at each capture)."""
  checked = {}
  for a, b in zip(old, new):
    if (a is None) != (b is None):
      return False
    if a is not None:
      pair = (id(a.exprs), id(b.exprs))
      if pair not in checked:
        checked[pair] = not set(a.exprs).isdisjoint(b.exprs)
      if not checked[pair]:
        return False
  return True


def agree(old, new):
  """Narrows each input of `new` to the candidates both captures saw, and marks
  it proven when it was proven in `old` or its value changed between the two
  captures (which agree in everything else): a coincidence of values at one
  capture (lr equal to another group's lr) is gone once they part."""
  narrowed = {}  # (id of old candidates, id of new) -> the common ones, shared
  for a, b in zip(old, new):
    if a is not None and b is not None:
      pair = (id(a.exprs), id(b.exprs))
      if pair not in narrowed:
        seen = set(a.exprs)
        narrowed[pair] = tuple(e for e in b.exprs if e in seen) or b.exprs
      b.exprs = narrowed[pair]
      b.proven = a.proven or a.value != b.value


def group_values(optimizers):
  """The plain values of the optimizers' groups (what a step must not change)."""
  return [
    (i, g, key, value)
    for i, opt in enumerate(optimizers)
    for g, group in enumerate(opt.param_groups)
    for key, value in group.items()
    if key != "params" and (_number(value) or type(value) is tuple)
  ]


def group_change(optimizers, before, after):
  """Words naming the first parameter-group value the step changed, or None."""
  if before == after:
    return None
  old = {p[:3]: p[3] for p in before}
  for i, g, key, value in after:
    if old.get((i, g, key), value) != value:
      name = type(optimizers[i]).__name__
      return (
        f"the step changed {name}.param_groups[{g}][{key!r}] ({old[(i, g, key)]!r} -> "
        f"{value!r}): a replayed step runs no Python, so a learning-rate scheduler "
        "stepped inside fn would stop; call scheduler.step() after strategy.run"
      )
  return "the step changed an optimizer's parameter groups"
