"""What the jax runtime takes from JAX beyond its public API, in one place.

The jax runtime builds a step's program as a jaxpr (jax_programs.py,
`traced_step`). Whatever has a public form comes from it: `jax.extend.core`
(`ClosedJaxpr`, `Jaxpr`, `Literal`, `Var`, `set_current_trace`), `jax.core`
(`ShapedArray`, `Tracer`, `eval_jaxpr`), `jax.jit`, `jax.shard_map`. The rest
lives in `jax._src`, which moves with every release; each use is a function
here, with a branch where the supported versions differ:

* the dynamic jaxpr trace that a step runs in (`step_trace_base`,
  `new_trace`, `close_trace`) and the replica axis it binds (`bind_axis`):
  `jax.make_jaxpr` traces a function of its arguments, while a step meets its
  inputs as it runs (every global array it touches becomes one, `to_local`).
  The versions differ here: a closed trace's constants are its constvars in
  jax 0.10 and its first invars in 0.12 (where `Jaxpr` absorbed
  `ClosedJaxpr`); `close_trace` gives the second form for both;
* the current source location of a traced value (`source_info`);
* whether jax's backends have started (`backends_started`), and the state of
  `jax.distributed` (`distributed_state`).

Supported: jax 0.10.2 to 0.12.0.1 (`SUPPORTED`); `check_version` refuses
others by name when the runtime starts. Tested in both of `make test-jax`'s
environments (tests/runtime_jax/test_jax_compat.py).
"""

import importlib
import re

SUPPORTED = ((0, 10, 2), (0, 13))  # [lowest, first unsupported)
SUPPORTED_TEXT = "jax>=0.10.2,<0.13"


def version(jax):
  """jax's version as a tuple of ints ("0.12.0.1" -> (0, 12, 0, 1))."""
  parts = []
  for p in jax.__version__.split("+")[0].split("."):
    digits = re.match(r"\d*", p).group()
    if not digits:
      break
    parts.append(int(digits))
    if digits != p:  # "0rc1": a pre-release of what it names
      break
  return tuple(parts)


def check_version(jax):
  """Raises RuntimeError, naming the supported range, for a jax outside it."""
  low, high = SUPPORTED
  if not low <= version(jax) < high:
    raise RuntimeError(
      f"xladist: the jax runtime supports {SUPPORTED_TEXT}; this environment has jax "
      f"{jax.__version__}. Install a supported one (`pip install 'xladist[jax]'`), or "
      "use the torch_xla runtime (XLADIST_BACKEND=torch_xla)."
    )


def _private(name):
  return importlib.import_module(f"jax._src.{name}")


# -- public forms ----------------------------------------------------------------------


def closed_jaxpr_types():
  """(Jaxpr, ClosedJaxpr): the types of sub-programs in equation parameters.

  jax 0.12 moved ClosedJaxpr out of `jax._src.core`; `jax.extend.core` has
  both in every supported version."""
  from jax.extend import core

  return (core.Jaxpr, core.ClosedJaxpr)


def literal_type():
  from jax.extend import core

  return core.Literal


def new_var(aval):
  from jax.extend import core

  return core.Var(aval)


def shaped_array(shape, dtype):
  import jax

  return jax.core.ShapedArray(tuple(shape), dtype)


def eval_jaxpr(jaxpr, *args):
  """Evaluates a jaxpr without constvars (`close_trace`'s form) on `args`."""
  import jax

  return jax.core.eval_jaxpr(jaxpr, [], *args)


# -- jax._src --------------------------------------------------------------------------


def backends_started():
  """Whether jax's backends have started (settings such as the CPU device count
  can no longer change)."""
  return _private("xla_bridge").backends_are_initialized()


def distributed_state():
  """`jax.distributed`'s global state (its client, service, process count)."""
  return _private("distributed").global_state


def source_info():
  """The current source location, for the equations a trace records."""
  return _private("source_info_util").current()


def step_trace_base():
  """The class a step's trace subclasses: jax's dynamic jaxpr trace. Its
  `new_const` (aliased `pure` and `lift`) types the concrete values that a
  traced function closes over."""
  return _private("interpreters.partial_eval").DynamicJaxprTrace


def new_trace(trace_class):
  """A new top-level trace of `trace_class` (no debug info, no parent)."""
  return trace_class(None)


def current_trace(trace):
  """Context: `trace` is the one that jax operations record into."""
  from jax.extend import core

  return core.set_current_trace(trace)


def bind_axis(name, size):
  """Context: the named axis `name` of `size` devices is bound (collectives over
  it trace), as inside `shard_map`."""
  return _private("core").extend_axis_env_nd([(name, size)])


def close_trace(trace, out_tracers):
  """(jaxpr, consts): the program recorded by `trace`, returning `out_tracers`,
  in one form for every jax: no constvars, the constants' variables first
  among its invars (then the trace's own inputs); run it with
  `eval_jaxpr(jaxpr, *consts, *args)`."""
  src = source_info()
  tracers = [trace.to_jaxpr_tracer(t, src) for t in out_tracers]
  jaxpr, consts = trace.frame.to_jaxpr(trace, tracers, None, src)
  return _consts_first_among_invars(jaxpr, consts), consts


def _consts_first_among_invars(jaxpr, consts):
  """jax 0.10 returns the constants' variables as the jaxpr's constvars; jax
  0.12 (where a Jaxpr's constvars are those with values attached, the old
  ClosedJaxpr) returns none and puts them first among its invars."""
  if len(jaxpr.constvars) == len(consts) and consts:  # jax 0.10
    return jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
  if not jaxpr.constvars and len(jaxpr.invars) >= len(consts):  # jax 0.12 (or no constants)
    return jaxpr
  raise NotImplementedError(
    f"xladist: jax {_jax_version_text()} closed a trace into a jaxpr with "
    f"{len(jaxpr.constvars)} constvars for {len(consts)} constants: a form "
    f"jax_compat.py does not know (supported: {SUPPORTED_TEXT})."
  )


def _jax_version_text():
  import jax

  return jax.__version__
