"""Optimizer hyperparameters as inputs of a replayed step, not parts of its key.

A float in an optimizer's parameter groups ('lr', 'betas', 'weight_decay',
'momentum', 'eps', ..., set by a `torch.optim.lr_scheduler` or by hand) reaches
a step's program as a scalar: torch_xla passes a Python number to an XLA op as
device data (0 and 1 excepted: those are folded into the graph), the jax
runtime lifts it out of the program text as a constant. The program is the
same whatever the value; only the scalar fed to it differs. So a replayed step
feeds each such scalar its current value, and a schedule neither re-traces nor
recompiles.

Which program scalar is which hyperparameter is found while the step is traced:
every float of the tracked optimizers' groups is swapped for a `Hyper` (a float
that remembers where it came from, and what arithmetic made it: `-lr`,
`1 - beta2`, `lr * weight_decay`, ...) and swapped back when the trace ends.
The host scalars of the optimizers' state (torch's `step` counters, NAdam's
`mu_product`, ASGD's `eta` and `mu`) are swapped too (`_HostScalar`: its `item()`
is a Hyper, its in-place updates extend its expression), so what torch computes
from them in Python is an input as well, and a replay sets them as the step would.
Every host decision the trace takes on a Hyper (a comparison, `bool`, `int`,
`round`, ...) is a guard, checked before each replay (`guards_fail`). After the
trace the program's scalar constants are matched by value to the Hypers torch
functions took (hyper_inputs.py `match`; a torch-function mode notes them). A
scalar that matches no Hyper stays a constant of the program. A match can be a
coincidence (a constant 0.1 of the model when lr is 0.1): it counts as an input
only once two captures that agree saw its value follow the hyperparameter
(`Input.proven`); before that, a replay whose hyperparameter value changed is
traced instead and confirms or corrects it (replay.py).

What the key keeps of a hyperparameter (signature.py): whether it is 0, 1 or
another value (optimizers branch on `weight_decay != 0`; torch_xla folds 0 and
1 into the graph). A value that reaches the program through arithmetic a
`Hyper` does not follow (`float(lr)`, a `math` function imported by name before
the trace) is a plain constant: a
capture that differs from the last in such a constant is not replayed
(replay.py `_differs`), and verification traces catch the rest.
"""

import contextlib
import math
import operator

import torch
from torch.overrides import TorchFunctionMode

from xladist._nest import flatten, unflatten

LEAF, NUMBER, STATE = "leaf", "number", "state"  # an expression's leaves (NUMBER: a Python number)

_recording = [None]  # the list of Hypers made by the step being traced, or None


class Hyper(float):
  """A float of an optimizer's parameter group (or arithmetic on one) while a
  step is traced. `expr`: ("leaf", id(group), key, index) or (op name, *operands)."""

  def __new__(cls, value, expr):
    h = float.__new__(cls, value)
    h.expr = expr
    made = _recording[0]
    if made is not None:
      made.append(h)
    return h

  def __reduce__(self):  # a copy or a pickle is the plain number
    return (float, (float(self),))


def _operand(x):
  if isinstance(x, Hyper):
    return x.expr
  return (NUMBER, float(x))


def _number(x):
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _operand_number(x):
  """Whether a Hyper's arithmetic or comparison takes `x` as a number (a bool
  too, as the float it stands for would: `lr * True`)."""
  return isinstance(x, (int, float))


_BINARY = {
  "add": (operator.add, "+"),
  "sub": (operator.sub, "-"),
  "mul": (operator.mul, "*"),
  "truediv": (operator.truediv, "/"),
  "pow": (operator.pow, "**"),
}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs}


def _binary(name, fn):
  def op(self, other):
    if not _operand_number(other):
      return NotImplemented
    return Hyper(fn(float(self), float(other)), (name, self.expr, _operand(other)))

  def rop(self, other):
    if not _operand_number(other):
      return NotImplemented
    return Hyper(fn(float(other), float(self)), (name, _operand(other), self.expr))

  return op, rop


for _name, (_fn, _) in _BINARY.items():
  _op, _rop = _binary(_name, _fn)
  setattr(Hyper, f"__{_name}__", _op)
  setattr(Hyper, f"__r{_name}__", _rop)


