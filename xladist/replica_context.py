"""`ReplicaContext`: what the step function sees of the other replicas."""

import torch

from xladist import context
from xladist import runtime as _runtime
from xladist._global_view import concat_stacked as _concat_stacked
from xladist._nest import (
  error_at,
  flatten_with_path,
  leaf_name,
  tree_map,
  tree_map_with_path,
  unflatten,
)
from xladist.communication_options import check_options
from xladist.reduce_util import as_reduce_op
from xladist.values import DistributedValues, PerReplica


class ReplicaContext:
  """The replica context of one `strategy.run` (or the default one outside any scope).

  Inside `run`, every replica is traced at once, so `replica_id_in_sync_group`
  is a traced int32 tensor (as in TF's TPUStrategy), not a Python int.
  """

  def __init__(self, strategy, region=None):
    self._strategy = strategy
    self._region = region

  def __repr__(self):
    return f"ReplicaContext(strategy={self._strategy!r})"

  @property
  def strategy(self):
    return self._strategy

  @property
  def num_replicas_in_sync(self):
    return self._strategy.num_replicas_in_sync

  @property
  def replica_id_in_sync_group(self):
    """This replica's index in 0..num_replicas_in_sync-1, as a traced int32 tensor.

    Using it in Python control flow (`if ctx.replica_id_in_sync_group == 0:`)
    makes `strategy.run` raise a RuntimeError that says so; use tensor ops
    (`torch.where`) instead.
    """
    if self._region is None:
      return torch.tensor(0, dtype=torch.int32)
    return self._region.replica_id

  tower_id = replica_id_in_sync_group

  def tower_local_var_scope(self, reduce_method):
    """Legacy (tf.contrib TowerContext): the strategy's `tower_local_var_scope`,
    for variables made inside the step function."""
    return self._strategy.tower_local_var_scope(reduce_method)

  @property
  def devices(self):
    """The devices this replica's computation runs on (a 1-tuple)."""
    return (self._strategy.extended._current_device(),)

  def _require_current(self, api):
    if context.get_replica_context() is not self:
      raise RuntimeError(
        f"ReplicaContext.{api} must be called in this replica context: inside the "
        "step function of the strategy.run that made it, outside merge_fn."
      )

  def merge_call(self, merge_fn, *legacy_args, args=None, kwargs=None, **legacy_kwargs):
    """Runs `merge_fn(strategy, *args, **kwargs)` once, in cross-replica context.

    TF 2's form is `merge_call(merge_fn, args=(), kwargs=None)`, where the
    second positional argument is `args`. The positional form of
    tf.contrib.distribute, `merge_call(merge_fn, *args, **kwargs)`, is accepted
    too: positional values that are not one tuple or list (with an optional
    kwargs dict after it) are the arguments themselves.

    Tensors in `args`/`kwargs` reach `merge_fn` as `PerReplica` values (strategy
    variables as themselves). What `merge_fn` returns goes back to every
    replica: a `PerReplica` gives each replica its own component, anything else
    is the same on every replica. A `merge_fn` that only reduces
    (`strategy.reduce`, `extended.reduce_to`, `extended.batch_reduce_to`) costs
    one all-reduce; reading `PerReplica.values` costs an all-gather.

    TF's example, with replica ids 0 and 1 and `three = 3.`:

      >>> def merge_fn(strategy, v):
      ...   return strategy.reduce("sum", v, axis=None)
      >>> def fn(three):
      ...   ctx = xd.get_replica_context()
      ...   v = three + ctx.replica_id_in_sync_group     # 3., 4.
      ...   s = ctx.merge_call(merge_fn, args=(v,))      # 7. on both
      ...   return s + v                                 # 10., 11.

    Raises:
      TypeError: `merge_fn` is not callable.
      RuntimeError: not called from this replica context.
    """
    if not callable(merge_fn):
      raise TypeError(f"merge_call: merge_fn must be callable, got {type(merge_fn).__name__}.")
    self._require_current("merge_call")
    args, kwargs = _merge_call_arguments(legacy_args, legacy_kwargs, args, kwargs)
    region = self._region
    if region is not None:
      args, kwargs = tree_map(lambda x: self._as_per_replica(x, region), (tuple(args), kwargs))
    mode = context._Mode(self._strategy, cross_replica=self._strategy)
    context.push(mode)
    try:
      if region is None:
        result = merge_fn(self._strategy, *args, **kwargs)
      else:
        # Mirrored variables merge_fn writes get the same value on every
        # replica: such writes need no combining on exit.
        result = region.step.combining(lambda: merge_fn(self._strategy, *args, **kwargs))
    finally:
      context.pop(mode)
    if region is None:
      return result
    return tree_map(region.local_of, result)

  @staticmethod
  def _as_per_replica(x, region):
    if not isinstance(x, torch.Tensor) or region.step.is_variable(x):
      return x
    if not _runtime.is_device_tensor(x):
      x = region.local_replicated(x)
    return PerReplica._from_local(x, region)

  def all_reduce(self, reduce_op, value, options=None):
    """All-reduces a nested structure of tensors across replicas.

    The reduction uses the strategy's CrossDeviceOps: by default the tensors
    of one dtype are packed into one XLA all-reduce; `options`
    (`experimental.CommunicationOptions`) can ask for buckets of
    `bytes_per_pack` bytes instead. SUM and MEAN are differentiable. With two
    replicas holding {"a": 1., "b": [2., 3.]} and {"a": 4., "b": [5., 6.]},
    `all_reduce("sum", value)` gives {"a": 5., "b": [7., 9.]} on both.

    Raises:
      TypeError: a leaf is not a tensor or number, or `options` is not a
        CommunicationOptions.
      RuntimeError: not called from this replica context.
    """
    reduce_op = as_reduce_op(reduce_op, "ReplicaContext.all_reduce")
    options = check_options(options, "ReplicaContext.all_reduce")
    self._require_current("all_reduce")
    paths, leaves, spec = flatten_with_path(value)
    tensors = [_as_tensor(x, "all_reduce", value, p) for p, x in zip(paths, leaves)]
    if self._region is None:
      return unflatten(spec, tensors)
    is_dev = _runtime.is_device_tensor
    tensors = [t if is_dev(t) else self._region.local_replicated(t) for t in tensors]
    return unflatten(spec, self._region.all_reduce(reduce_op, tensors, options))

  def all_gather(self, value, axis, options=None):
    """Concatenates every replica's value (nested structure) along `axis`.

    With two replicas holding [1, 2] and [3, 4], `all_gather(v, axis=0)` gives
    [1, 2, 3, 4] on both. Differentiable.

    Raises:
      ValueError: a value is a scalar or `axis` is out of range.
      RuntimeError: not called from this replica context.
    """
    check_options(options, "ReplicaContext.all_gather")
    self._require_current("all_gather")
    region = self._region

    def gather(path, x):
      t = _as_tensor(x, "all_gather", value, path)
      try:
        if region is None or t.dim() == 0:
          # No other replica (or a scalar, which raises): the value stacked once.
          return _concat_stacked(t.unsqueeze(0), axis, "ReplicaContext.all_gather")
        if not _runtime.is_device_tensor(t):
          t = region.local_replicated(t)
        return _concat_stacked(region.gather_stacked(t), axis, "ReplicaContext.all_gather")
      except (TypeError, ValueError) as e:
        raise error_at(e, value, path) from None

    return tree_map_with_path(gather, value)


