"""Multi-host initialisation: a cluster resolver's cluster -> the runtime's multi-host runtime.

xladist runs one process per host and ONE SPMD program over a mesh of every
host's devices; the collectives between hosts are torch_xla's (PJRT's), nothing
is home-made. What this module does is tell torch_xla, before its runtime
starts, which hosts form the job and which one this process is, and check
afterwards that the runtime agrees with the cluster resolver.

How torch_xla 2.9 forms a multi-host runtime (read from its source; the PJRT
client is created the first time an XLA device is touched):

* XLA:CPU: the PJRT CPU client gets a device count (`CPU_NUM_DEVICES`) and no
  distributed options, so a process is always a runtime of its own
  (`xr.process_count() == 1`). Only single-worker clusters can run on it.
* TPU: libtpu's PJRT client finds the other hosts of the slice itself, from
  the TPU VM's environment (the VM metadata, or the variables
  `TPU_WORKER_ID` and `TPU_WORKER_HOSTNAMES` that GKE sets and that torch_xla's
  own TPU helpers read too). The client's creation waits until every host has
  joined.
* PJRT plugins (`PJRT_DYNAMIC_PLUGINS=1`, a plugin whose
  `requires_xla_coordinator()` is true): torch_xla starts its coordinator (XLA's
  distributed runtime service, run by process 0) from the torchrun-style
  variables `RANK`, `WORLD_SIZE`, `LOCAL_RANK` / `PJRT_LOCAL_PROCESS_RANK`,
  `LOCAL_WORLD_SIZE` / `PJRT_LOCAL_PROCESS_COUNT`, `MASTER_ADDR` and
  `XLA_COORDINATOR_PORT` (default 8547).

On the jax runtime (`XLADIST_BACKEND=jax`, runtime/jax_runtime.py) any
device type, XLA:CPU included, forms a multi-host runtime: `runtime_env`
gives it the coordinator (the chief's address), the process count and this
process's index, from which it calls `jax.distributed.initialize` (gloo
collectives on CPU) when it starts. Its collectives never return when a peer
died or stopped, so there every step and reduction of a multi-host strategy
is waited for with a bound (`wait_for_step`, `wait_for_hosts`), and an error
of the runtime becomes one that names the other hosts.

The mapping from a cluster to these settings (`cluster_info`, `runtime_env`,
`apply_env`, `check_runtime`, `local_shard_rows`) is made of pure functions so
that it can be tested without a second host. Process order: the "chief" task
(if the cluster has one) is process 0, then the "worker" tasks by index, as in
TF's MultiWorkerMirroredStrategy; the chief's (else worker 0's) address is the
coordinator's.
"""

import dataclasses
import math
import os
import threading

from xladist import cluster_resolver as resolvers
from xladist import runtime as _runtime
from xladist.input.sharding import host_replica_ids

DEFAULT_JOIN_TIMEOUT_SECONDS = 600.0
COORDINATOR_DEFAULT_PORT = "8547"  # torch_xla 2.9's XlaCoordinator default

_lock = threading.Lock()
_process_cluster = None  # the ClusterInfo this process joined, once a strategy did
_host_timeout = DEFAULT_JOIN_TIMEOUT_SECONDS  # bound of xladist's host waits on a cluster


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
  """What a cluster resolver says about the hosts of a job.

  Attributes:
    num_workers: the number of hosts (processes) that run the SPMD program.
    task_index: this process's index among them (0 .. num_workers - 1).
    is_chief: whether this process is the chief (`cluster_resolver.is_chief`).
    hosts: the hosts' addresses ("host:port" or "host") in process order.
    coordinator: the chief's (else worker 0's) address, or None for one host.
    task: this process's (task_type, task_id) in the resolver's terms.
  """

  num_workers: int
  task_index: int
  is_chief: bool
  hosts: tuple
  coordinator: object
  task: tuple


