"""The strategy's variables: module state and optimizer state made under `scope()`.

While a scope is active, torch's global module registration hooks record every
module that registers a parameter or buffer. On leaving the scope (and before
each `run`) the recorded tensors are moved to the strategy's device(s) with
`torch.utils.swap_tensors`, which keeps each `Parameter`'s identity: an optimizer
made in the same scope, before the move, still holds the right objects. (A
CPU->XLA `.data` assignment is rejected by torch 2.9, and `module.to()` would make
new Parameter objects.)

Inside `run` every variable's `.data` (and `.grad`) is swapped for its local view
on entry and back to a global view on exit; optimizer state is swapped the same
way. Mirrored state is labelled replicated; each device holds its own copy, which
the gradient aggregation keeps identical.
"""

import weakref

import torch
from torch.nn.modules import module as torch_module

from xladist import _runtime, collectives, variables
from xladist.reduce_util import ReduceOp


class VariableStore:
  """Tracks the modules and optimizers whose state belongs to one strategy."""

  def __init__(self, place_fn):
    # tensor -> a new tensor on the strategy's device(s), or None when it is
    # already there
    self._place_fn = place_fn
    self._modules = []  # weakrefs, in registration order (stable graph order)
    self._module_ids = set()
    self._pending = []
    self._optimizers = []
    self._optimizer_ids = set()
    self._hook_handles = None
    self._scope_depth = 0
    self._overrides = []  # tower_local_var_scope policies, innermost last

  @property
  def policy_override(self):
    return self._overrides[-1] if self._overrides else None

  def push_override(self, policy):
    self._overrides.append(policy)

  def pop_override(self):
    self._overrides.pop()

  # -- scope ----------------------------------------------------------------
  def enter_scope(self):
    self._scope_depth += 1
    if self._scope_depth == 1:
      self._hook_handles = (
          torch_module.register_module_parameter_registration_hook(self._on_register),
          torch_module.register_module_buffer_registration_hook(self._on_register),
          # A submodule assigned under the scope may have been made elsewhere
          # or copied (nn.TransformerEncoder deep-copies its layers, which
          # registers no parameter): its whole subtree becomes variables.
          torch_module.register_module_module_registration_hook(self._on_submodule),
      )

  def exit_scope(self):
    self._scope_depth -= 1
    if self._scope_depth == 0:
      for h in self._hook_handles:
        h.remove()
      self._hook_handles = None
      self.place_pending()

  def _on_register(self, module, name, tensor):
    if tensor is not None and self._overrides and not variables.has_explicit_policy(tensor):
      variables.set_policy(tensor, self._overrides[-1])
    key = id(module)
    if key not in self._module_ids:
      self._module_ids.add(key)
      ref = weakref.ref(module, lambda _, key=key: self._forget(key))
      self._modules.append(ref)
      self._pending.append(ref)
    return None

  def _on_submodule(self, parent, name, submodule):
    if submodule is not None:
      for m in submodule.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
          if t is not None:
            self._on_register(m, None, t)
        if m._parameters or m._buffers:
          self._on_register(m, None, None)
    return None

  def _forget(self, key):
    self._module_ids.discard(key)
    self._modules = [r for r in self._modules if r() is not None]

  def track_optimizer(self, optimizer):
    """Returns True when `optimizer` was not tracked before."""
    if id(optimizer) in self._optimizer_ids:
      return False
    self._optimizer_ids.add(id(optimizer))
    key = id(optimizer)

    def forget(_, key=key):
      self._optimizer_ids.discard(key)
      self._optimizers = [r for r in self._optimizers if r() is not None]
    self._optimizers.append(weakref.ref(optimizer, forget))
    return True

  # -- placement --------------------------------------------------------------
  def place_pending(self):
    """Moves the recorded modules' tensors to the strategy's devices.

    A module whose move fails stays pending (with the ones after it), so the
    error can be fixed and the placement retried.
    """
    while self._pending:
      module = self._pending[0]()
      if module is not None:
        for tensors in (module._parameters, module._buffers):
          for name, t in tensors.items():
            if t is None or isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
              continue
            self._place(module, name, t)
      self._pending.pop(0)

  def _place(self, module, name, t):
    placed = self._place_fn(t)
    if placed is None:  # already where it belongs
      return
    if isinstance(t, torch.nn.Parameter):
      placed = torch.nn.Parameter(placed, requires_grad=t.requires_grad)
    variables.carry_policy(t, placed)  # swap_tensors swaps the objects' __dict__
    try:
      torch.utils.swap_tensors(t, placed)
    except RuntimeError as e:
      raise RuntimeError(
          f"xladist could not move {type(module).__name__}.{name} (shape "
          f"{tuple(t.shape)}) to the strategy's devices: another reference to "
          "the tensor is alive (a view such as `w = model.weight[0]`, or a "
          "tensor kept from running the module inside the scope). Drop such "
          "references before the scope is left; the move is retried then and "
          f"before each strategy.run. (torch: {e})") from None

  def tracks(self, tensor):
    """True when `tensor` is a parameter or buffer of a module this store tracks."""
    return any(t is tensor for m in self.modules()
               for t in list(m._parameters.values()) + list(m._buffers.values()))

  def modules(self):
    for ref in self._modules:
      m = ref()
      if m is not None:
        yield m

  def optimizers(self):
    for ref in self._optimizers:
      o = ref()
      if o is not None:
        yield o

  # -- entering and leaving a step --------------------------------------------
  def variables(self):
    """Every tracked XLA tensor: module parameters and buffers."""
    for module in self.modules():
      for t in module._parameters.values():
        if t is not None and t.device.type == "xla":
          yield t
      for t in module._buffers.values():
        if t is not None and t.device.type == "xla":
          yield t

  @staticmethod
  def optimizer_state_slots(optimizer):
    for state in optimizer.state.values():
      for key, v in state.items():
        if isinstance(v, torch.Tensor) and v.device.type == "xla":
          yield state, key, v

  def enter(self, step):
    """Swaps every variable (and its grad) and optimizer state for its local view.

    `step` (a `Step`) records what was swapped and the IR identity of each
    local view, so that `exit` converts back only what the step wrote.
    """
    to_local, uid = _runtime.to_local, _runtime.ir_id
    for t in self.variables():
      data, grad = t.data, t.grad
      policy = variables.policy_of(t)
      local = to_local(_runtime.ensure_sharded(data))
      if policy.on_read and policy.aggregation is variables.VariableAggregation.SUM:
        # Replica 0 holds the total, the others start from 0: the sum read
        # back is exact.
        local = torch.where(step.region.replica_id == 0, local, torch.zeros_like(local))
      t.data = local
      step.variables.append((t, data, grad, policy, uid(t)))
      if grad is not None:
        t.grad = to_local(_runtime.ensure_sharded(grad))
    for optimizer in self.optimizers():
      self.enter_optimizer(optimizer, step)

  def enter_optimizer(self, optimizer, step):
    snapshot = {p: dict(state) for p, state in optimizer.state.items()}
    step.optimizers.append((optimizer, snapshot))
    for state, key, v in list(self.optimizer_state_slots(optimizer)):
      state[key] = _runtime.to_local(_runtime.ensure_sharded(v))

  @staticmethod
  def exit(step, to_global):
    """Swaps the local views back for global ones.

    A variable the step did not write gets its global tensor back untouched
    (its local view then is not part of the program). A written mirrored
    variable leaves the region as is; written sync-on-read variables are
    combined with their aggregation in one packed all-reduce per kind.
    Gradients that an optimizer stepped in this step are released (as
    `zero_grad(set_to_none=True)` would); others (accumulated by a step that
    did not call `optimizer.step()`) are kept.
    """
    uid = _runtime.ir_id
    stepped = step.stepped
    on_read = {}
    for t, data, _, policy, local_id in step.variables:
      if uid(t) == local_id:
        t.data = data
      elif policy.on_read:
        on_read.setdefault(policy.aggregation, []).append(t)
      else:
        t.data = to_global(t.data)
      if t.grad is not None:
        t.grad = None if id(t) in stepped else to_global(t.grad)
    for aggregation, tensors in on_read.items():
      combined = _aggregate(step.region, aggregation, [t.data for t in tensors])
      for t, value in zip(tensors, combined):
        t.data = to_global(value)
    for optimizer, snapshot in step.optimizers:
      for state, key, v in list(VariableStore.optimizer_state_slots(optimizer)):
        state[key] = to_global(v)

  @staticmethod
  def restore(step):
    """Puts back the global tensors saved by `enter` (after a failed trace)."""
    for t, data, grad, _, _ in step.variables:
      t.data = data
      t.grad = grad
    for optimizer, snapshot in step.optimizers:
      optimizer.state.clear()
      optimizer.state.update(snapshot)


def _aggregate(region, aggregation, tensors):
  """Combines the replicas' copies of sync-on-read variables (one all-reduce per dtype)."""
  agg = variables.VariableAggregation
  if aggregation in (agg.NONE, agg.ONLY_FIRST_REPLICA):
    first = region.replica_id == 0
    tensors = [torch.where(first, t, torch.zeros_like(t)) for t in tensors]
    return collectives.all_reduce(ReduceOp.SUM, tensors, region.num_replicas)
  return collectives.all_reduce(ReduceOp[aggregation.name], tensors, region.num_replicas)


class Step:
  """What one `run` swapped into its region."""

  __slots__ = ("region", "variables", "optimizers", "stepped", "variable_ids")

  def __init__(self, region):
    self.region = region
    self.variables = []   # (tensor, global data, global grad, policy, local IR id)
    self.optimizers = []  # (optimizer, state snapshot)
    self.stepped = set()  # ids of parameters an optimizer stepped
    self.variable_ids = None

  def is_variable(self, tensor):
    if self.variable_ids is None:
      self.variable_ids = {id(t) for t, *_ in self.variables}
    return id(tensor) in self.variable_ids
