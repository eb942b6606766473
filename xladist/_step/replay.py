"""Replay: `strategy.run` runs a step's compiled program without tracing `fn` again.

On by default; `XLADIST_REPLAY=0` turns it off, `RunOptions(experimental_replay=
False)` for one run (True turns it on for one run whatever the variable says).

Tracing a step (running `fn`'s Python on lazy tensors, entering and leaving the
manual region, hashing the graph) costs the host far more than launching the
compiled program (docs/architecture.md, "Replay"). So once a step's program is
known, `strategy.run` *replays* it: the program is run again with torch_xla's
cached-graph primitives (the ones its dynamo bridge uses), on the current
values of the step's inputs, and the outputs are written back where the traced
step would have left them.

What a program reads and writes is found by *capturing* a traced step:

* before the trace, every place a step's state lives (a *slot*: a variable, its
  gradient, a sync-on-read variable's per-replica components, an optimizer
  state entry, a tensor hyperparameter) and every argument's global tensor is
  listed with the identity of its device buffer;
* after the trace, the program's outputs are the returned tensors and every
  slot the step wrote; its inputs (the graph's device data, in parameter order)
  are each a slot, an argument, the random-number seed, an optimizer
  *hyperparameter* (`hyper.py`: fed its current value at each replay), or a
  *constant* (a buffer nothing names: a Python scalar torch_xla made device
  data, a tensor captured from outside), recognised by buffer identity;
* every trace of a key that can be captured is: compiled (`_xla_warm_up_cache`;
  the second capture of a key finds the program compiled) and run
  (`_run_cached_graph`) when `run` returns. A trace that cannot be captured
  (the first step of an optimizer, which makes its state) stays lazy, as
  without replay.

Promotion: a step is replayed once two consecutive traces of the same *key*
described the same program (graph hash, input and output mapping, constant
buffers or values). The key is the step's signature (`_step_signature`: argument
shapes, dtypes and shardings, the Python values `fn` reads by name, modules'
train/eval flags, variables' requires_grad and gradients, whether each
optimizer hyperparameter is 0, 1 or another number, state sizes) plus what the
program's mapping assumes: the identities of the variables, optimizers, their
state and parameter groups, of the objects `fn` reads by name (closure cells,
globals, default arguments), of the non-tensor objects passed as arguments, the
grad mode and the strategy's gradient aggregation. A different key traces (and
is captured in turn).

Random numbers: a replayed program takes torch_xla's seed as an input. The
seed it gets, and the seed left for what follows, are those the traced step
would have used and left (`_Seeds`, which also keeps a step's program the same
when random ops of earlier steps ran since the last sync), so dropout masks are
the same bit for bit, whether the user syncs after each step or not.

Never replayed (traced as before, and said why with `XLADIST_REPLAY_DEBUG=1`):

* a step that changes state outside the XLA device other than a host step
  counter (a Python number in an optimizer's state; the counters of torch's
  default Adam, AdamW, Adagrad replay: a replay adds to them, hyper.py), changes
  an optimizer's parameter groups
  (a scheduler stepped inside `fn`), returns a host tensor or an object that is
  not a plain Python value, or creates state (the first step of an optimizer, a
  variable made in the step);
* a step whose inputs are pending (a variable written outside a step and not
  synced: tracing fuses that write into the step's program);
* CentralStorageStrategy (its optimizer runs on the host after the program);
  OneDeviceStrategy and the default strategy call `fn` directly and do not
  replay. Several hosts and TPUStrategy's logical devices replay (every host
  traces the same steps, so every host decides alike);
* replay off (`XLADIST_REPLAY=0`, `RunOptions(experimental_replay=False)`).

`experimental_run_steps(k)`: once its first step is replayed, the other k - 1
steps run as ONE program (`Replayer.replay_steps`): on torch_xla a *group*,
the k - 1 steps traced back to back (their random ops one seed chain) and
captured under the step's key like a step of their own (captured twice, then
replayed); on jax a scan of the step's program. A call
is then two executions and traces nothing.

The contract: `fn`'s Python runs only when the step is traced (as with
`tf.function` and `jax.jit`): Python side effects (printing, appending to a
list, counting in a mutable object) happen on traced steps only, and values
`fn` reaches other than through the watched places (through another function,
a mutable object's attribute, a dict of models) are those of the last trace.
Every `XLADIST_REPLAY_VERIFY` steps (default 100; 1: every step; 0: never) a
step of a replayed key is traced instead and its program compared with the
capture; a difference means the replayed steps since the last check were
stale: it is logged and warned about (raised as a RuntimeError when
`XLADIST_REPLAY_VERIFY` is set), and the new capture replaces the old.
"""

import collections
import logging
import os
import types
import warnings
import weakref

import numpy as np
import torch

from xladist import runtime as _runtime
from xladist._nest import flatten, unflatten
from xladist._step import hyper, seeds
from xladist._step import signature as signatures
from xladist.values import _NOT_CONSTANT, DistributedValues, Mirrored, PerReplica
from xladist.variable_store import copies_of

logger = logging.getLogger("xladist")

_PLAIN = (bool, int, float, str, bytes, type(None))
_OFF = ("0", "off", "false", "no")
DEFAULT_VERIFY_EVERY = 100
_MAX_KEYS = 16  # keys (programs) kept per strategy, least recently used dropped
_FRESH_LIMIT = 3  # steps in a row with a new key after which they are not captured


def _xla():
  return _runtime.native()


def _env_off(name):
  return os.environ.get(name, "").strip().lower() in _OFF


class _Placed:
  """`Replayer.run`'s options when the run placed new variables first: the
  signature the compile watch took saw them before, so this step is traced."""

  experimental_replay = False


PLACED = _Placed()


def enabled(options):
  """Whether replay is on for a run: `RunOptions(experimental_replay=...)` when
  given, else `XLADIST_REPLAY` (0 / off turns it off), else on (the default on
  both runtimes; see docs/architecture.md, "Replay")."""
  choice = getattr(options, "experimental_replay", None) if options is not None else None
  if choice is not None:
    return bool(choice)
  return os.environ.get("XLADIST_REPLAY", "").strip().lower() not in _OFF


def verify_every():
  """(K, strict): every K-th step of a replayed key is traced and compared (0:
  never); strict when XLADIST_REPLAY_VERIFY is set (a stale replay raises)."""
  text = os.environ.get("XLADIST_REPLAY_VERIFY", "").strip()
  if not text:
    return DEFAULT_VERIFY_EVERY, False
  try:
    k = int(text)
  except ValueError:
    raise ValueError(
      f"XLADIST_REPLAY_VERIFY must be an int (verify every that many steps; 1: every "
      f"step, 0: never), got {text!r}."
    ) from None
  return max(0, k), True


def _debug():
  text = os.environ.get("XLADIST_REPLAY_DEBUG", "").strip().lower()
  return text not in ("",) + _OFF


# -- torch_xla's random-number seed -------------------------------------------------------


def _signed(seed):
  return seed - (1 << 64) if seed >= (1 << 63) else seed


def _seed_tensor(seed):
  """The seed as the int64 device scalar a traced graph's seed parameter holds."""
  return _runtime.place_replicated(torch.tensor(_signed(seed), dtype=torch.int64))