def _pow(self, other, _number_pow=Hyper.__pow__):
  """`beta1 ** step` with a tensor `step` (Adam's capturable bias correction):
  torch_xla folds the base of `pow(Scalar, Tensor)` into the graph as a
  constant, so the base is made a tensor first (device data, an input)."""
  if isinstance(other, torch.Tensor):
    return torch.pow(torch.tensor(self, dtype=other.dtype, device=other.device), other)
  return _number_pow(self, other)


Hyper.__pow__ = _pow
for _name, _fn in _UNARY.items():
  setattr(
    Hyper,
    f"__{_name}__",
    lambda self, _name=_name, _fn=_fn: Hyper(_fn(float(self)), (_name, self.expr)),
  )
del _name, _fn, _op, _rop


# -- guards: host decisions a trace makes on a Hyper ------------------------------------------
#
# A comparison (`rho_t > 5`, `max(1, step - t0)`, `if lr < 0.05:`), `bool`, `int`,
# `round`, `math.floor` / `ceil` / `trunc` of a Hyper gives a plain value that steers
# the trace (a branch, a shape, a constant of the program); a replay is only right
# while it would come out the same. Each is recorded as a guard (expression, result)
# and checked before every replay (`guards_fail`).

_guarding = [None]  # the dict of guards of the step being traced, or None

_COMPARE = {
  "lt": (operator.lt, "<"),
  "le": (operator.le, "<="),
  "gt": (operator.gt, ">"),
  "ge": (operator.ge, ">="),
  "eq": (operator.eq, "=="),
  "ne": (operator.ne, "!="),
}
_TO_PLAIN = {"bool": bool, "int": int, "floor": math.floor, "ceil": math.ceil, "trunc": math.trunc}


def _guard(expr, result):
  guards = _guarding[0]
  if guards is not None:
    guards[expr] = result
  return result


def _comparison(name, fn):
  def op(self, other):
    if not _operand_number(other):
      return NotImplemented
    return _guard((name, self.expr, _operand(other)), fn(float(self), float(other)))

  return op


for _name, (_fn, _) in _COMPARE.items():
  setattr(Hyper, f"__{_name}__", _comparison(_name, _fn))
for _name, _fn in _TO_PLAIN.items():
  setattr(
    Hyper,
    f"__{_name}__",
    lambda self, _name=_name, _fn=_fn: _guard((_name, self.expr), _fn(float(self))),
  )
Hyper.__hash__ = float.__hash__


def _round(self, ndigits=None):
  return _guard(("round", self.expr, ndigits), round(float(self), ndigits))


Hyper.__round__ = _round
del _name, _fn

# `math.sqrt(h)`, `math.exp(h)`, ...: while a step that may be captured is traced, the
# `math` module's functions of one or two numbers follow Hypers (a float subclass
# reaches C as its value: no method of it is called), so `math.sqrt(bias_correction2)`
# is an input of the program, not a constant of it.
_MATH = (
  "sqrt exp log log2 log10 log1p expm1 cos sin tan acos asin atan tanh cosh sinh pow fabs "
  "atan2 hypot copysign"
).split()
_MATH_FNS = {name: getattr(math, name) for name in _MATH}
_math_depth = [0]


def _math_wrapper(name, fn):
  def wrapper(*args):
    if any(isinstance(a, Hyper) for a in args) and all(_number(a) for a in args):
      return Hyper(fn(*(float(a) for a in args)), ("math", name, *map(_operand, args)))
    return fn(*args)

  wrapper.__name__ = name
  return wrapper


_MATH_WRAPPERS = {name: _math_wrapper(name, fn) for name, fn in _MATH_FNS.items()}


@contextlib.contextmanager
def _math_follows_hypers():
  if _math_depth[0] == 0:
    for name, wrapper in _MATH_WRAPPERS.items():
      setattr(math, name, wrapper)
  _math_depth[0] += 1
  try:
    yield
  finally:
    _math_depth[0] -= 1
    if _math_depth[0] == 0:
      for name, fn in _MATH_FNS.items():
        setattr(math, name, fn)


