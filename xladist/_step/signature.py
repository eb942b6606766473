"""What a step's program depends on, as xladist can see it from the host.

A `Signature` is a flat mapping from a readable place ("args[0]['x']",
"Linear.weight", "optimizer 0 group 0 'lr'", "fn's closure 'flag'") to what
re-tracing the step would depend on there: a tensor's shape, dtype and
sharding, a Python value, a module's training flag. Two steps with equal
signatures trace the same program unless `fn` branches on something xladist
does not watch (a value read through another function or object). The
step's *state* (`take_with_state`) adds what its tensors hold as it begins and
joins its program: work traced and not executed yet, writes of sync-on-read
variables outside a step.

Used to explain recompilations (`compile_watch.py`) and to key replayed
programs (`replay.py`, signature only); cheap enough to take at every
`strategy.run` (0.35 ms with the state for a model of 102 parameters with
momentum buffers, whose step traces in 23 ms; checked on XLA:CPU).
"""

import functools
import types
import weakref

import torch

from xladist import runtime as _runtime
from xladist._nest import flatten_with_path
from xladist._step.signature_words import (  # (explain and differences: re-exported)
  _MISSING,
  _SETS_MODES,
  differences,  # noqa: F401
  explain,  # noqa: F401
)
from xladist.replica_copies import copies_of
from xladist.values import DistributedValues, Mirrored, PerReplica

_PLAIN = (bool, int, float, str, bytes, type(None))


def _sharding(t):
  return _runtime.sharding_spec(t)


def _tensor_entry(t):
  return ("tensor", tuple(t.shape), t.dtype, _sharding(t))


def _leaf_entry(x):
  if isinstance(x, torch.Tensor):
    return _tensor_entry(x)
  if isinstance(x, PerReplica):
    if x._values is not None:
      return ("PerReplica", tuple(_leaf_entry(v) for v in x._values))
    if x._stacked is not None:
      return ("PerReplica", _tensor_entry(x._stacked))
    return ("PerReplica", _leaf_entry(x._local))  # made inside a step (merge_call)
  if isinstance(x, Mirrored):
    return ("Mirrored", (_leaf_entry(x._primary),))
  if isinstance(x, DistributedValues):
    return ("object", type(x).__qualname__)
  if isinstance(x, _PLAIN):
    return ("value", x)
  return ("object", type(x).__qualname__)


def _path(prefix, path):
  out = prefix
  for key in path:
    out += f"[{key!r}]"
  return out


def _unwrap(fn):
  """(the object a bound method or callable object belongs to, the Python
  function that runs) for `fn`, a function, bound method, functools.partial or
  callable object."""
  while isinstance(fn, functools.partial):
    fn = fn.func
  self = getattr(fn, "__self__", None)
  func = getattr(fn, "__func__", fn)
  if getattr(func, "__code__", None) is None and callable(fn):
    call = type(fn).__call__  # a callable object's method (a slot wrapper for builtins)
    if getattr(call, "__code__", None) is not None:
      self, func = fn, call
  return self, func


def _names(code):
  """The names `code` and the functions defined in it look up."""
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= _names(const)
  return names


@functools.lru_cache(maxsize=256)
def _sets_modes(code):
  """Whether `code` (or a function defined in it) names `train` or `eval`: the
  same answer at every step of a function, so found once per code object."""
  return not {"train", "eval"}.isdisjoint(_names(code))


