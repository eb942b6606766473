"""MirroredStrategy: one replica per local XLA device, synchronous, one SPMD program."""

import sys
import traceback

import torch
from torch.optim import optimizer as torch_optimizer

from xladist import (
  _grad_clip,
  _replay,
  _runtime,
  _xm_in_step,
  context,
)
from xladist._global_view import check_axis as _check_axis
from xladist._global_view import concat_stacked as _concat_stacked
from xladist._region import HOST_READ_MESSAGE, Region
from xladist._step_tensors import StepTensors, describe_fn
from xladist.communication_options import CommunicationOptions
from xladist.cross_device_ops import check_cross_device_ops
from xladist.extended import StrategyExtended
from xladist.reduce_util import ReduceOp
from xladist.replica_context import ReplicaContext
from xladist.strategy import Strategy
from xladist.values import PerReplica, flatten, reduce_by_form, tree_map, unflatten
from xladist.variable_store import VariableStore, copies_of


class SPMDExtended(StrategyExtended):
  """Replicas are coordinates of a mesh's replica axis; `run` is one manual region."""

  _mirrors_variables = True

  def __init__(
    self, strategy, cross_device_ops=None, communication_options=None, cores_per_replica=1
  ):
    super().__init__(strategy)
    self._cross_device_ops = check_cross_device_ops(cross_device_ops, type(strategy).__name__)
    self._communication_options = communication_options or CommunicationOptions()
    n = _runtime.num_devices()
    # Replica r spans devices r*k .. r*k + k - 1 and is named after the first.
    self._cores_per_replica = cores_per_replica
    # Every replica's tensors live on torch_xla's one SPMD device; the names
    # must be devices a tensor can be put on (see StrategyExtended.worker_devices).
    self._device_names = (str(_runtime.device()),) * (n // cores_per_replica)
    self._store = VariableStore(_place_variable, len(self._device_names))
    self._region = None
    self._iota = None
    self._device_iota_global = None

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
    # of one element are transferred in one call.
    n = self._num_replicas_in_sync
    host = [t for t in tensors if t.device.type != "xla"]
    placed = iter(_runtime.place_split_many(host) if host else ())
    return [
      PerReplica._from_stacked(
        _runtime.place_split(t) if t.device.type == "xla" else next(placed), n
      )
      for t in tensors
    ]

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

  # -- run ------------------------------------------------------------------------------
  def _call_for_each_replica(self, fn, args, kwargs):
    if self._region is not None:
      return self._call_in_merge(fn, args, kwargs)
    strategy = self._strategy_ref
    store = self._store
    _grad_clip.ensure_installed()
    placed = bool(store._pending)
    store.place_pending()
    _runtime.follow_torch_seed()
    # Replay (xladist/_replay.py): once the step's program is known, run it
    # without tracing fn; otherwise trace, and capture the traced program.
    replayer = self.__dict__.get("_replayer")
    if replayer is None:
      gap = None
      if type(self)._trace is not SPMDExtended._trace:
        gap = f"{type(self).__name__} does its own work around each step's trace"
      elif self._cores_per_replica > 1:
        gap = "several logical devices per replica (TPUStrategy) are not replayed yet"
      elif getattr(self, "_host_replicas", None) is not None:
        gap = "several hosts are not replayed yet (every host must decide alike)"
      replayer = self._replayer = _replay.Replayer(self, gap)
    options = _replay.PLACED if placed else getattr(self, "_run_options", None)
    out, attempt = replayer.run(fn, args, kwargs, self._compile_watch, options)
    if attempt is None:
      return out
    if attempt.args is not None:
      args, kwargs = attempt.args, attempt.kwargs
    region = Region(strategy)
    step = region.step
    made = StepTensors(region)
    hooks = (
      torch_optimizer.register_optimizer_step_pre_hook(self._before_step),
      torch_optimizer.register_optimizer_step_post_hook(self._after_step),
    )
    self._region = region
    try:
      # Only frames below this one hold replica-local views (see _clear_step_frames).
      out = self._trace(fn, args, kwargs, region, made)
    except _runtime.HostReadInStep as e:
      attempt.abandon()
      store.restore(step)
      _clear_step_frames(e.__traceback__)
      raise RuntimeError(HOST_READ_MESSAGE.format(detail=str(e))) from None
    except BaseException as e:
      attempt.abandon()
      store.restore(step)
      _clear_step_frames(e.__traceback__)
      raise
    finally:
      for hook in hooks:
        hook.remove()
      keep = {id(t) for t, *_ in step.variables}
      region.close()
      self._region = None
      del step
      made.release(keep, describe_fn(fn))
    return attempt.finish(out)

  def _call_in_merge(self, fn, args, kwargs):
    """call_for_each_replica inside merge_fn (TF allows it): the step's replicas
    run `fn` again, each with its own components; results come back in the
    merge_call form of PerReplica."""
    region = self._region
    local_args, local_kwargs = tree_map(region.local_of, (args, kwargs))
    mode = context._Mode(
      self._strategy_ref, replica_context=ReplicaContext(self._strategy_ref, region)
    )
    context.push(mode)
    try:
      out = fn(*local_args, **local_kwargs)
    finally:
      context.pop(mode)
    return tree_map(
      lambda x: PerReplica._from_local(x, region) if isinstance(x, torch.Tensor) else x, out
    )

  def _trace(self, fn, args, kwargs, region, made):
    """Enters the region, traces `fn` once for all replicas, leaves the region."""
    strategy, store, step = self._strategy_ref, self._store, region.step
    leaves, spec = flatten((args, kwargs))
    entered = [region.enter_value(x) for x in leaves]
    for t in entered:
      made.track(t)
    local_args, local_kwargs = unflatten(spec, entered)
    del entered
    # Global tensors this strategy keeps are made before `made` records.
    self._replica_iota()
    if self._cores_per_replica > 1:
      self._device_iota()
    store.enter(step)
    mode = context._Mode(strategy, replica_context=ReplicaContext(strategy, region))
    context.push(mode)
    try:
      with _runtime.no_execution(), _xm_in_step.guarded(), made:
        out = fn(*local_args, **local_kwargs)
    finally:
      context.pop(mode)
    leaves, spec = flatten(out)
    result = unflatten(spec, [region.exit_value(x) for x in leaves])
    store.exit(step, region.global_replicated)
    return result

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

  def _before_step(self, optimizer, args, kwargs):
    """optimizer.step() in a replica context: aggregate the gradients first."""
    region = self._region
    ctx = context.get_replica_context()
    if region is None or ctx is None or ctx.strategy is not self._strategy_ref:
      return
    step = region.step
    if self._store.track_optimizer(optimizer):
      self._store.enter_optimizer(optimizer, step)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    foreign = [tuple(p.shape) for p in params if not step.is_variable(p)]
    if foreign:
      raise RuntimeError(
        f"optimizer.step() in strategy.run: {len(foreign)} of the optimizer's "
        f"parameters (shapes {foreign[:3]}...) are not variables of "
        f"{self._strategy_ref!r}. Create the model under strategy.scope() so that "
        "its parameters are mirrored on every replica."
      )
    step.stepped.update(id(p) for p in params)
    # Mirrored variables with an aggregation that the optimizer updates are
    # updated identically on every replica (from aggregated gradients).
    step.optimizer_clean[id(optimizer)] = step.clean([p for p in params if step.is_aggregated(p)])
    self._aggregate_gradients(ctx, params, "optimizer.step()")

  def _aggregate_for_clipping(self, ctx, tensors):
    """torch's gradient clipping inside this strategy's step (`_grad_clip.py`):
    the gradients of variables in the list `tensors` are aggregated across
    replicas and replace the local ones, in the list and in `.grad`."""
    region = self._region
    if region is None or ctx.strategy is not self._strategy_ref:
      return
    if self.experimental_gradient_aggregation is None:
      return
    owner = {id(t.grad): t for t, *_ in region.step.variables if t.grad is not None}
    params = [owner.get(id(t)) for t in tensors]
    found = [p for p in params if p is not None]
    if not found:
      return
    self._aggregate_gradients(ctx, found, "torch.nn.utils gradient clipping")
    for i, p in enumerate(params):
      if p is not None:
        tensors[i] = p.grad

  def _aggregate_gradients(self, ctx, params, api):
    """Replaces each parameter's local gradient by its aggregate across replicas
    (the strategy's experimental_gradient_aggregation; one merge_call, packed
    into few all-reduces), except those aggregated earlier in this step (by
    gradient clipping). Called by optimizer.step() and by torch's clipping
    functions inside `run` (`_grad_clip.py`)."""
    op = self.experimental_gradient_aggregation
    step = self._region.step
    done = step.aggregated_grads
    todo = []
    for p in params:
      if p.grad is None:
        continue
      if id(p) not in done:
        todo.append(p)
      elif done[id(p)] is not p.grad:
        raise RuntimeError(
          f"{api} in strategy.run: a gradient was replaced after gradient clipping "
          "had aggregated it across replicas in this step (e.g. another backward() "
          "with set_to_none, or an assignment to .grad), so xladist cannot tell "
          "whether it is a per-replica or an aggregated value. Clip right before "
          "optimizer.step(), after every backward() of the step."
        )
    if op is None or not todo:
      return

    def merge_fn(strategy, *grads):
      return strategy.extended.batch_reduce_to(op, [(g, g) for g in grads])

    reduced = ctx.merge_call(merge_fn, args=[p.grad for p in todo])
    for p, g in zip(todo, reduced):
      p.grad = g
      done[id(p)] = g

  def _after_step(self, optimizer, args, kwargs):
    region = self._region
    if region is not None:
      step = region.step
      step.sanction(step.optimizer_clean.pop(id(optimizer), ()))

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


def _clear_step_frames(tb):
  """Clears the locals of the finished frames below `run` in a traceback.

  They hold replica-local views of the step's tensors; reading one after the
  step (a traceback printer showing arguments, e.g. pytest's long tracebacks,
  or a debugger) makes torch_xla 2.9 abort the process ("Check failed:
  !IsManual()"). The traceback keeps its files, lines and source.
  """
  here = sys._getframe(1)  # _call_for_each_replica
  while tb is not None and tb.tb_frame is not here:
    tb = tb.tb_next
  if tb is not None:
    traceback.clear_frames(tb.tb_next)  # skips frames still running (generators)


def _place_variable(tensor):
  if tensor.device.type == "xla":
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

  def __init__(self, devices=None, cross_device_ops=None, communication_options=None):
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
      dev = torch.device(d) if not isinstance(d, int) else torch.device("xla", d)
    except (RuntimeError, TypeError):
      dev = None
    if dev is None or dev.type != "xla":
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
