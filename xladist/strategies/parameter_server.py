"""ParameterServerStrategy: variables on ps tasks, functions scheduled on workers.

TF's `tf.distribute.ParameterServerStrategy` (v2) with its coordinator
(`xladist.coordinator.ClusterCoordinator`): one chief process runs the
training program, ps tasks hold the variables, workers run the functions the
chief schedules, asynchronously. Every task is a member of one
torch.distributed.rpc group (`xladist/_ps/rpc.py`); workers and ps tasks run
`xladist.Server(...).join()`.

On the chief, a module (or `xladist.Variable`) made under `scope()` is placed
on the ps tasks when the scope is left: each parameter and buffer becomes a
variable held by one ps task, round-robin in creation order, or, with a
`variable_partitioner`, split along dim 0 into shards placed round-robin.
The chief's tensors keep a copy of the values (the initial ones, refreshed by
the coordinator's `join()` for every variable the scheduled functions refer
to, by `extended.read_var`, `state_dict()` and checkpoints); writes to them on the
chief (`load_state_dict`, `Variable.assign`, in-place ops) are sent to the ps
tasks before the next scheduled function.

On a worker, a scheduled function sees the same objects (it and its arguments
are sent by value with cloudpickle, closures included, the variables,
optimizers and per-worker values by reference): the worker reads the variables
from the ps tasks when the function starts, runs it on its XLA device, and
sends the optimizer's gradients back, where the ps tasks apply them.
"""

import atexit
import threading
import weakref
from typing import NamedTuple

import torch

from xladist import cluster_resolver as resolvers
from xladist import runtime as _runtime
from xladist import variable_policy as policies
from xladist._ps import rpc as _rpc
from xladist._ps import server
from xladist._ps import task as _ps_task
from xladist.communication_options import CommunicationOptions
from xladist.extended import StrategyExtended
from xladist.input import dataset as input_dataset
from xladist.input.options import InputContext, InputReplicationMode
from xladist.partitioners import shard_rows
from xladist.strategies.one_device import SingleReplicaExtended
from xladist.strategy import Strategy
from xladist.variable_store import VariableStore

_API = "ParameterServerStrategy"
_INFO = "_xladist_ps"  # attribute of a chief tensor: its VarInfo
_OPT = "_xladist_ps_opt"  # attribute of an optimizer whose updates the ps tasks apply
_chief = {"extended": None}  # this process's ParameterServerExtended (a weakref)


class VarInfo(NamedTuple):
  """Where a ps variable lives: `shards` is a tuple of (ps task, first row, rows);
  an unpartitioned variable has one shard (rows None for a scalar)."""

  var_id: int
  shape: tuple
  dtype: torch.dtype
  shards: tuple
  trainable: bool

  def keys(self):
    return [(self.var_id, i) for i in range(len(self.shards))]


def info_of(tensor):
  """The VarInfo of a chief tensor that is a ps variable, else None."""
  return tensor.__dict__.get(_INFO) if isinstance(tensor, torch.Tensor) else None


def split_rows(info, value):
  """A full value -> one tensor per shard (views)."""
  if len(info.shards) == 1:
    return [value]
  return [value.narrow(0, start, rows) for _, start, rows in info.shards]


def join_rows(info, parts):
  return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def group_by_task(items):
  """[(task, payload)] -> {task: [payload, ...]} (order kept)."""
  out = {}
  for task, payload in items:
    out.setdefault(task, []).append(payload)
  return out


def call_all(calls, timeout, what):
  """Runs remote functions on several tasks at once: {task: (fn, args)} -> {task: value}.

  Raises:
    TaskUnavailableError: a task failed or did not answer within `timeout`.
    Exception: a remote function's error (rebuilt with its remote traceback).
  """
  futures = {task: _rpc.call_async(task, fn, args, timeout) for task, (fn, args) in calls.items()}
  out = {}
  for task, future in futures.items():
    result = _rpc.wait(task, future, what)
    if result[0] != "ok":
      raise _rpc.rebuild_error(result)
    out[task] = result[1]
  return out


def read_variables(infos, timeout):
  """The current values of ps variables (CPU tensors), one call per ps task."""
  wanted = [
    (task, (info.var_id, i)) for info in infos for i, (task, _, _) in enumerate(info.shards)
  ]
  by_task = group_by_task(wanted)
  values = call_all(
    {task: (_ps_task.read, (keys,)) for task, keys in by_task.items()},
    timeout,
    "reading variables",
  )
  got = {}
  for task, keys in by_task.items():
    got.update(zip(keys, values[task]))
  return [join_rows(info, [got[k] for k in info.keys()]) for info in infos]


