"""Capturing a traced step (replay.py): `Attempt` lists the step's slots and
arguments with their buffer ids before the trace, and after it finds the
step's program (`runtime.last_program`), maps each input to a slot, an
argument, the seed, a hyperparameter or a constant and each result to a
returned leaf or a written slot (one way on every runtime), runs the captured
program where the runtime recorded the step lazily (torch_xla: the "graph"
form) and offers it to its key's entry (promoted when two captures agree).
"""

import warnings

import torch

from xladist import runtime as _runtime
from xladist._nest import flatten, unflatten
from xladist._step import hyper, hyper_inputs, python_effects, seeds
from xladist._step.replay_program import (
  ARG,
  CONST,
  DONATED_KINDS,
  DROP,
  HYPER,
  PLAIN,
  RET,
  SEED,
  SLOT,
  CapturedProgram,
  NotCapturable,
  arg_entry,
  arg_global,
  debug,
  differs,
  donate_min_bytes,
  donated,
  logger,
  nbytes,
  settle_coincidences,
  signed,
  weak,
  write_back,
)
from xladist._step.replay_slots import (
  GRAD,
  free_slots,
  host_change,
  host_state,
  read_slots,
  state_slots,
)
from xladist.values import _NOT_CONSTANT, Mirrored, PerReplica


