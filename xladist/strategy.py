"""`Strategy`: the public API of every strategy (its machinery: `extended.py`).

Public methods check the context and their arguments, then call one underscore
hook on `StrategyExtended`; each strategy overrides hooks only. This is TF 2's
API; the TF 1 / tf.contrib names `Strategy` keeps for ported code come from
the mixin in `strategy_legacy.py`.
"""

import copy

from xladist import context
from xladist import runtime as _runtime
from xladist._global_view import as_value
from xladist._nest import error_at, flatten, tree_map_with_path
from xladist._step import seeds
from xladist.extended import _require_cross_replica, _require_no_other_strategy
from xladist.input import dataset as input_dataset
from xladist.input.options import InputOptions, InputReplicationMode
from xladist.reduce_util import as_reduce_op
from xladist.run_options import RunOptions, ValueContext
from xladist.strategy_legacy import StrategyLegacy


class _Scope:
  """The context manager returned by `strategy.scope()`.

  The same object may be entered again while it is active (TF allows nesting
  scopes of one strategy, distribute_lib_test's testSameScopeNesting).
  """

  def __init__(self, strategy):
    self._strategy = strategy
    self._modes = []

  def __enter__(self):
    s = self._strategy
    if s.extended._is_default:
      mode = _default_scope_mode(s)
    else:
      _require_no_other_strategy(s, "tried to enter the scope of")
      current = context.current_mode()
      if getattr(current, "explicit_default", False):
        raise RuntimeError(
          f"Mixing different strategies: tried to enter the scope of {s!r} inside "
          "the default strategy's scope(); leave the default strategy's scope "
          "first."
        )
      if context.in_step(s):
        # Inside run of the same strategy: stay in the replica context.
        mode = context._Mode(s, replica_context=context.get_replica_context())
      else:
        mode = context._Mode(s, cross_replica=s)
    s.extended._enter_scope()
    context.push(mode)
    self._modes.append(mode)
    return s

  def __exit__(self, *exc):
    if not self._modes:
      raise RuntimeError(
        "xladist contexts were exited out of order: a strategy.scope() was left "
        "that was not entered."
      )
    context.pop(self._modes[-1])  # raises if an inner context is still active
    self._modes.pop()
    self._strategy.extended._exit_scope()
    return False


def _default_scope_mode(strategy):
  """The default strategy's scope keeps the default state (TF's testScopeMostlyNoOp):
  the default replica context, no cross-replica context."""
  if context.has_strategy():
    raise RuntimeError(
      f"Must not nest strategy scopes: the default strategy's scope() was entered "
      f"inside the scope of {context.get_strategy()!r}."
    )
  base = context.current_mode()
  mode = context._Mode(strategy, replica_context=base.replica_context)
  mode.explicit_default = True
  return mode


# The runtime's sync count when the last `strategy.run` on a device returned.
_steps_ended = [None]


def _end_previous_step():
  """`strategy.run` ends the step before it, as TF users expect (they never cut
  graphs): when nothing cut the graph since the last `run` returned, the work
  pending since then (the last step's program when it was traced lazily, a
  `strategy.reduce` of its losses, a metric reset) is cut now and runs as one
  program before this step is traced, so it never joins this step's program. A
  script that calls `torch_xla.sync()` after each step changes nothing (its
  sync is counted). The last step's work runs when a value is read (or at the
  next `run`)."""
  if _steps_ended[0] is not None and _runtime.boundary_count() == _steps_ended[0]:
    seeds.STEP_SEEDS.sync_between_steps()


