"""A step's program on the jax runtime: building, caching and running it.

`traced_step` runs a step's phases inside a jax trace (jax_step.py), closes it
into a jaxpr (its float literals lifted into constants), finds or builds its
compiled program (`_Program`: `jax.jit(shard_map(...))` over the replica mesh,
cached by the jaxpr's structure, then its text), and runs it. For the replay of
steps (_step/replay.py): `last_program`, `run_program` (again, or inside
another trace; a hyperparameter's new value is a scalar input, `_fed` into the
packed constants). Holds the last program run, its
outputs (what `wait` waits for) and the callbacks of the next sync.

Memory (issue 41): the last traced step's input and result arrays are held only
until the capture takes them (`last_program`), so that no old step's buffers
outlive it. A replay gives up (donates) the inputs the capture names: the capture
has the program's donating variant compiled ahead of time (`prepare_program`: the
program jitted again with `donate_argnums`, lowered on the abstract inputs of the
step just traced; one more compilation per captured program, none at a replay),
and `run_program(..., donate=...)` runs it, first copying an input array that
anything besides its tensor refers to (`_giveable`: torchax's `detach()` shares
the array). The capture names no input of a program that would give up less
than 16 MiB (`replay_program.donate_min_bytes`, `XLADIST_DONATE_MIN_BYTES`): it
gets no variant, whose compilation would cost more than the memory. Traced
steps do not donate (docs/performance.md, "Memory").
"""

import contextlib
import functools
import logging
import operator
import sys

import numpy as np

from xladist import _settings
from xladist.runtime import jax_compat
from xladist.runtime.jax_devices import (
  REPLICA_AXIS,
  _counts,
  _current,
  _placed,
  _rt,
  _tls,
  _wrap,
  mesh,
  num_devices,
  replicated_sharding,
)
from xladist.runtime.jax_step import _local_input, _source_info, _step_trace_class, _StepTrace


class _Program:
  """A compiled step program and what it was traced from.

  Its constants are passed in two parts (`pack`): the arrays, and the scalars
  packed into one vector per dtype (a step's Python numbers, lifted out of the
  program text: one input instead of dozens, each of which costs a transfer
  per device at every run)."""

  def __init__(self, jitted, key, jaxpr, in_split, out_split, layout, mapped=None):
    self.jitted = jitted
    self.mapped = mapped  # the function jitted (a donating variant jits it again)
    self.donating = {}  # donated input positions -> that variant, compiled (`prepare_program`)
    self.key = key  # the program's text: what two captures of one step compare
    self.seed_inputs = ()  # the random key is the runtime's input, not one of the program's
    self.jaxpr = jaxpr
    self.in_split = in_split
    self.out_split = out_split
    self.layout = layout
    # the packed form's scalar vectors: their dtypes, and each scalar constant's
    # (vector, position), in layout order
    self.scalar_dtypes = tuple(sorted({d for kind, d, _ in layout if kind == "scalar"}))
    self.scalar_at = tuple(
      (self.scalar_dtypes.index(d), j) for kind, d, j in layout if kind == "scalar"
    )
    self.fed = {}  # id(packed constants) -> what `_fed` last gave them
    self.hlo = None
    self._local = None

  def pack(self, consts):
    """The constants as the program takes them (placed on the devices)."""
    jax = _rt().jax
    arrays, scalars = [], {}
    for (kind, dtype, _), c in zip(self.layout, consts, strict=True):
      if kind == "array":
        arrays.append(c)
      else:
        scalars.setdefault(dtype, []).append(np.asarray(c, dtype=jax.numpy.dtype(dtype)))
    vectors = [np.stack(scalars[d]) for d in sorted(scalars)]
    with jax.ensure_compile_time_eval():
      placed = _on_devices(vectors)  # each process its own copy (no cross-process check)
    return (_on_devices(arrays), placed)

  def call(self, packed, key, args):
    return self.jitted(packed[0], packed[1], key, *args)

  def local(self):
    """The step's body on replica-local values, as one jitted call: a replayed
    step inside another trace is one equation of it."""
    if self._local is None:
      self._local = _rt().jax.jit(_unpacking_body(self.jaxpr, self.layout))
    return self._local


def _const_layout(consts):
  """Per constant: ("scalar", dtype, index in its dtype's vector) or ("array", dtype, i)."""
  counts, layout = {}, []
  for c in consts:
    dtype = np.dtype(c.dtype).name  # not .str: bfloat16's is "<V2" (void)
    if tuple(np.shape(c)) == ():
      layout.append(("scalar", dtype, counts.get(dtype, 0)))
      counts[dtype] = counts.get(dtype, 0) + 1
    else:
      layout.append(("array", dtype, None))
  return tuple(layout)


