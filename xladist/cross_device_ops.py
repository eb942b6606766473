"""Cross-device ops: how a strategy combines the replicas' values (TF's names).

Every reduction lowers to XLA collectives inside the step's program. What a
`CrossDeviceOps` chooses is how the tensors of one batch reduction are packed
into collectives, and (for `ReductionToOneDevice`) how the values are combined:

* `CrossDeviceOps()` itself is the default: one all-reduce per dtype, or
  buckets of `CommunicationOptions.bytes_per_pack` bytes when a call asks.
* `NcclAllReduce(num_packs)` / `HierarchicalCopyAllReduce(num_packs)`: XLA
  all-reduces, the tensors of one dtype split into `num_packs` contiguous packs
  of roughly equal bytes (0: one all-reduce per tensor). XLA's runtime picks
  the algorithm, so the two differ only in name.
* `ReductionToOneDevice(accumulation_fn=...)`: every replica's values are
  gathered (an all-gather, packed like the default) and combined with
  `accumulation_fn([v0, v1, ...])`; every device computes the same result, so
  no broadcast is needed afterwards.

Where the values are:

* inside `merge_call` (and `ReplicaContext.all_reduce`) each replica holds its
  own traced tensor; the reduction is the collectives above;
* in cross-replica context outside a step (`strategy.run`'s outputs, values
  built on the host) the value is one global tensor (num_replicas, ...) split
  over the replica axis; it is reduced with ordinary torch ops and XLA's SPMD
  partitioner inserts the collective. The values of one batch reduction are
  packed the same way (one concatenated reduction per pack), except by
  `ReductionToOneDevice`, which accumulates each value on its own.
"""

import torch

from xladist import collectives, context
from xladist import runtime as _runtime
from xladist._global_view import (
  _is_variable_module,
  as_value,
  check_destinations,
  destination_count,
  reduce_global,
  reduce_stacked,
  stacked_components,
  to_destinations,
)
from xladist.communication_options import CommunicationOptions, check_options
from xladist.reduce_util import ReduceOp, as_reduce_op
from xladist.values import DistributedValues, Mirrored, PerReplica, reduce_by_form

_PAIRS_MESSAGE = (
  "value_destination_pairs should be a list or tuple of tuples of "
  "PerReplica objects and destinations"
)


