"""Ops that torch_xla 2.9 has no lowering for, composed of ops it lowers.

torch_xla runs an aten op without an XLA kernel on the host (its CPU
fallback): it computes the op's inputs, copies them to the CPU, runs torch's
CPU kernel and copies the result back. Outside a step that is slow; inside
`strategy.run` it is a host read of traced values, which xladist refuses. These
ops are common in ordinary models:

* `aten::_weight_norm_interface` (`nn.utils.parametrizations.weight_norm`,
  the old `nn.utils.weight_norm`), and its backward;
* `aten::_embedding_bag` and `aten::_embedding_bag_forward_only`
  (`nn.EmbeddingBag`, `F.embedding_bag`), and their backward;
* `aten::linalg_matrix_exp` (`torch.linalg.matrix_exp`, and
  `nn.utils.parametrizations.orthogonal` of a square weight), and its backward;
* `aten::avg_pool2d` (`nn.AvgPool1d/2d`), whose backward torch_xla runs on the
  host with `ceil_mode=True` (ResNet-D's downsampling uses it);
* `aten::batch_norm` in evaluation mode under autograd (a BatchNorm after
  `model.eval()` with a backward through it, e.g. frozen statistics while
  fine-tuning), whose backward torch_xla cannot build at all.

Each gets a kernel for the XLA device at the Autograd key (`AutogradXLA`),
written with ops torch_xla lowers: autograd differentiates the composition,
so no backward op is needed either. The kernels are registered once, when the
torch_xla runtime starts (`register`), and only where torch_xla has no kernel of
its own for the op (a torch_xla that lowers one keeps its own), except
avg_pool2d and batch_norm, whose kernels torch_xla 2.9 has but runs partly on
the host or fails in.
"""

import torch

_LIBRARY = []  # the torch.library.Library that holds the kernels, once registered

# EmbeddingBag's modes, as aten numbers them.
_SUM, _MEAN, _MAX = 0, 1, 2
# Squarings that `_matrix_exp` can apply: scales matrices of norm up to
# 2**_MAX_SQUARINGS / 2 to norm <= 1/2.
_MAX_SQUARINGS = 24
_TAYLOR_TERMS = 18


def weight_norm_interface(v, g, dim=0):
  """`w = g * v / ||v||`, the norm over every dimension but `dim`; (w, norm)."""
  if dim == -1:  # aten's convention: the norm of the whole tensor
    norm = v.norm().reshape([1] * v.dim())
  else:
    norm = v.norm(p=2, dim=[d for d in range(v.dim()) if d != dim], keepdim=True)
  return v * (g / norm), norm


