"""The step engine of the SPMD strategies: one `strategy.run`, in three phases.

MirroredStrategy, MultiWorkerMirroredStrategy, TPUStrategy and
CentralStorageStrategy run every step through a `StepEngine` (the extended
object of each owns one, `extended._engine`; a strategy that needs more work
around a step declares its own engine class, `extended._engine_class`):

(a) collect: the step's arguments are placed with the region's sharding
    (`Region.enter_value`: host values and tensors of other placements), the
    variables made since the last step are placed (`VariableStore.
    place_pending`), and the global value of every variable, gradient,
    optimizer slot and sync-on-read component is recorded with its identity
    (`VariableStore.enter`: `Step.variables`, `Step.watch`);
(b) run the body: `fn` is traced once for all replicas in a manual region,
    each variable bound to its replica-local view, in a replica context, with
    host reads refused (`runtime.no_execution`) and the runtime library's own
    idioms (torch_xla's xm.*) given xladist's meaning (`runtime.foreign_idioms`
    with `_IDIOMS`); `optimizer.step()` aggregates the gradients
    first (`before_optimizer_step`), as does torch's gradient clipping
    (`aggregate_for_clipping`);
(c) write back: the outputs leave the region as PerReplica or replicated
    global values (`Region.exit_value`), every variable gets its global value
    back, written ones with their new value after the write rules
    (`VariableStore.exit`), and tensors made in the step are invalidated
    (`StepTensors.release`). A step that fails puts back what it touched
    (`VariableStore.restore`).

With replay (`replay.py`), once the traced program of a step is known, (b)
is skipped: the program runs again on the new inputs.
"""

import contextlib
import sys
import traceback

import torch
from torch.optim import optimizer as torch_optimizer

from xladist import collectives, context, sharded_state, sharded_units
from xladist import runtime as _runtime
from xladist._nest import flatten, tree_map, unflatten
from xladist._step import hyper, python_effects, rng_state, seeds
from xladist._step.device_state import place_host_state, prepare_optimizer
from xladist._step.grad_clip import ensure_installed as _ensure_clipping_hook
from xladist._step.region import HOST_READ_MESSAGE, Region
from xladist._step.replay import PLACED, Replayer
from xladist._step.tensors import StepTensors
from xladist.reduce_util import ReduceOp
from xladist.replica_context import ReplicaContext
from xladist.values import PerReplica


def _step_replica_context():
  """The ReplicaContext of the step's replica function (None elsewhere, e.g. in merge_fn)."""
  ctx = context.get_replica_context()
  return None if ctx is None or ctx._region is None else ctx


# What the runtime library's own idioms mean inside a step (runtime.foreign_idioms).
_IDIOMS = {
  "replica_context": _step_replica_context,
  "select_own": collectives.select_own,
  "reduce_ops": {"sum": ReduceOp.SUM, "min": ReduceOp.MIN, "max": ReduceOp.MAX},
}


