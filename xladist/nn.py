"""`xladist.nn`: layers and loss helpers whose math spans replicas."""

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from xladist import context
from xladist.reduce_util import ReduceOp


class SyncBatchNorm(_BatchNorm):
  """Batch normalization over the global batch: statistics all-reduced across replicas.

  Inside `strategy.run` with several replicas, the batch mean and variance are
  computed over every replica's examples (two all-reduces of per-channel sums,
  differentiable), so the layer behaves as BatchNorm on the global batch on one
  device; running statistics are updated with the global statistics. In
  cross-replica context, and in evaluation with running statistics, it is
  plain BatchNorm.

  Takes the arguments of `torch.nn.BatchNorm2d` and accepts inputs of rank >= 2
  (N, C, ...). Convert a model made of torch BatchNorm layers with
  `SyncBatchNorm.convert_sync_batchnorm(model)` before or inside
  `strategy.scope()`.
  """

  def _check_input_dim(self, input):
    if input.dim() < 2:
      raise ValueError(
        f"SyncBatchNorm expects an input of shape (N, C, ...), got rank "
        f"{input.dim()} (shape {tuple(input.shape)})."
      )

  def forward(self, input):
    self._check_input_dim(input)
    ctx = context.get_replica_context()
    batch_stats = self.training or not self.track_running_stats
    if ctx is None or not batch_stats:
      return super().forward(input)
    if input.shape[1] != self.num_features:
      raise ValueError(
        f"SyncBatchNorm({self.num_features}): the input has {input.shape[1]} "
        f"channels (shape {tuple(input.shape)})."
      )
    dims = [0] + list(range(2, input.dim()))
    shape = [1, -1] + [1] * (input.dim() - 2)
    count = (input.numel() // input.shape[1]) * ctx.num_replicas_in_sync
    mean = ctx.all_reduce("sum", input.sum(dims)) / count
    centered = input - mean.view(shape)
    var = ctx.all_reduce("sum", (centered * centered).sum(dims)) / count
    out = centered * torch.rsqrt(var + self.eps).view(shape)
    if self.affine:
      out = out * self.weight.view(shape) + self.bias.view(shape)
    if self.training and self.track_running_stats:
      with torch.no_grad():
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative average, as torch's BatchNorm
          factor = 1.0 / self.num_batches_tracked.to(mean.dtype)
        else:
          factor = self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
        unbiased = var.detach() * (count / max(count - 1, 1))
        self.running_var.mul_(1 - factor).add_(unbiased * factor)
    return out

  @classmethod
  def convert_sync_batchnorm(cls, module):
    """Returns `module` with every torch BatchNorm layer replaced by SyncBatchNorm.

    Parameters and buffers are carried over (the same Parameter objects, so an
    optimizer made before the conversion still holds them).
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, cls):
      new = cls(
        module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
      )
      if module.affine:
        new.weight = module.weight
        new.bias = module.bias
      if module.track_running_stats:
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
      new.train(module.training)
      return new
    for name, child in module.named_children():
      converted = cls.convert_sync_batchnorm(child)
      if converted is not child:
        module.add_module(name, converted)
    return module


class _ScaleGradient(torch.autograd.Function):
  """The identity forward; the gradient multiplied by `factor` backward."""

  @staticmethod
  def forward(ctx, x, factor):
    ctx.factor = factor
    return x.view_as(x)

  @staticmethod
  def backward(ctx, grad):
    return grad * ctx.factor, None


def _replicas_and_factor(api, in_replica_context=True):
  """(num_replicas_in_sync, gradient factor) of the current context.

  `in_replica_context`: the call needs one (a RuntimeError in a strategy's
  cross-replica context, as in TF); else cross-replica context counts as one
  replica with no aggregation.

  TF divides a replica's loss by the GLOBAL batch (or the replica count)
  because apply_gradients SUMS the replicas' gradients. xladist aggregates
  with `extended.experimental_gradient_aggregation`, MEAN by default: the
  gradient of a TF-scaled loss is then multiplied by the replica count so
  that, after the mean, it is the single-device gradient (SUM or None: TF's
  own meaning, factor 1). The loss VALUE is TF's in every case, so
  `strategy.reduce("sum", losses)` reads the global mean as in TF.
  """
  ctx = context.get_replica_context()
  if ctx is None:
    if in_replica_context and context.has_strategy():
      raise RuntimeError(
        f"You are calling `{api}` in cross replica context (inside "
        "strategy.scope() but outside strategy.run), while it was expected to be "
        "called in replica context: call it in the function given to "
        "strategy.run, where each replica computes its own loss."
      )
    return 1, 1
  n = ctx.num_replicas_in_sync
  op = getattr(ctx.strategy.extended, "experimental_gradient_aggregation", ReduceOp.SUM)
  return n, (n if op is ReduceOp.MEAN else 1)


def _as_loss_tensor(x):
  x = torch.as_tensor(x)
  if not x.is_floating_point():
    x = x.to(torch.get_default_dtype())
  return x


def _weighted(per_example_loss, sample_weight):
  """Losses times their weights, broadcast as TF does: a weight of one rank
  less than the losses gets a trailing dim (per-example weights of per-token
  losses), one of one rank more with a trailing 1 loses it."""
  w = torch.as_tensor(sample_weight, dtype=per_example_loss.dtype)
  if w.device != per_example_loss.device:
    w = w.to(per_example_loss.device)
  if w.dim() == per_example_loss.dim() - 1 and w.dim() > 0:
    w = w.unsqueeze(-1)
  elif w.dim() == per_example_loss.dim() + 1 and w.shape[-1] == 1:
    w = w.squeeze(-1)
  try:
    shape = torch.broadcast_shapes(w.shape, per_example_loss.shape)
  except RuntimeError:
    shape = None
  if shape != per_example_loss.shape:
    raise ValueError(
      "xladist.nn.compute_average_loss: sample_weight has shape "
      f"{list(torch.as_tensor(sample_weight).shape)}, which does not broadcast to the "
      f"losses' shape {list(per_example_loss.shape)} (Incompatible shapes: "
      f"{list(per_example_loss.shape)} vs. {list(torch.as_tensor(sample_weight).shape)}); "
      "give one weight per example (or per loss element), or a scalar."
    )
  return per_example_loss * w


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
  """A replica's share of the global batch's mean loss (TF's `tf.nn.compute_average_loss`).

  Returns `sum(per_example_loss * sample_weight) / global_batch_size`, a scalar
  of the losses' dtype: the value TF returns, so that
  `strategy.reduce("sum", per_replica_losses, axis=None)` is the mean loss of
  the global batch. Its gradient is the single-device gradient of that mean
  once `optimizer.step()` has aggregated the replicas' gradients, whatever
  `strategy.extended.experimental_gradient_aggregation` is (with the default
  MEAN, the gradient is scaled by the replica count; the value is not).

  Call it in the function given to `strategy.run` (or with no strategy).

  Args:
    per_example_loss: the replica's per-example losses, rank >= 1 (dim 0 is
      the batch; further dims, e.g. per-token losses, are summed too).
    sample_weight: optional weights: a scalar, one per example, or one per loss
      element.
    global_batch_size: the number of examples of all replicas in this step;
      default: `per_example_loss.shape[0] * num_replicas_in_sync`.

  Raises:
    ValueError: a scalar `per_example_loss`, weights of the wrong shape, or a
      global batch size that is not a positive integer.
    RuntimeError: called in cross-replica context without `global_batch_size`.
  """
  api = "compute_average_loss"
  loss = _as_loss_tensor(per_example_loss)
  if loss.dim() == 0:
    raise ValueError(
      "Invalid value passed for `per_example_loss`. Expected a tensor with at "
      "least rank 1, got a scalar: xladist.nn.compute_average_loss averages "
      "per-example losses; compute the loss with reduction='none'."
    )
  if sample_weight is not None:
    loss = _weighted(loss, sample_weight)
  if global_batch_size is None:
    n, factor = _replicas_and_factor(api)
    global_batch_size = loss.shape[0] * n
  else:
    if isinstance(global_batch_size, torch.Tensor) or not isinstance(global_batch_size, int):
      raise ValueError(
        f"xladist.nn.compute_average_loss: global_batch_size must be a Python int "
        f"(a constant of the traced step), got {type(global_batch_size).__name__}."
      )
    if global_batch_size <= 0:
      raise ValueError(
        f"xladist.nn.compute_average_loss: global_batch_size must be positive, got "
        f"{global_batch_size}."
      )
    n, factor = _replicas_and_factor(api, in_replica_context=False)
  average = loss.sum() / global_batch_size
  return _ScaleGradient.apply(average, factor) if factor != 1 else average


def scale_regularization_loss(regularization_loss):
  """A replica's share of a regularization loss (TF's `tf.nn.scale_regularization_loss`).

  Returns `sum(regularization_loss) / num_replicas_in_sync`: summed over the
  replicas (TF's `strategy.reduce("sum", ...)`) it is the loss once. Its
  gradient after `optimizer.step()`'s aggregation is the regularization
  loss's own gradient, whatever `experimental_gradient_aggregation` is. Add
  it to `compute_average_loss`'s result in the function given to `strategy.run`.

  Raises:
    RuntimeError: called in cross-replica context (inside `strategy.scope()`,
      outside `strategy.run`).
  """
  n, factor = _replicas_and_factor("scale_regularization_loss")
  scaled = _as_loss_tensor(regularization_loss).sum() / n
  return _ScaleGradient.apply(scaled, factor) if factor != 1 else scaled


__all__ = ["SyncBatchNorm", "compute_average_loss", "scale_regularization_loss"]