# -- slots: where a step's state lives between steps ----------------------------------------

VAR, GRAD, COPIES, OPT, GROUP, FREE = range(6)


class _Slot:
  """One place a state tensor lives: a variable (its `.data`), its `.grad`, a
  sync-on-read variable's components, `optimizer.state[param][key]`, a tensor
  in a parameter group, or an XLA tensor `fn` reads by name (FREE: a closure
  cell, a global, an attribute of its object; read afresh at every replay, so
  that an in-place update between steps is seen)."""

  __slots__ = ("kind", "tensor", "owner", "key", "describe")

  def __init__(self, kind, tensor, owner=None, key=None, describe=None):
    self.kind, self.tensor, self.owner, self.key, self.describe = kind, tensor, owner, key, describe

  def ident(self):
    return (self.kind, id(self.tensor), id(self.owner), self.key)

  def get(self, settle=True):
    kind = self.kind
    if kind == VAR:
      return self.tensor
    if kind == GRAD:
      return self.tensor.grad
    if kind == COPIES:
      copies = copies_of(self.tensor)
      if copies is None:
        return None
      return copies.current(self.tensor, self.describe) if settle else copies.stacked
    if kind == OPT:
      state = self.owner.get(self.tensor)
      return None if state is None else state.get(self.key)
    if kind == FREE:
      value = self.owner.cell_contents if self.key is None else self.owner.get(self.key)
      return value if value is self.tensor else None
    return self.owner.get(self.key)

  def set(self, value):
    kind = self.kind
    if kind == VAR:
      self.tensor.data = value
    elif kind == GRAD:
      self.tensor.grad = value
    elif kind == COPIES:
      copies_of(self.tensor).stacked = value
    elif kind == OPT:
      self.owner[self.tensor][self.key] = value
    elif kind == FREE:
      self.tensor.data = value
    else:
      self.owner[self.key] = value


def _slots(store):
  """Every slot of `store`'s variables and tracked optimizers, in a stable order."""
  out = []
  seen = set()
  describe = store.describe
  for t in store.variables():
    if id(t) in seen:
      continue
    seen.add(id(t))
    out.append(_Slot(VAR, t))
    if t.grad is not None:
      out.append(_Slot(GRAD, t))
    if copies_of(t) is not None:
      out.append(_Slot(COPIES, t, describe=describe))
  for opt in store.optimizers():
    for group in opt.param_groups:
      for key, v in group.items():
        if key != "params" and isinstance(v, torch.Tensor) and _runtime.is_device_tensor(v):
          out.append(_Slot(GROUP, None, group, key))
    for p, state in opt.state.items():
      for key, v in state.items():
        if isinstance(v, torch.Tensor) and _runtime.is_device_tensor(v):
          out.append(_Slot(OPT, p, opt.state, key))
  return out


def _is_xla_tensor(value):
  return isinstance(value, torch.Tensor) and _runtime.is_device_tensor(value)


def _free_slots(fn):
  """FREE slots: the XLA tensors `fn` reads by name (see `_Slot`)."""
  out = []
  bound = getattr(fn, "__self__", None)
  f = getattr(fn, "__func__", fn)
  code = getattr(f, "__code__", None)
  if code is None:
    return out
  for cell in f.__closure__ or ():
    try:
      value = cell.cell_contents
    except ValueError:
      continue
    if _is_xla_tensor(value):
      out.append(_Slot(FREE, value, cell))
  glob = f.__globals__
  for name in code.co_names:
    value = glob.get(name)
    if _is_xla_tensor(value):
      out.append(_Slot(FREE, value, glob, name))
  if bound is not None:
    attrs = getattr(bound, "__dict__", {})
    for name, value in attrs.items():
      if _is_xla_tensor(value):
        out.append(_Slot(FREE, value, attrs, name))
  return out


def _host_state(store):
  """What a step could change in optimizers outside the XLA device: host tensors
  (by identity and version) and Python values in their state."""
  out = []
  for i, opt in enumerate(store.optimizers()):
    for p_index, state in enumerate(opt.state.values()):
      for key, v in state.items():
        if isinstance(v, torch.Tensor):
          if not _runtime.is_device_tensor(v):
            value = float(v) if v.dim() == 0 and v.is_floating_point() else None
            out.append(((i, p_index, key), (id(v), v._version, value)))
        elif isinstance(v, _PLAIN):
          out.append(((i, p_index, key), v))
        else:
          out.append(((i, p_index, key), id(v)))
  return out


def _host_change(store, before, after):
  """(words naming the first host-side optimizer state a step changed, or None;
  the host step counters it advanced: [(state dict, key, increment)]).

  A float CPU scalar of a parameter's state that the step added to (the `step`
  of torch's default Adam, AdamW, Adagrad, ...) is a counter: a replayed step
  adds the same, and hyper.py feeds the bias corrections for its new value."""
  if before == after:
    return None, []
  old = dict(before)
  optimizers = list(store.optimizers())
  states = [list(opt.state.values()) for opt in optimizers]
  counters = []
  for place, value in after:
    was = old.get(place, _MISSING)
    if was == value:
      continue
    i, p_index, key = place
    if (
      type(was) is tuple
      and type(value) is tuple
      and value[0] == was[0]
      and value[2] is not None
      and value[2] > was[2]
    ):
      counters.append((states[i][p_index], key, value[2] - was[2]))
      continue
    name = type(optimizers[i]).__name__
    return (
      f"{name} keeps state[...][{key!r}] outside the XLA device and the step changes it "
      "in a way replay cannot repeat (a Python value, or a host tensor that is not a "
      "step counter): its steps are traced every time; keep that state in a tensor on "
      "the device to replay them"
    ), counters
  return None, counters


_MISSING = object()


# -- the key: what a program's capture depends on -------------------------------------------


def _ref(value, depth=0):
  if isinstance(value, _PLAIN):
    return value
  if depth < 2 and type(value) is tuple:
    return tuple(_ref(v, depth + 1) for v in value)
  return ("id", id(value))


def _fn_refs(fn):
  """What `fn` reads by name besides its plain values: closure cells, default
  arguments and named globals (by identity), its bound object."""
  out = []
  bound = getattr(fn, "__self__", None)
  if bound is not None:
    out.append(id(bound))
  f = getattr(fn, "__func__", fn)
  code = getattr(f, "__code__", None)
  if code is None:
    return (id(fn),)
  out.append(id(code))
  for cell in f.__closure__ or ():
    try:
      out.append(_ref(cell.cell_contents))
    except ValueError:  # an empty cell
      out.append(_MISSING_REF)
  for value in f.__defaults__ or ():
    out.append(_ref(value))
  if f.__kwdefaults__:
    out.extend(_ref(v) for v in f.__kwdefaults__.values())
  glob = f.__globals__
  for name in code.co_names:
    value = glob.get(name, _MISSING)
    if value is not _MISSING and not isinstance(value, types.ModuleType):
      out.append(_ref(value))
  return tuple(out)


_MISSING_REF = ("empty",)


