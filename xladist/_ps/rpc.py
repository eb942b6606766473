"""The parameter-server cluster on torch.distributed.rpc (TensorPipe).

Every task of a `chief` / `worker` / `ps` cluster joins one RPC group: the
chief is rank 0 and hosts the rendezvous (a TCPStore at the chief's address
from the cluster spec), workers follow by index, then the ps tasks. Tasks are
named as TF names them ("worker:1" for /job:worker/task:1).

A worker that died and is started again with the same command (TF's cluster
manager restarting a preempted worker) cannot take its old place: torch 2.9's
static group keeps the first incarnation's name and rank, and its gloo
barrier has passed. The new process joins as an extra member instead, with a
name and rank of its own ("worker:1_restart1", a rank past the static ones):
it starts its agent on a key space of its own in the chief's store (torch
refuses a dynamic agent in a static group's space), publishes its address in
the group's space, adds the chief and the ps tasks to its agent, and asks the
chief to add it (`_admit`). The task name stays the user's view: callers name
tasks, `route` maps a task to its current RPC name.

Remote functions never raise: they return `("ok", value)` or an error record
(see `error_record`), so an exception that reaches the caller of `call` /
`wait` is a transport failure (the task died, the connection broke, or the
call ran past its timeout), which `TaskUnavailableError` reports with the
task's name. Every wait here has a timeout.
"""

import pickle
import threading
import time
import traceback
import warnings

from xladist._ps import bind
from xladist.cluster_resolver import ClusterSpec

JOBS = ("chief", "worker", "ps")
DEFAULT_TIMEOUT = 60.0  # seconds: the default bound on one remote call


class TaskUnavailableError(RuntimeError):
  """A task of the cluster could not be reached (it died, or did not answer in time)."""

  def __init__(self, task, detail):
    super().__init__(f"{task_device(task)} is unavailable: {detail}")
    self.task = task
    self.detail = detail

  def __reduce__(self):
    return (type(self), (self.task, self.detail))


class RemoteTraceback(Exception):
  """The traceback of an exception raised in another task (its `__cause__`)."""

  def __str__(self):
    return self.args[0]


def task_name(job, index):
  return f"{job}:{index}"


def task_device(name):
  """ "worker:1" -> "/job:worker/replica:0/task:1" (TF's device name of the task)."""
  job, index = name.split(":")
  return f"/job:{job}/replica:0/task:{index}"


class Layout:
  """Who is who in a parameter-server cluster.

  Args:
    cluster_spec: a ClusterSpec (or dict) with one "chief" task, one or more
      "worker" tasks and one or more "ps" tasks (other jobs, e.g. "evaluator",
      are not part of the RPC group).
    api: the name of the calling API, for messages.

  Raises:
    ValueError: a job is missing or malformed.
  """

  def __init__(self, cluster_spec, api):
    spec = ClusterSpec(cluster_spec)
    jobs = spec.as_dict()
    for job in JOBS:
      if job not in jobs or not spec.num_tasks(job):
        raise ValueError(
          f"{api}: a parameter-server cluster needs the jobs 'chief' (one task: "
          "the coordinator), 'worker' and 'ps'; the cluster has "
          f"{spec.jobs}. Describe it with TF_CONFIG or a SimpleClusterResolver, e.g. "
          "{'chief': ['host:2222'], 'worker': ['host:2223', ...], 'ps': ['host:2225', ...]}."
        )
      if spec.task_indices(job) != list(range(spec.num_tasks(job))):
        raise ValueError(
          f"{api}: job {job!r} has the task indices {spec.task_indices(job)}; "
          "a parameter-server cluster needs tasks 0 .. n-1."
        )
    if spec.num_tasks("chief") != 1:
      raise ValueError(
        f"{api}: the cluster has {spec.num_tasks('chief')} chief tasks; it needs exactly one."
      )
    self.spec = spec
    self.chief_address = spec.task_address("chief", 0)
    self.num_workers = spec.num_tasks("worker")
    self.num_ps = spec.num_tasks("ps")
    self.world_size = 1 + self.num_workers + self.num_ps
    self.workers = [task_name("worker", i) for i in range(self.num_workers)]
    self.ps = [task_name("ps", i) for i in range(self.num_ps)]

  def rank(self, job, index):
    if job == "chief":
      return 0
    if job == "worker":
      return 1 + index
    return 1 + self.num_workers + index


