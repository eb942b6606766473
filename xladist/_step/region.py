"""One `strategy.run` call: the manual region every replica is traced in.

Entering converts each argument and each strategy variable to its local view;
leaving converts every output (and the variables) back to global views:

* a per-replica value is a global tensor of shape (num_replicas, *shape) split
  over the replica axis; inside the region each replica sees its own row,
  squeezed to `shape`;
* a mirrored value (variables, plain tensors, `Mirrored`) is replicated; inside
  the region each replica sees the whole tensor;
* an output of shape `shape` leaves as (num_replicas, *shape), split over the
  replica axis, and becomes a `PerReplica`.
"""

import torch

from xladist import _logical, collectives
from xladist import runtime as _runtime
from xladist.step_writes import StepWrites
from xladist.values import _NOT_CONSTANT, DistributedValues, Mirrored, PerReplica

HOST_READ_MESSAGE = (
  "strategy.run: the step function read a traced tensor's value on the host "
  "({detail}). Inside strategy.run all replicas are traced into one XLA program, "
  "so no value is known while the function runs; this includes Python control "
  "flow such as `if replica_id_in_sync_group == 0:` (replica_id_in_sync_group is "
  "a traced tensor, as in TF's TPUStrategy), `.item()`, `bool(t)`, `print(t)` and "
  "`.cpu()`. Use tensor operations instead (torch.where, masks, "
  "ReplicaContext.all_reduce), or return the value from the step function and "
  "read it after strategy.run returns."
)


