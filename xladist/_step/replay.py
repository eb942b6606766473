"""Replay: `strategy.run` runs a step's compiled program without tracing `fn` again.

On by default; `XLADIST_REPLAY=0` turns it off, `RunOptions(experimental_replay=
False)` for one run (True turns it on for one run whatever the variable says).

Tracing a step (running `fn`'s Python on lazy tensors, entering and leaving the
manual region, hashing the graph) costs the host far more than launching the
compiled program (docs/architecture.md, "Replay"). So once a step's program is
known, `strategy.run` *replays* it: the program is run again by the runtime
(the contract's `ProgramReplay`: `runtime.run_program`), on the current
values of the step's inputs, and the outputs are written back where the traced
step would have left them.

This module is the replayer (keys, promotion, verification, the steps of
`experimental_run_steps`); replay_slots.py lists where a step's state lives,
replay_capture.py captures a traced step, replay_program.py holds a captured
program and feeds it, hyper.py makes the optimizers' hyperparameters inputs and
the trace's host decisions on them guards. How a step is captured, its key,
promotion, random numbers and what is never replayed: docs/architecture.md,
"How a step is captured, and when it replays".

The contract: a replayed step computes what running `fn` would. What `fn`'s
Python read while it was traced is guarded (python_effects.py: globals, closure
cells, attribute paths and dict items, in `fn` and every function it calls; the
values are the last part of the key), and a step whose Python writes state
outside its program (a counter, a helper's attribute, a list, the host random
generators, printing, logging) is not captured: it is traced at every call.
What the recorder cannot follow (a read by C code, a list item at a computed
index) is left to the verification trace: every `XLADIST_REPLAY_VERIFY` steps
(default 100; 1: every step; 0: never) a
step of a replayed key is traced instead and its program compared with the
capture; a difference means the replayed steps since the last check were
stale: it is warned about once (raised as a RuntimeError when
`XLADIST_REPLAY_VERIFY` is set) and the key is traced at every step from then on.
"""

import collections
import typing

from xladist import _settings
from xladist import runtime as _runtime
from xladist._nest import flatten
from xladist._step import hyper, python_effects, read_guards, seeds
from xladist._step import signature as signatures
from xladist._step.replay_capture import (
  Attempt,
)
from xladist._step.replay_program import (
  ARG,
  KeyEntry,
  Traced,
  advance_host_scalars,
  arg_entry,
  debug,
  logger,
  program_inputs,
  weak,
  write_back,
)
from xladist._step.replay_slots import (
  arg_refs,
  fn_refs,
  store_refs,
)


class ReplayKey(typing.NamedTuple):
  """What a replayed step must share with the traced one whose program it runs."""

  signature: tuple  # the step's signature (signature.py): shapes, dtypes, placements
  fn: tuple  # the objects fn reads by name (replay_slots.fn_refs)
  args: tuple  # the non-tensor arguments' identities (replay_slots.arg_refs)
  store: tuple  # the variables and optimizers (replay_slots.store_refs)
  torch_modes: tuple  # grad mode, autocast, default dtype, ... (read_guards.torch_modes)
  aggregation: object  # the strategy's gradient aggregation
  reads: tuple  # what the traces read, guarded (read_guards.Watched.key)


DEFAULT_VERIFY_EVERY = 100
_MAX_KEYS = 16  # keys (programs) kept per strategy, least recently used dropped
_FRESH_LIMIT = 3  # steps in a row with a new key after which they are not captured
_GUARD_LIMIT = 4  # replays in a row refused by a guard after which a key is traced


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
  return _settings.switch("XLADIST_REPLAY", True)