def _python_values(fn, out, optimizers):
  """Plain Python values `fn` reads by name: its closure cells and the globals
  its code names (a flag, a counter, a size); the train/eval flags of the
  modules and the optimizers it reaches by name (`optimizers`: id -> optimizer,
  filled here)."""
  self, fn = _unwrap(fn)
  code = getattr(fn, "__code__", None)
  if code is None:
    return
  # A fn that calls .train()/.eval() traces with the modes it sets, not with the
  # ones the previous step left: `explain` leaves those out (replay keys by them).
  if _sets_modes(code):
    out[_SETS_MODES] = ("value", True)
  reached = []  # (label, value) of the objects fn reaches by name
  for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
    try:
      value = cell.cell_contents
    except ValueError:  # an empty cell
      continue
    if isinstance(value, _PLAIN):
      out[ByName(f"fn's closure variable {name!r}")] = ("value", value)
    else:
      reached.append((name, value))
  glob = fn.__globals__
  for name in code.co_names:
    value = glob.get(name, _MISSING)
    if isinstance(value, _PLAIN) and not isinstance(value, types.ModuleType):
      out[ByName(f"global {name!r}")] = ("value", value)
    elif value is not _MISSING:
      reached.append((name, value))
  if self is not None:
    for name, value in getattr(self, "__dict__", {}).items():
      if isinstance(value, _PLAIN):
        out[ByName(f"{type(self).__name__}.{name}")] = ("value", value)
      else:
        reached.append((f"{type(self).__name__}.{name}", value))
  for name, value in reached:
    if isinstance(value, torch.nn.Module):
      _modes(name, value, out)
    elif isinstance(value, torch.optim.Optimizer):
      optimizers.setdefault(id(value), value)


class ByName(str):
  """The label of a plain value `fn` reads by name (a closure cell, a global, an
  attribute of its object): in the signature for explanations, left out of the
  replay key, which guards what the trace read instead (python_effects.py)."""

  __slots__ = ()


def replay_entries(sig):
  """The signature's entries a replay key keeps: all but the values `fn` reads by
  name (`ByName`), which the key's guards from the trace cover. Kept for the last
  dict asked about (`take` gives the same dict while nothing changed): a replayed
  step's key is then hashed in constant time (`Entries`)."""
  last = _LAST_ENTRIES[0]
  if last is not None and last[0] is sig:
    return last[1]
  out = Entries(item for item in sig.items() if type(item[0]) is not ByName)
  _LAST_ENTRIES[0] = (sig, out)
  return out


_LAST_ENTRIES = [None]  # (signature, its Entries)


class Entries(tuple):
  """A tuple of signature entries that hashes once (a replay key is looked up at every
  step; hashing the entries of a large model walked all of them)."""

  def __hash__(self):
    h = self.__dict__.get("hash")
    if h is None:
      h = self.__dict__["hash"] = tuple.__hash__(self)
    return h


def _modes(name, module, out):
  """train()/eval() of a module `fn` reaches by name and of its submodules
  (dropout and batch norm trace differently in each)."""
  cached = _MODES.get(module)
  if cached is None or cached[0] != (name, _STRUCTURE[0]):
    # The submodules without the module itself: a value that held its key
    # would keep the module alive in the weak dictionary.
    subs = [
      (f"{name}.{sub} ({type(m).__name__}) training", m)
      for sub, m in module.named_modules()
      if m is not module
    ]
    cached = _MODES[module] = (
      (name, _STRUCTURE[0]),
      f"{name} ({type(module).__name__}) training",
      subs,
    )
  out[cached[1]] = ("value", module.training)
  for label, m in cached[2]:
    out[label] = ("value", m.training)


# The module trees' labels, found once per structure: torch's global hooks on
# module, parameter and buffer registration (every `module.x = ...` of a Module,
# Parameter or buffer, `register_*`, `load_state_dict(assign=True)`) bump
# _STRUCTURE, which keys the cached layouts below (a signature's labels are
# formatted once, not at every step). Neither cache holds a user's module or
# tensor alive: a module dropped by the user leaves the store (its weak refs).
_STRUCTURE = [0]
_MODES = weakref.WeakKeyDictionary()  # module -> ((name, structure), label, [(label, submodule)])
_LAYOUTS = weakref.WeakKeyDictionary()  # store -> (key, layout): see _layout


def _structure_changed(*args):
  _STRUCTURE[0] += 1


def _watch_structure():
  from torch.nn.modules import module as torch_module

  torch_module.register_module_module_registration_hook(_structure_changed)
  torch_module.register_module_parameter_registration_hook(_structure_changed)
  torch_module.register_module_buffer_registration_hook(_structure_changed)


_watch_structure()