class ParameterServerExtended(StrategyExtended):
  """The chief's side of ParameterServerStrategy."""

  def __init__(self, strategy, cluster_resolver, layout, partitioner, timeout):
    super().__init__(strategy)
    self._cluster_resolver = cluster_resolver
    self._layout = layout
    self._partitioner = partitioner
    self._timeout = timeout
    self._store = VariableStore(self._place_on_ps)
    self._lock = threading.RLock()
    self._next_var = 0
    self._next_ps = 0
    self._pending = []  # (tensor, VarInfo) created, not yet sent to the ps tasks
    self._vars = weakref.WeakValueDictionary()  # var_id -> chief tensor
    self._versions = {}  # var_id -> the chief tensor's write stamp when last synced
    self._stale = set()  # var_ids scheduled functions may have changed since the last read
    self._next_opt = 0
    self._coordinator = None
    self._closed = False

  def _copy_for(self, strategy):
    raise NotImplementedError(
      f"copy.deepcopy({_API}): the strategy is this chief's connection to the "
      "cluster (its ps tasks hold the variables it made, its coordinator drives "
      "the workers), which a second object cannot share safely. Pass the "
      "strategy object itself where a copy was asked for."
    )

  # -- TF's facts -----------------------------------------------------------------
  @property
  def parameter_devices(self):
    """The ps tasks' devices ("/job:ps/replica:0/task:i/device:CPU:0")."""
    return tuple(_rpc.task_device(t) + "/device:CPU:0" for t in self._layout.ps)

  @property
  def worker_devices(self):
    """The devices functions run on: every worker's ("/job:worker/replica:0/task:i")."""
    return tuple(_rpc.task_device(t) for t in self._layout.workers)

  @property
  def _num_replicas_in_sync(self):
    return 1

  @property
  def experimental_between_graph(self):
    """False: one program (the chief's) drives every task."""
    return False

  @property
  def should_checkpoint(self):
    return True

  @property
  def should_save_summary(self):
    return True

  def non_slot_devices(self, var_list):
    return self.parameter_devices[:1]

  # -- variables --------------------------------------------------------------------
  def _enter_scope(self):
    self._store.enter_scope()

  def _exit_scope(self):
    self._store.exit_scope()
    self.flush()

  def _place_on_ps(self, tensor):
    """Records a new variable (sent to its ps tasks by `flush`); it stays on the chief."""
    placed = None
    if tensor.device.type != "cpu":
      placed = tensor.detach().cpu()
      policies.carry_policy(tensor, placed)
    target = tensor if placed is None else placed
    with self._lock:
      shape = tuple(target.shape)
      num_shards = self._num_shards(shape, target.dtype)
      ps = self._layout.ps
      if num_shards == 1:
        shards = ((ps[self._next_ps % len(ps)], 0, shape[0] if shape else None),)
        self._next_ps += 1
      else:
        shards = []
        for start, rows in shard_rows(shape[0], num_shards):
          shards.append((ps[self._next_ps % len(ps)], start, rows))
          self._next_ps += 1
        shards = tuple(shards)
      trainable = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
      info = VarInfo(self._next_var, shape, target.dtype, shards, trainable)
      self._next_var += 1
      target.__dict__[_INFO] = info
      # With a new tensor (`placed`), the store swaps it into `tensor` (dicts too).
      self._pending.append(tensor)
    return placed

  def _num_shards(self, shape, dtype):
    if self._partitioner is None or not shape:
      return 1
    parts = self._partitioner(torch.Size(shape), dtype)
    parts = [int(p) for p in parts]
    if len(parts) != len(shape) or any(p < 1 for p in parts) or any(p != 1 for p in parts[1:]):
      raise ValueError(
        f"{_API}: variable_partitioner returned {parts} for a variable of shape "
        f"{shape}; it must return one positive count per dimension, and only "
        "dimension 0 may be partitioned (e.g. [2, 1])."
      )
    return min(parts[0], shape[0]) if shape[0] else 1

  def flush(self):
    """Sends the variables made since the last flush to their ps tasks."""
    with self._lock:
      pending, self._pending = self._pending, []
      if not pending:
        return
      items = []
      for t in pending:
        info = info_of(t)
        for (task, _, _), key, part in zip(info.shards, info.keys(), split_rows(info, t.detach())):
          items.append((task, (key, part.contiguous())))
      calls = {
        task: (_ps_task.create, ([k for k, _ in entries], [v for _, v in entries]))
        for task, entries in group_by_task(items).items()
      }
      call_all(calls, self._timeout, "creating variables")
      for t in pending:
        info = info_of(t)
        self._vars[info.var_id] = t
        self._versions[info.var_id] = _stamp(t)
      for module in self._store.modules():
        if not getattr(module, "_xladist_ps_hooks", False):
          module.register_state_dict_pre_hook(_refresh_module)
          module.register_load_state_dict_post_hook(_push_module)
          module._xladist_ps_hooks = True

  def variables(self):
    return [t for t in self._vars.values()]

  def pull(self, tensors):
    """Refreshes the chief's copies of `tensors` (ps variables) from the ps tasks."""
    tensors = [t for t in tensors if info_of(t) is not None]
    if not tensors:
      return
    self.push_chief_writes()
    values = read_variables([info_of(t) for t in tensors], self._timeout)
    with torch.no_grad():
      for t, v in zip(tensors, values):
        t.copy_(v)
        self._versions[info_of(t).var_id] = _stamp(t)

  def mark_stale(self, var_ids):
    """Records that a scheduled function may change these variables."""
    with self._lock:
      self._stale.update(var_ids)

  def refresh_stale(self, ignore_unavailable=False):
    """Reads the variables scheduled functions may have changed since the last
    refresh into the chief's copies (the coordinator's `join`, `done`).

    Raises:
      TaskUnavailableError: a ps task could not be reached (unless
        `ignore_unavailable`; the variables stay marked).
    """
    with self._lock:
      stale, self._stale = self._stale, set()
    tensors = [t for t in (self._vars.get(i) for i in sorted(stale)) if t is not None]
    try:
      self.pull(tensors)
    except _rpc.TaskUnavailableError:
      with self._lock:
        self._stale.update(stale)
      if not ignore_unavailable:
        raise

  def push(self, tensors):
    """Sets the ps variables behind `tensors` to the chief's values."""
    items = []
    for t in tensors:
      info = info_of(t)
      for (task, _, _), key, part in zip(info.shards, info.keys(), split_rows(info, t.detach())):
        items.append((task, (key, part.contiguous().clone())))
    calls = {
      task: (_ps_task.assign, ([k for k, _ in e], [v for _, v in e]))
      for task, e in group_by_task(items).items()
    }
    call_all(calls, self._timeout, "writing variables")
    for t in tensors:
      self._versions[info_of(t).var_id] = _stamp(t)

  def push_chief_writes(self):
    """Sends the chief's writes to its copies (since the last sync) to the ps tasks.

    Variables made in a scope that is still open are placed and sent first
    (the scope's exit would do it): TF makes a ps variable on its ps task at
    once, so a function scheduled inside the scope refers to the ps variable,
    and a read there gives its value. Before (issue 41), such a function got
    a copy of the chief's value, and its writes never reached the ps tasks.
    """
    self._store.place_pending()
    self.flush()
    changed = [t for t in self.variables() if _stamp(t) != self._versions.get(info_of(t).var_id)]
    if changed:
      self.push(changed)

  def variable_shards(self, var):
    """Where a variable lives: one (ps device, first row, rows) per shard (rows
    is None for a scalar); an unpartitioned variable has one entry.

    Raises:
      ValueError: `var` is not a variable of this strategy.
    """
    tensor = var.value_ if getattr(var, "_is_xladist_variable", False) else var
    self.flush()
    info = info_of(tensor)
    if info is None:
      raise ValueError(
        f"{_API}.extended.variable_shards: expected a variable made under "
        f"strategy.scope(), got a {type(var).__name__}."
      )
    return tuple(
      (_rpc.task_device(t) + "/device:CPU:0", start, rows) for t, start, rows in info.shards
    )

  def read_var(self, var):
    """The variable's current value, read from its ps tasks (a CPU tensor)."""
    tensor = var.value_ if getattr(var, "_is_xladist_variable", False) else var
    if info_of(tensor) is None:
      return super().read_var(var)
    self.pull([tensor])
    return tensor.detach().clone()

  # -- optimizers: their state lives with the variables, on the ps tasks -------------
  def register_optimizer(self, optimizer):
    """Gives `optimizer` an id; its updates are applied on the ps tasks from now on.

    State the optimizer holds on the chief (e.g. just restored from a
    checkpoint) is sent to the ps tasks.

    Raises:
      ValueError: the optimizer mixes ps variables and other tensors.
    """
    with self._lock:
      opt_id = getattr(optimizer, _OPT, None)
      if opt_id is not None:
        return opt_id
      for group in optimizer.param_groups:
        for p in group["params"]:
          if info_of(p) is None:
            raise ValueError(
              f"{_API}: the optimizer {type(optimizer).__name__} updates a tensor of "
              f"shape {tuple(p.shape)} that is not a variable of the strategy; make "
              "the model under strategy.scope() so that every parameter lives on "
              "the ps tasks."
            )
      opt_id = self._next_opt
      self._next_opt += 1
      setattr(optimizer, _OPT, opt_id)
      optimizer.register_state_dict_post_hook(_optimizer_state_from_ps)
      optimizer.register_load_state_dict_post_hook(_optimizer_state_to_ps)
      if optimizer.state:
        _optimizer_state_to_ps(optimizer)
      return opt_id

  def optimizer_spec(self, optimizer):
    """What a worker needs to stand in for `optimizer` (see coordinator/_worker.py)."""
    opt_id = self.register_optimizer(optimizer)
    groups = [
      ({k: v for k, v in g.items() if k != "params"}, [info_of(p) for p in g["params"]])
      for g in optimizer.param_groups
    ]
    return (opt_id, type(optimizer), dict(optimizer.defaults), groups)

  def shutdown(self):
    """Ends the cluster: every worker and ps task's `Server.join()` returns and
    this process leaves the RPC group (xladist's addition; also run at exit)."""
    if self._closed:
      return
    self._closed = True
    graceful = False
    try:
      graceful = server.stop_cluster(self._layout)
    finally:
      _rpc.stop(graceful=graceful, timeout=server.LEAVE_SECONDS)

  # -- running ------------------------------------------------------------------------------
  def _call_for_each_replica(self, fn, args, kwargs, options=None):
    raise RuntimeError(
      f"{_API}.run on the chief: functions run on the workers. Schedule the "
      "function with xladist.coordinator.ClusterCoordinator(strategy).schedule(fn, "
      "args); inside it, strategy.run(replica_fn, args) runs on the worker."
    )

  def _experimental_distribute_dataset(self, dataset, options):
    return _DatasetSpec(None, dataset, options)

  def _distribute_datasets_from_function(self, dataset_fn, options):
    return _DatasetSpec(dataset_fn, None, options)


