"""What the jax runtime changes in torchax so that ordinary torch training runs on it.

torchax (PyTorch on JAX) is built for JAX autodiff; xladist runs the user's own
step (`model(x)`, `loss.backward()`, a `torch.optim` optimizer) under torch
autograd on torchax tensors. torchax 0.0.13 (pinned: its last release, June
2026) gets that wrong in the places below; `install()` fixes each, once per
process, and tests/runtime_jax/test_torchax_fixes.py checks every fix op by op against
plain torch on the CPU (forward and backward), so that a torchax upgrade shows
at once which fixes still hold. Checked with torch 2.9.0, jax 0.10.2 and torchax
0.0.13 on XLA:CPU.

1. Autograd. torchax lowers some torch *functions* (`F.linear`, `einsum`,
   `F.pad`, attention, `__getitem__`, `F.max_pool2d`, ...) before autograd sees
   them, so `loss.backward()` finds no graph ("element 0 of tensors does not
   require grad"; google/torchax#15). While grad mode is on, a function with
   an input that requires grad is left to torch: autograd records it and
   torchax lowers the aten ops underneath.
2. Backward ops torchax lowers wrongly: `native_layer_norm_backward` (its
   lowering takes the wrong arguments) and BatchNorm's backward run through
   torch's own decompositions (`torch._decomp`), inside torchax's dispatch
   mode, so that the ops they decompose into are lowered again.
3. Backward ops torchax does not lower or lowers wrongly, and torch does not
   decompose: `convolution_backward` (no lowering, google/torchax#65) and
   `max_pool2d_with_indices_backward` (a Python loop that ignores the batch
   and channel dims, and fails on a default stride) are the `jax.vjp` of
   torchax's own forward lowering: one rule, exact gradients.
5. Methods of torchax's Tensor class that compute on the jax array directly
   (`flatten`, `type_as`, `__setitem__`) cut the autograd graph: the layers
   before an `nn.Flatten` silently never trained. Under autograd, with an
   input that requires grad, they are torch's own methods (recorded, then
   lowered op by op).
4. BatchNorm's running statistics: torchax's `native_batch_norm` lowering
   computes new running statistics and drops them (running_mean and
   running_var never change), and uses the biased batch variance. It runs
   through torch's decomposition instead, which updates both buffers in place
   with the unbiased variance, as torch does.

6. `Tensor.data` returns the tensor itself in torchax (and logs a warning
   each time), so `saved = t.data; t.data = other; t.data = saved` does not
   put the value back: xladist's step saves and restores variables that way.
   Here `.data` is a new tensor over the same jax array, as torch's `.data`
   is a new tensor over the same storage. JAX arrays are immutable, so an
   in-place write through `.data` (`p.data.add_(x)`) does not reach `p` on
   this runtime: write `p` itself under `torch.no_grad()` (docs/architecture.md).

7. With torchax's modes on for the whole process (the jax runtime enables them
   globally), ops whose operands are host tensors or storages only (the
   storage clone of `copy.deepcopy(cpu_model)`, a CPU model's backward) are
   torch's own, not lowered: torchax has no lowering for storage ops and its
   backward rules would get CPU tensors.

Not here (the runtime's step handles it): the PRNG key, which torchax's
`jax_jit` bakes in at trace time (the same dropout mask every step): the step
takes a fresh key as an input.
"""

import functools

_installed = []


def _torch():
  import torch

  return torch


@functools.cache
def _aten():
  return _torch().ops.aten


def _requires_grad_input(args, kwargs):
  import torch.utils._pytree as pytree

  torch = _torch()
  return any(
    isinstance(a, torch.Tensor) and a.requires_grad for a in pytree.tree_leaves((args, kwargs))
  )


# Functions torchax must keep even under autograd: they move, detach or read
# tensors and record nothing.
_KEEP_LOWERED = {"to", "backward", "__get__", "__set__", "requires_grad_", "detach", "numpy"}