def _unpacking_body(jaxpr, layout):
  """fn(arrays, vectors, key, *args): the jaxpr evaluated with its constants
  rebuilt from the packed form."""
  order = sorted({d for kind, d, _ in layout if kind == "scalar"})

  def body(arrays, vectors, key_in, *args):
    by_dtype = dict(zip(order, vectors, strict=True))
    it = iter(arrays)
    consts = [next(it) if kind == "array" else by_dtype[d][j] for kind, d, j in layout]
    return jax_compat.eval_jaxpr(jaxpr, *consts, key_in, *args)

  return body


_programs = {}
_last_outputs = []
_last_program = [None]  # (program, packed constants, key, abstract inputs) of the last step
# its (input arrays, result arrays, scalar constants), until the capture takes them
_last_io = [None]
_sync_callbacks = []


def traced_step(body):
  """Runs `body()` (a step's phases) inside a jax trace, then its program.

  Returns what `body` returned, its output tensors holding the program's results.
  A `traced_step` inside another one (the k steps of `experimental_run_steps`)
  is part of the outer one's program: its outputs are values of that trace,
  which the next step reads as they are.
  """
  rt = _rt()
  if _current() is not None:
    # A step inside a traced group of steps (experimental_run_steps): part of
    # the group's one program.
    return body()
  n = num_devices()
  trace = jax_compat.new_trace(_step_trace_class())
  st = _StepTrace(trace)
  env = rt.env
  key_before = env.param.prng = _placed_key(env.param.prng)
  _tls.step = st
  try:
    with jax_compat.bind_axis(REPLICA_AXIS, n), jax_compat.current_trace(trace):
      # The key's type without its placement: inside the program every value is
      # replica-local (a placed aval would name the global mesh).
      key_aval = jax_compat.shaped_array(key_before.shape, key_before.dtype)
      key_in = trace.new_arg(key_aval, _source_info())
      # Every replica draws from the same key: xladist's per-replica draws take
      # each replica's rows of one global draw (_step/seeds.py).
      env.param.prng = key_in
      result = body()
      key_out = env.param.prng
      outs = [t for _, t, _ in st.outputs] + [key_out]
      jaxpr, consts = jax_compat.close_trace(trace, outs)
  finally:
    _tls.step = None
    env.param.prng = key_before  # until the program has run
  jaxpr, consts = _lift_float_literals(jaxpr, consts)
  program = _program_for(jaxpr, st, _const_layout(consts))
  packed = program.pack(consts)
  args = [elem for elem, _ in st.inputs]
  abstract = [_abstract(a) for a in args]
  outs = program.call(packed, key_before, args)
  _counts["execute"] += 1
  _counts["sync"] += 1
  result_of = {}
  for (tensor, traced, _), value in zip(st.outputs, outs[:-1], strict=True):
    result_of[id(traced)] = value
    for holder in st.holders[id(tensor)]:
      holder._elem = value
  for ident in st.idents:
    ident.target = result_of.get(id(ident.target), ident.target)
  env.param.prng = outs[-1]
  _last_outputs[:] = [outs[-1]]
  _last_program[0] = (program, packed, key_before, abstract)
  scalars = [c for (kind, _, _), c in zip(program.layout, consts) if kind == "scalar"]
  _last_io[0] = (args, list(outs[:-1]), scalars)
  _run_sync_callbacks()
  return result


def _placed_key(key):
  """The random key placed as a step's program leaves it (replicated over the
  mesh). A key made on the host (a new seed: torch.manual_seed, set_seed) would
  make the next program compile once for its placement and once more for the
  placed key that program returns. With several processes the key stays as it
  is (each process's host key would need a collective to place)."""
  jax = _rt().jax
  if isinstance(key, jax.core.Tracer) or jax.process_count() > 1:
    return key
  sharding = replicated_sharding(0)
  if key.sharding != sharding:
    key = jax.device_put(key, sharding)
  return key


def last_program(outputs=None):
  """(program, constants, inputs, result arrays) of the last step traced and
  run, for the replay of steps (`_step/replay.py`). The inputs are the program's
  input arrays, then its scalar constants (the step's Python numbers, lifted
  out of the program text) as host tensors, one each: `run_program` takes them
  as inputs like the arrays, so a replay feeds a hyperparameter's new value the
  same way on every runtime. The constants are the packed arrays and vectors.
  (`outputs`: the runtime ran the step's whole program already; every result is
  offered.)"""
  del outputs
  program, consts, _, _ = _last_program[0]
  args, results, scalars = _last_io[0]
  _last_io[0] = None  # taken: held here, they would keep an old step's buffers alive
  return program, consts, args + [_host_scalar(c) for c in scalars], results