def evaluate(expr, groups):
  """The value of `expr` now (`groups`: id -> parameter group or per-parameter
  state dict). A host scalar (`STATE`) reads its value before the step."""
  kind = expr[0]
  if kind == STATE:
    return float(groups[expr[1]][expr[2]])
  if kind == LEAF:
    value = groups[expr[1]][expr[2]]
    if expr[3] is not None:
      value = value[expr[3]]
    return float(value)
  if kind == NUMBER:
    return expr[1]
  if kind in _UNARY:
    return _UNARY[kind](evaluate(expr[1], groups))
  if kind == "math":
    return _MATH_FNS[expr[1]](*(evaluate(e, groups) for e in expr[2:]))
  if kind in _COMPARE:
    return _COMPARE[kind][0](evaluate(expr[1], groups), evaluate(expr[2], groups))
  if kind in _TO_PLAIN:
    return _TO_PLAIN[kind](evaluate(expr[1], groups))
  if kind == "round":
    return round(evaluate(expr[1], groups), expr[2])
  return _BINARY[kind][0](evaluate(expr[1], groups), evaluate(expr[2], groups))


def places(expr):
  """The hyperparameters and host scalars `expr` reads (its LEAF and STATE nodes)."""
  if expr[0] in (LEAF, STATE):
    yield expr
  elif expr[0] != NUMBER:
    for part in expr[1:]:
      if type(part) is tuple:
        yield from places(part)


def reads_state(exprs):
  """Whether evaluating any of `exprs` reads a host scalar of an optimizer's
  state (a tensor: `runtime.host_work` makes such reads cheap)."""
  return any(p[0] == STATE for e in exprs for p in places(e))


def guards_fail(guards, groups):
  """Words naming the first guard (a host decision of the trace) that would come
  out otherwise now, or None."""
  for expr, result in guards:
    try:
      now = evaluate(expr, groups)
    except (ArithmeticError, ValueError):
      now = None  # (a math domain error now: the decision cannot be the same)
    if now != result:
      return f"a host decision of the trace changed ({describe(expr)} was {result!r}, now {now!r})"
  return None


def describe(expr):
  """An expression in words: "('lr' < 0.05)", "(state['step'] + 1.0)"."""
  kind = expr[0]
  if kind == LEAF:
    return repr(expr[2]) + ("" if expr[3] is None else f"[{expr[3]}]")
  if kind == NUMBER:
    return repr(expr[1])
  if kind == STATE:
    return f"state[{expr[2]!r}]"
  if kind == "math":
    return f"math.{expr[1]}({', '.join(describe(e) for e in expr[2:])})"
  if kind in _COMPARE or kind in _BINARY:
    sign = (_COMPARE.get(kind) or _BINARY[kind])[1]
    return f"({describe(expr[1])} {sign} {describe(expr[2])})"
  if kind == "round":
    return f"round({describe(expr[1])}, {expr[2]})"
  return f"{kind}({describe(expr[1])})"


# -- the trace: swap the floats in, and back --------------------------------------------------


