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
way. What a step wrote is found by comparing each variable's IR value on exit
with the one it entered with (the step's ledger: `StepWrites`, step_writes.py),
and each written variable leaves by its policy (docs/architecture.md, "Writes"):

* mirrored (ON_WRITE), aggregation NONE: each replica keeps what it wrote (TF 2);
* mirrored with an aggregation: writes made through `Variable.assign*`, an
  update context or `optimizer.step()` are already combined; any other in-place
  write is combined on exit (MEAN: the replicas' mean, ONLY_FIRST_REPLICA:
  replica 0's) or, for SUM, refused;
* sync-on-read (ON_READ): each replica's component is kept between steps in a
  hidden (num_replicas, ...) tensor (`ReplicaCopies`, replica_copies.py); the
  module attribute holds their aggregate, which is what cross-replica code reads.
"""

import weakref

import torch
from torch.nn.modules import module as torch_module

from xladist import collectives, sharded_state
from xladist import runtime as _runtime
from xladist import variable_policy as policies
from xladist.reduce_util import ReduceOp
from xladist.replica_copies import ReplicaCopies, copies_of, count_traced_step, watch_forward

VA = policies.VariableAggregation
# Attribute of a mirrored variable of a strategy with several replicas: their
# number (TF: a MirroredVariable is a DistributedValues; see mirrored_replicas).
_MIRRORED = "_xladist_mirrored"


class _PlacementError(RuntimeError):
  """A module's tensors could not be moved to the strategy's devices."""


class VariableStore:
  """Tracks the modules and optimizers whose state belongs to one strategy."""

  def __init__(self, place_fn, num_replicas=1):
    # tensor -> a new tensor on the strategy's device(s), or None when it is
    # already there
    self._place_fn = place_fn
    self.num_replicas = num_replicas
    self._modules = []  # weakrefs, in registration order (stable graph order)
    self._module_ids = set()
    self._pending = []
    self._reported = set()  # ids of pending modules whose failed move was raised
    self._optimizers = []
    self._optimizer_ids = set()
    self._hook_handles = None
    self._scope_depth = 0
    self._overrides = []  # tower_local_var_scope policies, innermost last
    self.active_step = None  # the StepWrites of the run being traced
    self.sharding = None  # the strategy's ShardingOptions (sharded_state.py), or None

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
      if self.active_step is None:
        self.place_pending()

  def _on_register(self, module, name, tensor):
    if tensor is not None and self._overrides and not policies.has_explicit_policy(tensor):
      policies.set_policy(tensor, self._overrides[-1])
    self.adopt(module)
    if (
      self.active_step is not None
      and tensor is not None
      and getattr(module, "_is_xladist_variable", False)
    ):
      # An xladist.Variable made inside run (TF creates it once, in the
      # replica context's scope): it is complete now, so it joins the step.
      self._pending = [r for r in self._pending if r() is not module]
      self.create_in_step(module, tensor, self.active_step)
    return None

  def adopt(self, module):
    """Makes `module`'s parameters and buffers variables of this store."""
    key = id(module)
    self._reported.discard(key)  # asked for again: a failure is raised again
    if key not in self._module_ids:
      self._module_ids.add(key)
      ref = weakref.ref(module, lambda _, key=key: self._forget(key))
      self._modules.append(ref)
      self._pending.append(ref)

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

    A module whose move fails is left as it was (none of its tensors moved)
    and stays pending, so the error can be fixed and the placement retried;
    the other modules are placed all the same, so the strategy stays usable
    for everything else. A module's failure is raised once, after the others
    are placed; a retry (before each `run`) that fails again raises nothing: a
    step that uses the module then names its parameter as one that is not the
    strategy's (`experimental_adopt` of it raises again). Returns how many
    modules were placed.
    """
    failed, error, placed = [], None, 0
    while self._pending:
      ref = self._pending.pop(0)
      module = ref()
      if module is None:
        continue
      try:
        self._place_module(module)
        placed += 1
      except _PlacementError as e:
        failed.append(ref)
        if error is None and id(module) not in self._reported:
          error = e
        self._reported.add(id(module))
    self._pending = failed
    if error is not None:
      raise error
    return placed

  def place_module_of(self, tensor):
    """Places the pending module that holds `tensor` now.

    A variable made in a scope that is still open is placed when the scope is
    left; a cross-replica read before then (`fetch`, `read_var`,
    `experimental_local_results`, `Variable.value`) places its module first,
    so it reads what it will read after the scope (a sync-on-read SUM variable:
    num_replicas times its initial value). Other pending modules wait.
    """
    for i, ref in enumerate(self._pending):
      module = ref()
      if module is not None and any(
        t is tensor for t in (*module._parameters.values(), *module._buffers.values())
      ):
        self._place_module(module)
        del self._pending[i]
        return

  def _place_module(self, module):
    """Moves one module's tensors, all or none (`_PlacementError` if one cannot move)."""
    # An RNN keeps weak references to its weights (`_flat_weight_refs`), and
    # swap_tensors refuses a tensor that has one: drop them for the move and
    # rebuild them after, as RNNBase._apply does around torch's own moves.
    rnn = isinstance(module, torch.nn.RNNBase)
    if rnn:
      module._flat_weight_refs = []
    tensors = [
      (name, t)
      for kind in (module._parameters, module._buffers)
      for name, t in kind.items()
      if t is not None and not isinstance(t, torch.nn.parameter.UninitializedTensorMixin)
    ]
    moved = []  # (tensor, what it held before): swapping again puts it back
    try:
      for name, t in tensors:
        old = self._move(module, name, t)
        if old is not None:
          moved.append((t, old))
    except _PlacementError:
      for t, old in reversed(moved):
        torch.utils.swap_tensors(t, old)
      raise
    finally:
      if rnn:
        module._init_flat_weights()
    for _, t in tensors:
      self._after_move(module, t)

  def _move(self, module, name, t):
    """Swaps `t` with its placed copy; returns the copy (now holding the old
    value), or None when `t` is where it belongs."""
    layout = sharded_state.choose(t, self.sharding, self.num_replicas)
    if layout is not None and layout.params and not layout.is_rows(t):
      placed = sharded_state.place_rows(t, layout)
    else:
      placed = self._place_fn(t)
    if layout is not None:
      sharded_state.set_layout(t, layout)  # swap_tensors takes it to the placed tensor
    if placed is None:
      return None
    if isinstance(t, torch.nn.Parameter):
      placed = torch.nn.Parameter(placed, requires_grad=t.requires_grad)
    policies.carry_policy(t, placed)  # swap_tensors swaps the objects' __dict__
    try:
      torch.utils.swap_tensors(t, placed)
    except RuntimeError as e:
      raise _PlacementError(
        f"xladist could not move {type(module).__name__}.{name} (shape "
        f"{tuple(t.shape)}) to the strategy's devices: another reference to "
        "the tensor is alive (a view such as `w = model.weight[0]`, a weak "
        "reference, or a tensor kept from running the module inside the scope). "
        f"None of {type(module).__name__}'s tensors moved, and it is not the "
        "strategy's yet; the strategy's other variables are. Drop such references: "
        "the move is retried before each strategy.run (or call "
        f"strategy.extended.experimental_adopt on the module). (torch: {e})"
      ) from None
    return placed

  def _after_move(self, module, t):
    layout = sharded_state.layout_of(t)
    if layout is not None and layout.params and isinstance(module, torch.nn.Module):
      sharded_state.watch_module(module)
    if (
      self.num_replicas > 1
      and _runtime.is_device_tensor(t)
      and policies.policy_of(t).on_read
      and copies_of(t) is None
    ):
      ReplicaCopies.create(t, self.num_replicas)
      if isinstance(module, torch.nn.Module):
        watch_forward(module)
    self._mark_mirrored(t)

  def _mark_mirrored(self, t):
    if self.num_replicas > 1 and _runtime.is_device_tensor(t) and not policies.policy_of(t).on_read:
      setattr(t, _MIRRORED, self.num_replicas)

  def tracks(self, tensor):
    """True when `tensor` is a parameter or buffer of a module this store tracks."""
    return any(
      t is tensor
      for m in self.modules()
      for t in list(m._parameters.values()) + list(m._buffers.values())
    )

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

  def describe(self, tensor):
    """'Module.name' (or the Variable's name) of a tracked tensor, for errors."""
    for m in self.modules():
      for kind in (m._parameters, m._buffers):
        for name, t in kind.items():
          if t is tensor:
            if getattr(m, "_is_xladist_variable", False):
              return repr(m)
            return f"{type(m).__name__}.{name} (shape {tuple(t.shape)})"
    return f"a tensor of shape {tuple(tensor.shape)}"

  # -- entering and leaving a step --------------------------------------------
  def tensors(self):
    """Every tracked module parameter and buffer, once.

    A tensor registered in several modules (tied weights: `head.weight =
    emb.weight`) is one variable, entered and updated once.
    """
    seen = set()
    for module in self.modules():
      for tensors in (module._parameters, module._buffers):
        for t in tensors.values():
          if t is not None and id(t) not in seen:
            seen.add(id(t))
            yield t

  def variables(self):
    """Every tracked XLA tensor, once (`tensors`)."""
    return (t for t in self.tensors() if _runtime.is_device_tensor(t))

  @staticmethod
  def optimizer_state_slots(optimizer):
    """(parameter, its state dict, key, device tensor) of each device tensor in
    the optimizer's state (host values such as step counters are not slots)."""
    for p, state in optimizer.state.items():
      for key, v in list(state.items()):
        if isinstance(v, torch.Tensor) and _runtime.is_device_tensor(v):
          yield p, state, key, v

  def enter(self, step):
    """Swaps every variable (and its grad) and optimizer state for its local view.

    `step` (a `StepWrites`) records what was swapped and the IR identity of each
    local view, so that `exit` converts back only what the step wrote.
    """
    self.active_step = step
    count_traced_step(1)
    for t in self.variables():
      self.enter_variable(t, step)
    step.sharded.gather_entered()
    for t, *_ in step.variables:
      if id(t) in step.sharded.rows:
        step.watch(t)
        kept = sharded_state.kept_grads(t)
        if kept is not None:
          t.grad = _runtime.to_local(kept).squeeze(0)
    for optimizer in self.optimizers():
      self.enter_optimizer(optimizer, step)

  def create_in_step(self, module, t, step):
    """Places a variable made inside the step and enters it.

    Every replica starts from replica 0's initial value (TF initialises the
    other components from the first).
    """
    with torch._C.DisableTorchFunction():  # xladist's own work: no user checks
      self._create_in_step(module, t, step)

  def _create_in_step(self, module, t, step):
    region = step.region
    if _runtime.is_device_tensor(t):  # a value traced in the step: replica 0's
      local = collectives.all_reduce(
        ReduceOp.SUM,
        [torch.where(region.replica_id == 0, t.detach(), torch.zeros_like(t))],
        region.num_replicas,
      )[0]
    else:
      placed = _runtime.place_replicated(t)
      if isinstance(t, torch.nn.Parameter):
        placed = torch.nn.Parameter(placed, requires_grad=t.requires_grad)
      policies.carry_policy(t, placed)
      torch.utils.swap_tensors(t, placed)
      local = _runtime.to_local(t.data)
    if self.num_replicas > 1 and policies.policy_of(t).on_read:
      watch_forward(module)
    step.created.add(id(t))
    self._mark_mirrored(t)
    self.enter_variable(t, step, local=local)
    if step.is_aggregated(t):
      # Its initial value is the same on every replica: a creation, not an
      # in-place write to combine on exit (mirrored_variable_test.py
      # testAssignMirroredVarReplicaContextWithSum creates one with SUM in
      # call_for_each_replica).
      step.sanction([t])

  def enter_variable(self, t, step, local=None):
    """Swaps one variable for its local view (`local`: a value made in the step)."""
    data, grad = t.data, t.grad
    policy = policies.policy_of(t)
    layout = sharded_state.layout_of(t)
    if local is None and layout is not None and layout.params:
      # Kept as rows: this replica's row now, the full value once every
      # sharded parameter is entered (gathers per pack, `enter`).
      t.grad = None
      step.sharded.enter(t, _runtime.to_local(_runtime.ensure_sharded(data)), layout)
      t.data = step.sharded.rows[id(t)]
      step.variables.append((t, data, grad, policy))
      return
    if local is None:
      copies = copies_of(t)
      if copies is not None:
        local = _runtime.to_local(copies.current(t, self.describe)).squeeze(0)
      else:
        local = _runtime.to_local(_runtime.ensure_sharded(data))
    t.data = local
    step.variables.append((t, data, grad, policy))
    step.watch(t)
    if policy.aggregation is not VA.NONE and not policy.on_read:
      step.aggregated.append(t)
    if grad is not None:
      t.grad = _runtime.to_local(_runtime.ensure_sharded(grad))

  def enter_optimizer(self, optimizer, step):
    snapshot = {p: dict(state) for p, state in optimizer.state.items()}
    step.optimizers.append((optimizer, snapshot))
    if self.sharding is not None:
      sharded_state.watch_optimizer(optimizer)
    for p, state, key, v in list(self.optimizer_state_slots(optimizer)):
      local = _runtime.to_local(_runtime.ensure_sharded(v))
      layout = sharded_state.state_layout(p, v)
      state[key] = local if layout is None else layout.local_row(local, step.region.replica_id)

  def exit(self, step, to_global):
    """Swaps the local views back for global ones.

    A variable the step did not write gets its global tensor back untouched
    (its local view then is not part of the program). Written variables leave
    by their policy (module docstring); written sync-on-read variables are
    combined with their aggregation in one packed all-reduce per kind.
    Gradients that an optimizer stepped in this step are released (as
    `zero_grad(set_to_none=True)` would); others (accumulated by a step that
    did not call `optimizer.step()`) are kept.

    Raises:
      RuntimeError: a SUM-aggregated mirrored variable was written in place
        other than through `Variable.assign*` (the replicas' writes cannot be
        summed: it is unknown whether they were assignments or increments).
    """
    region, stepped = step.region, step.stepped
    n = region.num_replicas
    combine = {}  # (aggregation, on_read) -> [tensor]
    for t, data, _, policy in step.variables:
      layout = sharded_state.layout_of(t)
      if layout is not None and layout.params:
        grad = t.grad
        t.grad = None
        t.data = step.sharded.exit_value(t, data, layout)
        sharded_state.keep_grads(t, None if id(t) in stepped or grad is None else grad, n)
        continue
      if not step.written(t):
        t.data = data
      elif policy.on_read and n > 1:
        combine.setdefault((policy.aggregation, True), []).append(t)
      elif policy.on_read or policy.aggregation is VA.NONE or step.sanctioned(t):
        t.data = to_global(t.data)
      elif policy.aggregation is VA.SUM:
        raise RuntimeError(
          f"strategy.run: {self.describe(t)} is a mirrored variable with "
          "aggregation SUM and was written in place inside the step (copy_, "
          "add_, fill_, an index assignment, `.data =`, ...), not through "
          "Variable.assign / assign_add / assign_sub. The replicas' writes cannot "
          "be summed without knowing whether they set or incremented the value. "
          "Write it with v.assign(...) / v.assign_add(...) inside the step, or in "
          "cross-replica context (merge_call, strategy.extended.update)."
        )
      else:  # MEAN / ONLY_FIRST_REPLICA of the replicas' written values
        combine.setdefault((policy.aggregation, False), []).append(t)
      if t.grad is not None:
        t.grad = None if id(t) in stepped else to_global(t.grad)
    for (aggregation, on_read), tensors in combine.items():
      locals_ = [t.data for t in tensors]
      combined = _aggregate(region, aggregation, locals_)
      for t, local, value in zip(tensors, locals_, combined):
        t.data = to_global(value)
        if on_read:
          stacked = _runtime.to_global(
            local.unsqueeze(0),
            _runtime.sharding(local.dim() + 1, n),
            torch.Size((n,) + tuple(local.shape)),
          )
          copies = copies_of(t)
          if copies is None:  # made inside this step
            copies = ReplicaCopies(stacked, n, aggregation).attach(t)
          copies.stacked = stacked
    for t, _, _, _ in step.variables:
      copies = copies_of(t)
      if copies is not None:
        copies.restamp(t)
    for optimizer, _ in step.optimizers:
      for p, state, key, v in list(VariableStore.optimizer_state_slots(optimizer)):
        layout = sharded_state.state_layout(p, v)
        state[key] = to_global(v) if layout is None else sharded_state.to_global_rows(v, layout)
    self.active_step = None
    count_traced_step(-1)

  def restore(self, step):
    """Puts back the global tensors saved by `enter` (after a failed trace)."""
    for t, data, grad, _ in step.variables:
      if sharded_state.layout_of(t) is not None:
        t.grad = None  # a gradient's shape may be the full one while data is rows
      if id(t) in step.created:
        # Made inside the failed step: it has no value outside it.
        data = _runtime.place_replicated(torch.zeros(t.shape, dtype=t.dtype))
      t.data = data
      t.grad = grad
      copies = copies_of(t)
      if copies is not None:
        copies.restamp(t)
    for optimizer, snapshot in step.optimizers:
      optimizer.state.clear()
      optimizer.state.update(snapshot)
    if self.active_step is step:
      self.active_step = None
      count_traced_step(-1)


def _aggregate(region, aggregation, tensors):
  """Combines the replicas' copies (one all-reduce per dtype)."""
  if aggregation in (VA.NONE, VA.ONLY_FIRST_REPLICA):
    first = region.replica_id == 0
    tensors = [torch.where(first, t, torch.zeros_like(t)) for t in tensors]
    return collectives.all_reduce(ReduceOp.SUM, tensors, region.num_replicas)
  return collectives.all_reduce(ReduceOp[aggregation.name], tensors, region.num_replicas)


def mirrored_replicas(t):
  """How many replicas a mirrored variable of a strategy with several replicas
  has a copy on, else None."""
  return getattr(t, _MIRRORED, None)


def cross_replica_read(t, step):
  """A variable of the step being traced, read in cross-replica context there
  (in merge_fn): a sync-on-read variable's components combined by its
  aggregation on every replica (TF: SyncOnReadVariable._get_cross_replica);
  a mirrored variable is its replica's copy."""
  policy = policies.policy_of(t)
  if not policy.on_read or step.region.num_replicas == 1:
    return t
  return _aggregate(step.region, policy.aggregation, [t.detach()])[0]