def _layout(store):
  """(the store's live modules, their labels: [(label, [(label.name, is a
  buffer, name)] of its parameters and buffers, {attribute: label.name})]), the
  labels rebuilt when a module is tracked or dropped or any module tree changes."""
  modules = list(store.modules())
  key = (_STRUCTURE[0], tuple(map(id, modules)))
  cached = _LAYOUTS.get(store)
  if cached is not None and cached[0] == key:
    return modules, cached[1]
  layout = []
  for i, module in enumerate(modules):
    label = f"{type(module).__name__}#{i}"
    tensors = [
      (f"{label}.{name}", buffer, name)
      for buffer, kind in ((False, module._parameters), (True, module._buffers))
      for name in kind
    ]
    layout.append((label, tensors, {}))  # {}: labels of its plain attributes
  _LAYOUTS[store] = (key, layout)
  return modules, layout


def _data_only_hash():
  """torch_xla's graph hash of tensors that hold device data only: the same for
  any such tensors, whatever their shapes (checked on torch_xla 2.9)."""
  if not _DATA_ONLY:
    _DATA_ONLY.append(_runtime.graph_hash([torch.zeros(1).to(_runtime.device())]))
  return _DATA_ONLY[0]


_DATA_ONLY = []


def _pending(tensors):
  """("pending", None) when `tensors` hold device data only, else ("pending",
  the hash of the work they hold, traced and not executed yet: it joins the
  next program)."""
  is_dev = _runtime.is_device_tensor
  xla = [t for t in tensors if is_dev(t)]
  if not xla:
    return ("pending", None)
  h = _runtime.graph_hash(xla)
  return ("pending", None if h == _data_only_hash() else h.hex())


# Steps run without a sync between them (experimental_run_steps) hand their
# variables to the next one as work not executed; hashing that work walks the
# whole chain, so it is not hashed.
UNSYNCED = ("pending", "unsynced")


def _tensors(x, into):
  """The XLA tensors behind an argument leaf."""
  if isinstance(x, torch.Tensor):
    into.append(x)
  elif isinstance(x, PerReplica):
    parts = x._values if x._values is not None else (x._stacked, x._local)
    into.extend(part for part in parts if isinstance(part, torch.Tensor))
  elif isinstance(x, Mirrored) and isinstance(x._primary, torch.Tensor):
    into.append(x._primary)


def _number(store, opt):
  """The optimizer's number for `store`: the order in which signatures first saw
  it, by a name fn reads or tracked by the store from its first step() inside
  strategy.run (so the first step's signature and the next one's agree)."""
  numbers = _NUMBERS.get(store)
  if numbers is None:
    numbers = _NUMBERS[store] = weakref.WeakKeyDictionary()
  n = numbers.get(opt)
  if n is None:
    n = numbers[opt] = len(numbers)
  return n


_NUMBERS = weakref.WeakKeyDictionary()  # store -> {optimizer: number}


def _optimizer(label, opt, out, state):
  out[f"{label} ({type(opt).__name__}) state entries"] = ("value", len(opt.state))
  for g, group in enumerate(opt.param_groups):
    for key, value in group.items():
      if key == "params":
        continue
      if type(value) is float:
        out[f"{label} group {g} {key!r}"] = ("hyper", _hyper_class(value))
      elif type(value) is tuple and value and all(type(v) in (float, int) for v in value):
        out[f"{label} group {g} {key!r}"] = ("hyper", tuple(map(_hyper_class, value)))
      elif isinstance(value, _PLAIN):
        out[f"{label} group {g} {key!r}"] = ("value", value)
    out[f"{label} group {g} params"] = ("value", len(group["params"]))
  if state is not None:  # (only a signature with the step's state looks at them)
    for slots in opt.state.values():
      state.extend(v for v in slots.values() if isinstance(v, torch.Tensor))


def _hyper_class(value):
  """What a step's key keeps of a float hyperparameter (replay feeds its value to
  the program, _step/hyper.py): whether it is 0, 1 or another number (optimizers
  branch on `weight_decay != 0`; torch_xla folds 0 and 1 into the graph)."""
  if type(value) is int:
    return ("int", value)
  return value if value in (0.0, 1.0) else "a number"


def take(fn, args, kwargs, store):
  """The signature of `strategy.run(fn, args, kwargs)` for the variables `store`
  tracks (replay, `replay.py`, keys its programs by it): the same dict as the last
  one taken for `store` when it is equal to it (`replay_entries` keeps its entries
  by the dict's identity). Read only."""
  sig = _take(fn, args, kwargs, store, None)
  last = _LAST_TAKEN.get(store)
  if last is not None and last == sig:
    return last
  _LAST_TAKEN[store] = sig
  return sig