def _store_refs(store):
  """Identities of the variables and optimizers (a new Parameter object after
  `load_state_dict(assign=True)`, a replaced optimizer state after
  `optimizer.load_state_dict`, new parameter groups)."""
  variables = tuple(map(id, store.variables()))
  optimizers = []
  for opt in store.optimizers():
    host = tuple(
      (id(v), v._version)
      for g in opt.param_groups
      for k, v in g.items()
      if k != "params" and isinstance(v, torch.Tensor) and not _runtime.is_device_tensor(v)
    )
    optimizers.append((id(opt), id(opt.state), tuple(map(id, opt.param_groups)), host))
  return variables, tuple(optimizers)


def _arg_refs(leaves):
  return tuple(
    id(x) for x in leaves if not isinstance(x, (torch.Tensor, DistributedValues) + _PLAIN)
  )


# -- captured programs ------------------------------------------------------------------------

SLOT, ARG, CONST, SEED = range(4)
RET = 4
DROP = 5  # a result nothing keeps (a value of the step no slot or return holds)
HYPER = 6  # an optimizer hyperparameter (or arithmetic on some): `prog.hypers[i]`


class _Program:
  """One captured step program and how to feed it and place its outputs."""

  __slots__ = (
    "hash",
    "slots",
    "sources",
    "targets",
    "aliases",
    "cleared",
    "ret_spec",
    "ret_leaves",
    "draws",
    "consts",
    "restamp",
    "n_outputs",
    "runtime_program",
    "starts",
    "hypers",
    "groups",
    "scalar_slots",
    "host_vectors",
    "counters",
  )

  def fingerprint(self):
    sources = tuple(s if s[0] != CONST else (CONST,) for s in self.sources)
    return (
      self.hash,
      sources,
      tuple(self.targets),
      tuple(self.aliases),
      tuple(self.cleared),
      self.ret_spec,
      tuple(self.ret_leaves),
      self.draws,
      tuple(h.key() if h is not None else None for h in self.hypers),
    )


def _same_constants(a, b):
  """Whether two captures' constants are the same values (same buffers, or equal
  small tensors: a tensor made afresh by each trace from the same data)."""
  for x, y in zip(a, b):
    if x[0] == y[0]:
      continue
    tx, ty = x[1], y[1]
    if tx.shape != ty.shape or tx.dtype != ty.dtype or tx.numel() > 65536:
      return False
    if not torch.equal(tx.cpu(), ty.cpu()):
      return False
  return True


def _differs(old, new):
  """Words naming how two captures of one key differ, or None when they are the same."""
  fa, fb = old.fingerprint(), new.fingerprint()
  if fa[0] != fb[0]:
    return "a different graph (XLA program hash)"
  if fa != fb:
    return "the same graph with its inputs or outputs mapped differently"
  if not _same_constants(old.consts, new.consts):
    return (
      "the same graph with other constants (a Python number or a tensor fn reads "
      "from outside, e.g. through a helper function or an object's attribute)"
    )
  return None


class _Entry:
  __slots__ = ("program", "promoted", "since_verify", "refused", "failures", "groups")

  def __init__(self):
    self.program = None
    self.promoted = False
    self.since_verify = 0
    self.refused = None  # why this key is never replayed, or None
    self.failures = 0  # captures refused so far (twice: never again)
    self.groups = {}  # k -> _Entry of k steps after this key's step as one program (torch_xla)


# -- the replayer -------------------------------------------------------------------------------


