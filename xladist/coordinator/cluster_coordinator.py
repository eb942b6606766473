"""`ClusterCoordinator`: schedules functions onto the workers of a ParameterServerStrategy.

As TF's coordinator: `schedule` puts a closure (the function and its
arguments, pickled once) in a queue and returns a `RemoteValue`; one thread
per worker takes closures from the queue and runs each on its worker with
one remote call (`_worker.run_closure`), so every worker has at most one
closure in flight. `join()` waits until the queue is empty and nothing is in
flight.

Failures:

* a worker that fails (its process died, the connection broke, or a closure
  ran past `closure_timeout_seconds`) has its in-flight closure put back at
  the front of the queue for the other workers (so a closure that was running
  on it may run twice: at-least-once, as TF); its thread then checks every
  second whether the worker answers again, and uses it again if so;
* a worker process started again after it died (same command, same task)
  rejoins the cluster as a new incarnation (`xladist/_ps/rpc.py`): its thread
  switches to it, makes every per-worker value (datasets, iterators, values of
  `per_worker_values`) there again, in creation order, then runs closures on
  it, as TF rebuilds a restarted worker's resources; iterators start over;
* a ps task that fails makes the closures that needed it fail with a
  `TaskUnavailableError` naming the task: like an error raised by the
  function itself, it is raised by the next `schedule`, `join` or `done`
  (and by the closure's `fetch`), after the queued closures are cancelled
  (their RemoteValues raise `CancelledError`);
* when a function fails, the others in flight are cancelled too, as TF's
  cancellation manager cancels them: their RemoteValues raise
  `CancelledError` (a worker runs a function to its end, so what it did to
  variables before it returns stays done, as ops TF ran before cancelling);
* no wait is unbounded: with every worker gone for longer than the strategy's
  communication timeout, waits raise instead of hanging.
"""

import atexit
import collections
import threading
import time

from xladist._nest import flatten, unflatten
from xladist._ps import rpc as _rpc
from xladist._ps import server
from xladist.coordinator import _wire, _worker
from xladist.coordinator.values import (
  CancelledError,
  PerWorkerDataset,
  PerWorkerIterator,
  PerWorkerValues,
  RemoteValue,
  RemoteValueImpl,
)
from xladist.strategies import parameter_server as ps

_PROBE_SECONDS = 1.0


class _Closure:
  __slots__ = ("description", "payload", "remote_value", "runs", "cancelled")

  def __init__(self, description, payload, remote_value):
    self.description = description
    self.payload = payload
    self.remote_value = remote_value
    self.runs = 0  # how many times a worker started it
    self.cancelled = False  # another function failed while this one was in flight


class _ClosureQueue:
  """Queued and in-flight closures, and the first error since the last raise."""

  def __init__(self):
    self._lock = threading.Lock()
    self._changed = threading.Condition(self._lock)
    self._queue = collections.deque()
    self._inflight = 0
    self._running = set()  # the closures in flight
    self._error = None
    self._stopped = False

  def put(self, closure):
    with self._lock:
      self._raise_if_error()
      self._queue.append(closure)
      self._changed.notify_all()

  def get(self, timeout):
    with self._lock:
      if (not self._queue or self._error is not None) and not self._stopped:
        self._changed.wait(timeout)
      # After an error nothing more starts: the queued closures are cancelled
      # when the error is raised.
      if self._stopped or not self._queue or self._error is not None:
        return None
      self._inflight += 1
      closure = self._queue.popleft()
      self._running.add(closure)
      return closure

  def put_back(self, closure):
    with self._lock:
      self._inflight -= 1
      self._running.discard(closure)
      if self._error is not None or closure.cancelled:
        closure.remote_value._set_error(_cancelled(closure, closure.cancelled))
      else:
        self._queue.appendleft(closure)
      self._changed.notify_all()

  def mark_finished(self, closure, value):
    """A closure returned `value`: its RemoteValue gets it, or CancelledError
    when another function failed while it ran."""
    with self._lock:
      self._inflight -= 1
      self._running.discard(closure)
      if closure.cancelled:
        closure.remote_value._set_error(_cancelled(closure, in_flight=True))
      else:
        closure.remote_value._set_value(value)
      self._changed.notify_all()

  def set_error(self, error):
    with self._lock:
      self._record_error(error)
      self._changed.notify_all()

  def mark_failed(self, closure, error):
    """A closure raised `error`: its RemoteValue gets it (also when it was
    cancelled meanwhile, as TF's); the first error cancels the others in flight."""
    with self._lock:
      self._inflight -= 1
      self._running.discard(closure)
      closure.remote_value._set_error(error)
      self._record_error(error)
      self._changed.notify_all()

  def _record_error(self, error):
    if self._error is None:
      self._error = error
      for other in self._running:
        other.cancelled = True

  def failed(self):
    with self._lock:
      return self._error is not None

  def idle_or_failed(self):
    with self._lock:
      return self._error is not None or (not self._queue and not self._inflight)

  def no_inflight(self):
    with self._lock:
      return self._inflight == 0

  def raise_if_error(self):
    with self._lock:
      self._raise_if_error()

  def _raise_if_error(self):
    if self._error is None:
      return
    error, self._error = self._error, None
    while self._queue:
      closure = self._queue.popleft()
      closure.remote_value._set_error(_cancelled(closure))
    raise error

  def done(self):
    with self._lock:
      self._raise_if_error()
      return not self._queue and not self._inflight

  def stop(self):
    with self._lock:
      self._stopped = True
      self._changed.notify_all()


