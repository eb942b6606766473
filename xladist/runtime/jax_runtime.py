"""The jax runtime: torch code on JAX through torchax (XLA:CPU, XLA:CUDA, several processes).

Selected by `XLADIST_BACKEND=jax`. The layers above see the same interface as
on torch_xla (runtime/__init__.py); what differs is how a step becomes a
program. torch_xla records a step lazily and compiles it at the next sync; here
a step is traced by JAX while it runs:

* `traced_step(body)` opens a JAX trace (a dynamic jaxpr trace with the
  replica axis bound) and runs the engine's phases inside it. Each
  `to_local(global)` adds the global array as a new input of the program, seen
  inside as its replica-local view (the whole value, or its row of the
  replica-split array); each `to_global(local)` registers an output and
  returns a torchax tensor that stands for it. When `body` returns, the jaxpr
  is closed, run as `jax.jit(shard_map(...))` over the replica mesh (compiled
  once per program: the key is the jaxpr's text and the inputs' placements),
  and every output tensor gets its array. So ordinary torch code runs
  unchanged inside a step and every cross-replica operation is a `psum` /
  `pmax` / `pmin` of the one program.
* The random-number key of torchax is an input and an output of every step
  (each step draws anew, and a step's draws do not bake into its program).
* Placement, eager work outside steps and host reads are plain JAX: arrays
  with a `NamedSharding` over the ("replica",) mesh, dispatched
  asynchronously.
* Several processes: `jax.distributed` (gloo on CPU), joined when
  `XLADIST_JAX_COORDINATOR`, `XLADIST_JAX_NUM_PROCESSES` and
  `XLADIST_JAX_PROCESS_ID` are set (cluster_resolver/_multihost.py sets them
  from the cluster resolver, TF_CONFIG included), with JAX's recoverability on
  and its preemption service off, so that a lost peer is an error, not an
  abort or a swallowed signal. xladist bounds its waits (`wait`): a collective
  whose peer died never returns in jax 0.10.

Replay (replay.py) works here too: the runtime hands over the program a step
ran and its inputs (`REPLAY_KIND = "program"`), across several processes too (a
traced and a replayed step dispatch the same compiled program); a replayed
step's new hyperparameter values replace its packed scalar constants
(`with_scalars`). Not on this runtime (each refused with
an error that names it): several devices per replica (TPUStrategy's logical
devices), CentralStorageStrategy, ParameterServerStrategy, sharded
(torch.distributed.checkpoint) checkpoints.
"""

import atexit
import contextlib
import functools
import os
import sys
import threading

import numpy as np

from xladist.runtime import jax_compat
from xladist.runtime.host import call_with_timeout, user_frame  # noqa: F401  (interface)
from xladist.runtime.host import frame_outside as _frame_outside

REPLICA_AXIS = "replica"
CORE_AXIS = "core"
DEVICE_KIND = "jax"
DEFAULT_CPU_DEVICES = 4
COMPILE_CACHE_DEVICE_TYPES = ()
REPLAY_KIND = "program"  # replay.py: the runtime hands over the program and its inputs

_lock = threading.RLock()
_state = None


class _Runtime:
  def __init__(self, jax, torchax, platform):
    import torch

    self.jax = jax
    self.env = torchax.default_env()
    self.Tensor = torchax.tensor.Tensor
    self.platform = platform
    self.devices = jax.devices()
    self.num_devices = len(self.devices)
    self.device = torch.device("jax:0")


def _configure_jax(jax, environ):
  """jax settings that must be made before its backends start."""
  platforms = environ.get("JAX_PLATFORMS", "")
  started = jax_compat.backends_started()  # jax used before the first strategy
  flags = environ.get("XLA_FLAGS", "")
  if not started and "host_platform_device_count" not in flags:
    cpu_devices = int(environ.get("CPU_NUM_DEVICES", DEFAULT_CPU_DEVICES))
    jax.config.update("jax_num_cpu_devices", cpu_devices)
  jax.config.update("jax_enable_x64", True)  # torch's int64 (labels, counters)
  coordinator = environ.get("XLADIST_JAX_COORDINATOR")
  if coordinator:
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_enable_preemption_service", False)
    if not platforms or platforms == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    join_timeout = int(environ.get("XLADIST_JAX_JOIN_TIMEOUT", "300"))
    # Bounded here (TimeoutError), before jax's own deadline, which aborts the
    # process (its coordination client's fatal-error callback).
    call_with_timeout(
      lambda: jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(environ["XLADIST_JAX_NUM_PROCESSES"]),
        process_id=int(environ["XLADIST_JAX_PROCESS_ID"]),
        initialization_timeout=join_timeout + 60,
      ),
      join_timeout,
      f"jax.distributed.initialize: the {environ['XLADIST_JAX_NUM_PROCESSES']} processes "
      f"did not all join the coordinator {coordinator} within {join_timeout} s.",
    )
    atexit.register(_exit_barrier, join_timeout)  # runs before jax's own shutdown


_peer_lost = [False]  # a bounded wait failed: other processes may be gone


