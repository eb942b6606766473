"""The recorder's tables: which frames it follows and what each instruction does.

`python_effects.Recorder` watches the bytecode of every frame it follows while a
step is traced. This module says which code is followed (`followed`) and turns a
code object into a plan, {instruction offset: action}, once (`plan`). The world is
closed: every opcode of the supported Python versions is in a table here, either
handled (a load from outside the frame, an attribute, an item, a store) or inert
(stack and arithmetic, calls, jumps: nothing outside the frame that the handled
ones do not already show). An opcode in no table makes an "unknown" action: a step
that runs it is not replayable. On a Python without tables (3.10, 3.13 and later)
the recorder does not run at all and every step is traced (`SUPPORTED`).

An action is (kind, chain, name, escapes): `chain` is the access path of the object
the instruction works on, as loads and steps (("fast", "self"), "drop", ("item",
"beta")), or None; `escapes` says that the value the instruction reads leaves the
access path (it is passed to a call, iterated, stored in a local, compared):
such a value is guarded by its content where it is a container (read_guards.py),
since code the recorder cannot see (C, a builtin) may read any part of it.
"""

import dis
import inspect
import os
import sys
import sysconfig

import torch

SUPPORTED = ((3, 11), (3, 12))

# -- which frames are followed ------------------------------------------------------------------


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


def followed(filename):
  """Whether the recorder follows code from `filename`: everything but the known
  libraries' files and the interpreter's frozen modules. Code without a file is
  followed: `python -c` (`<string>`), a REPL (`<stdin>`), a notebook's cells
  (`<ipython-input-…>`), `exec`, and the code dataclasses and namedtuple generate."""
  if not _ROOTS:
    _ROOTS.extend(_roots())
  if filename.startswith("<"):
    return not filename.startswith("<frozen ")
  path = os.path.realpath(filename)
  if path.startswith(_TORCH_MODULES + os.sep):
    return os.path.basename(path) != "module.py"  # hooks' bookkeeping, not settings
  return not path.startswith(tuple(_ROOTS))


# -- the opcode tables ---------------------------------------------------------------------------

