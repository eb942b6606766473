"""The runtime contract: what the step engine and every layer above it ask of a runtime.

A runtime is a module that provides the operations of `Runtime` (the core),
`ProgramReplay` (running a step's program again without tracing it),
`ShardedCheckpoints` (torch.distributed.checkpoint of global tensors) and
`Diagnostics` (counters and program text for tests and benchmarks) as
module-level functions. `xladist/runtime/__init__.py` binds exactly these names
from the selected runtime; `tests/runtime_contract/` says, operation by
operation, what each must do (values checked against plain torch on the CPU),
and runs on every runtime. A runtime may refuse a capability it lacks with
`require` (a clear error naming the API) rather than leave it half done.

Vocabulary (the same on every runtime):

* a *device tensor* is a `torch.Tensor` whose data lives on the runtime's
  devices; a *global* tensor is one value over all devices of the strategy
  (replicated: whole on each; split: dimension 0 cut into one block per
  replica); a *local* tensor is one replica's view inside a step;
* a *step* is the work `strategy.run` traces into one program; its *region* is
  where local tensors exist (entered with `to_local`, left with `to_global`);
* a *boundary* is the point where the host hands the work recorded so far to
  the devices as a program (`sync`); what a runtime does between boundaries
  (record lazily, trace and compile, run eagerly) is its own business;
* a *value id* names the value a tensor holds now: it changes whenever the
  tensor is given a new value (assignment, in-place op, `.data =`), however the
  runtime implements writes; a *buffer id* names the device memory a computed
  value lives in (two tensors sharing one buffer have one buffer id).

Nothing here names a runtime library: torch_xla's lazy tensors (IR ids, graph
cuts, its module attributes, its C++ bindings) stay inside runtime/xla.py and
its modules; jax's jit and shard_map inside runtime/jax_runtime.py and its
modules. docs/architecture.md ("The runtime layer and its contract"; "TorchTPU on
paper") maps each operation to torch_xla, jax and TorchTPU.
"""

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Runtime(Protocol):
  """The core: devices, placement, the step's region, host transfers and
  boundaries, counters and random state (40 operations and 2 attributes).

  Attributes:
    DEVICE_KIND: the torch device type of the runtime's tensors ("xla", "jax").
    HostReadInStep: the exception raised when a step's traced value is read on
      the host while the step is traced (`no_execution`).
  """

  DEVICE_KIND: str
  HostReadInStep: type

  # -- devices and mesh --------------------------------------------------------------------
  def initialize(self) -> None:
    """Starts the runtime in this process (once; later calls do nothing)."""

  def is_initialized(self) -> bool:
    """Whether `initialize` ran in this process."""

  def device_type(self) -> str:
    """The kind of device this process uses ("CPU", "TPU", "GPU", ...). A
    runtime that must start to know it starts (jax: its platform is known once
    `jax.distributed` has joined the processes); torch_xla answers from the
    environment without starting."""

  def num_devices(self) -> int:
    """Devices of the whole job (every process)."""

  def device(self) -> Any:
    """The torch device global tensors are made on."""

  def cores_per_replica(self, num_replicas: int | None = None) -> int:
    """Devices one replica spans (1 unless a replica is a logical device of
    several cores, as with TPUStrategy's device assignments)."""

  def process_devices(self) -> tuple:
    """(number of processes, this process's index, names of this process's
    devices as "<PLATFORM>:<global index>"); starts the runtime."""

  def replica_groups(self, num_replicas: int | None = None, within: bool = False) -> list:
    """Device groups of an all-reduce: across replicas (one group of every
    replica's device) or, with `within`, across one replica's cores."""

  # -- placement of global values ----------------------------------------------------------
  def is_device_tensor(self, tensor) -> bool:
    """Whether `tensor` lives on the runtime's devices (global or local)."""

  def place_replicated(self, tensor):
    """A host tensor (or a list of them, in one transfer) as global tensors
    whole on every device."""

  def place_split(self, tensor):
    """A host tensor (or a list) split along dimension 0 into one block per
    replica (the dimension's size is the number of replicas)."""

  def place_per_device(self, tensor, num_replicas: int):
    """A host tensor of one row per device, each row on its device (a replica
    of several cores gets its row on each of them)."""

  def ensure_sharded(self, tensor):
    """A device tensor with a placement the step can enter (a tensor computed
    without one is given the replicated placement)."""

  def sharding(self, ndim: int, num_replicas: int | None = None, split: bool = True):
    """The runtime's placement object for an `ndim` tensor: split along
    dimension 0 over the replicas, or (split=False) replicated."""

  def sharding_spec(self, tensor) -> str:
    """How a tensor is placed, as text ("" for a host tensor): equal texts mean
    equal placements (the step's signature keys on it)."""

  def held_bytes(self, tensor) -> int:
    """The bytes of `tensor` that the fullest device holds (its shard, or the
    whole tensor where it is replicated), read from the runtime's placement."""

  def local_shards(self, tensor) -> list:
    """[(host tensor, device name)] of this process's blocks of a global tensor."""

  def global_from_local_shards(self, shards, sharding, full_shape):
    """The global tensor whose blocks on this process's devices are `shards`
    (host tensors, one per local device, in `process_devices` order)."""

  # -- the step's region -------------------------------------------------------------------
  def traced_step(self, body):
    """Runs `body()`, which traces one step (entering the region, `fn`,
    leaving it): the runtime records the step as one program."""

  def to_local(self, tensor):
    """Inside a step: each replica's block of a global tensor (its local view)."""

  def to_global(self, tensor, sharding, full_shape):
    """Inside a step: the global tensor of which the local `tensor` is each
    replica's block (`sharding` from `sharding(...)`)."""

  def spmd_all_reduce(self, op_name: str, tensor, scale: float, groups: list):
    """Inside a step: the all-reduce ("sum", "min", "max") of a local tensor
    over `groups`, times `scale`: a collective of the step's program."""

  def spmd_reduce_scatter(self, tensor, scale: float, groups: list):
    """Inside a step: each replica's (n, ...) local `tensor` summed over the n
    replicas of `groups`, times `scale`; replica r gets row r of the sum (a
    reduce-scatter of the step's program)."""

  def spmd_all_gather(self, tensor, replica_id, groups: list):
    """Inside a step: the local `tensor` of each of the n replicas of `groups`,
    stacked (n, ...) on every replica (an all-gather of the step's program;
    `replica_id`: the step's traced replica index, for a runtime that composes
    it of other collectives)."""

  def optimization_barrier_(self, tensors: list) -> None:
    """Inside a step: each of `tensors` (local values) now holds its output of
    one XLA optimization barrier over all of them: the same values, but XLA may
    not move a computation that uses one of them to before the others exist, nor
    merge it with one that uses the tensors from before the barrier. In place,
    and unseen by autograd (the gradient passes through unchanged)."""

  def no_execution(self):
    """A context manager: reading a traced value on the host inside it raises
    `HostReadInStep` naming the user's line (never a hang or a wrong value)."""

  def foreign_idioms(self, handlers: dict):
    """A context manager: while a step is traced, the runtime library's own
    per-process idioms that users port from its one-process-per-device model
    (its collectives, syncs, ordinals) take xladist's meaning or are refused
    with an error naming the replacement. `handlers` says what xladist means:
    {"replica_context": () -> the ReplicaContext of the step's replica
    function, or None outside it; "select_own": (stacked, replica id) -> the
    replica's own row; "reduce_ops": {"sum" | "min" | "max": ReduceOp}}. A
    runtime whose library has no such idioms does nothing."""

  def value_id(self, tensor):
    """The id of the value `tensor` holds now (see the vocabulary)."""

  def creation_index(self, tensor=None):
    """When `tensor`'s value was made, as a token: equal for the same value
    object, and ordered against the mark `creation_index()` taken as a step's
    trace begins: `creation_index(t) < mark` exactly for the tensors whose
    value existed before the step began (torch_xla: its tensor ids, which grow
    with every tensor made; jax: whether the value is a traced one)."""

  # -- host transfers and boundaries -------------------------------------------------------
  def to_host(self, tensors) -> list:
    """Host (CPU) copies of device tensors, in one transfer."""

  def replica_copies(self, tensor, num_replicas: int) -> tuple:
    """Host copies of each replica's copy of a replicated global tensor, read
    from the replica's (first) device: copies written with aggregation NONE
    may differ, and this shows how."""

  def sync(self, tensors=None, boundary: bool = True) -> None:
    """Starts the work recorded so far (all of it, or what `tensors` need) on
    the devices without waiting. `boundary=False`: start all of it without
    counting a boundary (no step closures run, `boundary_count` unchanged)."""

  def wait(self, timeout_seconds: float | None = None, what: str = "") -> None:
    """Blocks until the work started so far has finished (TimeoutError naming
    `what` after `timeout_seconds`)."""

  def boundary_count(self) -> int:
    """How many boundaries this process has passed."""

  def on_boundary(self, callback) -> None:
    """Calls `callback()` once, at the next boundary."""

  # -- counters ----------------------------------------------------------------------------
  def compile_count(self) -> int:
    """Programs compiled by this process so far (a cache hit compiles nothing)."""

  def graph_hash(self, tensors) -> bytes:
    """A key of the work that makes `tensors` (equal keys: the same program)."""

  # -- random state ------------------------------------------------------------------------
  def seed(self, running: bool = False):
    """The runtime's random seed as an int (None before `initialize`), or
    (running=True) the running seed the next traced random op draws from (a
    value `set_seed(..., running=True)` takes back; jax: the key's identity)."""

  def set_seed(self, value, running: bool = False) -> None:
    """Sets what `seed(running)` returns."""

  # -- capabilities ------------------------------------------------------------------------
  def require(self, api: str) -> None:
    """Raises NotImplementedError naming `api` and what to use instead when
    this runtime cannot run it; returns otherwise."""


