"""How a scheduled function and its arguments travel to a worker.

They are pickled on the chief with cloudpickle, so that a function defined
inside another function (TF's `worker_fn` in a training script's `main`), a
lambda, or a function of the chief's `__main__` travels by value: its code,
the values it captures and the globals it uses. Importable functions and
classes still travel by reference. What must not be copied travels as a
persistent id, wherever it sits (an argument, a captured variable, a module's
attribute): ps variables (by their VarInfo), the strategy, the optimizers of
ps variables (by a spec from which the worker makes a `RemoteOptimizer`),
per-worker values, datasets and iterators (by id).
`xladist/coordinator/_worker.py` resolves them on the worker, to the worker's
own copy of each variable, its own per-worker values, and a RemoteOptimizer
whose updates the ps tasks apply. A captured model is rebuilt on the worker
around the worker's copies of its variables.

When pickling fails, the captured name (or argument) that cannot travel is
found by pickling each one alone, following functions that capture
functions, and named in the error.
"""

import collections
import functools
import io
import pickle
import types

import cloudpickle
import torch

from xladist.coordinator.values import PerWorkerDataset, PerWorkerValues, RemoteValue
from xladist.strategies import parameter_server as ps

# Types that are never sent by reference: skipped at once (pickling a module
# calls persistent_id for every object in it).
_PLAIN = frozenset(
  {str, int, float, bool, bytes, type(None), dict, list, tuple, set, collections.OrderedDict}
)
_COORDINATOR = "the coordinator cannot be sent"
_DEPTH = 4  # how deep the search for what cannot travel follows captured functions


class _Pickler(cloudpickle.Pickler):
  def __init__(self, file, strategy, coordinator_type):
    super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
    self._strategy = strategy
    self._coordinator_type = coordinator_type
    self.var_ids = set()  # the ps variables the payload refers to

  def persistent_id(self, obj):
    if type(obj) in _PLAIN:
      return None
    if isinstance(obj, torch.Tensor):
      info = ps.info_of(obj)
      if info is None:
        return None
      self.var_ids.add(info.var_id)
      return ("v", info)
    if obj is self._strategy:
      return ("s",)
    if isinstance(obj, torch.optim.Optimizer):
      if any(ps.info_of(p) is not None for g in obj.param_groups for p in g["params"]):
        spec = self._strategy.extended.optimizer_spec(obj)
        self.var_ids.update(info.var_id for _, infos in spec[3] for info in infos)
        return ("o", spec)
      return None
    if isinstance(obj, PerWorkerValues):
      return ("w", obj._id)
    if isinstance(obj, PerWorkerDataset):
      return ("w", obj._values._id)
    if isinstance(obj, RemoteValue):
      raise ValueError(
        "ClusterCoordinator.schedule: a RemoteValue used as an input to a scheduled "
        "function is not supported (as in TF); pass rv.fetch() (its value) instead."
      )
    if isinstance(obj, self._coordinator_type):
      raise TypeError(
        f"ClusterCoordinator.schedule: {_COORDINATOR} to a worker; schedule "
        "functions from the chief only."
      )
    return None


def dumps(fn, args, kwargs, strategy, coordinator_type, api, arg_names=None):
  """Pickles `(fn, args, kwargs)` for a worker.

  `arg_names` names the arguments in errors (default "args[i]"); with it,
  `fn` is xladist's own and is not searched.

  Returns:
    (the payload, the ids of the ps variables it refers to).

  Raises:
    TypeError: something the function captures, or an argument, cannot be
      pickled (a lock, an open file, a generator, the coordinator, ...); the
      message names it.
    ValueError: a RemoteValue is among them (named too).
  """
  buffer = io.BytesIO()
  pickler = _Pickler(buffer, strategy, coordinator_type)
  try:
    pickler.dump((fn, args, kwargs))
  except Exception as e:  # noqa: BLE001 - re-raised below, naming what failed
    path, value, error = _culprit(fn, args, kwargs, strategy, coordinator_type, arg_names)
    error = error or e
    what = _describe(path, value) if path else "the function or its arguments"
    what += "," if path and len(path) > 1 else ""
    if isinstance(error, ValueError):
      raise ValueError(f"{error} It is {what.rstrip(',')}.") from None
    if _COORDINATOR in str(error):
      raise TypeError(
        f"{api}: {what} cannot be sent to the workers: the coordinator stays on "
        "the chief; schedule functions from the chief only."
      ) from None
    raise TypeError(
      f"{api}: {what} cannot be sent to the workers ({_short(error)}). A scheduled "
      "function travels by value with what it captures (cloudpickle); the "
      "strategy's variables, models, optimizers and per-worker values and "
      "iterators travel as references. Make the object on the worker instead "
      "(inside the function, or with coordinator.per_worker_values(fn)), or "
      "capture a value that can be pickled."
    ) from None
  return buffer.getvalue(), frozenset(pickler.var_ids)


# -- finding what cannot travel ---------------------------------------------------------


def _culprit(fn, args, kwargs, strategy, coordinator_type, arg_names):
  """(path, value, error) of the first captured value or argument that cannot
  be pickled, or (None, None, None). `path`: what was passed (e.g. "the
  function main.<locals>.worker_fn", "args[1]"), then the captured names
  leading to the value."""

  def fails(value):
    try:
      _Pickler(io.BytesIO(), strategy, coordinator_type).dump(value)
    except Exception as e:  # noqa: BLE001 - the answer
      return e
    return None

  def search(value, path):
    error = fails(value)
    if error is None:
      return None
    if len(path) <= _DEPTH:
      for name, inner in _captures(value):
        found = search(inner, path + [name])
        if found is not None:
          return found
    return path, value, error

  name = getattr(fn, "__qualname__", None) or type(fn).__name__
  candidates = [] if arg_names else [(f"the function {name}", fn)]
  names = arg_names or [f"args[{i}]" for i in range(len(args))]
  candidates += list(zip(names, args))
  candidates += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
  for label, value in candidates:
    found = search(value, [label])
    if found is not None:
      return found
  return None, None, None


def _describe(path, value):
  """ "'lock' (a lock), captured by 'helper', captured by the function outer"."""
  kind = f"(a {type(value).__name__})"
  if len(path) == 1:
    return f"{path[0]} {kind}"
  by = [repr(n) for n in reversed(path[1:-1])] + [path[0]]
  return f"{path[-1]!r} {kind}, captured by " + ", captured by ".join(by)


def _captures(value):
  """(name, value) of what a function sends with it: its closure cells, the
  globals its code uses (cloudpickle sends those of functions it sends by
  value), a partial's function and arguments, a bound method's object."""
  if isinstance(value, functools.partial):
    yield "func", value.func
    for i, a in enumerate(value.args):
      yield f"args[{i}]", a
    yield from value.keywords.items()
    return
  if isinstance(value, types.MethodType):
    yield "self", value.__self__
    return
  if not isinstance(value, types.FunctionType):
    return
  code = value.__code__
  for name, cell in zip(code.co_freevars, value.__closure__ or ()):
    try:
      yield name, cell.cell_contents
    except ValueError:  # an empty cell
      continue
  for name in _global_names(code):
    if name in value.__globals__:
      inner = value.__globals__[name]
      if not isinstance(inner, types.ModuleType):
        yield name, inner


def _global_names(code):
  names = list(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names += _global_names(const)
  return list(dict.fromkeys(names))


def _short(e):
  text = str(e).strip().splitlines()
  return text[0] if text else type(e).__name__