def cluster_info(cluster_resolver, api):
  """Validates `cluster_resolver` and describes its cluster as a `ClusterInfo`.

  An empty cluster (no TF_CONFIG, `SimpleClusterResolver({})`) is one host.
  Otherwise the cluster needs a "worker" or "chief" job; "evaluator" tasks may
  be listed (they are not part of the job); other jobs are refused.

  Raises:
    TypeError: `cluster_resolver` is not a `ClusterResolver`.
    ValueError: the cluster has no worker or chief, has jobs this strategy
      cannot run ("ps"), more than one chief, gaps in the worker indices, or
      does not contain this process's task; or this task is an evaluator.
  """
  if not isinstance(cluster_resolver, resolvers.ClusterResolver):
    raise TypeError(
      f"{api}(cluster_resolver=...): expected an xladist.cluster_resolver."
      "ClusterResolver (TFConfigClusterResolver, SimpleClusterResolver, "
      f"TPUClusterResolver) or None, got {type(cluster_resolver).__name__} "
      f"{cluster_resolver!r:.80}."
    )
  spec = cluster_resolver.cluster_spec()
  task_type, task_id = cluster_resolver.task_type, cluster_resolver.task_id
  if not spec:
    return ClusterInfo(1, 0, True, (), None, (task_type, task_id))
  jobs = spec.as_dict()
  where = f"{api}: the cluster {jobs}"
  other = sorted(set(jobs) - {"chief", "worker", "evaluator"})
  if other:
    raise ValueError(
      f"{where} has the job(s) {other}; this strategy runs every host as a "
      '"chief" or "worker" task of one synchronous job (parameter servers '
      "are ParameterServerStrategy's). Remove them from the cluster."
    )
  if "chief" not in jobs and "worker" not in jobs:
    raise ValueError(
      f'{where} has no "worker" or "chief" job; list the hosts as '
      '{"worker": ["host0:port", "host1:port", ...]}.'
    )
  chiefs = spec.task_indices("chief") if "chief" in jobs else []
  if chiefs and chiefs != [0]:
    raise ValueError(
      f"{where} has the chief tasks {chiefs}; a cluster has at most "
      'one chief, task 0 of job "chief".'
    )
  workers = spec.task_indices("worker") if "worker" in jobs else []
  if workers != list(range(len(workers))):
    raise ValueError(
      f"{where} has the worker indices {workers}; they must be 0 .. "
      f"{len(workers) - 1} without gaps."
    )
  if task_type is None or task_id is None:
    raise ValueError(
      f"{where} does not say which task this process is (task_type="
      f'{task_type!r}, task_id={task_id!r}); set TF_CONFIG\'s "task" or the '
      "resolver's task_type and task_id."
    )
  if task_type == "evaluator":
    raise ValueError(
      f"{api}: this process is the evaluator task, which is not part of the "
      "training job; evaluate with a single-host strategy there "
      "(MirroredStrategy or OneDeviceStrategy)."
    )
  if task_type not in ("chief", "worker"):
    raise ValueError(
      f"{where}: this process's task type {task_type!r} is not "
      '"chief" or "worker"; fix the resolver\'s task_type.'
    )
  indices = chiefs if task_type == "chief" else workers
  if task_id not in indices:
    raise ValueError(
      f"{where} has no task {task_id} in job {task_type!r} (its tasks are "
      f"{indices}); fix the resolver's task_id (TF_CONFIG's \"task\" index)."
    )
  hosts = tuple(
    [spec.task_address("chief", 0) for _ in chiefs]
    + [spec.task_address("worker", i) for i in workers]
  )
  for address in hosts:
    split_address(address, api)
  index = task_id + len(chiefs) if task_type == "worker" else 0
  return ClusterInfo(
    len(hosts),
    index,
    resolvers.is_chief(cluster_resolver),
    hosts,
    hosts[0] if len(hosts) > 1 else None,
    (task_type, task_id),
  )