_agent = {"name": None, "layout": None, "rpc_name": None, "restarted": False}
_agent_lock = threading.Lock()
# Guards the agent's member tables: torch 2.9 does not lock them in a static
# group, so adding a member must not race with a call looking one up.
_members_lock = threading.Lock()
_routes = {}  # task -> the RPC name of its current incarnation, where not the task's
_admitted = {"hook": None, "tasks": set()}
# torch 2.9's init_rpc prefixes the keys of a process's first RPC group with this.
_GROUP_PREFIX = "rpc_prefix_0"
_FORMED_KEY = "xladist_formed"


def current_task():
  """This process's task name, or None when it has not joined a cluster."""
  return _agent["name"]


def current_layout():
  """The Layout of the cluster this process joined, or None."""
  return _agent["layout"]


def route(task):
  """The RPC name of `task`'s current incarnation."""
  return _routes.get(task, task)


def set_route(task, rpc_name):
  _routes[task] = rpc_name


def restarted_tasks():
  """The tasks that rejoined the cluster as a new process (seen by the chief)."""
  return set(_admitted["tasks"])


def on_admit(hook):
  """Calls `hook(task, rpc_name)` when a restarted task rejoins (the chief's
  coordinator switches to it once its per-worker values are rebuilt). Without
  a hook, calls to the task go to the new process at once."""
  _admitted["hook"] = hook


def _admit(task, rpc_name, rank):
  """Remote function, on the chief: a restarted `task` joined as `rpc_name`."""
  import torch.distributed.rpc as rpc

  try:
    with _members_lock:
      agent = rpc.api._get_current_rpc_agent()
      agent._update_group_membership(rpc.WorkerInfo(rpc_name, rank), [], {}, True)
    _admitted["tasks"].add(task)
    hook = _admitted["hook"]
    if hook is None:
      set_route(task, rpc_name)
    else:
      hook(task, rpc_name)
    return ("ok", None)
  except Exception as e:  # noqa: BLE001 - returned to the caller as data
    return error_record(e, current_task() or "chief:0")


