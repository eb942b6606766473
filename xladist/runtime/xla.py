"""The torch_xla runtime: device discovery, SPMD initialisation, meshes, manual
regions, collectives' lowering, host transfers, counters and RNG state.

This is the only module of xladist that imports torch_xla (import-linter's
"only the runtime imports torch_xla" contract): everything else reaches it
through the facade `xladist.runtime` (see its docstring for the interface).

Facts this module relies on (torch 2.9.0 + torch_xla 2.9.0, checked by spikes
recorded in docs/architecture.md):

* `xr.use_spmd()` is process-wide and must come before any tensor touches an XLA
  device; once torch_xla has placed a tensor in its non-SPMD mode the "SPMD config"
  is locked.
* A manual region is entered per tensor with `_spmd_full_to_shard_shape` on a tensor
  that carries a sharding, and left with `_mark_manual_sharding` +
  `_spmd_shard_to_full_shape`. The Python wrappers `xs.enable_manual_sharding` /
  `xs.disable_manual_sharding` do the same with more per-call work; the step's
  tracing cost is dominated by these calls, so the raw bindings are used with
  cached `OpSharding` objects.
* A host read of a traced tensor inside a manual region aborts the process; with
  `_set_allow_execution(False)` it raises a RuntimeError instead, which `run`
  turns into a message that says what went wrong.
"""

import contextlib
import functools
import glob
import importlib.util
import os
import sys
import threading
import traceback
import warnings

import numpy as np

_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
_TORCH_XLA_LOG_LEVEL = "1"  # what torch_xla's import sets when the variable is unset


def _launch_environment():
  """The variables this process was started with (Linux), or None where unknown.

  /proc/self/environ keeps the environment the process was launched with;
  assignments to os.environ since then do not show there.
  """
  try:
    with open("/proc/self/environ", "rb") as f:
      entries = f.read().split(b"\0")
  except OSError:
    return None
  return {e.partition(b"=")[0].decode(errors="replace") for e in entries if e}


def _quiet_xla_logs(environ=None, modules=None, launched_with=None):
  """Shows XLA's C++ log from errors on (level 2) unless the user chose a level.

  XLA's C++ logging prints warnings at every compilation (GSPMD's deprecation
  notice, once per program compiled). The level is read when the C++
  library logs for the first time (at the first compilation or runtime start),
  so setting it here is in time even when torch_xla was imported (not yet used)
  before xladist. torch_xla's
  import sets level 1 where none was set: that value, with torch_xla imported
  before xladist and the variable not in the launch environment, is taken as
  torch_xla's default, not the user's choice. The arguments are for tests.
  """
  environ = os.environ if environ is None else environ
  modules = sys.modules if modules is None else modules
  value = environ.get(_LOG_LEVEL)
  if value is None:
    environ[_LOG_LEVEL] = "2"
  elif value == _TORCH_XLA_LOG_LEVEL and "torch_xla" in modules:
    launched_with = _launch_environment() if launched_with is None else launched_with
    if launched_with is not None and _LOG_LEVEL not in launched_with:
      environ[_LOG_LEVEL] = "2"


_quiet_xla_logs()

REPLICA_AXIS = "replica"
CORE_AXIS = "core"
DEFAULT_CPU_DEVICES = 4

# TPU chips are PCI devices of Google's vendor id with one of these device ids:
# the table of torch_xla 2.9 (`_TPU_PCI_DEVICE_IDS` in torch_xla/_internal/tpu.py,
# which torch_xla also uses to pick its own default device and libtpu's flags).
# Google's vendor id alone is not a TPU: gVNIC, the virtual NIC of ordinary
# Compute Engine CPU and GPU VMs, is vendor 0x1ae0, device 0x0042.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICE_IDS = {
  "0x0027": "TPU v2 / v3",
  "0x005e": "TPU v4",
  "0x0063": "TPU v5e",
  "0x006f": "TPU v6e",
  "0x0076": "TPU7x",
  # torch_xla lists these two as "testing only" (JAX's table names 0x0062 v5p).
  "0x0056": "TPU (no public name)",
  "0x0062": "TPU v5p",
}

