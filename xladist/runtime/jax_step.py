"""The step's trace on the jax runtime: what one step being traced adds to its program.

`to_local` makes a global value an input of the program, seen as its
replica-local view; `to_global` registers a local value as an output;
`spmd_all_reduce` is a collective of the program (psum / pmax / pmin over the
replica axis). Also: tensor identities across the trace (`_Ident`: `ir_id`,
`tensor_id`, `next_tensor_id`), the jaxpr trace that turns a global array a
step closes over into an input, and host reads refused while a step is traced
(`no_execution`). jax_programs.py opens the trace and runs its program.
"""

import contextlib
import functools

import numpy as np

from xladist.runtime import jax_compat
from xladist.runtime.host import HostReadInStep
from xladist.runtime.host import frame_outside as _frame_outside
from xladist.runtime.jax_devices import REPLICA_AXIS, _current, _rt, _wrap, mesh


class _Ident:
  """The identity of a tensor's array (it keeps the array alive, so no other
  array can take its id). Taken while a step is traced, an identity of a
  step output's traced value becomes that of the program's result once the
  step has run: a variable the step wrote keeps the identity it left with."""

  __slots__ = ("target",)

  def __init__(self, target):
    self.target = target
    st = _current()
    if st is not None and isinstance(target, _rt().jax.core.Tracer):
      st.idents.append(self)

  def __eq__(self, other):
    return isinstance(other, _Ident) and other.target is self.target

  def __ne__(self, other):
    return not self.__eq__(other)

  def __hash__(self):
    return id(self.target)

  def __lt__(self, other):
    # creation_index(t) < creation_index(): t existed before the step began.
    return other is _STEP_START and not isinstance(self.target, _rt().jax.core.Tracer)


_STEP_START = object()


def value_id(tensor):
  """The identity of the array behind a tensor (changes when it is written); an
  array's own (a program's result)."""
  return _Ident(getattr(tensor, "_elem", tensor))


def creation_index(tensor=None):
  """The identity of the array behind a tensor, ordered against None's mark:
  `creation_index(t) < creation_index()` holds for a tensor whose value
  existed before the step being traced."""
  return _STEP_START if tensor is None else _Ident(tensor._elem)


def buffer_ids(tensors):
  """The identity of each tensor's array (`id`: the caller keeps the arrays
  alive); a jax array is never pending, so never None. An array that is not
  wrapped (a program's constant or result) is its own buffer."""
  return [id(getattr(t, "_elem", t)) for t in tensors]


class _StepTrace:
  """What one traced step added to its program: inputs and outputs."""

  def __init__(self, trace):
    self.trace = trace
    self.inputs = []  # (global array, split?)
    self.by_array = {}  # id(global array) -> local tracer
    self.outputs = []  # (tensor standing for the output, local tracer, split?)
    self.holders = {}  # id(output tensor) -> tensors given its value by `.data =`
    self.idents = []  # _Ident objects of traced values (see _Ident)


def in_traced_step():
  """Whether a step is being traced in this thread (its program not yet run)."""
  return _current() is not None


def _source_info():
  return jax_compat.source_info()


def to_local(global_tensor):
  """The replica-local view of a global tensor inside the step being traced.

  A replica-split value (shape (R, ...)) gives each replica its row, shape
  (1, ...); a replicated one the whole value. Each distinct global array
  becomes one input of the step's program.
  """
  st = _current()
  if st is None:
    raise RuntimeError("xladist: to_local outside a traced step (xladist's own bug)")
  jax = _rt().jax
  elem = global_tensor._elem
  if isinstance(elem, jax.core.Tracer):
    return global_tensor  # made in this step: already a value of every replica
  return _wrap(_local_input(st, elem), requires_grad=False)


def _local_input(st, elem):
  """The tracer of global array `elem` in step `st`: a new input the first time."""
  local = st.by_array.get(id(elem))
  if local is None:
    split = not elem.sharding.is_fully_replicated
    shape = ((1,) + tuple(elem.shape[1:])) if split else tuple(elem.shape)
    local = st.trace.new_arg(jax_compat.shaped_array(shape, elem.dtype), _source_info())
    st.inputs.append((elem, split))
    st.by_array[id(elem)] = local
  return local


@functools.cache
def _step_trace_class():
  """The jaxpr trace of a step: a global array the step reads without entering
  it (a device tensor `fn` closes over, a value a strategy keeps) becomes an
  input seen as its replica-local view, like `to_local`; other concrete arrays
  are constants typed without a placement (inside the program every value is
  replica-local)."""
  jax = _rt().jax
  from jax.sharding import NamedSharding

  class StepTrace(jax_compat.step_trace_base()):
    __slots__ = ()

    def new_const(self, c, source_info, aval=None):
      st = _current()
      if st is not None and st.trace is self and isinstance(c, jax.Array):
        sharding = c.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh():
          return _local_input(st, c)
        if aval is None:
          aval = jax_compat.shaped_array(c.shape, c.dtype)
      return super().new_const(c, source_info, aval)

    pure = lift = new_const

  return StepTrace


def to_global(local_tensor, sharding, full_shape):
  """An output of the step being traced: `local_tensor` leaves every replica as
  one global value (replicated, or the replicas' rows stacked)."""
  st = _current()
  split = tuple(full_shape) != tuple(local_tensor.shape)
  out = _wrap(local_tensor._elem)
  st.outputs.append((out, local_tensor._elem, split))
  st.holders[id(out)] = [out]
  return out


_REDUCERS = {"sum": "psum", "max": "pmax", "min": "pmin"}


def spmd_all_reduce(op_name, tensor, scale, groups):
  """psum / pmax / pmin of a step's local tensor over the replica axis, times `scale`."""
  jax = _rt().jax
  _one_group(groups)
  fn = getattr(jax.lax, _REDUCERS[op_name])
  return _wrap(_scaled(fn(tensor._elem, REPLICA_AXIS), scale))


def spmd_reduce_scatter(tensor, scale, groups):
  """psum_scatter of a step's local (n, ...) tensor: replica r gets row r of the sum."""
  jax = _rt().jax
  _one_group(groups)
  out = jax.lax.psum_scatter(tensor._elem, REPLICA_AXIS, scatter_dimension=0, tiled=False)
  return _wrap(_scaled(out, scale))


def spmd_all_gather(tensor, replica_id, groups):
  """all_gather of a step's local tensor: (n, ...) on every replica."""
  jax = _rt().jax
  _one_group(groups)
  return _wrap(jax.lax.all_gather(tensor._elem, REPLICA_AXIS, axis=0, tiled=False))


def optimization_barrier_(tensors):
  """`lax.optimization_barrier` over the tensors' arrays, each tensor given its output."""
  jax = _rt().jax
  tensors = list(tensors)
  outs = jax.lax.optimization_barrier(tuple(t._elem for t in tensors))
  for t, out in zip(tensors, outs):
    t._elem = out


def _scaled(out, scale):
  return out if scale == 1.0 else out * np.asarray(scale, dtype=out.dtype)


def _one_group(groups):
  if groups is not None and len(groups) != 1:
    raise NotImplementedError(
      "xladist's jax runtime reduces over all replicas; collectives over groups of "
      "devices (TPUStrategy's logical devices) need the torch_xla runtime."
    )


@contextlib.contextmanager
def no_execution():
  """Turns a host read of a traced value into HostReadInStep."""
  jax = _rt().jax
  try:
    yield
  except jax.errors.ConcretizationTypeError as e:
    import traceback

    raise HostReadInStep(_frame_outside(traceback.extract_tb(e.__traceback__))) from None
