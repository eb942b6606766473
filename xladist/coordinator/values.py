"""`RemoteValue` and `PerWorkerValues` (TF's tf.distribute.coordinator values)."""

import enum
import threading

import torch

from xladist._nest import flatten, unflatten


class CancelledError(RuntimeError):
  """The scheduled function was cancelled: an earlier one failed (TF's
  tf.errors.CancelledError); schedule it again."""


class _Status(enum.Enum):
  NOT_READY = "NOT_READY"
  READY = "READY"


class RemoteValue:
  """An asynchronously available value of a scheduled function.

  `ClusterCoordinator.schedule` returns one; it becomes ready when the
  function has run on a worker (or failed, or was cancelled).

  Example::

    with strategy.scope():
      v = xd.Variable(0.0)
    rv = coordinator.schedule(add_and_read, args=(v,))   # returns v + 0.1 on a worker
    rv.fetch()    # array(0.1, dtype=float32), once the function has run
  """

  def fetch(self):
    """Waits for the value and returns it with tensors as numpy arrays (TF's
    `fetch`). Raises the function's error, or CancelledError.

    Afterwards reads on the chief of the variables this function, or any
    function finished before, refers to give their values on the ps tasks
    (those functions' writes included)."""
    raise NotImplementedError

  def get(self):
    """Waits for the value and returns it with tensors as CPU torch tensors."""
    raise NotImplementedError


class RemoteValueImpl(RemoteValue):
  """The RemoteValue of one closure."""

  def __init__(self, coordinator, description, var_ids=()):
    self._coordinator = coordinator
    self._description = description
    self._var_ids = var_ids  # the ps variables the function refers to
    self._finished = None  # its number among finished closures, once it ran
    self._event = threading.Event()
    self._status = _Status.NOT_READY
    self._value = None
    self._error = None
    self._numpy = None

  def __repr__(self):
    return f"RemoteValue({self._description}, {self._status.value})"

  def _set_value(self, value):
    self._value, self._error = value, None
    self._status = _Status.READY
    self._event.set()

  def _set_error(self, error):
    self._value, self._error = None, error
    self._status = _Status.READY
    self._event.set()

  def _wait(self, api):
    self._coordinator._wait_until(self._event.is_set, f"RemoteValue.{api} of {self._description}")
    self._coordinator._refresh_after(self)
    if self._error is not None:
      raise self._error

  def get(self):
    self._wait("get")
    return self._value

  def fetch(self):
    self._wait("fetch")
    if self._numpy is None:
      leaves, spec = flatten(self._value)
      self._numpy = unflatten(
        spec, [x.numpy() if isinstance(x, torch.Tensor) else x for x in leaves]
      )
    return self._numpy


class PerWorkerValues:
  """One value per worker, each living on its worker (TF's PerWorkerValues).

  Passed to `ClusterCoordinator.schedule` (in `args` or `kwargs`), the
  function gets the value of the worker it runs on. Made by
  `iter(coordinator.create_per_worker_dataset(...))` and
  `coordinator.per_worker_values(fn)`.

  Attributes:
    _values: one RemoteValue per worker: ready (None) once the worker made its
      value, or holding the error that prevented it.
  """

  def __init__(self, values, resource_id=None, coordinator=None):
    self._values = tuple(values)
    self._id = resource_id
    self._coordinator = coordinator

  def __repr__(self):
    return f"PerWorkerValues(id={self._id}, workers={len(self._values)})"

  def __del__(self):
    coordinator = getattr(self, "_coordinator", None)
    if coordinator is not None and self._id is not None:
      coordinator._release_resource(self._id)


class PerWorkerIterator(PerWorkerValues):
  """One iterator per worker (TF's PerWorkerDistributedIterator): pass it to a
  scheduled function, which calls `next()` on its worker's iterator."""

  def __iter__(self):
    return self

  def __next__(self):
    raise TypeError(
      "A per-worker iterator lives on the workers: pass it to "
      "ClusterCoordinator.schedule(fn, args=(iterator,)) and call next() on it "
      "inside fn, which gets its worker's iterator."
    )


class PerWorkerDataset:
  """A dataset made on every worker (`ClusterCoordinator.create_per_worker_dataset`).

  `iter(per_worker_dataset)` makes an iterator on every worker and returns
  them as a `PerWorkerValues` (TF's PerWorkerDistributedIterator): pass it to
  scheduled functions, which call `next()` on their worker's iterator.
  """

  def __init__(self, coordinator, values):
    self._coordinator = coordinator
    self._values = values

  def __iter__(self):
    return self._coordinator._make_iterators(self)

  def __repr__(self):
    return f"PerWorkerDataset(id={self._values._id})"
