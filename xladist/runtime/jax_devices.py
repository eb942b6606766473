"""The jax runtime's start, devices and placement (the bottom of runtime/jax_*.py).

`initialize` starts jax and torchax once per process (jax's settings, the
processes of `jax.distributed`, the torchax hooks the traced steps need); the
rest places global values on the ("replica",) mesh and reads them back to the
host. Holds the runtime's state (`_state`), its counters (`_counts`) and the
step being traced in this thread (`_current`, set by jax_programs.traced_step):
the other jax_*.py modules read them from here. jax_runtime.py is the module
runtime/__init__.py binds.
"""

import atexit
import functools
import os
import sys
import threading

import numpy as np

from xladist.runtime import jax_compat
from xladist.runtime.host import call_with_timeout

REPLICA_AXIS = "replica"
CORE_AXIS = "core"
DEVICE_KIND = "jax"
DEFAULT_CPU_DEVICES = 4

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


# -- what initialize installs: counters, and the torchax hooks of traced steps ---------

_counts = {"compile": 0, "execute": 0, "sync": 0}


def _install_compile_counter(jax):
  def listener(event, duration, **kwargs):
    if event == "/jax/compilation_cache/compile_time_saved_sec":
      return
    if event.endswith("backend_compile_duration"):
      _counts["compile"] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)


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
    torch = _torch()
    if isinstance(other, torch.Tensor) and tuple(self.shape) != tuple(other.shape):
      # A new shape (sharded state's rows, sharded_state.py): torch's own setter
      # updates the sizes autograd checks a gradient against; torchax's keeps them.
      torch._C.TensorBase.data.__set__(self, other)
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


def replica_groups(num_replicas=None, within=False):
  """One group of every device (a replica is one device on this runtime), or
  (within) each device alone."""
  if within:
    return [[d] for d in range(num_devices())]
  return [list(range(num_devices()))]


@functools.cache
def replicated_sharding(ndim):
  from jax.sharding import NamedSharding, PartitionSpec

  return NamedSharding(mesh(), PartitionSpec())


@functools.cache
def replica_sharding(ndim, num_replicas=None):
  from jax.sharding import NamedSharding, PartitionSpec

  return NamedSharding(mesh(num_replicas), PartitionSpec(REPLICA_AXIS))


def sharding(ndim, num_replicas=None, split=True):
  """The NamedSharding of an `ndim` tensor split along dim 0 over the replicas, or replicated."""
  return replica_sharding(ndim, num_replicas) if split else replicated_sharding(ndim)


@functools.cache
def _mesh_index():
  """jax's device id -> the device's index among all processes' devices (its
  replica; torch_xla's global device ordinal). The same number on one process;
  on several, jax numbers process p's CPU devices from p * 2048."""
  return {d.id: i for i, d in enumerate(_rt().devices)}


def _device_name(device):
  return f"{device_type()}:{_mesh_index()[device.id]}"


def process_devices():
  """(number of processes, this process's index, this process's devices named
  "<PLATFORM>:<global index>", their replica)."""
  jax = _rt().jax
  return jax.process_count(), jax.process_index(), [_device_name(d) for d in jax.local_devices()]


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
    # A host value goes through make_array_from_callback, one process or
    # several: 35 µs for a replay's vector of scalars on 4 XLA:CPU devices where
    # device_put takes 95 µs (its Python path), and each process its own value.
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def place_replicated(tensor):
  if isinstance(tensor, (list, tuple)):
    return [place_replicated(t) for t in tensor]
  return _wrap(_put(tensor, replicated_sharding(tensor.dim())))


def ensure_sharded(tensor):
  return tensor


def place_split(tensor):
  if isinstance(tensor, (list, tuple)):
    return [place_split(t) for t in tensor]
  return _wrap(_put(tensor, replica_sharding(tensor.dim(), tensor.shape[0])))


def place_per_device(tensor, num_replicas):
  return place_split(tensor)


def local_shards(tensor):
  """[(host shard, "<PLATFORM>:<index>")] of this process's shards of a global
  tensor (named as by `process_devices`)."""
  torch = _torch()
  out = []
  for shard in tensor._elem.addressable_shards:
    out.append((torch.from_numpy(np.array(shard.data)), _device_name(shard.device)))
  return out


def global_from_local_shards(shards, sharding, full_shape):
  """A global tensor from this process's host shards, one per local device (in
  the order of `process_devices()`)."""
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
