"""TPUStrategy: MirroredStrategy's replicas, each over one or several TPU cores.

Without a device assignment every device is a replica, exactly as in
MirroredStrategy. `experimental_device_assignment=DeviceAssignment.build(...,
computation_shape=[k], num_replicas=R)` gives each replica k devices (TF's
logical devices): the mesh is (R, k), named ("replica", "core"). Inside `run`,
`experimental_split_to_logical_devices` divides a tensor's work over the
replica's cores (see xladist/_logical.py for how, docs/architecture.md for why
this route).
"""

import math

import numpy as np
import torch

from xladist import _logical, context, sharding_options
from xladist import cluster_resolver as resolvers
from xladist import runtime as _runtime
from xladist.cluster_resolver import _multihost
from xladist.strategies.multi_worker import MultiWorkerExtended
from xladist.strategy import Strategy

_API = "TPUStrategy"


class DeviceAssignment:
  """Which devices each replica's logical devices are (TF's `tpu.experimental.DeviceAssignment`).

  Build one with `DeviceAssignment.build`. Replica r's logical device c is
  device r * k + c of the process's XLA devices (k = num_cores_per_replica).

  Attributes:
    num_replicas: the number of replicas.
    num_cores_per_replica: the logical devices (cores) of each replica.
    core_assignment: an int array (num_replicas, num_cores_per_replica) of
      device ordinals.
  """

  def __init__(self, num_replicas, num_cores_per_replica):
    self.num_replicas = num_replicas
    self.num_cores_per_replica = num_cores_per_replica
    self.core_assignment = np.arange(num_replicas * num_cores_per_replica).reshape(
      num_replicas, num_cores_per_replica
    )

  @classmethod
  def build(cls, topology=None, computation_shape=None, computation_stride=None, num_replicas=1):
    """A device assignment of `num_replicas` replicas of `prod(computation_shape)` cores.

    Args:
      topology: None (this process's XLA devices). xladist has no TPU topology
        object: a value other than None is rejected.
      computation_shape: the shape of one replica's block of cores, e.g. [2] or
        TF's [1, 1, 1, 2]; its product is the number of logical devices per
        replica. None: one core per replica.
      computation_stride: must be None or all ones (replicas are consecutive
        blocks of devices).
      num_replicas: replicas; num_replicas * cores per replica must be the
        number of XLA devices (the SPMD mesh covers all of them). None (an
        xladist extension): as many as the devices hold.

    Raises:
      ValueError / TypeError: an argument out of range, with what to pass instead.
    """
    api = "DeviceAssignment.build"
    if topology is not None:
      raise ValueError(
        f"{api}(topology=...): xladist reads the topology from the XLA devices of "
        "this process; pass topology=None (TF's initialize_tpu_system has no "
        "counterpart here)."
      )
    shape = [1] if computation_shape is None else list(computation_shape)
    if not shape or any(
      isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in shape
    ):
      raise ValueError(
        f"{api}: computation_shape must be a non-empty list of positive "
        f"ints, got {computation_shape!r}."
      )
    if computation_stride is not None and any(s != 1 for s in computation_stride):
      raise ValueError(
        f"{api}: computation_stride={list(computation_stride)!r} is not "
        "supported; a replica's cores are consecutive devices."
      )
    k = int(math.prod(shape))
    n = _runtime.num_devices()
    if num_replicas is None:
      if n % k:
        raise ValueError(
          f"{api}(computation_shape={shape}): {k} cores per replica do not divide "
          f"the {n} XLA devices of this process; the SPMD mesh must cover all of "
          "them (torch_xla 2.9 rejects a mesh over a subset)."
        )
      num_replicas = n // k
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
      raise ValueError(f"{api}: num_replicas must be a positive int or None, got {num_replicas!r}.")
    if num_replicas * k != n:
      raise ValueError(
        f"{api}(computation_shape={shape}, num_replicas={num_replicas}): "
        f"{num_replicas} replicas x {k} cores = {num_replicas * k} devices, but "
        f"the SPMD mesh must cover all {n} XLA devices of this process "
        "(torch_xla 2.9 rejects a mesh over a subset). Choose num_replicas * "
        f"cores per replica = {n}."
      )
    return cls(num_replicas, k)

  def tpu_ordinal(self, replica=0, logical_core=0):
    """The device ordinal of `replica`'s logical device `logical_core`."""
    return int(self.core_assignment[replica, logical_core])

  def __repr__(self):
    return (
      f"DeviceAssignment(num_replicas={self.num_replicas}, "
      f"num_cores_per_replica={self.num_cores_per_replica})"
    )