class Replayer:
  """Replays the steps of one strategy (its `_call_for_each_replica` drives it).

  Attributes (for tests and benchmarks):
    replays / traces / captures: how many steps were replayed, traced, and
      traced and captured.
    reasons: (step number, why the step was traced) of the last 100 traced steps.
  """

  def __init__(self, extended, gap=None):
    self._extended = extended
    self._store = extended._store
    self._n = extended._num_replicas_in_sync
    self._gap = gap  # why this strategy's steps are never replayed, or None
    self._entries = collections.OrderedDict()
    self._last_key = {}  # id(code) -> (sig, key) of its last step
    self._fresh = {}  # id(code) -> how many steps in a row had a new key
    self._watch_step = None  # the compile watch's step whose signature was used
    self.replays = self.traces = self.captures = 0
    # (entry, weak ref to fn, spec, argument entries) of the step just replayed:
    # weak, so that a replayed step's fn (and the model its closure holds) does
    # not outlive the user's references to it
    self.last_replayed = None
    self._in_group = False  # tracing the steps of a group (`_group_steps`)
    self._group_hypers = []  # the hyper.Swapped of each step of the group traced now
    self.steps = 0
    self.reasons = collections.deque(maxlen=100)

  # -- one step ---------------------------------------------------------------------------------
  def run(self, fn, args, kwargs, watch, options):
    """Replays the step if it can. Returns (result, None) when replayed, else
    (None, attempt): trace the step with `attempt.args` / `attempt.kwargs`, then
    call `attempt.finish(result)` (or `attempt.abandon()` if the trace failed)."""
    self.steps += 1
    self.last_replayed = None
    seed = seeds.STEP_SEEDS.start_step()
    if self._in_group:
      return None, self._plain("one of experimental_run_steps' steps traced as one program", seed)
    if self._gap is not None:
      return None, self._plain(self._gap, seed)
    if options is PLACED:
      return None, self._plain("new variables were placed on the devices", seed)
    if not enabled(options):
      return None, self._plain(
        "replay is off (RunOptions(experimental_replay=False) or XLADIST_REPLAY=0)", seed
      )
    store = self._store
    leaves, spec = flatten((args, kwargs))
    sig = self._signature(fn, args, kwargs, watch)
    key = (
      tuple(sig.items()),
      _fn_refs(fn),
      _arg_refs(leaves),
      _store_refs(store),
      torch.is_grad_enabled(),
      self._extended.experimental_gradient_aggregation,
    )
    code = id(getattr(getattr(fn, "__func__", fn), "__code__", None))
    entry = self._entries.get(key)
    if entry is None:
      why = self._why_new(fn, sig, key)
      entry = self._entries[key] = _Entry()
      if len(self._entries) > _MAX_KEYS:
        self._entries.popitem(last=False)
      fresh = self._fresh[code] = self._fresh.get(code, 0) + 1
    else:
      self._entries.move_to_end(key)
      why = None
      fresh = self._fresh[code] = 0
    self._last_key[code] = (sig, key)
    if fresh > _FRESH_LIMIT:
      # A new key at every step (a learning rate set at each step, a counter):
      # capturing would not pay off; trace as without replay until a key repeats.
      return None, self._plain(
        f"{why}; the key changed at each of the last {fresh} steps of this function "
        "(e.g. a Python number fn reads by name, set at every step): traced without "
        "capture until a step repeats one (pass such values as tensor arguments; an "
        "optimizer's hyperparameters need nothing: they are inputs)",
        seed,
      )
    if entry.refused is not None:
      return None, self._plain(f"not replayable: {entry.refused}", seed)
    if entry.promoted:
      every, strict = verify_every()
      if every and entry.since_verify + 1 >= every:
        entry.since_verify = 0
        return None, self._capture(
          fn, entry, leaves, spec, "verification trace", seed, verify=(strict, every)
        )
      out = self._replay(entry, leaves, seed)
      if not isinstance(out, _Traced):
        entry.since_verify += 1
        self.last_replayed = (entry, _weak(fn), spec, [_arg_entry(x) for x in leaves])
        return out, None
      why = out.why
    elif why is not None:
      pass  # a new key: captured (compiled and run now) at its first trace
    elif entry.program is None:
      why = "capturing the program of a signature seen before"
    else:
      why = "second trace of this signature: captured and compared with the first"
    return None, self._capture(fn, entry, leaves, spec, why, seed)

  def replay_steps(self, fn, args_list):
    """The k steps after a replayed one in `experimental_run_steps`, as ONE
    program, when the step before was replayed for the same `fn` and every
    step's arguments have its arguments' shapes, dtypes and placements (between
    the steps of a group no user code runs but the iterator). On jax: the
    runtime's scan of the step's program. On torch_xla: the k steps traced as
    one graph, captured and replayed like a step of their own (`_group_steps`).
    Returns the steps' results, or None (then they are traced as one program)."""
    last = self.last_replayed
    if last is None or not args_list:
      return None
    entry, last_fn, spec, entries = last
    if fn is not last_fn() or not entry.promoted:
      return None
    leaves_list = []
    for args in args_list:
      leaves, new_spec = flatten((tuple(args), {}))
      if new_spec != spec or [_arg_entry(x) for x in leaves] != entries:
        return None
      leaves_list.append(leaves)
    if _runtime.REPLAY_KIND != "program":
      return self._group_steps(entry, fn, args_list)
    prog = entry.program
    if prog.counters or isinstance(_fresh_scalars(prog), _Traced):
      return None  # (a scan feeds every step the same scalars: not with step counters)
    plan, fixed, carried, stacked = _steps_plan(prog, leaves_list, self._n)
    if plan is None:
      return None
    program, consts = prog.runtime_program
    self.steps += len(args_list)
    seed = seeds.STEP_SEEDS.start_step()
    final, ys = _runtime.run_program_steps(program, consts, plan, fixed, carried, stacked)
    self.replays += len(args_list)
    entry.since_verify += len(args_list)
    seeds.STEP_SEEDS.after_replay(seed, prog.draws)
    return _write_back_steps(prog, plan, final, ys, len(args_list), self._n)

  def _group_steps(self, entry, fn, args_list):
    """torch_xla: the k steps as one program. The group has an entry of its own
    under the step's (the same rules: captured, replayed once two captures
    agree); it is traced as k
    `strategy.run` calls in a row (not captured one by one, their random ops
    one seed chain), and its program's inputs are the slots and the k steps'
    arguments."""
    k = len(args_list)
    group = entry.groups.get(k)
    if group is None:
      group = entry.groups[k] = _Entry()
    if group.refused is not None:
      return None
    args_list = [tuple(args) for args in args_list]
    leaves, spec = flatten((tuple(args_list), {}))
    seed = seeds.STEP_SEEDS.start_step()
    if group.promoted:
      out = self._replay(group, leaves, seed, steps=k)
      if not isinstance(out, _Traced):
        self.steps += k
        entry.since_verify += k
        prog = group.program
        starts = [seeds.run_n(seed, d) for d in prog.starts]
        seeds.STEP_SEEDS.settle_chain(starts, seeds.run_n(seed, prog.draws))
        return out
      why = out.why
    elif group.program is None:
      why = f"first trace of {k} steps as one program"
    else:
      why = f"second trace of {k} steps as one program: captured and compared with the first"
    self._note(why)
    attempt = _Attempt(self, fn, group, leaves, spec, None, seed)
    attempt.group = True
    if attempt.args is not None:
      args_list = attempt.args
    strategy = self._extended._strategy_ref
    self._in_group = True
    self._group_hypers = []
    try:
      with self._extended._one_program(), seeds.STEP_SEEDS.chained() as starts:
        outs = [strategy.run(fn, args=args) for args in args_list]
    except BaseException:
      attempt.abandon()
      raise
    finally:
      self._in_group = False
    program = group.program
    attempt.hypers = hyper.Swapped.merged(self._group_hypers)
    self._group_hypers = []
    outs = attempt.finish(outs)
    if group.program is not program:  # captured now: where its steps' seeds start
      offsets = tuple(seeds.draws_between(seed, s) for s in starts)
      if None in offsets:
        group.program, group.promoted = None, False
        group.refused = "its random-number seeds could not be followed"
      else:
        group.program.starts = offsets
    seeds.STEP_SEEDS.settle_chain(starts, seeds.STEP_SEEDS.left)
    return outs

  def _signature(self, fn, args, kwargs, watch):
    """The step's signature: the one the compile watch took at the start of this
    run (`Strategy.run`), else taken here."""
    last = getattr(watch, "_last", None)
    if last is not None and watch.steps != self._watch_step:
      sig = last[1]
      code = getattr(getattr(fn, "__func__", fn), "__code__", None)
      if sig.get("fn", (None, None, None))[2] == id(code):
        self._watch_step = watch.steps
        return sig
    return signatures.take(fn, args, kwargs, self._store)

  def _why_new(self, fn, sig, key):
    code = id(getattr(getattr(fn, "__func__", fn), "__code__", None))
    last = self._last_key.get(code)
    if last is None:
      return "first trace of this step function"
    old_sig, old_key = last
    what = signatures.differences(old_sig, sig)
    if what:
      return f"new signature: {what}"
    names = (
      None,
      "an object fn reads by name (closure, global, default argument) was replaced",
      "a non-tensor argument is another object",
      "variables or optimizers were replaced (new Parameter objects, optimizer.load_state_dict)",
      "grad mode changed",
      "the strategy's gradient aggregation changed",
    )
    for i in range(1, len(key)):
      if key[i] != old_key[i]:
        return f"new key: {names[i]}"
    return "a step seen before, dropped from the cache"

  def _note(self, why):
    self.traces += 1
    self.reasons.append((self.steps, why))
    if _debug():
      logger.warning("xladist replay: step %d traced: %s", self.steps, why)

  def _plain(self, why, seed):
    self._note(why)
    return _Attempt(self, None, None, None, None, None, seed)

  def _capture(self, fn, entry, leaves, spec, why, seed, verify=None):
    if _runtime.in_traced_step():
      # One of the steps traced as one program (experimental_run_steps on jax):
      # it has no program of its own to capture; a promoted key is replayed
      # into the enclosing program.
      return self._plain(f"{why}; inside steps traced as one program: not captured", seed)
    self._note(why)
    return _Attempt(self, fn, entry, leaves, spec, verify, seed)

  # -- replaying ---------------------------------------------------------------------------------
  def _replay(self, entry, leaves, seed, steps=1):
    prog = entry.program
    if _runtime.REPLAY_KIND == "program":
      return self._replay_program(prog, leaves, seed)
    x = _xla()
    n = self._n
    inputs = _inputs(prog, leaves, n, seed)
    if isinstance(inputs, _Traced):
      return inputs
    # One execution in flight, as torch_xla keeps it for traced programs (each
    # holds the device until it ends). `_run_cached_graph` does not: replays
    # launched back to back queued up, and on XLA:CPU a queue of programs with
    # all-reduces aborted the process ("Expected 4 threads to join the
    # rendezvous, but only 3 of them arrived"). The host work of this step so
    # far overlapped the previous one.
    _runtime.wait()
    try:
      results = x._run_cached_graph(prog.hash, inputs)
    except RuntimeError as e:
      if "pending ir" not in str(e):
        raise
      # An input still has a computation pending: a variable written outside
      # the step (tracing fuses that write into the step's program, so the
      # step is traced), or an argument computed lazily (computed first).
      pending = x._check_tensor_need_materialization(inputs)
      if any(p for p, s in zip(pending, prog.sources) if s[0] != ARG):
        return _Traced(
          "a variable was written outside a step and not synced (the trace fuses the write)"
        )
      _runtime.sync([t for t, p in zip(inputs, pending) if p])
      results = x._run_cached_graph(prog.hash, inputs)
    self.replays += steps
    seeds.STEP_SEEDS.after_replay(seed, prog.draws)
    _advance(prog)
    return _write_back(prog, results, n)

  def _replay_program(self, prog, leaves, seed):
    """`_replay` on a runtime that runs a step's program itself (jax)."""
    n = self._n
    inputs = _inputs(prog, leaves, n, seed)
    if isinstance(inputs, _Traced):
      return inputs
    # the runtime's arrays (a constant is one already)
    inputs = [v._elem if isinstance(v, torch.Tensor) else v for v in inputs]
    fresh = _fresh_scalars(prog)
    if isinstance(fresh, _Traced):
      return fresh
    program, consts = prog.runtime_program
    results = _runtime.run_program(program, consts, inputs)
    self.replays += 1
    seeds.STEP_SEEDS.after_replay(seed, prog.draws)
    _advance(prog)
    return _write_back(prog, results, n)


