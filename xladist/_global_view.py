"""Values in the global view (outside a step): reductions, concatenation, destinations.

Outside `strategy.run` a PerReplica is one global tensor (num_replicas, ...)
split over the replica axis (or a tuple of host components); reducing it is an
ordinary torch reduction over dim 0, and XLA's SPMD partitioner inserts the
collective.
"""

import torch

from xladist import context
from xladist import runtime as _runtime
from xladist.reduce_util import ReduceOp
from xladist.replica_copies import copies_of
from xladist.values import DistributedValues, Mirrored, PerReplica, as_components, check_components
from xladist.variable_store import mirrored_replicas


def check_axis(axis, rank, api):
  if isinstance(axis, bool) or not isinstance(axis, int):
    raise TypeError(f"{api}: axis must be an int or None, got {type(axis).__name__}.")
  if not -rank <= axis < rank:
    raise ValueError(f"{api}: axis {axis} is out of range for a per-replica value of rank {rank}.")
  return axis % rank


def reduce_global(reduce_op, value, axis, n):
  """Reduces a PerReplica (global or host form), Mirrored or tensor over `n` replicas."""
  if isinstance(value, PerReplica):
    if value._stacked is None and _ragged(value.values):
      return reduce_ragged(reduce_op, as_components(value.values), axis)
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
        "PerReplica that strategy.run returned, or use ReduceOp.MEAN."
      )
    out = out * scale
  return out


def stacked_components(value, api="strategy.reduce"):
  """A PerReplica (not the merge_call form) as one (num_replicas, ...) tensor."""
  if value._stacked is not None:
    return value._stacked
  return torch.stack(check_components(value.values, api))


def _ragged(values):
  comps = [c for c in values if isinstance(c, torch.Tensor)]
  return len(comps) == len(values) and len({tuple(c.shape) for c in comps}) > 1


def reduce_ragged(reduce_op, comps, axis):
  """strategy.reduce of components of different shapes (TF's rule).

  With `axis`, each component is reduced along it first, so the components may
  differ in that dimension (MEAN divides by the total count, the exact global
  mean). Without `axis` the shapes must agree.

  Raises:
    ValueError: `axis` is None, or the shapes differ elsewhere than `axis`.
  """
  api = "strategy.reduce"
  shapes = [tuple(c.shape) for c in comps]
  if axis is None:
    raise ValueError(
      f"{api}: the PerReplica's components have different shapes {shapes}, so "
      "they cannot be reduced elementwise (axis=None); pass the axis along which "
      "they differ (e.g. axis=0 for batches of different sizes)."
    )
  ranks = {len(s) for s in shapes}
  if len(ranks) != 1:
    raise ValueError(f"{api}: the PerReplica's components have different ranks {shapes}.")
  rank = ranks.pop()
  axis = check_axis(axis, rank, api)
  rest = {s[:axis] + s[axis + 1 :] for s in shapes}
  if len(rest) != 1:
    raise ValueError(
      f"{api}: the PerReplica's components have shapes {shapes}, which differ "
      f"outside axis {axis}; components may differ only along the reduced axis."
    )
  if reduce_op is ReduceOp.MEAN:
    total = sum(
      c.to(torch.float32 if not c.is_floating_point() else c.dtype).sum(axis) for c in comps
    )
    return total / sum(c.shape[axis] for c in comps)
  if reduce_op is ReduceOp.SUM:
    return sum(c.sum(axis) for c in comps)
  reduced = torch.stack(
    [c.amin(axis) if reduce_op is ReduceOp.MIN else c.amax(axis) for c in comps]
  )
  return reduced.amin(0) if reduce_op is ReduceOp.MIN else reduced.amax(0)


def gather_components(comps, axis, api):
  """Concatenates components that may differ in size along `axis` (TF's gather).

  Raises:
    ValueError: the components differ in rank or outside `axis`, or are scalars.
  """
  shapes = [tuple(c.shape) for c in comps]
  if len({len(s) for s in shapes}) != 1:
    raise ValueError(f"{api}: the components have different ranks {shapes}.")
  rank = len(shapes[0])
  if rank == 0:
    raise ValueError(
      f"{api}: per-replica values must have rank >= 1 to be concatenated, got "
      "scalars; reshape them to shape (1,) first."
    )
  axis = check_axis(axis, rank, api)
  if len({s[:axis] + s[axis + 1 :] for s in shapes}) != 1:
    raise ValueError(
      f"{api}: the components have shapes {shapes}; they may differ only along "
      f"the gathered axis {axis}."
    )
  dtypes = [str(c.dtype) for c in comps]
  if len(set(dtypes)) != 1:
    raise ValueError(
      f"{api}: the components have different dtypes {dtypes} (replica 0, "
      "1, ...); convert them to one dtype first."
    )
  return torch.cat(list(comps), axis)


def as_value(value, in_region=False):
  """A strategy variable as the distributed value it is (TF: a MirroredVariable
  or SyncOnReadVariable is a DistributedValues): the components of a
  sync-on-read variable, or a Mirrored of a mirrored one (an xladist.Variable,
  or a module's parameter or buffer made under the scope). Other values, and
  anything else inside a step, unchanged; there (in merge_fn) a variable is
  the PerReplica of its replicas' views."""
  if in_region:
    return _variable_in_region(value)
  tensor = value.value_ if _is_variable_module(value) else value
  if not isinstance(tensor, torch.Tensor):
    return value
  owner = value.distribute_strategy if _is_variable_module(value) else context.get_strategy()
  store = getattr(owner.extended, "_store", None)
  if store is not None:
    store.place_module_of(tensor)  # a variable made in a scope that is still open
  copies = copies_of(tensor)
  if copies is not None:
    return PerReplica._from_stacked(copies.current(tensor, repr), copies.num_replicas)
  if _is_variable_module(value):
    n = value.distribute_strategy.num_replicas_in_sync
    return Mirrored._from_primary(tensor, n) if n > 1 else tensor
  n = mirrored_replicas(tensor)
  if n is not None:
    return Mirrored._from_primary(tensor, n)
  return value


