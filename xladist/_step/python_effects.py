"""What a traced step's Python reads and writes outside its program (closed-world).

While a step that may be captured is traced, `Recorder` watches the Python that
runs (a `sys.settrace` function with opcode events on 3.11, `sys.monitoring` on
3.12, the tracing thread only), in every frame of code that is not a known
library's (bytecode.py: `<string>`, a REPL, exec'd code are followed), and records:

* *reads*: every value a followed frame takes from outside itself: a global, a
  closure cell of a function made before the step, an attribute along an
  access path (`self.drop.p`, `cfg.beta`), a dict item under a constant key
  (`CONF["loss"]["l2"]`). Each becomes a `Location` whose value is part of the
  step's replay key (replay.py): a plain value by value, another object by
  identity, and a value that leaves its path (passed on, iterated, indexed at a
  computed key) by its content when it is a container, a partial, os.environ, a
  numpy array or a CPU tensor (read_guards.py). `getattr`/`hasattr`/`vars` with
  a computed name guard the object's attributes; every module the step runs
  has its train/eval flag (as the step found it), submodules and hooks in the
  key. A device tensor that is not a variable is guarded by identity (and is an
  input read at every replay: replay_slots.read_slots); variables are the key's
  store and optimizers' hyperparameters Hypers (hyper.py).
* *writes*: what the step changes that its program would not: a global or a
  closure variable of an enclosing function, an attribute or item of an object
  that existed before the step, a container mutated by its methods, a location
  read that holds something else at the end (changed by code not followed), the
  host random-number generators, printing and logging. A step that writes is
  traced at every call (replay.py says why under `XLADIST_REPLAY_DEBUG=1`).
* *what it cannot classify* (`unfollowed`, each with its file and line): an
  opcode in no table, an iterator made before the step, `getattr` of a value
  it cannot follow to its source, a closure it cannot find, a container past the
  content guard's bounds, a Python without tables. Such a step is traced too.

Objects made by the step itself (a dict of results, an output object, a
helper made inside `fn`) are neither guarded nor written: an object is *born
in the step* when its `__init__` ran during the trace, when the garbage
collector began tracking it during the trace (`gc.freeze()` at the start moves
every object tracked then to the permanent generation, so `gc.get_objects()`
lists only those tracked since), or when it is a dict held by a local variable
that the frame only ever binds to dict displays (`out = {}`, `d = {"n": 0}`).
CPython leaves a dict of atomic values untracked: such a dict found any other
way is taken as older than the step (a write to it stops replay: slower, never wrong).

Attributes are looked up without running code (read_guards.static_get): a
property or `__getattr__` is a frame of its own, followed when it is user code.
"""

import builtins
import collections
import enum
import gc
import logging
import sys
import threading
import types

import torch

from xladist._step import bytecode
from xladist._step import host_objects as host
from xladist._step.read_guards import (
  BY_CONTENT,
  MISSING,
  SKIP,
  Location,
  by_content,
  module_state,
  static_get,
)

WROTE = "the step's Python "  # how the words saying what a step wrote begin
UNFOLLOWED = "xladist cannot follow what the step's Python does: "


class Reason(enum.Enum):
  """Why a step's Python keeps its key from replaying."""

  WROTE = "it writes state outside the program"
  UNFOLLOWED = "the recorder cannot classify what it does"


class Refusal(str):
  """The words saying why a key is not replayed, and the kind of reason (`kind`)."""

  def __new__(cls, words, kind):
    out = str.__new__(cls, words)
    out.kind = kind
    return out


# -- the recorder --------------------------------------------------------------------------------


