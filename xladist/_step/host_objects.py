"""What the replay recorder knows of host objects (python_effects.py).

Which attribute tables are a module's or an optimizer's own (their structure,
modes and hyperparameters are the signature's, the slots' and the Hypers', not
reads), which methods read or change a container, whether an object's items are
found by Python code, the functions of a code object, the host random-number
generators a step may draw from, and the `nn.Module.train` calls a traced step
makes itself (told to the recorders tracing then).
"""

import gc
import random
import sys
import types

import torch

from xladist._step.read_guards import MISSING

# nn.Module's own tables and flags (every instance has them): its structure and
# modes are the signature's and the "module" locations' (read_guards.py), not reads
MODULE_OWN = frozenset(torch.nn.Module().__dict__)
# an optimizer's tables: its hyperparameters are program inputs and its state slots
# (hyper.py, replay_slots.py), not reads
OPTIMIZER_OWN = frozenset(("param_groups", "state", "defaults"))
READERS = {"get", "keys", "values", "items", "copy", "index", "count", "__getitem__",
            "__contains__", "__iter__", "__len__", "most_common", "fromkeys"}  # fmt: skip

MUTATORS = {
  "append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
  "update", "setdefault", "popitem", "add", "discard", "difference_update",
  "intersection_update", "symmetric_difference_update", "appendleft", "extendleft",
  "popleft", "rotate", "__setitem__", "__delitem__",
}  # fmt: skip


MODE_SETTERS = []  # the recorders tracing now, told of each nn.Module.train call
TRAIN = torch.nn.Module.train


def train(self, mode=True):
  for tell in MODE_SETTERS:
    tell(self)
  return TRAIN(self, mode)


train.__wrapped__ = TRAIN
train.__doc__ = TRAIN.__doc__


def python_getitem(klass):
  """Whether items of `klass` are found by a Python `__getitem__` (a frame followed
  like any other) rather than by C code."""
  for k in klass.__mro__:
    if "__getitem__" in k.__dict__:
      return isinstance(k.__dict__["__getitem__"], types.FunctionType)
  return False


def own_table(obj, name):
  if isinstance(obj, torch.nn.Module):
    return name in MODULE_OWN
  return isinstance(obj, torch.optim.Optimizer) and name in OPTIMIZER_OWN


def path(chain):
  if chain is None:
    return "?"
  out = str(chain[0][1])
  for step in chain[1:]:
    out += f"[{step[1]!r}]" if type(step) is tuple else f".{step}"
  return out


def methods_of(frame, code):
  """The functions of `code` among the attributes of the class of the frame's first
  argument (a method called by C code: a dataclass's generated `__init__`)."""
  if not code.co_argcount:
    return []
  first = frame.f_locals.get(code.co_varnames[0], MISSING)
  out = []
  for klass in (first if isinstance(first, type) else type(first)).__mro__:
    for attr in list(vars(klass).values()):
      fn = getattr(attr, "__func__", getattr(attr, "fget", attr))
      if getattr(fn, "__code__", None) is code and getattr(fn, "__closure__", None):
        out.append(fn)
  return out


def functions_of(code):
  """The functions of `code` alive now (a closure xladist never saw loaded: made
  by C code, or reached through a container), found through the collector."""
  return [f for f in gc.get_referrers(code) if type(f) is types.FunctionType and f.__closure__]


# -- host random-number generators ---------------------------------------------------------------

RNG_NAMES = ("random", "numpy.random", "torch's CPU generator")


def rng_states():
  np = sys.modules.get("numpy")
  np_state = None
  if np is not None:
    try:
      np_state = np.random.get_state(legacy=False)
    except Exception:
      np_state = None
  return (random.getstate(), np_state, torch.default_generator.get_state())


def same_state(a, b):
  if isinstance(a, torch.Tensor):
    return torch.equal(a, b)
  if isinstance(a, dict):
    np = sys.modules["numpy"]
    return a.keys() == b.keys() and all(
      np.array_equal(a[k], b[k]) if hasattr(a[k], "shape") else same_state(a[k], b[k]) for k in a
    )
  return a == b
