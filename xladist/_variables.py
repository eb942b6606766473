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


_STATE = object()  # _Slot key: an optimizer's whole state


class _Slot:
  """A saved (tensor, attribute, value) to put back if a step fails while tracing."""
  __slots__ = ("owner", "key", "value")

  def __init__(self, owner, key, value):
    self.owner, self.key, self.value = owner, key, value


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

  # -- scope ----------------------------------------------------------------
  def enter_scope(self):
    self._scope_depth += 1
    if self._scope_depth == 1:
      self._hook_handles = (
          torch_module.register_module_parameter_registration_hook(self._on_register),
          torch_module.register_module_buffer_registration_hook(self._on_register),
      )

  def exit_scope(self):
    self._scope_depth -= 1
    if self._scope_depth == 0:
      for h in self._hook_handles:
        h.remove()
      self._hook_handles = None
      self.place_pending()

  def _on_register(self, module, name, tensor):
    key = id(module)
    if key not in self._module_ids:
      self._module_ids.add(key)
      ref = weakref.ref(module, lambda _, key=key: self._forget(key))
      self._modules.append(ref)
      self._pending.append(ref)
    return None

  def _forget(self, key):
    self._module_ids.discard(key)
    self._modules = [r for r in self._modules if r() is not None]

  def track_module(self, module):
    """Makes `module`'s (and its children's) state strategy variables."""
    for m in module.modules():
      self._on_register(m, None, None)
    self.place_pending()

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

  def is_variable(self, tensor):
    for module in self.modules():
      for t in module._parameters.values():
        if t is tensor:
          return True
      for t in module._buffers.values():
        if t is tensor:
          return True
    return False

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

  def enter(self, to_local, saved):
    """Swaps every variable (and its grad) and optimizer state for its local view."""
    for t in self.variables():
      saved.append(_Slot(t, "data", t.data))
      saved.append(_Slot(t, "grad", t.grad))
      t.data = to_local(t.data)
      if t.grad is not None:
        t.grad = to_local(t.grad)
    for optimizer in self.optimizers():
      self.enter_optimizer(optimizer, to_local, saved)

  def enter_optimizer(self, optimizer, to_local, saved):
    snapshot = {p: dict(state) for p, state in optimizer.state.items()}
    saved.append(_Slot(optimizer, _STATE, snapshot))
    for state, key, v in list(self.optimizer_state_slots(optimizer)):
      state[key] = to_local(v)

  def exit(self, to_global):
    for t in self.variables():
      t.data = to_global(t.data)
      if t.grad is not None:
        t.grad = to_global(t.grad)
    for optimizer in self.optimizers():
      for state, key, v in list(self.optimizer_state_slots(optimizer)):
        state[key] = to_global(v)

  @staticmethod
  def restore(saved):
    """Puts back the global tensors saved by `enter` (after a failed trace)."""
    for slot in reversed(saved):
      if slot.key is _STATE:
        slot.owner.state.clear()
        slot.owner.state.update(slot.value)
      else:
        setattr(slot.owner, slot.key, slot.value)
