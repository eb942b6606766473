"""Lowerings of aten ops that torchax 0.0.13 lacks or gets wrong (fixes 3, 9 and 10
of torchax_fixes.py, which installs them): convolution and max-pool backward as
the `jax.vjp` of torchax's own forward lowerings, average pooling (forward and
backward) and `nn.EmbeddingBag` (forward and its backward ops). Each is a rule
`rule(env, *args, **kwargs)` computing the op on jax arrays; `lowered_ops()`
maps the aten ops to them. torchax_fixes.py's docstring says what each fixes.
"""

import functools


@functools.cache
def _aten():
  import torch

  return torch.ops.aten


def _jax_of(t):
  return t.jax()  # a torchax Tensor's array, or a torchax View's, materialized


def _conv_backward(
  env,
  grad_output,
  input,
  weight,
  bias_sizes,
  stride,
  padding,
  dilation,
  transposed,
  output_padding,
  groups,
  output_mask,
):
  """aten.convolution_backward as the vjp of torchax's convolution lowering."""
  import jax
  from torchax import tensor as txt
  from torchax.ops import jaten

  def forward(x, w):
    return jaten._aten_convolution(
      x, w, None, stride, padding, dilation, transposed, output_padding, groups
    )

  g = _jax_of(grad_output)
  _, vjp = jax.vjp(forward, _jax_of(input), _jax_of(weight))
  grad_input, grad_weight = vjp(g)
  grad_bias = None
  if output_mask[2]:
    grad_bias = g.sum(axis=(0,) + tuple(range(2, g.ndim)))
  out = (grad_input, grad_weight, grad_bias)
  return tuple(
    txt.Tensor(x, env) if (keep and x is not None) else None for x, keep in zip(out, output_mask)
  )


def _max_pool2d_backward(
  env, grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices
):
  """aten.max_pool2d_with_indices_backward as the vjp of torchax's forward lowering."""
  import jax
  from torchax import tensor as txt
  from torchax.ops import jaten

  del indices  # the vjp finds the maxima itself (ties: as XLA's reduce-window)

  def forward(x):
    return jaten._aten_max_pool2d_with_indices(
      x, kernel_size, list(stride) or list(kernel_size), padding, dilation, ceil_mode
    )[0]

  _, vjp = jax.vjp(forward, _jax_of(input))
  (grad_input,) = vjp(_jax_of(grad_output))
  return txt.Tensor(grad_input, env)


def _adaptive_avg_pool_backward(spatial, env, grad_output, input):
  """aten._adaptive_avg_pool{2,3}d_backward as the vjp of torchax's forward lowering."""
  import jax
  from torchax import tensor as txt
  from torchax.ops import jaten

  g = _jax_of(grad_output)

  def forward(x):
    return jaten.adaptive_avg_pool2or3d(x, tuple(g.shape[-spatial:]))

  _, vjp = jax.vjp(forward, _jax_of(input))
  (grad_input,) = vjp(g)
  return txt.Tensor(grad_input, env)


# -- fix 9: average pooling ----------------------------------------------------------------


def _pool_dims(values, n, default):
  """torch's int[n] pooling argument (an int, one value or n; empty: default) as n ints."""
  if isinstance(values, int):
    values = [values]
  values = list(values) if values else list(default)
  return values * n if len(values) == 1 else values


