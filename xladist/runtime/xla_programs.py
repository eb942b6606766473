"""torch_xla's side of replay (the contract's `ProgramReplay`, "graph" form).

torch_xla records a step lazily; replay.py names the tensors the step computed
(what it returned, the state it wrote), and this module cuts the program that
computes them (`last_program`: its parameters, the random seed among them, its
graph hash, compiled now) and runs it again on new parameters (`run_program`),
with torch_xla's cached-graph bindings (the ones its dynamo bridge uses). A
parameter is recognised by its device buffer (`buffer_ids`).

Donation (issue 41): the parameters `run_program(..., donate=...)` names at a
program's first run are compiled as buffer donors (torch_xla's
`_set_buffer_donation` on their device data, its alias-with-buffer-donor
setting on while the graph is hashed and compiled): XLA writes the results of
the same shape into their memory, so a step's new parameters and optimizer
state take the place of the old ones instead of living beside them. Every run
of that program then gives those buffers up. What might still read one is
dealt with first (`_donatable`): pending tensors are computed, and an input
whose storage another tensor shares (a `detach()` or `.data` the user kept) is
copied, the copy donated.
"""

import contextlib
import functools

from xladist.runtime.host import shares_storage


class PendingInput(RuntimeError):
  """`run_program`: an input still has a computation pending (nothing ran)."""


class GraphProgram:
  """A cut program: its graph hash (`key`, torch_xla's cache key), the
  positions of its random-seed parameters (`seed_inputs`) and, until its first
  run compiles it, the pending outputs it computes."""

  __slots__ = ("key", "seed_inputs", "uncompiled", "donate")

  def __init__(self, key, seed_inputs, uncompiled):
    self.key = key
    self.seed_inputs = seed_inputs
    self.uncompiled = uncompiled
    self.donate = ()  # the parameters every run gives up (fixed when compiled)


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
  """The program computing `outputs` (the tensors a step returned and wrote):
  those with a pending computation, each value once, are its results; compiled at
  its first `run_program` (none when cached: a capture refused before it runs
  compiles nothing). Returns (GraphProgram, None, its parameters, its results)."""
  x = _xlac()
  outputs = list(outputs)
  results, seen = [], set()
  for t, pending in zip(outputs, x._check_tensor_need_materialization(outputs)):
    uid = x._unique_id_for_ir_and_data(t)
    if pending and uid not in seen:
      seen.add(uid)
      results.append(t)
  if not results:
    return GraphProgram(None, (), None), None, [], []
  ids, params = x._get_tensors_xla_device_data_node(results)
  seed_id = x._get_seed_info_id()
  seeds = tuple(i for i, tid in enumerate(ids) if tid == seed_id)
  key = x._get_graph_hash(results)
  return GraphProgram(key, seeds, results), None, list(params), results


def prepare_program(program, consts, donate):
  """Nothing to compile ahead: the capture's own run of a cut program compiles
  it (`run_program`), with its donated parameters."""
  del program, consts, donate


def run_program(program, consts, inputs, donate, device):
  """Runs a cut program on `inputs` (its parameters, in order). `donate`: the
  positions of inputs whose buffers the caller gives up, honoured at the
  program's first run (its compilation: at the capture, where the caller has
  checked them); later runs give up the same positions, after `_donatable`
  (`device`: the device whose pending work is computed first)."""
  del consts
  x = _xlac()
  inputs = list(inputs)
  if program.uncompiled is not None:
    _compile(x, program, inputs, tuple(donate))
  elif program.donate:
    inputs = _donatable(x, inputs, program.donate, device)
  try:
    return x._run_cached_graph(program.key, inputs)
  except RuntimeError as e:
    if "pending ir" not in str(e):
      raise
    raise PendingInput(str(e)) from None


def _compile(x, program, params, donate):
  """Compiles a cut program (the step's own compilation), its `donate`
  parameters as buffer donors (the graph hash names them: the donating program
  is a program of its own)."""
  if donate:
    for i in donate:
      x._set_buffer_donation(params[i], True)
    saved = x._xla_get_enable_alias_with_buffer_donor_config()
    x._xla_set_enable_alias_with_buffer_donor_config(True)
    try:
      program.key = x._get_graph_hash(program.uncompiled)
      x._xla_warm_up_cache(program.uncompiled, [])
    finally:
      x._xla_set_enable_alias_with_buffer_donor_config(saved)
    program.donate = donate
  else:
    x._xla_warm_up_cache(program.uncompiled, [])
  program.uncompiled = None


def _donatable(x, inputs, donate, device):
  """`inputs` made safe to give up at `donate`: a pending tensor could read an
  old buffer when it is computed, so pending tensors are computed first (the
  user's lazy work between steps; none in a plain loop); an input whose storage
  another tensor shares (kept by the user) is replaced by a copy, which is
  given up instead."""
  import torch

  if any(x._check_device_tensor_need_materialization(device)):
    if any(x._check_tensor_need_materialization(inputs)):
      raise PendingInput("an input has pending ir")  # the caller's to decide (nothing ran)
    x._xla_sync_live_tensors("", [], wait=True)
  for i in donate:
    t = inputs[i]
    if shares_storage(t):
      with torch.no_grad():
        copy = t.clone()
      x._xla_sync_multi([copy], devices=[], wait=True)
      inputs[i] = copy
  return inputs


def host_work():
  """A replay's bookkeeping on host tensors: nothing to set aside on torch_xla
  (its ops on CPU tensors are torch's own)."""
  return contextlib.nullcontext()


def in_traced_step():
  """torch_xla records steps lazily: no step has a trace of its own to be inside."""
  return False