class CrossDeviceOps:
  """Base of the cross-device reductions; on its own, the default packed all-reduce.

  `MirroredStrategy(cross_device_ops=...)` uses one for every reduction:
  `strategy.reduce`, `extended.reduce_to` / `batch_reduce_to` (and so the
  gradient aggregation of `optimizer.step()`) and `ReplicaContext.all_reduce`.
  The public methods can also be called directly in cross-replica context.

  Example, 4 replicas, a model with 200 float32 parameter tensors::

    >>> strategy = xd.MirroredStrategy(cross_device_ops=xd.NcclAllReduce(num_packs=2))
    >>> # each optimizer.step() inside strategy.run: 2 all-reduces (default: 1,
    >>> # NcclAllReduce(num_packs=0): 200)
    >>> def merge_fn(s, a, b):   # in a merge_call, a = replica r's r, b = 10 * r
    ...   return s.extended.batch_reduce_to("sum", [(a, a), (b, b)])   # [6., 60.]
  """

  def __repr__(self):
    return f"{type(self).__name__}()"

  # -- public API: check, then call a hook --------------------------------------------
  def reduce(self, reduce_op, per_replica_value, destinations, options=None):
    """Reduces `per_replica_value` across replicas onto `destinations`.

    Returns a `Mirrored` when `destinations` names several devices (or is a
    distributed value), else a tensor (copied to the host for "cpu").

    Raises:
      ValueError: `per_replica_value` is not a distributed value or tensor, or
        `destinations` is malformed.
      TypeError: `options` is not a CommunicationOptions.
    """
    api = f"{type(self).__name__}.reduce"
    reduce_op = as_reduce_op(reduce_op, api)
    options = _options(options, api)
    per_replica_value = as_value(per_replica_value)
    if not isinstance(per_replica_value, (DistributedValues, torch.Tensor)):
      raise ValueError(
        f"{api}: per_replica_value must be a PerReplica, Mirrored, variable or "
        f"tensor, got {type(per_replica_value).__name__}."
      )
    check_destinations(destinations, api)
    return self._reduce_implementation(reduce_op, per_replica_value, destinations, options)

  def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
    """Reduces several values at once, packed into few collectives; returns a list.

    Raises:
      ValueError: `value_destination_pairs` is not a list or tuple of
        (PerReplica, destinations) pairs.
      TypeError: `options` is not a CommunicationOptions.
    """
    api = f"{type(self).__name__}.batch_reduce"
    reduce_op = as_reduce_op(reduce_op, api)
    options = _options(options, api)
    if isinstance(value_destination_pairs, (list, tuple)):
      value_destination_pairs = [
        (as_value(p[0]), p[1]) if isinstance(p, tuple) and len(p) == 2 else p
        for p in value_destination_pairs
      ]
    check_value_destination_pairs(value_destination_pairs, api)
    return self._batch_reduce_implementation(reduce_op, list(value_destination_pairs), options)

  def broadcast(self, tensor, destinations):
    """`tensor` mirrored on `destinations` (a Mirrored for several devices).

    Raises:
      TypeError: `tensor` is a distributed value (reduce it first).
      ValueError: `destinations` is malformed.
    """
    api = f"{type(self).__name__}.broadcast"
    if isinstance(tensor, DistributedValues) or _is_variable_module(tensor):
      tensor = _single_value(tensor, api)
    check_destinations(destinations, api)
    return self._broadcast_implementation(tensor, destinations)

  # -- hooks ------------------------------------------------------------------------------
  def _reduce_implementation(self, reduce_op, value, destinations, options):
    return self._batch_reduce_implementation(reduce_op, [(value, destinations)], options)[0]

  def _batch_reduce_implementation(self, reduce_op, pairs, options):
    values = [v for v, _ in pairs]
    reduced = self._reduce_values(reduce_op, values, options)
    in_region = _in_region()
    return [to_destinations(r, d, _num_replicas(v), in_region) for r, (v, d) in zip(reduced, pairs)]

  def _broadcast_implementation(self, tensor, destinations):
    n = destination_count(destinations)
    strategy = context.get_strategy()
    if strategy.num_replicas_in_sync > 1 or n > 1:
      tensor = strategy.extended._broadcast(tensor)
    return to_destinations(tensor, destinations, n, _in_region())

  def _reduce_values(self, reduce_op, values, options):
    """Reduced tensors of `values`: the merge_call (local) ones in one batch."""

    def reduce_local(vs):
      tensors = []
      for v in vs:
        t, region = v._local
        region.require_active("CrossDeviceOps.reduce")
        tensors.append(t)
      return self._all_reduce_local(reduce_op, tensors, vs[0]._local[1], options)

    return reduce_by_form(
      values,
      lambda vs: self._reduce_global_batch(reduce_op, vs, _num_replicas(vs[0]), options),
      reduce_local,
    )

  def _packs(self, tensors, options):
    """How the tensors of one batch reduction share collectives (lists of indices)."""
    if options is not None and options.bytes_per_pack > 0:
      return collectives.pack_by_bytes(tensors, options.bytes_per_pack)
    return collectives.pack_by_dtype(tensors)

  def _all_reduce_local(self, reduce_op, tensors, region, options):
    """All-reduces the local tensors of one manual region (differentiable for SUM/MEAN)."""
    return collectives.all_reduce(
      reduce_op, tensors, region.num_replicas, self._packs(tensors, options)
    )

  def _reduce_global(self, reduce_op, value, num_replicas):
    """Reduces a value held in the global view (outside a step)."""
    return reduce_global(reduce_op, value, None, num_replicas)

  def _reduce_global_batch(self, reduce_op, values, num_replicas, options):
    """Reduces values held in the global view, packed like the in-step reductions.

    The (num_replicas, ...) tensors of the PerReplica values of one pack are
    flattened and concatenated along dim 1 and reduced over dim 0 at once, so
    the SPMD partitioner emits one all-reduce per pack instead of one per value
    (checked in XLA:CPU's optimised HLO). Other values are reduced one by one.
    """
    out = [None] * len(values)
    packable = [
      i
      for i, v in enumerate(values)
      if isinstance(v, PerReplica)
      and v._local is None
      and v._stacked is not None
      and _runtime.is_device_tensor(v._stacked)
    ]
    stacks = [values[i]._stacked for i in packable]
    metas = [torch.empty(t.shape[1:], dtype=t.dtype, device="meta") for t in stacks]
    done = set()
    for pack in self._packs(metas, options):
      if len(pack) < 2:
        continue
      group = [stacks[j] for j in pack]
      flat = torch.cat([t.reshape(t.shape[0], -1) for t in group], dim=1)
      reduced = reduce_stacked(reduce_op, flat, None, "strategy.reduce")
      pieces = reduced.split([metas[j].numel() for j in pack])
      for j, piece in zip(pack, pieces):
        out[packable[j]] = piece.view(metas[j].shape).clone()  # not a view (collectives._packed)
        done.add(packable[j])
    for i, v in enumerate(values):
      if i not in done:
        out[i] = self._reduce_global(reduce_op, v, num_replicas)
    return out


