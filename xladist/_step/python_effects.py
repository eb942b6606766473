"""What a traced step's Python reads and writes outside its program.

While a step that may be captured is traced, `Recorder` watches the Python that
runs (a `sys.settrace` function with opcode events, for the frames of user code
and of torch's module classes; torch's other internals, xladist, the runtimes
and the standard library are not followed) and records:

* *reads*: every value a followed frame takes from outside itself: a global, a
  closure cell of a function made before the step, an attribute along an
  access path (`self.drop.p`, `cfg.beta`, `self.ema.decay`), a dict item under
  a constant key (`cfg["beta"]`). Each becomes a `Location` whose value is
  part of the step's replay key (replay.py): a plain value (bool, int, float,
  str, None, tuples of them) by value, another object by identity. Tensors are
  the program's inputs (slots), and optimizers' hyperparameters are Hypers
  (hyper.py): neither is guarded here.
* *writes*: what the step changes that its program would not: a global or a
  closure variable of an enclosing function, an attribute or item of an object
  that existed before the step, a list, dict or set mutated by its methods,
  the host random-number generators (`random`, `numpy.random`, torch's CPU
  generator), printing and logging. A step that writes is not captured: it is
  traced at every call (replay.py says why under `XLADIST_REPLAY_DEBUG=1`).

Objects made by the step itself (a dict of results, an output object, a
helper made inside `fn`) are neither guarded nor written: an object is *born
in the step* when its `__init__` ran during the trace, when the garbage
collector began tracking it during the trace (`gc.freeze()` at the start moves
every object tracked then to the permanent generation, so `gc.get_objects()`
lists only those tracked since), or when it is a dict held by a local variable
that the frame only ever binds to dict displays (`out = {}`, `d = {"n": 0}`).
CPython leaves a dict of atomic values untracked until a container enters it:
such a dict found any other way is taken as older than the step (a write to it
stops replay: slower, never wrong). tracemalloc told the same apart before, at
about 45 % of a trace's time on the jax runtime.

Attributes are looked up without running code (the instance dict, an
`nn.Module`'s parameters, buffers and submodules, slots, plain class
attributes): a property or `__getattr__` is a frame of its own, followed when
it is user code.
"""

import collections
import dis
import gc
import inspect
import logging
import os
import random
import sys
import sysconfig
import types

import torch

from xladist._step.read_guards import MISSING, SKIP, Location, static_get

_PLAIN = (bool, int, float, str, bytes, type(None))
WROTE = "the step's Python "  # how the words saying what a step wrote begin

_MUTATORS = {
  "append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
  "update", "setdefault", "popitem", "add", "discard", "difference_update",
  "intersection_update", "symmetric_difference_update", "appendleft", "extendleft",
  "popleft", "rotate", "__setitem__", "__delitem__",
}  # fmt: skip
_CONTAINERS = (list, dict, set, collections.deque, bytearray)


# -- which frames are followed -----------------------------------------------------------------


def _roots():
  """Folders whose code is not followed: the standard library, xladist, the
  runtimes and torch (its module classes excepted: their `forward`s read the
  modules' settings, `Dropout.p`, `self.training`)."""
  paths = sysconfig.get_paths()
  out = {os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")}
  here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
  out.add(here + os.sep)
  for name in ("torch", "torch_xla", "jax", "jaxlib", "torchax", "numpy", "optax",
               "_pytest", "pluggy", "typing_extensions", "sympy", "functorch"):  # fmt: skip
    spec = sys.modules.get(name)
    file = getattr(spec, "__file__", None)
    if file:
      out.add(os.path.dirname(os.path.realpath(file)) + os.sep)
  return tuple(sorted(out))


_TORCH_MODULES = os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "nn", "modules")
_ROOTS = []


def _followed(filename):
  if not _ROOTS:
    _ROOTS.extend(_roots())
  if filename.startswith("<"):
    return False  # generated code (dataclasses' __init__, namedtuple), frozen modules
  path = os.path.realpath(filename)
  if path.startswith(_TORCH_MODULES + os.sep):
    return os.path.basename(path) != "module.py"  # hooks' bookkeeping, not settings
  return not path.startswith(tuple(_ROOTS))


# -- what each instruction of a followed code object does ------------------------------------

_LOADS = {
  "LOAD_FAST": "fast", "LOAD_FAST_CHECK": "fast", "LOAD_FAST_AND_CLEAR": "fast",
  "LOAD_DEREF": "deref", "LOAD_CLASSDEREF": "deref", "LOAD_GLOBAL": "global", "LOAD_NAME": "global",
}  # fmt: skip


