"""The tensors a traced step makes, and what happens to those that outlive it.

Inside `strategy.run` every tensor is one replica's local view in a manual
region. torch_xla 2.9 aborts the process (`hlo_sharding.cc: Check failed:
!IsManual()`) when such a tensor is computed outside its region: when it is
read after the step, and at the next `torch_xla.sync()`, which computes every
live tensor with pending work. So no replica-local tensor may outlive the
step: what `fn` returns leaves the region as a PerReplica, variables and
optimizer state leave with the store, and any other tensor the step made that
is still referenced afterwards (appended to a list, kept in a closure or an
exception, stored on a module) is replaced in place by a `ReplicaLocalTensor`,
which raises a clear error when used.

`StepTensors` is a TorchFunctionMode active while `fn` is traced; it records
each tensor a torch function returns (not the in-place ones, which return an
argument). After the step the recorded tensors that something else still
references are swapped (`torch.utils.swap_tensors`) with placeholders.

It also finds the step's in-place writes to tensors that are not the
strategy's variables and were made before the step (an EMA helper's shadow
copies; a counter made with `torch.zeros(..., device=...)`): such a tensor is
entered like a mirrored variable before its first write (`Region.
enter_outside`) and leaves the step replicated, as written. A host tensor
written with the step's device values is first moved to the device (in place,
as the scope moves module state; a shadow copy cloned from a parameter under
`strategy.scope()`, before placement, is one). What every replica writes must
be the same value: the tensors whose values differ between replicas are
followed through the step (`Region.varying`: the replicas' rows of PerReplica
arguments, the replica id, random draws, gradients before their aggregation,
sync-on-read variables, and whatever is computed from them; an all-reduce's
result is the same everywhere), and a write of such a value to one of those
tensors raises an error that says what to make instead.
"""

import sys

import torch
from torch.overrides import TorchFunctionMode

from xladist import context
from xladist import runtime as _runtime
from xladist._step import seeds as _step_random

# Tensor methods that read a value on the host. Inside a step they raise before
# torch_xla tries to execute: a refused execution leaves every tensor it was
# computing without data ("Check failed: tensor_data" at the next use).
_HOST_READS = {
  torch.Tensor.__repr__,
  torch.Tensor.__format__,
  torch.Tensor.tolist,
  torch.Tensor.item,
  torch.Tensor.numpy,
  torch.Tensor.__bool__,
  torch.Tensor.__int__,
  torch.Tensor.__float__,
  torch.Tensor.__index__,
  torch.Tensor.__complex__,
  torch.Tensor.__array__,
  torch.Tensor.cpu,
  torch.Tensor.data_ptr,
  torch.Tensor.__contains__,
}


# What a torch function is, for StepTensors (looked up once per function).
_HOST_READ, _TO, _ATTRIBUTE, _DRAW, _WRITE, _BACKWARD, _OTHER = (
  "host read",
  "Tensor.to",
  "attribute access",
  "random draw",
  "in-place write",
  "backward",
  "other",
)
_KINDS = {}  # function -> its kind
_MAX_KINDS = 4096
_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor of `t.data`


def _writes_first(func):
  """True for a function that writes its first argument in place (a tensor, or
  the list of tensors of a `torch._foreach_*_` op): `add_`, `copy_`,
  `t[i] = v`, `t += v`, `torch.ops.aten.add_.Tensor`."""
  name = getattr(func, "__name__", "")
  if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
    return True
  schema = getattr(func, "_schema", None)  # an OpOverload
  if schema is not None and schema.arguments:
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write
  return False


def _kind(func):
  if func in _HOST_READS:
    kind = _HOST_READ
  elif func is torch.Tensor.to:
    kind = _TO
  elif getattr(func, "__name__", None) in ("__get__", "__set__"):
    kind = _ATTRIBUTE  # reading or setting an attribute (t.grad, t.data)
  elif func in _step_random.DRAWS:
    kind = _DRAW
  elif func is torch.Tensor.backward or func is torch.autograd.backward:
    kind = _BACKWARD
  elif _writes_first(func):
    kind = _WRITE
  else:
    kind = _OTHER
  try:
    if len(_KINDS) < _MAX_KINDS:
      _KINDS[func] = kind
  except TypeError:
    pass
  return kind


