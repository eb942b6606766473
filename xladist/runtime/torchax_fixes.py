"""What the jax runtime changes in torchax so that ordinary torch training runs on it.

torchax (PyTorch on JAX) is built for JAX autodiff; xladist runs the user's own
step (`model(x)`, `loss.backward()`, a `torch.optim` optimizer) under torch
autograd on torchax tensors. torchax 0.0.13 (pinned: its last release, June
2026) gets that wrong in the places below; `install()` fixes each, once per
process, and tests/runtime_jax/test_torchax_fixes.py checks every fix op by op against
plain torch on the CPU (forward and backward), so that a torchax upgrade shows
at once which fixes still hold. Checked with torchax 0.0.13 on XLA:CPU with
torch 2.9.0 + jax 0.10.2 and torch 2.14.1 + jax 0.12.0.1 (`make test-jax`).
Fixes 3, 9 and 10 are lowerings of their own, in torchax_lowerings.py; on torch
2.13+ torchax is imported through torchax_load.py.

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

8. Backward ops torchax does not lower, for which torch has a composite
   form: `_weight_norm_interface_backward` (`nn.utils.parametrizations.
   weight_norm`) runs as torch's `_weight_norm_differentiable_backward`
   (its double-backward form, made of ordinary ops) inside torchax's mode.
9. Average pooling: torchax's `avg_pool2d`/`avg_pool3d` lowering is wrong
   with `ceil_mode=True` and no padding (the extra window is averaged over
   the whole kernel, not over the part inside the input), and
   `avg_pool2d_backward`/`avg_pool3d_backward` (also what `F.avg_pool1d`
   becomes) have no lowering. Here the forward is a `reduce_window` sum
   divided by torch's divisor (computed from the static shapes), and the
   backward is its vjp. `_adaptive_avg_pool2d_backward` (and 3d) is the vjp
   of torchax's own (correct) forward lowering.
10. `nn.EmbeddingBag`: torchax's `_embedding_bag` lowering reads the offsets
   on the host (`TracerArrayConversionError` inside a traced step), ignores
   `per_sample_weights` and `include_last_offset`, and fails in "max" mode;
   its backward ops have no lowering. Here the forward is a segment sum /
   mean / max over bag ids found from the offsets on the device, and the
   backward ops (`_embedding_bag_backward`, `_embedding_bag_dense_backward`,
   `_embedding_bag_per_sample_weights_backward`) are written out from what
   the forward saves (bag of each index, bag sizes, the arg-max rows).
11. In-place view ops that change a tensor's shape (`transpose_`, `t_`,
   `squeeze_`, `unsqueeze_`): torchax swaps the jax array but leaves the
   tensor's sizes as torch's dispatcher sees them, so autograd expects the
   old shape (`nn.GRU(batch_first=True)` failed in backward: "invalid
   gradient ... expected shape compatible with"). Here the sizes are
   updated as well.
12. `torch.autocast("jax", dtype=torch.bfloat16)` (torchax names torch's
   PrivateUse1 backend "jax") was silently a no-op: torchax tensors carry no
   autocast dispatch key, and torchax casts only under its own
   `torchax.amp.autocast`, below autograd (so a cast op's backward ran in
   float32). While torch's autocast is on for "jax", a torch function named
   in torch's CPU autocast lists (`linear`, `conv2d`, `matmul`, ...: torchax's
   copy of them) gets its arguments cast in __torch_function__, where
   autograd records the casts, as torch's autocast does; the aten ops
   underneath run under torchax's autocast with torch's dtype (what a
   function of another name, `F.cross_entropy`, becomes: `nll_loss` in
   float32).
13. `out=` of a torch function (`torch.maximum(a, b, out=a)` in Adam's amsgrad
   and Adamax): torchax's function lowerings take no `out` (TypeError); the
   result is computed without it and copied into `out`.
14. An op with no tensor operand and no jax device argument that torchax does
   not lower (torchvision's `torchvision::_cuda_version`, which `import
   torchvision` runs, also when transformers imports it lazily; a library's
   custom op registered with `torch.library`) raised `OperatorNotFound` once the
   runtime enabled torchax for the process: torch's own runs it, as without
   xladist (outside a step torch is plain torch).
15. `Tensor.detach` is a Python method of torchax's Tensor, so no torch
   function mode saw it: a `loss.detach()` kept in a list past a step kept a
   traced value (jax's `UnexpectedTracerError` at its next use, where torch_xla
   gives xladist's message). It is torch's own `detach`, lowered by torchax
   (`aten.detach`), which xladist's step sees like any other op.

Not here (the runtime's step handles it): the PRNG key, which torchax's
`jax_jit` bakes in at trace time (the same dropout mask every step): the step
takes a fresh key as an input.
"""

