"""`Strategy` and `StrategyExtended`: the public API and its shared machinery.

Public methods check the context and their arguments, then call one underscore
hook on `StrategyExtended`; each strategy overrides hooks only.
"""

import optree
import torch

from xladist import context
from xladist._global_view import check_destinations as _check_destinations
from xladist._global_view import concat_stacked as _concat_stacked
from xladist._global_view import is_host_destination, reduce_global, to_destinations
from xladist.communication_options import check_options
from xladist.input import dataset as input_dataset
from xladist.input.options import InputContext, InputOptions, InputReplicationMode
from xladist.reduce_util import ReduceOp, as_reduce_op
from xladist.values import DistributedValues, Mirrored, PerReplica


def flatten(structure):
  """Leaves of a nested structure; distributed values and None are leaves."""
  return optree.tree_flatten(
      structure, is_leaf=lambda x: isinstance(x, DistributedValues), none_is_leaf=True)


def unflatten(treespec, leaves):
  return optree.tree_unflatten(treespec, leaves)


def _require_no_other_strategy(strategy, what):
  current = context.get_strategy()
  if current is not strategy and context.has_strategy():
    raise RuntimeError(
        f"Mixing different strategies: {what} {strategy!r} inside the scope of "
        f"{current!r}. Leave the first strategy's scope, or use that strategy.")


def _require_cross_replica(strategy, api, fix):
  _require_no_other_strategy(strategy, f"{api} was called on")
  if context.in_step(strategy):
    raise RuntimeError(
        f"{api} requires being in cross-replica context, but it was called in a "
        f"replica context (inside strategy.run). {fix}")


class _Scope:
  """The context manager returned by `strategy.scope()`."""

  def __init__(self, strategy):
    self._strategy = strategy
    self._mode = None

  def __enter__(self):
    s = self._strategy
    _require_no_other_strategy(s, "tried to enter the scope of")
    if context.in_step(s):
      # Inside run of the same strategy: stay in the replica context.
      self._mode = context._Mode(s, replica_context=context.get_replica_context())
    else:
      self._mode = context._Mode(s, cross_replica=s)
    s.extended._enter_scope()
    context.push(self._mode)
    return s

  def __exit__(self, *exc):
    context.pop(self._mode)
    self._strategy.extended._exit_scope()
    return False