class ReplicaLocalTensor(torch.Tensor):
  """What a replica-local tensor that outlived its step becomes: any use raises."""

  _xladist_origin = "the step function"

  @classmethod
  def __torch_function__(cls, func, types, args=(), kwargs=None):
    origin = next(
      (a._xladist_origin for a in args if isinstance(a, ReplicaLocalTensor)), cls._xladist_origin
    )
    raise RuntimeError(
      f"{getattr(func, '__name__', func)}: this tensor was made inside strategy.run "
      f"({origin}) and holds one replica's value; it cannot be used after the step "
      "(torch_xla would abort the process). Return it from the step function "
      "instead: strategy.run gives it back as a PerReplica (use "
      "strategy.experimental_local_results or strategy.reduce on it), or combine it "
      "inside the step with ReplicaContext.all_reduce and return the result."
    )


class StepTensors(TorchFunctionMode):
  """Watches every torch function while a step is traced.

  It records the tensors torch functions make (see the module docstring),
  turns random draws into each replica's share of one global draw
  (`_step_random`), refuses host reads before torch_xla executes anything,
  refuses parameters that are not the strategy's variables (a model made
  outside `strategy.scope()`, or another strategy's): their gradients would be
  replica-local tensors left in a model that outlives the step, and enters the
  tensors made before the step that the step writes (module docstring),
  following which values differ between replicas.
  """

  def __init__(self, region):
    super().__init__()
    self._made = {}  # id -> tensor, in creation order
    self._region = region
    self._varying = region.varying  # id -> tensor whose value differs between replicas
    self._several = region.num_replicas > 1

  def __enter__(self):
    # Values that differ between replicas from the start: sync-on-read
    # variables (each replica's component) and the gradients the variables
    # bring in (accumulated by earlier steps, not aggregated yet).
    step = self._region.step
    if self._several and step is not None:
      for t, _, _, policy in step.variables:
        if policy.on_read:
          self._varying[id(t)] = t
        grad = t.grad if t.is_leaf else None
        if grad is not None:
          self._varying[id(grad)] = grad
    return super().__enter__()

  def __torch_function__(self, func, types, args=(), kwargs=None):
    # Every torch call of the step comes through here (about 450 in a small
    # MLP step): what a function is (host read, random draw, attribute access)
    # is looked up once per function (`_kind`), and the per-tensor checks are
    # inlined.
    try:
      kind = _KINDS[func]
    except (KeyError, TypeError):  # first seen, or a function that cannot be a key
      kind = _kind(func)
    if kind is _HOST_READ or (kind is _TO and _to_host(args, kwargs or {})):
      if any(isinstance(a, torch.Tensor) and _runtime.is_device_tensor(a) for a in args):
        raise _runtime.HostReadInStep(_runtime.user_frame())
    if kind is _ATTRIBUTE:  # reading or setting t.grad, t.data computes nothing
      return self._attribute(func, args, kwargs or {})
    made = self._made
    varying = self._varying
    differs = False  # whether an argument's value differs between replicas
    for a in args:
      if isinstance(a, torch.Tensor):
        if a.requires_grad and a.is_leaf and id(a) not in made:
          self._check_parameter(a, func)
        if id(a) in varying:
          differs = True
      elif isinstance(a, (list, tuple)):
        for x in a:
          if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_leaf and id(x) not in made:
              self._check_parameter(x, func)
            if id(x) in varying:
              differs = True
    if kwargs:
      for v in kwargs.values():
        if isinstance(v, torch.Tensor) and id(v) in varying:
          differs = True
      out = kwargs.get("out")
    else:
      kwargs = {}
      out = None
    draw = kind is _DRAW and context.get_replica_context() is not None
    drawn = draw and self._several  # each replica's share of a global draw
    written = None
    if kind is _WRITE or out is not None or (kind is _DRAW and func.__name__.endswith("_")):
      written = self._before_write(func, kind, args, kwargs, out, differs or drawn)
    result = None
    if draw:
      result = _step_random.draw(func, args, kwargs, self._region)
      drawn = drawn and result is not None
    if result is None:
      grads = self._tainted_grads() if kind is _BACKWARD else None
      try:
        result = func(*args, **kwargs)
      except AssertionError:
        # torchax refuses host tensors (other than scalars) among device ones
        # ("mixed math"); torch_xla copies them to the device. Inside a step
        # both runtimes do the latter.
        placed = _host_operands_placed(args, kwargs)
        if placed is None:
          raise
        args, kwargs = placed
        result = func(*args, **kwargs)
      if grads is not None:
        self._after_backward(grads, differs)
    is_dev = _runtime.is_device_tensor
    if isinstance(result, torch.Tensor):
      if id(result) not in made and is_dev(result):
        self._note(result, args, kwargs)
      if differs or drawn:
        varying[id(result)] = result
    elif isinstance(result, (tuple, list)):
      for r in result:
        if isinstance(r, torch.Tensor):
          if id(r) not in made and is_dev(r):
            self._note(r, args, kwargs)
          if differs or drawn:
            varying[id(r)] = r
    if written and (differs or drawn):
      for t in written:
        varying[id(t)] = t
    return result

  # -- writes to tensors made before the step ----------------------------------------
  def _outside(self, t):
    """True for a device tensor that is not the strategy's variable, was not
    made in the step and existed before it (and so is not entered yet)."""
    region = self._region
    step = region.step
    return (
      step is not None
      and id(t) not in self._made
      and _runtime.is_device_tensor(t)
      and not step.is_variable(t)
      and region.made_before(t)
    )

  def _before_write(self, func, kind, args, kwargs, out, differs):
    """Before `func` writes its first argument (or `out=`): enters each written
    tensor made before the step; refuses a write of values that differ between
    replicas to one. Returns the written tensors."""
    targets = []
    if kind is not _OTHER and args:
      first = args[0]
      if isinstance(first, torch.Tensor):
        targets.append(first)
      elif isinstance(first, (list, tuple)):
        targets.extend(x for x in first if isinstance(x, torch.Tensor))
    if isinstance(out, torch.Tensor):
      targets.append(out)
    elif isinstance(out, (list, tuple)):
      targets.extend(x for x in out if isinstance(x, torch.Tensor))
    region = self._region
    for t in targets:
      if id(t) in region.outside:
        if differs:
          self._refuse_write(func, t)
      elif self._outside(t):
        if differs:
          self._refuse_write(func, t)
        if _view_base(t) is not None:
          self._refuse_view(func, _view_base(t), t)
        self._enter(t)
      elif _runtime.is_device_tensor(t) or t.device.type != "cpu":
        # A view (torch's, or a torchax View on the jax runtime) of a tensor
        # made before the step: entered, its writes are the tensor's; not
        # entered, the view does not see the entered value: refused.
        base = t._base if _runtime.is_device_tensor(t) else _view_base(t)
        if base is not None:
          if id(base) in region.outside:
            if differs:
              self._refuse_write(func, base)
          elif self._outside(base):
            self._refuse_view(func, base, t)
      elif self._moves(t, args, kwargs):  # a host tensor written with device values
        if differs:
          self._refuse_write(func, t)
        self._move_to_device(func, t)
    return targets

  def _enter(self, t):
    self._region.enter_outside(t)
    _not_replayed(
      self._region,
      f"writes a device tensor of shape {tuple(t.shape)} that is not a variable of the "
      "strategy (replay follows variables, optimizer state and the tensors fn names)",
    )

  @staticmethod
  def _moves(t, args, kwargs):
    """Whether a host tensor `t` written in place is written with device tensors
    (which on the host would be read there: refused inside a step)."""
    if t.dim() == 0:
      return False  # a host scalar (an optimizer's step counter) stays where it is
    is_dev = _runtime.is_device_tensor
    for a in list(args[1:]) + list(kwargs.values()):
      if isinstance(a, torch.Tensor) and is_dev(a):
        return True
      if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) and is_dev(x) for x in a):
        return True
    return False

  def _move_to_device(self, func, t):
    """Moves a host tensor made before the step to the device (replicated), in
    place, and enters it: a shadow copy cloned from a parameter under
    strategy.scope() (before placement) is a host tensor."""
    if t.requires_grad or t._is_view() or t.grad_fn is not None:
      self._refuse_write(func, t, host=True)
    placed = _runtime.place_replicated(t.detach())
    try:
      torch.utils.swap_tensors(t, placed)
    except RuntimeError:
      self._refuse_write(func, t, host=True)
    self._enter(t)

  def _refuse_view(self, func, base, view):
    raise RuntimeError(
      f"strategy.run: {getattr(func, '__name__', func)} ({_runtime.user_frame()}) "
      f"writes a view of shape {tuple(view.shape)} of a tensor of shape "
      f"{tuple(base.shape)} that was made outside the step and is not a variable of "
      f"{self._region.strategy!r}. xladist enters such a tensor into the step when "
      "the step writes the tensor itself (`t.copy_(...)`, `t.sub_(...)`, "
      "`t[i] = v`); write it that way, or make it a buffer of a module created "
      "under strategy.scope() (register_buffer), which is a variable of the strategy."
    )

  def _refuse_write(self, func, t, host=False):
    if _runtime.is_device_tensor(t):
      what = f"a device tensor of shape {tuple(t.shape)} made before the step"
    else:
      what = f"a host tensor of shape {tuple(t.shape)}"
    if host:
      why = (
        "with the step's device values; it is moved to the device for that, in "
        "place, but this one cannot be (it requires gradients, is a view, or "
        "something holds a weak reference to it)"
      )
    else:
      why = (
        "with a value that differs between replicas (computed from the replica's "
        "own inputs, gradients before their aggregation, random numbers or the "
        "replica id), but such a tensor holds one value for all replicas"
      )
    raise RuntimeError(
      f"strategy.run: {getattr(func, '__name__', func)} ({_runtime.user_frame()}) "
      f"writes {what} in place, which is not a variable of "
      f"{self._region.strategy!r}, {why}. Create it under strategy.scope() as a "
      "buffer of a module (module.register_buffer: a sync-on-read variable, each "
      "replica's value kept, read as their mean) or as an xladist.Variable with "
      "the synchronization and aggregation it needs (a running total: "
      "synchronization=ON_READ, aggregation=SUM), or combine the replicas' values "
      "before writing (ReplicaContext.all_reduce)."
    )

  # -- attributes (t.data, t.grad) ---------------------------------------------------
  def _attribute(self, func, args, kwargs):
    """`t.data` or `t.grad` read or set. Reading `.data` of a tensor made before
    the step, or setting it, enters that tensor first (`t.data` aliases it: a
    write through the alias is a write of the tensor)."""
    varying = self._varying
    data = getattr(func, "__self__", None) is _DATA and args and isinstance(args[0], torch.Tensor)
    if data:
      t = args[0]
      setting = func.__name__ == "__set__"
      value_differs = setting and len(args) > 1 and id(args[1]) in varying
      if id(t) in self._region.outside:
        if value_differs:
          self._refuse_write(func, t)
      elif self._outside(t):
        if value_differs:
          self._refuse_write(func, t)
        if _view_base(t) is not None:
          self._refuse_view(func, _view_base(t), t)
        self._enter(t)
    result = func(*args, **kwargs)
    if data:
      if setting:
        if value_differs:
          varying[id(t)] = t
      elif id(t) in varying and isinstance(result, torch.Tensor):
        varying[id(result)] = result
    if isinstance(result, torch.Tensor):
      if id(result) not in self._made and _runtime.is_device_tensor(result):
        self._note(result, args, kwargs)
    return result

  # -- gradients -----------------------------------------------------------------------
  def _tainted_grads(self):
    """Before a backward: the variables whose gradient differs between replicas."""
    step = self._region.step
    if not self._several or step is None:
      return None
    varying = self._varying
    return {
      id(t)
      for t, *_ in step.variables
      if t.is_leaf and t.grad is not None and id(t.grad) in varying
    }

  def _after_backward(self, before, differs):
    """After a backward: the gradients it made or added to differ between
    replicas when its loss does (or they did before); aggregated gradients
    (an all-reduce's result) are the same everywhere."""
    varying = self._varying
    for t, *_ in self._region.step.variables:
      if t.is_leaf:
        grad = t.grad
        if grad is not None and (differs or id(t) in before):
          varying[id(grad)] = grad

  def _check_parameter(self, t, func):
    """`t` requires gradients, is a leaf and was not made in the step: it must
    be a variable of the strategy."""
    step = self._region.step
    if step is None or step.is_variable(t):
      return
    strategy = self._region.strategy
    where = (
      f"on the {t.device.type} device"
      if not _runtime.is_device_tensor(t)
      else (
        "on the XLA device, but not made under this strategy's scope (moved by hand, "
        "copied, or made by another strategy)"
      )
    )
    raise RuntimeError(
      f"strategy.run: {getattr(func, '__name__', func)} got a "
      f"{type(t).__name__} of shape {tuple(t.shape)} that requires gradients and is "
      f"{where}; it is not a variable of {strategy!r}, so its gradients would be "
      "one replica's. Create the model under strategy.scope(), or give an existing "
      "one to the strategy: strategy.extended.experimental_adopt(model) (its "
      "parameters and buffers become mirrored variables; optimizers keep them)."
    )

  def _note(self, t, args, kwargs):
    """Records `t`, an XLA tensor not recorded yet, unless it is an argument."""
    # In-place ops and `out=` return one of their arguments: not a new tensor.
    for a in args:
      if a is t:
        return
    if kwargs:
      for v in kwargs.values():
        if v is t:
          return
    self._made[id(t)] = t

  def track(self, t):
    """Records a tensor made by xladist itself (an argument's local view)."""
    if isinstance(t, torch.Tensor) and _runtime.is_device_tensor(t):
      self._made.setdefault(id(t), t)

  def release(self, keep, fn):
    """Invalidates the recorded tensors still referenced elsewhere.

    Args:
      keep: ids of tensors that stay valid (the strategy's variables).
      fn: the step function, named in the error message of an invalidated
        tensor ("fn at file:line", formatted only when one is).
    """
    made = self._made
    self._made = {}
    self._varying.clear()  # (the region's, cleared when it closed; see Region.close)
    refs = sys.getrefcount
    origin = None
    # Newest first; each tensor leaves `made` before it is looked at.
    while made:
      key, t = made.popitem()
      # References: `t`, and getrefcount's argument.
      if key not in keep and refs(t) > 2:
        if origin is None:
          origin = describe_fn(fn)
        _invalidate(t, origin)
    t = None