class _DatasetSpec:
  """A distributed dataset made on the chief: built on each worker by
  `ClusterCoordinator.create_per_worker_dataset` (TF's way of passing
  `strategy.distribute_datasets_from_function(...)` to it)."""

  def __init__(self, dataset_fn, dataset, options):
    self.dataset_fn, self.dataset, self.options = dataset_fn, dataset, options

  def __iter__(self):
    raise TypeError(
      f"{_API}: a distributed dataset made on the chief is iterated on the "
      "workers: pass it to ClusterCoordinator.create_per_worker_dataset(...) and "
      "iterate what that returns."
    )


def _stamp(t):
  return (t._version, t.data_ptr())


def _extended():
  ref = _chief["extended"]
  return ref() if ref is not None else None


def _refresh_module(module, prefix, keep_vars):
  """state_dict() pre-hook on the chief: the values come from the ps tasks."""
  ext = _extended()
  if ext is None:
    return
  tensors = [t for t in list(module._parameters.values()) + list(module._buffers.values())]
  ext.pull([t for t in tensors if t is not None and info_of(t) is not None])


def _push_module(module, incompatible_keys):
  """load_state_dict() post-hook on the chief: the loaded values go to the ps tasks."""
  ext = _extended()
  if ext is None:
    return
  tensors = [t for t in list(module._parameters.values()) + list(module._buffers.values())]
  tensors = [t for t in tensors if t is not None and info_of(t) is not None]
  if tensors:
    ext.push(tensors)