class _AllReduceCrossDeviceOps(CrossDeviceOps):
  """XLA all-reduces with the tensors of one batch reduction in `num_packs` packs."""

  _ALGORITHM = "all-reduce"

  def __init__(self, num_packs=1):
    name = type(self).__name__
    if isinstance(num_packs, bool) or not isinstance(num_packs, int):
      raise TypeError(
        f"{name}(num_packs): num_packs must be an int >= 0, got "
        f"{type(num_packs).__name__} {num_packs!r}."
      )
    if num_packs < 0:
      raise ValueError(
        f"{self._ALGORITHM} requires num_packs >= 0, but {num_packs} is specified "
        f"({name}; 0 means one all-reduce per tensor)."
      )
    self._num_packs = num_packs

  def __repr__(self):
    return f"{type(self).__name__}(num_packs={self._num_packs})"

  @property
  def num_packs(self):
    return self._num_packs

  def _packs(self, tensors, options):
    # A per-call bytes_per_pack is an explicit request and wins over num_packs.
    if options is not None and options.bytes_per_pack > 0:
      return collectives.pack_by_bytes(tensors, options.bytes_per_pack)
    return collectives.pack_into(tensors, self._num_packs)


class NcclAllReduce(_AllReduceCrossDeviceOps):
  """All-reduce in `num_packs` packs (TF: NCCL; here an XLA all-reduce).

  Args:
    num_packs: how many all-reduces one batch reduction of one dtype becomes:
      the tensors, in order, are split into `num_packs` contiguous packs of
      roughly equal bytes (a dtype with fewer tensors gets one all-reduce per
      tensor). Each dtype is packed on its own, so d dtypes give up to
      d * num_packs all-reduces. 0: no packing, one all-reduce per tensor.

  Raises:
    TypeError: `num_packs` is not an int.
    ValueError: `num_packs` is negative.
  """

  _ALGORITHM = "NCCL all-reduce"


class HierarchicalCopyAllReduce(_AllReduceCrossDeviceOps):
  """All-reduce in `num_packs` packs (TF: hierarchical copy; here an XLA all-reduce).

  On XLA the device topology is the runtime's business, so this lowers exactly
  like `NcclAllReduce(num_packs)`; see there for how packs are formed.

  Raises:
    TypeError: `num_packs` is not an int.
    ValueError: `num_packs` is negative.
  """

  _ALGORITHM = "HierarchicalCopy"


def _add_n(values):
  """The default accumulation: the elementwise sum of a list of tensors (TF's add_n)."""
  total = values[0]
  for v in values[1:]:
    total = total + v
  return total