class Recorder:
  """Records a traced step's reads and writes (see the module docstring).
  `fn`: the step function (its closure cells are locations from the start).
  Used as a context manager around the call of `fn`; reusable across several
  calls (experimental_run_steps' steps traced as one program)."""

  def __init__(self, fn=None, is_variable=None):
    self.reads = {}  # Location.ident() -> (Location, value at the first read)
    self.writes = []  # what the step wrote, in words (first 8)
    self.unfollowed = []  # what the recorder could not classify, in words (first 8)
    self.unavailable = None  # why reads could not be recorded (another trace function)
    self._keys = {}  # Location.ident() -> its key entry at the first read
    self._born = set()  # ids of objects whose __init__ ran in the step
    self._functions = collections.defaultdict(list)  # code -> functions seen
    self._frames = set()  # ids of frames started in the step
    self._frozen = False  # whether __enter__ froze the collector's generations
    self._verdicts = {}  # id -> (object, born): what _is_born found, per object
    self._young = set()  # ids of objects tracked since the freeze, when last listed
    self._depth = 0
    self._rng = None
    self._thread = None  # the thread that traces (reads of others are not the step's)
    # whether a tensor is one of the strategy's variables (their identities are the key's)
    self._is_variable = is_variable or (lambda t: isinstance(t, torch.nn.Parameter))
    self._hook = None  # the global forward pre-hook that notes the modules run
    self._modes_before = {}  # id(module) -> its train/eval flag before the step set it
    if fn is not None:
      self._note_function(fn)

  # -- starting and stopping --------------------------------------------------------------------
  def __enter__(self):
    self._depth += 1
    if self._depth > 1:
      return self
    if sys.version_info[:2] not in bytecode.SUPPORTED:
      self.unavailable = _UNSUPPORTED
      return self
    if _MONITORING:
      if sys.monitoring.get_tool(_TOOL) is not None:
        self.unavailable = f"sys.monitoring's tool id {_TOOL} is taken"
        return self
    elif sys.gettrace() is not None:
      self.unavailable = "a trace function (a debugger or coverage) is active"
      return self
    self._rng = host.rng_states()
    self._thread = threading.get_ident()
    self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._module_runs)
    host.MODE_SETTERS.append(self._mode_set)
    torch.nn.Module.train = host.train  # while a step is traced (put back at its end)
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
    self._hook.remove()
    host.MODE_SETTERS.remove(self._mode_set)
    if not host.MODE_SETTERS:
      torch.nn.Module.train = host.TRAIN
    self._changed_unseen()
    if self._frozen:
      gc.unfreeze()
      self._frozen = False
      self._verdicts, self._young = {}, set()
    after = host.rng_states()
    for name, a, b in zip(host.RNG_NAMES, self._rng, after):
      if not host.same_state(a, b):
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
        _ACTIONS[action[0]](self, frame, *action[1:])
      except Exception as e:  # never break the user's step; say what was not followed
        self._unfollowed(frame, f"{type(e).__name__} while following it ({e})")

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
    if threading.get_ident() != self._thread:
      return None  # sys.monitoring is for every thread: another's code is not the step's
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
    if code in _PLANS and threading.get_ident() == self._thread:
      self._at(sys._getframe(1), offset)
    return None

  # -- reads ------------------------------------------------------------------------------------
  def _read(self, frame, kind, owner, name, value, label, escapes):
    if isinstance(value, torch.Tensor) and not (escapes and by_content(value)):
      if value.device.type != "cpu" and not self._is_variable(value):
        # a device tensor that is not a variable, reached through an object: the
        # program reads the one the trace saw, so another one traces again
        self._note(frame, Location(kind, owner, name, label, False), value)
      return
    if type(value).__name__ == "Hyper":
      return
    if isinstance(value, types.ModuleType) and kind != "cell":
      return
    if kind == "attr" and isinstance(owner, types.ModuleType) and callable(value):
      return  # a library's function (`F.linear`, `math.sqrt`)
    if isinstance(value, (types.FunctionType, types.MethodType)):
      self._note_function(value)
    elif hasattr(type(value), "__next__") and not self._is_born(value):
      self._unfollowed(frame, f"reads {label}, an iterator made before the step (advancing it "
                       "is a write a replay would skip)")  # fmt: skip
      return
    if not isinstance(value, torch.Tensor):
      self._note(frame, Location(kind, owner, name, label, True), value)
    if escapes and by_content(value):
      self._guard_content(frame, value, label)

  def _note(self, frame, loc, value):
    ident = loc.ident()
    if ident not in self.reads:
      self._keys[ident] = key = loc.key(value)
      # (a content location's value is in its key: the recorder does not hold it)
      self.reads[ident] = (loc, None if loc.kind in BY_CONTENT else value)
      why = getattr(key[-1], "why", None) if loc.kind in ("content", "attrs") else None
      if why is not None:
        self._unfollowed(frame, f"reads {loc.label}, which {why}")

  def _guard_content(self, frame, value, label, kind="content"):
    """`value` (a container, an array, an object whose attributes are read by
    name) is guarded by what it holds; one made in the step needs nothing."""
    if not self._is_born(value):
      self._note(frame, Location(kind, value, None, f"{label} (its content)", True), value)

  def _note_function(self, fn):
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is not None and getattr(fn, "__closure__", None):
      known = self._functions[code]
      if not any(f is fn for f in known):
        known.append(fn)

  def _on_global(self, frame, chain, name, escapes):
    g = frame.f_globals
    value = g.get(name, MISSING)
    if value is MISSING:
      value = frame.f_builtins.get(name, MISSING)
      if value is print:
        self._write("prints (print)")
        return
    self._read(frame, "global", g, name, value, f"global {name!r} of {g.get('__name__', '?')}",
               escapes)  # fmt: skip

  def _on_attr_builtin(self, frame, chain, name, escapes):
    """`getattr(obj, name)`, `hasattr`, `vars` (reads of attributes by a name
    computed at run time) and `setattr`, `delattr` (writes)."""
    value = frame.f_globals.get(name, MISSING)
    if value is MISSING:
      value = frame.f_builtins.get(name, MISSING)
    if value is not getattr(builtins, name):  # a global of that name
      return self._on_global(frame, None, name, escapes)
    obj = self._resolve(frame, chain) if chain is not None else SKIP
    if bytecode.ATTR_BUILTINS[name] == "writes":
      if obj is SKIP or not self._is_born(obj, frame, chain):
        self._write(f"sets an attribute by a computed name ({name}({host.path(chain)}, ...))")
    elif obj is SKIP:
      self._unfollowed(frame, f"{name}() of a value xladist cannot follow to its source")
    elif isinstance(obj, types.ModuleType):
      self._unfollowed(frame, f"{name}() of module {obj.__name__}")
    else:
      self._guard_content(frame, obj, f"{host.path(chain)} ({name}() by a computed name)", "attrs")

  def _on_deref(self, frame, chain, name, escapes):
    if self._owned_here(frame, name):
      return
    value = frame.f_locals.get(name, MISSING)
    label = f"closure variable {name!r} of {frame.f_code.co_qualname}"
    code = frame.f_code
    searches = (
      lambda: self._functions.get(code, ()),
      lambda: host.methods_of(frame, code),
      lambda: host.functions_of(code),
    )
    for search in searches:
      for fn in search():
        index = fn.__code__.co_freevars.index(name)
        try:
          same = fn.__closure__[index].cell_contents is value
        except ValueError:
          same = False
        if same:
          self._note_function(fn)
          self._read(frame, "cell", fn, index, value, label, escapes)
          return
    self._unfollowed(frame, f"reads {label} of a function xladist cannot find")

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

  def _on_attr(self, frame, chain, name, escapes):
    obj = self._resolve(frame, chain)
    if obj is SKIP or self._is_born(obj, frame, chain):
      return
    value = static_get(obj, name)
    if value is SKIP:
      if self._through_own_table(frame, chain):
        return  # a module's or an optimizer's own table (`self._modules.values()`)
      if by_content(obj) and not isinstance(obj, torch.Tensor):
        if name in host.MUTATORS:
          self._write(f"changes {host.path(chain)} ({type(obj).__name__}.{name})")
        elif name in host.READERS or name.startswith("__"):
          self._guard_content(frame, obj, host.path(chain))
      return
    if value is MISSING:
      return
    if host.own_table(obj, name):
      # train()/eval() and hooks are the "module" locations' (`_module_runs`), a
      # module's tables (`_modules`, `_parameters`) its structure (signature.py)
      return
    self._read(frame, "attr", obj, name, value, f"{type(obj).__name__}.{name}", escapes)

  def _through_own_table(self, frame, chain):
    """Whether `chain` passes through a module's or an optimizer's own table."""
    obj = self._resolve(frame, chain[:1])
    for step in chain[1:]:
      if obj is SKIP or type(step) is tuple:
        return False
      if host.own_table(obj, step):
        return True
      obj = static_get(obj, step)
    return False

  def _on_item(self, frame, chain, key, escapes):
    obj = self._resolve(frame, chain)
    if obj is SKIP or self._is_born(obj, frame, chain) or isinstance(obj, torch.Tensor):
      return
    if self._through_own_table(frame, chain):
      return
    if not isinstance(obj, dict):
      if by_content(obj):
        self._guard_content(frame, obj, host.path(chain))
      elif not isinstance(obj, (str, bytes, range)) and not host.python_getitem(type(obj)):
        self._unfollowed(frame, f"reads an item of {host.path(chain)} ({type(obj).__name__}), "
                         "whose items xladist cannot follow")  # fmt: skip
      return
    value = obj.get(key, MISSING)
    if value is not MISSING:
      self._read(frame, "item", obj, key, value, f"{host.path(chain)}[{key!r}]", escapes)

  def _module_runs(self, module, args):
    """The global forward pre-hook: a module the step runs, however it is
    reached, has its train/eval flag and hooks in the key (the flag as the step
    found it: a step that calls `.train()` itself replays after an `.eval()`)."""
    ident = ("module", id(module), None)  # Location.ident() of the module's location
    if ident in self.reads or threading.get_ident() != self._thread or self._is_born(module):
      return
    label = f"{type(module).__name__} at {id(module):#x}: train/eval and hooks"
    before = self._modes_before.get(id(module), module.training)
    self._keys[ident] = ("content", module_state(module, training=before))
    self.reads[ident] = (Location("module", module, None, label, True), None)

  def _mode_set(self, module):
    """`module.train(mode)` / `.eval()` in the step: the flags before it, kept."""
    if threading.get_ident() == self._thread:
      for m in module.modules():
        self._modes_before.setdefault(id(m), m.training)

  def _changed_unseen(self):
    """A place the step read that holds something else at its end was written
    by code the recorder does not see (C code, the standard library)."""
    for ident, (loc, _) in self.reads.items():
      if loc.kind != "module" and loc.key(loc.read()) != self._keys[ident]:
        self._write(f"changes {loc.label} in code xladist does not follow")

  # -- writes and what the recorder cannot follow -----------------------------------------------
  def _write(self, what):
    if what not in self.writes and len(self.writes) < 8:
      self.writes.append(what)

  def _unfollowed(self, frame, what):
    place = what
    if frame is not None:
      code = frame.f_code
      place = f"{what} ({code.co_filename}:{frame.f_lineno}, in {code.co_qualname})"
    if place not in self.unfollowed and len(self.unfollowed) < 8:
      self.unfollowed.append(place)

  def _on_unknown(self, frame, chain, name, escapes):
    self._unfollowed(frame, f"runs opcode {name}, which xladist's recorder does not model")

  def _on_print(self, frame, chain, name, escapes):
    self._write("prints (an expression statement shown by the interpreter)")

  def _on_store_global(self, frame, chain, name, escapes):
    self._write(f"sets global {name!r}")

  def _on_store_name(self, frame, chain, name, escapes):
    if frame.f_locals is frame.f_globals:
      self._write(f"sets global {name!r}")

  def _on_store_deref(self, frame, chain, name, escapes):
    if not self._owned_here(frame, name):
      self._write(f"sets nonlocal {name!r} of {frame.f_code.co_qualname}")

  def _on_store_attr(self, frame, chain, name, escapes):
    obj = self._resolve(frame, chain) if chain is not None else SKIP
    if obj is SKIP:
      self._write(f"sets attribute {name!r} of an object xladist cannot follow")
    elif not self._is_born(obj, frame, chain):
      self._write(f"sets {host.path(chain)}.{name} ({type(obj).__name__})")

  def _on_store_item(self, frame, chain, name, escapes):
    obj = self._resolve(frame, chain) if chain is not None else SKIP
    if obj is SKIP:
      self._write("sets an item of a container xladist cannot follow")
    elif not self._is_born(obj, frame, chain) and not isinstance(obj, torch.Tensor):
      self._write(f"sets an item of {host.path(chain)} ({type(obj).__name__})")

  # -- helpers ----------------------------------------------------------------------------------
  def _resolve(self, frame, chain):
    kind, name = chain[0]
    if kind == "global":
      obj = frame.f_globals.get(name, MISSING)
      if obj is MISSING:
        obj = frame.f_builtins.get(name, MISSING)
    else:
      obj = frame.f_locals.get(name, MISSING)
    for step in chain[1:]:
      if obj is MISSING or obj is SKIP:
        return SKIP
      if type(step) is tuple:  # ("item", key)
        obj = obj.get(step[1], MISSING) if isinstance(obj, dict) else SKIP
      else:
        obj = static_get(obj, step)
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

  def key_at_read(self, ident):
    """The key entry of the location `ident` as the step first read it."""
    return self._keys[ident]

  def why_not_replayed(self):
    """Words saying what the step wrote or what the recorder could not
    classify (UNFOLLOWED), or None."""
    if self.unavailable is not None:
      words = f"{UNFOLLOWED}its reads could not be recorded: {self.unavailable}"
      return Refusal(words, Reason.UNFOLLOWED)
    if self.unfollowed:
      return Refusal(UNFOLLOWED + "; ".join(self.unfollowed), Reason.UNFOLLOWED)
    if not self.writes:
      return None
    return Refusal(WROTE + "; ".join(self.writes), Reason.WROTE)