def _exit_barrier(timeout_seconds):
  """At exit, waits (at most `timeout_seconds`) until every process reaches its exit.

  With recoverability on, jax's shutdown does not wait for the other
  processes, and a process whose coordinator (process 0) has already shut down
  is aborted in its own shutdown: so the processes meet here, then the others
  disconnect and the coordinator waits until they did. Skipped after a failed
  bounded wait (`wait`): the others may be gone.
  """
  state = jax_compat.distributed_state()
  client = state.client
  if client is None or _peer_lost[0]:
    return
  try:
    client.wait_at_barrier("xladist-exit", int(timeout_seconds * 1000))
    if state.service is None:
      state.shutdown()  # disconnects while the coordinator still serves
    else:
      # The coordinator serves until the others have disconnected: their
      # live-node query returns once every other process called it or left.
      call_with_timeout(
        lambda: client.get_live_nodes(list(range(state.num_processes))),
        timeout_seconds,
        "the other processes did not disconnect",
      )
  except Exception as e:  # noqa: BLE001  (exiting: report, do not raise)
    print(
      f"xladist: the other processes did not reach their exit within {timeout_seconds} s "
      f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})",
      file=sys.stderr,
    )


def initialize():
  """Starts jax and torchax once per process and returns the runtime.

  XLA:CPU gets `CPU_NUM_DEVICES` devices (default 4) unless XLA_FLAGS sets
  `--xla_force_host_platform_device_count`; a GPU is used when jax finds one.
  """
  global _state
  if _state is not None:
    return _state
  with _lock:
    if _state is not None:
      return _state
    from xladist.runtime import torchax_fixes, torchax_load

    try:
      import jax
    except ImportError as e:
      raise _runtime_not_installed(e) from e
    jax_compat.check_version(jax)
    torchax_load.check_torch()
    # Before torchax's first environment, which starts jax's backends.
    _configure_jax(jax, os.environ)
    try:
      torchax = torchax_load.load()
    except ImportError as e:
      raise _runtime_not_installed(e) from e
    torchax_fixes.install()
    torchax.enable_globally()
    _follow_data_assignments(torchax.tensor.Tensor)
    _eager_host_transfers(jax, torchax)
    _state = _Runtime(jax, torchax, jax.default_backend())
    _install_compile_counter(jax)
    return _state


def _runtime_not_installed(e):
  chosen = (
    "XLADIST_BACKEND=jax"
    if os.environ.get("XLADIST_BACKEND")
    else "chosen because torch_xla is not installed either"
  )
  return RuntimeError(
    f"xladist: the jax runtime ({chosen}) needs jax and torchax, which cannot be "
    f"imported here ({e}). Install a runtime: `pip install 'xladist[jax]'` (CPU) or "
    "'xladist[cuda]' (NVIDIA GPU) for this one (`make venv-jax` builds the CPU "
    "one), or 'xladist[xla]' / 'xladist[tpu]' for torch_xla."
  )


def _rt():
  return _state if _state is not None else initialize()


# -- devices ---------------------------------------------------------------------------


def is_initialized():
  return _state is not None


def device_type():
  """ "CPU", "GPU" or "TPU": the platform jax runs on (starts the runtime)."""
  return {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "tpu": "TPU"}.get(
    _rt().platform, _rt().platform.upper()
  )


def num_devices():
  return _rt().num_devices


def device():
  return _rt().device


def cores_per_replica(num_replicas=None):
  """Always 1 here: several devices per replica are torch_xla's (TPUStrategy)."""
  n = num_devices()
  r = n if num_replicas is None else num_replicas
  if r < 1 or n % r:
    raise ValueError(
      f"{r} replicas cannot share this process's {n} devices evenly: every "
      "replica spans the same number of devices (a divisor of the device count)."
    )
  if r != n:
    raise NotImplementedError(
      f"xladist's jax runtime runs one replica per device ({n} devices, {r} replicas "
      "asked): several devices per replica (TPUStrategy's logical devices) need the "
      "torch_xla runtime (XLADIST_BACKEND=torch_xla)."
    )
  return 1


@functools.cache
def mesh(num_replicas=None):
  from jax.sharding import Mesh

  cores_per_replica(num_replicas)
  return Mesh(np.array(_rt().devices), (REPLICA_AXIS,))


def replica_groups(num_replicas=None):
  return [list(range(num_devices()))]


def core_groups(num_replicas):
  return [[d] for d in range(num_devices())]


@functools.cache
def replicated_sharding(ndim):
  from jax.sharding import NamedSharding, PartitionSpec

  return NamedSharding(mesh(), PartitionSpec())


@functools.cache
def replica_sharding(ndim, num_replicas=None):
  from jax.sharding import NamedSharding, PartitionSpec

  return NamedSharding(mesh(num_replicas), PartitionSpec(REPLICA_AXIS))


@functools.cache
def _mesh_index():
  """jax's device id -> the device's index among all processes' devices (its
  replica; torch_xla's global device ordinal). The same number on one process;
  on several, jax numbers process p's CPU devices from p * 2048."""
  return {d.id: i for i, d in enumerate(_rt().devices)}