class Attempt:
  """A traced step: plain (seed bookkeeping only) or captured (compiled and run
  when `run` returns; left lazy when it cannot be)."""

  def __init__(self, replayer, fn, entry, leaves, spec, verify, seed):
    self._replayer = replayer
    self._entry = entry
    self._verify = verify
    self._seed0 = seed
    self.args = self.kwargs = None
    self.group = False  # the attempt of experimental_run_steps' group, not of a step
    self.hypers = None  # the step's hyper.Swapped (given to `finish`)
    self.effects = None  # the step's python_effects.Recorder (given to `finish`)
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
    slots = state_slots(store) + free_slots(fn)
    known = {slot.ident() for slot in slots}
    slots += [s for s in read_slots(rep.read_locations(fn)) if s.ident() not in known]
    values = [s.get() for s in slots]
    globals_ = []
    new_leaves = list(leaves)
    for i, leaf in enumerate(leaves):
      if isinstance(leaf, (PerReplica, Mirrored, torch.Tensor)):
        if isinstance(leaf, PerReplica) and leaf._constant() is not _NOT_CONSTANT:
          globals_.append(None)
          continue
        try:
          g = arg_global(leaf, rep._n)
        except NotCapturable as e:
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
    # An input is recognised by the identity of its device buffer.
    named = [((SLOT, i), v) for i, v in enumerate(values)]
    named += [((ARG, i), g) for i, g in enumerate(globals_) if g is not None]
    handles = _runtime.buffer_ids([v for _, v in named])
    if any(h is None for h in handles[: len(values)]):
      return self._record(
        "not captured: a variable or optimizer state has a computation pending (run now)"
      )
    if any(h is None for h in handles):  # an argument computed lazily: computed first
      _runtime.sync([v for (_, v), h in zip(named, handles) if h is None])
      handles = _runtime.buffer_ids([v for _, v in named])
    by_handle, first, ambiguous = {}, {}, set()
    for (source, v), h in zip(named, handles):
      # one buffer for two slots holding the same tensor is one input; any other
      # sharing (an argument that is a variable, two slots' distinct views) is refused
      if h in by_handle and (source[0] == ARG or first[h] is not v):
        ambiguous.add(h)
      by_handle.setdefault(h, source)
      first.setdefault(h, v)
    self._donate_floor = donate_min_bytes()  # read here: a bad setting is the user's error
    self._shared = _shared_slots(slots, values, self._donate_floor)
    self._slots = slots
    self._by_handle = by_handle
    self._ambiguous = ambiguous
    self._held = (values, globals_)  # keeps the buffers (and so their ids) alive
    self._uids = [_runtime.value_id(v) for v in values]
    self._host = host_state(store)
    self._groups = hyper_inputs.group_values(list(store.optimizers()))
    self._ready = True

  # -- after the trace ------------------------------------------------------------------------
  def abandon(self):
    """The trace failed: keep the seed bookkeeping right."""
    seeds.STEP_SEEDS.after_trace()

  def finish(self, result, hypers=None, effects=None):
    """Captures the traced step when it can (compiling and running its program
    now), and returns the step's result. `hypers`: the trace's hyper.Swapped;
    `effects`: its python_effects.Recorder (what its Python read and wrote)."""
    self.hypers, self.effects = hypers, effects
    seed1 = seeds.STEP_SEEDS.after_trace()
    rep = self._replayer
    if self._entry is None:
      if rep._in_group and self.hypers is not None:
        rep._group_hypers.append(self.hypers)
        rep._group_effects.append(self.effects)
      return result
    if self.effects is not None:
      fn = getattr(self, "_step", (None,))[0]
      if fn is not None:
        rep.note_effects(fn, self.effects, self._entry)
    if not self._ready:
      self._cut()
      return result
    try:
      prog, values = self._program(result, seed1)
    except NotCapturable as e:
      # Left lazy, as without replay: the next `strategy.run` (or a read) runs it.
      self._refused(e.args[0], e.permanent)
      return result
    except Exception as e:  # the runtime refused something: the traced step stands
      self._refused(f"capturing failed ({type(e).__name__}: {e})", True)
      return result
    # What the replays run is compiled now, not at a replay (its settings' errors are the user's).
    _runtime.prepare_program(*prog.runtime_program, prog.donate)
    if _runtime.REPLAY_KIND != "program":
      # Run the captured step itself: its inputs are the traced graph's device data.
      results = _runtime.run_program(*prog.runtime_program, values, donate=prog.donate)
      result = write_back(prog, results, rep._n)
    rep.captures += 1
    self._offer(prog)
    if self._entry.promoted and not self.group:
      # Confirmed (a verification trace, a second capture): the steps after it
      # in experimental_run_steps may run as its group, as after a replayed step.
      fn, spec, leaves = self._step
      rep.last_replayed = (self._entry, weak(fn), spec, [arg_entry(x) for x in leaves])
    return result

  def _cut(self):
    """Runs a traced step that was not captured now, so that the next step
    starts from computed values and can be captured (a step that is replayed
    needs no sync, so none may come). Every pending tensor is cut with it: a
    sync of some tensors only lets torch_xla give their input buffers to the
    outputs (aliasing) while other pending tensors still read them."""
    _runtime.sync(boundary=False)

  def _refused(self, why, permanent):
    entry = self._entry
    entry.failures += 1
    if permanent or entry.failures >= 2:
      entry.refused = why
      if getattr(why, "kind", None) is not None:  # its Python's (python_effects.Refusal)
        self._replayer.warn_once(self._step[0], why)
    self._record(f"not captured: {why}")

  def _record(self, what):
    rep = self._replayer
    rep.reasons.append((rep.steps, what))
    if debug():
      logger.warning("xladist replay: step %d %s", rep.steps, what)

  def _offer(self, prog):
    entry = self._entry
    old = entry.program
    entry.program = prog
    if old is None:
      entry.promoted = False
      return
    what = differs(old, prog)
    if what is not None and settle_coincidences(old, prog):
      what = differs(old, prog)
    if what is None:
      hyper_inputs.agree(old.hypers, prog.hypers)
      entry.promoted = True
      return
    entry.promoted = False
    entry.step_groups = {}  # captured from the step's old program
    if self._verify is None:
      self._record(f"captured {what} than the last trace: the next trace confirms it")
    else:
      # Never silent: this key is not replayed again (its steps are traced, so the
      # numbers from here on are the traced ones), said once.
      strict, every = self._verify
      rep = self._replayer
      entry.refused = f"a verification trace at step {rep.steps} captured {what}"
      message = (
        f"xladist: replayed steps were stale: a verification trace at step {rep.steps} "
        f"captured {what} than the program replayed since (up to {every - 1} steps "
        "before this one used the old program). fn depends on something xladist does "
        "not watch (a value read by C code, or through a list at a computed index); pass "
        "it as an argument or read it as an attribute, a dict item or by name, or turn "
        "replay off for this step "
        "(RunOptions(experimental_replay=False) or XLADIST_REPLAY=0). This step "
        "function is traced at every step from now on."
      )
      logger.warning(message)
      if strict:
        raise RuntimeError(message)
      warnings.warn(message, RuntimeWarning, stacklevel=4)

  def _program(self, result, seed1):
    """The traced step's program (`runtime.last_program`), its inputs mapped to
    slots, arguments (by buffer), the seed, hyperparameters and constants (scalars
    matched by value: hyper_inputs.py), its results to what fn returned and the
    slots the step wrote (by value identity; a result two of them take is an
    alias). Returns it with the program's inputs at the capture."""
    slots, uids, counters = _new_state_slots(self)
    wrote = self.effects.why_not_replayed() if self.effects is not None else None
    if wrote is not None:
      # Left lazy, as without replay; the key's next steps are traced too.
      self._replayer.count_refusal(wrote)
      skipped = " (a replay would skip it)" if wrote.kind is python_effects.Reason.WROTE else ""
      words = f"{wrote}{skipped}: traced at every call"
      raise NotCapturable(python_effects.Refusal(words, wrote.kind))
    ret_spec, returned = _returned(result)
    outs, ret_leaves = [], []
    for j, kind, value in returned:
      if kind in ("py", "hyper"):
        ret_leaves.append((kind, value))
      else:
        outs.append((value, (RET, j)))
        ret_leaves.append(kind)
    cleared, written = _written_slots(slots, uids)
    outs += [(value, (SLOT, i)) for i, value in written]
    program, consts, inputs, results = _runtime.last_program([t for t, _ in outs])
    index = {}
    for j, r in enumerate(results):
      index.setdefault(_runtime.value_id(r), j)
    targets, aliases, outside = [(DROP,)] * len(results), [], []
    for t, target in outs:
      j = index.get(_runtime.value_id(t))
      if j is None:
        if target[0] == RET:
          raise NotCapturable("a returned tensor is not computed by the step")
        outside.append(t)  # a slot the step gave a value from outside: it keeps it at a replay
        continue
      if targets[j][0] == DROP:
        targets[j] = target
      else:
        aliases.append((target, j))
    if all(t[0] == DROP for t in targets):
      raise NotCapturable("the step computes nothing")
    if any(self._by_handle.get(h, (None,))[0] == ARG for h in _runtime.buffer_ids(outside)):
      raise NotCapturable("a state slot was given an argument of the step (a replay would not)")
    # The program's inputs: device buffers (slots, arguments; one nothing names is
    # fed as it is), the seed, and scalars (host or device tensors: hyperparameters
    # or constants, compared between captures).
    sources, scalars, taken = [], [], []
    for j, (handle, v) in enumerate(zip(_runtime.buffer_ids(inputs), inputs)):
      if j in program.seed_inputs:
        if int(v.cpu()) != signed(self._seed0):
          raise NotCapturable("the step's random-number seed is not the one it started from")
        sources.append((SEED,))
        continue
      sources.append(_source(self, handle, v, scalars if isinstance(v, torch.Tensor) else taken))
    hypers = _hyper_sources(self, sources, scalars)
    draws = 0
    if sum(1 for s in sources if s[0] == SEED) > 1:
      raise NotCapturable("the program has several random-number seeds")
    if any(s[0] == SEED for s in sources):
      draws = seeds.draws_between(self._seed0, seed1)
      if not draws:
        raise NotCapturable("the step's random-number seed use could not be followed")
    arrays = [] if consts is None else [(id(a), a) for a in consts[0]]
    prog = CapturedProgram(
      program.key,
      slots,
      sources,
      targets,
      aliases,
      cleared,
      ret_spec,
      ret_leaves,
      consts=arrays + scalars,
      runtime_program=(program, consts),
      draws=draws,
      hypers=hypers,
    )
    prog.donate = donated(prog, self._shared, self._donate_floor)
    _host_decisions(prog, self, counters)
    return prog, inputs


