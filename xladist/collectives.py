"""Cross-replica collectives inside a step, lowered to XLA HLO collectives.

These run inside the manual region of `strategy.run`, where every tensor is one
replica's local value. Each becomes an HLO `all-reduce` over the replica group
with global device ids (the only kind that works in an SPMD program, which has
one replica and N partitions).

* `all_reduce` packs the tensors of one call into flat buffers, one collective
  per pack: by default one pack per dtype, so a nested structure of many small
  tensors costs few collectives; `pack_by_bytes` and `pack_into` are the other
  plans (CommunicationOptions.bytes_per_pack, NcclAllReduce(num_packs)).
* `all_gather` is the runtime's (`spmd_all_gather`): jax's all-gather; torch_xla
  2.9 has none in its SPMD bindings, so there each replica places its value in
  its own row of a zero buffer (a select) and the rows are summed with one
  all-reduce. x + 0 is exact for every value, inf and NaN included (XLA:CPU
  flushes subnormals to zero, as in any computation).
* `reduce_scatter` (sharded state, sharded_state.py): each replica's rows of
  the sum, one reduce-scatter per dtype (torch_xla's `_xla_spmd_reduce_scatter`,
  jax's `psum_scatter`).

SUM and MEAN are differentiable (the gradient of a sum all-reduce is a sum
all-reduce of the gradients), and so is all_gather.
"""

import torch

from xladist import runtime as _runtime
from xladist.reduce_util import ReduceOp

_HLO_OP = {ReduceOp.SUM: "sum", ReduceOp.MEAN: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


def _reduce_flat(op, flat, num_replicas):
  """One all-reduce of a 1-D buffer over the replicas."""
  groups = _runtime.replica_groups(num_replicas)
  if op is ReduceOp.MEAN and flat.is_floating_point():
    return _runtime.spmd_all_reduce("sum", flat, 1.0 / num_replicas, groups)
  if flat.dtype == torch.bool:
    out = _runtime.spmd_all_reduce(_HLO_OP[op], flat.to(torch.int32), 1.0, groups)
    return out.bool() if op is not ReduceOp.SUM else out
  out = _runtime.spmd_all_reduce(_HLO_OP[op], flat, 1.0, groups)
  if op is ReduceOp.MEAN:  # integers: the floor of the mean, dtype kept
    out = torch.div(out, num_replicas, rounding_mode="floor")
  return out


class _PackedAllReduce(torch.autograd.Function):
  """All-reduce of several tensors of one dtype through one packed buffer."""

  @staticmethod
  def forward(ctx, op, num_replicas, *tensors):
    ctx.op, ctx.num_replicas = op, num_replicas
    return tuple(_packed(op, num_replicas, tensors))

  @staticmethod
  def backward(ctx, *grads):
    if ctx.op not in (ReduceOp.SUM, ReduceOp.MEAN):
      raise RuntimeError(
        f"ReplicaContext.all_reduce with {ctx.op} is not differentiable; only "
        "ReduceOp.SUM and ReduceOp.MEAN are."
      )
    grads = [torch.zeros((), device=g.device, dtype=g.dtype) if g is None else g for g in grads]
    return (None, None) + tuple(_packed(ctx.op, ctx.num_replicas, grads))


def _packed(op, num_replicas, tensors):
  if len(tensors) == 1:
    t = tensors[0]
    return [_reduce_flat(op, t.reshape(-1), num_replicas).view(t.shape)]
  flat = torch.cat([t.reshape(-1) for t in tensors])
  flat = _reduce_flat(op, flat, num_replicas)
  # Each result its own tensor, not a view of `flat`: an in-place write to a view
  # (a gradient clipped after aggregation) makes torch_xla rewrite the whole packed
  # buffer for each write, every other piece reading through the chain (ResNet-18:
  # a step 30x slower to run).
  return [
    piece.view(t.shape).clone()
    for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)
  ]


def all_reduce(op, tensors, num_replicas, packs=None):
  """All-reduces a list of local tensors; returns the list of results.

  `packs` is a list of lists of indices into `tensors`, each of one dtype (see
  `pack_by_dtype`, `pack_by_bytes`, `pack_into`); each pack becomes one
  collective. Default: one pack per dtype.
  """
  if packs is None:
    packs = pack_by_dtype(tensors)
  out = [None] * len(tensors)
  for indices in packs:
    group = [tensors[i] for i in indices]
    if any(t.requires_grad for t in group):
      reduced = _PackedAllReduce.apply(op, num_replicas, *group)
    else:
      reduced = _packed(op, num_replicas, group)
    for i, r in zip(indices, reduced):
      out[i] = r
  return out


# -- pack plans: which tensors of one batch reduction share a collective ------------


def pack_by_dtype(tensors):
  """One pack per dtype (in order of first appearance)."""
  by_dtype = {}
  for i, t in enumerate(tensors):
    by_dtype.setdefault(t.dtype, []).append(i)
  return list(by_dtype.values())