class Swapped:
  """The groups whose floats are Hypers during one traced step (`active`: only
  for a step whose program may be captured; otherwise nothing is swapped)."""

  def __init__(self, active=True, carried=None):
    self.active = active
    self.groups = {}  # id(group) -> group
    self.saved = []  # (group, key, original value, the Hyper or tuple put in)
    self.made = []  # every Hyper made while the step was traced
    self.used = {}  # id -> the Hypers passed to a torch function (`recording`)
    self.guards = {}  # expression -> the plain value the trace took from it
    # (id(state), key) -> the host scalar put in (its `expr`: its value now, in
    # terms of the values before the step). `carried`: the expressions the steps
    # before this one left (experimental_run_steps' steps traced as one program).
    self.scalars = {}
    self.carried = carried if carried is not None else {}

  @classmethod
  def merged(cls, parts):
    """One record of several traced steps (experimental_run_steps' group)."""
    out = cls()
    for part in parts:
      out.groups.update(part.groups)
      out.made.extend(part.made)
      out.used.update(part.used)
      out.guards.update(part.guards)
      out.scalars.update(part.scalars)
    return out

  def swap(self, optimizer):
    """Swaps the floats of `optimizer`'s groups for Hypers, and the host scalars
    of its state (torch's step counters, NAdam's `mu_product`) for `_HostScalar`s
    (once per group and state)."""
    if not self.active:
      return
    for state in optimizer.state.values():
      sid = id(state)
      if sid in self.groups:
        continue
      for key, value in list(state.items()):
        if _is_host_scalar(value):
          scalar = value.as_subclass(_HostScalar)
          scalar.expr = self.carried.get((sid, key), (STATE, sid, key))
          self.saved.append((state, key, value, scalar))
          self.scalars[(sid, key)] = scalar
          state[key] = scalar
          self.groups[sid] = state
    for group in optimizer.param_groups:
      gid = id(group)
      if gid in self.groups:
        continue
      self.groups[gid] = group
      for key, value in list(group.items()):
        if key == "params":
          continue
        if _number(value) and isinstance(value, float):
          new = Hyper(value, (LEAF, gid, key, None))
        elif type(value) is tuple and value and all(_number(v) for v in value):
          new = tuple(
            Hyper(v, (LEAF, gid, key, i)) if isinstance(v, float) else v
            for i, v in enumerate(value)
          )
        else:
          continue
        self.saved.append((group, key, value, new))
        group[key] = new

  def swap_value(self, namespace, key):
    """Swaps the float at `namespace[key]` (a module's globals, an object's
    `__dict__`, a dict a step reads) for a Hyper: a value the step reads that
    changed between steps (python_effects.py) is fed to the program as an
    optimizer's hyperparameter is."""
    value = namespace.get(key)
    if not self.active or type(value) is not float:
      return
    gid = id(namespace)
    self.groups.setdefault(gid, namespace)
    new = Hyper(value, (LEAF, gid, key, None))
    self.saved.append((namespace, key, value, new))
    namespace[key] = new

  def __enter__(self):
    self._outer = _recording[0], _guarding[0]
    if self.active:
      _recording[0], _guarding[0] = self.made, self.guards
      self._math = _math_follows_hypers()
      self._math.__enter__()
    else:
      _recording[0] = self.made
    return self

  def __exit__(self, *exc):
    _recording[0], _guarding[0] = self._outer
    if self.active:
      self._math.__exit__(*exc)
    self.restore()
    return False

  def updates(self):
    """The host scalars the step changed: {(id(state), key): expression of the new
    value}, None for one whose new value is not an expression of the values
    before the step (an untracked write)."""
    return {
      place: None if scalar.expr is _UNTRACKED else scalar.expr
      for place, scalar in self.scalars.items()
      if scalar.expr != self.carried.get(place, (STATE, *place))
    }

  def recording(self):
    """A torch-function mode that notes every Hyper passed to a torch function
    while `fn` runs: the values a program's scalars can be (a Hyper used only
    to make another, `weight_decay` in `1 - lr * weight_decay`, is not one)."""
    return _Uses(self.used) if self.active else contextlib.nullcontext()

  def candidates(self):
    """The Hypers a program scalar is matched against: those torch functions
    took (all the step made when none was seen)."""
    return list(self.used.values()) or self.made

  def restore(self):
    """Puts the original floats back; a value set during the step (a scheduler
    stepped inside it) is kept, as a plain float."""
    for group, key, value, new in self.saved:
      now = group.get(key)
      if now is new:
        group[key] = value
      elif isinstance(now, Hyper):
        group[key] = float(now)
      elif type(now) is tuple and any(isinstance(v, Hyper) for v in now):
        group[key] = tuple(float(v) if isinstance(v, Hyper) else v for v in now)
    self.saved = []


def plain(result):
  """`result` with every Hyper leaf a plain float (what a traced step returns)."""
  leaves, spec = flatten(result)
  if not any(isinstance(x, Hyper) for x in leaves):
    return result
  return unflatten(spec, [float(x) if isinstance(x, Hyper) else x for x in leaves])


def _is_host_scalar(value):
  """A host scalar of an optimizer's state (the `step` counter of torch's default
  Adam, AdamW, Adagrad, RAdam, NAdam; NAdam's `mu_product`): a float CPU scalar
  that torch's step reads with `item()` and updates in place."""
  return (
    isinstance(value, torch.Tensor)
    and not isinstance(value, _HostScalar)
    and value.device.type == "cpu"
    and value.dim() == 0
    and value.is_floating_point()
  )


_UNTRACKED = ("untracked",)
_INPLACE = {
  "__iadd__": "add",
  "add_": "add",
  "__isub__": "sub",
  "sub_": "sub",
  "__imul__": "mul",
  "mul_": "mul",
  "__itruediv__": "truediv",
  "div_": "truediv",
}
_OTHER_INPLACE = ("__ipow__", "__imod__", "__ifloordiv__", "__iand__", "__ior__", "__ixor__")


