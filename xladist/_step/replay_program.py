"""A captured step program (replay.py): its record, how two captures compare, how
it is fed its inputs at a replay and how its results are written back.

A program's inputs are each a *source*: a slot (replay_slots.py), an argument,
the random-number seed, an optimizer hyperparameter (hyper.py) or a constant;
its results each a *target*: a returned leaf or a slot. `CapturedProgram` holds the
mapping and the runtime's program (`runtime.last_program`); `program_inputs` builds
the inputs of one replay from the current slots and arguments, `write_back`
puts the results where the traced step would have left them (a group of
`experimental_run_steps`' steps is a program like a step's: replay.py).
"""

import contextlib
import dataclasses
import enum
import logging
import operator
import weakref

import numpy as np
import torch

from xladist import _settings
from xladist import runtime as _runtime
from xladist._nest import unflatten
from xladist._step import hyper, hyper_inputs
from xladist._step.hyper_compile import compiled
from xladist._step.replay_slots import (
  COPIES,
  GRAD,
  OPT,
  PLAIN,
  VAR,
)
from xladist.replica_copies import copies_of
from xladist.values import Mirrored, PerReplica

logger = logging.getLogger("xladist")


def debug():
  return _settings.switch("XLADIST_REPLAY_DEBUG", False)


# -- torch_xla's random-number seed -------------------------------------------------------


def signed(seed):
  return seed - (1 << 64) if seed >= (1 << 63) else seed


def _seed_tensor(seed):
  """The seed as the int64 device scalar a traced graph's seed parameter holds."""
  return _runtime.place_replicated(torch.tensor(signed(seed), dtype=torch.int64))


# -- captured programs ------------------------------------------------------------------------


class Source(enum.IntEnum):
  """Where a captured program's input comes from, or where a result goes."""

  SLOT = 0  # a slot of the step's state (replay_slots.py)
  ARG = 1  # an argument of the step
  CONST = 2  # a constant of the trace
  SEED = 3  # the step's random seed
  RET = 4  # a value fn returned
  DROP = 5  # a result nothing keeps (a value of the step no slot or return holds)
  HYPER = 6  # an optimizer hyperparameter (or arithmetic on some): `prog.hypers[i]`


SLOT, ARG, CONST, SEED, RET, DROP, HYPER = Source


@dataclasses.dataclass(slots=True, eq=False)
class CapturedProgram:
  """One captured step program (what `Attempt._program` records) and how to
  feed it and place its outputs."""

  hash: object  # the runtime's program key (its graph hash or text)
  slots: list  # replay_slots._Slot of every SLOT source and target
  sources: list  # each input's source: (SLOT, i), (ARG, i), (CONST, value), (SEED,), (HYPER, i)
  targets: list  # each result's target: (SLOT, i), (RET, j) or (DROP,)
  aliases: list  # (target, result index): a result a second target takes too
  cleared: list  # the gradient slots the step set to None
  ret_spec: object  # the nest of what fn returned
  ret_leaves: list  # per returned leaf: "stacked", "tensor", ("py", value) or ("hyper", expr)
  consts: list  # (buffer id, value) of the constants, compared between captures
  runtime_program: tuple = None  # (program, constants) of `runtime.last_program`
  draws: int = 0  # random numbers the step draws (torch_xla's seed arithmetic)
  starts: tuple = ()  # a group's steps: draws before each step's first seed
  hypers: list = dataclasses.field(default_factory=list)  # hyper_inputs.Input of each HYPER source
  groups: dict = dataclasses.field(default_factory=dict)  # id -> the groups and states they read
  counters: tuple = ()  # the host scalars the step updates: (state, key, expression)
  guards: tuple = ()  # (expression, value): the host decisions of the trace (hyper.py)
  donate: tuple = ()  # positions of the inputs a run gives up (`donated`)
  host_reads: bool = False  # whether its guards or hyperparameters read host tensors
  # "counters" / "guards" -> (the tuple it was made from, hyper_compile.compiled of its
  # expressions), "hypers" -> (the inputs, their candidates, hyper_inputs.evaluator):
  # each made again when what it was made from is replaced
  evaluators: dict = dataclasses.field(default_factory=dict)
  restamp: list = dataclasses.field(init=False)  # the sync-on-read variables it writes

  def __post_init__(self):
    self.restamp = [s.tensor for s in self.slots if s.kind == COPIES]

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
      tuple(str(h.dtype) if h is not None else None for h in self.hypers),
      tuple((id(state), key, expr) for state, key, expr in self.counters),
      self.guards,
    )


