"""CentralStorageStrategy: one copy of every variable in host memory, compute mirrored.

TF's CentralStorageStrategy keeps each variable once, on the CPU, replicates
the computation over the local devices and applies the updates to that one
copy. On XLA this is the "offload" layout: parameters, buffers and optimizer
state live in host memory between steps, and each `run`

1. sends the variables to the replicas (one transfer, replicated),
2. traces the step exactly as MirroredStrategy does (one SPMD program; the
   gradients are reduced across replicas inside it),
3. brings back what the step changed and the reduced gradients (one sync),
   so every device buffer of the variables is released, and
4. runs the optimizer on the host, on the one copy.

So device memory holds only what a step needs while it runs; optimizer state
never reaches the device. The cost is a host round trip per step (the graph
is cut at every `run`) and the optimizer's arithmetic on the CPU.

Sync-on-read state (BatchNorm statistics, `tower_local_var_scope`) keeps its
per-replica components on the host too, so training gives the same numbers as
MirroredStrategy.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from xladist import context
from xladist import runtime as _runtime
from xladist import variable_policy as policies
from xladist._nest import flatten
from xladist._step.engine import StepEngine
from xladist.communication_options import CommunicationOptions
from xladist.extended import _variable_tensor
from xladist.replica_copies import ReplicaCopies, aggregate_host, copies_of, spread
from xladist.strategies.mirrored import SPMDExtended, _check_devices
from xladist.strategy import Strategy
from xladist.variable_store import VariableStore

VA = policies.VariableAggregation
_HOST = "_xladist_host_replicas"  # a sync-on-read variable's components on the host


class _HostReplicas:
  """The (num_replicas, ...) components of a sync-on-read variable between steps.

  `stamp` is the attribute's write stamp when the components were stored: a
  write to the attribute on the host since then (load_state_dict, an
  assignment) is a cross-replica assignment, spread over the components by
  TF's rule at the next step.
  """

  __slots__ = ("stacked", "aggregation", "stamp")

  def __init__(self, stacked, aggregation, stamp):
    self.stacked = stacked
    self.aggregation = aggregation
    self.stamp = stamp


def _host_stamp(t):
  return (t._version, t.data_ptr())


class _CentralStorageEngine(StepEngine):
  """The step engine with central storage's work around each traced step:
  gradients no optimizer consumed are reduced at the end of the step, and
  optimizer.step() only reduces the gradients (the update runs on the host
  after the program, `CentralStorageExtended._to_host`)."""

  def replay_gap(self):
    return (
      "CentralStorageStrategy runs the optimizer on the host after each step's program "
      "(its variables live in host memory), so a step is a program and host work, and "
      "replay runs programs only"
    )

  def trace(self, fn, args, kwargs, region, made):
    ext = self._ext
    self._guard = _ReadAfterUpdate(ext, region.step)

    def step(*a, **k):
      try:
        out = fn(*a, **k)
      finally:
        self._guard.stop()
      self._guard.check_outputs(out)
      ext._reduce_leftover_gradients(region)
      return out

    try:
      out = super().trace(step, args, kwargs, region, made)
    finally:
      self._guard = None  # it refers to the step's tensors, which must not outlive it
    # The reduced gradients leave the region as replicated global tensors
    # before the step's local tensors are invalidated.
    ext._updates = [
      (optimizer, [(p, region.global_replicated(g)) for p, g in pairs])
      for optimizer, pairs in ext._updates
    ]
    return out

  def before_optimizer_step(self, ctx, optimizer):
    """optimizer.step() in a replica context: reduce the gradients across
    replicas (as MirroredStrategy) and keep them for the host update; the
    optimizer sees no gradient inside the step, so it changes nothing there.
    From here to the end of the step function, a read of the updated
    parameters is refused (`_ReadAfterUpdate`)."""
    step = self.region.step
    with self._guard.paused():
      params = self._optimizer_params(
        optimizer, "its parameters live in the strategy's central storage"
      )
      self.aggregate_gradients(ctx, params, "optimizer.step()")
      grads = [p.grad for p in params]
      step.stepped.update(id(p) for p in params)
      self._ext._updates.append((optimizer, list(zip(params, grads))))
      self._ext._store.track_optimizer(optimizer)  # its state is the strategy's
      for p in params:
        p.grad = None
    self._guard.start()

  def after_optimizer_step(self, optimizer):
    return None


# What a torch function may do with an updated parameter: attributes (t.grad,
# t.shape) and metadata, which read no value.
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__hash__}


class _ReadAfterUpdate(TorchFunctionMode):
  """Refuses reads of parameters updated by `optimizer.step()` earlier in the
  same step function: the update runs on the host after the step's program,
  so inside the step such a read would see the value before the update
  (MirroredStrategy's step sees the new one). Active from the first
  optimizer.step() of a step to the end of the step function."""

  def __init__(self, ext, step):
    super().__init__()
    self._ext = ext
    self._step = step
    self._active = False
    self._entered = False

  def start(self):
    if not self._entered:
      self.__enter__()
      self._entered = True
    self._active = True

  def stop(self):
    self._active = False
    if self._entered:
      self._entered = False
      self.__exit__(None, None, None)

  @contextlib.contextmanager
  def paused(self):
    active, self._active = self._active, False
    try:
      yield
    finally:
      self._active = active

  def __torch_function__(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if self._active and func not in _METADATA:
      if getattr(func, "__name__", None) not in ("__get__", "__set__"):
        for leaf in flatten((args, kwargs))[0]:
          if isinstance(leaf, torch.Tensor) and id(leaf) in self._step.stepped:
            raise self._error(leaf, f"{getattr(func, '__name__', func)}(...) reads")
    return func(*args, **kwargs)

  def check_outputs(self, out):
    for leaf in flatten(out)[0]:
      if isinstance(leaf, torch.Tensor) and id(leaf) in self._step.stepped:
        raise self._error(leaf, "the step function returns")

  def _error(self, tensor, what):
    name = next(
      (
        n
        for m in self._ext._store.modules()
        for n, p in m.named_parameters(remove_duplicate=False)
        if p is tensor
      ),
      f"of shape {tuple(tensor.shape)}",
    )
    return RuntimeError(
      f"CentralStorageStrategy: {what} the parameter {name} after optimizer.step() "
      "updated it in the same strategy.run. The update runs on the host after the "
      "step's program, so inside the step the parameter still holds its value "
      "before the update (MirroredStrategy's would hold the new one). Read it in "
      "the next strategy.run or after run returns, or compute what needs it before "
      "optimizer.step()."
    )


class CentralStorageExtended(SPMDExtended):
  """SPMDExtended whose variables and optimizer state stay on the host between steps."""

  _mirrors_variables = False  # one copy of each variable (TF: not a MirroredVariable)
  _engine_class = _CentralStorageEngine

  def __init__(self, strategy, communication_options=None):
    super().__init__(strategy, None, communication_options)
    self._store = VariableStore(self._place_on_host, self._num_replicas_in_sync)
    self._updates = []  # (optimizer, [(param, reduced local gradient)]) of the running step

  # -- TF's device facts -----------------------------------------------------------
  @property
  def parameter_devices(self):
    """Where the variables live: the host ("cpu"), once."""
    return ("cpu",)

  def non_slot_devices(self, var_list):
    return self.parameter_devices

  # -- placement: variables stay on the host -----------------------------------------
  def _place_on_host(self, tensor):
    n = self._num_replicas_in_sync
    placed = None
    if tensor.device.type != "cpu":
      placed = tensor.detach().cpu()
      policies.carry_policy(tensor, placed)
    target = tensor if placed is None else placed
    policy = policies.policy_of(tensor)
    if n > 1 and policy.on_read and getattr(tensor, _HOST, None) is None:
      # Every replica starts from the value (as MirroredStrategy's components).
      stacked = target.detach().unsqueeze(0).expand((n,) + tuple(target.shape)).clone()
      if policy.aggregation is VA.SUM:
        with torch.no_grad():
          target.mul_(n)
      setattr(target, _HOST, _HostReplicas(stacked, policy.aggregation, _host_stamp(target)))
    return placed

  def _variable_components(self, tensor):
    """TF's local results of a variable: the one copy, or a sync-on-read
    variable's per-replica components (host tensors)."""
    host = getattr(tensor, _HOST, None)
    if host is not None and tensor.device.type == "cpu":
      self._refresh_host_components(tensor, host)
      return tuple(host.stacked.unbind(0))
    return (tensor,)

  def _refresh_host_components(self, t, host):
    """Spreads a host write of the attribute over the components (TF's rule)."""
    if _host_stamp(t) != host.stamp:
      host.stacked = spread(t.detach(), host.aggregation, self._num_replicas_in_sync).clone()
      host.stamp = _host_stamp(t)

  # -- run ---------------------------------------------------------------------------------
  def _call_for_each_replica(self, fn, args, kwargs, options=None):
    if self._region is not None:
      return super()._call_for_each_replica(fn, args, kwargs)
    self._store.place_pending()
    twins = self._to_devices()
    self._updates = []
    try:
      out = super()._call_for_each_replica(fn, args, kwargs, options)
    except BaseException:
      self._updates = []
      self._back_unchanged(twins)
      raise
    updates, self._updates = self._updates, []
    self._to_host(twins, updates)
    return out

  def _to_devices(self):
    """Swaps every variable for a replicated copy on the devices (one transfer).

    Returns:
      id(variable) -> (variable, twin, IR id of the copy): after the swap the
      twin object holds the host tensor (swap_tensors keeps each Parameter's
      identity, so optimizers and user references stay valid).
    """
    n = self._num_replicas_in_sync
    variables = [t for t in self._host_variables()]
    values = []
    for t in variables:
      values.append(t.detach())
      if t.grad is not None:
        aggregation = self.experimental_gradient_aggregation
        g = t.grad.detach()
        # A gradient left by an earlier run is the reduced value; spread it so
        # that the next reduction counts it once (TF's rule for SUM).
        values.append(g / n if aggregation is not None and aggregation.name == "SUM" else g)
    placed = iter(_replicate_many(values)) if values else iter(())
    twins = {}
    for t in variables:
      x = next(placed)
      grad = next(placed) if t.grad is not None else None
      if isinstance(t, torch.nn.Parameter):
        x = torch.nn.Parameter(x, requires_grad=t.requires_grad)
      attrs = dict(t.__dict__)
      t.grad = None
      torch.utils.swap_tensors(t, x)  # t: the device copy; x: the host tensor
      t.__dict__.clear()
      t.__dict__.update(attrs)
      if grad is not None:
        t.grad = grad
      host = attrs.get(_HOST)
      if host is not None:
        self._refresh_host_components(x, host)
        ReplicaCopies(host.stacked, n, host.aggregation).copy_to(t)
      twins[id(t)] = (t, x, _runtime.value_id(t))
    return twins

  def _host_variables(self):
    return (t for t in self._store.tensors() if t.device.type == "cpu")

  def _back_unchanged(self, twins):
    """A failed step: every variable gets its host tensor back (nothing changed)."""
    for t, x, _ in twins.values():
      attrs = {k: v for k, v in t.__dict__.items() if k != "_xladist_replicas"}
      t.grad = None
      torch.utils.swap_tensors(t, x)
      t.__dict__.clear()
      t.__dict__.update(attrs)

  def _reduce_leftover_gradients(self, region):
    """Gradients no optimizer consumed (accumulation over several runs) are
    reduced to the one copy at the end of the step, with the strategy's
    gradient aggregation; the next run spreads them back (see _to_devices)."""
    op = self.experimental_gradient_aggregation
    step = region.step
    params = [t for t, *_ in step.variables if t.grad is not None and id(t) not in step.stepped]
    if op is None or not params or region.num_replicas == 1:
      return
    reduced = context.get_replica_context().all_reduce(op, [p.grad for p in params])
    for p, g in zip(params, reduced):
      p.grad = g

  def _to_host(self, twins, updates):
    """Brings back what the step wrote, the reduced gradients and the
    sync-on-read components (one sync, one batch of transfers); swaps the host
    tensors back in; runs the optimizers on the host."""
    fetch, apply = [], []
    for t in list(self._store.variables()):
      entry = twins.get(id(t))
      if entry is None:  # made inside the step
        x = torch.empty(0, dtype=t.dtype)
        if isinstance(t, torch.nn.Parameter):
          x = torch.nn.Parameter(x, requires_grad=t.requires_grad)
        written = True
      else:
        _, x, ir = entry
        written = _runtime.value_id(t) != ir
      copies = copies_of(t)
      stacked = copies.stacked if copies is not None and written else None
      slots = [t.detach() if written else None, t.grad, stacked]
      apply.append((t, x, [s is not None for s in slots]))
      fetch.extend(s for s in slots if s is not None)
    grads = [g for _, pairs in updates for _, g in pairs]
    _runtime.sync()
    values = iter(_runtime.to_host(fetch + grads)) if fetch or grads else None
    for t, x, present in apply:
      value, grad, stacked = (next(values) if p else None for p in present)
      attrs = {k: v for k, v in t.__dict__.items() if k != "_xladist_replicas"}
      t.grad = None
      torch.utils.swap_tensors(t, x)  # t: the host tensor again
      t.__dict__.clear()
      t.__dict__.update(attrs)
      if value is not None:
        with torch.no_grad():
          t.data = value
      t.grad = grad
      if stacked is not None:
        setattr(t, _HOST, _HostReplicas(stacked, policies.policy_of(t).aggregation, None))
        getattr(t, _HOST).stamp = _host_stamp(t)
    # The host step: each optimizer on the one copy, with the reduced gradients.
    for optimizer, pairs in updates:
      host_grads = [next(values) for _ in pairs]
      params = [p for p, _ in pairs]
      kept = {id(p): p.grad for group in optimizer.param_groups for p in group["params"]}
      for group in optimizer.param_groups:
        for p in group["params"]:
          p.grad = None
      for p, g in zip(params, host_grads):
        p.grad = g
      optimizer.step()  # run's optimizer hooks are gone: a plain host step
      stepped = {id(p) for p in params}
      for group in optimizer.param_groups:
        for p in group["params"]:
          p.grad = None if id(p) in stepped else kept[id(p)]

  def read_var(self, var):
    """The value of `var` in cross-replica context (a host tensor): the one
    copy, or a sync-on-read variable's aggregate."""
    value = _variable_tensor(var)
    host = getattr(value, _HOST, None)
    if host is not None:
      self._refresh_host_components(value, host)
      return aggregate_host(host.stacked, host.aggregation).clone()
    return super().read_var(var)


_replicate_many = _runtime.place_replicated


class CentralStorageStrategy(Strategy):
  """Variables in host memory, computation mirrored over the local XLA devices.

  TF's `tf.distribute.experimental.CentralStorageStrategy`: one copy of each
  variable (here in host memory), every local device a replica, synchronous
  training. The API is MirroredStrategy's (run, reduce, gather, distributed
  datasets, checkpoints, sync-on-read state); what differs is where state
  lives. Each `run` sends the variables to the devices, runs the step as one
  SPMD program whose all-reduces combine the gradients, brings the changed
  values and the reduced gradients back, and runs `optimizer.step()` on the
  host. Between steps the devices hold no parameter, gradient or optimizer
  state.

  Example::

    strategy = xd.experimental.CentralStorageStrategy()
    with strategy.scope():
      model = Net()
      optimizer = torch.optim.Adam(model.parameters())   # its state stays on the host
    strategy.extended.parameter_devices   # ('cpu',)

  Differences from MirroredStrategy that a step can see: `optimizer.step()`
  inside `run` updates the variables after the step's program has run (on the
  host), so inside the step the parameters still hold their old values: a
  read of a parameter after `optimizer.step()` updated it, later in the same
  step function (a second forward, a metric, returning it), raises a
  RuntimeError saying so, instead of giving the old value; read it in the
  next `run` or after `run` returns. Each `run` cuts the graph (the host
  update needs the gradients), so `experimental_run_steps` gives one
  execution per step.

  Args:
    compute_devices: None (all local XLA devices) or the list of every local
      XLA device (as MirroredStrategy's `devices`).
    parameter_device: None or "cpu": where the variables live. xladist keeps
      them in host memory; for variables on the devices use MirroredStrategy.
    communication_options: an `experimental.CommunicationOptions` for the
      reductions (as MirroredStrategy's).

  Raises:
    ValueError: `compute_devices` is not the list of all local XLA devices,
      or `parameter_device` is not the host.
    TypeError: `communication_options` is not a CommunicationOptions.
  """

  def __init__(self, compute_devices=None, parameter_device=None, communication_options=None):
    _runtime.initialize()
    _runtime.require("CentralStorageStrategy")
    _check_devices(compute_devices, "CentralStorageStrategy")
    if parameter_device is not None:
      try:
        kind = torch.device(parameter_device).type
      except (RuntimeError, TypeError):
        kind = None
      if kind != "cpu":
        raise ValueError(
          f"CentralStorageStrategy(parameter_device={parameter_device!r}): xladist "
          "keeps the central copy of the variables in host memory; pass None or "
          "'cpu'. For variables held on the XLA devices use MirroredStrategy."
        )
    if communication_options is not None and not isinstance(
      communication_options, CommunicationOptions
    ):
      raise TypeError(
        "CentralStorageStrategy(communication_options=...): expected an "
        "xladist.experimental.CommunicationOptions or None, got "
        f"{type(communication_options).__name__}."
      )
    super().__init__(CentralStorageExtended(self, communication_options))