def _is_dataset(obj):
  """A dataset object (what iter() takes); a one-pass iterator is not one."""
  if isinstance(obj, (str, bytes, dict)) or hasattr(obj, "__next__"):
    return False
  return hasattr(type(obj), "__iter__") or hasattr(type(obj), "__getitem__")


def _cancelled(closure, in_flight=False):
  if in_flight:
    return CancelledError(
      f"{closure.description} was cancelled because another scheduled function "
      "failed while it ran; what it did to variables before it returned stays "
      "done. Schedule it again."
    )
  return CancelledError(
    f"{closure.description} was cancelled because an earlier scheduled function "
    "failed; schedule it again."
  )


class _WorkerThread:
  """Runs closures from the queue on one worker, one at a time."""

  def __init__(self, coordinator, index, task):
    self.index = index
    self.task = task
    self.alive = True
    self.failures = 0
    self.completed = 0
    self.restarts = 0
    self.held = set()  # ids of the per-worker values this worker holds
    self.restarted_as = None  # the RPC name of a new incarnation, until adopted
    self._coordinator = coordinator
    self._stop = False
    self._thread = threading.Thread(
      target=self._loop, name=f"xladist-coordinator-{task}", daemon=True
    )
    self._thread.start()

  def stop(self):
    self._stop = True

  def join(self, timeout):
    self._thread.join(timeout)

  def _loop(self):
    c = self._coordinator
    while not self._stop:
      if self.restarted_as is not None:
        self._adopt()
      if not self.alive:
        self._probe()
        continue
      closure = c._queue.get(timeout=0.2)
      if closure is None:
        continue
      closure.runs += 1
      try:
        result = _rpc.call(
          self.task,
          _worker.run_closure,
          (closure.payload, c._timeout),
          timeout=c._closure_timeout,
          what=f"running {closure.description}",
        )
      except _rpc.TaskUnavailableError:
        self.alive = False
        self.failures += 1
        c._queue.put_back(closure)
        continue
      closure.remote_value._finished = c._count_finished(closure.remote_value._var_ids)
      if result[0] == "ok":
        self.completed += 1
        c._queue.mark_finished(closure, result[1])
      else:
        c._queue.mark_failed(closure, _rpc.rebuild_error(result))

  def _adopt(self):
    """Switches to the worker's new incarnation, which holds no per-worker value yet."""
    with self._coordinator._resource_lock:
      rpc_name, self.restarted_as = self.restarted_as, None
      _rpc.set_route(self.task, rpc_name)
      self.held = set()
      self.alive = False
      self.restarts += 1

  def _probe(self):
    time.sleep(_PROBE_SECONDS)
    if self._stop or self.restarted_as is not None:
      return
    try:
      result = _rpc.call(self.task, server._alive, timeout=2.0, what="a liveness check")
    except _rpc.TaskUnavailableError:
      return
    if result[0] == "ok" and self._coordinator._catch_up(self):
      self.alive = True


