"""MultiWorkerMirroredStrategy: MirroredStrategy across hosts, one process per host.

Every host runs this same program; torch_xla's multi-host runtime (PJRT) joins
the hosts' devices into one mesh whose replica axis spans them all, so a step
is ONE SPMD program and its all-reduces cross hosts inside it. The cluster
(which hosts, which one this process is) comes from a cluster resolver; see
`xladist/cluster_resolver/_multihost.py` for how it is mapped onto the
runtime's settings. On the jax runtime (`XLADIST_BACKEND=jax`) the hosts join
through `jax.distributed` (gloo on CPU), and every step and reduction is
waited for with a bound (`CommunicationOptions.timeout_seconds`, default
600 s): a host that died or stalled makes the others fail with an error
naming it, never hang.

Host-level behaviour (TF's): `extended.experimental_between_graph` is True;
only the chief has `should_checkpoint` and `should_save_summary`; each host
feeds only its own replicas (host h: replicas [h*R/H, (h+1)*R/H)), with
`InputContext.input_pipeline_id` = host index.
"""

import torch

from xladist import runtime as _runtime
from xladist import sharding_options
from xladist.cluster_resolver import _multihost
from xladist.communication_options import CommunicationOptions
from xladist.input import dataset as input_dataset
from xladist.input import sharding
from xladist.input.options import InputReplicationMode
from xladist.replica_copies import copies_of
from xladist.strategies.mirrored import SPMDExtended
from xladist.strategy import Strategy
from xladist.values import DistributedValues, PerReplica

_API = "MultiWorkerMirroredStrategy"


class MultiWorkerExtended(SPMDExtended):
  """SPMDExtended over every host's devices, with the host's place in the cluster.

  Args:
    strategy: the MultiWorkerMirroredStrategy.
    cluster: the `_multihost.ClusterInfo` of this process.
    cluster_resolver: the resolver it came from (`strategy.cluster_resolver`).
    communication_options: the strategy's default `CommunicationOptions`.
    cores_per_replica: devices per replica (TPUStrategy's logical devices).
    api: the strategy's name, for messages.
  """

  def __init__(
    self,
    strategy,
    cluster,
    cluster_resolver,
    communication_options=None,
    cores_per_replica=1,
    api=_API,
  ):
    super().__init__(strategy, None, communication_options, cores_per_replica)
    self._api = api
    self._cluster = cluster
    self._cluster_resolver = cluster_resolver
    self._host_replicas = _multihost.host_replicas(cluster, self._num_replicas_in_sync, api)

  # -- host-level facts -----------------------------------------------------------
  @property
  def experimental_between_graph(self):
    """True: every host runs this program for its own replicas."""
    return True

  @property
  def experimental_should_init(self):
    """True: every host initialises the variables (they are mirrored)."""
    return True

  @property
  def should_checkpoint(self):
    """True only on the chief (`cluster_resolver.is_chief`)."""
    return self._cluster.is_chief

  @property
  def should_save_summary(self):
    """True only on the chief (`cluster_resolver.is_chief`)."""
    return self._cluster.is_chief

  @property
  def _input_hosts(self):
    """(num_hosts, host_index) for the input layer, None on one host."""
    if self._host_replicas is None:
      return None
    return self._cluster.num_workers, self._cluster.task_index

  def _fed_replicas(self):
    if self._host_replicas is None:
      return super()._fed_replicas()
    return self._host_replicas

  def _group_leaf(self, components):
    if self._host_replicas is None:
      return super()._group_leaf(components)
    if not all(isinstance(c, torch.Tensor) for c in components):
      raise TypeError(
        f"{self._api}.experimental_distribute_values_from_function: on several "
        "hosts value_fn must return tensors (each host builds only its own "
        f"replicas' values), got {type(components[0]).__name__}."
      )
    n = self._num_replicas_in_sync
    stacked = torch.stack([c.detach().cpu() for c in components])
    return PerReplica._from_stacked(
      _multihost.place_host_rows([stacked], self._host_replicas, n)[0], n
    )

  def _local_results(self, value):
    """TF's meaning on several hosts: the components of this host's replicas."""
    if self._host_replicas is None or not isinstance(value, DistributedValues):
      return super()._local_results(value)
    if isinstance(value, PerReplica) and value._stacked is not None:
      return _multihost.local_components(
        value._stacked, self._host_replicas, self._num_replicas_in_sync
      )
    return tuple(value.values[r] for r in self._host_replicas)

  # -- bounded waits (the jax runtime) --------------------------------------------
  def _bounds_each_step(self):
    """Whether every step and reduction is waited for, bounded: on several hosts
    on the jax runtime, whose gloo collectives never return when a peer died or
    stopped (and where every later program queues behind such a one)."""
    return self._host_replicas is not None and _runtime.BACKEND == "jax"

  def _call_for_each_replica(self, fn, args, kwargs, options=None):
    if not self._bounds_each_step() or self._in_region():
      return super()._call_for_each_replica(fn, args, kwargs, options)
    out = super()._call_for_each_replica(fn, args, kwargs, options)
    _multihost.wait_for_step(f"{self._api}.run: the step")
    return out

  def _reduce(self, reduce_op, value, axis, options=None):
    out = super()._reduce(reduce_op, value, axis, options)
    if (
      self._bounds_each_step()
      and not self._tracing()
      and isinstance(out, torch.Tensor)
      and _runtime.is_device_tensor(out)
    ):
      _multihost.wait_for_hosts([out], f"{self._api}.reduce: the reduction")
    return out

  def _variable_components(self, tensor):
    """On several hosts on the jax runtime, this host's replicas' components of
    a variable (TF's experimental_local_results there), read from this host's
    devices (the other hosts' copies are not addressable here)."""
    if self._host_replicas is None or _runtime.BACKEND != "jax":
      return super()._variable_components(tensor)
    n = self._num_replicas_in_sync
    copies = copies_of(tensor)
    if copies is not None:  # sync-on-read: each replica's row
      stacked = copies.current(tensor, self._store.describe)
      return _multihost.local_components(stacked, self._host_replicas, n)
    return _multihost.local_copies(tensor, self._host_replicas, n)

  def _check_local_devices(self):
    """This host's devices must be its replicas' (checked at start, not at the first batch)."""
    if self._host_replicas is not None:
      _multihost.local_shard_rows(
        _runtime.process_devices()[2],
        self._host_replicas,
        self._api,
        self._cores_per_replica,
      )

  # -- input ------------------------------------------------------------------------
  def _experimental_distribute_dataset(self, dataset, options):
    if self._input_hosts is None:
      return super()._experimental_distribute_dataset(dataset, options)
    return input_dataset.from_dataset(
      self, dataset, options, "strategy.experimental_distribute_dataset", hosts=self._input_hosts
    )

  def _distribute_datasets_from_function(self, dataset_fn, options):
    if self._input_hosts is None:
      return super()._distribute_datasets_from_function(dataset_fn, options)
    api = "strategy.distribute_datasets_from_function"
    per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    datasets = []
    for ctx in sharding.input_contexts(*self._input_hosts, self._num_replicas_in_sync, per_replica):
      dataset = dataset_fn(ctx)
      input_dataset.check_dataset(
        dataset, api, f"what dataset_fn returned for pipeline {ctx.input_pipeline_id}"
      )
      datasets.append(dataset)
    return input_dataset.from_datasets(self, datasets, options, api, hosts=self._input_hosts)

  def _place_inputs(self, tensors):
    if self._host_replicas is None:
      return super()._place_inputs(tensors)
    if any(_runtime.is_device_tensor(t) for t in tensors):
      raise TypeError(
        f"{self._api}: a dataset yielded a tensor on an XLA device; on several hosts "
        "datasets must yield host (CPU) tensors, which xladist transfers to this "
        "host's replicas."
      )
    n = self._num_replicas_in_sync
    placed = _multihost.place_host_rows(tensors, self._host_replicas, n)
    return [PerReplica._from_stacked(t, n) for t in placed]


