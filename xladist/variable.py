"""`xladist.Variable`: TF's tf.Variable for state that is not a module's parameter.

`Variable` holds metrics, counters and other state with tf.Variable's
distributed semantics::

  with strategy.scope():
    seen = xd.Variable(0, synchronization=xd.VariableSynchronization.ON_READ,
                       aggregation=xd.VariableAggregation.SUM)

  def step(x):
    seen.assign_add(x.shape[0])   # each replica counts its own examples

  # after the steps, in cross-replica context: seen.value == all examples
"""

import copy

import torch
from torch.optim import optimizer as torch_optimizer

from xladist import context
from xladist import runtime as _runtime
from xladist.replica_copies import copies_of, spread
from xladist.variable_policy import (
  Policy,
  VariableAggregation,
  VariableSynchronization,
  as_aggregation,
  as_synchronization,
  policy_of,
  set_policy,
)
from xladist.variable_store import cross_replica_read

VA, VS = VariableAggregation, VariableSynchronization
_SUM_CROSS_REPLICA = (
  "SyncOnReadVariable does not support `{api}` in cross-replica context when "
  "aggregation is set to `VariableAggregation.SUM`"
)


class Variable(torch.nn.Module):
  """A tensor with tf.Variable's distributed semantics (metrics, counters, state).

  Made under `strategy.scope()` it is a strategy variable like a module's
  parameter (also when made inside `strategy.run`: every replica then starts
  from replica 0's initial value). Writes follow TF 2's rules:

  * `ON_WRITE` (mirrored, the default), in a replica context: with aggregation
    NONE each replica writes its own copy (the copies may then differ, as in
    TF 2); with SUM, MEAN or ONLY_FIRST_REPLICA the replicas' values are
    combined first so that every replica applies the same update. A value that
    is the same on every replica (a Python number, a tensor from outside the
    step) is applied as is with MEAN / ONLY_FIRST_REPLICA and refused with SUM
    (TF: "A non-DistributedValues value ... cannot be reduced with ... SUM").
    In cross-replica context a write sets every copy.
  * `ON_READ`: in a replica context each replica writes its own component;
    read in cross-replica context, the components are combined with
    `aggregation`. In cross-replica context `assign(x)` gives each component
    x / num_replicas (SUM) or x (otherwise), so the read is x;
    `assign_add` / `assign_sub` add to each component and are refused for SUM.

  Args:
    initial_value: a tensor or a number.
    trainable: registered as a Parameter (True) or a buffer (False). Default:
      True for floating ON_WRITE variables, False otherwise (as in TF).
    synchronization: a VariableSynchronization (AUTO means ON_WRITE, or ON_READ
      inside `tower_local_var_scope`). NONE is refused under strategies with
      several devices (MirroredStrategy, TPUStrategy, MultiWorkerMirroredStrategy),
      as in TF.
    aggregation: a VariableAggregation (or "sum"/"mean"/...).
    dtype: converts `initial_value`.
    name: a name for messages and `repr` (TF's `name`).
    constraint: a function applied to the value after each `optimizer.step()`
      that updates it (TF: optimizers apply `Variable.constraint`).

  Raises:
    ValueError: a bad enum value, synchronization NONE under a strategy with
      several devices, or aggregation MEAN with a non-floating dtype there.
    TypeError: `constraint` is not callable.
  """

  _is_xladist_variable = True

  def __init__(
    self,
    initial_value,
    trainable=None,
    synchronization="AUTO",
    aggregation="NONE",
    dtype=None,
    name=None,
    constraint=None,
  ):
    super().__init__()
    synchronization = as_synchronization(synchronization, "xladist.Variable")
    aggregation = as_aggregation(aggregation, "xladist.Variable")
    if constraint is not None and not callable(constraint):
      raise TypeError(
        "xladist.Variable(constraint=...): expected a function from the value to "
        f"the constrained value, got {type(constraint).__name__}."
      )
    strategy = context.get_strategy()
    label = name if name is not None else "Variable"
    if synchronization is VS.NONE and strategy.extended._mirrors_variables:
      raise ValueError(
        f"`NONE` variable synchronization mode is not supported with "
        f"{type(strategy).__name__}: every variable of a strategy with several "
        "devices is either mirrored (ON_WRITE) or sync-on-read (ON_READ). Please "
        f"change the `synchronization` for variable: {label}."
      )
    override = _scope_override(strategy)
    if synchronization is VS.AUTO:
      synchronization = VS.ON_READ if override is not None else VS.ON_WRITE
      if override is not None and aggregation is VA.NONE:
        aggregation = override.aggregation
    on_read = synchronization is VS.ON_READ
    value = torch.as_tensor(initial_value, dtype=dtype).detach().clone()
    if (
      aggregation is VA.MEAN
      and strategy.extended._mirrors_variables
      and not (value.is_floating_point() or value.is_complex())
    ):
      raise ValueError(
        f"xladist.Variable {label}: creating a distributed variable with "
        f"aggregation=MEAN and the non-floating dtype {value.dtype} is not "
        "supported (the mean would be truncated); use a floating dtype or "
        "aggregation SUM / ONLY_FIRST_REPLICA."
      )
    if trainable is None:
      trainable = not on_read and value.is_floating_point()
    self._policy = Policy(synchronization, aggregation)
    self._name = name
    self._strategy = strategy
    self._constraint = constraint
    # Set before registration so the strategy's registration hook sees it.
    tensor = torch.nn.Parameter(value) if trainable else value
    set_policy(tensor, self._policy)
    if constraint is not None:
      _constrain(tensor, constraint)
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
  def name(self):
    return self._name if self._name is not None else "Variable"

  @property
  def trainable(self):
    return isinstance(self.value_, torch.nn.Parameter) and self.value_.requires_grad

  @property
  def constraint(self):
    """The function applied after each optimizer update (None: none)."""
    return self._constraint

  @property
  def distribute_strategy(self):
    """The strategy whose scope made this variable (the default strategy outside any)."""
    return self._strategy

  @property
  def value(self):
    """The value: a replica's own component in a replica context (and inside
    `extended.update`), else the aggregate of the replicas' values, also in
    merge_fn inside a step (one all-reduce there).

    Raises:
      ValueError: a sync-on-read variable with aggregation NONE read in
        cross-replica context (it has no aggregate; TF refuses it too).
    """
    store = getattr(self._strategy.extended, "_store", None)
    step = store.active_step if store is not None else None
    if step is None:
      if store is not None:
        store.place_module_of(self.value_)  # made in a scope that is still open
      cross_replica = copies_of(self.value_) is not None
    else:
      mode = context.current_mode()
      cross_replica = (
        mode.replica_context is None
        and mode.update_device is None
        and step.region.num_replicas > 1
        and step.is_variable(self.value_)
      )
    if not (self._policy.on_read and cross_replica):
      return self.value_
    if self._policy.aggregation is VA.NONE:
      raise ValueError(
        f"{self!r}: a sync-on-read variable with aggregation NONE has no value in "
        "cross-replica context (its replicas' components are not combined); read "
        "it inside strategy.run, or give it an aggregation (SUM, MEAN, "
        "ONLY_FIRST_REPLICA)."
      )
    if step is None:
      return self.value_  # the attribute holds the aggregate between steps
    return cross_replica_read(self.value_, step)

  def read_value(self):
    """A copy of the value (detached)."""
    return self.value.detach().clone()

  def forward(self):
    return self.value

  def __repr__(self):
    name = f"{self._name!r}, " if self._name is not None else ""
    return (
      f"Variable({name}shape={tuple(self.value_.shape)}, dtype={self.value_.dtype}, "
      f"synchronization={self.synchronization.name}, "
      f"aggregation={self.aggregation.name})"
    )

  def __deepcopy__(self, memo):
    """A new variable of the same strategy, policy and value (TF: the copy's
    components are copies of this one's)."""
    strategy = self._strategy
    current = context.get_strategy()
    if current is not strategy and context.has_strategy():
      raise RuntimeError(
        f"copy.deepcopy of {self!r}: mixing different strategies: the variable "
        f"belongs to {strategy!r}, but {current!r} is current. Copy it outside "
        "that scope or inside its own strategy's scope."
      )
    src = self.value_
    with torch.no_grad():
      value = src.detach().clone()
    new = Variable.__new__(Variable)
    torch.nn.Module.__init__(new)
    memo[id(self)] = new
    new._policy = copy.deepcopy(self._policy)
    new._name, new._strategy, new._constraint = self._name, strategy, self._constraint
    tensor = (
      torch.nn.Parameter(value, requires_grad=src.requires_grad)
      if isinstance(src, torch.nn.Parameter)
      else value
    )
    set_policy(tensor, new._policy)
    if self._constraint is not None:
      _constrain(tensor, self._constraint)
    copies = copies_of(src)
    if copies is not None:
      copies.current(src, repr)
      copies.copy_to(tensor)
    with strategy.scope():
      if isinstance(tensor, torch.nn.Parameter):
        new.register_parameter("value_", tensor)
      else:
        new.register_buffer("value_", tensor)
    return new

  # -- writes ----------------------------------------------------------------
  def assign(self, value):
    """Sets the value (see the class docstring for the rules per context);
    returns the variable."""
    self._write(value, "assign")
    return self

  def assign_add(self, delta):
    """Adds `delta` (see the class docstring); returns the variable."""
    self._write(delta, "assign_add")
    return self

  def assign_sub(self, delta):
    """Subtracts `delta` (see the class docstring); returns the variable."""
    self._write(delta, "assign_sub")
    return self

  def _write(self, value, api):
    target = self.value_
    x = torch.as_tensor(value, dtype=target.dtype)
    if x.device != target.device:
      x = x.to(target.device)
    policy = self._policy
    strategy = self._strategy
    store = getattr(strategy.extended, "_store", None)
    step = store.active_step if store is not None else None
    if step is None:
      return self._write_outside_step(x, api)
    mode = context.current_mode()
    if mode.update_device is not None:  # extended.update: this component
      return self._apply(target, x, api)
    region = step.region
    if mode.replica_context is None:  # merge_fn: cross-replica, inside the step
      if policy.on_read:
        return self._assign_cross_replica_local(target, x, api, region)
      return step.combining(lambda: self._apply(target, x, api))
    if policy.on_read or policy.aggregation is VA.NONE:
      return self._apply(target, x, api)  # each replica its own copy (TF 2)
    aggregation = policy.aggregation
    same = _same_on_every_replica(value, step, region)
    if same and aggregation is VA.SUM and region.num_replicas > 1:
      raise ValueError(
        f"{self!r}.{api} in a replica context: a non-DistributedValues value "
        f"({_describe_value(value)}) cannot be reduced with ReduceOp.SUM: it is the "
        f"same on every replica, so the {region.num_replicas} replicas would add "
        "it that many times. Pass a value computed in the step (each replica's "
        "own), or use aggregation MEAN or ONLY_FIRST_REPLICA."
      )
    if not same:
      if aggregation is VA.MEAN and not (target.is_floating_point() or target.is_complex()):
        raise ValueError(
          f"{self!r}.{api} in a replica context: cannot update a non-float variable "
          "with aggregation MEAN from per-replica values (the mean would be "
          "truncated); cast the variable to a floating dtype or use SUM."
        )
      x = _combine(context.get_replica_context(), aggregation, x)
    return step.combining(lambda: self._apply(target, x, api))

  def _write_outside_step(self, x, api):
    target = self.value_
    copies = copies_of(target)
    if copies is None or api == "assign":
      # One value everywhere; for sync-on-read state the next use spreads it
      # over the components (TF: assign in cross-replica context).
      return self._apply(target, x, api)
    if self._policy.aggregation is VA.SUM:
      raise ValueError(_SUM_CROSS_REPLICA.format(api=api) + f" ({self!r}).")
    stacked = copies.current(target, repr)
    with torch.no_grad():
      delta = x if api == "assign_add" else -x
      copies.stacked = _runtime.place_split(stacked + delta)
      target.add_(delta)
    copies.restamp(target)
    return None

  def _assign_cross_replica_local(self, target, x, api, region):
    """A cross-replica write of a sync-on-read variable inside merge_fn."""
    if api != "assign":
      if self._policy.aggregation is VA.SUM and region.num_replicas > 1:
        raise ValueError(_SUM_CROSS_REPLICA.format(api=api) + f" ({self!r}).")
      return self._apply(target, x, api)
    if self._policy.aggregation is VA.SUM and region.num_replicas > 1:
      parts = spread(x, VA.SUM, region.num_replicas)
      x = parts.index_select(0, region.replica_id.reshape(1).long()).squeeze(0)
    return self._apply(target, x, api)

  @staticmethod
  def _apply(target, x, api):
    with torch.no_grad():
      if api == "assign":
        target.copy_(x)
      elif api == "assign_add":
        target.add_(x)
      else:
        target.sub_(x)