class ClusterCoordinator:
  """Schedules functions onto the workers of a ParameterServerStrategy (TF's ClusterCoordinator).

  One coordinator per strategy (creating it again returns the same object).

  Example::

    coordinator = xd.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    losses = [coordinator.schedule(train_step, args=(model, opt, iterator))
              for _ in range(100)]
    coordinator.join()
    print(losses[-1].fetch())

  Args:
    strategy: the chief's `ParameterServerStrategy`.
    closure_timeout_seconds: xladist's addition: a scheduled function that
      runs longer than this on a worker counts as a worker failure (it is
      rescheduled). Default 600.

  Raises:
    TypeError: `strategy` is not a ParameterServerStrategy made on the chief.
  """

  def __new__(cls, strategy, closure_timeout_seconds=None):
    existing = getattr(getattr(strategy, "extended", None), "_coordinator", None)
    if existing is not None:
      return existing
    return super().__new__(cls)

  def __init__(self, strategy, closure_timeout_seconds=None):
    if getattr(self, "_strategy", None) is not None:
      return
    if not isinstance(strategy, ps.ParameterServerStrategy) or not isinstance(
      strategy.extended, ps.ParameterServerExtended
    ):
      raise TypeError(
        "ClusterCoordinator(strategy): expected the chief's "
        f"xladist.ParameterServerStrategy, got {type(strategy).__name__}."
      )
    ext = strategy.extended
    self._strategy = strategy
    self._timeout = ext._timeout
    self._closure_timeout = float(closure_timeout_seconds or 600.0)
    self._queue = _ClosureQueue()
    self._next_resource = 0
    self._released = []
    # id -> (the per-worker RemoteValues, the pickled call that makes the value,
    # what it is, the call's function and arguments)
    self._resources = {}
    # Held while per-worker values are made, so that a restarted worker's are
    # rebuilt once each and in creation order.
    self._resource_lock = threading.RLock()
    # Reads on the chief after a fetch (`_refresh_after`): closures are
    # numbered as they finish; `_changed[var_id]` is the number of the last
    # finished closure that refers to the variable, `_pulled[var_id]` the
    # number of closures finished before the chief's copy of the variable was
    # last read from the ps tasks after a fetch, `_synced` the same for every
    # variable (join).
    self._finished_lock = threading.Lock()
    self._finished = 0
    self._changed = {}
    self._pulled = {}
    self._synced = 0
    self._workers = [_WorkerThread(self, i, t) for i, t in enumerate(ext._layout.workers)]
    self._closed = False
    ext._coordinator = self
    _rpc.on_admit(self._on_restart)
    atexit.register(self.shutdown)

  @property
  def strategy(self):
    return self._strategy

  def __repr__(self):
    alive = sum(w.alive for w in self._workers)
    return f"ClusterCoordinator(workers={len(self._workers)}, available={alive})"

  # -- scheduling ---------------------------------------------------------------------
  def schedule(self, fn, args=None, kwargs=None):
    """Schedules `fn(*args, **kwargs)` to run on some worker; returns a RemoteValue.

    Non-blocking. The function and its arguments are pickled now with
    cloudpickle (their values at this call; variables are read on the worker
    when it runs): a function defined inside another travels by value with
    what it captures. Variables, models, optimizers, the strategy and
    per-worker values and iterators, as arguments or captured, travel as
    references: a `PerWorkerValues` gives the function its worker's value.

    Example (TF's shape: a nested function capturing the training objects)::

      def train(model, optimizer, iterator):
        def worker_fn():
          x, y = next(iterator)          # this worker's iterator
          return strategy.run(replica_fn, args=(x, y))   # replica_fn uses model, optimizer
        return [coordinator.schedule(worker_fn) for _ in range(100)]

    Raises:
      TypeError: `fn` is not callable, or something it captures or an
        argument cannot be pickled (the message names it).
      ValueError: a RemoteValue is among the arguments or captured values.
      Exception: the error of an earlier scheduled function that failed (the
        queued ones are then cancelled), as TF.
    """
    self._check_open("schedule")
    self._raise_pending_error("ClusterCoordinator.schedule")
    if not callable(fn):
      raise TypeError(f"ClusterCoordinator.schedule: fn must be callable, got {type(fn).__name__}.")
    args = tuple(args or ())
    kwargs = dict(kwargs or {})
    ext = self._strategy.extended
    ext.push_chief_writes()
    self._delete_released()
    payload, var_ids = _wire.dumps(
      fn, args, kwargs, self._strategy, ClusterCoordinator, "ClusterCoordinator.schedule"
    )
    ext.mark_stale(var_ids)
    description = f"the scheduled function {getattr(fn, '__qualname__', repr(fn))}"
    remote_value = RemoteValueImpl(self, description, var_ids)
    self._queue.put(_Closure(description, payload, remote_value))
    return remote_value

  def join(self):
    """Blocks until every scheduled function has run.

    Then the chief's copies of the variables the functions refer to are read
    from the ps tasks, so that reads on the chief (`v.read_value()`,
    `float(v)`, `model(x)`, a checkpoint) give the ps tasks' values, as TF's
    reads of ps variables do. `fetch()` / `get()` of a function's RemoteValue
    does the same for the variables of every function finished by then (that
    one's included). Otherwise, between `schedule` and `join`, the chief's
    copies keep the values of the last such read;
    `strategy.extended.read_var(v)` reads a ps task at any time.

    Raises:
      Exception: the first error of a scheduled function since the last
        raise (queued functions are then cancelled): the function's own
        exception (with the worker's traceback as its cause), or a
        `TaskUnavailableError` naming a ps task that failed.
      RuntimeError: every worker has been unavailable for longer than the
        strategy's timeout.
    """
    self._check_open("join")
    self._wait_until(self._queue.idle_or_failed, "ClusterCoordinator.join")
    ext = self._strategy.extended
    try:
      self._raise_pending_error("ClusterCoordinator.join")
    except BaseException:
      # Nothing runs any more (queued functions are cancelled): the reads
      # are current, except for a ps task that failed (the error names it).
      ext.refresh_stale(ignore_unavailable=True)
      raise
    self._refresh_all()

  def done(self):
    """Whether every scheduled function has run (raises an error as `join`);
    when True, the chief's copies of the variables are refreshed as by `join`."""
    self._raise_pending_error("ClusterCoordinator.done")
    done = self._queue.done()
    if done:
      self._refresh_all()
    return done

  # -- reads on the chief ------------------------------------------------------------------
  def _count_finished(self, var_ids):
    """Numbers a closure that has just finished on a worker (its writes to the
    variables `var_ids` are on the ps tasks)."""
    with self._finished_lock:
      self._finished += 1
      for i in var_ids:
        self._changed[i] = self._finished
      return self._finished

  def _refresh_all(self):
    """Reads every variable scheduled functions may have changed (join, done)."""
    with self._finished_lock:
      finished = self._finished
    self._strategy.extended.refresh_stale()
    self._synced = max(self._synced, finished)

  def _refresh_after(self, remote_value):
    """After `fetch()` / `get()` of a function that ran: the chief's copies of
    the variables that it, or any function finished before, refers to are read
    from the ps tasks (TF reads a ps variable where it lives), unless read
    since the last function referring to them finished; so every read on the
    chief after a fetch gives the ps values as of the fetch, as after `join()`.
    A function that raised refreshes them too, where the ps tasks answer; a
    ps task that fails fails the fetch only for the function's own variables
    (the others are read again at the next fetch or join)."""
    if remote_value._finished is None or self._closed:
      return
    ext = self._strategy.extended
    with self._finished_lock:
      now = self._finished
      for i in [i for i in self._changed if i not in ext._vars]:  # variables gone
        del self._changed[i]
        self._pulled.pop(i, None)
      ids = [i for i, n in self._changed.items() if max(self._pulled.get(i, 0), self._synced) < n]
    if not ids:
      return
    try:
      self._pull(ids, now)
      return
    except _rpc.TaskUnavailableError as e:
      error = e
    own = [i for i in ids if i in remote_value._var_ids]
    if len(own) < len(ids):
      try:
        self._pull(own, now)
        return
      except _rpc.TaskUnavailableError as e:
        error = e
    if remote_value._error is None:
      raise error  # otherwise the function's own error is what fetch raises

  def _pull(self, ids, now):
    ext = self._strategy.extended
    ext.pull([t for t in (ext._vars.get(i) for i in ids) if t is not None])
    with self._finished_lock:
      for i in ids:
        self._pulled[i] = max(self._pulled.get(i, 0), now)

  def _raise_pending_error(self, what):
    """Raises the first error of a scheduled function, once the functions in
    flight have ended (their own errors are then dropped, as TF's), after
    cancelling the queued ones."""
    if self._queue.failed():
      self._wait_until(self._queue.no_inflight, f"{what} (functions in flight)")
      self._queue.raise_if_error()

  def fetch(self, val):
    """The values of RemoteValues in a nested structure (numpy arrays, as TF)."""
    leaves, spec = flatten(val)
    return unflatten(spec, [x.fetch() if isinstance(x, RemoteValue) else x for x in leaves])

  # -- per-worker values -----------------------------------------------------------------
  def create_per_worker_dataset(self, dataset_fn):
    """Makes a dataset on every worker; `iter()` of the result makes iterators there.

    Args:
      dataset_fn: a function run on each worker: no argument, or an
        `InputContext` (num_input_pipelines = workers, input_pipeline_id = the
        worker's index) to shard the data; it returns a dataset (a DataLoader,
        any re-iterable, or `strategy.distribute_datasets_from_function(...)`
        called on the worker). Or what `strategy.distribute_datasets_from_function
        (fn)` / `experimental_distribute_dataset(ds)` returned on the chief. Or
        a dataset itself (a DataLoader, a list of batches, any re-iterable that
        pickles): every worker gets a copy of it, unsharded, as TF gives each
        worker the dataset passed.

    Returns:
      A `PerWorkerDataset`.

    Raises:
      TypeError: `dataset_fn` is neither a function nor a dataset, or cannot
        be sent to the workers (the message names what).
    """
    self._check_open("create_per_worker_dataset")
    if not (
      callable(dataset_fn) or isinstance(dataset_fn, ps._DatasetSpec) or _is_dataset(dataset_fn)
    ):
      raise TypeError(
        "ClusterCoordinator.create_per_worker_dataset: expected a function returning "
        "a dataset, or a dataset (an iterable such as a DataLoader or a list of "
        f"batches), got {type(dataset_fn).__name__}."
      )
    values = self._create_per_worker(
      _worker.make_dataset,
      (dataset_fn,),
      {},
      "a dataset",
      api="ClusterCoordinator.create_per_worker_dataset",
      arg_names=("dataset_fn",),
    )
    return PerWorkerDataset(self, values)

  def per_worker_values(self, fn, args=(), kwargs=None):
    """Runs `fn(*args, **kwargs)` on every worker and keeps each result there.

    Returns:
      A `PerWorkerValues`; passed to a scheduled function, it gives the
      function its worker's result (e.g. a per-worker counter or cache).
    """
    self._check_open("per_worker_values")
    if not callable(fn):
      raise TypeError(
        f"ClusterCoordinator.per_worker_values: fn must be callable, got {type(fn).__name__}."
      )
    return self._create_per_worker(
      fn,
      tuple(args),
      dict(kwargs or {}),
      "a per-worker value",
      api="ClusterCoordinator.per_worker_values",
    )

  def _make_iterators(self, dataset):
    return self._create_per_worker(
      _worker.make_iterator, (dataset,), {}, "an iterator", PerWorkerIterator
    )

  def _create_per_worker(
    self, fn, args, kwargs, what, kind=PerWorkerValues, api="ClusterCoordinator", arg_names=None
  ):
    with self._resource_lock:
      return self._create_per_worker_locked(fn, args, kwargs, what, kind, api, arg_names)

  def _create_per_worker_locked(self, fn, args, kwargs, what, kind, api, arg_names):
    ext = self._strategy.extended
    ext.push_chief_writes()
    resource_id = self._next_resource
    self._next_resource += 1
    payload, _ = _wire.dumps(fn, args, kwargs, self._strategy, ClusterCoordinator, api, arg_names)
    values = []
    futures = []
    for w in self._workers:
      rv = RemoteValueImpl(self, f"{what} on {_rpc.task_device(w.task)}")
      values.append(rv)
      if not w.alive:
        rv._set_error(_rpc.TaskUnavailableError(w.task, "it failed earlier"))
        continue
      try:
        futures.append(
          (
            w,
            rv,
            _rpc.call_async(
              w.task,
              _worker.create_resource,
              (resource_id, payload, self._timeout),
              self._closure_timeout,
            ),
          )
        )
      except _rpc.TaskUnavailableError as e:
        rv._set_error(e)
    for w, rv, future in futures:
      try:
        result = _rpc.wait(w.task, future, f"making {what}")
      except _rpc.TaskUnavailableError as e:
        rv._set_error(e)
        continue
      if result[0] != "ok":
        raise _rpc.rebuild_error(result)
      rv._set_value(None)
      w.held.add(resource_id)
    # The record keeps what the call refers to (an iterator's dataset) from
    # being released while it exists: a restarted worker makes both again.
    self._resources[resource_id] = (values, payload, what, (fn, args, kwargs))
    return kind(values, resource_id, self)

  def _catch_up(self, w):
    """Makes on worker `w` the per-worker values it lacks (all of them on a
    restarted worker), in creation order; whether it now holds every one."""
    with self._resource_lock:
      for resource_id in sorted(list(self._resources)):
        if resource_id in w.held:
          continue
        entry = self._resources.get(resource_id)
        if entry is None:
          continue  # released meanwhile
        _, payload, what, _ = entry
        try:
          result = _rpc.call(
            w.task,
            _worker.create_resource,
            (resource_id, payload, self._timeout),
            timeout=self._closure_timeout,
            what=f"making {what} again",
          )
        except _rpc.TaskUnavailableError:
          return False
        if result[0] != "ok":
          # Raised by the next schedule / join; closures using it on this
          # worker fail naming the missing value.
          self._queue.set_error(_rpc.rebuild_error(result))
        w.held.add(resource_id)
      return True

  def _on_restart(self, task, rpc_name):
    """A worker process was started again (`_rpc.on_admit`): its thread adopts it."""
    for w in self._workers:
      if w.task == task:
        w.restarted_as = rpc_name

  def _release_resource(self, resource_id):
    self._released.append(resource_id)  # deleted on the workers at the next schedule

  def _delete_released(self):
    while self._released:
      resource_id = self._released.pop()
      self._resources.pop(resource_id, None)
      for w in self._workers:
        w.held.discard(resource_id)
        if w.alive:
          try:
            _rpc.call_async(w.task, _worker.delete_resource, (resource_id,), self._timeout)
          except _rpc.TaskUnavailableError:
            pass

  # -- waiting -----------------------------------------------------------------------------
  def _wait_until(self, predicate, what):
    """Waits for `predicate()`, bounded: with no worker available for longer
    than the strategy's timeout it raises."""
    unavailable_since = None
    while not predicate():
      if any(w.alive for w in self._workers):
        unavailable_since = None
      elif unavailable_since is None:
        unavailable_since = time.monotonic()
      elif time.monotonic() - unavailable_since > self._timeout:
        names = ", ".join(_rpc.task_device(w.task) for w in self._workers)
        raise RuntimeError(
          f"{what}: every worker ({names}) has been unavailable for more than "
          f"{self._timeout:.0f} s, so the scheduled functions cannot run. Restart the "
          "workers, or raise CommunicationOptions.timeout_seconds."
        )
      time.sleep(0.02)

  def _check_open(self, api):
    if self._closed:
      raise RuntimeError(f"ClusterCoordinator.{api}: the coordinator was shut down.")

  # -- statistics and shutdown --------------------------------------------------------------
  @property
  def experimental_worker_stats(self):
    """Per worker: {"task", "available", "completed", "failures", "restarts"}
    (xladist's addition; "restarts": how many new processes of the task rejoined)."""
    return [
      {
        "task": _rpc.task_device(w.task),
        "available": w.alive,
        "completed": w.completed,
        "failures": w.failures,
        "restarts": w.restarts,
      }
      for w in self._workers
    ]

  def shutdown(self):
    """Ends the cluster (xladist's addition; TF's ends with the chief's process):
    the worker threads stop, every worker and ps task's `Server.join()` returns,
    and this process leaves the RPC group. Also run at exit."""
    if self._closed:
      return
    self._closed = True
    _rpc.on_admit(None)
    self._queue.stop()
    for w in self._workers:
      w.stop()
    for w in self._workers:
      w.join(timeout=5.0)
    self._strategy.extended.shutdown()
