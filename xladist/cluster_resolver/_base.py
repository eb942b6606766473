"""`ClusterResolver`, the base of the resolvers; `SimpleClusterResolver`; `is_chief`."""

from xladist import runtime as _runtime
from xladist.cluster_resolver._cluster_spec import ClusterSpec


def _join_rpc(rpc_layer, address):
  return f"{rpc_layer}://{address}" if rpc_layer else address


class ClusterResolver:
  """Base of the cluster resolvers (TF's `tf.distribute.cluster_resolver.ClusterResolver`).

  Subclasses implement `cluster_spec()` and `master()`; the properties
  `task_type`, `task_id`, `rpc_layer` and `environment` are plain settable
  attributes here (None / "" when unknown).
  """

  def __init__(self, task_type=None, task_id=None, rpc_layer=None, environment=""):
    self.task_type = task_type
    self.task_id = task_id
    self.rpc_layer = rpc_layer
    self._environment = environment

  @property
  def task_type(self):
    """This process's job name ("worker", "chief", ...), or None."""
    return self._task_type

  @task_type.setter
  def task_type(self, value):
    if value is not None and not isinstance(value, str):
      raise TypeError(
        f"{type(self).__name__}: task_type must be a string or None, got "
        f"{type(value).__name__} {value!r}."
      )
    self._task_type = value

  @property
  def task_id(self):
    """This process's index within its job, or None."""
    return self._task_id

  @task_id.setter
  def task_id(self, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
      raise TypeError(
        f"{type(self).__name__}: task_id must be an int or None, got "
        f"{type(value).__name__} {value!r}."
      )
    if value is not None and value < 0:
      raise ValueError(f"{type(self).__name__}: task_id must be >= 0, got {value}.")
    self._task_id = value

  @property
  def rpc_layer(self):
    """The protocol prefixed to `master()` addresses ("grpc"), or None."""
    return self._rpc_layer

  @rpc_layer.setter
  def rpc_layer(self, value):
    if value is not None and not isinstance(value, str):
      raise TypeError(
        f"{type(self).__name__}: rpc_layer must be a string or None, got "
        f"{type(value).__name__} {value!r}."
      )
    self._rpc_layer = value

  @property
  def environment(self):
    """The cluster's environment name ("" when none, "google", "cloud", ...)."""
    return self._environment

  def cluster_spec(self):
    """The cluster as a `ClusterSpec`."""
    raise NotImplementedError(f"{type(self).__name__} does not implement cluster_spec().")

  def master(self, task_type=None, task_id=None, rpc_layer=None):
    """The address of a task ("rpc_layer://host:port"), "" when there is none."""
    raise NotImplementedError(f"{type(self).__name__} does not implement master().")

  def _task_master(self, task_type, task_id, rpc_layer):
    """`master()` for resolvers with a `ClusterSpec`: the named or own task."""
    if task_type is None:
      task_type, task_id = self.task_type, self.task_id
    if task_type is None or task_id is None:
      return ""
    address = self.cluster_spec().task_address(task_type, task_id)
    return _join_rpc(rpc_layer if rpc_layer is not None else self.rpc_layer, address)

  def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
    """Accelerators (XLA devices) of one task: {"TPU": n} on TPU, else {"XLA": n}.

    The base version counts this process's addressable XLA devices, which
    initialises xladist's torch_xla runtime; every task is assumed to have the
    same devices (one process per host, identical hosts). `config_proto` is
    accepted for TF compatibility and ignored.
    """
    del task_type, task_id, config_proto
    runtime = _runtime.initialize()
    kind = "TPU" if runtime.device_type == "TPU" else "XLA"
    return {kind: len(_runtime.process_devices()[2])}


def is_chief(cluster_resolver):
  """Whether the resolver's own task is the chief.

  TF's rule: the task of job "chief" when the cluster has one, else task 0 of
  job "worker". A resolver with no task (one process, no cluster) is the chief.

  Raises:
    TypeError: `cluster_resolver` is not a `ClusterResolver`.
  """
  if not isinstance(cluster_resolver, ClusterResolver):
    raise TypeError(
      f"is_chief: expected a ClusterResolver, got "
      f"{type(cluster_resolver).__name__} {cluster_resolver!r}."
    )
  task_type, task_id = cluster_resolver.task_type, cluster_resolver.task_id
  if task_type is None:
    return True
  if "chief" in cluster_resolver.cluster_spec().jobs:
    return task_type == "chief"
  return task_type == "worker" and task_id in (0, None)


class SimpleClusterResolver(ClusterResolver):
  """A resolver told everything (TF's `SimpleClusterResolver`).

  Example:

    >>> r = SimpleClusterResolver(ClusterSpec({"worker": ["a:1", "b:1"]}),
    ...                           task_type="worker", task_id=1, rpc_layer="grpc",
    ...                           num_accelerators={"TPU": 4})
    >>> r.master("worker", 1), r.master(), r.num_accelerators()
    ('grpc://b:1', '', {'TPU': 4})

  Args:
    cluster_spec: a `ClusterSpec` or a dict for one.
    master: what `master()` returns when no task is named ("" by default).
    task_type, task_id, environment, rpc_layer: as the properties.
    num_accelerators: dict of accelerator kind -> count per task (for example
      {"TPU": 4}); None counts this process's XLA devices when asked.

  Raises:
    TypeError: an argument has the wrong type.
  """

  def __init__(
    self,
    cluster_spec,
    master="",
    task_type=None,
    task_id=None,
    environment="",
    num_accelerators=None,
    rpc_layer=None,
  ):
    super().__init__(task_type, task_id, rpc_layer, environment)
    self._cluster_spec = ClusterSpec(cluster_spec)
    if not isinstance(master, str):
      raise TypeError(
        f"SimpleClusterResolver: master must be a string, got {type(master).__name__} {master!r}."
      )
    self._master = master
    if num_accelerators is not None and not (
      isinstance(num_accelerators, dict)
      and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
        for k, v in num_accelerators.items()
      )
    ):
      raise TypeError(
        "SimpleClusterResolver: num_accelerators must be None or a dict of "
        f"accelerator kind -> int such as {{'TPU': 4}}, got {num_accelerators!r}."
      )
    self._num_accelerators = num_accelerators

  def cluster_spec(self):
    return self._cluster_spec

  def master(self, task_type=None, task_id=None, rpc_layer=None):
    """The named task's address, else the `master` given (with `rpc_layer`)."""
    if task_type is not None and task_id is not None:
      return self._task_master(task_type, task_id, rpc_layer)
    rpc = rpc_layer if rpc_layer is not None else self.rpc_layer
    return _join_rpc(rpc, self._master) if self._master else ""

  def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
    if self._num_accelerators is None:
      return super().num_accelerators(task_type, task_id, config_proto)
    return dict(self._num_accelerators)