_ACTIONS = {
  "global": Recorder._on_global,
  "attr_builtin": Recorder._on_attr_builtin,
  "unknown": Recorder._on_unknown,
  "print": Recorder._on_print,
  "store_name": Recorder._on_store_name,
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
_PLANS = {}  # code -> bytecode.plan(code), for followed code
_FROZEN_AT_IMPORT = gc.get_freeze_count()
_DICT_LOCALS = {}  # code -> bytecode.dict_locals(code), for followed code
_UNSUPPORTED = (
  f"Python {sys.version_info[0]}.{sys.version_info[1]}: xladist's recorder has bytecode "
  f"tables for {', '.join(f'{a}.{b}' for a, b in bytecode.SUPPORTED)} only (every step is "
  "traced)"
)


def _code_info(code):
  followed = bytecode.followed(code.co_filename)
  if followed:
    _PLANS[code] = bytecode.plan(code)
    _DICT_LOCALS[code] = bytecode.dict_locals(code)
  init = code.co_name == "__init__" and code.co_argcount > 0
  return followed, init, code is logging.Logger.handle.__code__


def merged(recorders):
  """One record of several traced steps (experimental_run_steps' group)."""
  out = Recorder()
  for r in recorders:
    if r is None:
      continue
    for ident, read in r.reads.items():
      out.reads.setdefault(ident, read)
    out._keys.update(r._keys)
    for what in r.writes:
      out._write(what)
    for what in r.unfollowed:
      if what not in out.unfollowed:
        out.unfollowed.append(what)
    out.unavailable = out.unavailable or r.unavailable
  return out