def _device_name(device):
  return f"{device_type()}:{_mesh_index()[device.id]}"


def runtime_devices():
  """This process's devices, named "<PLATFORM>:<global index>" (their replica)."""
  rt = _rt()
  return [_device_name(d) for d in rt.jax.local_devices()]


def addressable_device_count():
  return _rt().jax.local_device_count()


def process_count_index():
  jax = _rt().jax
  return jax.process_count(), jax.process_index()


# -- tensors and placement ---------------------------------------------------------------


def is_device_tensor(tensor):
  """True for a torchax tensor (a global value, or a step's local view)."""
  return type(tensor) is _rt().Tensor or isinstance(tensor, _rt().Tensor)


def _wrap(array, requires_grad=False):
  rt = _rt()
  return rt.Tensor(array, rt.env, requires_grad=requires_grad)


def _host_array(tensor):
  t = tensor.detach()
  if t.dtype == _torch().bfloat16:
    return t.float().numpy().astype(_ml_dtypes().bfloat16)
  return t.contiguous().numpy()


@functools.cache
def _torch():
  import torch

  return torch


@functools.cache
def _ml_dtypes():
  import ml_dtypes

  return ml_dtypes


def _put(value, sharding):
  """A jax array of `value` (host tensor, torchax tensor) with `sharding`, made
  now even while a step is traced (placement is never part of a step's program)."""
  if not is_device_tensor(value):
    return _placed(_host_array(value), sharding)
  elem = value._elem
  if isinstance(elem, _rt().jax.core.Tracer):
    return elem  # made in the step: already part of its program
  return _placed(elem, sharding)


def _placed(x, sharding):
  """`x` (a jax array or a host array) with `sharding`, made now. With several
  processes a process's own value goes through the host (each process gives
  its own devices the value: device_put would compare it across processes, a
  collective)."""
  jax = _rt().jax
  with jax.ensure_compile_time_eval():
    if isinstance(x, jax.Array):
      if x.sharding == sharding:
        return x
      if jax.process_count() == 1 or not x.is_fully_addressable:
        return jax.device_put(x, sharding)
      x = np.array(x)
    if jax.process_count() > 1:
      return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    return jax.device_put(x, sharding)


def place_replicated(tensor):
  return _wrap(_put(tensor, replicated_sharding(tensor.dim())))


def ensure_sharded(tensor):
  return tensor


def place_split(tensor):
  return _wrap(_put(tensor, replica_sharding(tensor.dim(), tensor.shape[0])))


def place_split_many(tensors):
  return [place_split(t) for t in tensors]


def place_per_device(tensor, num_replicas):
  return place_split(tensor)


def replicate_many(tensors):
  return [place_replicated(t) for t in tensors]


def local_shards(tensor):
  """[(host shard, "<PLATFORM>:<index>")] of this process's shards of a global
  tensor (named as by `runtime_devices`)."""
  torch = _torch()
  out = []
  for shard in tensor._elem.addressable_shards:
    out.append((torch.from_numpy(np.array(shard.data)), _device_name(shard.device)))
  return out


def global_from_local_shards(shards, sharding, full_shape):
  """A global tensor from this process's host shards, one per local device (in
  the order of `runtime_devices()`)."""
  jax = _rt().jax
  arrays = [
    jax.device_put(_host_array(s), d) for s, d in zip(shards, jax.local_devices(), strict=True)
  ]
  return _wrap(jax.make_array_from_single_device_arrays(tuple(full_shape), sharding, arrays))


def to_host(tensors):
  """CPU copies of device tensors (global values are gathered from every process)."""
  torch = _torch()
  out = []
  for t in tensors:
    elem = t._elem
    if not elem.is_fully_addressable:
      from jax.experimental import multihost_utils

      elem = multihost_utils.process_allgather(elem, tiled=True)
    array = np.asarray(elem)
    if array.dtype == _ml_dtypes().bfloat16:
      out.append(torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16))
    else:
      out.append(torch.from_numpy(np.array(array)))
  return out


def replica_copies(tensor, num_replicas):
  """Each replica's copy of a replicated tensor (host tensors, from its device)."""
  torch = _torch()
  by_device = {
    s.device.id: torch.from_numpy(np.array(s.data)) for s in tensor._elem.addressable_shards
  }
  return tuple(by_device[d.id] for d in _rt().devices[:num_replicas])


def empty_sharded_like(shape, dtype, like):
  raise _no_sharded_checkpoints()


def is_sharded(t):
  return bool(is_device_tensor(t) and not t._elem.sharding.is_fully_replicated)


def sharding_spec(t):
  """How a device tensor is placed, as the step signature sees it: "split" over
  the replicas or "replicated" ("" for a host tensor). A traced value (a step's
  output read by the next of the steps traced as one program) is a variable's
  replicated value."""
  if not is_device_tensor(t):
    return ""
  elem = t._elem
  if isinstance(elem, _rt().jax.core.Tracer):
    return "replicated"
  return "replicated" if elem.sharding.is_fully_replicated else "split"


def graph_hash(tensors):
  return b""  # jax arrays are never pending work of a lazy graph


