"""MirroredStrategy: one replica per local XLA device, synchronous, one SPMD program."""

import torch

from xladist import runtime as _runtime
from xladist import sharding_options
from xladist._global_view import check_axis as _check_axis
from xladist._global_view import concat_stacked as _concat_stacked
from xladist._step.engine import StepEngine
from xladist.communication_options import CommunicationOptions
from xladist.cross_device_ops import check_cross_device_ops
from xladist.extended import StrategyExtended
from xladist.reduce_util import ReduceOp
from xladist.replica_copies import copies_of
from xladist.strategy import Strategy
from xladist.values import PerReplica, reduce_by_form
from xladist.variable_store import VariableStore


class SPMDExtended(StrategyExtended):
  """Replicas are coordinates of a mesh's replica axis; `run` is one manual region."""

  _mirrors_variables = True
  _engine_class = StepEngine  # runs each step; a strategy with more to do declares its own

  def __init__(
    self, strategy, cross_device_ops=None, communication_options=None, cores_per_replica=1
  ):
    super().__init__(strategy)
    self._cross_device_ops = check_cross_device_ops(cross_device_ops, type(strategy).__name__)
    self._communication_options = communication_options or CommunicationOptions()
    n = _runtime.num_devices()
    # Replica r spans devices r*k .. r*k + k - 1 and is named after the first.
    if cores_per_replica > 1:
      _runtime.cores_per_replica(n // cores_per_replica)  # the runtime refuses what it cannot
    self._cores_per_replica = cores_per_replica
    # Every replica's tensors live on torch_xla's one SPMD device; the names
    # must be devices a tensor can be put on (see StrategyExtended.worker_devices).
    self._device_names = (str(_runtime.device()),) * (n // cores_per_replica)
    self._store = VariableStore(_place_variable, len(self._device_names))
    self._engine = self._engine_class(self)
    self._iota = None
    self._device_iota_global = None

  @property
  def experimental_sharding(self):
    """The strategy's ShardingOptions (what it shards over its replicas), or None."""
    return self._store.sharding

  # -- hooks ------------------------------------------------------------------------
  def _enter_scope(self):
    self._store.enter_scope()

  def _exit_scope(self):
    self._store.exit_scope()

  def _current_device(self):
    return _runtime.device()

  def _in_region(self):
    return self._region is not None

  def _broadcast(self, tensor):
    if self._region is not None:
      return tensor
    return _runtime.place_replicated(torch.as_tensor(tensor))

  def _place_inputs(self, tensors):
    # Row r of each tensor goes straight to replica r's device; the host tensors
    # of one element are transferred in one call. A 1-D host tensor (a 0-d
    # element per replica) is transferred, then split: torch_xla 2.9's sharding
    # spec cannot send one straight to a (replica, core) mesh (IndexError).
    n = self._num_replicas_in_sync
    is_dev = _runtime.is_device_tensor
    host = [t for t in tensors if not is_dev(t) and t.dim() > 1]
    placed = iter(_runtime.place_split(host) if host else ())

    def place(t):
      if is_dev(t):
        return _runtime.place_split(t)
      if t.dim() == 1:
        return _runtime.place_split(t.to(_runtime.device()))
      return next(placed)

    return [PerReplica._from_stacked(place(t), n) for t in tensors]

  def _replica_iota(self):
    if self._iota is None:
      # Transferred, then split: a 1-D host tensor cannot be transferred
      # straight to a (replica, core) mesh by torch_xla 2.9's sharding spec.
      self._iota = _runtime.place_split(
        torch.arange(self._num_replicas_in_sync, dtype=torch.int32).to(_runtime.device())
      )
    return self._iota

  def _device_iota(self):
    """Element d on device d (a replica's cores find their index from it)."""
    if self._device_iota_global is None:
      self._device_iota_global = _runtime.place_per_device(
        torch.arange(_runtime.num_devices(), dtype=torch.int32), self._num_replicas_in_sync
      )
    return self._device_iota_global

  # -- run: the step engine (xladist/_step/engine.py) ----------------------------------
  @property
  def _region(self):
    """The Region of the step being traced, else None."""
    return self._engine.region

  def _call_for_each_replica(self, fn, args, kwargs, options=None):
    if self._engine.region is not None:
      return self._engine.call_in_merge(fn, args, kwargs)
    return self._engine.run(fn, args, kwargs, options)

  def _aggregate_for_clipping(self, ctx, tensors):
    """torch's gradient clipping inside a step (`_step/grad_clip.py`)."""
    self._engine.aggregate_for_clipping(ctx, tensors)

  @property
  def _clips_rows(self):
    """Whether clipping in a step scales rows of sharded gradients (`_step/grad_clip.py`)."""
    sharding = self._store.sharding
    return sharding is not None and sharding.shards("gradients")

  def _clip_total_norm(self, tensors, norm_type, total_norm):
    """torch's total gradient norm over sharded gradients' rows (`_step/grad_clip.py`)."""
    return self._engine.clip_total_norm(tensors, norm_type, total_norm)

  def _variable_components(self, tensor):
    """Each replica's component: the rows of a sync-on-read variable's
    components, or each replica's copy of a mirrored one (read from its device:
    copies written with aggregation NONE may differ, as in TF)."""
    n = self._num_replicas_in_sync
    copies = copies_of(tensor)
    if copies is not None:
      return tuple(PerReplica._from_stacked(copies.current(tensor, self._store.describe), n).values)
    return _runtime.replica_copies(tensor, n)

  def _update_each_replica(self, fn, args, kwargs, device):
    """One step whose replicas each run `fn` on their own components, in an
    update context (writes there are each replica's own, as in TF)."""

    def body(a, k):
      step = self._region.step
      return self._in_update_context(device, lambda: step.updating(lambda: fn(*a, **k)))

    return self._strategy_ref.run(body, args=(args, kwargs))

  # -- cross-replica operations ------------------------------------------------------------
  def _options(self, options):
    """The strategy's communication options, overridden by a call's."""
    return self._communication_options.merge(options)

  def _reduce(self, reduce_op, value, axis, options=None):
    if isinstance(value, PerReplica) and value._local is not None:
      return self._batch_reduce_local(reduce_op, [value], [axis], options)[0]
    if axis is None:
      return self._cross_device_ops._reduce_global(reduce_op, value, self._num_replicas_in_sync)
    return super()._reduce(reduce_op, value, axis)

  def _batch_reduce(self, reduce_op, values, options=None):
    return reduce_by_form(
      values,
      lambda vs: self._cross_device_ops._reduce_global_batch(
        reduce_op, vs, self._num_replicas_in_sync, self._options(options)
      ),
      lambda vs: self._batch_reduce_local(reduce_op, vs, [None] * len(vs), options),
    )

  def _batch_reduce_local(self, reduce_op, values, axes, options=None):
    """Reduces merge_call PerReplica values with the strategy's CrossDeviceOps."""
    tensors = []
    for v, axis in zip(values, axes):
      local, region = v._local
      region.require_active("strategy.reduce")
      if axis is not None:
        axis = _check_axis(axis, local.dim(), "strategy.reduce")
        local = _LOCAL_REDUCE[reduce_op](local, axis)
      elif reduce_op is ReduceOp.MEAN and not local.is_floating_point():
        local = local.float()
      tensors.append(local)
    return self._all_reduce_local(reduce_op, tensors, options)

  def _all_reduce_local(self, reduce_op, tensors, options=None):
    """All-reduces local tensors of the active step (ReplicaContext.all_reduce, merge_call)."""
    return self._cross_device_ops._all_reduce_local(
      reduce_op, tensors, self._region, self._options(options)
    )

  def _gather(self, value, axis):
    if isinstance(value, PerReplica) and value._local is not None:
      local, region = value._local
      region.require_active("strategy.gather")
      return _concat_stacked(region.gather_stacked(local), axis, "strategy.gather")
    return super()._gather(value, axis)


def _place_variable(tensor):
  if _runtime.is_device_tensor(tensor):
    _runtime.ensure_sharded(tensor)  # made on the XLA device: mark it replicated
    return None
  return _runtime.place_replicated(tensor)


_LOCAL_REDUCE = {
  ReduceOp.SUM: lambda t, a: t.sum(a),
  ReduceOp.MEAN: lambda t, a: (t if t.is_floating_point() else t.float()).mean(a),
  ReduceOp.MIN: lambda t, a: t.amin(a),
  ReduceOp.MAX: lambda t, a: t.amax(a),
}


class MirroredStrategy(Strategy):
  """Synchronous training with one replica per local XLA device.

  Every replica is a coordinate of a 1-D mesh over the devices; `run` traces the
  step once into one SPMD XLA program in which each replica works on its own
  data and gradients are combined with XLA all-reduces.

  Args:
    devices: None (all local XLA devices), or a list naming every local device
      ("xla:0", "xla:1", ... or torch.device objects). A subset is rejected:
      torch_xla 2.9 requires an SPMD mesh to cover every device.
    cross_device_ops: how reductions are packed and combined: None (the
      default: every reduction is an XLA all-reduce, one per dtype of a batch
      reduction), `NcclAllReduce(num_packs)`, `HierarchicalCopyAllReduce(num_packs)`
      or `ReductionToOneDevice(accumulation_fn=...)`. Used by `strategy.reduce`,
      `extended.reduce_to` / `batch_reduce_to`, `ReplicaContext.all_reduce` and
      the gradient aggregation of `optimizer.step()`.
    communication_options: an `experimental.CommunicationOptions` used by every
      reduction (a call's own options override the fields they set).

  Raises:
    ValueError: `devices` is not the list of all local XLA devices.
    TypeError: `cross_device_ops` is not a CrossDeviceOps, or
      `communication_options` is not a CommunicationOptions.
  """

  def __init__(
    self,
    devices=None,
    cross_device_ops=None,
    communication_options=None,
    experimental_sharding=None,
  ):
    sharding_options.check(experimental_sharding, "MirroredStrategy")
    _runtime.initialize()
    _check_devices(devices, "MirroredStrategy")
    if communication_options is not None and not isinstance(
      communication_options, CommunicationOptions
    ):
      raise TypeError(
        "MirroredStrategy(communication_options=...): expected an "
        "xladist.experimental.CommunicationOptions or None, got "
        f"{type(communication_options).__name__}."
      )
    super().__init__(SPMDExtended(self, cross_device_ops, communication_options))
    self.extended._store.sharding = experimental_sharding


def _check_devices(devices, api):
  n = _runtime.num_devices()
  if devices is None:
    return
  if (
    isinstance(devices, (list, tuple))
    and len(devices) == n
    and all(str(d) == str(_runtime.device()) for d in devices)
  ):
    return  # another strategy's worker_devices: one replica per device
  if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__iter__"):
    raise TypeError(
      f"{api}(devices=...): devices must be a list of devices, got {type(devices).__name__}."
    )
  indices = []
  for d in devices:
    try:
      dev = torch.device(d) if not isinstance(d, int) else torch.device(_runtime.DEVICE_KIND, d)
    except (RuntimeError, TypeError):
      dev = None
    if dev is None or dev.type != _runtime.DEVICE_KIND:
      raise ValueError(
        f"{api}(devices={list(devices)!r}): {d!r} is not an XLA device; xladist "
        "replicas run on XLA devices named 'xla:0' .. "
        f"'xla:{n - 1}'."
      )
    indices.append(0 if dev.index is None else dev.index)
  if sorted(indices) != list(range(n)):
    raise ValueError(
      f"{api}(devices={list(devices)!r}): xladist runs all replicas as one SPMD "
      f"program whose mesh must cover every local XLA device (torch_xla 2.9 "
      f"rejects a mesh over a subset), and this process has {n}: "
      f"'xla:0' .. 'xla:{n - 1}', each once. Pass devices=None, or limit the "
      "devices the process sees before it starts (CPU_NUM_DEVICES on XLA:CPU, "
      "TPU_VISIBLE_CHIPS on TPU)."
    )