def _view_base(t):
  """The tensor whose storage the view `t` writes, or None: torch's views (a
  `_base`), and the View objects of torchax (the jax runtime: a chain of
  `parent`s; a write through one replaces its root tensor's array)."""
  base = t._base
  if base is not None:
    return base
  parent = getattr(t, "parent", None)
  while isinstance(parent, torch.Tensor):
    base, parent = parent, getattr(parent, "parent", None)
  return base


def _host_operands_placed(args, kwargs):
  """(args, kwargs) with each host tensor that is not a scalar replaced by its
  replicated copy on the device; None when there is none, or no device tensor."""
  is_dev = _runtime.is_device_tensor
  found = [False, False]  # a host tensor, a device tensor

  def place(a):
    if isinstance(a, torch.Tensor):
      if is_dev(a):
        found[1] = True
      elif a.dim() > 0:
        found[0] = True
        return _runtime.place_replicated(a.detach())
    elif isinstance(a, (list, tuple)):
      return type(a)(place(x) for x in a)
    return a

  args = tuple(place(a) for a in args)
  kwargs = {k: place(v) for k, v in kwargs.items()}
  return (args, kwargs) if all(found) else None


def _not_replayed(region, why):
  """Keeps the step being traced from being captured for replay: its program's
  writes to `why`'s tensor are not mapped to a place replay writes back."""
  engine = getattr(region.strategy.extended, "_engine", None)
  effects = getattr(engine, "_effects", None)
  if effects is not None:
    effects._write(why)