_lock = threading.Lock()
_state = None  # the _Runtime once initialised


class _Runtime:
  """What xladist learnt about the process when it initialised torch_xla."""

  def __init__(self, device_type, num_devices):
    import torch_xla

    self.device_type = device_type
    self.num_devices = num_devices
    self.device = torch_xla.device()  # the one SPMD virtual device, "xla:0"
    self.device_name = str(self.device)  # as torch_xla's bindings name it (read per replay)


def _read_id(path):
  try:
    with open(path) as f:
      return f.read().strip().lower()
  except OSError:
    return None


def tpu_chips(sysfs_root="/sys"):
  """The PCI addresses of the TPU chips attached to this host (read from sysfs).

  `sysfs_root` is where sysfs is mounted (tests pass a fake tree).
  """
  chips = []
  for vendor in sorted(glob.glob(os.path.join(sysfs_root, "bus", "pci", "devices", "*", "vendor"))):
    if _read_id(vendor) != GOOGLE_PCI_VENDOR:
      continue
    if _read_id(os.path.join(os.path.dirname(vendor), "device")) in TPU_PCI_DEVICE_IDS:
      chips.append(os.path.basename(os.path.dirname(vendor)))
  return chips


def libtpu_found(environ=None, find_spec=importlib.util.find_spec):
  """Whether torch_xla 2.9 would find libtpu, TPU's PJRT runtime.

  As torch_xla decides it at import (`_setup_tpu_vm_library_path`): the
  variable `TPU_LIBRARY_PATH` is set, or torch_xla ships `lib/libtpu.so`, or the
  `libtpu` package is installed. Looked up without importing either package.
  """
  environ = os.environ if environ is None else environ
  if "TPU_LIBRARY_PATH" in environ:
    return True
  try:
    torch_xla_spec = find_spec("torch_xla")
    if torch_xla_spec is not None:
      for folder in torch_xla_spec.submodule_search_locations or ():
        if os.path.isfile(os.path.join(folder, "lib", "libtpu.so")):
          return True
    return find_spec("libtpu") is not None
  except (ImportError, ValueError):
    return False


def _detect_device_type(environ=None, sysfs_root="/sys", libtpu=None):
  """TPU when TPU chips and libtpu are there, else XLA:CPU; an explicit PJRT_DEVICE wins.

  torch_xla 2.9's own rule for its default device, written once here because
  it must be known before torch_xla is imported (its import picks, and logs, a
  default device of its own when PJRT_DEVICE is unset). `environ`,
  `sysfs_root` and `libtpu` (default: `libtpu_found(environ)`) are for tests.
  """
  environ = os.environ if environ is None else environ
  if environ.get("PJRT_DEVICE"):
    return environ["PJRT_DEVICE"].upper()
  chips = tpu_chips(sysfs_root)
  if not chips:
    return "CPU"
  if libtpu_found(environ) if libtpu is None else libtpu:
    return "TPU"
  warnings.warn(
    f"xladist: {len(chips)} TPU chip(s) are attached, but libtpu (the TPU runtime) "
    "is not installed, so xladist runs on XLA:CPU. Install it with "
    "`pip install 'xladist[tpu]'` (torch_xla[tpu]), or point TPU_LIBRARY_PATH "
    "at libtpu.so; set PJRT_DEVICE=CPU to choose XLA:CPU and silence this.",
    RuntimeWarning,
  )
  return "CPU"


