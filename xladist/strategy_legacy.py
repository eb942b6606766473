"""`StrategyLegacy`: the names `Strategy` keeps for ported TF 1 code.

tf.contrib.distribute's ("tower") names and the Scala API's, and TF 1
methods that TF 2 moved to `strategy.extended`: each is a thin alias of a
v2 method or of `StrategyExtended`. `Strategy` inherits them from this mixin,
so `strategy.py` reads as TF 2's API (as TF keeps `StrategyV1` apart).
"""

import torch

from xladist import context, variable_policy
from xladist import runtime as _runtime
from xladist._nest import leaves
from xladist.extended import _OverrideScope, _require_cross_replica
from xladist.values import Mirrored, PerReplica


class StrategyLegacy:
  """TF 1 / tf.contrib / Scala-API names of `Strategy` methods (a mixin of `Strategy`).

  Uses `self._extended`, `self.experimental_distribute_dataset`,
  `self.experimental_local_results` and `self.num_replicas_in_sync` of the
  `Strategy` it is mixed into.
  """

  def distribute_dataset(self, dataset_fn):
    """Legacy (tf.contrib): `experimental_distribute_dataset` of a dataset.

    Args:
      dataset_fn: a dataset of global batches, or a function of no arguments
        that returns one.
    """
    dataset = dataset_fn
    if callable(dataset_fn) and not hasattr(dataset_fn, "__iter__"):
      dataset = dataset_fn()
    return self.experimental_distribute_dataset(dataset)

  def tower_local_var_scope(self, reduce_method):
    """Legacy (tf.contrib): state created inside is sync-on-read with `reduce_method`.

    Parameters, buffers and `xladist.Variable`s made inside (under this
    strategy's scope, or inside its `run`, as the tf.contrib tests do with
    `get_tower_context().tower_local_var_scope(...)`) become ON_READ
    variables aggregated with `reduce_method` ("sum", "mean", a ReduceOp or a
    VariableAggregation): each replica updates its own copy in a step; read in
    cross-replica context (`fetch`, `extended.read_var`), they are combined.
    Every replica starts from the same initial value, even a random one.

    Raises:
      RuntimeError: this strategy is not the current one (enter its scope).
    """
    aggregation = variable_policy.as_aggregation(
      reduce_method.name if hasattr(reduce_method, "name") else reduce_method,
      "tower_local_var_scope",
    )
    if context.get_strategy() is not self:
      # TF 1's _require_distribution_strategy_scope: any context of this strategy.
      raise RuntimeError(
        "tower_local_var_scope must be entered inside this strategy's scope() "
        "or its run (the strategy must be the current one): with strategy.scope(), "
        "strategy.tower_local_var_scope(...): ..."
      )
    policy = variable_policy.Policy(variable_policy.VariableSynchronization.ON_READ, aggregation)
    return _OverrideScope(self._extended, policy)

  tower_local_variable_scope = tower_local_var_scope  # the Scala API's name

  def colocate_vars_with(self, colocate_with_variable):
    """Legacy name of `extended.colocate_vars_with`."""
    return self._extended.colocate_vars_with(colocate_with_variable)

  colocate_variables_with = colocate_vars_with  # the Scala API's name

  def non_slot_devices(self, var_list):
    return self._extended.non_slot_devices(var_list)

  def update(self, var, fn, *args, **kwargs):
    """Legacy: `extended.update(var, fn, args, kwargs)`."""
    return self._extended.update(var, fn, args, kwargs)

  def update_non_slot(self, colocate_with, fn, *args, **kwargs):
    """Legacy: `extended.update_non_slot(colocate_with, fn, args, kwargs)`."""
    return self._extended.update_non_slot(colocate_with, fn, args, kwargs)

  # -- legacy tf.contrib.distribute ("tower") names and the Scala API ---------
  def call_for_each_tower(self, fn, *args, **kwargs):
    """Legacy name of `extended.call_for_each_replica(fn, args, kwargs)`."""
    return self._extended.call_for_each_replica(fn, args, kwargs)

  def for_each_tower(self, fn, values):
    """Scala API: calls `fn(values)` per replica, each with its own components."""
    return self._extended.call_for_each_replica(fn, (values,))

  def unwrap(self, value):
    """Legacy name of `experimental_local_results`."""
    return self.experimental_local_results(value)

  @property
  def worker_device_index(self):
    """Legacy (tf.contrib): each replica's index, to pass to `call_for_each_tower`.

    A PerReplica whose component r is r (the integer 0 with one replica, as in
    TF); inside the step each replica gets its own index as a tensor.

    Raises:
      RuntimeError: called inside `run`.
    """
    _require_cross_replica(self, "strategy.worker_device_index", "Use tower_id inside a step.")
    if self.num_replicas_in_sync == 1:
      return 0
    return self.experimental_distribute_values_from_function(
      lambda ctx: ctx.replica_id_in_sync_group
    )

  @property
  def num_towers(self):
    return self.num_replicas_in_sync

  @property
  def is_single_tower(self):
    return self.num_replicas_in_sync == 1

  @property
  def worker_devices(self):
    return self._extended.worker_devices

  @property
  def parameter_devices(self):
    return self._extended.parameter_devices

  def broadcast(self, tensor, destinations=None, devices=None):
    """Legacy/Scala: `tensor` mirrored on `destinations` (default: every replica)."""
    dest = destinations if destinations is not None else devices
    return self._extended.broadcast_to(
      tensor, dest if dest is not None else self._extended.worker_devices
    )

  def batch_reduce(self, method_string, value_destination_pairs):
    """Legacy name of `extended.batch_reduce_to` taking "sum"/"mean"."""
    return self._extended.batch_reduce_to(method_string, value_destination_pairs)

  def fetch(self, val, destination="cpu", fn=lambda x: x):
    """Legacy (tf.contrib): `fn(val)` copied to `destination`.

    A variable (a parameter, buffer or xladist.Variable) gives its value in
    cross-replica context (one copy of a mirrored variable, the aggregate of a
    sync-on-read one: a tower-local SUM variable fetches the sum of the
    replicas' components, also right after it was made in a scope that is
    still open and in merge_fn); with the default destination "cpu" the
    result is a host tensor.

    Raises:
      ValueError: `val` is a PerReplica (reduce it first), or `destination`
        is not a device of this strategy.
    """
    _require_cross_replica(self, "strategy.fetch", "Return the value from the step.")
    if isinstance(val, PerReplica):
      raise ValueError(
        "strategy.fetch needs a mirrored value, got a PerReplica; reduce it "
        "first with strategy.reduce(...)."
      )
    if isinstance(val, Mirrored):
      val = val.primary
    val = self._extended._read_cross_replica(val)
    if isinstance(val, torch.Tensor):
      val = val.detach()
    out = fn(val)
    if not isinstance(out, torch.Tensor):
      return out
    return out.to(self._extended._resolve_device(destination, "strategy.fetch"))

  def group(self, value):
    """Legacy: runs the pending computation of every component of `value`.

    Like `tf.group` in eager mode it returns None; the values are then computed
    (asynchronously) without being copied to the host.
    """
    _require_cross_replica(self, "strategy.group", "Return the value from the step.")
    pending = [
      t
      for v in leaves(value)
      for t in self.experimental_local_results(v)
      if isinstance(t, torch.Tensor) and _runtime.is_device_tensor(t)
    ]
    if pending:
      _runtime.sync(pending)
    return None