import functools

from xladist.runtime import torchax_conversions, torchax_lowerings

_installed = []


def _torch():
  import torch

  return torch


@functools.cache
def _aten():
  return _torch().ops.aten


def _leaves(args, kwargs):
  """An op's operands where torch's pytree finds them (in tuples, lists and dicts'
  values), walked by hand: every op of the jax runtime comes here (with torch's
  pytree, fix 7's operand check took 1.9 s of a 15-model matrix case's 13.3 s)."""
  todo = [args, kwargs]
  while todo:
    a = todo.pop()
    if isinstance(a, (tuple, list)):
      todo.extend(a)
    elif isinstance(a, dict):
      todo.extend(a.values())
    else:
      yield a


def _requires_grad_input(args, kwargs):
  torch = _torch()
  return any(isinstance(a, torch.Tensor) and a.requires_grad for a in _leaves(args, kwargs))


# Functions torchax must keep even under autograd: they move, detach or read
# tensors and record nothing.
_KEEP_LOWERED = {"to", "backward", "__get__", "__set__", "requires_grad_", "detach", "numpy"}


def _decomposed_ops():
  """aten op -> torch's decomposition, for fixes 2, 4 and 8."""
  from torch._decomp import decomposition_table

  aten = _aten()
  ops = (
    aten.native_layer_norm_backward.default,
    aten.native_batch_norm_backward.default,
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_functional.default,
  )
  table = {op: decomposition_table[op] for op in ops if op in decomposition_table}
  # fix 8: torch's composite form of the same backward (ops torchax lowers)
  table[aten._weight_norm_interface_backward.default] = (
    aten._weight_norm_differentiable_backward.default.decompose
  )
  return table


# -- fix 11: in-place view ops -------------------------------------------------------------


def _set_sizes(t):
  """Gives torchax tensor `t` the sizes of its jax array as torch's dispatcher
  sees them (a torchax tensor is a wrapper over a "meta" tensor whose sizes
  torchax sets once, when it makes it)."""
  torch = _torch()
  shape = tuple(t._elem.shape)
  strides, step = [], 1
  for size in reversed(shape):
    strides.append(step)
    step *= max(size, 1)
  with torch._C._DisableTorchDispatch():
    torch.Tensor.as_strided_(t, shape, tuple(reversed(strides)))


def _inplace_view(functional):
  def rule(self, *args, **kwargs):
    out = functional(self, *args, **kwargs)  # lowered by torchax (the mode is on)
    self._elem = out._elem
    _set_sizes(self)
    return self

  return rule