def initialize():
  """Initialises torch_xla in SPMD mode once per process and returns the runtime.

  Idempotent. Chooses TPU when TPU chips are attached and libtpu is installed,
  else XLA:CPU with `CPU_NUM_DEVICES` virtual devices (default 4); `PJRT_DEVICE`
  set by the user is respected (see `_detect_device_type`).

  Raises:
    RuntimeError: torch_xla was already used in its non-SPMD mode in this process.
  """
  global _state
  if _state is not None:
    return _state
  with _lock:
    if _state is not None:
      return _state
    device_type = _detect_device_type()
    os.environ["PJRT_DEVICE"] = device_type
    if device_type == "CPU":
      os.environ.setdefault("CPU_NUM_DEVICES", str(DEFAULT_CPU_DEVICES))
    try:
      import torch_xla
      import torch_xla.runtime as xr
    except ImportError as e:
      raise RuntimeError(
        "xladist: the torch_xla runtime (XLADIST_BACKEND=torch_xla, the default) "
        f"needs torch_xla, which cannot be imported here ({e}). Install the "
        "versions xladist pins (torch==2.9.0 torch_xla==2.9.0; `make venv` builds "
        "such an environment; on a TPU VM pip install 'xladist[tpu]')."
      ) from e

    if not xr.is_spmd() and torch_xla._XLAC._xla_get_spmd_config_is_locked():
      raise RuntimeError(
        "xladist runs every strategy as one SPMD program, but torch_xla was "
        "already used in its non-SPMD mode in this process (a tensor was placed "
        "on an XLA device, or xmp.spawn started per-device threads, before the "
        "first xladist strategy was created). Create the xladist strategy before "
        "touching any XLA device, or call torch_xla.runtime.use_spmd() at the "
        "start of the program."
      )
    xr.use_spmd()
    from xladist.runtime import xla_lowerings

    xla_lowerings.register()
    _restore_torch_gru()
    _start_compile_cache(torch_xla, xr, device_type)
    _state = _Runtime(device_type, xr.global_runtime_device_count())
    return _state


_CACHE_OFF = ("", "0", "off", "false", "no", "none")

# Device types whose PJRT client loads a compiled program back from the cache
# (torch_xla 2.9 runs its persistent-cache tests on these only). Its XLA:CPU
# client writes programs to the cache but cannot read them back ("UNIMPLEMENTED:
# Deserializing serialized executable not supported", counted as
# PersistentCacheDeserializeFailure): there a cache costs time and disk and
# saves nothing.
COMPILE_CACHE_DEVICE_TYPES = ("TPU", "NEURON")


def compile_cache_path(device_type=None, environ=None):
  """Where compiled programs are kept between runs, or None when there is no cache.

  `XLADIST_COMPILE_CACHE`: unset means `~/.cache/xladist/xla-cache` on devices
  that can read programs back (TPU) and no cache elsewhere (XLA:CPU); a path
  moves the cache there and turns it on whatever the device; "off" (or "0",
  "") turns it off. torch_xla's own `XLA_PERSISTENT_CACHE_PATH`, when set,
  wins (see `_start_compile_cache`). `device_type` defaults to this process's.
  """
  environ = os.environ if environ is None else environ
  value = environ.get("XLADIST_COMPILE_CACHE")
  if value is None:
    if (device_type or _detect_device_type(environ)) not in COMPILE_CACHE_DEVICE_TYPES:
      return None
    return os.path.join(os.path.expanduser("~"), ".cache", "xladist", "xla-cache")
  if value.strip().lower() in _CACHE_OFF:
    return None
  return os.path.expanduser(value)


def _start_compile_cache(torch_xla, xr, device_type):
  """torch_xla's persistent compilation cache, on by default where it can be read.

  A program compiled once (same graph, shapes, shardings and devices) is read
  from disk by later runs instead of compiled again. Each host keeps its own
  (the default path is on the host's local disk).
  """
  if os.environ.get("XLA_PERSISTENT_CACHE_PATH") or (
    torch_xla._XLAC._xla_computation_cache_is_initialized()
  ):
    return
  path = compile_cache_path(device_type)
  if path is None:
    return
  if device_type not in COMPILE_CACHE_DEVICE_TYPES:
    warnings.warn(
      f"XLADIST_COMPILE_CACHE={os.environ.get('XLADIST_COMPILE_CACHE')!r}: torch_xla "
      f"2.9 on {device_type} writes compiled programs to the cache but cannot load "
      "them back, so every run compiles again and pays for the writes. Unset "
      "XLADIST_COMPILE_CACHE (no cache on this device) or set it to 'off'.",
      RuntimeWarning,
    )
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return  # an unwritable cache location costs compile time, nothing else
  xr.initialize_cache(path)


