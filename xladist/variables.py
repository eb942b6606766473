"""Variable policies (TF's VariableSynchronization / VariableAggregation) and `Variable`.

Every tensor of a module made under `strategy.scope()` is a strategy variable
with a policy:

* parameters: `ON_WRITE` (mirrored: identical on every replica; the optimizer
  keeps them so by aggregating gradients);
* buffers (e.g. BatchNorm running statistics): `ON_READ` with `MEAN`: each
  replica updates its own copy inside a step, and what is read in
  cross-replica context (attribute, `state_dict()`, checkpoints) is the mean;
* inside `strategy.tower_local_var_scope(reduce_method)`: `ON_READ` with that
  reduction;
* an `xladist.Variable` says its own policy.

`Variable` is TF's `tf.Variable` for state that is not a module's parameter or
buffer (metrics, counters)::

  with strategy.scope():
    seen = xd.Variable(0, synchronization=xd.VariableSynchronization.ON_READ,
                       aggregation=xd.VariableAggregation.SUM)

  def step(x):
    seen.assign_add(x.shape[0])   # each replica counts its own examples

  # after the steps, in cross-replica context: seen.value == all examples
"""

import enum

import torch

from xladist import context


class VariableSynchronization(enum.Enum):
  """When a variable's copies are synchronised (TF's tf.VariableSynchronization)."""

  AUTO = "AUTO"
  NONE = "NONE"
  ON_WRITE = "ON_WRITE"
  ON_READ = "ON_READ"


class VariableAggregation(enum.Enum):
  """How a variable's per-replica values are combined (TF's tf.VariableAggregation)."""

  NONE = "NONE"
  SUM = "SUM"
  MEAN = "MEAN"
  ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


class Policy:
  """The synchronization and aggregation of one variable."""

  __slots__ = ("synchronization", "aggregation")

  def __init__(self, synchronization, aggregation):
    self.synchronization = synchronization
    self.aggregation = aggregation

  @property
  def on_read(self):
    return self.synchronization is VariableSynchronization.ON_READ

  def __repr__(self):
    return f"Policy({self.synchronization.name}, {self.aggregation.name})"


MIRRORED = Policy(VariableSynchronization.ON_WRITE, VariableAggregation.NONE)
BUFFER = Policy(VariableSynchronization.ON_READ, VariableAggregation.MEAN)

# A policy given explicitly (Variable, tower_local_var_scope) is an attribute of
# the tensor (a weak-keyed table would stop torch.utils.swap_tensors, which
# refuses tensors that have weak references); the rest default by kind.
_ATTR = "_xladist_policy"


def set_policy(tensor, policy):
  setattr(tensor, _ATTR, policy)


def has_explicit_policy(tensor):
  return hasattr(tensor, _ATTR)


def policy_of(tensor):
  policy = getattr(tensor, _ATTR, None)
  if policy is not None:
    return policy
  return MIRRORED if isinstance(tensor, torch.nn.Parameter) else BUFFER


def carry_policy(source, target):
  """Copies an explicit policy before `source` and `target` are swapped."""
  policy = getattr(source, _ATTR, None)
  if policy is not None:
    setattr(target, _ATTR, policy)


def as_synchronization(value, api):
  return _as_enum(VariableSynchronization, value, api, "synchronization")


def as_aggregation(value, api):
  from xladist.reduce_util import ReduceOp
  if isinstance(value, ReduceOp) and value in (ReduceOp.SUM, ReduceOp.MEAN):
    return VariableAggregation[value.name]
  return _as_enum(VariableAggregation, value, api, "aggregation")


def _as_enum(cls, value, api, what):
  if isinstance(value, cls):
    return value
  if isinstance(value, str) and value.upper() in cls.__members__:
    return cls[value.upper()]
  names = ", ".join(f"{cls.__name__}.{m}" for m in cls.__members__)
  raise ValueError(f"{api}: {what} must be one of {names} (or their names), got "
                   f"{value!r}.")


