"""Values in the global view (outside a step): reductions, concatenation, destinations.

Outside `strategy.run` a PerReplica is one global tensor (num_replicas, ...)
split over the replica axis (or a tuple of host components); reducing it is an
ordinary torch reduction over dim 0, and XLA's SPMD partitioner inserts the
collective.
"""

import torch

from xladist.reduce_util import ReduceOp
from xladist.values import DistributedValues, Mirrored, PerReplica


def check_axis(axis, rank, api):
  if isinstance(axis, bool) or not isinstance(axis, int):
    raise TypeError(f"{api}: axis must be an int or None, got {type(axis).__name__}.")
  if not -rank <= axis < rank:
    raise ValueError(
        f"{api}: axis {axis} is out of range for a per-replica value of rank {rank}.")
  return axis % rank


def reduce_global(reduce_op, value, axis, n):
  """Reduces a PerReplica (global or host form), Mirrored or tensor over `n` replicas."""
  if isinstance(value, PerReplica):
    return reduce_stacked(reduce_op, stacked_components(value), axis, "strategy.reduce")
  if isinstance(value, Mirrored):
    value = value.primary
    scale = n
  else:
    scale = None
  value = torch.as_tensor(value)
  out = reduce_stacked(reduce_op, value.unsqueeze(0), axis, "strategy.reduce")
  if reduce_op is ReduceOp.SUM and n > 1:
    if scale is None:
      raise ValueError(
          f"strategy.reduce: a non-distributed value (a {type(value).__name__}) "
          f"cannot be reduced with ReduceOp.SUM over {n} replicas; pass the "
          "PerReplica that strategy.run returned, or use ReduceOp.MEAN.")
    out = out * scale
  return out


def stacked_components(value):
  """A PerReplica (not the merge_call form) as one (num_replicas, ...) tensor."""
  if value._stacked is not None:
    return value._stacked
  return torch.stack([torch.as_tensor(c) for c in value.values])


def to_destinations(value, destinations, num_replicas, in_region):
  """`value` on `destinations`: a Mirrored for several devices (or a distributed
  value), else the tensor; a "cpu" destination outside a step copies it to the host."""
  many = isinstance(destinations, DistributedValues) or (
      isinstance(destinations, (list, tuple)) and len(destinations) > 1)
  if many:
    return Mirrored._from_primary(value, num_replicas)
  if is_host_destination(destinations) and isinstance(value, torch.Tensor) and not in_region:
    return value.cpu()
  return value


def is_host_destination(destinations):
  """True when `destinations` names one device and it is the host CPU."""
  if isinstance(destinations, DistributedValues) or (
      isinstance(destinations, (list, tuple)) and len(destinations) > 1):
    return False
  if isinstance(destinations, (list, tuple)):
    destinations = destinations[0]
  if isinstance(destinations, torch.Tensor):
    destinations = destinations.device
  return str(destinations).startswith("cpu")


def reduce_stacked(reduce_op, stacked, axis, api):
  """Reduces a (num_replicas, *shape) tensor over replicas (and `axis` of shape)."""
  dims = [0]
  if axis is not None:
    dims.append(check_axis(axis, stacked.dim() - 1, api) + 1)
  if reduce_op is ReduceOp.SUM:
    return stacked.sum(dim=dims)
  if reduce_op is ReduceOp.MEAN:
    if not stacked.is_floating_point():
      stacked = stacked.float()
    return stacked.mean(dim=dims)
  if reduce_op is ReduceOp.MIN:
    return stacked.amin(dim=dims)
  return stacked.amax(dim=dims)


def concat_stacked(stacked, axis, api):
  """(num_replicas, *shape) -> the components concatenated along `axis`."""
  if stacked.dim() < 2:
    raise ValueError(
        f"{api}: per-replica values must have rank >= 1 to be concatenated, got "
        "scalars; reshape them to shape (1,) first.")
  axis = check_axis(axis, stacked.dim() - 1, api)
  moved = stacked.movedim(0, axis)
  shape = list(moved.shape)
  return moved.reshape(shape[:axis] + [shape[axis] * shape[axis + 1]] + shape[axis + 2:])


def check_destinations(destinations, api):
  ok = (str, torch.device, torch.Tensor, DistributedValues)
  if isinstance(destinations, ok):
    if isinstance(destinations, str) and not destinations:
      raise ValueError(f"{api}: destinations must not be an empty string.")
    return
  if isinstance(destinations, (list, tuple)) and destinations and all(
      isinstance(d, ok) for d in destinations):
    return
  raise ValueError(
      f"{api}: destinations must be a device (string or torch.device), a tensor, "
      f"a distributed value, or a non-empty list of them; got {destinations!r}.")
