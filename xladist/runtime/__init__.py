"""The runtime layer: what xladist asks of the machine that runs its programs.

Everything above this package (steps, strategies, input, checkpoints) reaches
devices, collectives and host transfers through the names bound here, never
through a runtime library directly (import-linter: only `xladist.runtime.xla`
imports torch_xla). Two runtimes exist, chosen by `XLADIST_BACKEND` when xladist
is imported:

* `xla` (runtime/xla.py, with runtime/xla_lowerings.py): torch_xla 2.9 in SPMD
  mode, one process per host, XLA:CPU or TPU. `XLADIST_BACKEND=torch_xla` (the
  default where torch_xla is installed) selects it;
* `jax_runtime` (runtime/jax_runtime.py, with runtime/torchax_fixes.py): JAX
  through torchax, XLA:CPU or NVIDIA GPUs, several processes through
  `jax.distributed`. `XLADIST_BACKEND=jax` (the default where torch_xla is not
  installed) selects it.

What a runtime provides (the interface; each name below is bound from the
selected runtime module):

* start and devices: `initialize`, `is_initialized`, `device_type`,
  `num_devices`, `device`, `cores_per_replica`, `mesh`, `runtime_devices`,
  `addressable_device_count`, `process_count_index`;
* placement of global values: `place_replicated`, `place_split`,
  `place_split_many`, `place_per_device`, `ensure_sharded`, `replicate_many`,
  shardings (`replicated_sharding`, `replica_sharding`), replica groups
  (`replica_groups`, `core_groups`), per-host shards (`local_shards`,
  `global_from_local_shards`);
* one region (the step's replica-local view): `to_local`, `to_global`,
  `spmd_all_reduce` (the collective inside it), `no_execution` with
  `HostReadInStep` (host reads refused while a step is traced), tensor
  identities (`ir_id`, `tensor_id`, `next_tensor_id`);
* host transfers and step boundaries: `is_device_tensor` (whether a tensor is
  on the runtime's device, global or a step's local view, rather than on the
  host; `DEVICE_KIND` is the torch device type of such tensors), `to_host`
  (one batch), `sync`, `wait`, `call_with_timeout`, `replica_copies`;
* counters and program text: `compile_count`, `execute_count`, `cache_hits`,
  `hlo_text`, `at_next_sync`; what a step's program depends on: `sharding_spec`,
  `graph_hash`;
* random state: `rng_seed` / `set_rng_seed` (the seed), `running_seed` /
  `set_running_seed` (what traced random ops move on), `sync_count`;
* the runtime's own idioms made safe inside a step: `patched`;
* sharded checkpoints: `checkpoint_planners` (torch.distributed.checkpoint
  planners for the runtime's tensors), `empty_sharded_like`, `is_sharded`;
* diagnostics: `user_frame`;
* `native`: the runtime library's own bindings, used only by the replay of
  traced programs (`_replay.py`), a torch_xla feature no other runtime has.

The interface still carries torch_xla's lazy-tensor shape (`ir_id`,
`to_local` per tensor while the step is traced); docs/architecture.md ("The
runtime layer") says what a runtime that compiles a step from its explicit
inputs (jax.jit of a shard_map; TorchTPU on DTensor) needs in addition.
"""

import importlib.util
import os

BACKENDS = ("torch_xla", "jax")


def _default_backend():
  """torch_xla where it is installed, else jax."""
  try:
    found = importlib.util.find_spec("torch_xla") is not None
  except ImportError:  # an import hook that refuses it
    found = False
  return "torch_xla" if found else "jax"


BACKEND = os.environ.get("XLADIST_BACKEND", "") or _default_backend()

if BACKEND == "jax":
  from xladist.runtime import jax_runtime as _backend
else:
  from xladist.runtime import xla as _backend

INTERFACE = (
  "initialize",
  "is_initialized",
  "device_type",
  "num_devices",
  "device",
  "DEVICE_KIND",
  "is_device_tensor",
  "cores_per_replica",
  "mesh",
  "runtime_devices",
  "addressable_device_count",
  "process_count_index",
  "place_replicated",
  "place_split",
  "place_split_many",
  "place_per_device",
  "ensure_sharded",
  "replicate_many",
  "replicated_sharding",
  "replica_sharding",
  "replica_groups",
  "core_groups",
  "local_shards",
  "global_from_local_shards",
  "to_local",
  "to_global",
  "spmd_all_reduce",
  "no_execution",
  "HostReadInStep",
  "ir_id",
  "tensor_id",
  "next_tensor_id",
  "to_host",
  "sync",
  "wait",
  "call_with_timeout",
  "replica_copies",
  "compile_count",
  "execute_count",
  "cache_hits",
  "hlo_text",
  "running_seed",
  "set_running_seed",
  "sync_count",
  "rng_seed",
  "set_rng_seed",
  "patched",
  "user_frame",
  "native",
  "checkpoint_planners",
  "sharding_spec",
  "graph_hash",
  "at_next_sync",
  "empty_sharded_like",
  "is_sharded",
  "traced_step",
  "REPLAY_KIND",
  "last_program",
  "in_traced_step",
  "run_program_steps",
  "stack_steps",
  "require",
  "run_program",
  "with_scalars",
  # torch_xla's device detection and compile-cache rules (tests read them)
  "compile_cache_path",
  "COMPILE_CACHE_DEVICE_TYPES",
  "REPLICA_AXIS",
  "CORE_AXIS",
)


def _check_backend():
  if BACKEND not in BACKENDS:
    raise RuntimeError(
      f"xladist: XLADIST_BACKEND={BACKEND!r} names no runtime of this release; the "
      f"runtimes are {', '.join(BACKENDS)}. Unset the variable (torch_xla where it is "
      "installed, else jax) or set it to one of them."
    )


def initialize():
  """Starts the selected runtime once per process (runtime/xla.py, runtime/jax_runtime.py)."""
  _check_backend()
  return _backend.initialize()


globals().update({name: getattr(_backend, name) for name in INTERFACE if name != "initialize"})