def split_address(address, api):
  """("host", "port" or None) of "host:port", "host", "[v6]:port" or "[v6]".

  Raises:
    ValueError: the address is empty or its port is not a number in 1..65535.
  """
  if not address:
    raise ValueError(
      f"{api}: a task of the cluster has an empty address; give every host as 'host:port'."
    )
  if address.startswith("["):
    host, sep, rest = address.partition("]")
    host += sep
    if rest and not rest.startswith(":"):
      raise ValueError(f"{api}: the address {address!r} is malformed; expected '[ipv6]:port'.")
    port = rest[1:] or None
  elif address.count(":") == 1:
    host, port = address.split(":")
  else:
    host, port = address, None
  if not host or (port is not None and not (port.isdigit() and 0 < int(port) < 65536)):
    raise ValueError(f"{api}: the address {address!r} is not 'host:port' with a port in 1..65535.")
  return host, port


def _truthy(value):
  return str(value).strip().lower() in ("1", "true", "yes")


def runtime_env(cluster, device_type, api, environ=None, backend=None):
  """The environment variables that make the runtime (torch_xla 2.9, or jax) join `cluster`.

  One host: nothing (the runtime starts on its own, as today).

  On the jax runtime (`backend` "jax"; default: `xladist.runtime.BACKEND`),
  for any device type: `XLADIST_JAX_COORDINATOR` (the chief's "host:port"; port
  8547 if the address has none), `XLADIST_JAX_NUM_PROCESSES` and
  `XLADIST_JAX_PROCESS_ID`, from which runtime/jax_devices.py calls
  `jax.distributed.initialize` (gloo collectives on CPU). `device_type` is not
  used there, so it may be a function that returns it (asking the jax runtime
  its device type starts it, which must happen after these variables are set).

  On torch_xla: TPU: `TPU_WORKER_ID` and `TPU_WORKER_HOSTNAMES` (the slice is
  formed by libtpu). A PJRT plugin with `PJRT_DYNAMIC_PLUGINS=1` in `environ`:
  the torchrun-style variables torch_xla's coordinator reads, one process per
  host, the coordinator at the chief's address.

  Raises:
    NotImplementedError: on torch_xla, several hosts on XLA:CPU (torch_xla
      2.9's CPU client is local to one process), or on a device type torch_xla
      forms no multi-host runtime for.
  """
  environ = os.environ if environ is None else environ
  if cluster.num_workers == 1:
    return {}
  n, i = cluster.num_workers, cluster.task_index
  if (_runtime.BACKEND if backend is None else backend) == "jax":
    host, port = split_address(cluster.coordinator, api)
    return {
      "XLADIST_JAX_COORDINATOR": f"{host}:{port or COORDINATOR_DEFAULT_PORT}",
      "XLADIST_JAX_NUM_PROCESSES": str(n),
      "XLADIST_JAX_PROCESS_ID": str(i),
    }
  if callable(device_type):
    device_type = device_type()
  if device_type == "CPU":
    raise NotImplementedError(
      f"{api}: the cluster has {n} hosts {list(cluster.hosts)}, but this process "
      "runs on XLA:CPU, whose PJRT client in torch_xla 2.9 is local to one process "
      "(no cross-process collectives). Run a single-worker cluster on XLA:CPU (no "
      "TF_CONFIG, or one task), or run the hosts on TPU."
    )
  if device_type == "TPU":
    return {
      "TPU_WORKER_ID": str(i),
      "TPU_WORKER_HOSTNAMES": ",".join(split_address(h, api)[0] for h in cluster.hosts),
    }
  if not _truthy(environ.get("PJRT_DYNAMIC_PLUGINS", "")):
    raise NotImplementedError(
      f"{api}: the cluster has {n} hosts, and torch_xla 2.9 forms a multi-host "
      f"runtime on TPU or through a PJRT plugin that uses its coordinator, not on "
      f"PJRT_DEVICE={device_type!r} without PJRT_DYNAMIC_PLUGINS=1. Run on TPU, or "
      "load the device's PJRT plugin (torch_xla.experimental.plugins)."
    )
  host, port = split_address(cluster.coordinator, api)
  return {
    "RANK": str(i),
    "WORLD_SIZE": str(n),
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",  # one process per host
    "PJRT_LOCAL_PROCESS_RANK": "0",
    "PJRT_LOCAL_PROCESS_COUNT": "1",
    "MASTER_ADDR": host,
    "XLA_COORDINATOR_PORT": port or COORDINATOR_DEFAULT_PORT,
  }


