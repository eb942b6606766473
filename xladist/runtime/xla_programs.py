"""torch_xla's side of replay (the contract's `ProgramReplay`, "graph" form).

torch_xla records a step lazily; replay.py names the tensors the step computed
(what it returned, the state it wrote), and this module cuts the program that
computes them (`last_program`: its parameters, the random seed among them, its
graph hash, compiled now) and runs it again on new parameters (`run_program`),
with torch_xla's cached-graph bindings (the ones its dynamo bridge uses). A
parameter is recognised by its device buffer (`buffer_ids`).
"""

import functools


class PendingInput(RuntimeError):
  """`run_program`: an input still has a computation pending (nothing ran)."""


class GraphProgram:
  """A cut program: its graph hash (`key`, torch_xla's cache key), the
  positions of its random-seed parameters (`seed_inputs`) and, until its first
  run compiles it, the pending outputs it computes."""

  __slots__ = ("key", "seed_inputs", "uncompiled")

  def __init__(self, key, seed_inputs, uncompiled):
    self.key = key
    self.seed_inputs = seed_inputs
    self.uncompiled = uncompiled


@functools.cache
def _xlac():
  import torch_xla

  return torch_xla._XLAC


def buffer_ids(tensors, wait):
  """The device-buffer handle of each tensor's value, None where a computation
  is pending. Before reading handles it calls `wait()` (runtime/xla.py's: the
  executions in flight finish; a buffer still being computed has no handle yet,
  and reading one crashes torch_xla 2.9); with every tensor pending (a traced
  step's outputs) there is nothing to read and nothing to wait for."""
  tensors = list(tensors)
  if not tensors:
    return []
  x = _xlac()
  pending = x._check_tensor_need_materialization(tensors)
  ready = [t for t, p in zip(tensors, pending) if not p]
  if ready:
    wait()
  handles = iter(x._get_tensors_handle(ready) if ready else ())
  return [None if p else next(handles) for p in pending]


def last_program(outputs=None):
  """The program computing `outputs` (pending tensors, each once), compiled at
  its first `run_program` (none when cached: a capture refused before it runs
  compiles nothing). Returns (GraphProgram, None, its parameters, outputs)."""
  x = _xlac()
  outputs = list(outputs)
  ids, params = x._get_tensors_xla_device_data_node(outputs)
  seed_id = x._get_seed_info_id()
  seeds = tuple(i for i, tid in enumerate(ids) if tid == seed_id)
  key = x._get_graph_hash(outputs)
  return GraphProgram(key, seeds, outputs), None, list(params), outputs


def run_program(program, consts, inputs):
  """Runs a cut program on `inputs` (its parameters, in order)."""
  del consts
  x = _xlac()
  if program.uncompiled is not None:
    x._xla_warm_up_cache(program.uncompiled, [])  # the step's own compilation
    program.uncompiled = None
  try:
    return x._run_cached_graph(program.key, list(inputs))
  except RuntimeError as e:
    if "pending ir" not in str(e):
      raise
    raise PendingInput(str(e)) from None


def run_program_steps(program, consts, plan, fixed, carried, rows):
  """Several steps of a cut program are themselves traced as one group and
  captured (replay.py `_group_steps`): no scan here."""
  raise NotImplementedError(
    "xladist: torch_xla replays experimental_run_steps' steps as a captured group, not a scan"
  )


def with_scalars(consts, vectors):
  """torch_xla feeds a program's scalars as parameters: no constants to repack."""
  raise NotImplementedError("xladist: torch_xla feeds a program's scalars as parameters")


def in_traced_step():
  """torch_xla records steps lazily: no step has a trace of its own to be inside."""
  return False
