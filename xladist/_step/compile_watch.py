"""Counts the XLA compilations of a strategy's steps and says why a step compiled again.

torch_xla compiles when the graph is cut (the user's `torch_xla.sync()`, a host
read, `experimental_run_steps`), after `strategy.run` has returned, so the
compilations of step k are attributed when step k + 1 starts or the counts are
read: if torch_xla's compilation count grew since step k started, step k
compiled. A step closure (`xm.add_step_closure`) notes the count at the first
`torch_xla.sync()` after a step began: what compiled up to it is the step's
program (with whatever else was pending at that sync, or cut out of it by a host
read before it); what compiled later came from code run between steps. After
its first step, a step of the same `fn` compiles again only if something it
depends on changed; the watch compares the two steps' signatures
(`signature.py`) and names what changed, in one line, on the "xladist"
logger:

* always when more than `XLADIST_RECOMPILE_WARN_AFTER` (default 3) steps in a
  row compiled (a training loop that never settles);
* for every recompilation with `XLADIST_EXPLAIN_COMPILES=1`.
"""

import logging
import weakref

from xladist import _settings
from xladist import runtime as _runtime
from xladist._step import signature as signatures

logger = logging.getLogger("xladist")

_NOTHING_SEEN = (
  "no change xladist can see since step {previous} (the previous step of {name}) in "
  "its arguments, variables, modules' train/eval modes, optimizer settings{pending}, "
  "or the Python values fn reads by name, yet the program was "
  "new: it was compiled {when}, so it holds the step together with other work not "
  "executed yet, traced outside fn (e.g. a running total `total += "
  "strategy.reduce(...)` that starts as a Python number is another graph on its "
  "first step than on later ones), or fn branches on a value it reaches through "
  "another object or function."
)
_FIRST = (
  "no change xladist can see since step {previous} (the previous step of {name}), "
  "but no earlier step of {name} compiled (their results were not used, or their "
  "programs were in torch_xla's cache): this is its first program here."
)
_AT_SYNC = "by the first torch_xla.sync() after the step began (or a host read before it)"
_NO_SYNC = (
  "before any torch_xla.sync() after the step began (by a host read or a sync of some tensors)"
)
_BETWEEN = (
  "by code run between steps (evaluation outside strategy.run, a host read, a "
  "reduction of a new shape)"
)


def _explain_always():
  return _settings.switch("XLADIST_EXPLAIN_COMPILES", False)


def _warn_after():
  k, _ = _settings.whole_number("XLADIST_RECOMPILE_WARN_AFTER", 3, "steps in a row")
  return max(0, k)


