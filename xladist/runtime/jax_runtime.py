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

Replay (_step/replay.py) works here too: the runtime hands over the program a
step ran and its inputs (`REPLAY_KIND = "program"`), across several processes
too (a traced and a replayed step dispatch the same compiled program); the
step's scalar constants are inputs of a replay like its arrays (`last_program`,
`scalar_input`), packed into the program's constants when one changed. Not on
this runtime (each refused with an error that names it): several devices per
replica (TPUStrategy's logical devices), CentralStorageStrategy, ParameterServerStrategy, sharded
(torch.distributed.checkpoint) checkpoints.

This module is the one runtime/__init__.py binds: it holds step boundaries
(`sync`, `wait`), counters, program text, random state and what only torch_xla
has, and re-exports the rest of the interface from the modules below it (each
imports only those listed after it):

* jax_programs.py: building, caching and running a step's program
  (`traced_step`, and the replay's `last_program`, `run_program`, ...);
* jax_step.py: the step's trace (`to_local`, `to_global`, `spmd_all_reduce`,
  `no_execution`, tensor identities);
* jax_devices.py: starting jax and torchax (`initialize`), devices, the mesh,
  placement and host transfers; the runtime's state lives there.
"""

import contextlib

import numpy as np

from xladist.runtime.host import HostReadInStep, call_with_timeout  # noqa: F401  (interface)
from xladist.runtime.jax_devices import (  # noqa: F401  (interface)
  CORE_AXIS,
  DEVICE_KIND,
  REPLICA_AXIS,
  _counts,
  _peer_lost,
  _rt,
  cores_per_replica,
  device,
  device_type,
  ensure_sharded,
  global_from_local_shards,
  initialize,
  is_device_tensor,
  is_initialized,
  local_shards,
  mesh,
  num_devices,
  place_per_device,
  place_replicated,
  place_split,
  process_devices,
  replica_copies,
  replica_groups,
  sharding,
  to_host,
)
from xladist.runtime.jax_programs import (  # noqa: F401  (interface)
  PendingInput,
  _last_outputs,
  _last_program,
  _run_sync_callbacks,
  host_work,
  last_program,
  on_boundary,
  prepare_program,
  run_program,
  scalar_input,
  traced_step,
)
from xladist.runtime.jax_step import (  # noqa: F401  (interface)
  _Ident,
  buffer_ids,
  creation_index,
  in_traced_step,
  no_execution,
  optimization_barrier_,
  spmd_all_gather,
  spmd_all_reduce,
  spmd_reduce_scatter,
  to_global,
  to_local,
  value_id,
)

COMPILE_CACHE_DEVICE_TYPES = ()
REPLAY_KIND = "program"  # replay.py: the runtime hands over the program and its inputs

# -- what a step's program depends on; sharded checkpoints -----------------------------


def empty_sharded_like(shape, dtype, like):
  raise _no_sharded_checkpoints()


def is_sharded(t):
  return bool(is_device_tensor(t) and not t._elem.sharding.is_fully_replicated)


def held_bytes(t):
  """The bytes of a device tensor on its fullest device: its addressable shards
  per device (a host tensor: its own size)."""
  if not is_device_tensor(t):
    return t.numel() * t.element_size()
  per_device = {}
  for shard in t._elem.addressable_shards:
    per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


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


# -- step boundaries and counters -----------------------------------------------------

_pending = []  # what the last `sync(tensors)` named: `wait` waits for it too


def sync(tensors=None, boundary=True):
  """Nothing to cut: a jax step is dispatched when it is traced. The next
  `wait` also waits for `tensors` (eager results, e.g. a reduction outside a
  step), as torch_xla's wait after `sync(tensors)` does. `boundary=False`:
  nothing is pending, nothing to do."""
  if not boundary:
    return
  _counts["sync"] += 1
  if tensors:
    jax = _rt().jax
    _pending[:] = [
      t._elem for t in tensors if is_device_tensor(t) and not isinstance(t._elem, jax.core.Tracer)
    ]
  _run_sync_callbacks()


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


def boundary_count():
  return _counts["sync"]


def hlo_text(tensors):
  """The (pre-partitioning) HLO of the last step program run, the program that
  computed `tensors` (a jax step has run by the time its outputs exist)."""
  last = _last_program[0]
  if last is None:
    return ""
  program, packed, key, args = last
  if program.hlo is None:
    lowered = program.jitted.lower(packed[0], packed[1], key, *args)
    program.hlo = lowered.as_text(dialect="hlo")
  return program.hlo


# -- random numbers ----------------------------------------------------------------------


def _key_to_int(key):
  jax = _rt().jax
  data = np.asarray(jax.random.key_data(key)).astype(np.uint64).reshape(-1)
  value = 0
  for word in data:
    value = (value << 32) | int(word)
  return value


def seed(running=False):
  """The runtime's random-number state as an int (the torchax key's bits; None
  before a strategy started the runtime), or (running=True) the key the next
  step's random ops start from (compared by identity)."""
  if running:
    return _Ident(_rt().env.param.prng)
  if not is_initialized():
    return None
  return _key_to_int(_rt().env.param.prng)


def set_seed(value, running=False):
  rt = _rt()
  if running:
    if isinstance(value, _Ident):
      rt.env.param.prng = value.target
    else:
      rt.env.manual_seed(int(value))
    return
  jax = rt.jax
  words = np.array([(int(value) >> 32) & 0xFFFFFFFF, int(value) & 0xFFFFFFFF], dtype=np.uint32)
  rt.env.param.prng = jax.random.wrap_key_data(words, impl="threefry2x32")


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
def foreign_idioms(handlers):
  """jax has no per-process collective idioms users port into a step: nothing to route."""
  del handlers
  yield


def compile_cache_path(device_type=None, environ=None):  # noqa: F811  (runtime/xla_compile_cache.py's signature)
  return None