def _plan(code):
  """{instruction offset: action} for `code`, found once: (kind, chain, name)
  where `chain` is the access path of the object the instruction works on, as
  loads and attributes (("fast", "self"), "drop"), or None when not followed."""
  plan = {}
  instrs = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
  after = []  # the access path on top of the stack after each instruction, or None
  cur = copied = augmented = None
  freevars = set(code.co_freevars)
  for k, ins in enumerate(instrs):
    op, arg = ins.opname, ins.argval
    if ins.is_jump_target:
      cur = copied = None
    new = None
    if op in _LOADS:
      kind = _LOADS[op]
      new = ((kind, arg),)
      if kind == "global":
        plan[ins.offset] = ("global", None, arg)
      elif kind == "deref" and arg in freevars:
        plan[ins.offset] = ("deref", None, arg)
    elif op in ("LOAD_ATTR", "LOAD_METHOD") and cur is not None:
      plan[ins.offset] = ("attr", cur, arg)
      new = cur + (arg,)
    elif op == "COPY" and ins.arg == 1 and cur is not None:
      new = copied = cur
    elif op == "BINARY_SUBSCR" and k >= 2 and instrs[k - 1].opname == "LOAD_CONST":
      if after[k - 2] is not None and isinstance(instrs[k - 1].argval, (str, int)):
        plan[ins.offset] = ("item", after[k - 2], instrs[k - 1].argval)
    elif (
      op == "BINARY_SUBSCR" and k >= 4 and instrs[k - 1].opname == "COPY" == instrs[k - 2].opname
    ):
      augmented = after[k - 4]  # `d[key] += ...`: d, key, COPY 2, COPY 2, BINARY_SUBSCR
    elif op in ("STORE_ATTR", "DELETE_ATTR"):
      target = cur if cur is not None else (copied if instrs[k - 1].opname == "SWAP" else None)
      plan[ins.offset] = ("store_attr", target, arg)
    elif op in ("STORE_SUBSCR", "DELETE_SUBSCR"):
      if op == "STORE_SUBSCR" and instrs[k - 1].opname == "SWAP" and augmented is not None:
        plan[ins.offset] = ("store_item", augmented, None)  # ... SWAP 3, SWAP 2, STORE_SUBSCR
      else:
        plan[ins.offset] = ("store_item", _container(instrs, after, k), None)
    elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
      plan[ins.offset] = ("store_global", None, arg)
    elif op in ("STORE_DEREF", "DELETE_DEREF") and arg in freevars:
      plan[ins.offset] = ("store_deref", None, arg)
    after.append(new)
    cur = new
  return plan


def _container(instrs, after, k):
  """The access path of the container a STORE_SUBSCR / DELETE_SUBSCR at `k`
  writes: what was on the stack under its key (DELETE: under nothing more)."""
  want = 1 if instrs[k].opname == "STORE_SUBSCR" else 0
  depth = 0
  for m in range(k - 1, max(-1, k - 12), -1):
    try:
      depth += dis.stack_effect(instrs[m].opcode, instrs[m].arg)
    except ValueError:
      return None
    if depth == want:
      return after[m - 1] if m >= 1 else None
    if depth > want:
      return None
  return None


# -- the recorder --------------------------------------------------------------------------------