def _variable_in_region(value):
  """A variable in merge_fn inside a step: the PerReplica of each replica's view
  of it (TF: a MirroredVariable or SyncOnReadVariable in merge_fn is still a
  DistributedValues; reducing it reduces the replicas' values)."""
  is_module = _is_variable_module(value)
  tensor = value.value_ if is_module else value
  if not isinstance(tensor, torch.Tensor):
    return value
  strategy = value.distribute_strategy if is_module else context.get_strategy()
  region = getattr(strategy.extended, "_region", None)
  if region is None or region.step is None:
    return value
  if not (is_module or region.step.is_variable(tensor)):
    return value
  return PerReplica._from_local(tensor, region)


def _is_variable_module(value):
  return getattr(value, "_is_xladist_variable", False)


def destination_count(destinations):
  """How many devices `destinations` names (a variable: its strategy's replicas)."""
  if isinstance(destinations, DistributedValues):
    return destinations.num_replicas
  if _is_variable_module(destinations):
    return destinations.distribute_strategy.num_replicas_in_sync
  if isinstance(destinations, torch.Tensor) and copies_of(destinations) is not None:
    return copies_of(destinations).num_replicas
  if isinstance(destinations, torch.Tensor) and mirrored_replicas(destinations) is not None:
    return mirrored_replicas(destinations)
  if isinstance(destinations, (list, tuple)):
    return len(destinations)
  return 1


def _on_xla(destinations):
  """True when `destinations` are XLA devices (or values living there)."""
  if isinstance(destinations, (list, tuple)):
    return all(_on_xla(d) for d in destinations)
  if isinstance(destinations, DistributedValues):
    return True
  if _is_variable_module(destinations):
    destinations = destinations.value_
  if isinstance(destinations, torch.Tensor):
    destinations = destinations.device
  return str(destinations).startswith(_runtime.DEVICE_KIND)


def to_destinations(value, destinations, num_replicas, in_region):
  """`value` on `destinations`: a Mirrored for several devices (or a distributed
  value or variable), placed on the XLA devices when they are the destination,
  else the tensor; a "cpu" destination outside a step copies it to the host."""
  count = destination_count(destinations)
  many = count > 1 or isinstance(destinations, DistributedValues)
  if many:
    if (
      isinstance(value, torch.Tensor)
      and not _runtime.is_device_tensor(value)
      and not in_region
      and _on_xla(destinations)
    ):
      value = _runtime.place_replicated(value)
    return Mirrored._from_primary(value, max(count, num_replicas))
  if is_host_destination(destinations) and isinstance(value, torch.Tensor) and not in_region:
    return value.cpu()
  return value


def is_host_destination(destinations):
  """True when `destinations` names one device and it is the host CPU."""
  if destination_count(destinations) > 1 or isinstance(destinations, DistributedValues):
    return False
  if _is_variable_module(destinations):
    destinations = destinations.value_
  if isinstance(destinations, (list, tuple)):
    destinations = destinations[0]
  if isinstance(destinations, torch.Tensor):
    destinations = destinations.device
  return str(destinations).startswith("cpu")


def check_device_name(device, api):
  """Refuses a device name that no tensor of this process can be put on.

  "cpu", "xla" and "xla:<i>" for the process's XLA devices are accepted (all
  replicas' tensors live on the SPMD device); torch_xla itself would fail on
  other XLA ordinals with a C++ `vector::_M_range_check`.

  Raises:
    ValueError: the name is not such a device.
  """
  if not isinstance(device, (str, torch.device)):
    return
  try:
    d = torch.device(device)
  except (RuntimeError, TypeError):
    d = None
  if d is not None and d.type == "cpu":
    return
  if d is not None and d.type == _runtime.DEVICE_KIND:
    if d.index is None or d.index < _runtime.num_devices():
      return
  raise ValueError(
    f"{api}: {str(device)!r} is not a device of this process; use 'cpu' (the host) "
    "or the XLA device every replica's tensors live on ('xla:0', see "
    "strategy.extended.worker_devices)."
  )


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
      "scalars; reshape them to shape (1,) first."
    )
  axis = check_axis(axis, stacked.dim() - 1, api)
  moved = stacked.movedim(0, axis)
  shape = list(moved.shape)
  return moved.reshape(shape[:axis] + [shape[axis] * shape[axis + 1]] + shape[axis + 2 :])


def check_destinations(destinations, api):
  ok = (str, torch.device, torch.Tensor, DistributedValues)
  if _is_variable_module(destinations):
    return
  if isinstance(destinations, ok):
    if isinstance(destinations, str) and not destinations:
      raise ValueError(f"{api}: destinations must not be an empty string.")
    check_device_name(destinations, api)
    return
  if (
    isinstance(destinations, (list, tuple))
    and destinations
    and all(isinstance(d, ok) for d in destinations)
  ):
    for d in destinations:
      check_device_name(d, api)
    return
  raise ValueError(
    f"{api}: destinations must be a device (string or torch.device), a tensor, "
    f"a variable, a distributed value, or a non-empty list of them; got "
    f"{destinations!r}."
  )
