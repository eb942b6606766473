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

It also refuses an in-place write to a device tensor made before the step that
is not one of the strategy's variables (an EMA helper's shadow copy cloned from
a placed parameter, directly or through a view): no replica's copy could leave
the step (torch_xla 2.9 aborted the process at the next sync).
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
_HOST_READ, _TO, _ATTRIBUTE, _DRAW, _WRITE, _OTHER = (
  "host read",
  "Tensor.to",
  "attribute access",
  "random draw",
  "in-place write",
  "other",
)
_KINDS = {}  # function -> its kind
_MAX_KINDS = 4096


def _view_base(t):
  """The tensor `t` is a view of (torch's `_base`; a torchax View's parent), or None."""
  base = t._base
  if base is None:
    parent = getattr(t, "parent", None)  # torchax's View (the jax runtime's slices)
    base = parent if isinstance(parent, torch.Tensor) else None
  return base


def _writes_first(func):
  """True for a function that writes its first argument in place (a tensor, or
  the tensors of a `torch._foreach_*_` op): `add_`, `copy_`, `t[i] = v`."""
  name = getattr(func, "__name__", "")
  if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
    return name != "requires_grad_"
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
  _xladist_host_rules = True  # its rules before a runtime's mode (runtime/torchax_fixes.py)

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
  (`_step_random`), refuses host reads before torch_xla executes anything, and
  refuses parameters that are not the strategy's variables (a model made
  outside `strategy.scope()`, or another strategy's): their gradients would be
  replica-local tensors left in a model that outlives the step.
  """

  def __init__(self, region):
    super().__init__()
    self._made = {}  # id -> tensor, in creation order
    self._region = region

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
    made = self._made
    if kind is _WRITE and args:
      self._check_write(func, args[0])
    if kind is not _ATTRIBUTE:  # reading or setting t.grad, t.data computes nothing
      for a in args:
        if isinstance(a, torch.Tensor):
          if a.requires_grad and a.is_leaf and id(a) not in made:
            self._check_parameter(a, func)
        elif isinstance(a, (list, tuple)):
          for x in a:
            if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf and id(x) not in made:
              self._check_parameter(x, func)
    if kwargs is None:
      kwargs = {}
    if kind is _DRAW and context.get_replica_context() is not None:
      result = _step_random.draw(func, args, kwargs, self._region)
      if result is None:
        result = func(*args, **kwargs)
    else:
      result = func(*args, **kwargs)
    is_dev = _runtime.is_device_tensor
    if isinstance(result, torch.Tensor):
      if id(result) not in made and is_dev(result):
        self._note(result, args, kwargs)
    elif isinstance(result, (tuple, list)):
      for r in result:
        if isinstance(r, torch.Tensor) and id(r) not in made and is_dev(r):
          self._note(r, args, kwargs)
    return result

  def _check_write(self, func, first):
    """Refuses an in-place write to a device tensor made before the step that is
    not the strategy's (an EMA helper's shadow copy cloned from a parameter):
    torch_xla 2.9 aborted the process (`Check failed: !IsManual()`) and the jax
    runtime kept a traced value in it."""
    region = self._region
    for t in first if isinstance(first, (list, tuple)) else (first,):
      if not isinstance(t, torch.Tensor):
        continue
      base = _view_base(t)  # a view writes the tensor it views
      base = t if base is None else base
      if id(base) in self._made or not _runtime.is_device_tensor(base):
        continue
      if region.is_variable(base):
        continue
      if _runtime.creation_index(base) < region._first_id:
        raise RuntimeError(
          f"strategy.run: {getattr(func, '__name__', func)} writes in place a tensor of "
          f"shape {tuple(base.shape)} made before the step that is not a variable of "
          f"{region.strategy!r} (an EMA helper's shadow copy made with "
          "`p.detach().clone()`, a counter made on the device by hand): each replica "
          "would write its own copy, which cannot leave the step. Keep such state in a "
          "module made under strategy.scope() (`register_buffer`: a variable, written "
          "by the step like a parameter), or update it after strategy.run."
        )

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