def _shared_slots(slots, values, min_bytes):
  """The "graph" form, whose capture runs the step's program on the buffers the
  slots hold as the step begins (`values`): the slots whose value shares its
  storage with another tensor (a `detach()` or `.data` the user keeps), which
  the captured program must not give up. Work still pending (the user's lazy
  tensors, which may read those buffers) is computed first. None when the
  program will give up nothing (the slots it could are under `min_bytes`)."""
  if _runtime.REPLAY_KIND != "graph":
    return ()
  size = sum(nbytes(v) for s, v in zip(slots, values) if s.kind in DONATED_KINDS)
  if not size or size < min_bytes:
    return None
  _runtime.sync(boundary=False)
  _runtime.wait()  # nothing the program gives up is still being read
  return {i for i, v in enumerate(values) if _runtime.shares_storage(v)}


def _host_decisions(prog, attempt, counters):
  """What the program assumes of the host: the guards of the trace (hyper.py), the
  host scalars it updates (`counters`: [(state dict, key, expression)]), and the
  groups and states their expressions read."""
  swapped = attempt.hypers
  prog.groups = swapped.groups if swapped is not None else {}
  prog.guards = tuple(swapped.guards.items()) if swapped is not None else ()
  prog.counters = tuple(counters)
  exprs = [expr for expr, _ in prog.guards] + [e for h in prog.hypers for e in h.exprs]
  prog.host_reads = bool(prog.counters) or hyper.reads_state(exprs)