_LAST_TAKEN = weakref.WeakKeyDictionary()  # store -> the last signature `take` gave


def take_with_state(fn, args, kwargs, store, synced=True):
  """(signature, state): `state` says what the step's tensors hold as it begins
  that joins its program: work traced and not executed yet, and sync-on-read
  variables written outside a step (spread to their components by the step).
  Not in the signature: replay handles both itself. `synced=False`: no
  torch_xla.sync() ran since the previous step began, so the variables hold its
  work and are not hashed."""
  state = {}
  return _take(fn, args, kwargs, store, state, synced), state


def _take(fn, args, kwargs, store, state, synced=True):
  # Attribute reads of tensors (.grad, .requires_grad) skip torch-function modes
  # (the jax runtime's torchax mode lowers each one as an op).
  with torch._C.DisableTorchFunction():
    return _take_entries(fn, args, kwargs, store, state, synced)


def _take_entries(fn, args, kwargs, store, state, synced):
  out = {}
  _, func = _unwrap(fn)
  code = getattr(func, "__code__", None)
  name = getattr(func, "__qualname__", None) or type(fn).__qualname__
  out["fn"] = ("function", name, id(code))
  optimizers = {}  # id -> optimizer fn reaches by name
  _python_values(fn, out, optimizers)
  arg_tensors, variables, components, slots = [], [], [], []
  for prefix, nest in (("args", tuple(args)), ("kwargs", kwargs)):
    paths, leaves, _ = flatten_with_path(nest)
    for path, leaf in zip(paths, leaves):
      out[_path(prefix, path)] = _leaf_entry(leaf)
      _tensors(leaf, arg_tensors)
  if state is None:
    out.update(_module_entries(store))
  else:
    _module_walk(store, out, state, variables, components)
  for opt in store.optimizers():
    optimizers.setdefault(id(opt), opt)
  listed = list(optimizers.values())
  for n, i in sorted((_number(store, opt), i) for i, opt in enumerate(listed)):
    _optimizer(f"optimizer {n}", listed[i], out, slots if state is not None else None)
  if state is not None:
    state["pending work in the arguments"] = _pending(arg_tensors)
    for group, tensors in (
      ("variables and their gradients", variables),
      ("per-replica components of sync-on-read variables", components),
      ("optimizer state", slots),
    ):
      state[f"pending work in the {group}"] = _pending(tensors) if synced else UNSYNCED
  return out


def _module_walk(store, out, state=None, variables=None, components=None):
  """The entries of the store's modules (their parameters and buffers, their plain
  attributes) into `out`; with `state`, what the tensors hold as well."""
  sharding = _runtime.sharding_spec
  modules, layout = _layout(store)
  for module, (label, tensors, attrs) in zip(modules, layout, strict=True):
    params, buffers = module._parameters, module._buffers
    for where, buffer, name in tensors:
      t = (buffers if buffer else params).get(name)
      if t is None:
        out[where] = ("value", None)
        continue
      grad = t.grad
      out[where] = (  # _tensor_entry(t) and two more fields, in one tuple
        "tensor",
        tuple(t.shape),
        t.dtype,
        sharding(t),
        t.requires_grad,
        None if grad is None else (tuple(grad.shape), grad.dtype),
      )
      if state is None:
        continue
      variables.append(t)
      if grad is not None:
        variables.append(grad)
      copies = copies_of(t)
      if copies is not None:
        components.append(copies.stacked)
        state[f"{where} written outside strategy.run since its last step"] = (
          "value",
          copies.changed(t),
        )
    for name, value in module.__dict__.items():
      if name[:1] != "_" and name != "training" and isinstance(value, _PLAIN):
        where = attrs.get(name)
        if where is None:
          where = attrs[name] = f"{label}.{name}"
        out[where] = ("value", value)


# -- the modules' entries, checked rather than taken again ---------------------------------
#
# A replayed step takes the signature at every `strategy.run`; its modules' part (a
# tuple per parameter and buffer, their plain attributes) is all of its cost that grows
# with the model. `_module_entries` keeps the last part taken for a store with a function
# made for it (`_module_checker`: one straight line of reads and comparisons, the reads
# `_module_walk` makes) that says whether walking again would give the same entries.