def num_devices():
  return initialize().num_devices


def device():
  """The torch device all SPMD tensors live on (torch_xla's virtual device)."""
  return initialize().device


# The torch device type string of this runtime's tensors.
DEVICE_KIND = "xla"


def is_device_tensor(tensor):
  """True for a tensor of this runtime's device, global or a step's local view."""
  return tensor.is_xla


def cores_per_replica(num_replicas=None):
  """How many devices (TF's logical devices, "cores") each replica spans.

  A strategy with R replicas on N devices gives each replica N / R devices.

  Raises:
    ValueError: R does not divide the number of devices.
  """
  n = num_devices()
  r = n if num_replicas is None else num_replicas
  if r < 1 or n % r:
    raise ValueError(
      f"{r} replicas cannot share this process's {n} XLA devices evenly: every "
      "replica spans the same number of devices (a divisor of the device count)."
    )
  return n // r


@functools.cache
def mesh(num_replicas=None):
  """The mesh of a strategy with `num_replicas` replicas (default: one per device).

  One device per replica: a 1-D mesh whose only axis is the replica axis. k > 1
  devices per replica: a (replicas, k) mesh named ("replica", "core"); replica r
  spans devices r*k .. r*k + k - 1. torch_xla 2.9 rejects a mesh over a subset of
  the devices, so the mesh always covers all of them.
  """
  import torch_xla.distributed.spmd as xs

  n = num_devices()
  k = cores_per_replica(num_replicas)
  if k == 1:
    return xs.Mesh(np.arange(n), (n,), (REPLICA_AXIS,))
  return xs.Mesh(np.arange(n), (n // k, k), (REPLICA_AXIS, CORE_AXIS))


def replica_groups(num_replicas=None, within=False):
  """The groups (global device ids) of a collective over the replicas or, with
  `within`, over each replica's devices.

  With k devices per replica there are k groups across replicas, one per core
  index: core c of every replica reduces with core c of the others.
  """
  n = num_devices()
  k = cores_per_replica(num_replicas)
  if within:
    return [list(range(r, r + k)) for r in range(0, n, k)]
  return [list(range(c, n, k)) for c in range(k)]


@functools.cache
def replicated_sharding(ndim):
  return mesh().get_op_sharding((None,) * ndim)


@functools.cache
def replica_sharding(ndim, num_replicas=None):
  """Dim 0 split over the replica axis, the other dims whole (and, with several
  devices per replica, the same on every device of a replica)."""
  return mesh(num_replicas).get_op_sharding((0,) + (None,) * (ndim - 1))


def sharding(ndim, num_replicas=None, split=True):
  """The OpSharding of an `ndim` tensor split along dim 0 over the replicas, or replicated."""
  return replica_sharding(ndim, num_replicas) if split else replicated_sharding(ndim)


@functools.cache
def device_sharding(num_replicas, ndim=1):
  """A tensor of one row per device (dim 0), row d on device d."""
  if cores_per_replica(num_replicas) == 1:
    return replica_sharding(ndim, num_replicas)
  return mesh(num_replicas).get_op_sharding(((0, 1),) + (None,) * (ndim - 1))


@functools.cache
def _replica_sharding_spec(ndim, num_replicas):
  import torch_xla.distributed.spmd as xs

  return xs.ShardingSpec(mesh(num_replicas), (0,) + (None,) * (ndim - 1))


@functools.cache
def _manual_sharding():
  import torch_xla
  import torch_xla.distributed.spmd as xs

  return torch_xla._XLAC.OpSharding([], [], [], xs.ShardingType.MANUAL)


@functools.cache
def _xlac():
  # Cached: called for every tensor a step enters or leaves (import statements
  # cost a sys.modules lookup each time).
  import torch_xla

  return torch_xla._XLAC


def place_replicated(tensor):
  """Copies `tensor` to the XLA device, replicated on every device of the mesh
  (a list: each of them, host tensors in one transfer call)."""
  if isinstance(tensor, (list, tuple)):
    return _replicate_many(tensor)
  t = tensor.detach()
  if t.device.type != "xla":
    t = t.to(device())
  _xlac()._xla_mark_sharding(t, replicated_sharding(t.dim()))
  return t


def ensure_sharded(tensor):
  """Marks an XLA tensor that carries no sharding as replicated (a no-op otherwise)."""
  x = _xlac()
  if x._get_xla_sharding_type(tensor) is None:
    x._xla_mark_sharding(tensor, replicated_sharding(tensor.dim()))
  return tensor


def place_split(tensor):
  """Puts a tensor of shape (R, ...) on the mesh of R replicas, row r on replica r.

  Each row of a host tensor is transferred straight to its device(s) (no
  replicate-then-reshard); a list of host tensors goes in one transfer call.
  """
  if isinstance(tensor, (list, tuple)):
    return _place_split_many(tensor)
  if tensor.device.type == "xla":
    _xlac()._xla_mark_sharding(tensor, replica_sharding(tensor.dim(), tensor.shape[0]))
    return tensor
  return _place_split_many([tensor])[0]


def place_per_device(tensor, num_replicas):
  """Puts a host tensor of shape (num_devices, ...) on the mesh, row d on device d."""
  t = tensor.to(device())
  _xlac()._xla_mark_sharding(t, device_sharding(num_replicas, t.dim()))
  return t


def _place_split_many(tensors):
  """`place_split` of several host tensors, all transferred in one call."""
  import torch_xla

  ts = [t.detach().contiguous() for t in tensors]
  specs = [_replica_sharding_spec(t.dim(), t.shape[0]).xla_spec(t) for t in ts]
  return torch_xla._XLAC._xla_tensors_from_aten(ts, [str(device())] * len(ts), specs)


def to_local(global_tensor):
  """Enters the manual region: each device gets its own shard of `global_tensor`.

  `global_tensor` must already carry a sharding (see place_* and ensure_sharded).
  """
  return _xlac()._spmd_full_to_shard_shape(global_tensor)


def value_id(tensor):
  """The id of the IR value (or device data) behind an XLA tensor: it changes when
  the tensor is written (in place, by `.data =`, or by a torch_xla kernel such as
  batch norm's running-statistics update, which does not bump `_version`)."""
  return _xlac()._unique_id_for_ir_and_data(tensor)


def creation_index(tensor=None):
  """torch_xla's id of an XLA tensor (ids grow with every tensor made), or
  (None) one larger than that of every XLA tensor made so far."""
  if tensor is None:
    import torch

    tensor = torch.empty((), device=device())
  return _xlac()._xla_get_tensor_id(tensor)


def to_global(local_tensor, op_sharding, full_shape):
  """Leaves the manual region: `local_tensor` becomes one shard of a global tensor."""
  x = _xlac()
  x._mark_manual_sharding(local_tensor, _manual_sharding())
  return x._spmd_shard_to_full_shape(local_tensor, op_sharding, full_shape, local_tensor.dtype)


def spmd_all_reduce(op_name, tensor, scale, groups):
  """An HLO all-reduce with global device ids (manual regions only).

  `op_name` is "sum", "min" or "max"; the result is multiplied by `scale`.
  `groups`: replica_groups(...) (across replicas) or replica_groups(...,
  within=True) (across one replica's devices).
  """
  return _xlac()._xla_spmd_all_reduce(op_name, tensor, scale, groups)


@contextlib.contextmanager
def no_execution():
  """Turns an attempted host read of a traced tensor into HostReadInStep."""
  x = _xlac()
  saved = x._get_allow_execution()
  x._set_allow_execution(False)
  try:
    yield
  except RuntimeError as e:
    if "Unexpected execution" in str(e):
      from xladist.runtime import host

      raise host.HostReadInStep(host.frame_outside(traceback.extract_tb(e.__traceback__))) from None
    raise
  finally:
    x._set_allow_execution(saved)


# runtime/host.py, imported when used: this module's device detection runs in
# a process that has imported neither torch nor xladist yet.
def call_with_timeout(fn, timeout_seconds, message):
  """runtime/host.py's bounded wait."""
  from xladist.runtime import host

  return host.call_with_timeout(fn, timeout_seconds, message)


def sync(tensors=None, boundary=True):
  """Cuts the pending graph and starts its execution (asynchronously).

  `boundary=False`: every pending tensor is cut without a MarkStep (no step
  closures, `boundary_count` unchanged; a sync of some tensors only would let
  torch_xla give their input buffers to the outputs while other pending
  tensors still read them)."""
  import torch_xla

  if not boundary:
    _xlac()._xla_sync_live_tensors("", [], wait=False)
  elif tensors is None:
    torch_xla.sync()
  else:
    _xlac()._xla_sync_multi(list(tensors), devices=[], wait=False)


def _wait_device_ops():
  import torch_xla.core.xla_model as xm

  xm.wait_device_ops()


def wait(timeout_seconds=None, what="the device's pending work"):
  """Blocks until every launched XLA execution has finished.

  With `timeout_seconds`, a TimeoutError is raised if the wait has not returned
  in time (the device work goes on; a later wait can still pick it up). On XLA
  a collective is part of a compiled program, so this is the only place a host
  can wait for one.

  Raises:
    TimeoutError: the work did not finish within `timeout_seconds`.
  """
  if timeout_seconds is None:
    _wait_device_ops()
    return
  call_with_timeout(
    _wait_device_ops,
    timeout_seconds,
    f"{what} did not finish within {timeout_seconds} s "
    "(CommunicationOptions.timeout_seconds); the device is still running it "
    "(e.g. a step whose collective waits for a replica). Raise "
    "timeout_seconds, or pass timeout_seconds=None to wait without a bound.",
  )


def replica_copies(tensor, num_replicas):
  """Each replica's copy of a replicated tensor, read from its first device (host tensors)."""
  sync([tensor])
  _wait_device_ops()
  k = cores_per_replica(num_replicas)
  by_device = {}
  for shard, name in _xlac()._get_local_shards([tensor])[0]:
    by_device[int(name.rsplit(":", 1)[1])] = shard
  return tuple(by_device[r * k] for r in range(num_replicas))


def cache_hits():
  """Programs read from the persistent compilation cache so far in this process."""
  import torch_xla.debug.metrics as met

  return met.counter_value("PersistentCacheHit") or 0


def compile_count():
  """Number of XLA compilations so far in this process (torch_xla's metrics)."""
  import torch_xla.debug.metrics as met

  data = met.metric_data("CompileTime")
  return 0 if data is None else data[0]


def execute_count():
  """Number of XLA executions so far in this process (torch_xla's metrics)."""
  import torch_xla.debug.metrics as met

  data = met.metric_data("ExecuteReplicatedTime") or met.metric_data("ExecuteTime")
  return 0 if data is None else data[0]


def hlo_text(tensors):
  """The (pre-partitioning) HLO of the pending graph that computes `tensors`.

  Waits for the executions in flight first: torch_xla 2.9 reads the device
  buffers of the graph's inputs, and one still being computed (the output of
  a replayed step, launched asynchronously) crashes the process (SIGSEGV).
  """
  wait()
  return _xlac()._get_xla_tensors_hlo(list(tensors))


# -- what other layers used to ask torch_xla for directly -------------------------------


def is_initialized():
  """True once a strategy started the runtime in this process."""
  return _state is not None


def device_type():
  """The device type this process would use (PJRT_DEVICE, else torch_xla's rule)."""
  return _detect_device_type()


def to_host(tensors):
  """CPU copies of XLA tensors, in one transfer call (pending ones computed once)."""
  return list(_xlac()._xla_get_cpu_tensors(list(tensors)))


def _replicate_many(tensors):
  """Host tensors -> XLA tensors replicated on every device, in one transfer call."""
  import torch_xla.distributed.spmd as xs

  m = mesh()
  ts = [t.detach().contiguous() for t in tensors]
  specs = [xs.ShardingSpec(m, (None,) * t.dim()).xla_spec(t) for t in ts]
  return _xlac()._xla_tensors_from_aten(ts, [str(device())] * len(ts), specs)


def process_devices():
  """(number of processes of the runtime, this process's index, this process's
  devices as torch_xla names them: "TPU:4", "CPU:0", ...); starts the runtime."""
  initialize()
  import torch_xla.runtime as xr

  return xr.process_count(), xr.process_index(), list(_xlac()._xla_get_runtime_devices())


def local_shards(tensor):
  """[(shard, device name)] of this host's shards of a global tensor."""
  return _xlac()._get_local_shards([tensor])[0]


def global_from_local_shards(shards, op_sharding, full_shape):
  """A global tensor from this host's CPU shards (one per local device)."""
  return _xlac()._global_tensor_from_cpu_shards(shards, op_sharding, full_shape)


def seed(running=False):
  """The runtime's RNG state (an int; None before a strategy started it), or
  (running=True) torch_xla's running seed, moved on by every random op traced."""
  if running:
    return _xlac()._xla_get_rng_seed()
  if _state is None:
    return None
  import torch_xla.core.xla_model as xm

  return int(xm.get_rng_state())


def set_seed(value, running=False):
  if running:
    _xlac()._xla_set_rng_seed(value, "")
    return
  import torch_xla.core.xla_model as xm

  xm.set_rng_state(int(value))


def checkpoint_planners():
  """(save planner, load planner, set_element) of torch.distributed.checkpoint
  for this runtime's sharded tensors (torch_xla's SPMD planners)."""
  from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner
  from torch_xla.experimental.distributed_checkpoint._helpers import set_element

  return SPMDSavePlanner, SPMDLoadPlanner, set_element


def empty_sharded_like(shape, dtype, like):
  """An uninitialised tensor of `shape` and `dtype` with the sharding of `like`."""
  import torch

  t = torch.empty(shape, dtype=dtype, device=like.device)
  _xlac()._xla_mark_sharding(t, _xlac()._get_xla_op_sharding(like))
  return t


def is_sharded(t):
  """Whether the XLA tensor `t` is split over the devices (not whole on each)."""
  import torch_xla.distributed.spmd as xs

  kind = _xlac()._get_xla_sharding_type(t)
  return kind is not None and xs.ShardingType(kind) in (
    xs.ShardingType.TILED,
    xs.ShardingType.PARTIAL,
  )


def sharding_spec(t):
  """The sharding of an XLA tensor as text ("" for a CPU tensor)."""
  if not t.is_xla:
    return ""
  return _xlac()._get_xla_sharding_spec(t)


def graph_hash(tensors):
  """The hash of the pending work that makes `tensors` (bytes)."""
  return _xlac()._get_graph_hash(list(tensors))


def on_boundary(callback):
  """Runs `callback()` when the next program of this process is cut (a step closure)."""
  import torch_xla.core.xla_model as xm

  xm.add_step_closure(callback)


def boundary_count():
  """How many times the graph was cut in this process (torch_xla's MarkStep count)."""
  value = _xlac()._xla_counter_value("MarkStep")
  return 0 if value is None else value


def require(api):
  """Every xladist API runs on torch_xla (the jax runtime refuses some)."""
  del api


REPLAY_KIND = "graph"  # runtime/xla_programs.py: a step's program is cut from its outputs

# Contract names defined in this runtime's other modules, bound when first read
# (PEP 562): this module's device detection runs in a process that has imported
# neither torch nor xladist (tests/test_runtime_detection.py).
_ELSEWHERE = {
  "HostReadInStep": "xladist.runtime.host",
  "PendingInput": "xladist.runtime.xla_programs",
  "host_work": "xladist.runtime.xla_programs",
  "in_traced_step": "xladist.runtime.xla_programs",
  "last_program": "xladist.runtime.xla_programs",
  "prepare_program": "xladist.runtime.xla_programs",
}


def __getattr__(name):
  where = _ELSEWHERE.get(name)
  if where is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(where), name)


def buffer_ids(tensors):
  """xla_programs.buffer_ids, waiting for the executions in flight before it
  reads a handle (a buffer still being computed has none: reading one crashes
  torch_xla 2.9)."""
  from xladist.runtime import xla_programs

  return xla_programs.buffer_ids(tensors, wait)


def run_program(program, consts, inputs, donate=()):
  """xla_programs.run_program on this runtime's device (whose pending work a
  donating run computes first), once the executions in flight have ended.

  One execution in flight, as torch_xla keeps it for traced programs (each holds
  the device until it ends). `_run_cached_graph` does not: replays launched back
  to back queued up, and on XLA:CPU a queue of programs with all-reduces aborted
  the process ("Expected 4 threads to join the rendezvous, but only 3 of them
  arrived"). The caller's host work before this call overlapped the previous
  program."""
  from xladist.runtime import xla_programs

  wait()
  return xla_programs.run_program(program, consts, inputs, donate, initialize().device_name)


def scalar_input(value, dtype):
  """A replay's scalar input (a hyperparameter's value): a replicated device
  scalar, as the traced graph's parameter was (a Python number torch_xla made
  device data)."""
  import torch

  return place_replicated(torch.tensor(value, dtype=dtype))


def foreign_idioms(handlers):
  """runtime/xla_idioms.py: torch_xla's xm.* idioms inside a traced step."""
  from xladist.runtime import xla_idioms

  return xla_idioms.foreign_idioms(handlers)


def traced_step(body):
  """Runs a step's phases: torch_xla records them lazily; the program is cut
  and run at the next sync."""
  with _torch_gru():
    return body()


def _restore_torch_gru():
  """Gives `torch.nn.GRU` back to torch.

  Importing torch_xla 2.9 replaces `torch.nn.GRU` with its scan-based subclass,
  whose forward runs torch_xla's scan whatever the device: a GRU made after the
  first strategy and run on the CPU (a reference model, an evaluation on the
  host) failed ("Expected all tensors in the given list to be XLA tensors"). A
  GRU made before, while torch_xla's class was in place, still works inside
  steps (`_torch_gru`).
  """
  import torch

  original = getattr(torch.nn.GRU, "_orig", None)
  if original is not None:
    torch.nn.GRU = original


@contextlib.contextmanager
def _torch_gru():
  """torch's own GRU forward while a step is traced.

  Importing torch_xla 2.9 replaces `torch.nn.GRU` with a scan-based subclass
  (`torch_xla.experimental.gru.GRU`). Its scan traces the cell ahead of time
  with fake tensors and AOT autograd, which reads values on the host inside a
  step's manual region; torch's forward computes the same values (the time
  loop unrolled into the step's program).
  """
  from torch.nn.modules import rnn
  from torch_xla.experimental import gru

  scan_forward = gru.GRU.__dict__.get("forward")
  gru.GRU.forward = rnn.GRU.forward
  try:
    yield
  finally:
    if scan_forward is None:
      del gru.GRU.forward
    else:
      gru.GRU.forward = scan_forward