def embedding_bag(
  weight,
  indices,
  offsets,
  scale_grad_by_freq=False,
  mode=_SUM,
  sparse=False,
  per_sample_weights=None,
  include_last_offset=False,
  padding_idx=-1,
):
  """aten::_embedding_bag with fixed shapes: (output, offset2bag, bag_size, max_indices).

  Each index belongs to the bag whose offset precedes it; indices equal to
  `padding_idx` take part in no bag; an empty bag gives zeros (torch's rule).
  """
  if sparse:
    raise RuntimeError(
      "nn.EmbeddingBag(sparse=True) / F.embedding_bag(sparse=True) on an XLA "
      "device: XLA has no sparse gradients. Use sparse=False (the gradient is "
      "then a dense tensor of the weight's shape)."
    )
  if scale_grad_by_freq:
    raise RuntimeError(
      "nn.EmbeddingBag(scale_grad_by_freq=True) on an XLA device is not supported "
      "by xladist (its gradient scaling counts indices on the host). Use "
      "scale_grad_by_freq=False."
    )
  n = indices.shape[0]
  bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
  positions = torch.arange(n, device=indices.device, dtype=offsets.dtype)
  # The bag of each index: how many offsets (of the bags' starts) are <= it, less one.
  starts = offsets[:bags]
  offset2bag = (positions.unsqueeze(1) >= starts.unsqueeze(0)).sum(1) - 1
  if include_last_offset:
    # Indices at or after the last offset belong to no bag.
    inside = positions < offsets[bags]
  else:
    inside = torch.ones_like(positions, dtype=torch.bool)
  kept = inside & (offset2bag >= 0)
  if padding_idx is not None and padding_idx >= 0:
    kept = kept & (indices != padding_idx)
  # Entries that belong to no bag go to a spare row `bags`, dropped at the end.
  target = torch.where(kept, offset2bag, torch.full_like(offset2bag, bags))
  rows = weight.index_select(0, indices)
  if per_sample_weights is not None:
    rows = rows * per_sample_weights.unsqueeze(1).to(rows.dtype)
  counts = torch.zeros(bags + 1, dtype=rows.dtype, device=rows.device).index_add(
    0, target, torch.ones_like(target, dtype=rows.dtype)
  )[:bags]
  shape = (bags + 1, weight.shape[1])
  if mode == _MAX:
    filled = torch.full(shape, float("-inf"), dtype=rows.dtype, device=rows.device)
    index = target.unsqueeze(1).expand_as(rows)
    out = filled.scatter_reduce(0, index, rows, reduce="amax", include_self=True)[:bags]
    out = torch.where(counts.unsqueeze(1) > 0, out, torch.zeros_like(out))
    # Which embedding row gave each bag's maximum, per column (aten's
    # max_indices): the first position in the bag holding the maximum.
    holds_max = kept.unsqueeze(1) & (rows == out[target.clamp(max=bags - 1)])
    never = torch.full_like(index, n)
    first = never.new_full(shape, n).scatter_reduce(
      0, index, torch.where(holds_max, positions.unsqueeze(1).expand_as(rows), never), "amin"
    )[:bags]
    max_indices = indices[first.clamp(max=n - 1)]
    max_indices = torch.where(counts.unsqueeze(1) > 0, max_indices, torch.zeros_like(max_indices))
  else:
    out = torch.zeros(shape, dtype=rows.dtype, device=rows.device).index_add(0, target, rows)
    out = out[:bags]
    if mode == _MEAN:
      out = out / counts.clamp(min=1).unsqueeze(1)
    max_indices = torch.zeros(bags, dtype=offsets.dtype, device=offsets.device)
  return out, offset2bag, counts.to(offsets.dtype), max_indices


def matrix_exp(a):
  """exp(a) of square matrices (batched): scaling, a Taylor polynomial, squaring.

  The number of squarings is computed on the device (no host read) from the
  matrix's 1-norm, at most `_MAX_SQUARINGS`; the Taylor polynomial of degree
  `_TAYLOR_TERMS` at norm <= 1/2 is exact to float64 rounding.
  """
  norm = a.abs().sum(-2).amax(-1)  # the 1-norm of each matrix
  s = torch.ceil(torch.log2(norm.clamp(min=1e-30) * 2)).clamp(min=0, max=_MAX_SQUARINGS)
  scaled = a / torch.pow(2.0, s).to(a.dtype)[..., None, None]
  eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
  result, term = eye, eye
  for k in range(1, _TAYLOR_TERMS + 1):
    term = term @ scaled / k
    result = result + term
  for i in range(_MAX_SQUARINGS):
    squared = result @ result
    result = torch.where((s > i)[..., None, None], squared, result)
  return result


def avg_pool2d(
  x,
  kernel_size,
  stride=(),
  padding=0,
  ceil_mode=False,
  count_include_pad=True,
  divisor_override=None,
):
  """aten::avg_pool2d as window sums divided by torch's divisors.

  torch_xla 2.9 lowers the forward but runs its backward on the host when
  `ceil_mode=True` (and its forward disagrees with torch's when a
  `divisor_override` comes with `ceil_mode=True`). Here the windows a ceil-mode
  output adds are made ordinary ones by zeros appended after the input, the
  sums come from avg_pool3d in floor mode counting padding (a window of depth
  1, times the window's area; lowered, forward and backward), and each sum is
  divided by its window's divisor, which depends on shapes only: the window
  clipped to input plus padding, or to the input with `count_include_pad=False`,
  or `divisor_override`.
  """
  kh, kw = _pair(kernel_size)
  sh, sw = _pair(stride) if stride else (kh, kw)
  ph, pw = _pair(padding)
  batched = x.dim() == 4
  t = x if batched else x.unsqueeze(0)
  h, w = t.shape[-2:]
  oh = _pooled_size(h, kh, sh, ph, ceil_mode)
  ow = _pooled_size(w, kw, sw, pw, ceil_mode)
  extra_h = max(0, (oh - 1) * sh + kh - (h + 2 * ph))
  extra_w = max(0, (ow - 1) * sw + kw - (w + 2 * pw))
  if extra_h or extra_w:
    t = torch.nn.functional.pad(t, (0, extra_w, 0, extra_h))
  # Floor mode, padding counted: every window's divisor is kh * kw.
  sums = torch.nn.functional.avg_pool3d(
    t.unsqueeze(2), (1, kh, kw), (1, sh, sw), (0, ph, pw), count_include_pad=True
  ).squeeze(2)[..., :oh, :ow] * (kh * kw)
  if divisor_override:
    out = sums / divisor_override
  else:
    rows = _window_sizes(oh, sh, ph, kh, h, count_include_pad)
    cols = _window_sizes(ow, sw, pw, kw, w, count_include_pad)
    divisor = torch.tensor(rows, dtype=torch.float32)[:, None] * torch.tensor(cols)[None, :]
    out = sums / divisor.to(sums.device, sums.dtype)
  return out if batched else out.squeeze(0)


def batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
  """aten::batch_norm; in evaluation mode under autograd, composed of lowered ops.

  torch_xla 2.9's `native_batch_norm` in evaluation mode returns empty saved
  statistics, and its `native_batch_norm_backward` drops the running statistics
  it is given and builds XLA's BatchNormGrad (the training-mode gradient) from
  the saved ones: the backward fails ("The size of mean should be compatible
  with feature count, but the size of offset factor is 0"). Here evaluation
  mode with a tensor that requires grad is torch's formula,
  `(x - running_mean) / sqrt(running_var + eps) * weight + bias`, which
  autograd differentiates (the gradients of x, weight and bias torch's CPU
  kernel gives; the running statistics are constants, neither read for grad nor
  written). Training mode, and evaluation without autograd, take aten's own
  path (`_batch_norm_impl_index`, what aten::batch_norm calls).
  """
  needs_grad = torch.is_grad_enabled() and any(
    t is not None and t.requires_grad for t in (x, weight, bias)
  )
  if training or not needs_grad or running_mean is None or running_var is None:
    return torch.ops.aten._batch_norm_impl_index(
      x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
    )[0]
  shape = [1, -1] + [1] * (x.dim() - 2)  # per channel, the channels in dimension 1
  scale = torch.rsqrt(running_var.detach() + eps)
  if weight is not None:
    scale = scale * weight
  out = (x - running_mean.detach().view(shape)) * scale.view(shape)
  if bias is not None:
    out = out + bias.view(shape)
  return out.to(x.dtype)


def _pooled_size(size, kernel, stride, pad, ceil_mode):
  """torch's pooling output length (a ceil-mode window must start inside the
  input or its left padding)."""
  span = size + 2 * pad - kernel
  out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
  if ceil_mode and (out - 1) * stride >= size + pad:
    out -= 1
  return out


def _pair(value):
  value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
  return value * 2 if len(value) == 1 else value


def _window_sizes(out, stride, pad, kernel, size, count_include_pad):
  """Each output position's window length along one dimension (torch's avg_pool rule)."""
  sizes = []
  for i in range(out):
    start = i * stride - pad
    end = min(start + kernel, size + pad)
    length = end - start
    if not count_include_pad:
      length = min(end, size) - max(start, 0)
    sizes.append(max(length, 1))
  return sizes


def _has_xla_kernel(name):
  return torch._C._dispatch_has_kernel_for_dispatch_key(name, "XLA")


def register():
  """Registers the kernels above for the XLA device (once per process)."""
  if _LIBRARY:
    return
  library = torch.library.Library("aten", "IMPL")
  kernels = {
    "_weight_norm_interface": weight_norm_interface,
    "_embedding_bag": embedding_bag,
    "_embedding_bag_forward_only": embedding_bag,
    "linalg_matrix_exp": matrix_exp,
  }
  for name, kernel in kernels.items():
    if not _has_xla_kernel(f"aten::{name}"):
      library.impl(name, kernel, "AutogradXLA")
  # torch_xla has a kernel for it, which runs on the host in ceil mode: replaced
  # above autograd (the composition is differentiated).
  library.impl("avg_pool2d", avg_pool2d, "AutogradXLA")
  # aten::batch_norm is composite (no kernel of torch_xla's): a kernel at
  # AutogradXLA takes the XLA device's calls, the others go on as before.
  library.impl("batch_norm", batch_norm, "AutogradXLA")
  _LIBRARY.append(library)