def _no_sharded_checkpoints():
  return RuntimeError(
    "xladist's sharded checkpoints (torch.distributed.checkpoint) run on the torch_xla "
    "runtime only; on the jax runtime save with xladist.checkpoint.Checkpoint.write / "
    "save (files), which the torch_xla runtime reads too."
  )


def checkpoint_planners():
  raise _no_sharded_checkpoints()


# -- one step: a dynamic jax trace ------------------------------------------------------


class HostReadInStep(RuntimeError):
  """A traced tensor's value was read on the host while a step was traced."""


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
    # tensor_id(t) < next_tensor_id(): t existed before the step began.
    return other is _STEP_START and not isinstance(self.target, _rt().jax.core.Tracer)


_STEP_START = object()


def ir_id(tensor):
  """The identity of the array behind a tensor (changes when it is written)."""
  return _Ident(tensor._elem)


def tensor_id(tensor):
  """The identity of the array behind a tensor; `tensor_id(t) < next_tensor_id()`
  holds for a tensor whose value existed before the step being traced."""
  return _Ident(tensor._elem)


def next_tensor_id():
  return _STEP_START


class _StepTrace:
  """What one traced step added to its program: inputs and outputs."""

  def __init__(self, trace):
    self.trace = trace
    self.inputs = []  # (global array, split?)
    self.by_array = {}  # id(global array) -> local tracer
    self.outputs = []  # (tensor standing for the output, local tracer, split?)
    self.holders = {}  # id(output tensor) -> tensors given its value by `.data =`
    self.idents = []  # _Ident objects of traced values (see _Ident)


def _eager_host_transfers(jax, torchax):
  """A host tensor moved to the device (`t.to("jax")`) is a concrete array even
  while a step is traced: a value the step reads as a constant, and one that a
  strategy keeps between steps (its replica iota) is never a traced value."""
  env = torchax.default_env()
  to_copy = env._to_copy
  tensor_class = torchax.tensor.Tensor

  def eager_to_copy(the_tensor, new_dtype, new_device):
    if isinstance(the_tensor, tensor_class):
      elem = the_tensor._elem
      if (
        str(getattr(new_device, "type", new_device)) == "cpu"
        and isinstance(elem, jax.Array)
        and not elem.is_fully_addressable
        and not elem.sharding.is_fully_replicated
      ):
        # Spread over other processes' devices (strategy.gather's result): read
        # like torch_xla, gathered from every process (`to_host`; a collective:
        # every process reads it).
        import torch.utils._mode_utils as mode_utils

        torch = _torch()
        host = to_host([the_tensor])[0]
        with mode_utils.no_dispatch(), torch._C.DisableTorchFunction():
          return host.to(device=new_device, dtype=new_dtype)
      return to_copy(the_tensor, new_dtype, new_device)
    with jax.ensure_compile_time_eval():
      return to_copy(the_tensor, new_dtype, new_device)

  env._to_copy = eager_to_copy


def _follow_data_assignments(tensor_class):
  """`t.data = out` copies out's array into t (torchax); when `out` stands
  for an output of the step being traced, `t` must get the program's result
  too: it is recorded as a holder of that output."""
  prop = tensor_class.data

  def set_data(self, other):
    prop.fset(self, other)
    st = _current()
    if st is not None:
      holders = st.holders.get(id(other))
      if holders is not None:
        holders.append(self)

  tensor_class.data = property(prop.fget, set_data)


_tls = threading.local()


def _current():
  return getattr(_tls, "step", None)


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
  if groups is not None and len(groups) != 1:
    raise NotImplementedError(
      "xladist's jax runtime reduces over all replicas; collectives over groups of "
      "devices (TPUStrategy's logical devices) need the torch_xla runtime."
    )
  fn = getattr(jax.lax, _REDUCERS[op_name])
  out = fn(tensor._elem, REPLICA_AXIS)
  if scale != 1.0:
    out = out * np.asarray(scale, dtype=out.dtype)
  return _wrap(out)


@contextlib.contextmanager
def no_execution():
  """Turns a host read of a traced value into HostReadInStep."""
  jax = _rt().jax
  try:
    yield
  except jax.errors.ConcretizationTypeError as e:
    import traceback

    raise HostReadInStep(_frame_outside(traceback.extract_tb(e.__traceback__))) from None