class Recorder:
  """Records a traced step's reads and writes (see the module docstring).
  `fn`: the step function (its closure cells are locations from the start).
  Used as a context manager around the call of `fn`; reusable across several
  calls (experimental_run_steps' steps traced as one program)."""

  def __init__(self, fn=None):
    self.reads = {}  # Location.ident() -> (Location, value at the first read)
    self.writes = []  # what the step wrote, in words (first 8)
    self.unavailable = None  # why reads could not be recorded (another trace function)
    self.unguarded = set()  # reads found and not guarded, in words
    self._born = set()  # ids of objects whose __init__ ran in the step
    self._functions = collections.defaultdict(list)  # code -> functions seen
    self._frames = set()  # ids of frames started in the step
    self._frozen = False  # whether __enter__ froze the collector's generations
    self._verdicts = {}  # id -> (object, born): what _is_born found, per object
    self._young = set()  # ids of objects tracked since the freeze, when last listed
    self._depth = 0
    self._rng = None
    if fn is not None:
      self._note_function(fn)

  # -- starting and stopping --------------------------------------------------------------------
  def __enter__(self):
    self._depth += 1
    if self._depth > 1:
      return self
    if _MONITORING:
      if sys.monitoring.get_tool(_TOOL) is not None:
        self.unavailable = f"sys.monitoring's tool id {_TOOL} is taken"
        return self
    elif sys.gettrace() is not None:
      self.unavailable = "a trace function (a debugger or coverage) is active"
      return self
    self._rng = _rng_states()
    if gc.get_freeze_count() <= _FROZEN_AT_IMPORT:
      # (the interpreter's own frozen objects, 375 on Python 3.12, go back to the
      # oldest generation at the end; after another user's gc.freeze(), only
      # __init__s and dict displays tell births). The young generations' garbage
      # is collected first: frozen, it would wait for a full collection after the
      # trace (an abandoned input iterator's prefetch thread lived on).
      gc.collect(1)
      gc.freeze()
      self._frozen = True
    if _MONITORING:
      self._start_monitoring()
    else:
      sys.settrace(self._call)
    return self

  def __exit__(self, *exc):
    self._depth -= 1
    if self._depth > 0 or self.unavailable is not None:
      return False
    if _MONITORING:
      self._stop_monitoring()
    else:
      sys.settrace(None)
    if self._frozen:
      gc.unfreeze()
      self._frozen = False
      self._verdicts, self._young = {}, set()
    after = _rng_states()
    for name, a, b in zip(_RNG_NAMES, self._rng, after):
      if not _same_state(a, b):
        self._write(f"draws from the host random-number generator of {name}")
    return False

  # -- events (Python 3.11: sys.settrace with opcode events) ------------------------------------
  def _call(self, frame, event, arg):
    if event != "call":
      return None
    if not self._started(frame, frame.f_code):
      return None
    self._frames.add(id(frame))
    frame.f_trace_lines = False
    frame.f_trace_opcodes = True
    return self._opcode

  def _opcode(self, frame, event, arg):
    if event == "opcode":
      self._at(frame, frame.f_lasti)
    return self._opcode

  def _started(self, frame, code):
    """A frame of `code` starts: notes what it makes and logs; whether it is followed."""
    info = _INFO.get(code)
    if info is None:
      info = _INFO[code] = _code_info(code)
    followed, init, handle = info
    if init:
      self._born.add(id(frame.f_locals.get(code.co_varnames[0])))
    if handle:
      record = frame.f_locals.get("record")
      name = getattr(record, "name", "")
      if not name.startswith("xladist"):
        self._write(f"logs (logger {name!r})")
    return followed

  def _at(self, frame, offset):
    action = _PLANS[frame.f_code].get(offset)
    if action is not None:
      try:
        _ACTIONS[action[0]](self, frame, action[1], action[2])
      except Exception as e:  # never break the user's step; say what was not followed
        self._write(f"{type(e).__name__} while following it ({e})")

  # -- events (Python 3.12: sys.monitoring, per code object) ------------------------------------
  # (3.12.1's settrace misses the opcode events of a code object's first traced call.)
  def _start_monitoring(self):
    mon = sys.monitoring
    mon.use_tool_id(_TOOL, "xladist")
    mon.register_callback(_TOOL, mon.events.PY_START, self._py_start)
    mon.register_callback(_TOOL, mon.events.INSTRUCTION, self._instruction)
    self._instrumented = set()  # code objects with INSTRUCTION events on
    mon.restart_events()
    mon.set_events(_TOOL, mon.events.PY_START)

  def _stop_monitoring(self):
    mon = sys.monitoring
    mon.set_events(_TOOL, 0)
    for code in self._instrumented:
      mon.set_local_events(_TOOL, code, 0)
    mon.register_callback(_TOOL, mon.events.PY_START, None)
    mon.register_callback(_TOOL, mon.events.INSTRUCTION, None)
    mon.free_tool_id(_TOOL)
    self._instrumented = set()

  def _py_start(self, code, offset):
    frame = sys._getframe(1)
    followed = self._started(frame, code)
    if not followed:
      info = _INFO[code]
      return None if (info[1] or info[2]) else sys.monitoring.DISABLE
    self._frames.add(id(frame))
    if code not in self._instrumented:
      sys.monitoring.set_local_events(_TOOL, code, sys.monitoring.events.INSTRUCTION)
      self._instrumented.add(code)
    return None

  def _instruction(self, code, offset):
    if code in _PLANS:
      self._at(sys._getframe(1), offset)
    return None

  # -- reads ------------------------------------------------------------------------------------
  def _read(self, kind, owner, name, value, label):
    if isinstance(value, torch.Tensor) or type(value).__name__ == "Hyper":
      return
    if isinstance(value, types.ModuleType) and kind != "cell":
      return
    if kind == "attr" and isinstance(owner, types.ModuleType) and callable(value):
      return  # a library's function (`F.linear`, `math.sqrt`)
    if isinstance(value, (types.FunctionType, types.MethodType)):
      self._note_function(value)
    loc = Location(kind, owner, name, label, True)
    ident = loc.ident()
    if ident not in self.reads:
      self.reads[ident] = (loc, value)

  def _note_function(self, fn):
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is not None and getattr(fn, "__closure__", None):
      known = self._functions[code]
      if not any(f is fn for f in known):
        known.append(fn)

  def _on_global(self, frame, chain, name):
    g = frame.f_globals
    value = g.get(name, MISSING)
    if value is MISSING:
      value = frame.f_builtins.get(name, MISSING)
      if value is print:
        self._write("prints (print)")
        return
    self._read("global", g, name, value, f"global {name!r} of {g.get('__name__', '?')}")

  def _on_deref(self, frame, chain, name):
    if self._owned_here(frame, name):
      return
    value = frame.f_locals.get(name, MISSING)
    for fn in self._functions.get(frame.f_code, ()):
      for cell_name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
        if cell_name == name:
          try:
            same = cell.cell_contents is value
          except ValueError:
            same = False
          if same:
            index = fn.__code__.co_freevars.index(name)
            label = f"closure variable {name!r} of {frame.f_code.co_qualname}"
            self._read("cell", fn, index, value, label)
            return
    # A function xladist never saw loaded (made by C code, or reached through a
    # container): its cell is not guarded (the verification trace checks it).
    self.unguarded.add(f"closure variable {name!r} of {frame.f_code.co_qualname}")

  def _owned_here(self, frame, name):
    """Whether the cell `name` of `frame` belongs to a frame started in the step."""
    f = frame.f_back
    for _ in range(64):
      if f is None or id(f) not in self._frames:
        return False
      if name in f.f_code.co_cellvars:
        return True
      f = f.f_back
    return False

  def _on_attr(self, frame, chain, name):
    obj = self._resolve(frame, chain)
    if obj is SKIP or self._is_born(obj, frame, chain):
      return
    value = static_get(obj, name)
    if value is SKIP:
      if isinstance(obj, _CONTAINERS) and name in _MUTATORS:
        self._write(f"changes {_path(chain)} ({type(obj).__name__}.{name})")
      return
    if value is MISSING:
      return
    if isinstance(obj, torch.nn.Module) and (name == "training" or name[:1] == "_"):
      # train()/eval() are the signature's modes (a step may set them itself), and
      # a module's tables (`_modules`, `_parameters`) its structure (signature.py)
      return
    self._read("attr", obj, name, value, f"{type(obj).__name__}.{name}")

  def _on_item(self, frame, chain, key):
    obj = self._resolve(frame, chain)
    if obj is SKIP or not isinstance(obj, dict) or self._is_born(obj, frame, chain):
      return
    value = obj.get(key, MISSING)
    if value is not MISSING:
      self._read("item", obj, key, value, f"{_path(chain)}[{key!r}]")

  # -- writes -----------------------------------------------------------------------------------
  def _write(self, what):
    if what not in self.writes and len(self.writes) < 8:
      self.writes.append(what)

  def _on_store_global(self, frame, chain, name):
    self._write(f"sets global {name!r}")

  def _on_store_deref(self, frame, chain, name):
    if not self._owned_here(frame, name):
      self._write(f"sets nonlocal {name!r} of {frame.f_code.co_qualname}")

  def _on_store_attr(self, frame, chain, name):
    obj = self._resolve(frame, chain) if chain is not None else SKIP
    if obj is SKIP:
      self._write(f"sets attribute {name!r} of an object xladist cannot follow")
    elif not self._is_born(obj, frame, chain):
      self._write(f"sets {_path(chain)}.{name} ({type(obj).__name__})")

  def _on_store_item(self, frame, chain, name):
    obj = self._resolve(frame, chain) if chain is not None else SKIP
    if obj is SKIP:
      self._write("sets an item of a container xladist cannot follow")
    elif not self._is_born(obj, frame, chain) and not isinstance(obj, torch.Tensor):
      self._write(f"sets an item of {_path(chain)} ({type(obj).__name__})")

  # -- helpers ----------------------------------------------------------------------------------
  def _resolve(self, frame, chain):
    kind, name = chain[0]
    if kind == "global":
      obj = frame.f_globals.get(name, MISSING)
      if obj is MISSING:
        obj = frame.f_builtins.get(name, MISSING)
    else:
      obj = frame.f_locals.get(name, MISSING)
    for attr in chain[1:]:
      if obj is MISSING or obj is SKIP:
        return SKIP
      obj = static_get(obj, attr)
    return SKIP if obj is MISSING else obj

  def _is_born(self, obj, frame=None, chain=None):
    """Whether `obj` was made during the step (the module docstring says how)."""
    if id(obj) in self._born:
      return True
    if type(obj) is dict and chain is not None and len(chain) == 1 and chain[0][0] == "fast":
      if chain[0][1] in _DICT_LOCALS.get(frame.f_code, ()):
        return True
    if not self._frozen or not gc.is_tracked(obj) or isinstance(obj, types.ModuleType):
      return False
    known = self._verdicts.get(id(obj))
    if known is None:
      if id(obj) not in self._young:
        self._young = {id(o) for o in gc.get_objects()}  # the permanent generation aside
      known = self._verdicts[id(obj)] = (obj, id(obj) in self._young)
    return known[1]

  # -- results ----------------------------------------------------------------------------------
  def locations(self):
    """[(Location, value read)] of what the step read, in the order first read."""
    return list(self.reads.values())

  def why_not_replayed(self):
    """Words saying what the step wrote, or None."""
    if self.unavailable is not None:
      return f"its reads could not be recorded: {self.unavailable}"
    if not self.writes:
      return None
    return WROTE + "; ".join(self.writes)