def apply_env(values, environ, api):
  """Sets `values` in `environ`; a variable already set to another value is an error.

  Returns:
    The names that were set (not already there with the same value).

  Raises:
    ValueError: `environ` sets one of the variables to another value (checked
      for all of them before any is set).
  """
  for name, value in values.items():
    current = environ.get(name)
    if current not in (None, "") and current != value:
      raise ValueError(
        f"{api}: the environment sets {name}={current!r}, but the cluster resolver "
        f"makes this process {name}={value!r}. Unset {name} (xladist sets it from "
        'the resolver), or fix the resolver (TF_CONFIG\'s "cluster" and '
        '"task") so that both describe the same host.'
      )
  changed = [name for name, value in values.items() if environ.get(name) != value]
  for name in changed:
    environ[name] = values[name]
  return changed


def _runtime_name():
  """The runtime library's name, for messages."""
  return "jax" if _runtime.BACKEND == "jax" else "torch_xla"


def check_runtime(cluster, process_count, process_index, api):
  """Raises RuntimeError unless the runtime's process count and index match `cluster`."""
  name = _runtime_name()
  described = (
    f"the cluster resolver describes {cluster.num_workers} host(s)"
    f"{' ' + str(list(cluster.hosts)) if cluster.hosts else ''} with this "
    f"process as host {cluster.task_index}"
  )
  if process_count != cluster.num_workers:
    if process_count == 1:
      fix = (
        f"{name} started a runtime of this process alone: it was started "
        "before the strategy (create the multi-host strategy before any other "
        "strategy or XLA tensor), or the device type has no multi-host runtime."
      )
    else:
      fix = (
        f"{name} joined a runtime of several processes (e.g. a TPU pod "
        "slice): describe all of its hosts, e.g. with "
        "cluster_resolver.TPUClusterResolver() or a TF_CONFIG listing each host."
      )
    raise RuntimeError(
      f"{api}: {described}, but {name}'s runtime has {process_count} process(es). {fix}"
    )
  if process_index != cluster.task_index:
    raise RuntimeError(
      f"{api}: {described}, but {name}'s runtime numbers this process "
      f"{process_index}. The resolver's host order must be the runtime's process "
      "order (the chief first, then the workers by index; on TPU the TPU worker "
      'ids): fix the task index (TF_CONFIG\'s "task" or TPU_WORKER_ID).'
    )


def _join_message(cluster, api, timeout_seconds, env):
  set_vars = ", ".join(f"{k}={v}" for k, v in env.items()) or "nothing"
  return (
    f"{api}: {_runtime_name()}'s multi-host runtime did not start within "
    f"{timeout_seconds:g} s. This process is host {cluster.task_index} of "
    f"{cluster.num_workers} {list(cluster.hosts)}; coordinator (chief) "
    f"{cluster.coordinator}; xladist set {set_vars}. Check that every host started "
    "the same program with its own task index, that the chief is reachable from "
    "this host (address and port open), and that no host failed at start-up (its "
    "log). Hosts that start slowly: raise CommunicationOptions(timeout_seconds=...)."
  )


def _process_count_index():
  return _runtime.process_devices()[:2]


def _start_jax(cluster, api, timeout, env):
  """Starts the jax runtime, joining the cluster within `timeout` seconds.

  The runtime starts in this thread, not in a helper one as torch_xla's:
  torchax's torch modes (`torchax.enable_globally()`) are thread-local, so it
  must start in the thread that runs the program. The jax runtime bounds its
  own join (`XLADIST_JAX_JOIN_TIMEOUT`, set here); its TimeoutError becomes
  one that names the cluster.
  """
  os.environ["XLADIST_JAX_JOIN_TIMEOUT"] = str(max(1, math.ceil(timeout)))
  try:
    return _process_count_index()
  except TimeoutError as e:
    raise TimeoutError(f"{_join_message(cluster, api, timeout, env)} ({e})") from e


