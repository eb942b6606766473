"""How a scheduled function and its arguments travel to a worker.

They are pickled on the chief (standard pickle: functions by reference, so a
scheduled function must be importable on the workers) with persistent ids for
what must not be copied: ps variables (by their VarInfo), the strategy, the
optimizers of ps variables (by a spec from which the worker makes a
`RemoteOptimizer`), per-worker values (by id). `xladist/coordinator/_worker.py`
resolves them on the worker.
"""

import collections
import io
import pickle

import torch

from xladist.coordinator.values import PerWorkerDataset, PerWorkerValues, RemoteValue
from xladist.strategies import parameter_server as ps

# Types that are never sent by reference: skipped at once (pickling a module
# calls persistent_id for every object in it).
_PLAIN = frozenset(
  {str, int, float, bool, bytes, type(None), dict, list, tuple, set, collections.OrderedDict}
)


class _Pickler(pickle.Pickler):
  def __init__(self, file, strategy, coordinator_type):
    super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
    self._strategy = strategy
    self._coordinator_type = coordinator_type

  def persistent_id(self, obj):
    if type(obj) in _PLAIN:
      return None
    if isinstance(obj, torch.Tensor):
      info = ps.info_of(obj)
      return None if info is None else ("v", info)
    if obj is self._strategy:
      return ("s",)
    if isinstance(obj, torch.optim.Optimizer):
      if any(ps.info_of(p) is not None for g in obj.param_groups for p in g["params"]):
        return ("o", self._strategy.extended.optimizer_spec(obj))
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
        "ClusterCoordinator.schedule: the coordinator cannot be sent to a worker; "
        "schedule functions from the chief only."
      )
    return None


def dumps(obj, strategy, coordinator_type, api):
  """Pickles `obj` for a worker.

  Raises:
    TypeError: something in `obj` cannot be pickled (a lambda, a local function,
      a lock, ...).
  """
  buffer = io.BytesIO()
  try:
    _Pickler(buffer, strategy, coordinator_type).dump(obj)
  except (pickle.PicklingError, AttributeError, TypeError) as e:
    if isinstance(e, TypeError) and "coordinator cannot be sent" in str(e):
      raise
    raise TypeError(
      f"{api}: the function and its arguments are sent to the workers by pickling, "
      f"and this failed: {e}. Use a function defined at the top level of a module "
      "the workers can import (or a functools.partial of one), and pass the model, "
      "optimizer and per-worker iterators as arguments; lambdas and functions "
      "defined inside other functions cannot be sent."
    ) from None
  return buffer.getvalue()