class _Program:
  """A compiled step program and what it was traced from.

  Its constants are passed in two parts (`pack`): the arrays, and the scalars
  packed into one vector per dtype (a step's Python numbers, lifted out of the
  program text: one input instead of dozens, each of which costs a transfer
  per device at every run)."""

  def __init__(self, jitted, text_key, jaxpr, in_split, out_split, layout):
    self.jitted = jitted
    self.text_key = text_key
    self.jaxpr = jaxpr
    self.in_split = in_split
    self.out_split = out_split
    self.layout = layout
    self.hlo = None
    self._local = None

  def pack(self, consts):
    """The constants as the program takes them (placed on the devices)."""
    jax = _rt().jax
    arrays, scalars = [], {}
    for (kind, dtype, _), c in zip(self.layout, consts, strict=True):
      if kind == "array":
        arrays.append(c)
      else:
        scalars.setdefault(dtype, []).append(np.asarray(c, dtype=jax.numpy.dtype(dtype)))
    vectors = [np.stack(scalars[d]) for d in sorted(scalars)]
    with jax.ensure_compile_time_eval():
      placed = _on_devices(vectors)  # each process its own copy (no cross-process check)
    return (_on_devices(arrays), placed)

  def call(self, packed, key, args):
    return self.jitted(packed[0], packed[1], key, *args)

  def local(self):
    """The step's body on replica-local values, as one jitted call: a replayed
    step inside another trace is one equation of it."""
    if self._local is None:
      self._local = _rt().jax.jit(_unpacking_body(self.jaxpr, self.layout))
    return self._local


def _const_layout(consts):
  """Per constant: ("scalar", dtype, index in its dtype's vector) or ("array", dtype, i)."""
  counts, layout = {}, []
  for c in consts:
    dtype = np.dtype(c.dtype).name  # not .str: bfloat16's is "<V2" (void)
    if tuple(np.shape(c)) == ():
      layout.append(("scalar", dtype, counts.get(dtype, 0)))
      counts[dtype] = counts.get(dtype, 0) + 1
    else:
      layout.append(("array", dtype, None))
  return tuple(layout)


def _unpacking_body(jaxpr, layout):
  """fn(arrays, vectors, key, *args): the jaxpr evaluated with its constants
  rebuilt from the packed form."""
  order = sorted({d for kind, d, _ in layout if kind == "scalar"})

  def body(arrays, vectors, key_in, *args):
    by_dtype = dict(zip(order, vectors, strict=True))
    it = iter(arrays)
    consts = [next(it) if kind == "array" else by_dtype[d][j] for kind, d, j in layout]
    return jax_compat.eval_jaxpr(jaxpr, *consts, key_in, *args)

  return body


_programs = {}
_counts = {"compile": 0, "execute": 0, "sync": 0}
_last_outputs = []
_pending = []  # what the last `sync(tensors)` named: `wait` waits for it too
_last_program = [None]
_sync_callbacks = []


def _install_compile_counter(jax):
  def listener(event, duration, **kwargs):
    if event == "/jax/compilation_cache/compile_time_saved_sec":
      return
    if event.endswith("backend_compile_duration"):
      _counts["compile"] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)


def traced_step(body):
  """Runs `body()` (a step's phases) inside a jax trace, then its program.

  Returns what `body` returned, its output tensors holding the program's results.
  A `traced_step` inside another one (the k steps of `experimental_run_steps`)
  is part of the outer one's program: its outputs are values of that trace,
  which the next step reads as they are.
  """
  rt = _rt()
  if _current() is not None:
    # A step inside a traced group of steps (experimental_run_steps): part of
    # the group's one program.
    return body()
  n = num_devices()
  trace = jax_compat.new_trace(_step_trace_class())
  st = _StepTrace(trace)
  env = rt.env
  key_before = env.param.prng
  _tls.step = st
  try:
    with jax_compat.bind_axis(REPLICA_AXIS, n), jax_compat.current_trace(trace):
      # The key's type without its placement: inside the program every value is
      # replica-local (a placed aval would name the global mesh).
      key_aval = jax_compat.shaped_array(key_before.shape, key_before.dtype)
      key_in = trace.new_arg(key_aval, _source_info())
      # Every replica draws from the same key: xladist's per-replica draws take
      # each replica's rows of one global draw (_step/seeds.py).
      env.param.prng = key_in
      result = body()
      key_out = env.param.prng
      outs = [t for _, t, _ in st.outputs] + [key_out]
      jaxpr, consts = jax_compat.close_trace(trace, outs)
  finally:
    _tls.step = None
    env.param.prng = key_before  # until the program has run
  jaxpr, consts = _lift_float_literals(jaxpr, consts)
  program = _program_for(jaxpr, st, _const_layout(consts))
  packed = program.pack(consts)
  args = [elem for elem, _ in st.inputs]
  outs = program.call(packed, key_before, args)
  _counts["execute"] += 1
  _counts["sync"] += 1
  result_of = {}
  for (tensor, traced, _), value in zip(st.outputs, outs[:-1], strict=True):
    result_of[id(traced)] = value
    for holder in st.holders[id(tensor)]:
      holder._elem = value
  for ident in st.idents:
    ident.target = result_of.get(id(ident.target), ident.target)
  env.param.prng = outs[-1]
  _last_outputs[:] = [outs[-1]]
  _last_program[0] = (program, packed, key_before, args, list(outs[:-1]))
  _run_sync_callbacks()
  return result


def in_traced_step():
  """Whether a step is being traced in this thread (its program not yet run)."""
  return _current() is not None


def last_program():
  """(program, constants, input arrays, result arrays) of the last step traced
  and run, for the replay of steps (`_step/replay.py`); the constants are in
  the program's packed form, a value `run_program` takes as it is."""
  program, consts, _, args, results = _last_program[0]
  return program, consts, args, results