def initialize(cluster_resolver, api, timeout_seconds=None):
  """Starts the runtime (torch_xla's, or jax's) for the resolver's cluster (once per process).

  Call it before `_runtime.initialize()` (a multi-host strategy's constructor
  does). One host: `_runtime.initialize()` as for any strategy. Several hosts:
  the variables of `runtime_env` are set, then the runtime is started and
  waited for at most `timeout_seconds` (default 600 s): torch_xla's in a
  helper thread, jax's in this one (`_start_jax`). Either way the runtime's
  process count and index are checked against the resolver.

  Returns:
    The `ClusterInfo`.

  Raises:
    TypeError, ValueError: as `cluster_info` and `apply_env`.
    NotImplementedError: as `runtime_env`.
    TimeoutError: the other hosts did not join in time.
    RuntimeError: the runtime disagrees with the resolver, or this
      process already joined another multi-host cluster.
  """
  global _process_cluster
  cluster = cluster_info(cluster_resolver, api)
  with _lock:
    previous = _process_cluster
    if (
      previous is not None
      and previous.num_workers > 1
      and (previous.hosts, previous.task_index) != (cluster.hosts, cluster.task_index)
    ):
      raise RuntimeError(
        f"{api}: this process already joined the cluster {list(previous.hosts)} as "
        f"host {previous.task_index}; torch_xla's runtime cannot be started again "
        "for another cluster. Reuse that cluster's resolver."
      )
    if cluster.num_workers > 1:
      # The device type only where the rules need it: asking the jax runtime
      # starts it, which must come after its variables are set.
      env = runtime_env(cluster, _runtime.device_type, api)
    if cluster.num_workers > 1 and not _runtime.is_initialized():
      apply_env(env, os.environ, api)
      timeout = DEFAULT_JOIN_TIMEOUT_SECONDS if timeout_seconds is None else timeout_seconds
      if _runtime.BACKEND == "jax":
        count, index = _start_jax(cluster, api, timeout, env)
      else:
        count, index = _runtime.call_with_timeout(
          _process_count_index, timeout, _join_message(cluster, api, timeout, env)
        )
    else:
      # One host, or the runtime already started (checked against the cluster below).
      count, index = _process_count_index()
    check_runtime(cluster, count, index, api)
    _process_cluster = cluster
    if timeout_seconds is not None:
      global _host_timeout
      _host_timeout = timeout_seconds
  return cluster


def host_timeout():
  """How long xladist's own host waits may last: None (unbounded) in a one-host
  process; on several hosts the multi-host strategy's
  `CommunicationOptions.timeout_seconds` (default 600 s), since a host that died
  or stalled would leave the others waiting in a collective forever."""
  cluster = _process_cluster
  if cluster is None or cluster.num_workers == 1:
    return None
  return _host_timeout


def wait_for_hosts(tensors, what):
  """Runs the programs that make `tensors` and waits, bounded by `host_timeout()`.

  A no-op on one host (the read that follows waits as usual).

  Raises:
    TimeoutError: naming `what`, the hosts and what to check.
    RuntimeError: the runtime reported an error for the programs (a
      collective lost another host), naming `what` and the other hosts.
  """
  timeout = host_timeout()
  if timeout is None or not tensors:
    return
  _runtime.sync(list(tensors))
  _host_wait(timeout, what)


def wait_for_step(what):
  """Waits for the last step's program, bounded by `host_timeout()` (a no-op
  on one host). On the jax runtime a multi-host strategy calls it after each
  step: a collective whose peer died or stopped never returns there (gloo),
  and every later program of this process, reductions included, would queue
  behind it, so the first wait must be this bounded one.

  Raises:
    TimeoutError, RuntimeError: as `wait_for_hosts`.
  """
  timeout = host_timeout()
  if timeout is None:
    return
  _host_wait(timeout, what)