def _avg_pool(n, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
  """torch's avg_pool{n}d on a jax array: a zero-padded reduce_window sum over
  the last n dims, divided by torch's divisor."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  kernel = _pool_dims(kernel_size, n, ())
  stride = _pool_dims(stride, n, kernel)
  padding = _pool_dims(padding, n, (0,))
  lead = x.ndim - n
  pads, outs, divisors = [], [], []
  for size, k, s, p in zip(x.shape[lead:], kernel, stride, padding):
    # torch's pooling_output_shape: a last window must start inside the
    # input or its left padding.
    out = (size + 2 * p - k + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
      out -= 1
    pads.append((p, max((out - 1) * s + k - size - p, 0)))
    outs.append(out)
    start = np.arange(out) * s - p
    end = np.minimum(start + k, size + p)  # windows stop at the right padding
    if count_include_pad:
      divisors.append(end - start)
    else:
      divisors.append(np.minimum(end, size) - np.maximum(start, 0))
  low = x.dtype in (jnp.bfloat16, jnp.float16)
  acc = x.astype(jnp.float32) if low else x
  summed = jax.lax.reduce_window(
    acc,
    np.zeros((), acc.dtype),  # concrete: jax then knows it as a (differentiable) sum
    jax.lax.add,
    (1,) * lead + tuple(kernel),
    (1,) * lead + tuple(stride),
    ((0, 0),) * lead + tuple(pads),
  )
  summed = summed[(Ellipsis,) + tuple(slice(0, o) for o in outs)]
  if divisor_override:
    divisor = float(divisor_override)
  else:
    divisor = functools.reduce(np.multiply.outer, divisors).astype(np.float32)
  out = summed / jnp.asarray(divisor, acc.dtype)
  return out.astype(x.dtype)


def _avg_pool_forward(
  n,
  env,
  input,
  kernel_size,
  stride=(),
  padding=0,
  ceil_mode=False,
  count_include_pad=True,
  divisor_override=None,
):
  from torchax import tensor as txt

  out = _avg_pool(
    n,
    _jax_of(input),
    kernel_size,
    stride,
    padding,
    ceil_mode,
    count_include_pad,
    divisor_override,
  )
  return txt.Tensor(out, env)


def _avg_pool_backward(
  n,
  env,
  grad_output,
  input,
  kernel_size,
  stride,
  padding,
  ceil_mode,
  count_include_pad,
  divisor_override,
):
  """aten.avg_pool{2,3}d_backward as the vjp of `_avg_pool`."""
  import jax
  from torchax import tensor as txt

  def forward(x):
    return _avg_pool(
      n, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )

  _, vjp = jax.vjp(forward, _jax_of(input))
  (grad_input,) = vjp(_jax_of(grad_output))
  return txt.Tensor(grad_input, env)


# -- fix 10: nn.EmbeddingBag ---------------------------------------------------------------

_SUM, _MEAN, _MAX = 0, 1, 2


def _embedding_bag(
  env,
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
  """aten._embedding_bag on the device: (output, offset2bag, bag_size, max_indices).

  offset2bag[i] is the bag of indices[i], or the bag count for an index in no
  bag (past the last offset with include_last_offset): gathers by it fill
  zeros and segment sums drop it. bag_size counts each bag's indices other
  than padding_idx (what "mean" divides by); max_indices[b, d] is the row of
  `weight` whose value is bag b's maximum in column d (-1 for an empty bag).
  """
  import jax
  import jax.numpy as jnp
  from torchax import tensor as txt

  del scale_grad_by_freq, sparse  # the backward's business
  w, idx, offs = _jax_of(weight), _jax_of(indices), _jax_of(offsets)
  n = idx.shape[0]
  starts, stop = (offs[:-1], offs[-1]) if include_last_offset else (offs, n)
  bags = starts.shape[0]
  pos = jnp.arange(n, dtype=idx.dtype)
  bag = jnp.searchsorted(starts, pos, side="right") - 1
  in_bag = (bag >= 0) & (pos < stop)
  offset2bag = jnp.where(in_bag, bag, bags).astype(idx.dtype)
  counted = in_bag & (idx != padding_idx)
  bag_size = jax.ops.segment_sum(counted.astype(idx.dtype), offset2bag, bags)
  rows = jnp.take(w, idx, axis=0)
  if mode == _MAX:
    low = jnp.asarray(-jnp.inf, w.dtype)
    best = jax.ops.segment_max(jnp.where(counted[:, None], rows, low), offset2bag, bags)
    picked = jnp.take(best, offset2bag, axis=0, mode="fill", fill_value=0)
    hit = counted[:, None] & (rows == picked)
    first = jax.ops.segment_min(jnp.where(hit, pos[:, None], n), offset2bag, bags)
    filled = bag_size[:, None] > 0
    max_indices = jnp.where(filled, jnp.take(idx, jnp.minimum(first, n - 1)), -1)
    output = jnp.where(filled, best, jnp.zeros((), w.dtype))
  else:
    scale = counted.astype(w.dtype)
    if per_sample_weights is not None:
      scale = scale * _jax_of(per_sample_weights)
    output = jax.ops.segment_sum(rows * scale[:, None], offset2bag, bags)
    if mode == _MEAN:
      output = output / jnp.maximum(bag_size, 1).astype(w.dtype)[:, None]
    max_indices = jnp.zeros((bags,), idx.dtype)
  return tuple(txt.Tensor(a, env) for a in (output, offset2bag, bag_size, max_indices))


def _embedding_bag_weight_grad(
  env,
  grad,
  indices,
  offset2bag,
  bag_size,
  maximum_indices,
  num_weights,
  scale_grad_by_freq,
  mode,
  per_sample_weights,
  padding_idx,
):
  import jax.numpy as jnp
  from torchax import tensor as txt

  g, idx, o2b = _jax_of(grad), _jax_of(indices), _jax_of(offset2bag)
  dim = g.shape[1]
  zeros = jnp.zeros((num_weights, dim), g.dtype)
  if mode == _MAX:
    rows = _jax_of(maximum_indices)
    rows = jnp.where(rows >= 0, rows, num_weights)  # empty bags: dropped
    cols = jnp.broadcast_to(jnp.arange(dim), rows.shape)
    return txt.Tensor(zeros.at[rows, cols].add(g, mode="drop"), env)
  per_index = jnp.take(g, o2b, axis=0, mode="fill", fill_value=0)
  scale = (idx != padding_idx).astype(g.dtype)
  if mode == _MEAN:
    sizes = jnp.take(_jax_of(bag_size), o2b, mode="fill", fill_value=1)
    scale = scale / jnp.maximum(sizes, 1).astype(g.dtype)
  if per_sample_weights is not None:
    scale = scale * _jax_of(per_sample_weights)
  grad_weight = zeros.at[idx].add(per_index * scale[:, None])
  if scale_grad_by_freq:
    counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
    grad_weight = grad_weight / jnp.maximum(counts, 1)[:, None]
  return txt.Tensor(grad_weight, env)


def _embedding_bag_backward(
  env,
  grad,
  indices,
  offsets,
  offset2bag,
  bag_size,
  maximum_indices,
  num_weights,
  scale_grad_by_freq,
  mode,
  sparse,
  per_sample_weights,
  padding_idx=-1,
):
  if sparse:
    raise NotImplementedError(
      "xladist (jax runtime): nn.EmbeddingBag / F.embedding_bag with sparse=True: "
      "JAX has no sparse gradients; use sparse=False (a dense gradient)."
    )
  return _embedding_bag_weight_grad(
    env,
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx,
  )


def _embedding_bag_per_sample_weights_backward(
  env, grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1
):
  """d output / d per_sample_weights[i] = weight[indices[i]] . grad[bag of i]."""
  import jax.numpy as jnp
  from torchax import tensor as txt

  del offsets, mode  # "sum" only (F.embedding_bag refuses the others)
  idx = _jax_of(indices)
  per_index = jnp.take(_jax_of(grad), _jax_of(offset2bag), axis=0, mode="fill", fill_value=0)
  rows = jnp.take(_jax_of(weight), idx, axis=0)
  dot = (per_index * rows).sum(axis=1)
  return txt.Tensor(jnp.where(idx != padding_idx, dot, jnp.zeros((), dot.dtype)), env)


def lowered_ops():
  """aten op -> rule(env, *args, **kwargs) computing it on jax arrays (fixes 3, 9, 10)."""
  aten = _aten()
  return {
    aten.convolution_backward.default: _conv_backward,
    aten.max_pool2d_with_indices_backward.default: _max_pool2d_backward,
    aten.avg_pool2d.default: functools.partial(_avg_pool_forward, 2),
    aten.avg_pool3d.default: functools.partial(_avg_pool_forward, 3),
    aten.avg_pool2d_backward.default: functools.partial(_avg_pool_backward, 2),
    aten.avg_pool3d_backward.default: functools.partial(_avg_pool_backward, 3),
    aten._adaptive_avg_pool2d_backward.default: functools.partial(_adaptive_avg_pool_backward, 2),
    aten._adaptive_avg_pool3d_backward.default: functools.partial(_adaptive_avg_pool_backward, 3),
    aten._embedding_bag.default: _embedding_bag,
    aten._embedding_bag_forward_only.default: _embedding_bag,
    aten._embedding_bag_backward.default: _embedding_bag_backward,
    aten._embedding_bag_dense_backward.default: _embedding_bag_weight_grad,
    aten._embedding_bag_per_sample_weights_backward.default: (
      _embedding_bag_per_sample_weights_backward
    ),
  }
