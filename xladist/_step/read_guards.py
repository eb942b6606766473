"""Where a step's reads live, read again before each replay: the replay guard.

`python_effects.Recorder` finds what a traced step's Python read; each place is a
`Location` (a module's global, a function's closure cell, an attribute of an
object, a dict's item) read again without running code (`static_get`). `Watched`
keeps the locations the traces of one step function read and makes the last part
of its replay key from their values (replay.py): a plain value by value, another
object by identity, a float that changed between steps by its class (0, 1 or
another number: it is a program input, hyper.py). The key is first checked by a
function made for the last key's values (`_checker`).

A container whose value leaves the path it was read by (passed to a call,
iterated, indexed by a computed key: code xladist cannot see may read any part
of it) is guarded by its content (`content`): a "content" location on the
container itself. So are the attributes of an object read by a computed name
("attrs": `getattr(cfg, "w_" + name)`) and the train/eval flag and hooks of every
module the step runs ("module"). The torch modes a trace depends on (grad mode,
autocast, default dtype, deterministic algorithms, global module hooks) are a
part of the key of their own (`torch_modes`).
"""

import builtins
import collections
import functools
import os
import sys
import types
import weakref

import torch

_PLAIN = (bool, int, float, str, bytes, type(None))
MISSING = object()  # no value there
SKIP = object()  # an attribute found but not guarded (a method, a descriptor)


# -- locations: where a read value lives, read again before each replay ----------------------


class Location:
  """One place the trace read a value from: (kind, owner, name) with kind
  "global" (owner: a module's globals), "cell" (owner: the function whose
  closure holds it; name: the cell's index), "attr" (owner: an object),
  "item" (owner: a dict), or one guarded by content: "content" (owner: a
  container, guarded by what it holds), "attrs" (owner: an object, guarded by
  its attributes), "module" (owner: an nn.Module, guarded by its train/eval
  flag and its hooks). The owner is held weakly where it can be (a model
  the user lets go of is freed)."""

  __slots__ = ("kind", "_owner", "_weak", "_id", "name", "label", "by_value")

  def __init__(self, kind, owner, name, label, by_value):
    self.kind, self.name, self.label, self.by_value = kind, name, label, by_value
    self._id = id(owner)
    try:
      self._owner, self._weak = weakref.ref(owner), True
    except TypeError:
      self._owner, self._weak = owner, False

  @property
  def owner(self):
    return self._owner() if self._weak else self._owner

  def ident(self):
    return (self.kind, self._id, self.name)

  def read(self):
    kind, owner, name = self.kind, self.owner, self.name
    if owner is None and self._weak:
      return MISSING
    if kind == "cell":
      try:
        return owner.__closure__[name].cell_contents
      except (ValueError, IndexError, TypeError):
        return MISSING
    if kind == "global":
      value = owner.get(name, MISSING)
      return builtins.__dict__.get(name, MISSING) if value is MISSING else value
    if kind == "item":
      return owner.get(name, MISSING) if isinstance(owner, dict) else MISSING
    if kind in BY_CONTENT:
      return owner
    return static_get(owner, name)

  def key(self, value):
    """What the replay key keeps of `value`: the value itself when plain, its
    content for the content kinds, else the object's identity."""
    if self.kind in BY_CONTENT:
      return guarded_content(self.kind, value)
    if self.by_value and _plain(value):
      return (type(value), value)
    return _Same(value)

  def namespace(self):
    """The dict this location's value lives in (for a float made a program
    input, hyper.py), or None."""
    if self.kind in ("global", "item"):
      return self.owner
    if self.kind == "attr":
      d = getattr(self.owner, "__dict__", None)
      if isinstance(d, dict) and self.name in d:
        return d
    return None


class _Same:
  """An object in the replay key, equal to another only when it is the same
  live object (held weakly where it can be, else held, so that its identity
  is not reused)."""

  __slots__ = ("_ref", "_id", "_name", "__weakref__")

  def __init__(self, obj):
    self._id, self._name = id(obj), type(obj).__name__
    try:
      self._ref = weakref.ref(obj)
    except TypeError:
      self._ref = lambda obj=obj: obj

  def __eq__(self, other):
    if type(other) is not _Same or other._id != self._id:
      return False
    obj = self._ref()
    return obj is not None and other._ref() is obj

  def __hash__(self):
    return self._id

  def __repr__(self):
    return f"<{self._name} object at {self._id:#x}>"