def _invalidate(t, origin):
  dead = torch.Tensor._make_subclass(
    ReplicaLocalTensor,
    torch.empty(t.shape, dtype=t.dtype, device="meta"),
    t.requires_grad if t.is_leaf else False,
  )
  dead._xladist_origin = origin
  try:
    torch.utils.swap_tensors(t, dead)
  except RuntimeError:
    # Still used by an autograd graph or weakly referenced: give it a value
    # that cannot crash the next sync, and make it conspicuous.
    with torch.no_grad():
      t.data = torch.full(
        tuple(t.shape), float("nan") if t.is_floating_point() else 0, dtype=t.dtype, device=t.device
      )


def _to_host(args, kwargs):
  """True for a `Tensor.to(...)` call whose target is the host."""
  for a in tuple(args[1:]) + tuple(kwargs.values()):
    if isinstance(a, torch.Tensor):
      return a.device.type == "cpu"
    if isinstance(a, (str, torch.device)):
      try:
        return torch.device(a).type == "cpu"
      except (RuntimeError, TypeError):
        return False
  return False


def describe_fn(fn):
  code = getattr(fn, "__code__", None)
  name = getattr(fn, "__qualname__", type(fn).__name__)
  if code is None:
    return name
  return f"{name} at {code.co_filename}:{code.co_firstlineno}"