def _path(chain):
  if chain is None:
    return "?"
  root = chain[0][1]
  return ".".join((root,) + tuple(chain[1:]))


_ACTIONS = {
  "global": Recorder._on_global,
  "deref": Recorder._on_deref,
  "attr": Recorder._on_attr,
  "item": Recorder._on_item,
  "store_global": Recorder._on_store_global,
  "store_deref": Recorder._on_store_deref,
  "store_attr": Recorder._on_store_attr,
  "store_item": Recorder._on_store_item,
}

_INFO = {}  # code -> (followed, is an __init__, is logging's Logger.handle)
_MONITORING = sys.version_info >= (3, 12)
_TOOL = 4  # the sys.monitoring tool id (0-2 and 5 are named for debuggers, coverage,
# profilers and optimizers)
_PLANS = {}  # code -> _plan(code), for followed code
_FROZEN_AT_IMPORT = gc.get_freeze_count()
_DICT_LOCALS = {}  # code -> _dict_locals(code), for followed code
_DICT_DISPLAYS = ("BUILD_MAP", "BUILD_CONST_KEY_MAP", "DICT_UPDATE")


def _dict_locals(code):
  """The local variables of `code` that only ever hold a dict made by the frame: every
  store to them takes a dict display just built (`out = {}`, `d = {"n": 0}`,
  `d = {**a}`), where no jump lands, and none is a parameter."""
  instrs = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
  params = code.co_argcount + code.co_kwonlyargcount
  params += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
  made, other = set(), set(code.co_varnames[:params])
  for k, ins in enumerate(instrs):
    if ins.opname in ("STORE_FAST", "DELETE_FAST", "LOAD_FAST_AND_CLEAR"):
      display = (
        ins.opname == "STORE_FAST"
        and k > 0
        and not ins.is_jump_target
        and instrs[k - 1].opname in _DICT_DISPLAYS
      )
      (made if display else other).add(ins.argval)
  return frozenset(made - other)