# -- guards by content ---------------------------------------------------------------------------

BY_CONTENT = ("content", "attrs", "module")  # the kinds guarded by content
CONTENT_TYPES = (list, tuple, dict, set, frozenset, collections.deque, bytearray, os._Environ,
                 functools.partial)  # fmt: skip
_ITEMS = 10_000  # the most items (all levels) a content guard reads
_ARRAY_BYTES = 1 << 20  # the largest numpy array or CPU tensor guarded by content
_MODULE_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


class Unguardable(Exception):
  """A value too large (or of a kind) xladist cannot guard by content."""


def by_content(value):
  """Whether a value read by the step is guarded by its content when it leaves
  its access path: a container, a partial, os.environ, a numpy array or a CPU tensor."""
  if isinstance(value, CONTENT_TYPES):
    return True
  if isinstance(value, torch.Tensor):
    return type(value) is torch.Tensor and value.device.type == "cpu"
  np = sys.modules.get("numpy")
  return np is not None and isinstance(value, np.ndarray)


def content(value):
  """A hashable copy of what `value` holds: plain values by value, containers
  item by item (nested), numpy arrays and CPU tensors by their bytes, other
  objects by identity. Raises Unguardable past _ITEMS items or _ARRAY_BYTES."""
  return _content(value, [_ITEMS], 0)


def _content(v, budget, depth):
  budget[0] -= 1
  if budget[0] < 0 or depth > 12:
    raise Unguardable(f"holds more than {_ITEMS} items or nests more than 12 deep")
  t = type(v)
  if t in _PLAIN:
    return (t, v)
  if isinstance(v, float):  # a Hyper (hyper.py) while traced: the number it stands for
    return (float, float(v))
  if isinstance(v, (list, tuple, collections.deque)):
    return (t, tuple(_content(x, budget, depth + 1) for x in v))
  if isinstance(v, dict):
    return (t, tuple((_content(k, budget, depth + 1), _content(x, budget, depth + 1))
                     for k, x in list(v.items())))  # fmt: skip
  if isinstance(v, (set, frozenset)):
    return (t, frozenset(_content(x, budget, depth + 1) for x in v))
  if isinstance(v, bytearray):
    return (t, bytes(v))
  if isinstance(v, os._Environ):
    return (t, tuple(sorted(v._data.items())))
  if isinstance(v, functools.partial):
    inner = (_content(v.args, budget, depth + 1), _content(v.keywords, budget, depth + 1))
    return (t, _Same(v.func), inner)
  np = sys.modules.get("numpy")
  if np is not None and isinstance(v, np.ndarray):
    if v.nbytes > _ARRAY_BYTES:
      raise Unguardable(f"a numpy array of {v.nbytes} bytes (guarded up to {_ARRAY_BYTES})")
    return (t, v.dtype.str, v.shape, v.tobytes())
  if isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_sparse:
    size = v.numel() * v.element_size()
    if size > _ARRAY_BYTES:
      raise Unguardable(f"a CPU tensor of {size} bytes (guarded up to {_ARRAY_BYTES})")
    raw = v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return (torch.Tensor, str(v.dtype), tuple(v.shape), raw)
  return _Same(v)


def module_state(module, training=None):
  """What the step's program depends on in a module it runs that its parameters
  do not hold: the train/eval flag (`training` when given: the flag as a step
  found it before setting it), its submodules and which hooks are registered."""
  d = module.__dict__
  children = d.get("_modules")
  # (weak references: one per object, made once; equal while alive when their
  # referents are, so a submodule replaced by another differs)
  children = tuple(map(weakref.ref, children.values())) if children else ()
  flag = module.training if training is None else training
  return (flag, children) + tuple(tuple(d.get(name, ())) for name in _MODULE_TABLES)


class _Unguarded:
  """A key entry for a value that cannot be guarded: equal to nothing else."""

  __slots__ = ("why",)

  def __init__(self, why):
    self.why = why

  def __repr__(self):
    return f"<not guardable: {self.why}>"