def _same_constants(a, b):
  """Whether two captures' constants are the same values (same buffers, or equal
  small tensors or arrays: a constant made afresh by each trace from the same data)."""
  for (hx, x), (hy, y) in zip(a, b):
    if hx == hy:
      continue
    if tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype or np.prod(x.shape) > 65536:
      return False
    if not np.array_equal(_host(x), _host(y)):
      return False
  return True


def _host(value):
  """A constant's values in numpy (a torch tensor, or a jax runtime's array)."""
  if isinstance(value, torch.Tensor):
    value = value.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
  return np.asarray(value)


def differs(old, new):
  """Words naming how two captures of one key differ, or None when they are the same."""
  fa, fb = old.fingerprint(), new.fingerprint()
  if fa[0] != fb[0]:
    return "a different graph (XLA program hash)"
  if fa != fb:
    return "the same graph with its inputs or outputs mapped differently"
  if not hyper_inputs.compatible(old.hypers, new.hypers):
    return "the same graph with a hyperparameter input matched to other hyperparameters"
  if not _same_constants(old.consts, new.consts):
    return (
      "the same graph with other constants (a Python number or a tensor fn reads "
      "from outside, e.g. through a helper function or an object's attribute)"
    )
  return None


def settle_coincidences(old, new):
  """Where one capture took a program scalar for a hyperparameter and the other for
  a constant, and the scalar had the same value at both, the match was a coincidence
  of values at one capture (a constant of the model, 1/6, equal to a cycling
  `1 - beta1` at one step): both take it for the constant (what the scalar is at
  either capture). Returns whether there was any."""
  if old.hash != new.hash or len(old.sources) != len(new.sources):
    return False
  flips = [
    p
    for p, (a, b) in enumerate(zip(old.sources, new.sources))
    if {a[0], b[0]} == {CONST, HYPER} and _scalar_value(old, a) == _scalar_value(new, b)
  ]
  for prog in (old, new):
    _to_constants(prog, [p for p in flips if prog.sources[p][0] == HYPER])
  return bool(flips)


def _scalar_value(prog, source):
  if source[0] == HYPER:
    return prog.hypers[source[1]].value
  value = source[1]
  return float(value.cpu()) if isinstance(value, torch.Tensor) and value.dim() == 0 else None


def _to_constants(prog, positions):
  """Makes the HYPER sources at `positions` constants again (the scalar each was
  matched from), numbering the other HYPER sources afresh."""
  if not positions:
    return
  sources = prog.sources
  origin = {p: prog.hypers[sources[p][1]].origin for p in positions}  # (handle, scalar)
  # The constants compared between captures: the runtime's arrays, then the
  # (handle, value) of each tensor source, in source order.
  entries = {id(c[1]): c for c in prog.consts}
  tensors = sum(1 for s in sources if s[0] == CONST and isinstance(s[1], torch.Tensor))
  consts, hypers = prog.consts[: len(prog.consts) - tensors], []
  for p, s in enumerate(sources):
    if p in origin:
      sources[p] = (CONST, origin[p][1])
      consts.append(origin[p])
    elif s[0] == HYPER:
      sources[p] = (HYPER, len(hypers))
      hypers.append(prog.hypers[s[1]])
    elif s[0] == CONST and isinstance(s[1], torch.Tensor):
      consts.append(entries[id(s[1])])
  prog.consts, prog.hypers = consts, hypers


@dataclasses.dataclass(slots=True, eq=False)
class KeyEntry:
  """A key's program and its state of promotion."""

  program: CapturedProgram = None
  promoted: bool = False
  since_verify: int = 0
  refused: str = None  # why this key is never replayed, or None
  failures: int = 0  # captures refused so far (twice: never again)
  step_groups: dict = dataclasses.field(default_factory=dict)  # k -> KeyEntry of k steps
  guard_failures: int = 0  # replays refused by a guard in a row