def _merge_call_arguments(legacy_args, legacy_kwargs, args, kwargs):
  """(args, kwargs) of merge_call from TF 2's or the legacy positional form."""
  if args is not None or kwargs is not None:
    if legacy_args or legacy_kwargs:
      raise TypeError(
        "merge_call: pass merge_fn's arguments either as args=/kwargs= (TF 2) or "
        "positionally (legacy form), not both."
      )
    return tuple(args or ()), dict(kwargs or {})
  if (
    1 <= len(legacy_args) <= 2
    and isinstance(legacy_args[0], (tuple, list))
    and not legacy_kwargs
    and (len(legacy_args) == 1 or isinstance(legacy_args[1], (dict, type(None))))
  ):
    # TF 2 with positional args / kwargs: merge_call(fn, (a, b)) or (fn, (a,), {...})
    return tuple(legacy_args[0]), dict((legacy_args + (None,))[1] or {})
  return tuple(legacy_args), dict(legacy_kwargs)


def _as_tensor(x, api, value, path):
  """A leaf of `value` (at `path`) as a tensor."""
  if isinstance(x, torch.Tensor):
    return x
  if isinstance(x, (int, float, bool)):
    return torch.tensor(x)
  where = leaf_name(value, path)
  if isinstance(x, DistributedValues):
    raise TypeError(
      f"ReplicaContext.{api}: {where} is a {type(x).__name__}; inside the step each "
      "replica passes its own tensor."
    )
  raise TypeError(
    f"ReplicaContext.{api}: {where} is a {type(x).__name__}; expected tensors or "
    "Python numbers (in nested tuples, lists, dicts, namedtuples or dataclasses)."
  )


TowerContext = ReplicaContext