def start(layout, job, index, timeout_seconds, api):
  """Joins this process to the cluster's RPC group (blocks until every task joined).

  torch 2.9 forms a static RPC group with a gloo process group whose own wait
  is 30 minutes; the join runs in a helper thread so that `timeout_seconds`
  bounds it. A process joins one cluster in its life: a second static group
  in the same process hangs in gloo's rendezvous (its store keys no longer
  match fresh peers'; checked on torch 2.9), so it is refused.

  Raises:
    RuntimeError: this process already joined (or tried to join) a cluster.
    TimeoutError: the other tasks did not join within `timeout_seconds`.
  """
  import torch.distributed.rpc as rpc

  with _agent_lock:
    if _agent["name"] is not None or _agent.get("joined_before"):
      raise RuntimeError(
        f"{api}: this process already joined a parameter-server cluster (as "
        f"{_agent.get('joined_before')}); a process is one task of one cluster in "
        "its life (torch.distributed.rpc cannot form a second group with other "
        "peers in the same process). Start a new process for a new cluster."
      )
    name = task_name(job, index)
    _agent["joined_before"] = name
    bind.register_rendezvous()
    try:
      rejoin = job != "chief" and _cluster_formed(layout, timeout_seconds)
    except Exception as e:  # noqa: BLE001 - torch's store errors, reported as the join's
      raise TimeoutError(
        f"{api}: task {name} could not reach the cluster's rendezvous at "
        f"{layout.chief_address} within {timeout_seconds:.0f} s: {_short(e).rstrip('.')}. "
        "Start the chief (it hosts the rendezvous), check that its address is reachable, "
        "or raise the timeout."
      ) from None
    if rejoin and job == "ps":
      raise RuntimeError(
        f"{api}: the cluster at {layout.chief_address} already formed, so ps task "
        f"{name} is a restarted process; a ps task cannot rejoin (the variables it held "
        "are lost, as in TF, where a ps failure ends the program). Restart the whole "
        "cluster and restore the variables from a checkpoint."
      )
    options = rpc.TensorPipeRpcBackendOptions(
      # The store listens on the chief's address only (torch's tcp:// binds "::").
      init_method=f"{bind.SCHEME}://{layout.chief_address}",
      rpc_timeout=timeout_seconds,
      num_worker_threads=16,
    )
    # Set first: other tasks may call this one as soon as the group has formed.
    _agent["name"], _agent["layout"] = name, layout
    outcome = []

    def join():
      try:
        if rejoin:
          _rejoin(layout, name, options, timeout_seconds)
        else:
          with warnings.catch_warnings():
            # torch 2.9 warns about the gloo group rpc builds for its own barrier.
            warnings.simplefilter("ignore", UserWarning)
            rpc.init_rpc(
              name,
              rank=layout.rank(job, index),
              world_size=layout.world_size,
              rpc_backend_options=options,
            )
          _agent["rpc_name"] = name
          if job == "chief":
            # Tasks started from now on are restarted ones: they rejoin.
            rpc.api._get_current_rpc_agent().store.set(_FORMED_KEY, "1")
        outcome.append(None)
      except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
        outcome.append(e)

    thread = threading.Thread(target=join, name=f"xladist-join-{name}", daemon=True)
    start_time = time.monotonic()
    with bind.listen_on(layout.spec.task_address(job, index), api):
      thread.start()
      thread.join(timeout_seconds)
    waited = time.monotonic() - start_time
    if not outcome or outcome[0] is not None:
      _agent["name"], _agent["layout"] = None, None
      cause = "no answer" if not outcome else _short(outcome[0])
      raise TimeoutError(
        f"{api}: task {name} could not join the cluster at {layout.chief_address} "
        f"({waited:.1f} s waited, limit {timeout_seconds:.0f} s): {cause}. Start every "
        "task of the cluster (chief, workers and ps tasks, each with the same "
        "cluster spec), check that the chief's address is reachable, or raise the timeout."
      )


def _cluster_formed(layout, timeout):
  """Whether the chief's RPC group has formed (then this process is a restarted task)."""
  store = bind.client_store(layout.chief_address, timeout)
  try:
    return store.check([f"{_GROUP_PREFIX}/{_FORMED_KEY}"])
  finally:
    del store


def _rejoin(layout, name, options, timeout):
  """Joins a formed cluster as a new incarnation of task `name` (see the module doc)."""
  import torch.distributed as dist
  import torch.distributed.autograd as dist_autograd
  import torch.distributed.rpc as rpc

  store = bind.client_store(layout.chief_address, timeout)
  incarnation = store.add(f"xladist_incarnations/{name}", 1)
  rank = layout.world_size + store.add("xladist_extra_ranks", 1) - 1
  rpc_name = f"{name}_restart{incarnation}"
  own = dist.PrefixStore(f"xladist_rejoin_{rank}", store)
  # What rpc.init_rpc does, on a store of its own (torch 2.9 checks the group's
  # "static" flag in the store, which the first incarnation set).
  dist_autograd._init(rank)
  rpc._set_profiler_node_id(rank)
  rpc._init_rpc_backend(rpc.BackendType.TENSORPIPE, own, rpc_name, rank, None, options)
  store.set(f"{_GROUP_PREFIX}/addrs/{rpc_name}", own.get(f"addrs/{rpc_name}"))
  agent = rpc.api._get_current_rpc_agent()
  peers = [("chief:0", 0)] + [(p, layout.rank("ps", i)) for i, p in enumerate(layout.ps)]
  with _members_lock:
    for peer, peer_rank in peers:
      own.set(f"addrs/{peer}", store.get(f"{_GROUP_PREFIX}/addrs/{peer}"))
      agent._update_group_membership(rpc.WorkerInfo(peer, peer_rank), [], {}, True)
  _agent["rpc_name"], _agent["restarted"] = rpc_name, True
  result = call("chief:0", _admit, (name, rpc_name, rank), timeout, "rejoining the cluster")
  if result[0] != "ok":
    raise rebuild_error(result)