LOADS = {
  "LOAD_FAST": "fast", "LOAD_FAST_CHECK": "fast", "LOAD_FAST_AND_CLEAR": "fast",
  "LOAD_DEREF": "deref", "LOAD_CLASSDEREF": "deref", "LOAD_GLOBAL": "global", "LOAD_NAME": "global",
}  # fmt: skip
_HANDLED = set(LOADS) | {
  "LOAD_ATTR", "LOAD_METHOD", "BINARY_SUBSCR", "STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR",
  "DELETE_SUBSCR", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_DEREF", "DELETE_DEREF", "STORE_NAME",
  "DELETE_NAME", "STORE_SLICE", "COPY", "PRINT_EXPR",
}  # fmt: skip
# Opcodes that touch nothing outside the frame but what the handled ones show (the
# values they work on were loaded by handled opcodes first).
_INERT_COMMON = {
  "BEFORE_ASYNC_WITH", "BEFORE_WITH", "BINARY_OP", "BUILD_CONST_KEY_MAP", "BUILD_LIST",
  "BUILD_MAP", "BUILD_SET", "BUILD_SLICE", "BUILD_STRING", "BUILD_TUPLE", "CALL",
  "CALL_FUNCTION_EX", "CHECK_EG_MATCH", "CHECK_EXC_MATCH", "COMPARE_OP", "CONTAINS_OP",
  "COPY_FREE_VARS", "DELETE_FAST", "DICT_MERGE", "DICT_UPDATE", "END_ASYNC_FOR",
  "EXTENDED_ARG", "FORMAT_VALUE", "FOR_ITER", "GET_AITER", "GET_ANEXT", "GET_AWAITABLE",
  "GET_ITER", "GET_LEN", "GET_YIELD_FROM_ITER", "IMPORT_FROM", "IMPORT_NAME", "IS_OP",
  "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_FORWARD", "KW_NAMES", "LIST_APPEND",
  "LIST_EXTEND", "LOAD_ASSERTION_ERROR", "LOAD_BUILD_CLASS", "LOAD_CLOSURE", "LOAD_CONST",
  "MAKE_CELL", "MAKE_FUNCTION", "MAP_ADD", "MATCH_CLASS", "MATCH_KEYS", "MATCH_MAPPING",
  "MATCH_SEQUENCE", "NOP", "POP_EXCEPT", "POP_TOP", "PUSH_EXC_INFO", "PUSH_NULL",
  "RAISE_VARARGS", "RERAISE", "RESUME", "RETURN_GENERATOR", "RETURN_VALUE", "SEND",
  "SET_ADD", "SET_UPDATE", "STORE_FAST", "SWAP", "UNARY_INVERT", "UNARY_NEGATIVE",
  "UNARY_NOT", "UNPACK_EX", "UNPACK_SEQUENCE", "WITH_EXCEPT_START", "YIELD_VALUE", "CACHE",
}  # fmt: skip
_INERT = {
  (3, 11): _INERT_COMMON | {
    "ASYNC_GEN_WRAP", "JUMP_IF_FALSE_OR_POP", "JUMP_IF_TRUE_OR_POP", "LIST_TO_TUPLE",
    "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE",
    "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_NONE",
    "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_FORWARD_IF_TRUE", "PRECALL", "PREP_RERAISE_STAR",
    "UNARY_POSITIVE",
  },
  (3, 12): _INERT_COMMON | {
    "BINARY_SLICE", "CALL_INTRINSIC_1", "CALL_INTRINSIC_2", "CLEANUP_THROW", "END_FOR",
    "END_SEND", "JUMP", "JUMP_NO_INTERRUPT", "LOAD_LOCALS", "LOAD_SUPER_ATTR",
    "LOAD_SUPER_METHOD", "LOAD_ZERO_SUPER_ATTR", "LOAD_ZERO_SUPER_METHOD", "POP_BLOCK",
    "POP_JUMP_IF_FALSE", "POP_JUMP_IF_NONE", "POP_JUMP_IF_NOT_NONE", "POP_JUMP_IF_TRUE",
    "RETURN_CONST", "SETUP_CLEANUP", "SETUP_FINALLY", "SETUP_WITH", "STORE_FAST_MAYBE_NULL",
  },
}  # fmt: skip
# Opcodes the recorder does not model: a step that runs one is not replayable
# (`from m import *` and annotations in code that runs in a step, the 3.12 class
# bodies' reads of an enclosing scope, the instrumented forms that dis never shows).
UNMODELLED = {
  "IMPORT_STAR", "SETUP_ANNOTATIONS", "LOAD_FROM_DICT_OR_DEREF", "LOAD_FROM_DICT_OR_GLOBALS",
  "INTERPRETER_EXIT", "RESERVED",
}  # fmt: skip
# Builtins that read or write an object's attributes by a name computed at run time.
ATTR_BUILTINS = {"getattr": "reads", "hasattr": "reads", "vars": "reads",
                 "setattr": "writes", "delattr": "writes"}  # fmt: skip


def known(version=None):
  """The opcode names the tables classify for `version` (default: this one)."""
  version = version or sys.version_info[:2]
  return _HANDLED | _INERT.get(version, set())


# -- plans ---------------------------------------------------------------------------------------