class ReductionToOneDevice(CrossDeviceOps):
  """Gathers every replica's values and combines them with `accumulation_fn`.

  Inside a step (merge_call, ReplicaContext.all_reduce) the values are
  all-gathered (packed per dtype, or by `CommunicationOptions.bytes_per_pack`)
  and every device computes `accumulation_fn([v_0, ..., v_{N-1}])` identically,
  which takes the place of TF's copy to one device and broadcast back. Outside
  a step the components are stacked and accumulated the same way. MEAN divides
  the accumulated value by the number of replicas (floor division for integer
  dtypes). MIN and MAX (xladist extensions) take the elementwise min / max of the
  gathered values; `accumulation_fn` is not used for them.

  Args:
    reduce_to_device: accepted for TF compatibility (a device name or
      torch.device). In an SPMD program every device computes the combination,
      so no single device is singled out.
    accumulation_fn: a function from a list of tensors (one per replica, same
      shape and dtype) to their combination, like `torch.stack(vs).sum(0)`.
      Default: their sum (TF's `math_ops.add_n`).

  Raises:
    TypeError: `reduce_to_device` is not a device, or `accumulation_fn` is not callable.
  """

  def __init__(self, reduce_to_device=None, accumulation_fn=None):
    if reduce_to_device is not None and not isinstance(reduce_to_device, (str, torch.device)):
      raise TypeError(
        "ReductionToOneDevice(reduce_to_device): expected None, a device name or "
        f"a torch.device, got {type(reduce_to_device).__name__}."
      )
    if accumulation_fn is not None and not callable(accumulation_fn):
      raise TypeError(
        "ReductionToOneDevice(accumulation_fn): expected a function from a list "
        f"of tensors to a tensor, got {type(accumulation_fn).__name__}."
      )
    self.reduce_to_device = reduce_to_device
    self.accumulation_fn = accumulation_fn if accumulation_fn is not None else _add_n

  def __repr__(self):
    return (
      f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r}, "
      f"accumulation_fn={getattr(self.accumulation_fn, '__name__', self.accumulation_fn)})"
    )

  def _combine(self, reduce_op, values):
    if reduce_op is ReduceOp.MIN:
      return torch.stack(values).amin(0)
    if reduce_op is ReduceOp.MAX:
      return torch.stack(values).amax(0)
    if values[0].dtype == torch.bool:
      values = [v.to(torch.int32) for v in values]
    total = self.accumulation_fn(list(values))
    if not isinstance(total, torch.Tensor):
      raise TypeError(
        f"ReductionToOneDevice: accumulation_fn "
        f"{getattr(self.accumulation_fn, '__name__', self.accumulation_fn)!r} returned "
        f"{type(total).__name__} for a list of {len(values)} tensors; it must return "
        "their combination as one tensor (e.g. torch.stack(values).sum(0))."
      )
    if tuple(total.shape) != tuple(values[0].shape):
      raise ValueError(
        f"ReductionToOneDevice: accumulation_fn "
        f"{getattr(self.accumulation_fn, '__name__', self.accumulation_fn)!r} returned "
        f"a tensor of shape {tuple(total.shape)} for values of shape "
        f"{tuple(values[0].shape)}; it must combine them elementwise."
      )
    if reduce_op is ReduceOp.MEAN:
      n = len(values)
      if total.is_floating_point() or total.is_complex():
        total = total / n
      else:
        total = torch.div(total, n, rounding_mode="floor")
    return total

  def _all_reduce_local(self, reduce_op, tensors, region, options):
    n = region.num_replicas
    stacks = collectives.gather_stacked_many(
      tensors, region.replica_id, n, self._packs(tensors, options)
    )
    return [self._combine(reduce_op, list(s.unbind(0))) for s in stacks]

  def _reduce_global(self, reduce_op, value, num_replicas):
    if isinstance(value, PerReplica) and value._local is None:
      stacked = stacked_components(value)
      if reduce_op is ReduceOp.MEAN and not stacked.is_floating_point():
        stacked = stacked.float()  # as strategy.reduce: the mean of integers is a float
      return self._combine(reduce_op, list(stacked.unbind(0)))
    return super()._reduce_global(reduce_op, value, num_replicas)

  def _reduce_global_batch(self, reduce_op, values, num_replicas, options):
    return [self._reduce_global(reduce_op, v, num_replicas) for v in values]


def _single_value(value, api):
  """The one value a Mirrored or mirrored variable holds (what broadcast sends)."""
  value = as_value(value)
  if isinstance(value, Mirrored):
    return value.primary
  if isinstance(value, torch.Tensor):
    return value
  raise TypeError(
    f"{api}: expected a tensor, a Mirrored or a mirrored variable, got a "
    f"{type(value).__name__}; reduce it first."
  )


def check_value_destination_pairs(pairs, api):
  """TF's check: a list or tuple of (DistributedValues or tensor, destinations) pairs."""
  ok = (
    isinstance(pairs, (list, tuple))
    and len(pairs) > 0
    and all(
      isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], (DistributedValues, torch.Tensor))
      for p in pairs
    )
  )
  if not ok:
    got = type(pairs).__name__
    if isinstance(pairs, (list, tuple)) and not pairs:
      got = f"an empty {got}"
    elif isinstance(pairs, (list, tuple)):
      bad = next(
        (
          p
          for p in pairs
          if not (
            isinstance(p, tuple)
            and len(p) == 2
            and isinstance(p[0], (DistributedValues, torch.Tensor))
          )
        ),
        None,
      )
      got = f"a {got} containing {type(bad).__name__} {bad!r:.80}"
    raise ValueError(f"{api}: {_PAIRS_MESSAGE}, got {got}.")
  for _, d in pairs:
    check_destinations(d, api)


def check_cross_device_ops(cross_device_ops, api):
  if cross_device_ops is None:
    return CrossDeviceOps()
  if not isinstance(cross_device_ops, CrossDeviceOps):
    raise TypeError(
      f"{api}: cross_device_ops must be an xladist.CrossDeviceOps (e.g. "
      "xd.NcclAllReduce(num_packs=1), xd.HierarchicalCopyAllReduce(), "
      f"xd.ReductionToOneDevice()) or None, got {type(cross_device_ops).__name__} "
      f"{cross_device_ops!r:.80}."
    )
  return cross_device_ops


def _options(options, api):
  return check_options(options, api) or CommunicationOptions()


def _num_replicas(value):
  if isinstance(value, DistributedValues):
    return value.num_replicas
  return context.get_strategy().num_replicas_in_sync


def _in_region():
  """True while a step is being traced (where nothing may be read to the host)."""
  return context.get_strategy().extended._tracing()


__all__ = ["CrossDeviceOps", "HierarchicalCopyAllReduce", "NcclAllReduce", "ReductionToOneDevice"]