class Region:
  """The manual region of one traced step over all replicas.

  Args:
    strategy: the strategy whose step this is.
    replica_iota: returns the global int32 tensor whose row r is r (split over
      the replica axis): each replica's `replica_id` is its local view.
    device_iota: returns the global tensor whose element d is on device d
      (logical devices find their core index from it).
    all_reduce: `all_reduce(op, local_tensors, options)` with the strategy's
      cross-device ops (ReplicaContext.all_reduce, merge_call).
  """

  def __init__(self, strategy, replica_iota, device_iota, all_reduce):
    self.strategy = strategy
    self._replica_iota = replica_iota
    self._device_iota = device_iota
    self._all_reduce = all_reduce
    self.num_replicas = strategy.num_replicas_in_sync
    self.active = True
    self.step = StepWrites(self)
    self._replica_id = None
    self._core_axis = None
    # Tensors made before the step began have smaller XLA tensor ids: what the
    # step captured from outside is the same on every replica.
    self._first_id = _runtime.creation_index()
    self._replicated_ids = set()  # local views of Mirrored / plain-tensor arguments
    self._variable_ids = None  # ids of the strategy's variables (arguments that are one)

  # -- replica id ---------------------------------------------------------------
  @property
  def replica_id(self):
    """This replica's index as a traced int32 scalar (from a replica-split iota)."""
    if self._replica_id is None:
      iota = self._replica_iota()
      self._replica_id = _runtime.to_local(iota).reshape(())
    return self._replica_id

  @property
  def core_axis(self):
    """This device's place among its replica's cores (TPUStrategy logical devices)."""
    if self._core_axis is None:
      iota = self._device_iota()
      self._core_axis = _logical.CoreAxis(self.num_replicas, _runtime.to_local(iota).reshape(()))
    return self._core_axis

  def require_active(self, api):
    if not self.active:
      raise RuntimeError(
        f"{api}: this value belongs to a strategy.run call that has returned; "
        "values made inside merge_call cannot be used after the step."
      )

  # -- entering -------------------------------------------------------------------
  @staticmethod
  def local_replicated(t):
    """A mirrored global tensor -> the whole tensor on each replica."""
    if not _runtime.is_device_tensor(t):
      t = _runtime.place_replicated(t)
    else:
      _runtime.ensure_sharded(t)
    return _runtime.to_local(t)

  @staticmethod
  def global_replicated(t):
    """A local tensor that is identical on every replica -> a replicated global."""
    return _runtime.to_global(t, _runtime.sharding(t.dim(), split=False), t.shape)

  def enter_value(self, value):
    if isinstance(value, PerReplica):
      if value._local is not None:
        raise ValueError(
          "strategy.run: a PerReplica made inside merge_call cannot be passed "
          "to another strategy.run."
        )
      if value.num_replicas != self.num_replicas:
        raise ValueError(
          f"strategy.run: a PerReplica with {value.num_replicas} components was "
          f"passed to a strategy with {self.num_replicas} replicas."
        )
      constant = value._constant()
      if constant is not _NOT_CONSTANT:
        return constant  # the same Python value on every replica
      stacked = value._stacked_global(self.num_replicas)
      return _runtime.to_local(stacked).squeeze(0)
    if isinstance(value, Mirrored):
      return self.enter_value(value.primary)
    if isinstance(value, torch.Tensor):
      if self.is_variable(value):
        # TF keeps a variable argument a variable (custom_training_loop_models_test
        # test_variable_run_argument): the object itself, which the step binds
        # to its replica-local view (VariableStore.enter) before `fn` runs, so
        # autograd, optimizers and writes through it reach the model.
        return value
      local = self.local_replicated(value)
      self._replicated_ids.add(id(local))
      return local
    return value

  def is_variable(self, tensor):
    """True when `tensor` is one of the strategy's (placed) variables."""
    if self._variable_ids is None:
      store = getattr(self.strategy.extended, "_store", None)
      self._variable_ids = set() if store is None else {id(t) for t in store.variables()}
    return id(tensor) in self._variable_ids

  def is_replicated_input(self, tensor):
    """True for an XLA tensor that is the same on every replica by construction:
    a Mirrored or plain-tensor argument of `run`, or a tensor made before the step."""
    return id(tensor) in self._replicated_ids or _runtime.creation_index(tensor) < self._first_id

  # -- leaving --------------------------------------------------------------------
  def exit_value(self, value):
    value = _logical.whole(value)
    if isinstance(value, torch.Tensor) and not _runtime.is_device_tensor(value):
      # Made on the host inside fn: every replica made its own (TF: a PerReplica).
      if self.num_replicas == 1:
        return value
      return PerReplica(tuple(value.clone() for _ in range(self.num_replicas)))
    if isinstance(value, torch.Tensor):  # an XLA tensor (host tensors are handled above)
      if self.num_replicas == 1:
        # The one replica's value is the global value (on the jax runtime a
        # squeeze after leaving would be a traced value no program returns).
        return self.global_replicated(value.detach())
      local = value.detach().unsqueeze(0)
      full = torch.Size((self.num_replicas,) + tuple(value.shape))
      sharding = _runtime.sharding(local.dim(), self.num_replicas)
      stacked = _runtime.to_global(local, sharding, full)
      return PerReplica._from_stacked(stacked, self.num_replicas)
    if isinstance(value, DistributedValues):
      raise TypeError(
        "strategy.run: the step function returned a "
        f"{type(value).__name__}; inside the step return plain tensors (each "
        "replica's own value) and they come back as a PerReplica."
      )
    return value

  # -- cross-replica views (merge_call) --------------------------------------------
  def all_reduce(self, op, tensors, options=None):
    """All-reduces local tensors with the strategy's CrossDeviceOps and options."""
    return self._all_reduce(op, tensors, options)

  def gather_stacked(self, local):
    return collectives.gather_stacked(local, self.replica_id, self.num_replicas)

  def local_of(self, value):
    """The local (per-replica) tensor for a value merge_fn returned."""
    if isinstance(value, PerReplica):
      if value._local is not None:
        value._local[1].require_active("merge_call")
        return value._local[0]
      comps = [c if isinstance(c, torch.Tensor) else torch.as_tensor(c) for c in value.values]
      is_dev = _runtime.is_device_tensor
      comps = [c if is_dev(c) else c.to(_runtime.device()) for c in comps]
      return collectives.select_own(torch.stack(comps), self.replica_id)
    if isinstance(value, Mirrored):
      return value.primary
    return value

  def close(self):
    """Ends the step: drops every replica-local tensor this object holds (a
    ReplicaContext kept by the user keeps the region alive)."""
    self.active = False
    self.step = None
    self._replica_id = None
    self._core_axis = None
    self._replicated_ids = set()
    self._variable_ids = None