def _decomposed_ops():
  """aten op -> torch's decomposition, for fixes 2 and 4."""
  from torch._decomp import decomposition_table

  aten = _aten()
  ops = (
    aten.native_layer_norm_backward.default,
    aten.native_batch_norm_backward.default,
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_functional.default,
  )
  return {op: decomposition_table[op] for op in ops if op in decomposition_table}


def _jax_of(t):
  return t._elem


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


def _vjp_ops():
  aten = _aten()
  return {
    aten.convolution_backward.default: _conv_backward,
    aten.max_pool2d_with_indices_backward.default: _max_pool2d_backward,
  }


_GRAPH_CUTTING_METHODS = ("flatten", "type_as", "__setitem__")


def _recorded_under_autograd(lowered, name):
  torch = _torch()
  base = getattr(torch.Tensor, name)

  @functools.wraps(lowered)
  def method(self, *args, **kwargs):
    if torch.is_grad_enabled() and _requires_grad_input((self, args), kwargs):
      return base(self, *args, **kwargs)
    return lowered(self, *args, **kwargs)

  return method


def _host_only(txt, args, kwargs):
  """Whether an op's operands are host tensors or storages, none a torchax
  tensor or view (fix 7). Ops without tensor operands (factories) are not."""
  import torch.utils._pytree as pytree
  from torchax import view

  torch = _torch()
  host = False
  for a in pytree.tree_leaves((args, kwargs)):
    if isinstance(a, (txt.Tensor, view.View)):
      return False
    if isinstance(a, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
      host = True
    elif isinstance(a, (str, torch.device)) and str(a).split(":")[0] in _JAX_DEVICES:
      return False  # a move to the jax device (`t.to("jax")`) is torchax's
  return host


_JAX_DEVICES = ("jax", "privateuseone")


def _data_alias(self):
  from torchax import tensor as txt

  return txt.Tensor(self._elem, self._env)


def install():
  """Applies the fixes to torchax (idempotent; imports torchax)."""
  if _installed:
    return
  from torchax import tensor as txt

  torch = _torch()
  lowered_function = txt.XLAFunctionMode.__torch_function__

  def torch_function(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if _host_only(txt, args, kwargs):
      with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
        return func(*args, **kwargs)  # fix 7
    if (
      torch.is_grad_enabled()
      and txt._name_of_func(func) not in _KEEP_LOWERED
      and _requires_grad_input(args, kwargs)
    ):
      return func(*args, **kwargs)  # fix 1: autograd records it
    return lowered_function(self, func, types, args, kwargs)

  decomposed = _decomposed_ops()
  by_vjp = _vjp_ops()
  lowered_dispatch = txt.XLADispatchMode.__torch_dispatch__

  def torch_dispatch(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if _host_only(txt, args, kwargs):
      # torchax's mode is on for the whole process (the jax runtime enables it
      # globally): ops of host tensors and storages (`copy.deepcopy` of a CPU
      # model clones its storages) are torch's own (fix 7).
      with torch.utils._python_dispatch._disable_current_modes():
        return func(*args, **kwargs)
    rule = by_vjp.get(func)
    if rule is not None:  # fix 3
      return rule(self.env, *args, **kwargs)
    decomposition = decomposed.get(func)
    if decomposition is not None:  # fixes 2 and 4: lowered op by op
      with self:
        return decomposition(*args, **kwargs)
    return lowered_dispatch(self, func, types, args, kwargs)

  txt.XLAFunctionMode.__torch_function__ = torch_function
  txt.XLADispatchMode.__torch_dispatch__ = torch_dispatch
  for name in _GRAPH_CUTTING_METHODS:  # fix 5
    setattr(txt.Tensor, name, _recorded_under_autograd(getattr(txt.Tensor, name), name))
  txt.Tensor.data = property(_data_alias, txt.Tensor.data.fset)  # fix 6
  _installed.append((lowered_function, lowered_dispatch))