@runtime_checkable
class ProgramReplay(Protocol):
  """Running a traced step's program again on new inputs (replay.py), without
  tracing `fn` (7 operations and 2 attributes).

  Attributes:
    PendingInput: the exception `run_program` raises for an input still being
      computed.
    REPLAY_KIND: "graph" (the runtime records a step lazily: the program is
      cut from the outputs the engine names, `last_program(outputs)`) or
      "program" (the runtime traced and ran the step as a program of its own:
      `last_program()` hands it over with its inputs and results).
  """

  REPLAY_KIND: str
  PendingInput: type

  def in_traced_step(self) -> bool:
    """Whether a step is being traced inside another program (steps traced as
    one program): such a step has no program of its own."""

  def buffer_ids(self, tensors) -> list:
    """The buffer id of each tensor's value, or None for a value still being
    computed (recorded but not yet run)."""

  def last_program(self, outputs=None) -> tuple:
    """The program of the step just traced: (program, consts, inputs, results).
    "graph": the program computing `outputs` (compiled now), consts None,
    inputs its parameters (device tensors, in order), results the outputs it
    computes (each once, in order), `program.seed_inputs` the indices of the
    random seed's parameters. "program": the program the runtime ran, its
    packed constants, its input arrays followed by one host tensor per scalar
    constant (the step's Python numbers, which a replay feeds as inputs), and
    its result arrays."""

  def prepare_program(self, program, consts, donate) -> None:
    """Compiles now what `run_program(program, consts, inputs, donate)` runs
    (the capture calls it: no replay compiles). "graph": nothing to do (the
    capture's first run compiles the program); "program": the variant of the
    program that gives up the inputs at `donate`."""

  def run_program(self, program, consts, inputs, donate=()) -> list:
    """Runs `program` (from `last_program`) on `inputs`; its results. Raises
    `PendingInput` (an attribute of the runtime) when an input is still being
    computed. `donate`: positions of inputs the caller never reads again (state
    the results replace): the runtime may write the results into their buffers
    (donation), first copying an input another tensor still shares. "graph": the
    positions are fixed by the program's first run, which compiles it;
    "program": honoured once `prepare_program` compiled them."""

  def host_work(self):
    """A context for a replay's bookkeeping on host tensors (step counters,
    hyperparameter values): whatever the runtime routes every torch op through
    is set aside inside (jax: torchax's modes, about 20 µs per op otherwise);
    only host tensors are touched in it."""

  def scalar_input(self, value, dtype):
    """A hyperparameter's current value as `run_program` takes it among its
    inputs. "graph": a replicated device scalar of `dtype`, as the traced
    graph's parameter; "program": the number itself (the runtime packs the
    program's scalars, transferring them when one changed)."""


