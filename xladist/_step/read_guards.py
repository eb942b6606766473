"""Where a step's reads live, read again before each replay: the replay guard.

`python_effects.Recorder` finds what a traced step's Python read; each place is a
`Location` (a module's global, a function's closure cell, an attribute of an
object, a dict's item) read again without running code (`static_get`). `Watched`
keeps the locations the traces of one step function read and makes the last part
of its replay key from their values (replay.py): a plain value by value, another
object by identity, a float that changed between steps by its class (0, 1 or
another number: it is a program input, hyper.py). The key is first checked by a
function made for the last key's values (`_checker`).
"""

import builtins
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
  closure holds it; name: the cell's index), "attr" (owner: an object) or
  "item" (owner: a dict). The owner is held weakly where it can be (a model
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
    return static_get(owner, name)

  def key(self, value):
    """What the replay key keeps of `value`: the value itself when plain, else
    the object's identity."""
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
    lines.append(f"  x = {get}")
    if type(entry) is tuple and entry and entry[0] == "a float input":
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
    return repr(entry[1])
  return repr(entry)