def _optimizer_params(optimizer):
  return [p for g in optimizer.param_groups for p in g["params"]]


def _optimizer_state_from_ps(optimizer, state_dict):
  """state_dict() post-hook: the optimizer's state is read from the ps tasks
  (the state of a partitioned variable is reassembled from its shards)."""
  ext = _extended()
  opt_id = getattr(optimizer, _OPT, None)
  if ext is None or opt_id is None:
    return state_dict
  params = _optimizer_params(optimizer)
  infos = [info_of(p) for p in params]
  wanted = [(task, key) for info in infos for (task, _, _), key in zip(info.shards, info.keys())]
  by_task = group_by_task(wanted)
  got = {}
  results = call_all(
    {t: (_ps_task.optimizer_state, (opt_id, keys)) for t, keys in by_task.items()},
    ext._timeout,
    "reading optimizer state",
  )
  for task, keys in by_task.items():
    got.update(zip(keys, results[task]))
  state = {}
  for index, info in enumerate(infos):
    parts = [got[k] for k in info.keys()]
    if all(p is None for p in parts):
      continue
    merged = {}
    for name, first in parts[0].items():
      if isinstance(first, torch.Tensor) and len(parts) > 1 and first.dim() > 0:
        merged[name] = torch.cat([p[name] for p in parts], 0)
      else:
        merged[name] = first
    state[index] = merged
  state_dict["state"] = state
  return state_dict