def with_scalars(consts, vectors):
  """A program's packed constants (`_Program.pack`) with its scalar vectors
  replaced by `vectors` (host arrays, one per dtype in the program's order):
  a replayed step's new hyperparameter values, one transfer per vector."""
  jax = _rt().jax
  with jax.ensure_compile_time_eval():
    return (consts[0], _on_devices(vectors))


def stack_steps(arrays):
  """The k steps' values of one argument stacked on a new leading axis, placed
  like them (a replica-split value stays split on its replica axis)."""
  split = not arrays[0].sharding.is_fully_replicated
  return _stacker(split)(*arrays)


@functools.cache
def _stacker(split):
  jax = _rt().jax
  from jax.sharding import NamedSharding, PartitionSpec

  spec = PartitionSpec(None, REPLICA_AXIS) if split else PartitionSpec()
  return jax.jit(lambda *xs: jax.numpy.stack(xs), out_shardings=NamedSharding(mesh(), spec))


def run_program_steps(program, consts, plan, fixed, carried, stacked):
  """Runs a step's program k times as ONE program (a `lax.scan` over the steps),
  for the k replayed steps of `experimental_run_steps`.

  `plan` says where each input of the step comes from: ("fixed", j) the same
  array every step (`fixed[j]`), ("carry", c) the previous step's result that
  carries slot c (`carried[c]` at the first step), ("arg", j) step t's row of
  `stacked[j]` (the k steps' arguments stacked on a leading axis); and which
  results carry which slot (`carries`: result index -> c) and which are
  returned per step (`returned`: result indices). Returns (the carried values
  after the last step, {result index: [its value at each of the k steps]}).
  """
  _, _, returned = plan
  env = _rt().env
  key = (
    program,  # kept alive by the key: compared by identity
    plan,
    tuple(a.shape for a in stacked),
    tuple(a.sharding.is_fully_replicated for a in (*fixed, *stacked)),
  )
  fn = _steps_programs.get(key)
  if fn is None:
    fn = _steps_programs[key] = _steps_program(program, plan, fixed, stacked)
  final, ys, key_out = fn(consts[0], consts[1], env.param.prng, fixed, carried, stacked)
  _counts["execute"] += 1
  env.param.prng = key_out
  _last_outputs[:] = [key_out]
  k = stacked[0].shape[0] if stacked else (ys[0].shape[0] if ys else 0)
  per_step = _unstacker(k, tuple(program.out_split[r] for r in returned))(ys) if ys else []
  return [_wrap(c) for c in final], {
    r: [_wrap(v) for v in values] for r, values in zip(returned, per_step, strict=True)
  }


@functools.cache
def _unstacker(k, splits):
  """One program that cuts each stacked result into its k steps' values, each
  placed like one step's result (split over the replicas or replicated)."""
  jax = _rt().jax
  from jax.sharding import NamedSharding, PartitionSpec

  shardings = [
    [NamedSharding(mesh(), PartitionSpec(REPLICA_AXIS) if split else PartitionSpec())] * k
    for split in splits
  ]
  return jax.jit(lambda ys: [list(y) for y in ys], out_shardings=shardings)


_steps_programs = {}


def _steps_program(program, plan, fixed, stacked):
  jax = _rt().jax
  from jax.sharding import PartitionSpec as P

  inputs_plan, carries, returned = plan
  body = _unpacking_body(program.jaxpr, program.layout)
  out_split = program.out_split
  carry_slots = sorted({c for _, c in carries})
  carry_of = dict(carries)

  def steps(arrays, vectors, key, fixed, carried, stacked):
    def one(state, xs):
      values, key = state
      inputs = []
      for kind, j in inputs_plan:
        if kind == "fixed":
          inputs.append(fixed[j])
        elif kind == "carry":
          inputs.append(values[carry_slots.index(j)])
        else:
          inputs.append(xs[j])
      outs = body(arrays, vectors, key, *inputs)
      new = list(values)
      for r, c in carry_of.items():
        new[carry_slots.index(c)] = outs[r]
      return (new, outs[-1]), [outs[r] for r in returned]

    (final, key), ys = jax.lax.scan(one, (list(carried), key), list(stacked))
    return final, ys, key

  def spec(split, lead=False):
    if split:
      return P(None, REPLICA_AXIS) if lead else P(REPLICA_AXIS)
    return P()

  arg_split = [not a.sharding.is_fully_replicated for a in stacked]
  carry_split = [out_split[next(r for r, c in carries if c == slot)] for slot in carry_slots]
  in_specs = (
    P(),
    P(),
    P(),
    [spec(not a.sharding.is_fully_replicated) for a in fixed],
    [spec(x) for x in carry_split],
    [spec(x, lead=True) for x in arg_split],
  )
  out_specs = (
    [spec(x) for x in carry_split],
    [spec(out_split[r], lead=True) for r in returned],
    P(),
  )
  mapped = jax.shard_map(
    steps, mesh=mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False
  )
  return jax.jit(mapped)