def _advance(prog):
  """Adds to the host step counters what the replayed step adds (hyper.py)."""
  for state, key, step in prog.counters:
    state[key].add_(step)


def _fresh_scalars(prog):
  """jax: puts the hyperparameters' current values into the program's scalar
  constants (one transfer of one small vector when one changed), or a
  `_Traced` saying why the step is traced instead."""
  if not prog.hypers:
    return None
  vectors = prog.host_vectors
  changed = None
  for h, (v, j) in zip(prog.hypers, prog.scalar_slots):
    if h is None:
      continue
    value = _hyper_value(prog, h)
    if isinstance(value, _Traced):
      return value
    if vectors[v][j] != value:
      if changed is None:
        changed = [np.array(x) for x in vectors]
      changed[v][j] = value
  if changed is not None:
    prog.host_vectors = changed
    program, consts = prog.runtime_program
    prog.runtime_program = (program, _runtime.with_scalars(consts, changed))
  return None


def _steps_plan(prog, leaves_list, n):
  """How a scan of k replays of `prog` gets its inputs (see
  runtime.run_program_steps), or (None, ...) when some input cannot be planned."""
  slots = prog.slots
  carry_slot = {}  # result index -> slot index it writes
  for j, target in enumerate(prog.targets):
    if target[0] == SLOT:
      carry_slot[j] = target[1]
  for target, j in prog.aliases:
    if target[0] == SLOT:
      carry_slot.setdefault(j, target[1])
  written = set(carry_slot.values())
  inputs_plan, fixed, stacked = [], [], []
  for source in prog.sources:
    kind = source[0]
    if kind == SLOT and source[1] in written:
      inputs_plan.append(("carry", source[1]))
    elif kind == SLOT:
      value = slots[source[1]].get()
      if value is None:
        return None, None, None, None
      inputs_plan.append(("fixed", len(fixed)))
      fixed.append(value._elem)
    elif kind == ARG:
      try:
        rows = [_arg_global(leaves[source[1]], n)._elem for leaves in leaves_list]
      except _NotCapturable:
        return None, None, None, None
      inputs_plan.append(("arg", len(stacked)))
      stacked.append(_runtime.stack_steps(rows))
    else:
      inputs_plan.append(("fixed", len(fixed)))
      fixed.append(source[1])
  carried = {}
  for slot in sorted(written):
    value = slots[slot].get(settle=False)
    if value is None:
      return None, None, None, None
    carried[slot] = value._elem
  returned = tuple(j for j, t in enumerate(prog.targets) if t[0] == RET) + tuple(
    j for t, j in prog.aliases if t[0] == RET
  )
  plan = (tuple(inputs_plan), tuple(sorted(carry_slot.items())), tuple(dict.fromkeys(returned)))
  return plan, fixed, [carried[s] for s in sorted(written)], stacked


def _write_back_steps(prog, plan, final, ys, k, n):
  """Puts the k steps' outputs where k replays would have left them."""
  slots = prog.slots
  _, carries, returned = plan
  for slot, value in zip(sorted({c for _, c in carries}), final, strict=True):
    slots[slot].set(value)
  for i in prog.cleared:
    slots[i].tensor.grad = None
  for t in prog.restamp:
    copies_of(t).restamp(t)
  ret_of = {}
  for j, target in enumerate(prog.targets):
    if target[0] == RET:
      ret_of.setdefault(target[1], j)
  for target, j in prog.aliases:
    if target[0] == RET:
      ret_of.setdefault(target[1], j)
  results = []
  for t in range(k):
    leaves = []
    for index, kind in enumerate(prog.ret_leaves):
      if kind in ("stacked", "tensor"):
        value = ys[ret_of[index]][t]  # the runtime cut them per step
        leaves.append(PerReplica._from_stacked(value, n) if kind == "stacked" else value)
      else:
        leaves.append(_python_leaf(prog, kind))
    results.append(unflatten(prog.ret_spec, leaves))
  return results


def _weak(fn):
  """A weak reference to `fn` (a callable that returns it), strong only for a
  callable that takes no weak references (a builtin)."""
  try:
    return weakref.ref(fn)
  except TypeError:
    return lambda: fn


def _arg_entry(leaf):
  """What `replay_steps` compares of an argument: a tensor's (or a
  PerReplica's) shape, dtype and placement, a Python value itself, else the type."""
  if isinstance(leaf, PerReplica) and leaf._stacked is not None:
    leaf = leaf._stacked
  if isinstance(leaf, torch.Tensor):
    return (tuple(leaf.shape), leaf.dtype, _runtime.sharding_spec(leaf))
  if isinstance(leaf, _PLAIN):
    return ("value", leaf)
  return ("object", type(leaf))


def _inputs(prog, leaves, n, seed):
  """A replay's inputs, in the program's order (slots' current values, the
  arguments' global tensors, constants, the seed), or a `_Traced` saying why
  the step must be traced."""
  slots = prog.slots
  inputs = []
  for source in prog.sources:
    kind = source[0]
    if kind == SLOT:
      value = slots[source[1]].get()
      if value is None:
        return _Traced("a state slot has no value, or a tensor fn reads by name was replaced")
    elif kind == ARG:
      try:
        value = _arg_global(leaves[source[1]], n)
      except _NotCapturable as e:
        return _Traced(str(e))
    elif kind == CONST:
      value = source[1]
    elif kind == HYPER:
      h = prog.hypers[source[1]]
      value = _hyper_value(prog, h)
      if isinstance(value, _Traced):
        return value
      if h.placed is None or h.placed[0] != value:
        h.placed = (value, _runtime.place_replicated(torch.tensor(value, dtype=h.dtype)))
      value = h.placed[1]
    else:
      value = _seed_tensor(seed)
    inputs.append(value)
  return inputs