class _Modules:
  __slots__ = ("entries", "same")

  def __init__(self, entries, same):
    self.entries, self.same = entries, same


_MODULE_ENTRIES = weakref.WeakKeyDictionary()  # store -> _Modules of its last walk


def _module_entries(store):
  """{label: entry} of the store's modules, as `_module_walk` gives them: the last
  walk's when its checker finds every read the same, else walked again."""
  cached = _MODULE_ENTRIES.get(store)
  if cached is not None and cached.same is not None and cached.same(store):
    return cached.entries
  entries = {}
  _module_walk(store, entries)
  # A checker is made once two walks in a row agree: a part that changes at every
  # step (an attribute counting steps) is walked, not compiled again each time.
  stable = cached is not None and cached.entries == entries
  _MODULE_ENTRIES[store] = _Modules(entries, _module_checker(store, entries) if stable else None)
  return entries


def _module_checker(store, entries):
  """`same(store)`: whether `_module_walk(store)` would give `entries` now. It reads
  what the walk reads: the module tree's structure count and the store's list of
  modules, each tensor's shape, dtype, sharding, requires_grad and gradient, and each
  module's public attributes (the same names, the plain ones equal, the others still
  not plain). It holds neither the store nor a module (by identity number: a module
  made since registers its parameters, which moves the structure count)."""
  env = {"ST": _STRUCTURE, "M": _MISSING, "S": _runtime.sharding_spec, "PLAIN": _PLAIN}
  modules, layout = _layout(store)
  refs = store._modules
  lines = [
    "def same(store):",
    "  R = store._modules",
    f"  if ST[0] != {_STRUCTURE[0]} or len(R) != {len(refs)}:",
    "    return False",
  ]
  alive = [i for i, r in enumerate(refs) if r() is not None]
  if [refs[i]() for i in alive] != modules:
    return lambda store: False  # (the store's list changed while it was read)
  for n, (i, module, (_, tensors, _)) in enumerate(zip(alive, modules, layout)):
    lines.append(f"  m = R[{i}]()")
    lines.append(f"  if m is None or id(m) != {id(module)}:")
    lines.append("    return False")
    if tensors:
      lines.append("  P, B = m._parameters, m._buffers")
    for where, buffer, name in tensors:
      entry = entries[where]
      got = f"{'B' if buffer else 'P'}.get({name!r})"
      if entry == ("value", None):
        lines.append(f"  if {got} is not None:")
        lines.append("    return False")
        continue
      _, shape, dtype, sharding, requires_grad, grad = entry
      k = f"{n}_{len(env)}"
      env[f"sh{k}"], env[f"dt{k}"], env[f"sp{k}"] = shape, dtype, sharding
      lines.append(f"  t = {got}")
      lines.append(
        f"  if t is None or t.shape != sh{k} or t.dtype is not dt{k} or "
        f"t.requires_grad is not {requires_grad} or S(t) != sp{k}:"
      )
      lines.append("    return False")
      if grad is None:
        lines.append("  if t.grad is not None:")
      else:
        env[f"gs{k}"], env[f"gd{k}"] = grad
        lines.append("  g = t.grad")
        lines.append(f"  if g is None or g.shape != gs{k} or g.dtype is not gd{k}:")
      lines.append("    return False")
    public = [
      (name, value)
      for name, value in module.__dict__.items()
      if name[:1] != "_" and name != "training"
    ]
    lines.append("  d = m.__dict__")
    lines.append(f"  if len(d) != {len(module.__dict__)}:")
    lines.append("    return False")
    for name, value in public:
      if isinstance(value, _PLAIN):
        k = f"v{n}_{len(env)}"
        env[k] = ("value", value)
        lines.append(f"  if ('value', d.get({name!r}, M)) != {k}:")
      else:
        lines.append(f"  if isinstance(d.get({name!r}, None), PLAIN) or {name!r} not in d:")
      lines.append("    return False")
  lines.append("  return True")
  exec(compile("\n".join(lines) + "\n", "<xladist signature check>", "exec"), env)  # noqa: S102
  return env["same"]