def _hyper_sources(attempt, sources, consts):
  """Turns the CONST sources that are optimizer hyperparameters (matched by value:
  hyper_inputs.py) into HYPER sources, dropping them from `consts`; their
  `hyper_inputs.Input`s. A program's scalars are inputs on every runtime
  (torch_xla: device data; jax: `last_program`'s host scalars)."""
  made = attempt.hypers.candidates() if attempt.hypers is not None else ()
  scalar = [
    i
    for i, s in enumerate(sources)
    if s[0] == CONST
    and isinstance(s[1], torch.Tensor)  # (jax: an input array nothing names is none)
    and s[1].dim() == 0
    and s[1].dtype.is_floating_point
  ]
  if not made or not scalar:
    return []
  found = hyper_inputs.match(
    [(sources[i][1].cpu().item(), sources[i][1].dtype) for i in scalar], made
  )
  inputs, dropped = [], set()
  entries = {id(c[1]): c for c in consts}
  for i, h in zip(scalar, found):
    if h is not None:
      dropped.add(id(sources[i][1]))
      h.origin = entries[id(sources[i][1])]
      sources[i] = (HYPER, len(inputs))
      inputs.append(h)
  consts[:] = [c for c in consts if id(c[1]) not in dropped]
  return inputs


def _new_state_slots(attempt):
  """(the attempt's slots, with the gradients the step made; their value ids
  before the step; the host scalars the step updated, `host_change`). Refuses
  other new state, and a step that changed optimizer state outside the device."""
  store = attempt._replayer._store
  known = {s.ident() for s in attempt._slots}
  slots, uids = list(attempt._slots), list(attempt._uids)
  for s in state_slots(store):
    if s.ident() not in known:
      if s.kind != GRAD:  # a gradient made by the step is an output like any other
        raise NotCapturable("the step created state (optimizer state or variables)")
      slots.append(s)
      uids.append(None)
  updates = attempt.hypers.updates() if attempt.hypers is not None else {}
  host, counters = host_change(store, attempt._host, host_state(store), updates)
  if host is None:
    optimizers = list(store.optimizers())
    after = hyper_inputs.group_values(optimizers)
    host = hyper_inputs.group_change(optimizers, attempt._groups, after)
  if host is not None:
    raise NotCapturable(host, permanent=True)
  return slots, uids, counters


def _source(attempt, handle, value, consts):
  """Where a program input comes from: a slot or an argument (recognised by its
  device buffer's `handle`), else a constant (recorded in `consts`)."""
  if handle in attempt._ambiguous:
    raise NotCapturable("an argument shares its device buffer with a variable or another argument")
  source = attempt._by_handle.get(handle)
  if source is not None:
    return source
  consts.append((handle, value))
  return (CONST, value)


def _returned(result):
  """What fn returned, leaf by leaf: (index, "stacked" | "tensor" | "py", the
  PerReplica's stacked tensor, the tensor or the Python value), with the nest's spec.

  Raises:
    NotCapturable: a leaf that is neither a device tensor nor a plain value.
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
    elif isinstance(leaf, PLAIN):
      out.append((j, "py", leaf))
    else:
      raise NotCapturable(
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
      raise NotCapturable("a state slot lost its value")
    if _runtime.value_id(value) != uids[i]:
      written.append((i, value))
  return cleared, written