def _hyper_value(prog, h):
  """A hyperparameter input's value now, or a `_Traced` saying why the step is
  traced instead (see hyper.py: a match not yet confirmed by two captures is
  confirmed by a trace when its value first changes)."""
  value = h.current(prog.groups)
  if value is None:
    return _Traced("hyperparameters that were equal when the step was captured differ now")
  if value != h.value and not h.proven:
    return _Traced(
      f"optimizer hyperparameter {h.names()} changed for the first time since the step "
      "was captured (traced once to confirm that it is an input of the program)"
    )
  return value


def _arg_global(leaf, n):
  """The global tensor an argument enters the step from (what a trace reads).

  Raises:
    _NotCapturable: an argument the trace refuses (a PerReplica made inside
      merge_call, or for another replica count): the trace says why.
  """
  if isinstance(leaf, PerReplica):
    if leaf._local is not None or leaf.num_replicas != n:
      raise _NotCapturable("an argument is refused by the trace")
    return leaf._stacked_global(n)
  if isinstance(leaf, Mirrored):
    leaf = leaf.primary
  if not _runtime.is_device_tensor(leaf):
    return _runtime.place_replicated(leaf)
  return _runtime.ensure_sharded(leaf)


def _write_back(prog, results, n):
  """Puts a run's outputs where the traced step would have left them."""
  slots = prog.slots
  rets = [None] * len(prog.ret_leaves)
  for target, value in zip(prog.targets, results):
    if target[0] == SLOT:
      slots[target[1]].set(value)
    elif target[0] == RET:
      rets[target[1]] = value
  for target, j in prog.aliases:
    if target[0] == SLOT:
      slots[target[1]].set(results[j])
    else:
      rets[target[1]] = results[j]
  for i in prog.cleared:
    slots[i].tensor.grad = None
  for t in prog.restamp:
    copies_of(t).restamp(t)
  leaves = []
  for kind, value in zip(prog.ret_leaves, rets):
    if kind == "stacked":
      leaves.append(PerReplica._from_stacked(value, n))
    elif kind == "tensor":
      leaves.append(value)
    else:
      leaves.append(_python_leaf(prog, kind))
  return unflatten(prog.ret_spec, leaves)


def _python_leaf(prog, kind):
  """A Python value fn returned: as traced, or a hyperparameter's value now."""
  if kind[0] == "hyper":
    return hyper.evaluate(kind[1], prog.groups)
  return kind[1]