def _other_hosts(cluster):
  return [h for i, h in enumerate(cluster.hosts) if i != cluster.task_index]


def _host_wait(timeout, what):
  """`_runtime.wait` bounded by `timeout`; an error of the runtime becomes a
  RuntimeError that says which hosts this one was waiting for."""
  cluster = _process_cluster
  try:
    _runtime.wait(
      timeout,
      f"{what} (on the hosts {list(cluster.hosts)}: a host "
      "that stopped or is slower holds up the collectives of every step; "
      "check that host's log)",
    )
  except TimeoutError:
    raise
  except Exception as e:
    detail = str(e).strip().splitlines()
    raise RuntimeError(
      f"{what} failed on host {cluster.task_index} of {cluster.num_workers} "
      f"({cluster.hosts[cluster.task_index]}, task {cluster.task[0]} {cluster.task[1]}): "
      f"{_runtime_name()}'s collectives lost another host of the cluster "
      f"{_other_hosts(cluster)}: it died, was killed or closed its connections. "
      "Check that host's log, then restart the job on every host (from the last "
      f"checkpoint). The runtime reported {type(e).__name__}: "
      f"{detail[0] if detail else ''}"
    ) from e


def process_cluster():
  """The `ClusterInfo` this process joined, or None if no multi-host strategy was made."""
  return _process_cluster


def process_is_chief():
  """Whether this process is the chief: True unless it joined a cluster as a non-chief."""
  cluster = _process_cluster
  return cluster is None or cluster.is_chief


# -- input placement ------------------------------------------------------------------


def _device_ids(device_names, api):
  """Global device ids from torch_xla's device names ("TPU:4" -> 4)."""
  try:
    return [int(str(name).rsplit(":", 1)[1]) for name in device_names]
  except (IndexError, ValueError):
    raise RuntimeError(
      f"{api}: cannot read device ids from torch_xla's local devices {list(device_names)}."
    ) from None