def _inplace_view_ops():
  aten = _aten()
  return {
    aten.transpose_.default: _inplace_view(aten.transpose.int),
    aten.t_.default: _inplace_view(aten.t.default),
    aten.squeeze_.default: _inplace_view(aten.squeeze.default),
    aten.squeeze_.dim: _inplace_view(aten.squeeze.dim),
    aten.squeeze_.dims: _inplace_view(aten.squeeze.dims),
    aten.unsqueeze_.default: _inplace_view(aten.unsqueeze.default),
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


def _operand_types(txt):
  """(torchax's tensor types, host tensors' and storages', device names') for
  `_operands`: made once by `install()`, which imports torchax."""
  from torchax import view

  torch = _torch()
  return (
    (txt.Tensor, view.View),
    (torch.Tensor, torch.UntypedStorage, torch.TypedStorage),
    (str, torch.device),
  )


def _operands(operand_types, args, kwargs):
  """ "jax" when an op has a torchax tensor or view operand or names the jax device,
  else "host" when it has host tensors or storages, else None (no tensor operand)."""
  on_jax, on_host, names = operand_types
  host = None
  for a in _leaves(args, kwargs):
    if isinstance(a, on_jax):
      return "jax"
    if isinstance(a, on_host):
      host = "host"
    elif isinstance(a, names) and str(a).split(":")[0] in _JAX_DEVICES:
      return "jax"  # a move to the jax device (`t.to("jax")`) is torchax's
  return host


def _host_only(operand_types, args, kwargs):
  """Whether an op's operands are host tensors or storages, none a torchax
  tensor or view (fix 7). Ops without tensor operands (factories) are not."""
  return _operands(operand_types, args, kwargs) == "host"


_JAX_DEVICES = ("jax", "privateuseone")


def _own_torch_function(torch, args):
  """The `__torch_function__` of a host tensor subclass among `args` that asks for
  its rules to run under torchax's mode (`_xladist_host_rules`: xladist's host
  scalars; a mode comes before a subclass, so torchax's would hide them), or None."""
  for a in args:
    if isinstance(a, torch.Tensor) and getattr(type(a), "_xladist_host_rules", False):
      return type(a).__torch_function__
  return None


def _data_alias(self):
  from torchax import tensor as txt

  return txt.Tensor(self._elem, self._env)


# -- fix 12: torch.autocast("jax") ---------------------------------------------------------


def _autocast_policy_by_name():
  """torch function name ("linear", "conv2d", "mse_loss") -> torchax's cast
  policy for the aten op of that name (torch's CPU autocast lists), for the
  two policies applied above autograd."""
  from torchax import amp

  keep = (amp.CastPolicy.LOWER_PRECISION_FP, amp.CastPolicy.FP32)
  return {
    op.__name__.split(".")[0]: policy
    for op, policy in amp.autocast_policy.items()
    if policy in keep
  }


def _autocast_casts(policy, dtype, args, kwargs):
  """The floating-point tensor arguments cast as torch's autocast casts them:
  to `dtype` (LOWER_PRECISION_FP) or from a lower precision to float32 (FP32).
  Done in __torch_function__, above autograd, the casts are recorded, so the
  op's backward runs in the dtype its forward ran in, as with torch's autocast."""
  import torch.utils._pytree as pytree
  from torchax import amp

  torch = _torch()
  if policy is amp.CastPolicy.LOWER_PRECISION_FP:
    cast = lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t  # noqa: E731
  else:
    low = (torch.bfloat16, torch.float16)
    cast = lambda t: t.to(torch.float32) if t.dtype in low else t  # noqa: E731
  return pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))