def _optimizer_state_to_ps(optimizer):
  """load_state_dict() post-hook: the loaded state is sent to the ps tasks (and
  split along the shards of partitioned variables); the chief keeps none."""
  ext = _extended()
  opt_id = getattr(optimizer, _OPT, None)
  if ext is None or opt_id is None:
    return
  entries = []
  for group in optimizer.param_groups:
    hyper = {k: v for k, v in group.items() if k != "params"}
    for p in group["params"]:
      info = info_of(p)
      state = optimizer.state.get(p)
      for (task, _, _), key, shard in zip(info.shards, info.keys(), _shard_states(info, state)):
        entries.append((task, (key, hyper, shard)))
  calls = {
    task: (_ps_task.load_optimizer_state, (opt_id, type(optimizer), dict(optimizer.defaults), e))
    for task, e in group_by_task(entries).items()
  }
  call_all(calls, ext._timeout, "writing optimizer state")
  optimizer.state.clear()


def _shard_states(info, state):
  if not state:
    return [None] * len(info.shards)
  out = []
  for _, start, rows in info.shards:
    part = {}
    for name, v in state.items():
      if (
        isinstance(v, torch.Tensor)
        and len(info.shards) > 1
        and v.dim() > 0
        and v.shape[0] == info.shape[0]
      ):
        part[name] = v.narrow(0, start, rows).clone()
      else:
        part[name] = v.clone() if isinstance(v, torch.Tensor) else v
    out.append(part)
  return out