def _host_scalar(value):
  """A scalar constant as a host torch tensor of its dtype (bfloat16 through
  float32: torch takes no numpy bfloat16)."""
  import torch

  value = np.asarray(value)
  if value.dtype.name == "bfloat16":
    return torch.tensor(float(value), dtype=torch.bfloat16)
  return torch.from_numpy(value.copy())


def scalar_input(value, dtype):
  """A replay's scalar input (a hyperparameter's value): the number itself;
  `run_program` packs the program's scalars (`_fed`)."""
  del dtype
  return value


def _fed(program, consts, scalars):
  """`consts` (a program's packed constants) with its scalar vectors holding
  `scalars` (a replay's scalar inputs in the program's order: host tensors or
  numbers): one transfer per vector when a value changed since these constants
  last ran, none otherwise (each scalar compared by identity, a number by value)."""
  if not scalars:
    return consts
  fed = program.fed.get(id(consts))
  if fed is not None and fed[0] is consts and all(map(operator.is_, scalars, fed[1])):
    return fed[3]  # the same objects as last time (a number unchanged is its cached object)
  if fed is None or fed[0] is not consts:
    jax = _rt().jax
    sizes = [0] * len(program.scalar_dtypes)
    for v, j in program.scalar_at:
      sizes[v] = max(sizes[v], j + 1)
    host = [np.zeros(n, jax.numpy.dtype(d)) for n, d in zip(sizes, program.scalar_dtypes)]
    last = [None] * len(scalars)
    if len(program.fed) >= 8:  # the constants of programs replaced since
      program.fed.pop(next(iter(program.fed)))
  else:
    _, last, host, placed = fed
  changed = fed is None or fed[0] is not consts
  for i, x in enumerate(scalars):
    old = last[i]
    if x is old or (old is not None and not hasattr(x, "item") and x == old):
      continue
    v, j = program.scalar_at[i]
    host[v][j] = x.item() if hasattr(x, "item") else x
    changed = True
  if changed:
    jax = _rt().jax
    with jax.ensure_compile_time_eval():
      placed = (consts[0], _on_devices([h.copy() for h in host]))
  program.fed[id(consts)] = (consts, list(scalars), host, placed)
  return placed


def _abstract(array):
  """An input's shape, dtype and placement (what lowering the program needs)."""
  jax = _rt().jax
  weak = getattr(array, "weak_type", False)
  return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding, weak_type=weak)


@contextlib.contextmanager
def host_work():
  """A replay's bookkeeping on host tensors (step counters read and written,
  hyperparameters evaluated) with torchax's torch-function and dispatch modes set
  aside: through them every op or attribute of a host tensor costs about 20 µs
  (`t._version`, `float(t)`, `t.fill_(v)`; 0.1-0.6 µs without), and a replayed
  AdamW step reads and writes each parameter's counter. Only host tensors may be
  touched inside: torchax's device tensors need its modes."""
  import torch
  from torch.utils._python_dispatch import _disable_current_modes

  modes = []
  while torch._C._len_torch_function_stack():
    modes.append(torch._C._pop_torch_function_stack())
  try:
    with _disable_current_modes():
      yield
  finally:
    for mode in reversed(modes):
      torch._C._push_on_torch_function_stack(mode)


class PendingInput(RuntimeError):
  """Never raised here: a jax array is computed (or being computed) once it exists."""


def _arrays(values):
  """The jax arrays behind tensors (a program's constants are arrays already)."""
  return [getattr(v, "_elem", v) for v in values]


