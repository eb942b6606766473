"""`xladist.coordinator`: TF's `tf.distribute.coordinator` for ParameterServerStrategy.

* `ClusterCoordinator(strategy)`: `schedule(fn, args)` -> `RemoteValue`,
  `join()`, `done()`, `fetch(values)`, `create_per_worker_dataset(dataset_fn)`,
  `per_worker_values(fn)`;
* `RemoteValue`: `fetch()` (numpy), `get()` (torch tensors);
* `PerWorkerValues`: one value per worker, resolved on the worker a function runs on;
* `CancelledError`, `TaskUnavailableError`: what a cancelled function and an
  unreachable task raise.
"""

from xladist._ps.rpc import RemoteTraceback, TaskUnavailableError
from xladist.coordinator.cluster_coordinator import ClusterCoordinator
from xladist.coordinator.values import (
  CancelledError,
  PerWorkerDataset,
  PerWorkerIterator,
  PerWorkerValues,
  RemoteValue,
)

__all__ = [
  "CancelledError",
  "ClusterCoordinator",
  "PerWorkerDataset",
  "PerWorkerIterator",
  "PerWorkerValues",
  "RemoteTraceback",
  "RemoteValue",
  "TaskUnavailableError",
]