def _combine(ctx, aggregation, x):
  """The value every replica applies to a mirrored variable written in a replica context."""
  if aggregation is VA.ONLY_FIRST_REPLICA:
    rid = ctx.replica_id_in_sync_group
    return ctx.all_reduce("sum", torch.where(rid == 0, x, torch.zeros_like(x)))
  return ctx.all_reduce(aggregation.name, x)


def _same_on_every_replica(value, step, region):
  """TF's non-distributed value: one object for every replica.

  A Python number or host tensor, a variable's (mirrored) value, a tensor
  passed to `run` as a plain tensor or Mirrored, or an XLA tensor made before
  the step began (captured by closure). Tensors computed in the step are each
  replica's own, as in TF, where each replica makes its own.
  """
  if not isinstance(value, torch.Tensor) or not _runtime.is_device_tensor(value):
    return True
  if step.is_variable(value):
    return not policy_of(value).on_read
  return region.is_replicated_input(value)


def _describe_value(value):
  if isinstance(value, torch.Tensor):
    return f"a {value.device.type} tensor of shape {tuple(value.shape)}"
  return f"{type(value).__name__} {value!r:.40}"


def _scope_override(strategy):
  """The policy of the innermost tower_local_var_scope of the current strategy."""
  store = getattr(strategy.extended, "_store", None)
  return None if store is None else store.policy_override


# -- constraints (TF: optimizers apply Variable.constraint after an update) -------

_CONSTRAINT = "_xladist_constraint"
_constraint_hook = []


def _constrain(tensor, constraint):
  setattr(tensor, _CONSTRAINT, constraint)
  if not _constraint_hook:
    _constraint_hook.append(torch_optimizer.register_optimizer_step_post_hook(_apply_constraints))


def _apply_constraints(optimizer, args, kwargs):
  for group in optimizer.param_groups:
    for p in group["params"]:
      constraint = getattr(p, _CONSTRAINT, None)
      if constraint is not None:
        with torch.no_grad():
          p.copy_(constraint(p))