class Strategy:
  """A way to run one training step on several replicas.

  Make the model and optimizer under `scope()`, then call `run(step_fn, args)`
  once per global step. Every replica is traced into ONE XLA program; every
  cross-replica operation is an XLA collective inside it.
  """

  def __init__(self, extended):
    self._extended = extended

  def __repr__(self):
    return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"

  @property
  def extended(self):
    """The StrategyExtended holding the advanced API."""
    return self._extended

  @property
  def cluster_resolver(self):
    """The cluster resolver of a multi-host strategy (TPU, multi-worker), else None.

    As in TF: MultiWorkerMirroredStrategy and TPUStrategy return the resolver
    they were built from; MirroredStrategy, OneDeviceStrategy and the default
    strategy return None.
    """
    return self._extended._cluster_resolver

  @property
  def num_replicas_in_sync(self):
    """How many replicas take part in each step."""
    return self._extended._num_replicas_in_sync

  def scope(self):
    """A context manager: the strategy becomes current, in cross-replica context.

    Modules (their parameters and buffers) made inside become the strategy's
    variables: placed on its devices, mirrored on every replica.

    Raises:
      RuntimeError: a different strategy's scope is already active.
    """
    return _Scope(self)

  def run(self, fn, args=(), kwargs=None, options=None):
    """Runs `fn` once on every replica, traced into one XLA program.

    `args` and `kwargs` may hold `PerReplica` values (each replica gets its own
    component), `Mirrored` values and tensors (each replica gets the same value)
    and any Python value (passed through), in nested tuples, lists, dicts and
    namedtuples. Tensors `fn` returns come back as `PerReplica` (plain tensors
    with one replica); Python values come back unchanged.

    Example, two replicas:

      >>> def step(x):
      ...   ctx = xd.get_replica_context()
      ...   return x * 10, ctx.all_reduce("sum", x)
      >>> x = strategy.experimental_distribute_values_from_function(
      ...     lambda c: torch.tensor(float(c.replica_id_in_sync_group + 1)))
      >>> strategy.run(step, (x,))   # replica 0: (10., 3.)  replica 1: (20., 3.)

    Raises:
      TypeError: `fn` is not callable, or `args`/`kwargs` have the wrong type.
      RuntimeError: called inside `run` (a replica context), or `fn` read a
        traced value on the host (e.g. Python control flow on a tensor).
    """
    if not callable(fn):
      raise TypeError(f"strategy.run: fn must be callable, got {type(fn).__name__}.")
    if not isinstance(args, (tuple, list)):
      raise TypeError(
          "strategy.run: args must be a tuple or list of arguments, got "
          f"{type(args).__name__}; pass a single argument as args=(x,).")
    if kwargs is not None and not isinstance(kwargs, dict):
      raise TypeError(f"strategy.run: kwargs must be a dict, got {type(kwargs).__name__}.")
    if options is not None:
      from xladist.input_options import RunOptions
      if not isinstance(options, RunOptions):
        raise TypeError(
            f"strategy.run: options must be an xladist.RunOptions, got "
            f"{type(options).__name__}.")
    _require_cross_replica(
        self, "strategy.run",
        "Call the function directly inside a step, or use "
        "get_replica_context().merge_call() to reach cross-replica context.")
    with self.scope():
      return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

  def reduce(self, reduce_op, value, axis=None, destinations=None):
    """Reduces `value` across replicas (and along `axis` inside each replica).

    Returns a plain tensor. With two replicas holding [1., 2.] and [3., 4.]:
    `reduce("sum", v, axis=None)` gives [4., 6.]; `reduce("sum", v, axis=0)`
    gives 10.; `reduce("mean", v, axis=0)` gives 2.5 (the mean over all
    elements of all replicas).

    The legacy form `reduce("sum", value, destinations)` (tf.contrib) returns the
    reduced value on `destinations` (a Mirrored for several devices).

    Raises:
      RuntimeError: called in a replica context (use ReplicaContext.all_reduce).
      ValueError: `axis` out of range, or a non-distributed value with SUM.
    """
    if axis is not None and not isinstance(axis, int):
      destinations, axis = axis, None  # legacy reduce(method, value, destinations)
    reduce_op = as_reduce_op(reduce_op, "strategy.reduce")
    _require_cross_replica(self, "strategy.reduce",
                           "Use get_replica_context().all_reduce() inside a step.")
    if destinations is not None:
      return self._extended.reduce_to(reduce_op, value, destinations)
    return self._extended._reduce(reduce_op, value, axis)

  def gather(self, value, axis):
    """Concatenates the replicas' components of `value` along `axis`.

    With two replicas holding [[1, 2]] and [[3, 4]], `gather(v, axis=0)` gives
    [[1, 2], [3, 4]]. A Mirrored or plain tensor counts once per replica.

    Raises:
      RuntimeError: called in a replica context (use ReplicaContext.all_gather).
    """
    _require_cross_replica(self, "strategy.gather",
                           "Use get_replica_context().all_gather() inside a step.")
    return self._extended._gather(value, axis)

  def experimental_local_results(self, value):
    """The tuple of this host's per-replica components of `value` (a 1-tuple for
    plain values); on one host, every replica's."""
    return self._extended._local_results(value)

  def experimental_distribute_values_from_function(self, value_fn):
    """A PerReplica whose component r is `value_fn(ValueContext(r, N))`.

    On several hosts `value_fn` is called for this host's replicas only (as in
    TF), and must return tensors.
    """
    if not callable(value_fn):
      raise TypeError(
          "experimental_distribute_values_from_function: value_fn must be callable, "
          f"got {type(value_fn).__name__}.")
    from xladist.input_options import ValueContext
    n = self.num_replicas_in_sync
    replicas = self._extended._fed_replicas()
    values = [value_fn(ValueContext(r, n)) for r in replicas]
    if n == 1:
      return values[0]
    leaves = [flatten(v) for v in values]
    spec = leaves[0][1]
    for other in leaves[1:]:
      if other[1] != spec:
        raise ValueError(
            "experimental_distribute_values_from_function: value_fn returned "
            f"differently structured values for different replicas ({spec} vs "
            f"{other[1]}).")
    return unflatten(spec, [self._extended._group_leaf([lv[0][i] for lv in leaves])
                            for i in range(len(leaves[0][0]))])

  def experimental_distribute_dataset(self, dataset, options=None):
    """Distributes a dataset of GLOBAL batches over the replicas.

    `dataset` is a torch DataLoader or any re-iterable yielding global batches:
    tensors, or nested tuples, lists, dicts and namedtuples of them (numpy
    arrays are converted; other leaves are passed through). Each global batch
    of B = N * b rows is split on dim 0: replica r gets rows [r * b, (r + 1) * b).
    Iterating the result gives one element per step, ready for `run`; iterating
    it again starts a new epoch. A background thread prefetches and transfers
    the next elements while the current step runs.

    Example, 2 replicas::

      >>> loader = DataLoader(TensorDataset(torch.arange(8.)), batch_size=4)
      >>> for (x,) in strategy.experimental_distribute_dataset(loader):
      ...   strategy.run(step, args=(x,))   # 1st step: replica 0 [0., 1.], replica 1 [2., 3.]

    Every step must have the same shapes; a partial last batch raises a
    ValueError unless `options.experimental_partial_batch` is "mask" (pad it and
    get a mask of the real rows) or "drop".

    Args:
      dataset: the dataset of global batches.
      options: an `InputOptions` (default: `InputOptions()`).

    Returns:
      A `DistributedDataset`.

    Raises:
      TypeError: `dataset` is not re-iterable, or `options` is not an InputOptions.
      ValueError: `options` asks for `InputReplicationMode.PER_REPLICA` (only
        `distribute_datasets_from_function` has it).
      RuntimeError: called inside `run`.
    """
    api = "strategy.experimental_distribute_dataset"
    options = _check_input_options(options, api)
    if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
      raise ValueError(
          f"{api}: InputReplicationMode.PER_REPLICA is only supported by "
          "strategy.distribute_datasets_from_function; use it, or "
          "InputReplicationMode.PER_WORKER here.")
    input_dataset.check_dataset(dataset, api)
    _require_cross_replica(self, api, "Distribute the dataset before the training "
                           "loop, and pass its elements to strategy.run.")
    return self._extended._experimental_distribute_dataset(dataset, options)

  def distribute_datasets_from_function(self, dataset_fn, options=None):
    """Distributes datasets made by `dataset_fn(input_context)`, one per pipeline.

    `dataset_fn` is called now, once per input pipeline, with an `InputContext`,
    and returns a re-iterable dataset of PER-REPLICA batches (as in TF: use
    `input_context.get_per_replica_batch_size(global_batch_size)`):

    * `InputReplicationMode.PER_WORKER` (default): one pipeline per host (one
      here: input_pipeline_id 0, num_input_pipelines 1); each step takes its
      next N elements, element r going to replica r;
    * `InputReplicationMode.PER_REPLICA`: N pipelines (input_pipeline_id 0 ..
      N-1, num_input_pipelines N); replica r gets pipeline r's elements.

    Every step must have the same shapes; see `InputOptions.experimental_partial_batch`
    for per-replica batches that come short or run out at the end.

    Args:
      dataset_fn: a function from `InputContext` to a dataset.
      options: an `InputOptions` (default: `InputOptions()`).

    Returns:
      A `DistributedDataset`.

    Raises:
      TypeError: `dataset_fn` is not callable or returned something that is not
        re-iterable, or `options` is not an InputOptions.
      RuntimeError: called inside `run`.
    """
    api = "strategy.distribute_datasets_from_function"
    if not callable(dataset_fn):
      raise TypeError(f"{api}: dataset_fn must be callable, got "
                      f"{type(dataset_fn).__name__}.")
    options = _check_input_options(options, api)
    _require_cross_replica(self, api, "Distribute the datasets before the training "
                           "loop, and pass their elements to strategy.run.")
    return self._extended._distribute_datasets_from_function(dataset_fn, options)

  def experimental_distribute_datasets_from_function(self, dataset_fn, options=None):
    """Former name of `distribute_datasets_from_function`."""
    return self.distribute_datasets_from_function(dataset_fn, options)

  def distribute_dataset(self, dataset_fn):
    """Legacy (tf.contrib): `experimental_distribute_dataset` of a dataset.

    Args:
      dataset_fn: a dataset of global batches, or a function of no arguments
        that returns one.
    """
    dataset = dataset_fn
    if callable(dataset_fn) and not hasattr(dataset_fn, "__iter__"):
      dataset = dataset_fn()
    return self.experimental_distribute_dataset(dataset)

  def tower_local_var_scope(self, reduce_method):
    """Legacy (tf.contrib): state created inside is sync-on-read with `reduce_method`.

    Parameters, buffers and `xladist.Variable`s made inside (under this
    strategy's scope) become ON_READ variables aggregated with `reduce_method`
    ("sum", "mean", a ReduceOp or a VariableAggregation): each replica updates
    its own copy in a step; read in cross-replica context, they are combined.
    Every replica starts from the same initial value, even a random one.

    Raises:
      RuntimeError: not inside this strategy's scope.
    """
    from xladist import variables
    aggregation = variables.as_aggregation(
        reduce_method.name if hasattr(reduce_method, "name") else reduce_method,
        "tower_local_var_scope")
    if context.get_strategy() is not self or not context.in_cross_replica_context():
      raise RuntimeError(
          "tower_local_var_scope must be entered inside this strategy's scope() "
          "(cross-replica context): with strategy.scope(), "
          "strategy.tower_local_var_scope(...): ...")
    policy = variables.Policy(variables.VariableSynchronization.ON_READ, aggregation)
    return _OverrideScope(self._extended, policy)

  tower_local_variable_scope = tower_local_var_scope  # the Scala API's name

  def colocate_vars_with(self, colocate_with_variable):
    """Legacy name of `extended.colocate_vars_with`."""
    return self._extended.colocate_vars_with(colocate_with_variable)

  colocate_variables_with = colocate_vars_with  # the Scala API's name

  def non_slot_devices(self, var_list):
    return self._extended.non_slot_devices(var_list)

  def update(self, var, fn, *args, **kwargs):
    """Legacy: `extended.update(var, fn, args, kwargs)`."""
    return self._extended.update(var, fn, args, kwargs)

  def update_non_slot(self, colocate_with, fn, *args, **kwargs):
    """Legacy: `extended.update_non_slot(colocate_with, fn, args, kwargs)`."""
    return self._extended.update_non_slot(colocate_with, fn, args, kwargs)

  # -- legacy tf.contrib.distribute ("tower") names and the Scala API ---------
  def call_for_each_tower(self, fn, *args, **kwargs):
    """Legacy name of `extended.call_for_each_replica(fn, args, kwargs)`."""
    return self._extended.call_for_each_replica(fn, args, kwargs)

  def for_each_tower(self, fn, values):
    """Scala API: calls `fn(values)` per replica, each with its own components."""
    return self._extended.call_for_each_replica(fn, (values,))

  def unwrap(self, value):
    """Legacy name of `experimental_local_results`."""
    return self.experimental_local_results(value)

  @property
  def num_towers(self):
    return self.num_replicas_in_sync

  @property
  def is_single_tower(self):
    return self.num_replicas_in_sync == 1

  @property
  def worker_devices(self):
    return self._extended.worker_devices

  @property
  def parameter_devices(self):
    return self._extended.parameter_devices

  def broadcast(self, tensor, destinations=None, devices=None):
    """Legacy/Scala: `tensor` mirrored on `destinations` (default: every replica)."""
    dest = destinations if destinations is not None else devices
    return self._extended.broadcast_to(tensor, dest if dest is not None
                                       else self._extended.worker_devices)

  def batch_reduce(self, method_string, value_destination_pairs):
    """Legacy name of `extended.batch_reduce_to` taking "sum"/"mean"."""
    return self._extended.batch_reduce_to(method_string, value_destination_pairs)

  def fetch(self, val, destination="cpu", fn=lambda x: x):
    """Legacy: `fn(val)` copied to `destination` (one copy of a mirrored value)."""
    _require_cross_replica(self, "strategy.fetch", "Return the value from the step.")
    if isinstance(val, PerReplica):
      raise ValueError(
          "strategy.fetch needs a mirrored value, got a PerReplica; reduce it "
          "first with strategy.reduce(...).")
    if isinstance(val, Mirrored):
      val = val.primary
    out = fn(val)
    return out.to(destination) if isinstance(out, torch.Tensor) else out

  def group(self, value):
    """Legacy: runs the pending computation of every component of `value`.

    Like `tf.group` in eager mode it returns None; the values are then computed
    (asynchronously) without being copied to the host.
    """
    _require_cross_replica(self, "strategy.group", "Return the value from the step.")
    leaves = [t for v in flatten(value)[0] for t in self.experimental_local_results(v)
              if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    if leaves:
      from xladist import _runtime
      _runtime.sync(leaves)
    return None


class StrategyExtended:
  """The advanced API of a strategy; `strategy.extended`."""

  _device_names = ("cpu",)
  _cluster_resolver = None  # a multi-host strategy's resolver (strategy.cluster_resolver)

  def _fed_replicas(self):
    """The replicas whose inputs this host builds (all of them on one host)."""
    return range(self._num_replicas_in_sync)

  def _group_leaf(self, components):
    """One leaf per fed replica -> a distributed value (see _fed_replicas)."""
    return _group_leaf(components)

  def _local_results(self, value):
    if isinstance(value, DistributedValues):
      return tuple(value.values)
    return (value,)

  def __init__(self, strategy):
    self._strategy_ref = strategy
    self.experimental_gradient_aggregation = ReduceOp.MEAN

  @property
  def _num_replicas_in_sync(self):
    return len(self._device_names)

  @property
  def worker_devices(self):
    """The devices the replicas run on, one per replica."""
    return tuple(self._device_names)

  @property
  def parameter_devices(self):
    """The devices mirrored variables live on (all replica devices)."""
    return tuple(self._device_names)

  # -- host-level facts (TF's meanings) ------------------------------------------
  @property
  def experimental_between_graph(self):
    """Whether each host runs its own program for its own replicas (between-graph).

    False for single-host strategies (one program holds every replica); True
    for MultiWorkerMirroredStrategy, where every host runs this process.
    """
    return False

  @property
  def experimental_should_init(self):
    """Whether this process should initialise the variables (True: every host does)."""
    return True

  @property
  def should_checkpoint(self):
    """Whether this process should write checkpoints.

    True on one host; on several hosts only on the chief
    (`cluster_resolver.is_chief`). `xladist.checkpoint` honours it: the other
    hosts take part in the save but write nothing.
    """
    return True

  @property
  def should_save_summary(self):
    """Whether this process should write summaries (logs, metrics files).

    True on one host; on several hosts only on the chief.
    """
    return True

  @property
  def experimental_gradient_aggregation(self):
    """How `optimizer.step()` in a replica context combines gradients.

    `ReduceOp.MEAN` (default): with per-replica mean losses this reproduces
    single-device training on the global batch. `ReduceOp.SUM`: for losses
    already divided by the global batch size (TF's convention). `None`: no
    aggregation (the step function all-reduces gradients itself).
    """
    return self._gradient_aggregation

  @experimental_gradient_aggregation.setter
  def experimental_gradient_aggregation(self, op):
    self._gradient_aggregation = None if op is None else as_reduce_op(
        op, "experimental_gradient_aggregation")

  # -- public methods -----------------------------------------------------------
  def call_for_each_replica(self, fn, args=(), kwargs=None):
    """Runs `fn(*args, **kwargs)` in every replica (what `strategy.run` does)."""
    return self._strategy_ref.run(fn, args, kwargs)

  def reduce_to(self, reduce_op, value, destinations, options=None):
    """Reduces `value` across replicas onto `destinations`.

    Returns a Mirrored when `destinations` names several devices (or is a
    distributed value), else a tensor. The strategy's CrossDeviceOps does the
    reduction; `options` (`experimental.CommunicationOptions`) can set its
    packing and, for a "cpu" destination outside a step, bound the host-side
    wait for the result (`timeout_seconds`).

    Raises:
      TypeError: `options` is not a CommunicationOptions.
      ValueError: `destinations` is malformed.
      RuntimeError: called in a replica context.
      TimeoutError: the result was not ready within `options.timeout_seconds`.
    """
    reduce_op = as_reduce_op(reduce_op, "reduce_to")
    options = check_options(options, "reduce_to")
    _check_destinations(destinations, "reduce_to")
    _require_cross_replica(self._strategy_ref, "reduce_to",
                           "Use get_replica_context().merge_call() to get there.")
    options = self._options(options)
    reduced = self._reduce(reduce_op, value, None, options)
    self._wait_for_host([(reduced, destinations)], options, "reduce_to")
    return self._to_destinations(reduced, destinations)

  def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
    """Reduces several values at once (few collectives); returns a list.

    The strategy's CrossDeviceOps packs the values into collectives (by
    default one all-reduce per dtype); see `reduce_to` for `options`.

    Raises:
      ValueError: `value_destination_pairs` is not a list or tuple of
        (value, destinations) pairs.
      TypeError: `options` is not a CommunicationOptions.
      RuntimeError: called in a replica context.
      TimeoutError: the results were not ready within `options.timeout_seconds`.
    """
    reduce_op = as_reduce_op(reduce_op, "batch_reduce_to")
    options = check_options(options, "batch_reduce_to")
    if (not isinstance(value_destination_pairs, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in value_destination_pairs)):
      raise ValueError(
          "batch_reduce_to: value_destination_pairs must be a list or tuple of "
          "(value, destinations) pairs, got "
          f"{type(value_destination_pairs).__name__}.")
    for _, d in value_destination_pairs:
      _check_destinations(d, "batch_reduce_to")
    _require_cross_replica(self._strategy_ref, "batch_reduce_to",
                           "Use get_replica_context().merge_call() to get there.")
    options = self._options(options)
    reduced = self._batch_reduce(reduce_op, [v for v, _ in value_destination_pairs],
                                 options)
    pairs = [(r, d) for r, (_, d) in zip(reduced, value_destination_pairs)]
    self._wait_for_host(pairs, options, "batch_reduce_to")
    return [self._to_destinations(r, d) for r, d in pairs]

  def _options(self, options):
    """The options a reduction uses (a strategy may add its defaults)."""
    return options

  def _wait_for_host(self, pairs, options, api):
    """Bounds the host-side wait for results going to a "cpu" destination (by
    `options.timeout_seconds`, else on several hosts by their default bound)."""
    from xladist import _multihost
    timeout = options.timeout_seconds if options is not None else None
    if timeout is None:
      timeout = _multihost.host_timeout()
    if timeout is None:
      return
    if self._tracing():
      return  # inside a step nothing is read back, so nothing waits
    tensors = [r for r, d in pairs if isinstance(r, torch.Tensor)
               and r.device.type == "xla" and is_host_destination(d)]
    if tensors:
      from xladist import _runtime
      _runtime.sync(tensors)
      _runtime.wait(timeout, f"{api}: the reduction")

  def broadcast_to(self, tensor, destinations):
    """`tensor` mirrored on `destinations`."""
    _check_destinations(destinations, "broadcast_to")
    _require_cross_replica(self._strategy_ref, "broadcast_to",
                           "Use get_replica_context().merge_call() to get there.")
    if isinstance(tensor, DistributedValues):
      raise TypeError(
          f"broadcast_to: expected a tensor, got a {type(tensor).__name__}; "
          "reduce it first.")
    return self._to_destinations(self._broadcast(tensor), destinations)

  def experimental_run_steps(self, fn, iterator, steps):
    """Runs `steps` steps of `strategy.run(fn, element)` as ONE XLA execution.

    Like TF's `steps_per_execution` or a host training loop inside
    `tf.function`: the next `steps` elements of `iterator` (a
    DistributedIterator, or any iterator of values `run` takes) are fed to
    `strategy.run(fn, args=element)` (a tuple or list element is the argument
    list, anything else the single argument) back to back, and the graph is cut once
    at the end, so the k steps compile into one program and run as one
    execution. The results equal k separate steps. Fewer steps run when the
    iterator ends first (that shorter program compiles once too).

    Returns:
      The list of what each step returned (in step order).

    Raises:
      ValueError: `steps` is not a positive int.
      RuntimeError: called inside `run`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
      raise ValueError(
          f"experimental_run_steps: steps must be a positive int, got {steps!r}.")
    _require_cross_replica(self._strategy_ref, "experimental_run_steps",
                           "Call it from the training loop, outside strategy.run.")
    from xladist import _runtime
    outputs = []
    for _ in range(steps):
      try:
        element = next(iterator)
      except StopIteration:
        break
      args = tuple(element) if isinstance(element, (tuple, list)) else (element,)
      outputs.append(self._strategy_ref.run(fn, args=args))
    if self._current_device().type == "xla":
      _runtime.sync()
    return outputs

  # -- variables ------------------------------------------------------------------
  def update(self, var, fn, args=(), kwargs=None, group=True):
    """Runs `fn(var, *args, **kwargs)` to update a variable, in an update context.

    Allowed in cross-replica context: in a strategy's scope and inside
    `merge_fn` of a merge_call (where `var` is the replica's view of the
    mirrored variable and the update is traced once for all replicas). Inside,
    `current_update_device()` is the variable's device. `args` must be the same
    on every replica (tensors or Mirrored values, not PerReplica).

    Returns:
      What `fn` returned (a Mirrored of it when `group` is True and there are
      several replicas), or, with `group=False`, a tuple of per-replica results.

    Raises:
      RuntimeError: called in a replica context.
      ValueError: an argument is a PerReplica, or `var` is not a variable of
        this strategy.
    """
    _require_cross_replica(self._strategy_ref, "extended.update",
                           "Use get_replica_context().merge_call() to get there.")
    if not self.variable_created_in_scope(var):
      raise ValueError(
          f"extended.update: {_describe(var)} is not a variable of "
          f"{self._strategy_ref!r}; create it under strategy.scope().")
    return self._run_update(_variable_tensor(var), lambda: fn(var, *args, **(kwargs or {})),
                            args, kwargs, group, "extended.update")

  def update_non_slot(self, colocate_with, fn, args=(), kwargs=None, group=True):
    """Runs `fn(*args, **kwargs)` in an update context (for non-slot state)."""
    _require_cross_replica(self._strategy_ref, "extended.update_non_slot",
                           "Use get_replica_context().merge_call() to get there.")
    return self._run_update(None, lambda: fn(*args, **(kwargs or {})), args, kwargs,
                            group, "extended.update_non_slot")

  def _run_update(self, tensor, call, args, kwargs, group, api):
    leaves, _ = flatten((args, kwargs or {}))
    if any(isinstance(x, PerReplica) for x in leaves):
      raise ValueError(
          f"{api}: the arguments must be the same on every replica (tensors or "
          "Mirrored values), got a PerReplica; reduce it first (strategy.reduce or "
          "extended.reduce_to).")
    device = tensor.device if tensor is not None else self._current_device()
    mode = context._Mode(self._strategy_ref, cross_replica=self._strategy_ref,
                         update_device=device)
    context.push(mode)
    try:
      result = call()
    finally:
      context.pop(mode)
    n = self._num_replicas_in_sync
    if not group:
      return (result,) * n
    if n > 1 and isinstance(result, torch.Tensor):
      return Mirrored._from_primary(result, n)
    return result

  def non_slot_devices(self, var_list):
    """Where non-slot state lives: every replica's device (all state is mirrored)."""
    return self.worker_devices

  def colocate_vars_with(self, colocate_with_variable):
    """A context in which new variables are placed with `colocate_with_variable`.

    Every variable of an xladist strategy lives on all of its replicas' devices,
    so new ones already are; the context checks its argument.

    Raises:
      ValueError: the argument is not a variable of this strategy.
    """
    if not self.variable_created_in_scope(colocate_with_variable):
      raise ValueError(
          f"colocate_vars_with: {_describe(colocate_with_variable)} is not a "
          f"variable of {self._strategy_ref!r}.")
    return _Colocation()

  def value_container(self, value):
    """The variable holding `value`: an xladist.Variable for its value tensor,
    else `value` itself (tensors are their own containers)."""
    from xladist import variables
    for module in self._store.modules():
      if isinstance(module, variables.Variable) and module.value_ is value:
        return module
    return value

  def read_var(self, var):
    """The value of `var` in cross-replica context: one copy of a mirrored
    variable, the aggregate of a sync-on-read one (a tensor)."""
    _require_cross_replica(self._strategy_ref, "extended.read_var",
                           "Read the variable directly inside a step.")
    return _variable_tensor(var).detach().clone()

  def variable_created_in_scope(self, v):
    """True when `v` (a parameter, buffer or xladist.Variable) is a variable of this strategy."""
    store = self._store
    if isinstance(v, torch.nn.Module):
      return any(m is v for m in store.modules())
    return isinstance(v, torch.Tensor) and store.tracks(v)

  def _to_destinations(self, value, destinations):
    return to_destinations(value, destinations, self._num_replicas_in_sync,
                           self._tracing())

  def _in_region(self):
    return False

  def _tracing(self):
    """True while a step of this strategy is being traced (nothing may be read
    back to the host then)."""
    return context.in_step(self._strategy_ref) or self._in_region()

  # -- hooks: a strategy overrides these ------------------------------------------
  def _enter_scope(self):
    pass

  def _exit_scope(self):
    pass

  def _current_device(self):
    return torch.device("cpu")

  def _broadcast(self, tensor):
    return tensor

  def _experimental_distribute_dataset(self, dataset, options):
    return input_dataset.from_dataset(
        self, dataset, options, "strategy.experimental_distribute_dataset")

  def _distribute_datasets_from_function(self, dataset_fn, options):
    api = "strategy.distribute_datasets_from_function"
    n = self._num_replicas_in_sync
    per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    pipelines = n if per_replica else 1
    datasets = []
    for i in range(pipelines):
      dataset = dataset_fn(InputContext(pipelines, i, n))
      input_dataset.check_dataset(dataset, api, f"what dataset_fn returned for pipeline {i}")
      datasets.append(dataset)
    return input_dataset.from_datasets(self, datasets, options, api)

  def _place_inputs(self, tensors):
    """Tensors (N, b, ...) whose row r is replica r's -> the values `run` takes.

    Called in the prefetch thread with the tensors of one element. One replica:
    each batch itself on the strategy's device; several: PerReplica values.
    """
    if self._num_replicas_in_sync == 1:
      return [self._broadcast(t[0]) for t in tensors]
    return [PerReplica(tuple(t.unbind(0))) for t in tensors]

  def _call_for_each_replica(self, fn, args, kwargs):
    raise NotImplementedError  # every strategy overrides it

  def _reduce(self, reduce_op, value, axis, options=None):
    """The reduced value of `value` in the global view (no region active)."""
    return reduce_global(reduce_op, value, axis, self._num_replicas_in_sync)

  def _batch_reduce(self, reduce_op, values, options=None):
    return [self._reduce(reduce_op, v, None, options) for v in values]

  def _gather(self, value, axis):
    n = self._num_replicas_in_sync
    if isinstance(value, PerReplica):
      stacked = value._stacked if value._stacked is not None else torch.stack(
          [torch.as_tensor(c) for c in value.values])
    else:
      if isinstance(value, Mirrored):
        value = value.primary
      value = torch.as_tensor(value)
      stacked = value.unsqueeze(0).expand((n,) + tuple(value.shape))
    return _concat_stacked(stacked, axis, "strategy.gather")


class _OverrideScope:
  """The context manager of tower_local_var_scope."""

  def __init__(self, extended, policy):
    self._store, self._policy = extended._store, policy

  def __enter__(self):
    self._store.push_override(self._policy)
    return self

  def __exit__(self, *exc):
    self._store.pop_override()
    return False


class _Colocation:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _variable_tensor(var):
  from xladist import variables
  return var.value_ if isinstance(var, variables.Variable) else var


def _describe(var):
  if isinstance(var, torch.Tensor):
    return f"a {type(var).__name__} of shape {tuple(var.shape)}"
  return f"a {type(var).__name__}"


def _check_input_options(options, api):
  if options is None:
    return InputOptions()
  if not isinstance(options, InputOptions):
    raise TypeError(f"{api}: options must be an xladist.InputOptions or None, got "
                    f"{type(options).__name__}.")
  return options


def _group_leaf(components):
  """One leaf per replica -> a PerReplica, or the plain value if it is not a
  tensor and the same for every replica (e.g. a Python constant)."""
  first = components[0]
  if not isinstance(first, torch.Tensor) and not isinstance(first, DistributedValues):
    try:
      if all(c == first for c in components[1:]):
        return first
    except (TypeError, ValueError, RuntimeError):
      pass
  return PerReplica(components)