class Strategy(StrategyLegacy):
  """A way to run one training step on several replicas.

  Make the model and optimizer under `scope()`, then call `run(step_fn, args)`
  once per global step. Every replica is traced into ONE XLA program; every
  cross-replica operation is an XLA collective inside it.
  """

  def __init__(self, extended):
    self._extended = extended

  def __repr__(self):
    return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"

  def __deepcopy__(self, memo):
    """A strategy of the same kind and configuration (TF: StrategyBase.__deepcopy__,
    which Keras' clone paths use).

    The copy has the same devices, cluster and options and works on its own:
    it owns none of this strategy's variables (each keeps the strategy it was
    made under, as in TF) and starts with no traced steps. The default strategy
    is one per process: its copy is itself.

    Raises:
      NotImplementedError: the strategy cannot be copied (ParameterServerStrategy).
    """
    if self._extended._is_default:
      memo[id(self)] = self
      return self
    new = type(self).__new__(type(self))
    memo[id(self)] = new
    new._extended = self._extended._copy_for(new)
    memo[id(self._extended)] = new._extended
    for key, value in self.__dict__.items():
      if key != "_extended":
        setattr(new, key, copy.deepcopy(value, memo))
    return new

  def __copy__(self):
    raise RuntimeError(
      f"copy.copy({self!r}): a strategy cannot be copied shallowly (the copy would "
      "share the original's variables and steps). Use copy.deepcopy(strategy) for "
      "a strategy of the same configuration, or pass the strategy object itself."
    )

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
        f"{type(args).__name__}; pass a single argument as args=(x,)."
      )
    if kwargs is not None and not isinstance(kwargs, dict):
      raise TypeError(f"strategy.run: kwargs must be a dict, got {type(kwargs).__name__}.")
    if options is not None:
      if not isinstance(options, RunOptions):
        raise TypeError(
          f"strategy.run: options must be an xladist.RunOptions, got {type(options).__name__}."
        )
    _require_cross_replica(
      self,
      "strategy.run",
      "Call the function directly inside a step, or use "
      "get_replica_context().merge_call() to reach cross-replica context.",
    )
    args, kwargs = tuple(args), dict(kwargs or {})
    extended = self._extended
    # Not from merge_fn (run there re-enters the step being traced).
    on_device = (
      not extended._in_region() and extended._current_device().type == _runtime.DEVICE_KIND
    )
    if on_device:
      if not extended._grouping:
        _end_previous_step()
      extended._compile_watch.before_step(
        fn, args, kwargs, extended._store, lazy_state=getattr(extended, "_engine", None) is not None
      )
    try:
      with self.scope():
        return extended._call_for_each_replica(fn, args, kwargs, options)
    finally:
      if on_device:
        _steps_ended[0] = _runtime.boundary_count()

  def reduce(self, reduce_op, value, axis=None, destinations=None):
    """Reduces `value` across replicas (and along `axis` inside each replica).

    Returns a plain tensor. With two replicas holding [1., 2.] and [3., 4.]:
    `reduce("sum", v, axis=None)` gives [4., 6.]; `reduce("sum", v, axis=0)`
    gives 10.; `reduce("mean", v, axis=0)` gives 2.5 (the mean over all
    elements of all replicas).

    A nest (tuple, list, dict, namedtuple, dataclass) of such values, e.g.
    what `run` returned, gives the same nest of reduced tensors, each leaf
    reduced on its own (`reduce("sum", (v, {"w": v}), axis=None)` gives
    `([4., 6.], {"w": [4., 6.]})`).

    The legacy form `reduce("sum", value, destinations)` (tf.contrib) returns the
    reduced value on `destinations` (a Mirrored for several devices).

    Raises:
      RuntimeError: called in a replica context (use ReplicaContext.all_reduce).
      ValueError: `axis` out of range, or a non-distributed value with SUM.
    """
    if axis is not None and not isinstance(axis, int):
      destinations, axis = axis, None  # legacy reduce(method, value, destinations)
    reduce_op = as_reduce_op(reduce_op, "strategy.reduce")
    _require_cross_replica(
      self, "strategy.reduce", "Use get_replica_context().all_reduce() inside a step."
    )
    if destinations is not None:
      return self._extended.reduce_to(reduce_op, value, destinations)
    ext = self._extended
    tracing = ext._tracing()
    if flatten(value)[1].is_leaf():
      return ext._reduce(reduce_op, as_value(value, tracing), axis)

    def reduce_leaf(path, leaf):
      try:
        return ext._reduce(reduce_op, as_value(leaf, tracing), axis)
      except (TypeError, ValueError) as e:
        raise error_at(e, value, path) from None

    return tree_map_with_path(reduce_leaf, value)

  def gather(self, value, axis):
    """Concatenates the replicas' components of `value` along `axis`.

    With two replicas holding [[1, 2]] and [[3, 4]], `gather(v, axis=0)` gives
    [[1, 2], [3, 4]]. A Mirrored or plain tensor counts once per replica.

    Raises:
      RuntimeError: called in a replica context (use ReplicaContext.all_gather).
    """
    _require_cross_replica(
      self, "strategy.gather", "Use get_replica_context().all_gather() inside a step."
    )
    return self._extended._gather(value, axis)

  def experimental_local_results(self, value):
    """The tuple of this host's per-replica components of `value`; on one host,
    every replica's.

    A distributed value or a variable gives its components; a nest (tuple,
    list, dict, namedtuple, dataclass) one nest per replica, also without any
    tensor (`run(lambda: {"a": 1.})` on two replicas gives `({"a": 1.},
    {"a": 1.})`, as in TF); any other value a 1-tuple.
    """
    return self._extended._local_results(value)

  def experimental_distribute_values_from_function(self, value_fn):
    """A PerReplica whose component r is `value_fn(ValueContext(r, N))`.

    On several hosts `value_fn` is called for this host's replicas only (as in
    TF), and must return tensors.
    """
    if not callable(value_fn):
      raise TypeError(
        "experimental_distribute_values_from_function: value_fn must be callable, "
        f"got {type(value_fn).__name__}."
      )
    n = self.num_replicas_in_sync
    replicas = self._extended._fed_replicas()
    values = [value_fn(ValueContext(r, n)) for r in replicas]
    if n == 1:
      return values[0]
    spec = flatten(values[0])[1]
    replicas = list(replicas)
    for r, value in zip(replicas[1:], values[1:]):
      other = flatten(value)[1]
      if other != spec:
        raise ValueError(
          "experimental_distribute_values_from_function: value_fn returned "
          f"differently structured values for different replicas (replica "
          f"{replicas[0]}: {spec}, replica {r}: {other}); return the same nest of "
          "tensors for every replica."
        )

    def group(path, *components):
      # One leaf of every fed replica's value -> one distributed value.
      try:
        return self._extended._group_leaf(list(components))
      except (TypeError, ValueError) as e:
        raise error_at(e, values[0], path) from None

    return tree_map_with_path(group, *values)

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
    get a mask of the real rows) or "drop". With one replica nothing is split,
    so elements without a batch dimension (scalars, tuples of scalars) are
    delivered whole, as in TF; with several they are refused (a ValueError).

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
        "InputReplicationMode.PER_WORKER here."
      )
    input_dataset.check_dataset(dataset, api)
    _require_cross_replica(
      self,
      api,
      "Distribute the dataset before the training loop, and pass its elements to strategy.run.",
    )
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

    Nothing is split, so an element may have no batch dimension (a 0-d tensor,
    a Python number, a tuple of them): replica r gets exactly its element, with
    Python numbers made tensors as TF makes them (int -> int32, float ->
    float32). Every step must have the same shapes; see
    `InputOptions.experimental_partial_batch` for per-replica batches that come
    short or run out at the end. When some replica's elements without a batch
    dimension run out, the epoch ends there, as in TF (logged), unless "mask".

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
      raise TypeError(f"{api}: dataset_fn must be callable, got {type(dataset_fn).__name__}.")
    options = _check_input_options(options, api)
    _require_cross_replica(
      self,
      api,
      "Distribute the datasets before the training loop, and pass their elements to strategy.run.",
    )
    return self._extended._distribute_datasets_from_function(dataset_fn, options)

  def experimental_distribute_datasets_from_function(self, dataset_fn, options=None):
    """Former name of `distribute_datasets_from_function`."""
    return self.distribute_datasets_from_function(dataset_fn, options)


def experimental_set_strategy(strategy):
  """Makes `strategy` current for this thread without a `with` block.

  `experimental_set_strategy(None)` returns to the default strategy.

  Raises:
    RuntimeError: called inside a strategy scope (exit the scope first).
    TypeError: `strategy` is not an xladist Strategy or None.
  """
  if strategy is not None and not isinstance(strategy, Strategy):
    raise TypeError(
      "experimental_set_strategy expects an xladist Strategy or None, got "
      f"{type(strategy).__name__}."
    )
  old = context.base()
  mode = None if strategy is None else context._Mode(strategy, cross_replica=strategy)
  context.set_base(mode)  # raises inside a scope
  if old is not None:
    old.strategy.extended._exit_scope()
  if strategy is not None:
    strategy.extended._enter_scope()


def _check_input_options(options, api):
  if options is None:
    return InputOptions()
  if not isinstance(options, InputOptions):
    raise TypeError(
      f"{api}: options must be an xladist.InputOptions or None, got {type(options).__name__}."
    )
  return options