def _code_info(code):
  followed = _followed(code.co_filename)
  if followed:
    _PLANS[code] = _plan(code)
    _DICT_LOCALS[code] = _dict_locals(code)
  init = code.co_name == "__init__" and code.co_argcount > 0
  return followed, init, code is logging.Logger.handle.__code__


# -- host random-number generators ---------------------------------------------------------------

_RNG_NAMES = ("random", "numpy.random", "torch's CPU generator")


def _rng_states():
  np = sys.modules.get("numpy")
  np_state = None
  if np is not None:
    try:
      np_state = np.random.get_state(legacy=False)
    except Exception:
      np_state = None
  return (random.getstate(), np_state, torch.default_generator.get_state())


def _same_state(a, b):
  if isinstance(a, torch.Tensor):
    return torch.equal(a, b)
  if isinstance(a, dict):
    np = sys.modules["numpy"]
    return a.keys() == b.keys() and all(
      np.array_equal(a[k], b[k]) if hasattr(a[k], "shape") else _same_state(a[k], b[k]) for k in a
    )
  return a == b


def merged(recorders):
  """One record of several traced steps (experimental_run_steps' group)."""
  out = Recorder()
  for r in recorders:
    if r is None:
      continue
    for ident, read in r.reads.items():
      out.reads.setdefault(ident, read)
    for what in r.writes:
      out._write(what)
    out.unavailable = out.unavailable or r.unavailable
  return out