class Variable(torch.nn.Module):
  """A tensor with tf.Variable's distributed semantics (metrics, counters, state).

  Made under `strategy.scope()` it is a strategy variable like a module's
  parameter. Writes follow TF's rules:

  * `ON_WRITE` (mirrored, the default): in a replica context a write needs an
    `aggregation` (SUM, MEAN or ONLY_FIRST_REPLICA): the replicas' values are
    combined so that every replica applies the same update. Without one, the
    write raises a RuntimeError naming the fix.
  * `ON_READ`: in a replica context each replica writes its own copy; read in
    cross-replica context, the copies are combined with `aggregation`.

  Args:
    initial_value: a tensor or a number.
    trainable: registered as a Parameter (True) or a buffer (False). Default:
      True for floating ON_WRITE variables, False otherwise (as in TF).
    synchronization: a VariableSynchronization (AUTO means ON_WRITE, or ON_READ
      inside `tower_local_var_scope`).
    aggregation: a VariableAggregation (or "sum"/"mean"/...).
    dtype: converts `initial_value`.

  Raises:
    ValueError: ON_READ with trainable=True (as in TF), or a bad enum value.
  """

  def __init__(self, initial_value, trainable=None, synchronization="AUTO",
               aggregation="NONE", dtype=None):
    super().__init__()
    synchronization = as_synchronization(synchronization, "xladist.Variable")
    aggregation = as_aggregation(aggregation, "xladist.Variable")
    override = _scope_override()
    if synchronization is VariableSynchronization.AUTO:
      synchronization = (VariableSynchronization.ON_READ if override is not None
                         else VariableSynchronization.ON_WRITE)
      if override is not None and aggregation is VariableAggregation.NONE:
        aggregation = override.aggregation
    on_read = synchronization is VariableSynchronization.ON_READ
    value = torch.as_tensor(initial_value, dtype=dtype).detach().clone()
    if trainable is None:
      trainable = not on_read and value.is_floating_point()
    if trainable and on_read:
      raise ValueError(
          "xladist.Variable: synchronization=ON_READ variables cannot be trainable "
          "(each replica would hold a different value); pass trainable=False.")
    self._policy = Policy(synchronization, aggregation)
    # Set before registration so the strategy's registration hook sees it.
    tensor = torch.nn.Parameter(value) if trainable else value
    set_policy(tensor, self._policy)
    if trainable:
      self.register_parameter("value_", tensor)
    else:
      self.register_buffer("value_", tensor)

  @property
  def synchronization(self):
    return self._policy.synchronization

  @property
  def aggregation(self):
    return self._policy.aggregation

  @property
  def value(self):
    """The value: a replica's own (local) value in a replica context, else the
    aggregate of the replicas' values."""
    return self.value_

  def read_value(self):
    """A copy of the value (detached)."""
    return self.value_.detach().clone()

  def forward(self):
    return self.value_

  def __repr__(self):
    return (f"Variable(shape={tuple(self.value_.shape)}, dtype={self.value_.dtype}, "
            f"synchronization={self.synchronization.name}, "
            f"aggregation={self.aggregation.name})")

  def assign(self, value):
    """Sets the value (see the class docstring for the rules in a replica context)."""
    return self._write(value, lambda v, x: v.copy_(x), "assign")

  def assign_add(self, delta):
    return self._write(delta, lambda v, x: v.add_(x), "assign_add")

  def assign_sub(self, delta):
    return self._write(delta, lambda v, x: v.sub_(x), "assign_sub")

  def _write(self, value, apply, api):
    target = self.value_
    x = torch.as_tensor(value, dtype=target.dtype)
    if x.device != target.device:
      x = x.to(target.device)
    ctx = context.get_replica_context()
    replicated = (ctx is not None and ctx.num_replicas_in_sync > 1
                  and not self._policy.on_read)
    if replicated:
      aggregation = self._policy.aggregation
      if aggregation is VariableAggregation.NONE:
        raise RuntimeError(
            f"Variable.{api} in a replica context: this variable is mirrored "
            "(ON_WRITE) with aggregation NONE, so the replicas' values cannot be "
            "combined into one update. Create it with an aggregation, e.g. "
            "xladist.Variable(..., aggregation=xladist.VariableAggregation.SUM "
            "or MEAN or ONLY_FIRST_REPLICA), or update it in cross-replica context "
            "(ReplicaContext.merge_call / strategy.extended.update).")
      x = _combine(ctx, aggregation, x)
    with torch.no_grad():
      apply(target, x)
    return self


def _combine(ctx, aggregation, x):
  """The value every replica applies to a mirrored variable written in a replica context."""
  if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
    rid = ctx.replica_id_in_sync_group
    return ctx.all_reduce("sum", torch.where(rid == 0, x, torch.zeros_like(x)))
  return ctx.all_reduce(aggregation.name, x)


# -- tower_local_var_scope ----------------------------------------------------------

def _scope_override():
  """The policy of the innermost tower_local_var_scope of the current strategy."""
  strategy = context.get_strategy()
  store = getattr(strategy.extended, "_store", None)
  return None if store is None else store.policy_override