def _in_place(name):
  return (
    name in _INPLACE
    or name in _OTHER_INPLACE
    or (name.endswith("_") and not name.startswith("_") and name != "requires_grad_")
  )


def _scalar_expr(value):
  """The expression of an operand of a host scalar's update, or None."""
  if isinstance(value, Hyper):
    return value.expr
  if isinstance(value, _HostScalar):
    return value.expr
  if _number(value):
    return (NUMBER, float(value))
  if (
    type(value) is torch.Tensor
    and value.device.type == "cpu"
    and value.dim() == 0
    and value.is_floating_point()
  ):
    # A host scalar made from plain numbers (ASGD's `torch.as_tensor(1 / max(1,
    # step - t0))` while the `max` picks the 1: the comparison is a guard).
    return (NUMBER, float(value.item()))
  return None


class _HostScalar(torch.Tensor):
  """A host scalar of an optimizer's state while a step is traced. `expr`: its
  value as an expression of the values before the step and the hyperparameters;
  in-place arithmetic (`step_t += 1`, `mu_product *= mu`) and `copy_` extend it,
  and `item()` is a Hyper of it. A replayed step feeds what torch computes from
  it on the host as inputs, and sets it to the expression's value (replay.py)."""

  expr = _UNTRACKED
  _xladist_host_rules = True  # runtime/torchax_fixes.py: run these rules on jax too

  def item(self):
    return Hyper(torch.Tensor.item(self.as_subclass(torch.Tensor)), self.expr)

  @classmethod
  def __torch_function__(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    name = getattr(func, "__name__", None) or ""
    target = args[0] if args else None
    update = isinstance(target, _HostScalar) and _in_place(name)
    new = _UNTRACKED
    if update:
      other = args[1] if len(args) == 2 else None
      if name in _INPLACE and other is not None and set(kwargs) <= {"alpha"}:
        operand, alpha = _scalar_expr(other), kwargs.get("alpha", 1)
        if operand is not None and _number(alpha):
          if alpha != 1:
            operand = ("mul", operand, (NUMBER, float(alpha)))
          new = (_INPLACE[name], target.expr, operand)
      elif name in ("copy_", "fill_") and other is not None and not kwargs:
        new = _scalar_expr(other) or _UNTRACKED
      elif name == "zero_" and len(args) == 1:
        new = (NUMBER, 0.0)
    if update:
      plain = [a.as_subclass(torch.Tensor) if isinstance(a, _HostScalar) else a for a in args]
    else:
      # A host scalar as an operand of another op (ASGD's `mul_(mu)` of a device
      # tensor): its value as a Hyper, so the program takes it as an input.
      plain = [
        a
        if not isinstance(a, _HostScalar)
        else (a.item() if i > 0 else a.as_subclass(torch.Tensor))
        for i, a in enumerate(args)
      ]
    with torch._C.DisableTorchFunctionSubclass():
      out = func(*plain, **kwargs)
    if update:
      target.expr = new
      return target
    return out


_FACTORIES = (torch.as_tensor, torch.tensor, torch.scalar_tensor)


class _Uses(TorchFunctionMode):
  def __init__(self, used):
    super().__init__()
    self.used = used

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if func in _FACTORIES and args and isinstance(args[0], Hyper):
      # `torch.as_tensor(lr / (...))` on the host (ASGD's new `eta`): a host
      # scalar of that expression, so a `copy_` of it into state is followed.
      out = func(*args, **kwargs)
      if out.device.type == "cpu" and out.dim() == 0 and out.is_floating_point():
        out = out.as_subclass(_HostScalar)
        out.expr = args[0].expr
      return out
    for i, value in enumerate((*args, *kwargs.values())):
      if isinstance(value, Hyper):
        self.used[id(value)] = value
      elif isinstance(value, _HostScalar) and i > 0:
        h = value.item()  # an operand: it enters the op as a scalar (`_HostScalar`)
        self.used[id(h)] = h
      elif type(value) in (tuple, list):
        for v in value:
          if isinstance(v, Hyper):
            self.used[id(v)] = v
    return func(*args, **kwargs)