class TPUExtended(MultiWorkerExtended):
  """The replicas of every host of a TPU slice, k devices per replica.

  On a pod each host runs this program for its own replicas, as with
  MultiWorkerMirroredStrategy: each host feeds its replicas, only the chief
  (worker 0) checkpoints. (TF drives a pod from one client, so its TPUStrategy
  says between_graph False and checkpoints from that client.)
  """

  def __init__(self, strategy, cluster, cluster_resolver, device_assignment):
    super().__init__(
      strategy,
      cluster,
      cluster_resolver,
      cores_per_replica=device_assignment.num_cores_per_replica,
      api=_API,
    )
    self._device_assignment = device_assignment

  @property
  def num_logical_devices_per_replica(self):
    """The devices (TF's logical devices) of each replica."""
    return self._cores_per_replica

  @property
  def num_hosts(self):
    """The hosts (processes) of the slice."""
    return self._cluster.num_workers

  @property
  def num_replicas_per_host(self):
    """The replicas each host feeds."""
    return self._num_replicas_in_sync // self._cluster.num_workers

  @property
  def experimental_device_assignment(self):
    """The `DeviceAssignment` the strategy was built with."""
    return self._device_assignment


class TPUStrategy(Strategy):
  """Synchronous training on TPU cores (any XLA devices), TF's `TPUStrategy`.

  Args:
    tpu_cluster_resolver: a `cluster_resolver.TPUClusterResolver` (or any
      ClusterResolver) describing the TPU VM; None reads this VM's environment
      on TPU, and describes this one process elsewhere (XLA:CPU).
    experimental_device_assignment: None (one replica per device) or a
      `experimental.DeviceAssignment` giving each replica several devices,
      whose work `experimental_split_to_logical_devices` divides.

  Raises:
    TypeError: an argument of the wrong type.
  """

  def __init__(
    self, tpu_cluster_resolver=None, experimental_device_assignment=None, experimental_sharding=None
  ):
    sharding_options.check(experimental_sharding, "TPUStrategy")
    if tpu_cluster_resolver is None:
      # On a TPU VM, its environment; elsewhere (XLA:CPU, development) this one
      # process and its devices.
      tpu_cluster_resolver = (
        resolvers.TPUClusterResolver()
        if _runtime.device_type() == "TPU"
        else resolvers.SimpleClusterResolver(resolvers.ClusterSpec({}))
      )
    elif not isinstance(tpu_cluster_resolver, resolvers.ClusterResolver):
      raise TypeError(
        "TPUStrategy(tpu_cluster_resolver=...): expected a "
        "xladist.cluster_resolver.TPUClusterResolver (or another ClusterResolver) "
        f"or None, got {type(tpu_cluster_resolver).__name__}."
      )
    assignment = experimental_device_assignment
    if assignment is None:
      assignment = DeviceAssignment(_runtime.num_devices(), 1)
    elif not isinstance(assignment, DeviceAssignment):
      raise TypeError(
        "TPUStrategy(experimental_device_assignment=...): expected an "
        "xladist.experimental.DeviceAssignment (DeviceAssignment.build(...)) or "
        f"None, got {type(assignment).__name__}."
      )
    # On a pod (several workers) this starts torch_xla's multi-host runtime.
    cluster = _multihost.initialize(tpu_cluster_resolver, _API)
    extended = TPUExtended(self, cluster, tpu_cluster_resolver, assignment)
    extended._check_local_devices()
    super().__init__(extended)
    extended._store.sharding = experimental_sharding

  # -- logical devices ---------------------------------------------------------------
  def _core_axis(self, api):
    ctx = context.get_replica_context()
    region = self._extended._region
    if region is None or ctx is None or ctx.strategy is not self:
      raise RuntimeError(
        f"{api} is called inside the step function of this strategy's run(): it "
        "divides a replica's tensor over the replica's logical devices."
      )
    return region.core_axis

  def _num_cores(self):
    return self._extended._cores_per_replica

  def experimental_split_to_logical_devices(self, tensor, partition_dimensions):
    """`tensor` divided over the replica's logical devices; the math is unchanged.

    Dim d of `tensor` is cut into `partition_dimensions[d]` equal blocks; logical
    device c holds block c in row-major order over `partition_dimensions`.
    Operations on the result run on the blocks where that is exact (pointwise
    ops, matrix products, transposes, sums, leading-dim views; see
    xladist/_logical.py) and on the reassembled tensor otherwise.

    Args:
      tensor: a tensor of the replica (inside `run`).
      partition_dimensions: one positive int per dim of `tensor`; their product
        is the number of logical devices per replica, and each divides its dim.

    Raises:
      RuntimeError: called outside this strategy's `run`.
      ValueError: `partition_dimensions` does not fit `tensor` or the replica.
    """
    api = "TPUStrategy.experimental_split_to_logical_devices"
    axis = self._core_axis(api)
    if not isinstance(tensor, torch.Tensor):
      raise TypeError(f"{api}: expected a tensor, got {type(tensor).__name__}.")
    tensor = _logical.whole(tensor)
    dims = list(partition_dimensions) if isinstance(partition_dimensions, (list, tuple)) else None
    if dims is None or any(
      isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1 for p in dims
    ):
      raise ValueError(
        f"{api}: partition_dimensions must be a list of positive ints, "
        f"got {partition_dimensions!r}."
      )
    dims = [int(p) for p in dims]
    if len(dims) != tensor.dim():
      raise ValueError(
        f"{api}: partition_dimensions {dims} has {len(dims)} entries but the tensor "
        f"has {tensor.dim()} dims (shape {tuple(tensor.shape)}); give one per dim."
      )
    k = self._num_cores()
    if math.prod(dims) != k:
      raise ValueError(
        f"{api}: the product of partition_dimensions {dims} is {math.prod(dims)}, "
        f"but each replica has {k} logical devices; the product must equal {k}."
      )
    for d, (size, p) in enumerate(zip(tensor.shape, dims)):
      if size % p:
        raise ValueError(
          f"{api}: dim {d} of the tensor (shape {tuple(tensor.shape)}) has size "
          f"{size}, which {p} logical devices cannot share evenly; pad it to a "
          f"multiple of {p}."
        )
    if k == 1:
      return tensor
    return _logical.split(tensor, dims, axis)

  def experimental_assign_to_logical_device(self, tensor, logical_device_id):
    """`tensor` placed on one logical device of the replica (TF's semantics).

    In xladist's route every core of a replica computes the replica's unsplit
    operations, so the value is already on logical device `logical_device_id`
    (and the others): the result is `tensor`, reassembled if it was split.

    Raises:
      RuntimeError: called outside this strategy's `run`.
      ValueError: `logical_device_id` is not in [0, logical devices per replica).
    """
    api = "TPUStrategy.experimental_assign_to_logical_device"
    self._core_axis(api)
    k = self._num_cores()
    if (
      isinstance(logical_device_id, bool)
      or not isinstance(logical_device_id, (int, np.integer))
      or not 0 <= logical_device_id < k
    ):
      raise ValueError(
        f"{api}: logical_device_id must be an int in [0, {k}) (each replica has "
        f"{k} logical devices), got {logical_device_id!r}."
      )
    return _logical.whole(tensor)

  def experimental_replicate_to_logical_devices(self, tensor):
    """`tensor` whole on every logical device of the replica (reassembled if split).

    Raises:
      RuntimeError: called outside this strategy's `run`.
    """
    self._core_axis("TPUStrategy.experimental_replicate_to_logical_devices")
    return _logical.whole(tensor)