class _Attempt:
  """A traced step: plain (seed bookkeeping only) or captured (compiled and run
  when `run` returns; left lazy when it cannot be)."""

  def __init__(self, replayer, fn, entry, leaves, spec, verify, seed):
    self._replayer = replayer
    self._entry = entry
    self._verify = verify
    self._seed0 = seed
    self.args = self.kwargs = None
    self.group = False  # the attempt of experimental_run_steps' group, not of a step
    self.hypers = None  # the step's hyper.Swapped (set by the engine after the trace)
    self._ready = False
    if entry is not None:
      self._prepare(fn, leaves, spec)

  def wants_hypers(self):
    """Whether the trace should note the optimizers' hyperparameters (hyper.py):
    when its program may be captured (or it is one of a group's steps)."""
    return self._entry is not None or self._replayer._in_group

  # -- before the trace ---------------------------------------------------------------------
  def _prepare(self, fn, leaves, spec):
    rep = self._replayer
    store = rep._store
    self._step = (fn, spec, leaves)
    slots = _slots(store) + _free_slots(fn)
    values = [s.get() for s in slots]
    globals_ = []
    new_leaves = list(leaves)
    for i, leaf in enumerate(leaves):
      if isinstance(leaf, (PerReplica, Mirrored, torch.Tensor)):
        if isinstance(leaf, PerReplica) and leaf._constant() is not _NOT_CONSTANT:
          globals_.append(None)
          continue
        try:
          g = _arg_global(leaf, rep._n)
        except _NotCapturable as e:
          return self._record(f"not captured: {e}")
        if not isinstance(leaf, PerReplica) and g is not (
          leaf.primary if isinstance(leaf, Mirrored) else leaf
        ):
          new_leaves[i] = g  # a host tensor enters as the tensor placed here: an input
        globals_.append(g)
      else:
        globals_.append(None)
    self.args, self.kwargs = unflatten(spec, new_leaves)
    if any(v is None for v in values):
      return self._record("not captured: a state slot has no value")
    if _runtime.REPLAY_KIND == "program":
      return self._prepare_program(store, slots, values, globals_)
    x = _xla()
    arg_tensors = [g for g in globals_ if g is not None]
    need = x._check_tensor_need_materialization(values + arg_tensors)
    if any(need[: len(values)]):
      return self._record(
        "not captured: a variable or optimizer state has a computation pending (run now)"
      )
    pending_args = [t for t, p in zip(arg_tensors, need[len(values) :]) if p]
    if pending_args:
      _runtime.sync(pending_args)
    # A buffer still being computed has no handle yet (reading one crashes
    # torch_xla 2.9): wait for the executions in flight (captures are rare).
    _runtime.wait()
    handles = x._get_tensors_handle(values + arg_tensors) if values or arg_tensors else []
    by_handle = {}
    ambiguous = set()
    for i, h in enumerate(handles[: len(values)]):
      if h in by_handle and values[by_handle[h][1]] is not values[i]:
        ambiguous.add(h)
      by_handle.setdefault(h, (SLOT, i))
    k = len(values)
    for i, g in enumerate(globals_):
      if g is None:
        continue
      h = handles[k]
      k += 1
      if h in by_handle:
        ambiguous.add(h)
      by_handle.setdefault(h, (ARG, i))
    self._slots = slots
    self._by_handle = by_handle
    self._ambiguous = ambiguous
    self._uids = [_runtime.ir_id(v) for v in values]
    self._host = _host_state(store)
    self._groups = hyper.group_values(list(store.optimizers()))
    self._ready = True

  def _prepare_program(self, store, slots, values, globals_):
    """`_prepare` on a runtime that hands over each step's program and inputs
    (jax): an input is recognised by the identity of its array."""
    by_array, ambiguous = {}, set()
    for i, v in enumerate(values):
      a = id(v._elem)
      if a in by_array and values[by_array[a][1]] is not v:
        ambiguous.add(a)
      by_array.setdefault(a, (SLOT, i))
    for i, g in enumerate(globals_):
      if g is None:
        continue
      a = id(g._elem)
      if a in by_array:
        ambiguous.add(a)
      by_array.setdefault(a, (ARG, i))
    self._slots = slots
    self._by_handle = by_array
    self._ambiguous = ambiguous
    self._held = (values, globals_)  # keeps the arrays (and so their ids) alive
    self._uids = [_runtime.ir_id(v) for v in values]
    self._host = _host_state(store)
    self._groups = hyper.group_values(list(store.optimizers()))
    self._ready = True

  # -- after the trace ------------------------------------------------------------------------
  def abandon(self):
    """The trace failed: keep the seed bookkeeping right."""
    seeds.STEP_SEEDS.after_trace()

  def finish(self, result):
    """Captures the traced step when it can (compiling and running its program
    now), and returns the step's result."""
    seed1 = seeds.STEP_SEEDS.after_trace()
    rep = self._replayer
    if self._entry is None:
      if rep._in_group and self.hypers is not None:
        rep._group_hypers.append(self.hypers)
      return result
    if not self._ready:
      self._cut()
      return result
    rep = self._replayer
    try:
      prog, values = self._analyse(result, seed1)
    except _NotCapturable as e:
      # Left lazy, as without replay: the next `strategy.run` (or a read) runs it.
      self._refused(str(e), e.permanent)
      return result
    if _runtime.REPLAY_KIND != "program":
      # Run the captured step itself: its inputs are the traced graph's device data.
      results = _xla()._run_cached_graph(prog.hash, values)
      result = _write_back(prog, results, rep._n)
    rep.captures += 1
    self._offer(prog)
    if self._entry.promoted and not self.group:
      # Confirmed (a verification trace, a second capture): the steps after it
      # in experimental_run_steps may run as its group, as after a replayed step.
      fn, spec, leaves = self._step
      rep.last_replayed = (self._entry, _weak(fn), spec, [_arg_entry(x) for x in leaves])
    return result

  def _cut(self):
    """Runs a traced step that was not captured now, so that the next step
    starts from computed values and can be captured (a step that is replayed
    needs no sync, so none may come). Every pending tensor is cut with it: a
    sync of some tensors only lets torch_xla give their input buffers to the
    outputs (aliasing) while other pending tensors still read them."""
    _xla()._xla_sync_live_tensors("", [], wait=False)

  def _refused(self, why, permanent):
    entry = self._entry
    entry.failures += 1
    if permanent or entry.failures >= 2:
      entry.refused = why
    self._record(f"not captured: {why}")

  def _record(self, what):
    rep = self._replayer
    rep.reasons.append((rep.steps, what))
    if _debug():
      logger.warning("xladist replay: step %d %s", rep.steps, what)

  def _offer(self, prog):
    entry = self._entry
    old = entry.program
    entry.program = prog
    if old is None:
      entry.promoted = False
      return
    what = _differs(old, prog)
    if what is None:
      hyper.agree(old.hypers, prog.hypers)
      entry.promoted = True
      return
    entry.promoted = False
    entry.groups = {}  # captured from the step's old program
    if self._verify is None:
      self._record(f"captured {what} than the last trace: the next trace confirms it")
    else:
      strict, every = self._verify
      rep = self._replayer
      message = (
        f"xladist: replayed steps were stale: a verification trace at step {rep.steps} "
        f"captured {what} than the program replayed since (up to {every - 1} steps "
        "before this one used the old program). fn depends on something xladist does "
        "not watch; pass it as an argument or read it by name in fn (a closure or "
        "global plain value), or turn replay off for this step "
        "(RunOptions(experimental_replay=False) or XLADIST_REPLAY=0)."
      )
      logger.warning(message)
      if strict:
        raise RuntimeError(message)
      warnings.warn(message, RuntimeWarning, stacklevel=4)

  def _analyse(self, result, seed1):
    """The traced step's program (compiled) and the traced graph's inputs."""
    try:
      return self._program(result, seed1)
    except _NotCapturable:
      raise
    except Exception as e:  # torch_xla refused something: the traced step stands
      raise _NotCapturable(f"capturing failed ({type(e).__name__}: {e})", permanent=True) from e

  def _program(self, result, seed1):
    if _runtime.REPLAY_KIND == "program":
      return _program_of_runtime(self, result)
    x = _xla()
    slots, uids = _new_state_slots(self)
    # Outputs: the returned tensors, then the slots the step wrote.
    ret_spec, returned = _returned(result)
    outs, targets, ret_leaves = [], [], []
    for j, kind, value in returned:
      if kind in ("py", "hyper"):
        ret_leaves.append((kind, value))
      else:
        outs.append(value)
        targets.append((RET, j))
        ret_leaves.append(kind)
    cleared, written = _written_slots(slots, uids)
    for i, value in written:
      outs.append(value)
      targets.append((SLOT, i))
    # Only tensors with a pending computation are program outputs, each once.
    need = x._check_tensor_need_materialization(outs) if outs else []
    kept, kept_targets, aliases, first = [], [], [], {}
    for t, target, pending in zip(outs, targets, need):
      if not pending:
        if target[0] == RET:
          raise _NotCapturable("a returned tensor is not computed by the step")
        continue
      uid = _runtime.ir_id(t)
      if uid in first:
        aliases.append((target, first[uid]))
        continue
      first[uid] = len(kept)
      kept.append(t)
      kept_targets.append(target)
    if not kept:
      raise _NotCapturable("the step computes nothing")
    ids, values = x._get_tensors_xla_device_data_node(kept)
    seed_id = x._get_seed_info_id()
    sources, consts = [], []
    for tid, v in zip(ids, values):
      if tid == seed_id:
        if int(v.cpu()) != _signed(self._seed0):
          raise _NotCapturable("the step's random-number seed is not the one it started from")
        sources.append((SEED,))
        continue
      sources.append(_source(self, x._get_tensors_handle([v])[0], v, consts))
    hypers = _hyper_sources(self, sources, consts)
    draws = 0
    if sum(1 for s in sources if s[0] == SEED) > 1:
      raise _NotCapturable("the program has several random-number seeds")
    if any(s[0] == SEED for s in sources):
      draws = seeds.draws_between(self._seed0, seed1)
      if not draws:
        raise _NotCapturable("the step's random-number seed use could not be followed")
    graph_hash = x._get_graph_hash(kept)
    x._xla_warm_up_cache(kept, [])  # the step's own compilation (none when cached)
    prog = _program_record(
      graph_hash, slots, sources, kept_targets, aliases, cleared, ret_spec, ret_leaves, consts
    )
    prog.draws = draws
    prog.hypers = hypers
    prog.groups = self.hypers.groups if hypers else {}
    prog.counters = tuple(self._counters)
    return prog, values


def _hyper_sources(attempt, sources, consts):
  """torch_xla: turns the CONST sources that are optimizer hyperparameters into
  HYPER sources (hyper.py), dropping them from `consts`; their `hyper.Input`s."""
  made = attempt.hypers.candidates() if attempt.hypers is not None else ()
  scalar = [
    i
    for i, s in enumerate(sources)
    if s[0] == CONST and s[1].dim() == 0 and s[1].dtype.is_floating_point
  ]
  if not made or not scalar:
    return []
  found = hyper.match([(sources[i][1].cpu().item(), sources[i][1].dtype) for i in scalar], made)
  inputs, dropped = [], set()
  for i, h in zip(scalar, found):
    if h is not None:
      dropped.add(id(sources[i][1]))
      sources[i] = (HYPER, len(inputs))
      inputs.append(h)
  consts[:] = [c for c in consts if id(c[1]) not in dropped]
  return inputs


