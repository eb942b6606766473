"""Replay's view of a step's state: where it lives, and what a capture's key depends on.

A *slot* is one place a step's state lives between steps (a variable, its
gradient, a sync-on-read variable's per-replica components, an optimizer state
entry, a tensor hyperparameter, a device tensor `fn` reads by name); a capture
maps a program's inputs and outputs to slots. The *refs* are the identities a
captured program's mapping assumes (of the objects `fn` reads by name, of the
non-tensor arguments, of the variables, optimizers and their state): part of
the replay key (replay.py). Host state (Python numbers in optimizer state) is
listed so that a step changing it is refused, or, for step counters, replayed
by adding to them (hyper.py).
"""

import torch

from xladist import runtime as _runtime
from xladist.replica_copies import copies_of
from xladist.sharded_state import grad_between_steps, set_grad_between_steps
from xladist.values import DistributedValues

PLAIN = (bool, int, float, str, bytes, type(None))


# -- slots: where a step's state lives between steps ----------------------------------------

VAR, GRAD, COPIES, OPT, GROUP, FREE = range(6)


class _Slot:
  """One place a state tensor lives: a variable (its `.data`), its `.grad`, a
  sync-on-read variable's components, `optimizer.state[param][key]`, a tensor
  in a parameter group, or an XLA tensor `fn` reads by name (FREE: a closure
  cell, a global, an attribute of its object; read afresh at every replay, so
  that an in-place update between steps is seen)."""

  __slots__ = ("kind", "tensor", "owner", "key", "describe")

  def __init__(self, kind, tensor, owner=None, key=None, describe=None):
    self.kind, self.tensor, self.owner, self.key, self.describe = kind, tensor, owner, key, describe

  def ident(self):
    return (self.kind, id(self.tensor), id(self.owner), self.key)

  def get(self, settle=True):
    kind = self.kind
    if kind == VAR:
      return self.tensor
    if kind == GRAD:
      return grad_between_steps(self.tensor)
    if kind == COPIES:
      copies = copies_of(self.tensor)
      if copies is None:
        return None
      return copies.current(self.tensor, self.describe) if settle else copies.stacked
    if kind == OPT:
      state = self.owner.get(self.tensor)
      return None if state is None else state.get(self.key)
    if kind == FREE:
      value = self.owner.cell_contents if self.key is None else self.owner.get(self.key)
      return value if value is self.tensor else None
    return self.owner.get(self.key)

  def set(self, value):
    kind = self.kind
    if kind == VAR:
      self.tensor.data = value
    elif kind == GRAD:
      set_grad_between_steps(self.tensor, value)
    elif kind == COPIES:
      copies_of(self.tensor).stacked = value
    elif kind == OPT:
      self.owner[self.tensor][self.key] = value
    elif kind == FREE:
      self.tensor.data = value
    else:
      self.owner[self.key] = value


def state_slots(store):
  """Every slot of `store`'s variables and tracked optimizers, in a stable order."""
  out = []
  seen = set()
  describe = store.describe
  for t in store.variables():
    if id(t) in seen:
      continue
    seen.add(id(t))
    out.append(_Slot(VAR, t))
    if grad_between_steps(t) is not None:
      out.append(_Slot(GRAD, t))
    if copies_of(t) is not None:
      out.append(_Slot(COPIES, t, describe=describe))
  for opt in store.optimizers():
    for group in opt.param_groups:
      for key, v in group.items():
        if key != "params" and isinstance(v, torch.Tensor) and _runtime.is_device_tensor(v):
          out.append(_Slot(GROUP, None, group, key))
    for p, state in opt.state.items():
      for key, v in state.items():
        if isinstance(v, torch.Tensor) and _runtime.is_device_tensor(v):
          out.append(_Slot(OPT, p, opt.state, key))
  return out


def _is_xla_tensor(value):
  return isinstance(value, torch.Tensor) and _runtime.is_device_tensor(value)


def free_slots(fn):
  """FREE slots: the XLA tensors `fn` reads by name (see `_Slot`)."""
  out = []
  bound = getattr(fn, "__self__", None)
  f = getattr(fn, "__func__", fn)
  code = getattr(f, "__code__", None)
  if code is None:
    return out
  for cell in f.__closure__ or ():
    try:
      value = cell.cell_contents
    except ValueError:
      continue
    if _is_xla_tensor(value):
      out.append(_Slot(FREE, value, cell))
  glob = f.__globals__
  for name in code.co_names:
    value = glob.get(name)
    if _is_xla_tensor(value):
      out.append(_Slot(FREE, value, glob, name))
  if bound is not None:
    attrs = getattr(bound, "__dict__", {})
    for name, value in attrs.items():
      if _is_xla_tensor(value):
        out.append(_Slot(FREE, value, attrs, name))
  return out