class StepEngine:
  """Runs the steps of one SPMD strategy (see the module docstring).

  Args:
    extended: the strategy's StrategyExtended; the engine reads its
      variable store, compile watch, replica iota and gradient aggregation.
  """

  def __init__(self, extended):
    self._ext = extended
    self.region = None  # the Region of the step being traced, else None
    self._replayer = None
    self._swapped = None  # the hyper.Swapped of the step being traced
    self._effects = None  # the python_effects.Recorder of the step being traced
    rng_state.register_device_module()

  # -- what a strategy declares ----------------------------------------------------------
  def replay_gap(self):
    """Why this strategy's steps are not replayed, or None when they are.

    Replayed: one host or several (every host traces the same steps, so every
    host decides alike and runs the same program), with or without logical
    devices per replica (TPUStrategy)."""
    return None

  # -- one step ---------------------------------------------------------------------------
  def run(self, fn, args, kwargs, options):
    """`strategy.run(fn, args, kwargs, options)` outside any step."""
    ext = self._ext
    store = ext._store
    _ensure_clipping_hook()
    placed = store.place_pending() > 0
    seeds.follow_torch_seed()
    # Replay: once the step's program is known, run it without tracing fn;
    # otherwise trace, and capture the traced program.
    if self._replayer is None:
      self._replayer = Replayer(ext, self.replay_gap())
    out, attempt = self._replayer.run(
      fn, args, kwargs, ext._compile_watch, PLACED if placed else options
    )
    # Traced after all: what its tensors hold, as it begins (replayed: not needed).
    ext._compile_watch.take_state(traced=attempt is not None)
    if attempt is None:
      return out
    if attempt.args is not None:
      args, kwargs = attempt.args, attempt.kwargs
    region = Region(ext._strategy_ref, ext._replica_iota, ext._device_iota, ext._all_reduce_local)
    step = region.step
    made = StepTensors(region)
    seeds.watch_draws(region, made)
    hooks = (
      torch_optimizer.register_optimizer_step_pre_hook(self._before_optimizer_step),
      torch_optimizer.register_optimizer_step_post_hook(self._after_optimizer_step),
    )
    self._saved_hooks = contextlib.nullcontext()
    units = None
    if store.sharding is not None and store.sharding.shards("parameters"):
      # Each unit's parameters are gathered when it runs and again in its
      # backward (sharded_units.py).
      units = sharded_units.UnitGathers(step.sharded, store.sharding.units)
      hooks += (
        torch.nn.modules.module.register_module_forward_pre_hook(units.pre),
        torch.nn.modules.module.register_module_forward_hook(units.post),
      )
      self._saved_hooks = units.saved_tensors()
    self.region = region
    swapped = self._swapped = hyper.Swapped(
      active=attempt.wants_hypers(), carried=self._replayer.carried()
    )
    # What fn's Python reads and writes (python_effects.py), for a step that may
    # be captured; the values read that changed between steps are Hypers.
    effects = self._effects = (
      python_effects.Recorder(fn, region.is_variable) if attempt.wants_hypers() else None
    )
    for namespace, name in self._replayer.varying(fn):
      swapped.swap_value(namespace, name)
    try:
      # Only frames below this one hold replica-local views (see _clear_step_frames).
      with swapped:
        out = _runtime.traced_step(lambda: self.trace(fn, args, kwargs, region, made))
    except _runtime.HostReadInStep as e:
      attempt.abandon()
      store.restore(step)
      _clear_step_frames(e.__traceback__)
      raise RuntimeError(HOST_READ_MESSAGE.format(detail=str(e))) from None
    except BaseException as e:
      attempt.abandon()
      store.restore(step)
      _clear_step_frames(e.__traceback__)
      raise
    finally:
      for hook in hooks:
        hook.remove()
      if units is not None:
        units.close()  # the step's tensors it holds (a later sync would compute them)
        self._saved_hooks = contextlib.nullcontext()
      keep = {id(t) for t, *_ in step.variables}
      seeds.forget_draws(region)
      region.close()
      self.region = None
      self._swapped = None
      self._effects = None
      del step
      made.release(keep, fn)
    return hyper.plain(attempt.finish(out, swapped, effects))

  def replay_steps(self, fn, args_list):
    """experimental_run_steps' steps after a replayed one, as one replayed
    program (`Replayer.replay_steps`): their results, or None."""
    if self._replayer is None or self._ext._store._pending:
      return None
    return self._replayer.replay_steps(fn, args_list)

  def trace(self, fn, args, kwargs, region, made):
    """Phases (a) to (c) of a traced step: enter the region, trace `fn` once
    for all replicas, leave the region."""
    ext = self._ext
    strategy, store, step = ext._strategy_ref, ext._store, region.step
    leaves, spec = flatten((args, kwargs))
    entered = [region.enter_value(x) for x in leaves]
    for t in entered:
      made.track(t)
    local_args, local_kwargs = unflatten(spec, entered)
    del entered
    # Global tensors this strategy keeps are made before `made` records.
    ext._replica_iota()
    if ext._cores_per_replica > 1:
      ext._device_iota()
    store.enter(step)
    for optimizer in store.optimizers():
      self._swapped.swap(optimizer)
    mode = context._Mode(strategy, replica_context=ReplicaContext(strategy, region))
    context.push(mode)
    try:
      # Backward runs in this thread (`single_threaded_autograd`); the step is
      # one XLA program already, so torch.compile'd code inside runs as its own
      # Python (a compiled graph would be traced into the program anyway).
      with (
        _runtime.no_execution(),
        _runtime.foreign_idioms(_IDIOMS),
        made,
        single_threaded_autograd(),
        torch.compiler.set_stance("force_eager"),
        self._swapped.recording(),
        self._effects if self._effects is not None else contextlib.nullcontext(),
        self._saved_hooks,
      ):
        out = fn(*local_args, **local_kwargs)
    finally:
      context.pop(mode)
    leaves, spec = flatten(out)
    result = unflatten(spec, [region.exit_value(x) for x in leaves])
    store.exit(step, region.global_replicated)
    return result

  def call_in_merge(self, fn, args, kwargs):
    """call_for_each_replica inside merge_fn (TF allows it): the step's replicas
    run `fn` again, each with its own components; results come back in the
    merge_call form of PerReplica."""
    strategy, region = self._ext._strategy_ref, self.region
    local_args, local_kwargs = tree_map(region.local_of, (args, kwargs))
    mode = context._Mode(strategy, replica_context=ReplicaContext(strategy, region))
    context.push(mode)
    try:
      out = fn(*local_args, **local_kwargs)
    finally:
      context.pop(mode)
    return tree_map(
      lambda x: PerReplica._from_local(x, region) if isinstance(x, torch.Tensor) else x, out
    )

  # -- gradients ---------------------------------------------------------------------------
  def _in_this_step(self):
    """The replica context of this engine's step, or None."""
    ctx = context.get_replica_context()
    if self.region is None or ctx is None or ctx.strategy is not self._ext._strategy_ref:
      return None
    return ctx

  def _before_optimizer_step(self, optimizer, args, kwargs):
    ctx = self._in_this_step()
    if ctx is not None:
      self.before_optimizer_step(ctx, optimizer)

  def _after_optimizer_step(self, optimizer, args, kwargs):
    if self.region is not None:
      self.after_optimizer_step(optimizer)

  def _optimizer_params(self, optimizer, where):
    """The optimizer's parameters with a gradient; refuses any that is not a
    variable of this strategy (`where`: what holds the variables)."""
    step = self.region.step
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    foreign = [tuple(p.shape) for p in params if not step.is_variable(p)]
    if foreign:
      raise RuntimeError(
        f"optimizer.step() in strategy.run: {len(foreign)} of the optimizer's "
        f"parameters (shapes {foreign[:3]}...) are not variables of "
        f"{self._ext._strategy_ref!r}. Create the model under strategy.scope() so that "
        f"{where}."
      )
    return params

  def before_optimizer_step(self, ctx, optimizer):
    """optimizer.step() in a replica context: aggregate the gradients first."""
    store, step = self._ext._store, self.region.step
    # Refuses LBFGS and SparseAdam (at every traced step, not only the first);
    # makes ASGD's host scalars, runs Adafactor in tensor ops, sets Rprop's
    # capturable path.
    prepare_optimizer(optimizer)
    if store.track_optimizer(optimizer):
      place_host_state(optimizer)
      store.enter_optimizer(optimizer, step)
    self._swapped.swap(optimizer)
    params = self._optimizer_params(optimizer, "its parameters are mirrored on every replica")
    step.stepped.update(id(p) for p in params)
    # Mirrored variables with an aggregation that the optimizer updates are
    # updated identically on every replica (from aggregated gradients).
    step.optimizer_clean[id(optimizer)] = step.clean([p for p in params if step.is_aggregated(p)])
    if store.sharding is None:
      self.aggregate_gradients(ctx, params, "optimizer.step()")
      return
    # Sharded state (sharded_state.py): the update runs on each replica's rows,
    # of gradients reduce-scattered ("gradients", "parameters") or all-reduced.
    sharded_state.refuse_optimizer(optimizer)
    rows = self._sharded_grads(params)
    self.aggregate_gradients(ctx, [p for p in params if id(p) not in rows], "optimizer.step()")
    step.sharded.stepping[id(optimizer)] = step.sharded.to_shards(params)

  def after_optimizer_step(self, optimizer):
    step = self.region.step
    step.sharded.from_shards(step.sharded.stepping.pop(id(optimizer), ()))
    step.sanction(step.optimizer_clean.pop(id(optimizer), ()))

  def aggregate_for_clipping(self, ctx, tensors):
    """torch's gradient clipping inside this step (`_step/grad_clip.py`): the
    gradients of variables in the list `tensors` are aggregated across
    replicas and replace the local ones, in the list and in `.grad`."""
    if self._in_this_step() is None or self._ext.experimental_gradient_aggregation is None:
      return
    owner = {id(t.grad): t for t, *_ in self.region.step.variables if t.grad is not None}
    params = [owner.get(id(t)) for t in tensors]
    found = [p for p in params if p is not None]
    if not found:
      return
    rows = self._sharded_grads(found)
    self.aggregate_gradients(
      ctx, [p for p in found if id(p) not in rows], "torch.nn.utils gradient clipping"
    )
    for i, p in enumerate(params):
      if p is not None:
        tensors[i] = rows.get(id(p), p.grad)

  def _sharded_grads(self, params):
    """Under a level that shards gradients, the rows of the sharded parameters'
    aggregated gradients ({id(param): row}; reduce-scattered once per step):
    clipping scales the rows, and optimizer.step() uses them."""
    sharding = self._ext._store.sharding
    if sharding is None or not sharding.shards("gradients"):
      return {}
    step = self.region.step
    sharded, done = step.sharded, step.aggregated_grads
    # One all-reduced whole earlier in the step (a foreign clipping function) is sliced.
    todo = [p for p in params if sharded_state.layout_of(p) is not None and id(p) not in done]
    sharded.reduce_scatter(todo, self._ext.experimental_gradient_aggregation, keep_grads=True)
    return sharded.grad_rows_of(todo)

  def clip_total_norm(self, tensors, norm_type, total_norm):
    """torch's total gradient norm inside this step when some of `tensors` are
    rows of sharded gradients (each replica holds other rows): their norm is
    combined across the replicas, the whole gradients' norm is taken once.
    `total_norm`: torch's function. None when nothing is sharded."""
    if self._in_this_step() is None:
      return None
    rows_ids = self.region.step.sharded.grad_row_ids()
    rows = [t for t in tensors if id(t) in rows_ids]
    whole = [t for t in tensors if id(t) not in rows_ids]
    if not rows:
      return None
    n = self.region.num_replicas
    local = total_norm(rows, norm_type)
    if norm_type == float("inf"):
      total = collectives.all_reduce(ReduceOp.MAX, [local], n)[0]
      return torch.maximum(total, total_norm(whole, norm_type)) if whole else total
    powered = collectives.all_reduce(ReduceOp.SUM, [local**norm_type], n)[0]
    if whole:
      powered = powered + total_norm(whole, norm_type) ** norm_type
    return powered ** (1.0 / norm_type)

  def aggregate_gradients(self, ctx, params, api):
    """Replaces each parameter's local gradient by its aggregate across replicas
    (the strategy's experimental_gradient_aggregation; one merge_call, packed
    into few all-reduces), except those aggregated earlier in this step (by
    gradient clipping)."""
    op = self._ext.experimental_gradient_aggregation
    done = self.region.step.aggregated_grads
    todo = []
    for p in params:
      if p.grad is None:
        continue
      if id(p) not in done:
        todo.append(p)
      elif done[id(p)] is not p.grad:
        raise RuntimeError(
          f"{api} in strategy.run: a gradient was replaced after gradient clipping "
          "had aggregated it across replicas in this step (e.g. another backward() "
          "with set_to_none, or an assignment to .grad), so xladist cannot tell "
          "whether it is a per-replica or an aggregated value. Clip right before "
          "optimizer.step(), after every backward() of the step."
        )
    if op is None or not todo:
      return

    def merge_fn(strategy, *grads):
      return strategy.extended.batch_reduce_to(op, [(g, g) for g in grads])

    reduced = ctx.merge_call(merge_fn, args=[p.grad for p in todo])
    for p, g in zip(todo, reduced):
      p.grad = g
      done[id(p)] = g


def single_threaded_autograd():
  """Runs the step's backward passes in the tracing thread.

  torch's autograd engine sizes its per-device worker queues once, at the first
  backward of the process, from the device types registered then. A CPU
  `loss.backward()` before torch_xla was imported (a notebook's sanity check;
  `import xladist` does not import torch_xla) leaves no queue for XLA devices,
  and every later XLA backward fails an internal assert in engine.cpp. With
  multithreading off the engine runs every node in the calling thread and never
  looks those queues up; tracing gains nothing from the worker thread anyway
  (it only records operations).
  """
  return torch.autograd.set_multithreading_enabled(False)


def _clear_step_frames(tb):
  """Clears the locals of the finished frames below `StepEngine.run` in a traceback.

  They hold replica-local views of the step's tensors; reading one after the
  step (a traceback printer showing arguments, e.g. pytest's long tracebacks,
  or a debugger) makes torch_xla 2.9 abort the process ("Check failed:
  !IsManual()"). The traceback keeps its files, lines and source.
  """
  here = sys._getframe(1)  # StepEngine.run
  while tb is not None and tb.tb_frame is not here:
    tb = tb.tb_next
  if tb is not None:
    traceback.clear_frames(tb.tb_next)  # skips frames still running (generators)