def plan(code):
  """{instruction offset: (kind, chain, name, escapes)} for `code` (see the module
  docstring), found once per code object."""
  out = {}
  instrs = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
  table = known()
  after = []  # the access path on top of the stack after each instruction, or None
  cur = copied = augmented = None
  freevars = set(code.co_freevars)
  reads = []  # (index, offset) of the planned reads, to mark those that escape
  calls = []  # (index, offset) of loads of ATTR_BUILTINS, to find their first argument
  for k, ins in enumerate(instrs):
    op, arg = ins.opname, ins.argval
    if ins.is_jump_target:
      cur = copied = None
    new = None
    if op not in table:
      out[ins.offset] = ("unknown", None, op, False)
    elif op in LOADS:
      kind = LOADS[op]
      new = ((kind, arg),)
      if kind == "global":
        out[ins.offset] = ("global", None, arg, False)
        reads.append((k, ins.offset))
        if arg in ATTR_BUILTINS:
          calls.append((k, ins.offset))
      elif kind == "deref" and arg in freevars:
        out[ins.offset] = ("deref", None, arg, False)
        reads.append((k, ins.offset))
    elif op in ("LOAD_ATTR", "LOAD_METHOD") and cur is not None:
      out[ins.offset] = ("attr", cur, arg, False)
      reads.append((k, ins.offset))
      new = cur + (arg,)
    elif op == "COPY" and ins.arg == 1 and cur is not None:
      new = copied = cur
    elif op == "BINARY_SUBSCR" and k >= 2 and instrs[k - 1].opname == "LOAD_CONST":
      key = instrs[k - 1].argval
      if after[k - 2] is not None and isinstance(key, (str, int)):
        out[ins.offset] = ("item", after[k - 2], key, False)
        reads.append((k, ins.offset))
        new = after[k - 2] + (("item", key),)
    elif (
      op == "BINARY_SUBSCR" and k >= 4 and instrs[k - 1].opname == "COPY" == instrs[k - 2].opname
    ):
      augmented = after[k - 4]  # `d[key] += ...`: d, key, COPY 2, COPY 2, BINARY_SUBSCR
    elif op in ("STORE_ATTR", "DELETE_ATTR"):
      target = cur if cur is not None else (copied if instrs[k - 1].opname == "SWAP" else None)
      out[ins.offset] = ("store_attr", target, arg, False)
    elif op in ("STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE"):
      if op == "STORE_SUBSCR" and instrs[k - 1].opname == "SWAP" and augmented is not None:
        out[ins.offset] = ("store_item", augmented, None, False)  # ... SWAP 3, SWAP 2, STORE
      else:
        out[ins.offset] = ("store_item", _container(instrs, after, k), None, False)
    elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
      out[ins.offset] = ("store_global", None, arg, False)
    elif op in ("STORE_NAME", "DELETE_NAME"):
      out[ins.offset] = ("store_name", None, arg, False)
    elif op in ("STORE_DEREF", "DELETE_DEREF") and arg in freevars:
      out[ins.offset] = ("store_deref", None, arg, False)
    elif op == "PRINT_EXPR":
      out[ins.offset] = ("print", None, None, False)
    after.append(new)
    cur = new
  for k, offset in reads:
    if _escapes(instrs, k):
      kind, chain, name, _ = out[offset]
      out[offset] = (kind, chain, name, True)
  for k, offset in calls:
    kind, _, name, escapes = out[offset]
    out[offset] = ("attr_builtin", _argument(instrs, after, k), name, escapes)
  return out


def _escapes(instrs, k):
  """Whether the value instruction `k` reads leaves its access path: the next
  instruction neither reads an attribute of it nor an item at a constant key."""
  if k + 1 >= len(instrs):
    return True
  nxt = instrs[k + 1]
  if nxt.opname in ("LOAD_ATTR", "LOAD_METHOD") and not nxt.is_jump_target:
    return False
  if nxt.opname == "LOAD_CONST" and k + 2 < len(instrs):
    last = instrs[k + 2].opname
    if last in ("STORE_SUBSCR", "DELETE_SUBSCR", "COPY"):
      return False  # `d[key] = ...`, `del d[key]`, `d[key] += ...`: writes, said as such
    return not (last == "BINARY_SUBSCR" and isinstance(nxt.argval, (str, int)))
  return True


def _argument(instrs, after, k):
  """The access path of the first argument of the call whose callee instruction
  `k` loads (`getattr(cfg, ...)`: cfg), or None when it is not a plain path."""
  m = k + 1
  if m < len(instrs) and instrs[m].opname == "PUSH_NULL":
    m += 1
  if m >= len(instrs) or after[m] is None or len(after[m]) != 1:
    return None
  chain = after[m]
  while m + 1 < len(instrs) and after[m + 1] is not None and after[m + 1][:-1] == chain:
    m += 1
    chain = after[m]
  # The path is the whole first argument when what follows starts the next one (a
  # load) or is the call itself with one argument (`vars(cfg)`); else it is only a
  # part of it (`getattr(make()[0], name)`).
  nxt = instrs[m + 1] if m + 1 < len(instrs) else None
  if nxt is not None and (nxt.opname in LOADS or nxt.opname == "LOAD_CONST"):
    return chain
  if nxt is not None and nxt.opname in ("PRECALL", "CALL") and nxt.arg == 1:
    return chain
  return None


def _container(instrs, after, k):
  """The access path of the container a STORE_SUBSCR / DELETE_SUBSCR at `k`
  writes: what was on the stack under its key (DELETE: under nothing more)."""
  want = {"STORE_SUBSCR": 1, "STORE_SLICE": 2}.get(instrs[k].opname, 0)
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


_DICT_DISPLAYS = ("BUILD_MAP", "BUILD_CONST_KEY_MAP", "DICT_UPDATE")


def dict_locals(code):
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