class MultiWorkerMirroredStrategy(Strategy):
  """Synchronous training on every XLA device of several hosts (TF's MultiWorkerMirroredStrategy).

  Run the same program on every host, one process per host. The strategy
  starts torch_xla's multi-host runtime for the cluster its resolver
  describes; the replicas are all devices of all hosts (host h's devices are
  replicas h*D .. h*D + D - 1) and each step is ONE SPMD program whose
  all-reduces span the hosts. A single-worker cluster (no TF_CONFIG) is
  MirroredStrategy on this host's devices.

  Example, TF_CONFIG on host 1 of 2::

    TF_CONFIG='{"cluster": {"worker": ["10.0.0.2:8476", "10.0.0.3:8476"]},
                "task": {"type": "worker", "index": 1}}'

    strategy = xd.MultiWorkerMirroredStrategy()
    strategy.num_replicas_in_sync          # 8 with 4 devices per host
    strategy.extended.should_checkpoint    # False: only worker 0 writes

  Args:
    cluster_resolver: a `cluster_resolver.ClusterResolver`; None reads
      TF_CONFIG (`TFConfigClusterResolver`), and on TPU with no TF_CONFIG
      cluster the slice (`TPUClusterResolver()`). The chief (job "chief", else
      worker 0) is host 0 and the coordinator; the workers follow by index.
    communication_options: an `experimental.CommunicationOptions` used by every
      reduction (a call's own options override the fields they set); its
      `timeout_seconds` also bounds the wait for the other hosts to join
      (default 600 s).

  Raises:
    TypeError: `cluster_resolver` is not a ClusterResolver, or
      `communication_options` is not a CommunicationOptions.
    ValueError: the cluster is malformed or does not contain this task (see
      the message), or the environment contradicts it.
    NotImplementedError: several hosts on XLA:CPU with torch_xla (2.9 has no
      cross-process CPU runtime; the jax runtime, XLADIST_BACKEND=jax, has).
    TimeoutError: the other hosts did not join in time.
    RuntimeError: torch_xla's runtime disagrees with the resolver (e.g. it was
      started before this strategy).
  """

  def __init__(self, cluster_resolver=None, communication_options=None, experimental_sharding=None):
    sharding_options.check(experimental_sharding, _API)
    if communication_options is not None and not isinstance(
      communication_options, CommunicationOptions
    ):
      raise TypeError(
        f"{_API}(communication_options=...): expected an "
        "xladist.experimental.CommunicationOptions or None, got "
        f"{type(communication_options).__name__}."
      )
    if cluster_resolver is None:
      cluster_resolver = _multihost.default_resolver(_runtime.device_type)  # asked lazily
    timeout = communication_options.timeout_seconds if communication_options else None
    cluster = _multihost.initialize(cluster_resolver, _API, timeout)
    extended = MultiWorkerExtended(self, cluster, cluster_resolver, communication_options)
    extended._check_local_devices()
    super().__init__(extended)
    extended._store.sharding = experimental_sharding