def run_program(program, consts, inputs, donate=()):
  """Runs a step's program again on `inputs` (arrays in the order of its trace's
  inputs, then its scalars: `last_program`); returns its results as tensors,
  and moves the random key on.

  Inside a trace (a replayed step among the k steps of experimental_run_steps),
  the program's body is traced into the enclosing program instead: each input
  enters it as a local view, each result leaves it as an output.
  """
  rt = _rt()
  env = rt.env
  st = _current()
  n = len(program.in_split)
  consts = _fed(program, consts, inputs[n:])
  tensors, inputs = inputs[:n], _arrays(inputs[:n])
  if st is None:
    _last_io[0] = None
    env.param.prng = _placed_key(env.param.prng)
    outs = _donating_call(program, consts, env.param.prng, tensors, inputs, tuple(donate))
    del tensors
    if outs is None:
      outs = program.call(consts, env.param.prng, inputs)
    _counts["execute"] += 1
    env.param.prng = outs[-1]
    _last_outputs[:] = [outs[-1]]
    _run_sync_callbacks()
    return [_wrap(o) for o in outs[:-1]]
  tracer = rt.jax.core.Tracer
  local = [a if isinstance(a, tracer) else _local_input(st, a) for a in inputs]
  arrays = [_local_input(st, a) for a in consts[0]]
  vectors = [_local_input(st, v) for v in consts[1]]
  outs = program.local()(arrays, vectors, env.param.prng, *local)
  env.param.prng = outs[-1]
  results = []
  for value, split in zip(outs[:-1], program.out_split, strict=True):
    out = _wrap(value)
    st.outputs.append((out, value, split))
    st.holders[id(out)] = [out]
    results.append(out)
  return results


def prepare_program(program, consts, donate):
  """Compiles now (at the capture) the variant of `program` that gives up the
  inputs at the positions `donate` (`jax.jit`'s `donate_argnums`), for
  `run_program(..., donate=donate)`: no replay compiles. Its inputs are typed
  and placed as those of the last step traced, which ran `program`; a program
  that is not that step's is left as it is (its runs give nothing up)."""
  donate = tuple(donate)
  last = _last_program[0]
  if not donate or donate in program.donating or last is None or last[0] is not program:
    return
  _, _, key, abstract = last
  jax = _rt().jax
  jitted = jax.jit(program.mapped, donate_argnums=tuple(3 + i for i in donate))
  try:
    compiled = jitted.lower(consts[0], consts[1], key, *abstract).compile()
  except Exception as e:  # the replays give nothing up; they still run
    compiled = None
    logging.getLogger("xladist").warning(
      "replay: the step's program could not be compiled to give up its old state "
      "(%s: %s); replayed steps keep it alongside the new",
      type(e).__name__,
      e,
    )
  program.donating[donate] = compiled


def _donating_call(program, consts, key, tensors, inputs, donate):
  """Runs the variant of `program` that gives up the inputs at `donate`
  (compiled by `prepare_program`) on `inputs` (the arrays of `tensors`), made
  safe to give up first (`_giveable`); None when there is no such variant. One
  that refuses the arguments (placed otherwise than at the capture; refused
  before anything is given up) is dropped: the program runs as it is."""
  compiled = program.donating.get(donate) if donate else None
  if compiled is None:
    return None
  _giveable(tensors, inputs, donate)
  try:
    return compiled(consts[0], consts[1], key, *inputs)
  except (TypeError, ValueError) as e:
    program.donating[donate] = None
    if _settings.switch("XLADIST_REPLAY_DEBUG", False):
      logging.getLogger("xladist").warning(
        "xladist replay: the step's donating program refused its inputs (%s: %s); "
        "its replays give nothing up from now on",
        type(e).__name__,
        e,
      )
    return None


def _giveable(tensors, inputs, donate):
  """`inputs` (the arrays of `tensors`) made safe to give up at `donate`: an
  array that anything besides its tensor refers to (a `detach()` or `.data` the
  user kept: torchax tensors share their jax array; the same array at two
  positions), or that no tensor holds, is replaced by a copy (a transfer, no
  compilation), which is given up instead."""
  jax = _rt().jax
  own = _own_references()
  for i in donate:
    if sys.getrefcount(inputs[i]) > own or inputs[i] is tensors[i]:
      a = inputs[i]
      inputs[i] = jax.device_put(a, a.sharding, may_alias=False)


@functools.cache
def _own_references():
  """`sys.getrefcount` of an input array that nothing but its tensor refers to,
  as `_giveable` reads it (the tensor's, the list's and the call's own
  reference; measured, not assumed: interpreters count differently)."""
  tensor = _wrap(_rt().jax.device_put(np.zeros((), np.float32)))
  inputs = _arrays([tensor])
  return sys.getrefcount(inputs[0])


def _on_devices(consts):
  """A step's constants as replicated device arrays (transferred once, at the
  trace: a replayed program reuses them; host values would be sent at every
  run). With several processes each process gives its own devices the value."""
  jax = _rt().jax
  return [
    _placed(c if isinstance(c, jax.Array) else np.asarray(c), replicated_sharding(np.ndim(c)))
    for c in consts
  ]