def run_program(program, consts, inputs):
  """Runs a step's program again on `inputs` (arrays in the order of its trace's
  inputs); returns its results as tensors, and moves the random key on.

  Inside a trace (a replayed step among the k steps of experimental_run_steps),
  the program's body is traced into the enclosing program instead: each input
  enters it as a local view, each result leaves it as an output.
  """
  rt = _rt()
  env = rt.env
  st = _current()
  if st is None:
    outs = program.call(consts, env.param.prng, inputs)
    _counts["execute"] += 1
    env.param.prng = outs[-1]
    _last_outputs[:] = [outs[-1]]
    _run_sync_callbacks()
    return [_wrap(o) for o in outs[:-1]]
  tracer = rt.jax.core.Tracer
  local = [a if isinstance(a, tracer) else _local_input(st, a) for a in inputs]
  arrays = [_local_input(st, a) for a in consts[0]]
  vectors = [_local_input(st, v) for v in consts[1]]
  outs = program.local()(arrays, vectors, env.param.prng, *local)
  env.param.prng = outs[-1]
  results = []
  for value, split in zip(outs[:-1], program.out_split, strict=True):
    out = _wrap(value)
    st.outputs.append((out, value, split))
    st.holders[id(out)] = [out]
    results.append(out)
  return results


def _on_devices(consts):
  """A step's constants as replicated device arrays (transferred once, at the
  trace: a replayed program reuses them; host values would be sent at every
  run). With several processes each process gives its own devices the value."""
  jax = _rt().jax
  return [
    _placed(c if isinstance(c, jax.Array) else np.asarray(c), replicated_sharding(np.ndim(c)))
    for c in consts
  ]


def _lift_float_literals(jaxpr, consts):
  """The step's jaxpr with its floating-point scalar literals made constants
  (inputs of the program), and the constants' values.

  A Python float that a step passes to a torch op (Adam's bias-corrected step
  size, a learning rate a scheduler changes) is traced as a literal: baked into
  the program, its text (the program's key) would change with the value and
  every step would compile anew. torch_xla passes such scalars as device data.
  """
  literal = jax_compat.literal_type()
  jnp = _rt().jax.numpy
  lifted_vars, values = [], []

  def lift(atom):
    if not isinstance(atom, literal):
      return atom
    aval = atom.aval
    if getattr(aval, "shape", None) != () or not jnp.issubdtype(aval.dtype, jnp.inexact):
      return atom
    var = jax_compat.new_var(aval)
    lifted_vars.append(var)
    values.append(np.asarray(atom.val, dtype=aval.dtype))
    return var

  eqns = [eqn.replace(invars=[lift(a) for a in eqn.invars]) for eqn in jaxpr.eqns]
  outvars = [lift(a) for a in jaxpr.outvars]
  if not lifted_vars:
    return jaxpr, consts
  n = len(consts)  # the constants' variables are the first invars (jax_compat.close_trace)
  invars = [*jaxpr.invars[:n], *lifted_vars, *jaxpr.invars[n:]]
  jaxpr = jaxpr.replace(invars=invars, eqns=eqns, outvars=outvars)
  return jaxpr, list(consts) + values


_programs_by_structure = {}


class _Same:
  """A sub-program compared by identity (kept alive: its id is never reused)."""

  __slots__ = ("obj",)

  def __init__(self, obj):
    self.obj = obj

  def __eq__(self, other):
    return isinstance(other, _Same) and other.obj is self.obj

  def __hash__(self):
    return id(self.obj)


def _param_key(value):
  if isinstance(value, jax_compat.closed_jaxpr_types()):
    return _Same(value)
  if isinstance(value, (tuple, list)):
    return tuple(_param_key(v) for v in value)
  try:
    hash(value)
  except TypeError:
    return ("repr", repr(value))
  return value


def _structure(jaxpr):
  """A key of a jaxpr that is cheap to build (the text of a group of k steps
  costs tens of ms): its equations' primitives, operands, result types and
  parameters, sub-programs by identity. Equal structures are equal programs;
  a program seen under another structure (a sub-program traced anew) is found
  by its text (`_program_for`)."""
  literal = jax_compat.literal_type()
  ids = {}

  def atom(a):
    if isinstance(a, literal):
      return ("literal", repr(a.val), a.aval)
    return ids.setdefault(a, len(ids))

  parts = [tuple(v.aval for v in jaxpr.constvars), tuple(v.aval for v in jaxpr.invars)]
  for v in (*jaxpr.constvars, *jaxpr.invars):
    atom(v)
  for eqn in jaxpr.eqns:
    params = tuple(sorted((k, _param_key(v)) for k, v in eqn.params.items()))
    operands = tuple(atom(a) for a in eqn.invars)
    results = tuple(v.aval for v in eqn.outvars)
    for v in eqn.outvars:
      atom(v)
    parts.append((eqn.primitive, operands, results, params))
  parts.append(tuple(atom(a) for a in jaxpr.outvars))
  return tuple(parts)