def advance_host_scalars(prog):
  """Sets the host scalars of the optimizers' state (step counters, NAdam's
  `mu_product`) to what the replayed step computes from their values before it
  (hyper.py): every new value first, then every write."""
  if not prog.counters:
    return
  evaluate = _evaluator(prog, "counters")
  with _runtime.host_work():
    new = evaluate(prog.groups)
    for (state, key, _), value in zip(prog.counters, new):
      state[key].fill_(value)


_EXPRESSION_AT = {"counters": 2, "guards": 0}  # where each entry of the tuple has it


def _evaluator(prog, what):
  """hyper_compile.compiled of the expressions of the capture's `what` ("counters":
  (state, key, expression), or "guards": (expression, value)), made once per tuple."""
  made = prog.evaluators.get(what)
  source = getattr(prog, what)
  if made is None or made[0] is not source:
    at = _EXPRESSION_AT[what]
    made = prog.evaluators[what] = (source, compiled([entry[at] for entry in source]))
  return made[1]


def _guards_fail(prog):
  """A `Traced` when a host decision of the trace would come out otherwise now."""
  guards = prog.guards
  if not guards:
    return None
  try:
    now = _evaluator(prog, "guards")(prog.groups)
    if all(a == result for a, (_, result) in zip(now, guards)):
      return None
  except (ArithmeticError, ValueError):
    pass  # which guard, in words: below
  why = hyper.guards_fail(guards, prog.groups)
  return None if why is None else Traced(why, guard=True)


def weak(fn):
  """A weak reference to `fn` (a callable that returns it), strong only for a
  callable that takes no weak references (a builtin)."""
  try:
    return weakref.ref(fn)
  except TypeError:
    return lambda: fn


def arg_entry(leaf):
  """What `replay_steps` compares of an argument: a tensor's (or a
  PerReplica's) shape, dtype and placement, a Python value itself, else the type."""
  if isinstance(leaf, PerReplica) and leaf._stacked is not None:
    leaf = leaf._stacked
  if isinstance(leaf, torch.Tensor):
    # (attribute reads skip torch-function modes: on jax each one was lowered as an op)
    with torch._C.DisableTorchFunction():
      return (tuple(leaf.shape), leaf.dtype, _runtime.sharding_spec(leaf))
  if isinstance(leaf, PLAIN):
    return ("value", leaf)
  return ("object", type(leaf))


def program_inputs(prog, leaves, n, seed):
  """A replay's inputs, in the program's order (slots' current values, the
  arguments' global tensors, constants, the seed), or a `Traced` saying why
  the step must be traced."""
  with _runtime.host_work() if prog.host_reads else contextlib.nullcontext():
    failed = _guards_fail(prog)  # (host scalars only: the guards, the hyperparameters)
    if failed is not None:
      return failed
    hypers = prog.hypers
    if hypers:
      hypers = [_hyper_value(h, v) for h, v in zip(hypers, _hyper_values(prog))]
  slots = prog.slots
  inputs = []
  for source in prog.sources:
    kind = source[0]
    if kind == SLOT:
      value = slots[source[1]].get()
      if value is None:
        return Traced("a state slot has no value, or a tensor fn reads by name was replaced")
    elif kind == ARG:
      try:
        value = arg_global(leaves[source[1]], n)
      except NotCapturable as e:
        return Traced(str(e))
    elif kind == CONST:
      value = source[1]
    elif kind == HYPER:
      h = prog.hypers[source[1]]
      value = hypers[source[1]]
      if isinstance(value, Traced):
        return value
      if h.placed is None or h.placed[0] != value:
        h.placed = (value, _runtime.scalar_input(value, h.dtype))
      value = h.placed[1]
    else:
      value = _seed_tensor(seed)
    inputs.append(value)
  return inputs