def read_slots(locations):
  """FREE slots: the device tensors the traces of a step read through an object, a
  dict or a global (read_guards.Location, found by python_effects.Recorder), read
  afresh at every replay like those `fn` reads by name."""
  out = []
  for loc in locations:
    if loc.kind == "cell":
      fn = loc.owner
      value = loc.read()
      if fn is not None and _is_xla_tensor(value):
        out.append(_Slot(FREE, value, fn.__closure__[loc.name]))
      continue
    namespace = loc.namespace()
    if namespace is not None:
      value = namespace.get(loc.name)
      if _is_xla_tensor(value):
        out.append(_Slot(FREE, value, namespace, loc.name))
  return out


def host_state(store):
  """What a step could change in optimizers outside the XLA device: host tensors
  (by identity and version) and Python values in their state."""
  out = []
  for i, opt in enumerate(store.optimizers()):
    for p_index, state in enumerate(opt.state.values()):
      for key, v in state.items():
        if isinstance(v, torch.Tensor):
          if not _runtime.is_device_tensor(v):
            value = float(v) if v.dim() == 0 and v.is_floating_point() else None
            out.append(((i, p_index, key), (id(v), v._version, value)))
        elif isinstance(v, PLAIN):
          out.append(((i, p_index, key), v))
        else:
          out.append(((i, p_index, key), id(v)))
  return out


def host_change(store, before, after, updates):
  """(words naming the first host-side optimizer state a step changed in a way a
  replay cannot repeat, or None; the host scalars it updated: [(state dict, key,
  expression of the new value)]).

  `updates` (hyper.Swapped.updates): the host scalars of the optimizers' state
  (torch's `step` counters, NAdam's `mu_product`) whose in-place updates the trace
  followed: a replayed step sets each to its expression's value, computed from
  the values before the step (hyper.py)."""
  if before == after:
    return None, []
  old = dict(before)
  optimizers = list(store.optimizers())
  states = [list(opt.state.values()) for opt in optimizers]
  changed = []
  for place, value in after:
    was = old.get(place, _MISSING)
    if was == value:
      continue
    i, p_index, key = place
    state = states[i][p_index]
    expr = updates.get((id(state), key))
    if type(was) is tuple and type(value) is tuple and value[0] == was[0] and expr is not None:
      changed.append((state, key, expr))
      continue
    name = type(optimizers[i]).__name__
    return (
      f"{name} keeps state[...][{key!r}] outside the XLA device and the step changes it "
      "in a way replay cannot repeat (a Python value, or a host tensor written by an op "
      "xladist does not follow): its steps are traced every time; keep that state in a "
      "tensor on the device to replay them"
    ), changed
  return None, changed


_MISSING = object()


# -- the key: what a program's capture depends on -------------------------------------------


def _ref(value, depth=0):
  if isinstance(value, PLAIN):
    return value
  if depth < 2 and type(value) is tuple:
    return tuple(_ref(v, depth + 1) for v in value)
  return ("id", id(value))


def fn_refs(fn):
  """What `fn` starts from that its trace's guards do not see: its code, its
  bound object and its default arguments (its frame's own locals). Its closure
  cells and globals are guarded from the trace (python_effects.py)."""
  out = []
  bound = getattr(fn, "__self__", None)
  if bound is not None:
    out.append(id(bound))
  f = getattr(fn, "__func__", fn)
  code = getattr(f, "__code__", None)
  if code is None:
    return (id(fn),)
  out.append(id(code))
  for value in f.__defaults__ or ():
    out.append(_ref(value))
  if f.__kwdefaults__:
    out.extend(_ref(v) for v in f.__kwdefaults__.values())
  return tuple(out)


def store_refs(store):
  """Identities of the variables and optimizers (a new Parameter object after
  `load_state_dict(assign=True)`, a replaced optimizer state after
  `optimizer.load_state_dict`, new parameter groups)."""
  variables = tuple(map(id, store.variables()))
  optimizers = []
  for opt in store.optimizers():
    host = tuple(
      (id(v), v._version)
      for g in opt.param_groups
      for k, v in g.items()
      if k != "params" and isinstance(v, torch.Tensor) and not _runtime.is_device_tensor(v)
    )
    optimizers.append((id(opt), id(opt.state), tuple(map(id, opt.param_groups)), host))
  return variables, tuple(optimizers)


def arg_refs(leaves):
  return tuple(
    id(x) for x in leaves if not isinstance(x, (torch.Tensor, DistributedValues) + PLAIN)
  )
