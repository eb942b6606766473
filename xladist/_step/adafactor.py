"""torch.optim.Adafactor's update in tensor operations, for a strategy's step.

torch's Adafactor (2.9 to 2.14, `torch.optim._adafactor`) reads two device values on
the host at every parameter update: the parameter's RMS (`param.norm(2).item()`)
for the relative step size and the update's RMS for its clipping, each through
`max(...)`. A strategy's step is one traced program, where such a read is a
device-to-host transfer in the middle of the trace (refused). The same arithmetic
as tensors (`clamp(min=...)` for `max`) leaves nothing to read: the step counter
stays a host scalar (torch keeps it on the CPU; a replay follows it, hyper.py) and
`min(lr, 1 / sqrt(step))` stays a host decision (a guard of the trace).

`install()` puts a dispatcher in place of torch's single-tensor Adafactor function:
for parameters on an XLA device it runs `tensor_only_update`, for any other
(plain torch on the CPU, outside a strategy) torch's own function, unchanged.
`prepare_optimizer` (device_state.py) installs it at an Adafactor's first step in
`strategy.run` and turns its `foreach` option off (the multi-tensor function makes
the same host reads; it is a speed variant of the same update).
"""

import torch

from xladist import runtime as _runtime

_MODULE = "torch.optim._adafactor"
_NAME = "_single_tensor_adafactor"


def supported():
  """Whether this torch has the function `install()` replaces."""
  try:
    module = __import__(_MODULE, fromlist=[_NAME])
  except ImportError:
    return False
  return callable(getattr(module, _NAME, None))


def install():
  """Replaces torch's single-tensor Adafactor function (once) with a dispatcher:
  `tensor_only_update` for device parameters, torch's own function otherwise."""
  module = __import__(_MODULE, fromlist=[_NAME])
  current = getattr(module, _NAME)
  if getattr(current, "_xladist_original", None) is not None:
    return

  def dispatch(params, *args, **kwargs):
    if params and _runtime.is_device_tensor(params[0]):
      return tensor_only_update(params, *args, **kwargs)
    return current(params, *args, **kwargs)

  dispatch._xladist_original = current
  dispatch.__doc__ = __doc__
  setattr(module, _NAME, dispatch)


def tensor_only_update(
  params,
  grads,
  row_vars,
  col_vars,
  variances,
  state_steps,
  grad_scale,
  found_inf,
  *,
  d,
  lr,
  beta2_decay,
  weight_decay,
  eps1,
  eps2,
  maximize,
  has_complex=False,
):
  """One Adafactor update of `params` (torch's arguments, torch's arithmetic), with
  the two RMS values kept as device scalars."""
  if grad_scale is not None or found_inf is not None:
    raise ValueError("torch.optim.Adafactor: grad scaling must happen outside optimizer.step()")
  if isinstance(lr, torch.Tensor):
    lr = lr.item()
  for i, param in enumerate(params):
    grad = -grads[i] if maximize else grads[i]
    step_t = state_steps[i]
    tiny = eps1 if eps1 is not None else torch.finfo(param.dtype).eps

    step_t += 1
    step = step_t.item()
    new_weight = step**beta2_decay  # the weight of this step's squared gradient
    rho = min(lr, 1 / (step**0.5))
    param_rms = param.norm(2) / (param.numel() ** 0.5)
    alpha = param_rms.clamp(min=eps2) * rho

    if weight_decay != 0:
      param.mul_(1 - lr * weight_decay)

    if grad.dim() > 1:
      row_var, col_var = row_vars[i], col_vars[i]
      row_var.lerp_(grad.square().mean(dim=-1, keepdim=True), new_weight)
      col_var.lerp_(grad.square().mean(dim=-2, keepdim=True), new_weight)
      estimate = row_var @ col_var
      estimate = estimate / row_var.mean(dim=-2, keepdim=True).clamp(min=tiny)
    else:
      variance = variances[i]
      variance.lerp_(grad * grad, new_weight)
      estimate = variance.clone()

    update = estimate.clamp(min=tiny * tiny).rsqrt() * grad
    update_rms = update.norm(2) / ((update.numel() ** 0.5) * d)
    param.add_(update * (-alpha / update_rms.clamp(min=1.0)))