class CompileWatch:
  """One per strategy: attributes compilations to its steps.

  Attributes:
    compilations: compilations seen between this strategy's steps (from its
      first step on; the last step's are added when read).
    explanations: the lines logged so far, oldest first (at most 100 kept).
  """

  def __init__(self):
    self.compilations = 0
    self.steps = 0
    self.in_row = 0
    self.explanations = []
    self._seen = None  # torch_xla's compilation count when the last step started
    # the count at the first torch_xla.sync() since the last step started
    self._synced = None
    self._queued = False  # a step closure waits for the next sync
    # (step number, signature, (number, signature and state) of its fn's previous
    # step, compiled yet, state); replay.py reads the signature
    self._last = None
    self._by_fn = {}
    self._state_of = None  # what `take_state` needs, while a step's state is not taken

  def count(self):
    """Compilations so far, including those since the last step started."""
    self._settle()
    return self.compilations

  def _settle(self):
    """Attributes the compilations since the last look to the last step."""
    if self._last is None:
      return
    total = _runtime.compile_count()
    new = total - self._seen
    if not new:
      return
    seen, self._seen = self._seen, total
    self.compilations += new
    number, sig, before, compiled, state = self._last
    self._last = (number, sig, before, True, state)
    synced = self._synced
    at_sync = new if synced is None else max(0, min(synced, total) - seen)
    if at_sync:
      self._by_fn[sig["fn"]][2] = True  # a step of this fn compiled
    if before is not None and not compiled:
      self.in_row += 1
      if _explain_always() or self.in_row > _warn_after():
        now = {**sig, **state}
        self._explain(number, now, before, at_sync, new - at_sync, synced is not None)

  def count_unexplained(self, n):
    """Counts `n` compilations that are not the step's own recompilation
    (replay compiling, for itself, the program a step's trace ran) in
    `compilations`, without explaining them."""
    if n and self._last is not None:
      self._seen += n
      self.compilations += n

  def _mark_next_sync(self):
    """Queues a step closure that notes the compilation count at the next
    torch_xla.sync() (one at a time: steps without a sync between share it)."""
    if self._queued:
      return
    ref = weakref.ref(self)

    def at_sync():
      watch = ref()
      if watch is not None:
        watch._queued = False
        if watch._synced is None:
          watch._synced = _runtime.compile_count()

    _runtime.on_boundary(at_sync)
    self._queued = True

  def before_step(self, fn, args, kwargs, store, lazy_state=False):
    """Called at the start of `strategy.run`. `lazy_state`: the step may be
    replayed (it runs on the step engine); what its tensors hold as it begins
    is then looked at only if it is traced (`take_state`, called by the engine
    before the trace); a replayed step keeps its fn's last state (a replayed
    program runs on computed values only)."""
    if self._last is not None:
      self._settle()
      _, _, before, compiled, _ = self._last
      if before is not None and not compiled:
        self.in_row = 0
    self._seen = _runtime.compile_count()
    self._synced = None
    unsynced = self._queued  # no torch_xla.sync() since the last step began
    self._mark_next_sync()
    self.steps += 1
    if lazy_state:
      sig, state = signatures.take(fn, args, kwargs, store), {}
      self._state_of = (fn, args, kwargs, store, not unsynced)
    else:
      sig, state = signatures.take_with_state(fn, args, kwargs, store, synced=not unsynced)
      self._state_of = None
    key = sig["fn"]
    before = self._by_fn.get(key)
    if lazy_state and before is not None:
      state.update((k, v) for k, v in before[1].items() if k not in sig)
    self._last = (self.steps, sig, before, False, state)
    # [step number, signature and state, whether a step of this fn compiled]
    merged = {**sig, **state} if state else sig  # (a replayed step's signature: shared, read only)
    self._by_fn[key] = [self.steps, merged, before is not None and before[2]]

  def signature_of(self, step):
    """The signature `before_step` took for this watch's step number `step`, or
    None (another step began since, or none did)."""
    last = self._last
    return last[1] if last is not None and last[0] == step else None

  def take_state(self, traced=True):
    """The state of a step whose signature was taken lazily (`before_step`),
    read when the step is traced after all; `traced=False` (it was replayed)
    only lets go of what reading it needed (fn, its arguments)."""
    args = self._state_of
    self._state_of = None
    if args is None or not traced:
      return
    fn, fn_args, kwargs, store, synced = args
    _, state = signatures.take_with_state(fn, fn_args, kwargs, store, synced=synced)
    number, sig, before, compiled, old = self._last
    old.clear()
    old.update(state)
    self._by_fn[sig["fn"]][1] = {**sig, **state}

  def _explain(self, number, sig, before, at_sync, after, synced):
    name = sig["fn"][1].rsplit(".", 1)[-1]
    previous, old, compiled_before = before
    row = f", {self.in_row} steps in a row" if self.in_row > 1 else ""
    if at_sync:
      nothing = _NOTHING_SEEN if compiled_before else _FIRST
      checked = signatures.UNSYNCED not in sig.values()  # pending work was looked at
      what = signatures.explain(old, sig) or nothing.format(
        previous=previous,
        name=name,
        when=_AT_SYNC if synced else _NO_SYNC,
        pending=", work pending in its tensors" if checked else "",
      )
      # A fn whose earlier steps compiled nothing (their results unused, cached
      # programs of another strategy) compiles here for the first time.
      did = "compiled again" if compiled_before else "compiled (its earlier steps did not)"
      line = f"xladist: step {number} ({name}) {did} ({_count(at_sync)}{row}): {what}"
      if after:
        line += f" Then {_count(after)} after the torch_xla.sync() that ran it, {_BETWEEN}."
    else:
      row = f" ({self.in_row} steps in a row with compilations)" if self.in_row > 1 else ""
      line = (
        f"xladist: step {number} ({name}) did not compile{row}: the "
        f"torch_xla.sync() that ran it compiled nothing; {_count(after)} came after "
        f"it, {_BETWEEN}."
      )
    self.explanations.append(line)
    del self.explanations[:-100]
    logger.warning(line)


def _count(n):
  return f"{n} XLA compilation{'s' if n > 1 else ''}"