def _lift_float_literals(jaxpr, consts):
  """The step's jaxpr with its floating-point scalar literals made constants
  (inputs of the program), and the constants' values.

  A Python float that a step passes to a torch op (Adam's bias-corrected step
  size, a learning rate a scheduler changes) is traced as a literal: baked into
  the program, its text (the program's key) would change with the value and
  every step would compile anew. torch_xla passes such scalars as device data.
  """
  literal = jax_compat.literal_type()
  jnp = _rt().jax.numpy
  lifted_vars, values = [], []

  def lift(atom):
    if not isinstance(atom, literal):
      return atom
    aval = atom.aval
    if getattr(aval, "shape", None) != () or not jnp.issubdtype(aval.dtype, jnp.inexact):
      return atom
    var = jax_compat.new_var(aval)
    lifted_vars.append(var)
    values.append(np.asarray(atom.val, dtype=aval.dtype))
    return var

  eqns = [eqn.replace(invars=[lift(a) for a in eqn.invars]) for eqn in jaxpr.eqns]
  outvars = [lift(a) for a in jaxpr.outvars]
  if not lifted_vars:
    return jaxpr, consts
  n = len(consts)  # the constants' variables are the first invars (jax_compat.close_trace)
  invars = [*jaxpr.invars[:n], *lifted_vars, *jaxpr.invars[n:]]
  jaxpr = jaxpr.replace(invars=invars, eqns=eqns, outvars=outvars)
  return jaxpr, list(consts) + values


_programs_by_structure = {}


class _Same:
  """A sub-program compared by identity (kept alive: its id is never reused)."""

  __slots__ = ("obj",)

  def __init__(self, obj):
    self.obj = obj

  def __eq__(self, other):
    return isinstance(other, _Same) and other.obj is self.obj

  def __hash__(self):
    return id(self.obj)


def _param_key(value):
  if isinstance(value, jax_compat.closed_jaxpr_types()):
    return _Same(value)
  if isinstance(value, (tuple, list)):
    return tuple(_param_key(v) for v in value)
  try:
    hash(value)
  except TypeError:
    return ("repr", repr(value))
  return value


def _structure(jaxpr):
  """A key of a jaxpr that is cheap to build (the text of a group of k steps
  costs tens of ms): its equations' primitives, operands, result types and
  parameters, sub-programs by identity. Equal structures are equal programs;
  a program seen under another structure (a sub-program traced anew) is found
  by its text (`_program_for`)."""
  literal = jax_compat.literal_type()
  ids = {}

  def atom(a):
    if isinstance(a, literal):
      return ("literal", repr(a.val), a.aval)
    return ids.setdefault(a, len(ids))

  parts = [tuple(v.aval for v in jaxpr.constvars), tuple(v.aval for v in jaxpr.invars)]
  for v in (*jaxpr.constvars, *jaxpr.invars):
    atom(v)
  for eqn in jaxpr.eqns:
    params = tuple(sorted((k, _param_key(v)) for k, v in eqn.params.items()))
    operands = tuple(atom(a) for a in eqn.invars)
    results = tuple(v.aval for v in eqn.outvars)
    for v in eqn.outvars:
      atom(v)
    parts.append((eqn.primitive, operands, results, params))
  parts.append(tuple(atom(a) for a in jaxpr.outvars))
  return tuple(parts)


def _program_for(jaxpr, st, layout):
  """The compiled program of a traced step (one per distinct jaxpr and placement)."""
  jax = _rt().jax
  from jax.sharding import PartitionSpec as P

  in_split = tuple(split for _, split in st.inputs)
  out_split = tuple(split for _, _, split in st.outputs)
  shape = (_structure(jaxpr), in_split, out_split, layout)
  program = _programs_by_structure.get(shape)
  if program is not None:
    return program
  key = (str(jaxpr), in_split, out_split, layout)
  program = _programs.get(key)
  if program is not None:
    _programs_by_structure[shape] = program
    return program
  closed = jaxpr
  body = _unpacking_body(closed, layout)
  in_specs = (P(), P(), P()) + tuple(P(REPLICA_AXIS) if s else P() for s in in_split)
  out_specs = [P(REPLICA_AXIS) if s else P() for s in out_split] + [P()]
  mapped = jax.shard_map(body, mesh=mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False)
  program = _Program(jax.jit(mapped), key, closed, in_split, out_split, layout, mapped)
  _programs[key] = program
  _programs_by_structure[shape] = program
  return program


def _run_sync_callbacks():
  while _sync_callbacks:
    _sync_callbacks.pop(0)()


def on_boundary(callback):
  _sync_callbacks.append(callback)