def verify_every():
  """(K, strict): every K-th step of a replayed key is traced and compared (0:
  never); strict when XLADIST_REPLAY_VERIFY is set (a stale replay raises)."""
  k, given = _settings.whole_number(
    "XLADIST_REPLAY_VERIFY",
    DEFAULT_VERIFY_EVERY,
    "verify every that many steps; 1: every step, 0: never",
  )
  return max(0, k), given


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
    self._group_effects = []  # the python_effects.Recorder of each step of the group
    self._reads = {}  # id(code) -> read_guards.Watched: what its traces read
    self.writes = 0  # traced steps whose Python wrote state outside the program
    self.unfollowed = 0  # traced steps whose Python the recorder could not classify
    self._warned = set()  # id(code) of the step functions said to write (warn_once)
    self.steps = 0
    self.reasons = collections.deque(maxlen=100)

  # -- one step ---------------------------------------------------------------------------------
  def run(self, fn, args, kwargs, watch, options):
    """Replays the step if it can. Returns (result, None) when replayed, else
    (None, attempt): trace the step with `attempt.args` / `attempt.kwargs`, then
    call `attempt.finish(result, hypers, effects)` (or `attempt.abandon()` if the trace
    failed)."""
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
    code = _code_id(fn)
    reads = self._reads.get(code)
    key = ReplayKey(
      signatures.replay_entries(sig),
      fn_refs(fn),
      arg_refs(leaves),
      store_refs(store),
      read_guards.torch_modes(),
      self._extended.experimental_gradient_aggregation,
      reads.key() if reads is not None else (),
    )
    entry = self._entries.get(key)
    if entry is None:
      entry = self._made_with_fewer_reads(key)
      if entry is not None:
        self._entries[key] = entry  # found again under the key with every location
    if entry is None:
      why = self._why_new(fn, sig, key)
      entry = self._entries[key] = KeyEntry()
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
      self.count_refusal(entry.refused)
      return None, self._plain(f"not replayable: {entry.refused}", seed)
    if entry.promoted:
      every, strict = verify_every()
      if every and entry.since_verify + 1 >= every:
        entry.since_verify = 0
        return None, self._capture(
          fn, entry, leaves, spec, "verification trace", seed, verify=(strict, every)
        )
      out = self._replay(entry, leaves, seed)
      if not isinstance(out, Traced):
        entry.since_verify += 1
        entry.guard_failures = 0
        self.last_replayed = (entry, weak(fn), spec, [arg_entry(x) for x in leaves])
        return out, None
      why = out.why
      if out.guard:
        entry.guard_failures += 1
        if entry.guard_failures >= _GUARD_LIMIT:
          entry.refused = (
            f"its host decisions changed at {_GUARD_LIMIT} replays in a row (last: {why})"
          )
          logger.warning(
            "xladist replay: %s is traced at every step from now on: %s",
            getattr(fn, "__qualname__", fn),
            entry.refused,
          )
    elif why is not None:
      pass  # a new key: captured (compiled and run now) at its first trace
    elif entry.program is None:
      why = "capturing the program of a signature seen before"
    else:
      why = "second trace of this signature: captured and compared with the first"
    return None, self._capture(fn, entry, leaves, spec, why, seed)

  def _made_with_fewer_reads(self, key):
    """The entry of a key made before this function's traces found more locations
    (a branch taken later read more), equal to `key` on the locations it has: its
    program did not read the others. Or None."""
    for old, entry in self._entries.items():
      n = len(old.reads)
      if n < len(key.reads) and old[:-1] == key[:-1] and old.reads == key.reads[:n]:
        return entry
    return None

  def replay_steps(self, fn, args_list):
    """The k steps after a replayed one in `experimental_run_steps`, as ONE
    program, when the step before was replayed for the same `fn` and every
    step's arguments have its arguments' shapes, dtypes and placements (between
    the steps of a group no user code runs but the iterator): the k steps
    traced as one program, captured and replayed like a step of their own
    (`_group_steps`). Returns the steps' results, or None (then they are traced
    as one program)."""
    last = self.last_replayed
    if last is None or not args_list:
      return None
    entry, last_fn, spec, entries = last
    if fn is not last_fn() or not entry.promoted:
      return None
    for args in args_list:
      leaves, new_spec = flatten((tuple(args), {}))
      if new_spec != spec or [arg_entry(x) for x in leaves] != entries:
        return None
    return self._group_steps(entry, fn, args_list)

  def _group_steps(self, entry, fn, args_list):
    """The k steps as one program. The group has an entry of its own
    under the step's (the same rules: captured, replayed once two captures
    agree); it is traced as k
    `strategy.run` calls in a row (not captured one by one, their random ops
    one seed chain on torch_xla), and its program's inputs are the slots and the
    k steps' arguments. Host step counters chain through the steps (`carried`)."""
    k = len(args_list)
    group = entry.step_groups.get(k)
    if group is None:
      group = entry.step_groups[k] = KeyEntry()
    if group.refused is not None:
      return None
    args_list = [tuple(args) for args in args_list]
    leaves, spec = flatten((tuple(args_list), {}))
    seed = seeds.STEP_SEEDS.start_step()
    if group.promoted:
      out = self._replay(group, leaves, seed, steps=k)
      if not isinstance(out, Traced):
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
    attempt = Attempt(self, fn, group, leaves, spec, None, seed)
    attempt.group = True
    if attempt.args is not None:
      args_list = attempt.args
    strategy = self._extended._strategy_ref
    self._in_group = True
    self._group_hypers, self._group_effects = [], []

    def steps():
      with self._extended._one_program():
        return [strategy.run(fn, args=args) for args in args_list]

    try:
      with seeds.STEP_SEEDS.chained() as starts:
        outs = _runtime.traced_step(steps)  # one program (jax: one trace; torch_xla: lazily)
    except BaseException:
      attempt.abandon()
      raise
    finally:
      self._in_group = False
    program = group.program
    hypers = hyper.Swapped.merged(self._group_hypers)
    effects = python_effects.merged(self._group_effects)
    self._group_hypers, self._group_effects = [], []
    outs = attempt.finish(outs, hypers, effects)
    if group.program is not program:  # captured now: where its steps' seeds start
      offsets = tuple(seeds.draws_between(seed, s) for s in starts)
      if None in offsets:
        group.program, group.promoted = None, False
        group.refused = "its random-number seeds could not be followed"
      else:
        group.program.starts = offsets
    seeds.STEP_SEEDS.settle_chain(starts, seeds.STEP_SEEDS.left)
    return outs

  def carried(self):
    """Inside experimental_run_steps' steps traced as one program: the expressions
    of the host scalars the steps before this one left (hyper.Swapped), else None."""
    if not self._in_group:
      return None
    out = {}
    for part in self._group_hypers:
      out.update((place, scalar.expr) for place, scalar in part.scalars.items())
    return out

  def _signature(self, fn, args, kwargs, watch):
    """The step's signature: the one the compile watch took at the start of this
    run (`Strategy.run`), else taken here."""
    sig = watch.signature_of(watch.steps) if watch is not None else None
    if sig is not None and watch.steps != self._watch_step:
      code = getattr(getattr(fn, "__func__", fn), "__code__", None)
      if sig.get("fn", (None, None, None))[2] == id(code):
        self._watch_step = watch.steps
        return sig
    return signatures.take(fn, args, kwargs, self._store)

  def count_refusal(self, why):
    """Counts a traced step of a key refused for its Python (experimental_replay_counts)."""
    kind = getattr(why, "kind", None)  # python_effects.Refusal
    if kind is python_effects.Reason.WROTE:
      self.writes += 1
    elif kind is python_effects.Reason.UNFOLLOWED:
      self.unfollowed += 1

  def warn_once(self, fn, why):
    """Says once per step function, on the "xladist" logger, that its steps are
    traced at every call and why (a write of its Python: python_effects.py)."""
    code = _code_id(fn)
    if code in self._warned:
      return
    self._warned.add(code)
    advice = (
      "Move the write out of the step function (after strategy.run) to let it replay."
      if getattr(why, "kind", None) is python_effects.Reason.WROTE
      else "Pass such values as arguments of the step, or read them by name, attribute or "
      "constant key, to let it replay."
    )
    logger.warning(
      "xladist replay: %s is traced at every call, not replayed: %s. %s",
      getattr(fn, "__qualname__", fn),
      why,
      advice,
    )

  def read_locations(self, fn):
    """The locations the traces of `fn` read (read_guards.Watched), in order."""
    reads = self._reads.get(_code_id(fn))
    return list(reads.locations.values()) if reads is not None else []

  def varying(self, fn):
    """[(dict, key)] of the floats fn's traces read that changed between steps:
    swapped for Hypers while a step is traced (program inputs)."""
    reads = self._reads.get(_code_id(fn))
    return reads.namespaces() if reads is not None else []

  def note_effects(self, fn, effects, entry):
    """Adds what a traced step of `fn` read to the locations its key watches.
    The key of `entry` (the step's) gets the values the trace read at the new
    ones, so that the next step with the same values finds it."""
    code = _code_id(fn)
    reads = self._reads.get(code)
    if reads is None:
      reads = self._reads[code] = read_guards.Watched()
    before = len(reads.locations)
    reads.add(effects)
    if len(reads.locations) == before:
      return
    extra = tuple(effects.key_at_read(i) for i in list(reads.locations)[before:])
    for key, e in list(self._entries.items()):
      if e is entry:
        new = key._replace(reads=key.reads + extra)
        del self._entries[key]
        self._entries[new] = e
        last = self._last_key.get(code)
        if last is not None and last[1] == key:
          self._last_key[code] = (last[0], new)
        break

  def _rekey(self, code, reads):
    """Floats fn reads became program inputs (`read_guards.Watched.varying`):
    the keys of its entries that pinned them at 0 or 1 are rewritten as the
    key is made now, so that a value going back to one of them finds its
    program (a loop switching `Dropout.p` between 0 and 0.5)."""
    for key in list(self._entries):
      fn_entry = dict(key[0]).get("fn")
      if fn_entry is None or fn_entry[2] != code:
        continue
      values = reads.as_varying(key.reads)
      if values is not None and values != key.reads:
        new = key._replace(reads=values)
        if new not in self._entries:
          self._entries[new] = self._entries.pop(key)

  def _why_new(self, fn, sig, key):
    code = _code_id(fn)
    last = self._last_key.get(code)
    if last is None:
      return "first trace of this step function"
    old_sig, old_key = last
    what = signatures.differences(old_sig, sig)
    if what:
      return f"new signature: {what}"
    if len(key.reads) == len(old_key.reads) and key.reads != old_key.reads:
      reads = self._reads[code]
      varying = len(reads.varying)
      changed = reads.changed(old_key.reads, key.reads)
      if len(reads.varying) > varying:
        self._rekey(code, reads)
      if changed:
        return "a value the step reads changed: " + "; ".join(changed[:3])
    names = {
      "fn": "an object fn reads by name (closure, global, default argument) was replaced",
      "args": "a non-tensor argument is another object",
      "store": "variables or optimizers were replaced (new Parameter objects, "
      "optimizer.load_state_dict)",
      "torch_modes": "torch's global modes changed (grad mode, autocast, default dtype, "
      "deterministic algorithms, global module hooks)",
      "aggregation": "the strategy's gradient aggregation changed",
      "reads": "the step's last trace read values no trace before it had read",
    }
    for field, words in names.items():
      if getattr(key, field) != getattr(old_key, field):
        return f"new key: {words}"
    return "a step seen before, dropped from the cache"

  def _note(self, why):
    self.traces += 1
    self.reasons.append((self.steps, why))
    if debug():
      logger.warning("xladist replay: step %d traced: %s", self.steps, why)

  def _plain(self, why, seed):
    self._note(why)
    return Attempt(self, None, None, None, None, None, seed)

  def _capture(self, fn, entry, leaves, spec, why, seed, verify=None):
    if _runtime.in_traced_step():
      # One of the steps traced as one program (experimental_run_steps on jax):
      # it has no program of its own to capture; a promoted key is replayed
      # into the enclosing program.
      return self._plain(f"{why}; inside steps traced as one program: not captured", seed)
    self._note(why)
    return Attempt(self, fn, entry, leaves, spec, verify, seed)

  # -- replaying ---------------------------------------------------------------------------------
  def _replay(self, entry, leaves, seed, steps=1):
    """Runs the entry's program on the current inputs (one step, or a group's
    `steps`) and writes its results back; a `Traced` when it may not."""
    prog = entry.program
    n = self._n
    inputs = program_inputs(prog, leaves, n, seed)
    if isinstance(inputs, Traced):
      return inputs
    program, consts = prog.runtime_program
    try:
      results = _runtime.run_program(program, consts, inputs, donate=prog.donate)
    except _runtime.PendingInput:
      # An input still has a computation pending (torch_xla): a variable written
      # outside the step (tracing fuses that write into the step's program, so the
      # step is traced), or an argument computed lazily (computed first).
      pending = [b is None for b in _runtime.buffer_ids(inputs)]
      if any(p for p, s in zip(pending, prog.sources) if s[0] != ARG):
        return Traced(
          "a variable was written outside a step and not synced (the trace fuses the write)"
        )
      _runtime.sync([t for t, p in zip(inputs, pending) if p])
      results = _runtime.run_program(program, consts, inputs, donate=prog.donate)
    self.replays += steps
    seeds.STEP_SEEDS.after_replay(seed, prog.draws)
    advance_host_scalars(prog)
    return write_back(prog, results, n)


def _code_id(fn):
  """The identity of the code `fn` runs (a function, bound method, partial or
  callable object): what a step's keys and watched reads are kept under."""
  _, func = signatures._unwrap(fn)
  return id(getattr(func, "__code__", None) or fn)
