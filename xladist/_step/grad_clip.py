"""Gradient clipping inside `strategy.run` clips the aggregated gradients.

In a step, `loss.backward()` leaves each replica's own gradients in `.grad`;
`optimizer.step()` aggregates them across replicas first (TF's
apply_gradients). A user's `torch.nn.utils.clip_grad_norm_(model.parameters(),
1.0)` between the two would clip each replica's gradients with that replica's
norm: not what single-device training, DDP or TF's Keras `global_clipnorm`
give. So xladist aggregates first.

torch's clipping functions (`clip_grad_norm_`, `clip_grad_value_`,
`get_total_norm`, `clip_grads_with_norm_`) all hand the gradients they read to
one helper of `torch.nn.utils.clip_grad`, `_group_tensors_by_device_and_dtype`
(checked in torch 2.9). xladist replaces that name in that module only. Inside
a step of a strategy that aggregates gradients, the gradients of the
strategy's variables in the list are aggregated (one merge_call, packed into
as few all-reduces as optimizer.step() uses: the step then finds them done
and reduces nothing twice), set as the parameters' `.grad` and put in the list
in place of the local ones; torch's function goes on with them. One
interception point covers a function bound before xladist was imported
(`from torch.nn.utils import clip_grad_norm_`) as well.

torch_xla, when imported, puts its own `clip_grad_norm_` (no host sync) in
`torch.nn.utils`; it reads each `p.grad` itself. `ensure_installed()` (called
when each step starts, one identity test) wraps whatever foreign function
`torch.nn.utils.clip_grad_norm_` holds so that the parameters' gradients are
aggregated before it reads them. Not covered: that foreign function bound by
name before xladist was imported or a step ran (`import torch_xla; from
torch.nn.utils import clip_grad_norm_`): call `torch.nn.utils.clip_grad_norm_`.
"""

import functools

import torch
import torch.nn.utils as _nn_utils
import torch.nn.utils.clip_grad as _clip_grad

from xladist import context

_NAME = "_group_tensors_by_device_and_dtype"
_original = getattr(_clip_grad, _NAME, None)
if _original is None:  # torch is pinned; a release that moved it must not clip silently
  raise RuntimeError(
    f"xladist: torch.nn.utils.clip_grad has no {_NAME} in this torch release, so "
    "gradient clipping inside strategy.run could not be made to clip the aggregated "
    "gradients. Install the torch version xladist pins."
  )


def _group_aggregated(tensorlistlist, with_indices=False):
  ctx = context.get_replica_context()
  if ctx is not None and tensorlistlist and isinstance(tensorlistlist[0], list):
    aggregate = getattr(ctx.strategy.extended, "_aggregate_for_clipping", None)
    if aggregate is not None:
      aggregate(ctx, tensorlistlist[0])
  return _original(tensorlistlist, with_indices)


_original_total_norm = _clip_grad._get_total_norm


def _total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
  """torch's `_get_total_norm` (clip_grad_norm_, get_total_norm) inside a step
  whose strategy shards gradients: the list's sharded gradients become their
  rows (`_aggregate_for_clipping`) and their norm is combined across replicas."""
  ctx = context.get_replica_context()
  combine = getattr(ctx.strategy.extended, "_clip_total_norm", None) if ctx is not None else None
  if combine is not None and not isinstance(tensors, torch.Tensor):
    tensors = list(tensors)
    aggregate = getattr(ctx.strategy.extended, "_aggregate_for_clipping", None)
    if aggregate is not None and tensors:
      aggregate(ctx, tensors)

    def norm(ts, p):
      return _original_total_norm(ts, p, False, foreach)

    total = combine(tensors, float(norm_type), norm)
    if total is not None:
      if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):  # as torch
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite")
      return total
  return _original_total_norm(tensors, norm_type, error_if_nonfinite, foreach)


def _aggregate_parameters(parameters):
  """`parameters` as a list, with their gradients aggregated inside a step."""
  params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
  ctx = context.get_replica_context()
  if ctx is not None:
    aggregate = getattr(ctx.strategy.extended, "_aggregate_for_clipping", None)
    if aggregate is not None:
      aggregate(ctx, [p.grad for p in params if p.grad is not None])
  return params


def _wrap(fn):
  @functools.wraps(fn)
  def clip_grad_norm_(parameters, *args, **kwargs):
    ctx = context.get_replica_context()
    if ctx is not None and getattr(ctx.strategy.extended, "_clips_rows", False):
      # Sharded gradients are clipped as rows, through torch's own function
      # (the same arithmetic as torch_xla's; it reads `.grad`, which stays whole).
      return _clip_grad.clip_grad_norm_(parameters, *args, **kwargs)
    return fn(_aggregate_parameters(parameters), *args, **kwargs)

  clip_grad_norm_._xladist_aggregates = True
  return clip_grad_norm_


def ensure_installed():
  """Wraps a foreign `torch.nn.utils.clip_grad_norm_` (torch_xla's) once."""
  fn = _nn_utils.clip_grad_norm_
  if fn is not _clip_grad.clip_grad_norm_ and not getattr(fn, "_xladist_aggregates", False):
    _nn_utils.clip_grad_norm_ = _wrap(fn)


_group_aggregated.__wrapped__ = _original
setattr(_clip_grad, _NAME, _group_aggregated)
_total_norm.__wrapped__ = _original_total_norm
_clip_grad._get_total_norm = _total_norm
ensure_installed()
