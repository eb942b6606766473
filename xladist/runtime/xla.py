"""The torch_xla runtime: the contract's operations (runtime/contract.py) on
torch_xla 2.9 in SPMD mode: devices, meshes, manual regions, collectives' lowering,
host transfers, counters and RNG state.

runtime/__init__.py binds the contract's names from this module when torch_xla
is the selected runtime. The rest of the torch_xla runtime is in its own modules,
which this one imports or re-exports:

* xla_start.py: starting torch_xla once per process (`initialize`), and the
  runtime's state (`num_devices`, `device`);
* xla_device_detection.py: which device torch_xla runs on (TPU or XLA:CPU),
  decided without importing torch;
* xla_compile_cache.py: the persistent compilation cache (`compile_cache_path`);
* xla_logs.py: the level of XLA's C++ log, set when this module is imported;
* xla_gru.py: torch's GRU where torch_xla puts its scan-based one;
* xla_programs.py: replay's side (`last_program`, `run_program`, ...);
* xla_idioms.py: torch_xla's xm.* idioms inside a traced step;
* xla_lowerings.py: ops torch_xla has no lowering for, composed of ops it lowers.

These are the only modules of xladist that import torch_xla (import-linter's
"only the torch_xla runtime imports torch_xla" contract): everything else
reaches them through the facade `xladist.runtime` (see its docstring).

Facts this module relies on (torch 2.9.0 + torch_xla 2.9.0, checked by spikes
recorded in docs/architecture.md):

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
import traceback

import numpy as np

from xladist.runtime import host, xla_programs
from xladist.runtime.host import HostReadInStep, call_with_timeout  # noqa: F401  (interface)
from xladist.runtime.xla_compile_cache import (  # noqa: F401  (this runtime's own names)
  COMPILE_CACHE_DEVICE_TYPES,
  compile_cache_path,
)
from xladist.runtime.xla_device_detection import detect_device_type
from xladist.runtime.xla_gru import torch_gru
from xladist.runtime.xla_logs import quiet_xla_logs
from xladist.runtime.xla_programs import (  # noqa: F401  (interface)
  PendingInput,
  host_work,
  in_traced_step,
  last_program,
  prepare_program,
)
from xladist.runtime.xla_start import (  # noqa: F401  (interface)
  device,
  initialize,
  is_initialized,
  num_devices,
)

# When xladist is imported: before torch_xla's C++ library logs for the first time.
quiet_xla_logs()

REPLICA_AXIS = "replica"
CORE_AXIS = "core"


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


def spmd_reduce_scatter(tensor, scale, groups):
  """A reduce-scatter with global device ids (`_xla_spmd_reduce_scatter`, which
  works in a manual region, unlike torch_xla's classic collectives)."""
  n = tensor.shape[0]
  rows = _xlac()._xla_spmd_reduce_scatter("sum", tensor.reshape(-1), scale, 0, n, groups)
  return rows.view(tensor.shape[1:])


def spmd_all_gather(tensor, replica_id, groups):
  """torch_xla 2.9 has no all-gather with global device ids (its classic
  `_xla_all_gather` fails in an SPMD program: "replica_id < replica_count"):
  each replica's value in its own row of zeros, summed by one all-reduce (n
  times the bytes of an all-gather)."""
  import torch

  n = len(groups[0])
  rows = torch.arange(n, device=tensor.device, dtype=replica_id.dtype)
  mask = (rows == replica_id).view((n,) + (1,) * tensor.dim())
  expanded = tensor.unsqueeze(0).expand((n,) + tuple(tensor.shape))
  stacked = torch.where(mask, expanded, torch.zeros_like(expanded))
  out = _xlac()._xla_spmd_all_reduce("sum", stacked.reshape(-1), 1.0, groups)
  return out.view(stacked.shape)


def optimization_barrier_(tensors):
  """torch_xla's in-place `_xla_optimization_barrier_` (its FSDP's own tool)."""
  _xlac()._xla_optimization_barrier_(list(tensors))


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
      raise host.HostReadInStep(host.frame_outside(traceback.extract_tb(e.__traceback__))) from None
    raise
  finally:
    x._set_allow_execution(saved)


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


def device_type():
  """The device type this process would use (PJRT_DEVICE, else torch_xla's rule)."""
  return detect_device_type()


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
  if not is_initialized():
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


def held_bytes(t):
  """The bytes of an XLA tensor on its fullest device, from its sharding: a tiled
  tensor holds one tile per device (ceil of each dimension over its tiles), a
  replicated or unsharded one the whole tensor."""
  import re

  whole = t.numel() * t.element_size()
  if not t.is_xla:
    return whole
  spec = _xlac()._get_xla_sharding_spec(t)
  m = re.search(r"devices=\[([0-9,]+)\]", spec)
  if not m:
    return whole
  tiles = [int(x) for x in m.group(1).split(",")]
  if "last_tile_dim_replicate" in spec or len(tiles) > t.dim():
    tiles = tiles[: t.dim()]
  held = t.element_size()
  for size, n in zip(t.shape, tiles + [1] * (t.dim() - len(tiles))):
    held *= -(-size // n)
  return held


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


def buffer_ids(tensors):
  """xla_programs.buffer_ids, waiting for the executions in flight before it
  reads a handle (a buffer still being computed has none: reading one crashes
  torch_xla 2.9)."""
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
  with torch_gru():
    return body()