def install():
  """Applies the fixes to torchax (idempotent; imports torchax)."""
  if _installed:
    return
  from xladist.runtime import torchax_load

  torchax_load.load()  # before any `from torchax import`: torch 2.13+ lacks ops it names
  from torchax import tensor as txt

  torch = _torch()
  lowered_function = txt.XLAFunctionMode.__torch_function__
  decomposed = _decomposed_ops()
  lowered = torchax_lowerings.lowered_ops()
  inplace_views = _inplace_view_ops()
  fixed = {*decomposed, *lowered, *inplace_views}
  fixed |= {op.overloadpacket for op in fixed}
  autocast_policy = _autocast_policy_by_name()
  operand_types = _operand_types(txt)

  def torch_function(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    own = _own_torch_function(torch, args)
    if own is not None:
      # xladist's host scalars: their rules first (a mode comes before a subclass).
      # Their op alone: a host op (torch's own); as an operand of a jax tensor's op
      # they enter as a number, and the op is lowered as usual.
      if _host_only(operand_types, args, kwargs):
        with torch.utils._python_dispatch._disable_current_modes():
          return own(func, types, args, kwargs)
      return own(func, types, args, kwargs)
    if _host_only(operand_types, args, kwargs):
      with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
        return func(*args, **kwargs)  # fix 7
    if kwargs.get("out") is not None and not isinstance(
      func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    ):
      # fix 13: `torch.maximum(a, b, out=a)` (Adam's amsgrad, Adamax): torchax's
      # function lowerings take no `out`; the result is computed, then written.
      out = kwargs.pop("out")
      result = torch_function(self, func, types, args, kwargs)
      if isinstance(out, (tuple, list)):
        for o, r in zip(out, result):
          o.copy_(r)
      else:
        out.copy_(result)
      return out
    autocast = torch.is_autocast_enabled("jax")  # inside __torch_dispatch__ it reads False
    if autocast and self.env.param.autocast_dtype is None:
      with self.env.override_property(autocast_dtype=torch.get_autocast_dtype("jax")):
        return torch_function(self, func, types, args, kwargs)  # fix 12
    if autocast and txt._name_of_func(func) in autocast_policy:
      policy = autocast_policy[txt._name_of_func(func)]
      # Below every torch function mode: the jax runtime enables torchax for
      # the whole process, so a user's `with torchax.default_env():` stacks this
      # mode twice, and the inner one would lower the cast's `to` (_KEEP_LOWERED)
      # where autograd does not record it (no gradient reached the weights).
      with torch._C.DisableTorchFunction():
        args, kwargs = _autocast_casts(policy, self.env.param.autocast_dtype, args, kwargs)
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and func in fixed:
      return func(*args, **kwargs)  # an aten op fixed below, called directly
    if txt._name_of_func(func) not in _KEEP_LOWERED and (
      autocast or (torch.is_grad_enabled() and _requires_grad_input(args, kwargs))
    ):
      # fix 1: autograd records it; fix 12: the aten ops it becomes get the
      # autocast casts (torchax's function lowerings, `F.linear`, get none)
      return func(*args, **kwargs)
    return lowered_function(self, func, types, args, kwargs)

  lowered_dispatch = txt.XLADispatchMode.__torch_dispatch__

  def torch_dispatch(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    operands = _operands(operand_types, args, kwargs)  # once per op: this is every op's path
    if operands == "host":
      # torchax's mode is on for the whole process (the jax runtime enables it
      # globally): ops of host tensors and storages (`copy.deepcopy` of a CPU
      # model clones its storages) are torch's own (fix 7).
      with torch.utils._python_dispatch._disable_current_modes():
        return func(*args, **kwargs)
    rule = lowered.get(func)
    if rule is not None:  # fixes 3, 9 and 10 (torchax_lowerings.py)
      return rule(self.env, *args, **kwargs)
    rule = inplace_views.get(func)
    if rule is not None and isinstance(args[0], txt.Tensor):  # fix 11
      with self:
        return rule(*args, **kwargs)
    decomposition = decomposed.get(func)
    if decomposition is not None:  # fixes 2, 4 and 8: lowered op by op
      with self:
        return decomposition(*args, **kwargs)
    if operands is not None:
      return lowered_dispatch(self, func, types, args, kwargs)
    try:
      return lowered_dispatch(self, func, types, args, kwargs)
    except txt.OperatorNotFound:
      # fix 14: an op of no tensor and no jax device that torchax does not lower
      # (torchvision's `_cuda_version`, run by `import torchvision`; a custom op
      # of a library): torch's own, as without the jax runtime
      with torch.utils._python_dispatch._disable_current_modes():
        return func(*args, **kwargs)

  txt.XLAFunctionMode.__torch_function__ = torch_function
  txt.XLADispatchMode.__torch_dispatch__ = torch_dispatch
  for name in _GRAPH_CUTTING_METHODS:  # fix 5
    setattr(txt.Tensor, name, _recorded_under_autograd(getattr(txt.Tensor, name), name))
  txt.Tensor.data = property(_data_alias, txt.Tensor.data.fset)  # fix 6
  txt.Tensor.detach = torch._C.TensorBase.detach  # fix 15
  torchax_conversions.install()  # not a fix: the operand conversions without torch's pytree
  _installed.append((lowered_function, lowered_dispatch))
