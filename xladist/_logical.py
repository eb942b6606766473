"""Logical devices inside a replica: one replica's work divided over its cores.

A TPUStrategy with k cores ("logical devices") per replica runs its step in a
manual region over ALL devices of a (replicas, k) mesh (docs/architecture.md,
"Logical devices", says why: torch_xla 2.9 has no partial-manual regions). Every
core of a replica traces the same program on the same replica value, so an
ordinary tensor is held whole, and identical, by each core of its replica.

`split(tensor, partition_dims)` makes a `LogicalSplit`: a tensor that reports the
replica-level shape but holds only this core's block (blocks numbered
row-major over `partition_dims`; core c holds block c). Operations on it run on
the blocks wherever that keeps the result exact, with explicit collectives over
the replica's cores (the "core groups" of the mesh), in the way tensor-parallel
layers are written by hand:

* pointwise ops: blockwise; a whole tensor combined with a split one is cut to
  the core's block (its gradient is summed over the cores);
* `F.linear` / `matmul` / `mm` with rows split -> rows split; columns of the
  right operand split -> columns split; a split contraction dim -> blockwise
  product summed over the cores (one all-reduce);
* transpose / t / permute (the partition follows the dims), view / reshape when
  only dim 0 is split and stays divisible, sum / mean over dims that include
  every split dim (blockwise, then one all-reduce) or none (blockwise);
* with only dim 0 (the batch) split: convolutions, pooling, layer / group norm,
  softmax over another dim, embedding lookups, flatten from dim 1 (each
  example on its own; weights are whole, their gradients summed over cores).

Everything else reassembles its split arguments first (each core places its
block in a zero tensor, one all-reduce over the cores: exact) and runs whole, so
the result is always the unsplit math (TF's promise); which ops are divided is a
matter of speed. The rules work at the torch-function level, so autograd
differentiates the blockwise computation itself, and the collectives are
autograd functions with the matching backward (a sum over cores going forward
is the identity going back, and a whole tensor entering blockwise work has its
gradient summed over the cores).
"""

import math

import optree
import torch
import torch.nn.functional as F

from xladist import runtime as _runtime

_aten = torch.ops.aten


# -- the arguments of a torch function ------------------------------------------------------
# __torch_function__ walks (args, kwargs) on every op of a LogicalSplit. optree
# called directly (C++) took 0.2x the time of torch.utils._pytree (pure Python)
# and 0.6x that of torch.utils._cxx_pytree (optree behind Python wrappers) on
# these arguments (docs/architecture.md, "Libraries xladist relies on"). One
# difference, harmless here: a torch.Size stays a leaf (torch's pytrees rebuild
# it as a tuple).
def _leaves(tree):
  return optree.tree_leaves(tree, none_is_leaf=True)


def _map(fn, tree):
  return optree.tree_map(fn, tree, none_is_leaf=True)


def _map_only(cls, fn, tree):
  """`fn` on the leaves that are `cls` instances, the other leaves unchanged."""
  return optree.tree_map(lambda x: fn(x) if isinstance(x, cls) else x, tree, none_is_leaf=True)