class ParameterServerStrategy(Strategy):
  """Asynchronous training with variables on ps tasks (TF's ParameterServerStrategy v2).

  Create it on the chief (the coordinator), with the cluster from TF_CONFIG or
  a resolver; every worker and ps task runs `xladist.Server(...).join()`.
  Creating the strategy joins the chief to the cluster and waits for every
  task. Then::

    strategy = xd.ParameterServerStrategy(resolver)
    coordinator = xd.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
      model = Net()                                   # variables on the ps tasks
      optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    per_worker_iter = iter(coordinator.create_per_worker_dataset(dataset_fn))
    for _ in range(steps):
      coordinator.schedule(train_step, args=(model, optimizer, per_worker_iter))
    coordinator.join()

  Scheduled functions are sent by pickling (cloudpickle): a module-level
  function by reference, a function defined inside another (TF's `worker_fn`
  capturing the model, the optimizer and a per-worker iterator) or a lambda
  by value, with what it captures. The strategy's variables, models,
  optimizers and per-worker values and iterators travel as references,
  whether arguments or captured: a worker reads the variables from the ps
  tasks when the function starts, runs it on its XLA device, and
  `optimizer.step()` there sends the gradients to the ps tasks, which apply
  them with the optimizer (its state stays on the ps tasks) and return the
  new values.

  Security: run a cluster on a trusted network only. Scheduled functions are
  pickled Python that the workers run, so whoever can reach a task's ports
  (this chief's address from the cluster spec, every task's RPC listeners)
  can run code in it, as with TF's servers; every task listens only on its
  own address from the cluster spec.

  Args:
    cluster_resolver: a `cluster_resolver.ClusterResolver` whose cluster has
      the jobs "chief" (this process), "worker" and "ps"; None reads TF_CONFIG.
    variable_partitioner: None, or a partitioner
      (`xladist.experimental.partitioners`) splitting big variables along
      dim 0 into shards placed round-robin on the ps tasks.
    communication_options: an `experimental.CommunicationOptions` whose
      `timeout_seconds` bounds every remote call (default 60 s); the wait
      for the cluster to form is bounded by 600 s (or that, if larger).

  Raises:
    ValueError: the cluster is not a parameter-server cluster, or this process
      is not its chief.
    TypeError: an argument has the wrong type.
    TimeoutError: the cluster did not form in time.
  """

  def __init__(self, cluster_resolver=None, variable_partitioner=None, communication_options=None):
    _runtime.require("ParameterServerStrategy")
    if cluster_resolver is None:
      cluster_resolver = resolvers.TFConfigClusterResolver()
    if not isinstance(cluster_resolver, resolvers.ClusterResolver):
      raise TypeError(
        f"{_API}(cluster_resolver=...): expected a cluster_resolver.ClusterResolver, "
        f"got {type(cluster_resolver).__name__}."
      )
    if variable_partitioner is not None and not callable(variable_partitioner):
      raise TypeError(
        f"{_API}(variable_partitioner=...): expected a partitioner (a callable "
        f"(shape, dtype) -> partitions), got {type(variable_partitioner).__name__}."
      )
    if communication_options is not None and not isinstance(
      communication_options, CommunicationOptions
    ):
      raise TypeError(
        f"{_API}(communication_options=...): expected an "
        "xladist.experimental.CommunicationOptions or None, got "
        f"{type(communication_options).__name__}."
      )
    layout = _rpc.Layout(cluster_resolver.cluster_spec(), _API)
    if cluster_resolver.task_type not in (None, "chief") or cluster_resolver.task_id not in (
      None,
      0,
    ):
      raise ValueError(
        f"{_API}: this process is task {cluster_resolver.task_type}:"
        f"{cluster_resolver.task_id}, but the strategy runs on the chief (the "
        "coordinator). Workers and ps tasks run xladist.Server(cluster, job, index).join()."
      )
    timeout = (
      communication_options.timeout_seconds
      if communication_options and communication_options.timeout_seconds
      else None
    )
    _rpc.start(layout, "chief", 0, max(600.0, timeout or 0.0), _API)
    extended = ParameterServerExtended(
      self, cluster_resolver, layout, variable_partitioner, timeout or _rpc.DEFAULT_TIMEOUT
    )
    _chief["extended"] = weakref.ref(extended)
    atexit.register(extended.shutdown)
    super().__init__(extended)

  def __repr__(self):
    ext = self._extended
    if isinstance(ext, WorkerExtended):
      return f"ParameterServerStrategy(on worker {ext._worker_index})"
    return f"ParameterServerStrategy(workers={ext._layout.num_workers}, ps={ext._layout.num_ps})"


# -- the strategy as a worker sees it -------------------------------------------------


class WorkerExtended(SingleReplicaExtended):
  """ParameterServerStrategy inside a scheduled function on a worker: one
  replica on the worker's XLA device; its datasets are the worker's input
  pipeline (`InputContext.input_pipeline_id` is the worker's index)."""

  def __init__(self, strategy, worker_index, num_workers, num_ps):
    super().__init__(strategy, _runtime.device())
    self._worker_index, self._num_workers, self._num_ps = worker_index, num_workers, num_ps

  @property
  def parameter_devices(self):
    return tuple(f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(self._num_ps))

  def _distribute_datasets_from_function(self, dataset_fn, options):
    api = "strategy.distribute_datasets_from_function"
    if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
      raise ValueError(
        f"{api}: ParameterServerStrategy has one replica per worker: use PER_WORKER."
      )
    dataset = dataset_fn(InputContext(self._num_workers, self._worker_index, 1))
    input_dataset.check_dataset(dataset, api, "what dataset_fn returned")
    return input_dataset.from_datasets(self, [dataset], options, api)


def worker_strategy(worker_index, num_workers, num_ps):
  """The ParameterServerStrategy object functions see on a worker."""
  strategy = ParameterServerStrategy.__new__(ParameterServerStrategy)
  Strategy.__init__(strategy, WorkerExtended(strategy, worker_index, num_workers, num_ps))
  return strategy