def local_shard_rows(local_device_names, replica_ids, api="xladist", cores_per_replica=1):
  """Which row of this host's input goes to each local device, in device order.

  Replica r is devices r*k .. r*k + k - 1 of the mesh (global device ids; k =
  `cores_per_replica`), so the host feeding replicas `replica_ids` must own
  exactly those devices; torch_xla wants one shard per local device in the
  order of `_xla_get_runtime_devices()` ("TPU:4", ...: global ids).

  Raises:
    RuntimeError: the local devices are not the host's replicas' devices.
  """
  ids = _device_ids(local_device_names, api)
  start, k = replica_ids[0], cores_per_replica
  expected = [r * k + c for r in replica_ids for c in range(k)]
  if sorted(ids) != expected:
    raise RuntimeError(
      f"{api}: this host feeds replicas {list(replica_ids)} (hosts feed consecutive "
      f"blocks of replicas in host order), so it should have the XLA devices "
      f"{expected}, but its devices are {sorted(ids)}: "
      "torch_xla numbered the devices of the hosts in another order than the "
      "cluster resolver numbers the hosts. Order the resolver's hosts like the "
      "runtime's processes (TPUClusterResolver() on a TPU slice)."
    )
  return [i // k - start for i in ids]


def place_host_rows(tensors, replica_ids, num_replicas):
  """This host's rows -> global tensors split over the replica axis.

  `tensors` are host tensors of shape (len(replica_ids), ...) whose row i is
  replica `replica_ids[i]`'s. With every replica local (one host) this is
  exactly `_runtime.place_split(tensors)`. Otherwise each row goes to
  its own (local) device and the global tensor of shape (num_replicas, ...)
  is assembled by torch_xla from the hosts' shards (`_global_tensor_from_cpu_
  shards`); rows of other hosts never leave those hosts.
  """
  if len(replica_ids) == num_replicas:
    return _runtime.place_split(tensors)
  order = local_shard_rows(
    _runtime.process_devices()[2],
    replica_ids,
    cores_per_replica=_runtime.cores_per_replica(num_replicas),
  )
  return from_local_shards(tensors, order, num_replicas)


def local_components(stacked, replica_ids, num_replicas):
  """Replica r's row of a global (num_replicas, ...) tensor, for r in `replica_ids`.

  Read from this host's own device buffers (torch_xla's local shards), so no
  other host takes part and no program runs beyond the pending one that makes
  `stacked` (which every host runs, as for any read of a step's output). With
  k devices per replica the row is read from the replica's first device.

  Raises:
    RuntimeError: a replica of `replica_ids` has no device on this host.
  """
  return tuple(row.squeeze(0) for row in _local_shard_of(stacked, replica_ids, num_replicas))


def local_copies(tensor, replica_ids, num_replicas):
  """Replica r's copy of a replicated (mirrored) tensor, for r in `replica_ids`,
  read from this host's own device buffers as `local_components` (a host
  reads only its own replicas' copies)."""
  return _local_shard_of(tensor, replica_ids, num_replicas)


def _local_shard_of(tensor, replica_ids, num_replicas):
  """The host copies of `tensor`'s shards on the first device of each replica of `replica_ids`."""
  _runtime.sync([tensor])
  what = "experimental_local_results: the step that makes the value"
  if host_timeout() is None:
    _runtime.wait(None, what)
  else:
    _host_wait(host_timeout(), what)
  k = _runtime.cores_per_replica(num_replicas)
  shards = _runtime.local_shards(tensor)
  rows = {}
  for (shard, _), device_id in zip(
    shards, _device_ids([d for _, d in shards], "experimental_local_results")
  ):
    rows.setdefault(device_id // k, shard)
  missing = [r for r in replica_ids if r not in rows]
  if missing:
    raise RuntimeError(
      f"experimental_local_results: replicas {missing} have no device on this host "
      f"(its devices hold replicas {sorted(rows)})."
    )
  return tuple(rows[r] for r in replica_ids)


def from_local_shards(tensors, order, num_replicas):
  """Global (num_replicas, ...) tensors from this host's rows, row `order[d]` on local device d."""
  out = []
  for t in tensors:
    t = t.detach().contiguous()
    shards = [t[i : i + 1] for i in order]
    out.append(
      _runtime.global_from_local_shards(
        shards, _runtime.sharding(t.dim(), num_replicas), [num_replicas] + list(t.shape[1:])
      )
    )
  return out


def host_replicas(cluster, num_replicas, api):
  """The replica ids `cluster`'s host feeds (None with one host: all of them).

  Raises:
    ValueError: the replicas cannot be spread evenly over the hosts.
  """
  if cluster.num_workers == 1:
    return None
  if num_replicas % cluster.num_workers:
    raise ValueError(
      f"{api}: {num_replicas} replicas cannot be spread evenly over "
      f"{cluster.num_workers} hosts; every host must have the same number of XLA "
      "devices."
    )
  return host_replica_ids(cluster.num_workers, cluster.task_index, num_replicas)


def default_resolver(device_type):
  """The resolver of `MultiWorkerMirroredStrategy(cluster_resolver=None)`.

  TF_CONFIG's cluster (`TFConfigClusterResolver`); on TPU when TF_CONFIG names
  no cluster, the TPU slice itself (`TPUClusterResolver()`), since libtpu joins
  every host of the slice into the runtime anyway.

  `device_type` may be a function that returns it: it is then asked only when
  TF_CONFIG names no cluster (asking the jax runtime starts it, which must
  wait until a TF_CONFIG cluster's variables are set).
  """
  resolver = resolvers.TFConfigClusterResolver()
  if resolver.cluster_spec():
    return resolver
  if callable(device_type):
    device_type = device_type()
  if device_type == "TPU":
    return resolvers.TPUClusterResolver()
  return resolver