def guarded_content(kind, value):
  """The key entry of a content location holding `value`."""
  if value is MISSING or value is None:
    return ("content", None)
  try:
    if kind == "module":
      return ("content", module_state(value))
    if kind == "attrs":
      d = getattr(value, "__dict__", None)
      return ("content", _Same(value), content(dict(d)) if isinstance(d, dict) else None)
    return ("content", content(value))
  except Unguardable as e:
    return ("content", _Unguarded(str(e)))
  except Exception as e:  # a container changed size while read, a torch error
    return ("content", _Unguarded(f"{type(e).__name__}: {e}"))


_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_backward_pre_hooks", "_global_backward_hooks")  # fmt: skip
_AUTOCAST_DEVICES = []


def torch_modes():
  """The global torch state a traced step depends on: grad mode, autocast (its
  flag and dtype per device type), the default dtype, deterministic algorithms
  and the global module hooks (which are registered)."""
  if not _AUTOCAST_DEVICES:
    for device in ("cpu", "cuda", "xla"):
      try:
        torch.is_autocast_enabled(device)
        torch.get_autocast_dtype(device)
      except Exception:
        continue
      _AUTOCAST_DEVICES.append(device)
  autocast = tuple(
    (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
  )
  hooks = torch.nn.modules.module
  return (
    torch.is_grad_enabled(),
    autocast,
    torch.get_default_dtype(),
    torch.are_deterministic_algorithms_enabled(),
    tuple(tuple(getattr(hooks, name, ())) for name in _GLOBAL_HOOKS),
  )


def _plain(value):
  if type(value) in _PLAIN:
    return True
  return type(value) is tuple and len(value) <= 16 and all(type(v) in _PLAIN for v in value)


def static_get(obj, name):
  """`obj.name` found without running code, else SKIP (a method, a property,
  an attribute computed by `__getattr__`) or MISSING."""
  try:
    d = object.__getattribute__(obj, "__dict__")
  except AttributeError:
    d = None
  if d is not None and name in d:
    return d[name]
  if isinstance(obj, torch.nn.Module) and d is not None:
    for kind in ("_parameters", "_buffers", "_modules"):
      table = d.get(kind)
      if table is not None and name in table:
        return table[name]
  for klass in type(obj).__mro__:
    attr = klass.__dict__.get(name, MISSING)
    if attr is MISSING:
      continue
    if type(attr) is types.MemberDescriptorType:  # __slots__
      try:
        return attr.__get__(obj, type(obj))
      except AttributeError:
        return MISSING
    if _plain(attr):
      return attr
    return SKIP
  return MISSING


# -- what the traces of one step function read ----------------------------------------------------


class Watched:
  """The locations the traces of one step function read, in the order first
  found, and which of them hold a float that changed between steps (`varying`:
  made a program input, hyper.py). Their values are part of the step's replay
  key: a value that changed traces the step (the replay guard)."""

  def __init__(self):
    self.locations = {}  # Location.ident() -> Location
    self.varying = {}  # Location.ident() -> Location
    self._same = None  # () -> whether every location holds what the last key saw
    self._last = None  # the last key made

  def add(self, recorder):
    n = len(self.locations)
    for loc, _ in recorder.locations():
      self.locations.setdefault(loc.ident(), loc)
    if len(self.locations) != n:
      self._same = None

  def key(self):
    """What the replay key keeps of the locations' values now. Checked first
    against the values the last key saw, by a function made for them (one
    straight line of dict lookups and comparisons: `_checker`)."""
    if self._same is not None and self._same():
      return self._last
    varying = self.varying
    out, values = [], []
    for ident, loc in self.locations.items():
      value = loc.read()
      values.append(value)
      if ident in varying and type(value) is float:
        out.append(("a float input", value if value in (0.0, 1.0) else "a number"))
      else:
        out.append(loc.key(value))
    self._last = tuple(out)
    self._same = _checker(list(self.locations.values()), values, self._last, varying)
    return self._last

  def changed(self, old, new):
    """The labels of the locations whose values differ between two keys made by
    `key` (the same locations), marking the floats among them as varying when
    only floats changed."""
    locs = list(self.locations.values())
    diff = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    if len(old) != len(new) or not diff:
      return []
    if all(type(b) is tuple and b and b[0] is float for b in (new[i] for i in diff)):
      for i in diff:
        if locs[i].namespace() is not None:
          self.varying[locs[i].ident()] = locs[i]
          self._same = None
    return [f"{locs[i].label} ({_shown(old[i])} -> {_shown(new[i])})" for i in diff]

  def as_varying(self, values):
    """`values` (a key made by `key` before some floats became varying) as `key`
    makes it now, or None when a varying float in it is not 0 or 1: the program
    of such a key took that float as a constant, so only a key that pins the
    value (0 and 1 are pinned) stays true."""
    out = list(values)
    for i, ident in enumerate(self.locations):
      if i >= len(out) or ident not in self.varying:
        continue
      entry = out[i]
      if type(entry) is tuple and entry and entry[0] is float:
        if entry[1] not in (0.0, 1.0):
          return None
        out[i] = ("a float input", entry[1])
    return tuple(out)

  def namespaces(self):
    """[(dict, key)] of the varying floats, to swap for Hypers while tracing."""
    out = []
    for loc in self.varying.values():
      ns = loc.namespace()
      if ns is not None:
        out.append((ns, loc.name))
    return out


def _checker(locations, values, key, varying):
  """A function saying whether every location holds what `values` (the values
  read for `key`) held, as the key sees them: a plain value equal and of the
  same type, an object the same one, a varying float of the same class (0, 1 or
  another number). Made as Python source, one line per test, grouped by owner:
  a replay's guard check is a few dozen nanoseconds per location."""
  lines, env = ["def same():"], {"M": MISSING, "static_get": static_get}
  owner_var = {}
  for i, (loc, value, entry) in enumerate(zip(locations, values, key, strict=True)):
    env[f"L{i}"] = loc
    get = f"L{i}.read()"
    if loc.kind == "attr":
      o = loc.owner
      d = getattr(o, "__dict__", None) if o is not None else None
      if isinstance(d, dict) and loc.name in d:
        var = owner_var.get(loc._id)
        if var is None:
          var = owner_var[loc._id] = f"d{i}"
          env[f"R{i}"] = loc._owner
          lines.append(f"  o = R{i}()" if loc._weak else f"  o = R{i}")
          lines.append("  if o is None: return False")
          lines.append(f"  {var} = o.__dict__")
        env[f"N{i}"] = loc.name
        get = f"{var}.get(N{i}, M)"
    elif loc.kind == "global" and loc.name in loc.owner:
      env[f"G{i}"], env[f"N{i}"] = loc.owner, loc.name
      get = f"G{i}.get(N{i}, M)"
    if loc.kind == "module" and loc._weak and type(entry[1]) is tuple:
      # (the common case, one per module the step runs: no wrapper between)
      env[f"R{i}"], env[f"E{i}"], env["module_state"] = loc._owner, entry[1], module_state
      lines.append(f"  x = R{i}()")
      lines.append(f"  if x is None or module_state(x) != E{i}: return False")
      continue
    lines.append(f"  x = {get}")
    if loc.kind in BY_CONTENT:
      env[f"E{i}"] = entry
      test = f"L{i}.key(x) != E{i}"
    elif type(entry) is tuple and entry and entry[0] == "a float input":
      pinned = entry[1]
      test = (
        "x.__class__ is not float or x == 0.0 or x == 1.0"
        if pinned == "a number"
        else f"x.__class__ is not float or x != {pinned!r}"
      )
    elif type(entry) is tuple and entry and isinstance(entry[0], type):
      env[f"T{i}"], env[f"V{i}"] = entry[0], value
      test = f"x.__class__ is not T{i} or x != V{i}"
    else:
      env[f"S{i}"] = entry  # a _Same: the object, held weakly where it can be
      test = f"x is not S{i}._ref() or x is None"  # (a dead object's ref gives None)
    lines.append(f"  if {test}: return False")
  lines.append("  return True")
  exec("\n".join(lines), env)  # noqa: S102 (source made above from names it numbers)
  return env["same"]


def _shown(entry):
  if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], type):
    entry = entry[1]
  elif isinstance(entry, tuple) and entry and entry[0] == "content":
    return "content"
  text = repr(entry)
  return text if len(text) <= 60 else text[:57] + "..."