def _program_for(jaxpr, st, layout):
  """The compiled program of a traced step (one per distinct jaxpr and placement)."""
  jax = _rt().jax
  from jax.sharding import PartitionSpec as P

  in_split = tuple(split for _, split in st.inputs)
  out_split = tuple(split for _, _, split in st.outputs)
  shape = (_structure(jaxpr), in_split, out_split, layout)
  program = _programs_by_structure.get(shape)
  if program is not None:
    return program
  key = (str(jaxpr), in_split, out_split, layout)
  program = _programs.get(key)
  if program is not None:
    _programs_by_structure[shape] = program
    return program
  closed = jaxpr
  body = _unpacking_body(closed, layout)
  in_specs = (P(), P(), P()) + tuple(P(REPLICA_AXIS) if s else P() for s in in_split)
  out_specs = [P(REPLICA_AXIS) if s else P() for s in out_split] + [P()]
  mapped = jax.shard_map(body, mesh=mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False)
  program = _Program(jax.jit(mapped), key, closed, in_split, out_split, layout)
  _programs[key] = program
  _programs_by_structure[shape] = program
  return program


def sync(tensors=None):
  """Nothing to cut: a jax step is dispatched when it is traced. The next
  `wait` also waits for `tensors` (eager results, e.g. a reduction outside a
  step), as torch_xla's wait after `sync(tensors)` does."""
  _counts["sync"] += 1
  if tensors:
    jax = _rt().jax
    _pending[:] = [
      t._elem for t in tensors if is_device_tensor(t) and not isinstance(t._elem, jax.core.Tracer)
    ]
  _run_sync_callbacks()


def _run_sync_callbacks():
  while _sync_callbacks:
    _sync_callbacks.pop(0)()


def at_next_sync(callback):
  _sync_callbacks.append(callback)


def _block():
  jax = _rt().jax
  jax.block_until_ready(list(_last_outputs) + list(_pending))
  jax.effects_barrier()
  _pending.clear()


def wait(timeout_seconds=None, what="the device's pending work"):
  """Blocks until the last step's program has finished (at most `timeout_seconds`)."""
  if timeout_seconds is None:
    _block()
    return
  try:
    call_with_timeout(
      _block,
      timeout_seconds,
      f"{what} did not finish within {timeout_seconds} s "
      "(CommunicationOptions.timeout_seconds): a collective is waiting for a replica "
      "(another process died or stopped). Raise timeout_seconds, or pass "
      "timeout_seconds=None to wait without a bound.",
    )
  except Exception:
    _peer_lost[0] = True  # no synchronized exit (`_exit_barrier`)
    raise


def compile_count():
  """XLA compilations so far in this process (jax's monitoring events)."""
  _rt()
  return _counts["compile"]


def execute_count():
  return _counts["execute"]


def cache_hits():
  return 0


def sync_count():
  return _counts["sync"]


def hlo_text(tensors=None):
  """The HLO of the last step program run (the compiled, partitioned module)."""
  last = _last_program[0]
  if last is None:
    return ""
  program, packed, key, args, _ = last
  if program.hlo is None:
    program.hlo = program.jitted.lower(packed[0], packed[1], key, *args).as_text()
  return program.hlo


# -- random numbers ----------------------------------------------------------------------


def _key_to_int(key):
  jax = _rt().jax
  data = np.asarray(jax.random.key_data(key)).astype(np.uint64).reshape(-1)
  value = 0
  for word in data:
    value = (value << 32) | int(word)
  return value


def rng_seed():
  """The runtime's random-number state as an int (the torchax key's bits)."""
  if _state is None:
    return None
  return _key_to_int(_state.env.param.prng)


def set_rng_seed(seed):
  rt = _rt()
  jax = rt.jax
  words = np.array([(int(seed) >> 32) & 0xFFFFFFFF, int(seed) & 0xFFFFFFFF], dtype=np.uint32)
  rt.env.param.prng = jax.random.wrap_key_data(words, impl="threefry2x32")


def running_seed():
  """The key the next step's random ops start from (compared by identity)."""
  return _Ident(_rt().env.param.prng)


def set_running_seed(seed):
  if isinstance(seed, _Ident):
    _rt().env.param.prng = seed.target
  else:
    _rt().env.manual_seed(int(seed))


# -- what only torch_xla has ------------------------------------------------------------

_UNSUPPORTED = {
  "CentralStorageStrategy": "its variables live on the host between steps, which this "
  "runtime's traced steps do not read",
  "ParameterServerStrategy": "its workers run torch_xla programs against variables held "
  "by parameter-server processes",
}


def require(api):
  """Raises NotImplementedError when `api` does not run on this runtime."""
  why = _UNSUPPORTED.get(api)
  if why is not None:
    raise NotImplementedError(
      f"xladist.{api} does not run on the jax runtime ({why}). Use MirroredStrategy or "
      "MultiWorkerMirroredStrategy there, or run with XLADIST_BACKEND=torch_xla."
    )


@contextlib.contextmanager
def patched(replacements):
  """torch_xla's module attributes: nothing to patch on this runtime."""
  yield


def native():
  raise RuntimeError(
    "xladist: replaying traced programs is a torch_xla runtime feature (xladist's own bug "
    "if reached on the jax runtime)."
  )


def compile_cache_path(device_type=None, environ=None):
  return None
