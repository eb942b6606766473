"""MirroredStrategy: one replica per local XLA device, synchronous, one SPMD program."""

import torch
from torch.optim import optimizer as torch_optimizer

from xladist import _runtime, context
from xladist._region import HOST_READ_MESSAGE, Region
from xladist._variables import VariableStore
from xladist.reduce_util import ReduceOp
from xladist.replica_context import ReplicaContext
from xladist.strategy import (Strategy, StrategyExtended, _concat_stacked,
                              _check_axis, flatten, unflatten)
from xladist.values import Mirrored, PerReplica


class SPMDExtended(StrategyExtended):
  """Replicas are coordinates of a mesh's replica axis; `run` is one manual region."""

  def __init__(self, strategy):
    super().__init__(strategy)
    n = _runtime.num_devices()
    self._device_names = tuple(f"xla:{i}" for i in range(n))
    self._store = VariableStore(_place_variable)
    self._region = None
    self._iota = None

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
    return [PerReplica._from_stacked(
        _runtime.place_split(t) if t.device.type == "xla" else next(placed), n)
            for t in tensors]

  def _replica_iota(self):
    if self._iota is None:
      self._iota = _runtime.place_split(
          torch.arange(self._num_replicas_in_sync, dtype=torch.int32))
    return self._iota

  # -- run ------------------------------------------------------------------------------
  def _call_for_each_replica(self, fn, args, kwargs):
    if self._region is not None:
      raise RuntimeError(
          "strategy.run cannot be called inside merge_fn of a merge_call; merge_fn "
          "runs in cross-replica context inside the step. Reduce or gather there "
          "instead, or call strategy.run after the step returns.")
    strategy = self._strategy_ref
    store = self._store
    store.place_pending()
    region = Region(strategy)
    step = region.step
    hook = torch_optimizer.register_optimizer_step_pre_hook(self._before_step)
    self._region = region
    try:
      leaves, spec = flatten((args, kwargs))
      args, kwargs = unflatten(spec, [region.enter_value(x) for x in leaves])
      store.enter(step)
      mode = context._Mode(strategy, replica_context=ReplicaContext(strategy, region))
      context.push(mode)
      try:
        with _runtime.no_execution():
          out = fn(*args, **kwargs)
      finally:
        context.pop(mode)
      leaves, spec = flatten(out)
      result = unflatten(spec, [region.exit_value(x) for x in leaves])
      store.exit(step, region.global_replicated)
      return result
    except _runtime.HostReadInStep as e:
      store.restore(step)
      raise RuntimeError(HOST_READ_MESSAGE.format(detail=str(e))) from None
    except BaseException:
      store.restore(step)
      raise
    finally:
      hook.remove()
      region.close()
      self._region = None

  def _before_step(self, optimizer, args, kwargs):
    """optimizer.step() in a replica context: aggregate the gradients first."""
    region = self._region
    ctx = context.get_replica_context()
    if region is None or ctx is None or ctx.strategy is not self._strategy_ref:
      return
    step = region.step
    if self._store.track_optimizer(optimizer):
      self._store.enter_optimizer(optimizer, step)
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.grad is not None]
    foreign = [tuple(p.shape) for p in params if not step.is_variable(p)]
    if foreign:
      raise RuntimeError(
          f"optimizer.step() in strategy.run: {len(foreign)} of the optimizer's "
          f"parameters (shapes {foreign[:3]}...) are not variables of "
          f"{self._strategy_ref!r}. Create the model under strategy.scope() so that "
          "its parameters are mirrored on every replica.")
    step.stepped.update(id(p) for p in params)
    op = self.experimental_gradient_aggregation
    if op is None or not params:
      return

    def merge_fn(strategy, *grads):
      return strategy.extended.batch_reduce_to(op, [(g, g) for g in grads])
    reduced = ctx.merge_call(merge_fn, args=[p.grad for p in params])
    for p, g in zip(params, reduced):
      p.grad = g

  # -- cross-replica operations ------------------------------------------------------------
  def _reduce(self, reduce_op, value, axis):
    if isinstance(value, PerReplica) and value._local is not None:
      return self._batch_reduce_local(reduce_op, [value], [axis])[0]
    return super()._reduce(reduce_op, value, axis)

  def _batch_reduce(self, reduce_op, values):
    local = [i for i, v in enumerate(values)
             if isinstance(v, PerReplica) and v._local is not None]
    local_set = set(local)
    out = [None if i in local_set else self._reduce(reduce_op, v, None)
           for i, v in enumerate(values)]
    if local:
      reduced = self._batch_reduce_local(reduce_op, [values[i] for i in local],
                                         [None] * len(local))
      for i, r in zip(local, reduced):
        out[i] = r
    return out

  def _batch_reduce_local(self, reduce_op, values, axes):
    """Reduces merge_call PerReplica values with one packed all-reduce per dtype."""
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
    return self._region.all_reduce(reduce_op, tensors)

  def _gather(self, value, axis):
    if isinstance(value, PerReplica) and value._local is not None:
      local, region = value._local
      region.require_active("strategy.gather")
      return _concat_stacked(region.gather_stacked(local), axis, "strategy.gather")
    return super()._gather(value, axis)


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
    cross_device_ops: must be None for now: every reduction is an XLA all-reduce
      packed per dtype. Choosing another CrossDeviceOps is a documented gap
      (docs/architecture.md, "Not yet built").

  Raises:
    ValueError: `devices` is not the list of all local XLA devices.
    NotImplementedError: a `cross_device_ops` was given.
  """

  def __init__(self, devices=None, cross_device_ops=None):
    _runtime.initialize()
    _check_devices(devices, "MirroredStrategy")
    if cross_device_ops is not None:
      raise NotImplementedError(
          "MirroredStrategy(cross_device_ops=...): choosing a CrossDeviceOps is not "
          "built yet; every reduction already lowers to a packed XLA all-reduce. "
          "Pass cross_device_ops=None.")
    super().__init__(SPMDExtended(self))


def _check_devices(devices, api):
  n = _runtime.num_devices()
  if devices is None:
    return
  if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__iter__"):
    raise TypeError(f"{api}(devices=...): devices must be a list of devices, got "
                    f"{type(devices).__name__}.")
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
          f"'xla:{n - 1}'.")
    indices.append(0 if dev.index is None else dev.index)
  if sorted(indices) != list(range(n)):
    raise ValueError(
        f"{api}(devices={list(devices)!r}): xladist runs all replicas as one SPMD "
        f"program whose mesh must cover every local XLA device (torch_xla 2.9 "
        f"rejects a mesh over a subset), and this process has {n}: "
        f"'xla:0' .. 'xla:{n - 1}', each once. Pass devices=None, or limit the "
        "devices the process sees before it starts (CPU_NUM_DEVICES on XLA:CPU, "
        "TPU_VISIBLE_CHIPS on TPU).")
