"""`Server`: one task (a worker or a ps task) of a parameter-server cluster.

TF's `tf.distribute.Server`: each worker and ps process of a
`ParameterServerStrategy` cluster starts one and calls `join()`; all the
training program runs on the chief, which sends the workers the functions to
run and the ps tasks the variables to hold. Here a server is a member of the
cluster's torch.distributed.rpc group (TensorPipe): the chief hosts the
rendezvous at its address in the cluster spec; a ps task answers variable
reads and updates (`xladist/_ps/task.py`); a worker runs scheduled functions on
its XLA device(s) (`xladist/coordinator/_worker.py`).

Security: trusted networks only. A scheduled function and its arguments are
pickled Python that a worker unpickles and runs, so anyone who can connect to
a task's ports (the rendezvous store at the chief's address, every task's RPC
listeners) can run code in it, as with TF's servers (TF's SECURITY.md). Each
task listens only on its own address from the cluster spec (the interface
holding it), not on every interface; see `xladist/_ps/bind.py`.

A worker that dies can be started again with the same command: it rejoins the
cluster as a new incarnation of its task, and the chief's coordinator rebuilds
its per-worker datasets and values there and uses it again (TF's cluster
manager restarting a preempted worker). A restarted ps task is refused: its
variables are lost.

Example, on each worker and ps host (TF_CONFIG names the task)::

  import xladist as xd
  resolver = xd.cluster_resolver.TFConfigClusterResolver()
  server = xd.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                     task_index=resolver.task_id)
  server.join()   # returns when the chief shuts the cluster down (or is gone)
"""

import os
import threading
import time

from xladist import runtime as _runtime
from xladist._ps import rpc as _rpc
from xladist.cluster_resolver import ClusterSpec

_stop_event = threading.Event()
_stop = {"graceful": False}  # how the chief asked this task to leave
_POLL_SECONDS = 1.0  # how often join() checks that the chief is still there
LEAVE_SECONDS = 30.0  # bound on the quiet (graceful) leaving of the RPC group


def _stop_server(graceful=False):
  """Remote function: the chief ends the cluster; `graceful`: every task is
  up, so all of them leave through the RPC group's shutdown barrier."""
  _stop["graceful"] = bool(graceful)
  _stop_event.set()
  return ("ok", None)


def _alive():
  """Remote function: answers the chief's and the servers' liveness checks."""
  return ("ok", _rpc.current_task())