class CoreAxis:
  """This device's place among its replica's k cores, inside one step."""

  def __init__(self, num_replicas, device_id):
    self.num_cores = _runtime.cores_per_replica(num_replicas)
    self.groups = _runtime.replica_groups(within=True, num_replicas=num_replicas)
    self.core_id = device_id % self.num_cores  # traced int32 scalar

  def psum(self, t):
    """Sum over the replica's cores (an all-reduce over the core groups)."""
    if t.dtype == torch.bool:
      return self.psum(t.to(torch.int32)).bool()
    return _runtime.spmd_all_reduce("sum", t, 1.0, self.groups)

  def coordinates(self, dims):
    """This core's block coordinate along each dim (traced), row-major over dims."""
    coords, stride = [], self.num_cores
    for p in dims:
      stride //= p
      coords.append((self.core_id // stride) % p if p > 1 else None)
    return coords

  def block(self, full, dims):
    """This core's block of a whole tensor partitioned by `dims`."""
    for d, (p, c) in enumerate(zip(dims, self.coordinates(dims))):
      if p > 1:
        size = full.shape[d] // p
        index = c.to(torch.int64) * size + torch.arange(size, device=full.device)
        full = full.index_select(d, index)
    return full

  def assemble(self, local, dims):
    """The whole tensor from every core's block: exact (x + 0 == x)."""
    out = local
    for d, (p, c) in enumerate(zip(dims, self.coordinates(dims))):
      if p > 1:
        out = out.unsqueeze(d)
        size = list(out.shape)
        size[d] = p
        mask_shape = [1] * out.dim()
        mask_shape[d] = p
        mine = (torch.arange(p, device=out.device) == c).reshape(mask_shape)
        zero = torch.zeros((), dtype=out.dtype, device=out.device)
        out = torch.where(mine, out.expand(size), zero)
        out = out.reshape(size[:d] + [size[d] * size[d + 1]] + size[d + 2 :])
    return self.psum(out)


# -- autograd functions: the collectives of the core axis ------------------------------
class _Block(torch.autograd.Function):
  """Whole (same on every core) -> this core's block; backward: reassemble."""

  @staticmethod
  def forward(ctx, whole, dims, axis):
    ctx.dims, ctx.axis = dims, axis
    return axis.block(whole, dims)

  @staticmethod
  def backward(ctx, grad):
    return ctx.axis.assemble(grad, ctx.dims), None, None


class _Assemble(torch.autograd.Function):
  """Blocks -> the whole tensor on every core; backward: this core's block."""

  @staticmethod
  def forward(ctx, local, dims, axis):
    ctx.dims, ctx.axis = dims, axis
    return axis.assemble(local, dims)

  @staticmethod
  def backward(ctx, grad):
    return ctx.axis.block(grad, ctx.dims), None, None


class _SumCores(torch.autograd.Function):
  """Partial results -> their sum on every core; backward: the identity."""

  @staticmethod
  def forward(ctx, partial, axis):
    return axis.psum(partial)

  @staticmethod
  def backward(ctx, grad):
    return grad, None


class _Shared(torch.autograd.Function):
  """A whole tensor used by blockwise work: identity; backward: sum over cores."""

  @staticmethod
  def forward(ctx, whole, axis):
    ctx.axis = axis
    return whole.view_as(whole)

  @staticmethod
  def backward(ctx, grad):
    return ctx.axis.psum(grad), None


# -- the split tensor ---------------------------------------------------------------------
class LogicalSplit(torch.Tensor):
  """A replica's tensor of which this core holds one block (see the module doc)."""

  _dims = ()
  _axis = None

  @classmethod
  def __torch_function__(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():
      rule = _RULES.get(func)
      if rule is None and _is_pointwise(func):
        rule = _pointwise
      if rule is not None:
        out = rule(func, args, kwargs)
        if out is not NotImplemented:
          return out
      args, kwargs = _map_only(LogicalSplit, _whole, (args, kwargs))
      return func(*args, **kwargs)

  def __repr__(self):
    return (
      f"LogicalSplit(shape={tuple(self.shape)}, dtype={self.dtype}, "
      f"partition_dims={list(self._dims)})"
    )


def _wrap(local, dims, axis):
  out = local.as_subclass(LogicalSplit)
  out._dims, out._axis = tuple(dims), axis
  return out


def _local(x):
  return torch.Tensor.as_subclass(x, torch.Tensor)


def _full_shape(x):
  return torch.Size(s * p for s, p in zip(_local(x).shape, x._dims))


def _whole(x):
  return _Assemble.apply(_local(x), x._dims, x._axis)


def split(tensor, dims, axis):
  """`tensor` (whole on every core) as a LogicalSplit partitioned by `dims`."""
  return _wrap(_Block.apply(tensor, tuple(dims), axis), dims, axis)


def whole(value):
  """A LogicalSplit reassembled; anything else unchanged."""
  if isinstance(value, LogicalSplit):
    with torch._C.DisableTorchFunctionSubclass():
      return _whole(value)
  return value


# -- rules (called with torch-function handling off) --------------------------------------
_DUNDER_OPS = {
  "radd": "add",
  "iadd": "add_",
  "rmul": "mul",
  "imul": "mul_",
  "rsub": "rsub",
  "isub": "sub_",
  "truediv": "div",
  "rtruediv": "div",
  "rdiv": "div",
  "itruediv": "div_",
  "rpow": "pow",
  "ipow": "pow_",
  "and": "bitwise_and",
  "or": "bitwise_or",
  "xor": "bitwise_xor",
  "invert": "bitwise_not",
  "lt": "lt",
  "le": "le",
  "gt": "gt",
  "ge": "ge",
  "eq": "eq",
  "ne": "ne",
}
_pointwise_cache = {}


def _is_pointwise(func):
  name = getattr(func, "__name__", "")
  if name not in _pointwise_cache:
    base = name.strip("_")
    base = _DUNDER_OPS.get(base, base)
    packet = getattr(_aten, base, None)
    _pointwise_cache[name] = isinstance(packet, torch._ops.OpOverloadPacket) and any(
      torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()
    )
  return _pointwise_cache[name]


def _prepare(splits, args, kwargs):
  """Blocks for the operands of a blockwise pointwise op, or None."""
  ref = splits[0]
  shape, dims, axis = _full_shape(ref), ref._dims, ref._axis
  if any(_full_shape(s) != shape or s._dims != dims for s in splits):
    return None
  tensors = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
  if (
    torch.broadcast_shapes(
      *[_full_shape(t) if isinstance(t, LogicalSplit) else t.shape for t in tensors]
    )
    != shape
  ):
    return None  # a split operand would be broadcast up: not blockwise

  def local(a):
    if isinstance(a, LogicalSplit):
      return _local(a)
    if not isinstance(a, torch.Tensor):
      return a
    offset = len(shape) - a.dim()
    a_dims = tuple(dims[d + offset] if a.shape[d] != 1 else 1 for d in range(a.dim()))
    if math.prod(a_dims) > 1:
      return _Block.apply(a, a_dims, axis)
    return _Shared.apply(a, axis) if a.requires_grad else a

  return _map(local, (args, kwargs)), dims, axis


def _writes_first_argument(func):
  """add_, mul_, __iadd__ ... (but not the reflected __rsub__, __rpow__ ...)."""
  name = func.__name__
  return name.startswith("__i") if name.startswith("__") else name.endswith("_")


def _pointwise(func, args, kwargs):
  splits = [a for a in _leaves((args, kwargs)) if isinstance(a, LogicalSplit)]
  in_place = _writes_first_argument(func)
  if "out" in kwargs or (in_place and not isinstance(args[0], LogicalSplit)):
    return NotImplemented  # writing into a whole tensor: reassemble first
  prepared = _prepare(splits, args, kwargs)
  if prepared is None:
    return NotImplemented
  (largs, lkwargs), dims, axis = prepared
  out = func(*largs, **lkwargs)
  if in_place:
    return args[0]  # the block was written
  return _wrap(out, dims, axis)


def _operand(x, dims_if_whole, axis):
  """(local tensor, dims) of a matmul operand; whole operands cut to `dims_if_whole`."""
  if isinstance(x, LogicalSplit):
    return _local(x), x._dims
  if math.prod(dims_if_whole) > 1:
    return _Block.apply(x, dims_if_whole, axis), dims_if_whole
  return (_Shared.apply(x, axis) if x.requires_grad else x), (1, 1)


def _mm2d(a, b):
  """The blockwise product of two 2-D operands (at least one split), or NotImplemented."""
  axis = (a if isinstance(a, LogicalSplit) else b)._axis
  da = a._dims if isinstance(a, LogicalSplit) else None
  db = b._dims if isinstance(b, LogicalSplit) else None
  if da is not None and da[1] == 1 and db is None:  # rows split
    la, _ = _operand(a, None, axis)
    lb, _ = _operand(b, (1, 1), axis)
    return _wrap(torch.mm(la, lb), (da[0], 1), axis)
  if da is None and db is not None and db[0] == 1:  # columns split
    la, _ = _operand(a, (1, 1), axis)
    lb, _ = _operand(b, None, axis)
    return _wrap(torch.mm(la, lb), (1, db[1]), axis)
  p = da[1] if da is not None else db[0]
  if (da is None or da == (1, p)) and (db is None or db == (p, 1)):  # contraction split
    la, _ = _operand(a, (1, p), axis)
    lb, _ = _operand(b, (p, 1), axis)
    return _SumCores.apply(torch.mm(la, lb), axis)
  return NotImplemented


def _mm(func, args, kwargs):
  a, b = args[:2]
  if kwargs or a.dim() != 2 or b.dim() != 2:
    return NotImplemented
  return _mm2d(a, b)


def _matmul(func, args, kwargs):
  a, b = args[:2]
  if kwargs or b.dim() != 2 or a.dim() < 2:
    return NotImplemented
  if a.dim() == 2:
    return _mm2d(a, b)
  if not isinstance(a, LogicalSplit) or isinstance(b, LogicalSplit):
    return NotImplemented
  return _leading(a, lambda x2: _mm2d(x2, b))


def _leading(x, fn2d):
  """Applies a 2-D rule to x viewed as (rows, last dim), then views back."""
  shape = _full_shape(x)
  x2 = _view(None, (x, (-1, shape[-1])), {})
  if x2 is NotImplemented:
    return NotImplemented
  out = fn2d(x2)
  if out is NotImplemented:
    return NotImplemented
  new_shape = tuple(shape[:-1]) + (
    _full_shape(out)[-1] if isinstance(out, LogicalSplit) else out.shape[-1],
  )
  if isinstance(out, LogicalSplit):
    return _view(None, (out, new_shape), {})
  return out.reshape(new_shape)


def _linear(func, args, kwargs):
  x = args[0]
  weight = args[1] if len(args) > 1 else kwargs.get("weight")
  bias = args[2] if len(args) > 2 else kwargs.get("bias")
  if (
    not isinstance(x, LogicalSplit)
    or isinstance(weight, LogicalSplit)
    or isinstance(bias, LogicalSplit)
  ):
    return NotImplemented
  if x.dim() == 2:
    out = _mm2d(x, weight.t())
  else:
    out = _leading(x, lambda x2: _mm2d(x2, weight.t()))
  if out is NotImplemented or bias is None:
    return out
  if isinstance(out, LogicalSplit):
    return _pointwise(torch.add, (out, bias), {})
  return out + bias


_T_GETTER = torch.Tensor.T.__get__  # its __name__ is "__get__"


def _transpose(func, args, kwargs):
  x = args[0]
  n = x.dim()
  name = func.__name__
  if name == "t" or func == _T_GETTER:
    perm = list(range(n))[::-1]
  elif name in ("transpose", "swapaxes"):
    perm = list(range(n))
    a, b = (d % n for d in (list(args[1:3]) or [kwargs["dim0"], kwargs["dim1"]]))
    perm[a], perm[b] = perm[b], perm[a]
  else:  # permute
    dims = args[1:] if len(args) > 2 or isinstance(args[1], int) else args[1]
    perm = [d % n for d in dims]
  out = _local(x).permute(perm)
  return _wrap(out, [x._dims[d] for d in perm], x._axis)


def _view(func, args, kwargs):
  x = args[0]
  shape = (
    list(args[1])
    if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size))
    else list(args[1:])
  )
  p = x._dims[0]
  if kwargs or any(q > 1 for q in x._dims[1:]):
    return NotImplemented
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    shape[shape.index(-1)] = math.prod(_full_shape(x)) // known
  if not shape or shape[0] % p:
    return NotImplemented
  local = _local(x).reshape([shape[0] // p] + shape[1:])
  return _wrap(local, (p,) + (1,) * (len(shape) - 1), x._axis)


def _reduce(func, args, kwargs):
  x = args[0]
  if not isinstance(x, LogicalSplit) or (
    len(args) > 1 and not isinstance(args[1], (int, tuple, list))
  ):
    return NotImplemented
  mean = func.__name__ == "mean"
  dims = args[1] if len(args) > 1 else kwargs.get("dim")
  keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
  extra = {k: v for k, v in kwargs.items() if k not in ("dim", "keepdim")}
  if set(extra) - {"dtype"}:
    return NotImplemented
  n = x.dim()
  dims = [dims] if isinstance(dims, int) else dims
  reduced = set(range(n)) if dims is None or len(dims) == 0 else {d % n for d in dims}
  split_dims = {d for d, p in enumerate(x._dims) if p > 1}
  local = _local(x)
  if dims is None:
    partial = local.sum(**extra)
  else:
    partial = local.sum(sorted(reduced), keepdim=keepdim, **extra)
  if mean:
    partial = partial / math.prod(_full_shape(x)[d] for d in reduced)
  if split_dims <= reduced:
    return _SumCores.apply(partial, x._axis)
  if split_dims & reduced:
    return NotImplemented
  if mean:
    return NotImplemented  # handled whole: keeps the unsplit op's rounding
  kept = x._dims if keepdim else [p for d, p in enumerate(x._dims) if d not in reduced]
  return _wrap(partial, kept, x._axis)


def _batchwise(func, args, kwargs):
  """Ops that treat each index of dim 0 on its own (convolutions, pooling,
  layer norm, softmax over another dim, embedding lookups): blockwise when only
  dim 0 is split and every other tensor operand (a weight) is whole."""
  x = args[0]
  if not isinstance(x, LogicalSplit) or any(p > 1 for p in x._dims[1:]):
    return NotImplemented
  if any(isinstance(a, LogicalSplit) for a in _leaves((args[1:], kwargs))):
    return NotImplemented
  if func in _OVER_A_DIM:
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or dim % x.dim() == 0:
      return NotImplemented
  if func is torch.Tensor.flatten:
    start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
    if start % x.dim() == 0:
      return _view(func, (x, (-1,)), {}) if len(args) == 1 and not kwargs else NotImplemented
  axis = x._axis
  rest, kwargs = _map_only(
    torch.Tensor, lambda t: _Shared.apply(t, axis) if t.requires_grad else t, (args[1:], kwargs)
  )
  out = func(_local(x), *rest, **kwargs)
  if not isinstance(out, torch.Tensor):
    return NotImplemented
  return _wrap(out, (x._dims[0],) + (1,) * (out.dim() - 1), axis)


_OVER_A_DIM = (
  F.softmax,
  F.log_softmax,
  torch.softmax,
  torch.log_softmax,
  torch.Tensor.softmax,
  torch.Tensor.log_softmax,
)
_BATCHWISE = _OVER_A_DIM + (
  F.conv1d,
  F.conv2d,
  F.conv3d,
  F.conv_transpose1d,
  F.conv_transpose2d,
  F.conv_transpose3d,
  F.max_pool1d,
  F.max_pool2d,
  F.max_pool3d,
  F.avg_pool1d,
  F.avg_pool2d,
  F.avg_pool3d,
  F.adaptive_avg_pool1d,
  F.adaptive_avg_pool2d,
  F.adaptive_avg_pool3d,
  F.layer_norm,
  F.group_norm,
  F.embedding,
  torch.Tensor.flatten,
)


def _shape(func, args, kwargs):
  return _full_shape(args[0])


def _size(func, args, kwargs):
  shape = _full_shape(args[0])
  dim = args[1] if len(args) > 1 else kwargs.get("dim")
  return shape if dim is None else shape[dim]


def _same_layout(func, args, kwargs):
  x = args[0]
  return _wrap(func(_local(x), *args[1:], **kwargs), x._dims, x._axis)


_RULES = {
  torch.Tensor.shape.__get__: _shape,
  torch.Tensor.size: _size,
  torch.Tensor.dim: lambda f, a, k: len(a[0]._dims),
  torch.Tensor.ndim.__get__: lambda f, a, k: len(a[0]._dims),
  torch.Tensor.numel: lambda f, a, k: math.prod(_full_shape(a[0])),
  torch.Tensor.__len__: lambda f, a, k: _full_shape(a[0])[0],
  torch.Tensor.detach: _same_layout,
  torch.Tensor.clone: _same_layout,
  torch.Tensor.contiguous: _same_layout,
  torch.Tensor.float: _same_layout,
  torch.Tensor.to: lambda f, a, k: (
    _same_layout(f, a, k)
    if not any(isinstance(v, (str, torch.device)) for v in list(a[1:]) + list(k.values()))
    else NotImplemented
  ),
  torch.Tensor.type_as: _same_layout,
  torch.zeros_like: _same_layout,
  torch.ones_like: _same_layout,
  torch.Tensor.t: _transpose,
  torch.t: _transpose,
  _T_GETTER: _transpose,
  torch.Tensor.transpose: _transpose,
  torch.transpose: _transpose,
  torch.Tensor.permute: _transpose,
  torch.permute: _transpose,
  torch.Tensor.view: _view,
  torch.Tensor.reshape: _view,
  torch.reshape: _view,
  torch.mm: _mm,
  torch.Tensor.mm: _mm,
  torch.matmul: _matmul,
  torch.Tensor.matmul: _matmul,
  torch.Tensor.__matmul__: _matmul,
  F.linear: _linear,
  torch.sum: _reduce,
  torch.Tensor.sum: _reduce,
  torch.mean: _reduce,
  torch.Tensor.mean: _reduce,
  **{f: _batchwise for f in _BATCHWISE},
}