def _nbytes(t):
  return t.numel() * t.element_size()


def pack_by_bytes(tensors, bytes_per_pack):
  """Per dtype, in order: buckets of at most `bytes_per_pack` bytes.

  A tensor bigger than a bucket gets a pack of its own.
  """
  packs = []
  for group in pack_by_dtype(tensors):
    current, size = [], 0
    for i in group:
      n = _nbytes(tensors[i])
      if current and size + n > bytes_per_pack:
        packs.append(current)
        current, size = [], 0
      current.append(i)
      size += n
    if current:
      packs.append(current)
  return packs


def pack_into(tensors, num_packs):
  """Per dtype: `num_packs` contiguous packs of roughly equal bytes.

  A dtype with fewer tensors than `num_packs` gets one pack per tensor, so a
  batch reduction of one dtype with at least `num_packs` tensors has exactly
  `num_packs` collectives, and one with d dtypes at most d * num_packs.
  `num_packs == 0`: no packing, one collective per tensor.
  """
  if num_packs == 0:
    return [[i] for i in range(len(tensors))]
  packs = []
  for group in pack_by_dtype(tensors):
    k = min(num_packs, len(group))
    sizes = [_nbytes(tensors[i]) for i in group]
    total = sum(sizes)
    start, acc, cut = 0, 0, 1
    for pos, size in enumerate(sizes):
      acc += size
      left = len(group) - pos - 1  # tensors after this one
      # Close a pack once it reaches its share of the bytes, or when the
      # remaining tensors are just enough for the remaining packs.
      if cut < k and (acc * k >= cut * total or left == k - cut):
        packs.append(group[start : pos + 1])
        start, cut = pos + 1, cut + 1
    packs.append(group[start:])
  return packs


class _GatherStacked(torch.autograd.Function):
  @staticmethod
  def forward(ctx, local, replica_id, num_replicas):
    ctx.save_for_backward(replica_id)
    ctx.num_replicas = num_replicas
    return _gather_stacked(local, replica_id, num_replicas)

  @staticmethod
  def backward(ctx, grad):
    (replica_id,) = ctx.saved_tensors
    total = _reduce_flat(ReduceOp.SUM, grad.reshape(-1), ctx.num_replicas).view(grad.shape)
    return total.index_select(0, replica_id.reshape(1)).squeeze(0), None, None


def _gather_stacked(local, replica_id, num_replicas):
  src = local.to(torch.int32) if local.dtype == torch.bool else local
  out = _runtime.spmd_all_gather(src, replica_id, _runtime.replica_groups(num_replicas))
  return out.bool() if local.dtype == torch.bool else out


def gather_stacked_many(tensors, replica_id, num_replicas, packs=None):
  """`gather_stacked` of several tensors, one collective per pack.

  Returns, for each tensor, its (num_replicas, *shape) stack of every replica's value.
  """
  if packs is None:
    packs = pack_by_dtype(tensors)
  out = [None] * len(tensors)
  for indices in packs:
    group = [tensors[i] for i in indices]
    if len(group) == 1:
      out[indices[0]] = gather_stacked(group[0], replica_id, num_replicas)
      continue
    flat = torch.cat([t.reshape(-1) for t in group])
    stacked = gather_stacked(flat, replica_id, num_replicas)
    pieces = stacked.split([t.numel() for t in group], dim=1)
    for i, piece, t in zip(indices, pieces, group):
      out[i] = piece.reshape((num_replicas,) + tuple(t.shape))
  return out


def gather_stacked(local, replica_id, num_replicas):
  """Every replica's value, stacked on a new leading dim (same on every replica)."""
  if local.requires_grad:
    return _GatherStacked.apply(local, replica_id, num_replicas)
  return _gather_stacked(local, replica_id, num_replicas)


def select_own(stacked, replica_id):
  """Row `replica_id` of a (num_replicas, ...) tensor that every replica holds."""
  return stacked.index_select(0, replica_id.reshape(1).to(torch.int64)).squeeze(0)


def reduce_scatter(op, rows, num_replicas, packs=None):
  """Row r of the SUM (or MEAN) over the replicas of each (num_replicas, k_i)
  local tensor in `rows`, on replica r: one reduce-scatter per pack (`packs`,
  as `pack_by_dtype` gives by default; the rows of a pack side by side)."""
  if op not in (ReduceOp.SUM, ReduceOp.MEAN):
    raise ValueError(f"reduce_scatter: {op} is not SUM or MEAN")
  scale = 1.0 / num_replicas if op is ReduceOp.MEAN else 1.0
  groups = _runtime.replica_groups(num_replicas)
  out = [None] * len(rows)
  for indices in pack_by_dtype(rows) if packs is None else packs:
    group = [rows[i] for i in indices]
    packed = group[0] if len(group) == 1 else torch.cat(group, dim=1)
    reduced = _runtime.spmd_reduce_scatter(packed, scale, groups)
    for i, piece in zip(indices, reduced.split([t.shape[1] for t in group])):
      out[i] = piece
  return out