@runtime_checkable
class ShardedCheckpoints(Protocol):
  """torch.distributed.checkpoint of global tensors (3 operations)."""

  def checkpoint_planners(self) -> tuple:
    """(save planner class, load planner class, set_element) of
    torch.distributed.checkpoint for the runtime's global tensors; a runtime
    without sharded checkpoints raises a RuntimeError naming the dense form."""

  def empty_sharded_like(self, shape, dtype, like):
    """An uninitialised global tensor placed as `like`, to load into (refused
    like `checkpoint_planners` where sharded checkpoints are)."""

  def is_sharded(self, tensor) -> bool:
    """Whether a global tensor is split over devices (not whole on each)."""


@runtime_checkable
class Diagnostics(Protocol):
  """What tests and benchmarks read (no layer above the runtime uses them; 3
  operations)."""

  def execute_count(self) -> int:
    """Programs executed by this process so far."""

  def cache_hits(self) -> int:
    """Programs this process found compiled (in memory or the persistent cache)."""

  def hlo_text(self, tensors) -> str:
    """The HLO text (an "HloModule", before partitioning) of the program that
    computes `tensors`: the pending work that makes them ("graph" form) or the
    last step program run, which made them ("program" form)."""


PROTOCOLS = (Runtime, ProgramReplay, ShardedCheckpoints, Diagnostics)


def operations(protocol):
  """The names a runtime module must define for `protocol` (methods and attributes)."""
  names = [n for n in protocol.__dict__ if not n.startswith("_")]
  names += list(getattr(protocol, "__annotations__", {}))
  return tuple(dict.fromkeys(names))


def missing(module):
  """The contract's names `module` lacks (empty for a complete runtime)."""
  return [n for p in PROTOCOLS for n in operations(p) if not hasattr(module, n)]