def _new_state_slots(attempt):
  """The attempt's slots, with the gradients the step made; refuses other new
  state, and a step that changed optimizer state outside the device."""
  store = attempt._replayer._store
  known = {s.ident() for s in attempt._slots}
  slots, uids = list(attempt._slots), list(attempt._uids)
  for s in _slots(store):
    if s.ident() not in known:
      if s.kind != GRAD:  # a gradient made by the step is an output like any other
        raise _NotCapturable("the step created state (optimizer state or variables)")
      slots.append(s)
      uids.append(None)
  host, attempt._counters = _host_change(store, attempt._host, _host_state(store))
  if host is None:
    optimizers = list(store.optimizers())
    after = hyper.group_values(optimizers)
    host = hyper.group_change(optimizers, attempt._groups, after)
  if host is not None:
    raise _NotCapturable(host, permanent=True)
  return slots, uids


def _source(attempt, handle, value, consts):
  """Where a program input comes from: a slot or an argument (recognised by its
  device buffer's `handle`), else a constant (recorded in `consts`)."""
  if handle in attempt._ambiguous:
    raise _NotCapturable("an argument shares its device buffer with a variable or another argument")
  source = attempt._by_handle.get(handle)
  if source is not None:
    return source
  consts.append((handle, value))
  return (CONST, value)


def _program_record(key, slots, sources, targets, aliases, cleared, ret_spec, ret_leaves, consts):
  """A `_Program` of a capture (`draws` 0 until the caller counts them)."""
  prog = _Program()
  prog.hash = key
  prog.slots = slots
  prog.sources = sources
  prog.targets = targets
  prog.aliases = aliases
  prog.cleared = cleared
  prog.ret_spec = ret_spec
  prog.ret_leaves = ret_leaves
  prog.draws = 0
  prog.consts = consts
  prog.restamp = [s.tensor for s in slots if s.kind == COPIES]
  prog.n_outputs = len(targets)
  prog.starts = ()  # a group's steps: draws before each step's first seed
  prog.hypers = []  # hyper.Input of each HYPER source (jax: of each scalar slot)
  prog.groups = {}  # id -> the parameter groups the hypers read
  prog.scalar_slots = ()  # jax: (vector index, position) of each scalar constant
  prog.host_vectors = None  # jax: the scalar vectors' values, as last fed
  prog.counters = ()  # the host step counters the step adds to: (state, key, increment)
  return prog


def _returned(result):
  """What fn returned, leaf by leaf: (index, "stacked" | "tensor" | "py", the
  PerReplica's stacked tensor, the tensor or the Python value), with the nest's spec.

  Raises:
    _NotCapturable: a leaf that is neither a device tensor nor a plain value.
  """
  leaves, spec = flatten(result)
  out = []
  for j, leaf in enumerate(leaves):
    if isinstance(leaf, PerReplica) and leaf._stacked is not None:
      out.append((j, "stacked", leaf._stacked))
    elif isinstance(leaf, torch.Tensor) and _runtime.is_device_tensor(leaf):
      out.append((j, "tensor", leaf))
    elif isinstance(leaf, hyper.Hyper):
      out.append((j, "hyper", leaf.expr))
    elif isinstance(leaf, _PLAIN):
      out.append((j, "py", leaf))
    else:
      raise _NotCapturable(
        f"fn returns a {type(leaf).__name__} (a host value or an object made by "
        "the step: only device tensors and plain Python values are replayed)",
        permanent=True,
      )
  return spec, out


def _written_slots(slots, uids):
  """(the gradient slots the step cleared, [(slot index, new value)] of the slots
  it wrote)."""
  cleared, written = [], []
  for i, s in enumerate(slots):
    value = s.get(settle=False)
    if value is None:
      if s.kind == GRAD:
        cleared.append(i)
        continue
      raise _NotCapturable("a state slot lost its value")
    if _runtime.ir_id(value) != uids[i]:
      written.append((i, value))
  return cleared, written


def _program_of_runtime(attempt, result):
  """The jax runtime's capture: the step's program as the runtime ran it, its
  inputs mapped to slots and arguments by array identity, its results to the
  slots the step wrote and to what fn returned."""
  slots, uids = _new_state_slots(attempt)
  program, consts, inputs, results = _runtime.last_program()
  index = {id(r): j for j, r in enumerate(results)}
  targets = [(DROP,)] * len(results)
  aliases = []

  def target_of(tensor, target):
    j = index.get(id(tensor._elem))
    if j is None:
      return False
    if targets[j][0] == DROP:
      targets[j] = target
    else:
      aliases.append((target, j))
    return True

  ret_spec, returned = _returned(result)
  ret_leaves = []
  for j, kind, value in returned:
    if kind not in ("py", "hyper") and not target_of(value, (RET, j)):
      raise _NotCapturable("a returned tensor is not computed by the step")
    ret_leaves.append((kind, value) if kind in ("py", "hyper") else kind)
  cleared, written = _written_slots(slots, uids)
  for i, value in written:
    if not target_of(value, (SLOT, i)):
      raise _NotCapturable("a state slot was given a value the step did not compute")
  consts_seen = [(id(c), c) for part in consts for c in part]
  sources = [_source(attempt, id(array), array, consts_seen) for array in inputs]
  prog = _program_record(
    program.text_key, slots, sources, targets, aliases, cleared, ret_spec, ret_leaves, []
  )
  host = [np.array(v) for v in consts[1]]
  order = sorted({d for kind, d, _ in program.layout if kind == "scalar"})
  prog.scalar_slots = tuple(
    (order.index(d), j) for kind, d, j in program.layout if kind == "scalar"
  )
  made = attempt.hypers.candidates() if attempt.hypers is not None else ()
  if made and prog.scalar_slots:
    scalars = [(host[v][j].item(), _torch_dtype(host[v].dtype)) for v, j in prog.scalar_slots]
    prog.hypers = hyper.match(scalars, made)
    prog.groups = attempt.hypers.groups
  masked = [np.array(v) for v in host]
  for h, (v, j) in zip(prog.hypers, prog.scalar_slots):
    if h is not None:
      masked[v][j] = 0
  prog.host_vectors = host
  prog.counters = tuple(attempt._counters)
  prog.consts = [(id(a), _ConstView(a)) for a in consts[0]] + [
    (("scalars", i), _ConstView(m)) for i, m in enumerate(masked)
  ]
  prog.n_outputs = len(results)
  prog.runtime_program = (program, consts)
  return prog, None


def _torch_dtype(np_dtype):
  return getattr(torch, np.dtype(np_dtype).name, None)


class _ConstView:
  """A constant array seen as `_same_constants` compares them (shape, dtype,
  size and host values)."""

  def __init__(self, array):
    self.array = array
    self.shape = tuple(array.shape)
    self.dtype = array.dtype

  def numel(self):
    return int(np.prod(self.shape))

  def cpu(self):
    value = np.array(self.array)
    if value.dtype.name == "bfloat16":  # ml_dtypes' bfloat16, which torch cannot take
      return torch.from_numpy(value.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(value)


class _Traced:
  """`Replayer._replay`: the step could not be replayed and is traced, because..."""

  __slots__ = ("why",)

  def __init__(self, why):
    self.why = why


class _NotCapturable(Exception):
  def __init__(self, why, permanent=False):
    super().__init__(why)
    self.permanent = permanent