def stop(graceful=False, timeout=DEFAULT_TIMEOUT):
  """Leaves the RPC group.

  graceful=False leaves at once. TensorPipe (torch 2.9) then logs a "pipe
  closed" / "eof" warning in this task and in every peer for each connection
  it had, since only an agent that went through the group's shutdown barrier
  knows that closing pipes are expected. graceful=True is that barrier
  (`rpc.shutdown(graceful=True)`): every task of the cluster must call it,
  so it is used only when all of them are known to be up (the chief's
  `stop_cluster` checks); `timeout` bounds it, after which the task leaves
  anyway (a peer died meanwhile).

  Returns:
    Whether the task left quietly (graceful and in time).
  """
  import torch.distributed.rpc as rpc

  with _agent_lock:
    if _agent["name"] is None:
      return True
    _agent["name"] = None
    _agent["layout"] = None
    # A restarted task is no member of the static group's shutdown barrier.
    graceful = graceful and not _agent["restarted"]
    if not graceful:
      rpc.shutdown(graceful=False)
      return False
    outcome = []

    def leave():
      try:
        rpc.shutdown(graceful=True, timeout=timeout)
        outcome.append(True)
      except BaseException:  # noqa: BLE001 - torch still finalised the agent
        outcome.append(False)

    thread = threading.Thread(target=leave, name="xladist-leave", daemon=True)
    thread.start()
    thread.join(timeout + 5.0)
    return bool(outcome and outcome[0])


def call_async(task, fn, args=(), timeout=DEFAULT_TIMEOUT):
  """Starts `fn(*args)` on `task`; returns a torch Future (see `wait`)."""
  import torch.distributed.rpc as rpc

  try:
    with _members_lock:
      return rpc.rpc_async(route(task), fn, args=args, timeout=timeout)
  except RuntimeError as e:
    raise TaskUnavailableError(task, _short(e)) from None


def wait(task, future, what):
  """The value of a remote call started with `call_async` (its own timeout applies).

  Raises:
    TaskUnavailableError: the task failed or the call timed out.
  """
  try:
    return future.wait()
  except RuntimeError as e:
    raise TaskUnavailableError(task, f"{what} failed: {_short(e)}") from None


def call(task, fn, args=(), timeout=DEFAULT_TIMEOUT, what="a remote call"):
  return wait(task, call_async(task, fn, args, timeout), what)


def _short(e):
  text = str(e).strip().splitlines()
  return text[0] if text else type(e).__name__


# -- results of remote functions -----------------------------------------------


def error_record(exc, task, kind="fn"):
  """An exception raised in this task, as data the caller can rebuild.

  kind: "fn" (the user's function raised), or "ps" (a ps task could not be
  reached: `exc` is a TaskUnavailableError).
  """
  text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
  try:
    payload = pickle.dumps(exc)
    pickle.loads(payload)
  except Exception:  # noqa: BLE001 - an exception that cannot travel as itself
    payload = None
  return ("error", kind, task, payload, f"{type(exc).__name__}: {exc}", text)


def rebuild_error(record):
  """The exception of an `error_record`, with the remote traceback as its cause."""
  _, kind, task, payload, summary, text = record
  exc = None
  if payload is not None:
    try:
      exc = pickle.loads(payload)
    except Exception:  # noqa: BLE001
      exc = None
  if exc is None:
    exc = RuntimeError(f"{summary} (raised on {task_device(task)})")
  if kind == "ps" and not isinstance(exc, TaskUnavailableError):
    exc = TaskUnavailableError(getattr(exc, "task", task), str(exc))
  exc.__cause__ = RemoteTraceback(f"\n\nTraceback on {task_device(task)}:\n{text}")
  return exc