def _hyper_values(prog):
  """Every hyperparameter input's value now (`Input.current`, None where its
  candidates differ), by one evaluator made for the inputs as they are."""
  hypers = prog.hypers
  made = prog.evaluators.get("hypers")
  if (
    made is None
    or made[0] is not hypers
    or len(made[1]) != len(hypers)
    or not all(map(operator.is_, made[1], (h.exprs for h in hypers)))
  ):  # (the candidates it was made for are held: their identities stay theirs)
    made = (hypers, [h.exprs for h in hypers], hyper_inputs.evaluator(hypers))
    prog.evaluators["hypers"] = made
  return made[2](prog.groups)


def _hyper_value(h, value):
  """A hyperparameter input's value now (`value`), or a `Traced` saying why the
  step is traced instead (see hyper.py: a match not yet confirmed by two captures
  is confirmed by a trace when its value first changes)."""
  if value is None:
    return Traced("hyperparameters that were equal when the step was captured differ now")
  if value != h.value and not h.proven:
    return Traced(
      f"optimizer hyperparameter {h.names()} changed for the first time since the step "
      "was captured (traced once to confirm that it is an input of the program)"
    )
  return value


def arg_global(leaf, n):
  """The global tensor an argument enters the step from (what a trace reads).

  Raises:
    NotCapturable: an argument the trace refuses (a PerReplica made inside
      merge_call, or for another replica count): the trace says why.
  """
  if isinstance(leaf, PerReplica):
    if leaf._local is not None or leaf.num_replicas != n:
      raise NotCapturable("an argument is refused by the trace")
    return leaf._stacked_global(n)
  if isinstance(leaf, Mirrored):
    leaf = leaf.primary
  if not _runtime.is_device_tensor(leaf):
    return _runtime.place_replicated(leaf)
  return _runtime.ensure_sharded(leaf)


def write_back(prog, results, n):
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
    slots[i].set(None)
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


DONATED_KINDS = (VAR, GRAD, OPT)
DONATE_MIN_BYTES = 16 << 20


def donate_min_bytes():
  """The least a replay must give up for its program to donate anything:
  `XLADIST_DONATE_MIN_BYTES` (bytes of the donated inputs' global shapes; 0:
  always), else 16 MiB. Below it donating costs more than the memory it saves:
  on jax one more compilation per captured program, on torch_xla a sync before
  each capture and a check of every donated input before each replay."""
  n, _ = _settings.whole_number(
    "XLADIST_DONATE_MIN_BYTES", DONATE_MIN_BYTES, "bytes a replay must give up to donate; 0: always"
  )
  return n


def nbytes(tensor):
  return tensor.numel() * tensor.element_size()


def donated(prog, shared, min_bytes):
  """The positions of the program's inputs whose buffers a run may give up
  (donate) to its results: a variable, gradient or optimizer state the program
  overwrites, from a result of its own (one that nothing returns and no other
  slot takes: the user may keep what a step returns, and a buffer shared by two
  slots would be given up twice); none when together they come to less than
  `min_bytes` (`donate_min_bytes`). `shared`: slots not to give up (their value
  was shared with another tensor when the step began), None: give up nothing."""
  if shared is None:
    return ()
  result_of, takers = {}, {}
  pairs = [(t, j) for j, t in enumerate(prog.targets)] + list(prog.aliases)
  for target, j in pairs:
    if target[0] in (SLOT, RET):
      takers[j] = takers.get(j, 0) + 1
    if target[0] == SLOT:
      result_of[target[1]] = j
  out, size = [], 0
  for position, source in enumerate(prog.sources):
    if source[0] != SLOT or source[1] in shared:
      continue
    slot = prog.slots[source[1]]
    if slot.kind not in DONATED_KINDS:
      continue
    j = result_of.get(source[1])
    if j is not None and takers[j] == 1:
      out.append(position)
      size += nbytes(slot.get(settle=False))
  return tuple(out) if size >= min_bytes else ()


class Traced:
  """`Replayer._replay`: the step could not be replayed and is traced, because..."""

  __slots__ = ("why", "guard")

  def __init__(self, why, guard=False):
    self.why = why
    self.guard = guard  # a guard of the trace failed (hyper.py)


class NotCapturable(Exception):
  def __init__(self, why, permanent=False):
    super().__init__(why)
    self.permanent = permanent