class Server:
  """Starts a worker or ps task of a parameter-server cluster in this process.

  Security: run a cluster on a trusted network only. What the chief sends is
  pickled Python that this task runs, so whoever can reach its ports can run
  code in it (TF's servers are the same). The task listens on its address
  from the cluster spec only, not on every interface: give each task the
  address of its private interface there.

  Args:
    server_or_cluster_def: the cluster: a `cluster_resolver.ClusterSpec` or a
      dict {"chief": [...], "worker": [...], "ps": [...]} of "host:port"
      addresses (the chief's address is the rendezvous of the cluster).
    job_name: "worker" or "ps".
    task_index: this task's index in its job.
    protocol: accepted for TF's signature; "grpc" or None (the transport is
      torch.distributed.rpc's TensorPipe).
    config: accepted for TF's signature (ignored).
    start: start the task now (else call `start()`).
    timeout_seconds: how long `start()` waits for the whole cluster to join.

  Raises:
    ValueError: the cluster is not a parameter-server cluster, or the job or
      task is not in it (the chief runs the coordinator, not a Server).
    TypeError: an argument has the wrong type.
    RuntimeError: (at start) a ps task started after the cluster formed: a
      restarted ps task cannot rejoin (its variables are lost). A restarted
      worker rejoins.
  """

  def __init__(
    self,
    server_or_cluster_def,
    job_name=None,
    task_index=None,
    protocol=None,
    config=None,
    start=True,
    *,
    timeout_seconds=600.0,
  ):
    del config
    if protocol not in (None, "grpc"):
      raise ValueError(
        f"xladist.Server(protocol={protocol!r}): the tasks talk over "
        "torch.distributed.rpc (TensorPipe); pass None or 'grpc'."
      )
    if not isinstance(server_or_cluster_def, (ClusterSpec, dict)):
      raise TypeError(
        "xladist.Server: server_or_cluster_def must be a ClusterSpec or a dict of "
        f"job -> addresses, got {type(server_or_cluster_def).__name__}."
      )
    self._layout = _rpc.Layout(server_or_cluster_def, "xladist.Server")
    if job_name not in ("worker", "ps"):
      raise ValueError(
        f"xladist.Server(job_name={job_name!r}): a Server runs a 'worker' or a 'ps' "
        "task; the chief runs the training program and joins the cluster when it "
        "creates ParameterServerStrategy."
      )
    tasks = self._layout.num_workers if job_name == "worker" else self._layout.num_ps
    if isinstance(task_index, bool) or not isinstance(task_index, int):
      raise TypeError(
        f"xladist.Server(task_index={task_index!r}): task_index must be an int in 0 .. {tasks - 1}."
      )
    if not 0 <= task_index < tasks:
      raise ValueError(
        f"xladist.Server: job {job_name!r} has {tasks} tasks, so task_index must be "
        f"in 0 .. {tasks - 1}, got {task_index}."
      )
    self._job, self._index = job_name, task_index
    self._timeout = float(timeout_seconds)
    self._started = False
    self._joined = False
    if start:
      self.start()

  @property
  def target(self):
    """This task's address in the cluster spec ("tcp://host:port")."""
    return "tcp://" + self._layout.spec.task_address(self._job, self._index)

  @property
  def task(self):
    """This task's device name (TF's "/job:worker/replica:0/task:1")."""
    return _rpc.task_device(_rpc.task_name(self._job, self._index))

  def start(self):
    """Joins the cluster: blocks until every task (chief included) has joined.

    A worker first starts its XLA runtime (one device by default on XLA:CPU:
    `CPU_NUM_DEVICES` unset means 1), so that scheduled functions do not pay
    for it.

    Raises:
      TimeoutError: the cluster did not form within `timeout_seconds`.
    """
    if self._started:
      return
    if self._job == "worker":
      if _runtime.device_type() == "CPU":
        os.environ.setdefault("CPU_NUM_DEVICES", "1")
      _runtime.initialize()
    else:
      # A ps task runs optimizers; torch 2.9 imports torch._dynamo when the
      # first one is made (seconds), so that happens now, not in a step.
      import torch

      torch.optim.SGD([torch.zeros(1)], lr=0.0)
    _stop_event.clear()
    _rpc.start(self._layout, self._job, self._index, self._timeout, "xladist.Server")
    self._started = True

  def join(self):
    """Blocks until the chief ends the cluster, or the chief is gone; then leaves it."""
    if not self._started:
      self.start()
    if self._joined:
      return
    chief = _rpc.task_name("chief", 0)
    while not _stop_event.wait(_POLL_SECONDS):
      try:
        _rpc.call(chief, _alive, timeout=max(10.0, 5 * _POLL_SECONDS), what="a liveness check")
      except _rpc.TaskUnavailableError:
        break  # the chief ended without stopping us: nothing will come
    if _stop_event.is_set() and _stop["graceful"]:
      _rpc.stop(graceful=True, timeout=LEAVE_SECONDS)
    else:
      time.sleep(0.2)  # let the answer to the chief's stop request leave
      _rpc.stop()
    self._joined = True

  @staticmethod
  def create_local_server(config=None, start=True):
    """TF's in-process server has no counterpart: tasks are processes here."""
    raise NotImplementedError(
      "xladist.Server.create_local_server: a parameter-server cluster's tasks are "
      "separate processes here; start each with xladist.Server(cluster, job, index)."
    )


def stop_cluster(layout, timeout=5.0):
  """Asks every worker and ps task to leave (the chief's side of the shutdown).

  First every task is asked whether it is up: if all answer, all of them
  (the chief too) leave through the RPC group's shutdown barrier, which is
  quiet; with a task gone, or a worker restarted (it is no member of the
  barrier), every task leaves at once (TensorPipe then logs the closed
  connections).

  Returns:
    Whether the chief should leave gracefully (every task answered).
  """
  tasks = layout.workers + layout.ps
  # A restarted worker is an extra member, outside the static group's barrier.
  graceful = _answering(tasks, timeout) == len(tasks) and not _rpc.restarted_tasks()
  futures = []
  for task in tasks:
    try:
      futures.append((task, _rpc.call_async(task, _stop_server, (graceful,), timeout=timeout)))
    except _rpc.TaskUnavailableError:
      graceful = False
  for task, future in futures:
    try:
      _rpc.wait(task, future, "the stop request")
    except _rpc.TaskUnavailableError:
      graceful = False
  return graceful


def _answering(tasks, timeout):
  """How many of `tasks` answer a liveness check within `timeout`."""
  futures = []
  for task in tasks:
    try:
      futures.append((task, _rpc.call_async(task, _alive, timeout=timeout)))
    except _rpc.TaskUnavailableError:
      continue
  count = 0
  for task, future in futures:
    try:
      _rpc.wait(task, future, "a liveness check")
      count += 1
    except _rpc.TaskUnavailableError:
      continue
  return count
