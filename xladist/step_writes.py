"""The write ledger of one traced step: what `run` swapped into its region,
and which variables the step wrote.

`VariableStore.enter` records each variable it swaps for its local view here,
with the id of the runtime's value behind it (`runtime.value_id`, torch_xla's
IR value); `VariableStore.exit` asks which ones the step wrote (`written`),
and the APIs that combine the replicas' values (`Variable.assign*`, update
contexts, `optimizer.step()`, merge_call) mark their writes as combined
(`sanction`, `updating`, `combining`). One ledger per traced step: the step's
region holds it (`region.step`, `VariableStore.active_step`).
"""

import torch

from xladist import runtime as _runtime
from xladist.sharded_state import ShardedStep


class StepWrites:
  """What one `run` swapped into its region, and what the step wrote.

  A write is found by comparing a variable's IR value on exit with the one it
  had when it was entered or last written through an API that combines the
  replicas' values (`sanction`). The IR node the comparison refers to is kept
  alive by an alias ("pin"): a write such as `p.copy_(torch.ones_like(p))`
  frees the old node, and the new one can be allocated at the same address,
  which made the write invisible (checked on torch_xla 2.9).
  """

  __slots__ = (
    "region",
    "variables",
    "optimizers",
    "stepped",
    "variable_ids",
    "_ids",
    "_pins",
    "aggregated",
    "_sanctioned",
    "created",
    "optimizer_clean",
    "aggregated_grads",
    "sharded",
  )

  def __init__(self, region):
    self.region = region
    self.variables = []  # (tensor, global data, global grad, policy)
    self.optimizers = []  # (optimizer, state snapshot)
    self.stepped = set()  # ids of parameters an optimizer stepped
    # id(parameter) -> its gradient aggregated across replicas in this step
    # (by gradient clipping before optimizer.step(); see _step/grad_clip.py).
    self.aggregated_grads = {}
    self.variable_ids = None
    self._ids = {}  # id(tensor) -> IR id when entered
    self._pins = []
    self.aggregated = []  # mirrored variables with an aggregation
    self._sanctioned = {}  # id(tensor) -> IR id after its last combined write
    self.created = set()  # ids of variables made inside the step
    self.optimizer_clean = {}  # id(optimizer) -> aggregated params it may sanction
    self.sharded = ShardedStep(region)  # sharded parameters (sharded_state.py)

  def watch(self, t):
    self._pins.append(torch.ops.aten.alias(t.data))
    self._ids[id(t)] = _runtime.value_id(t)
    self.variable_ids = None

  def written(self, t):
    return id(t) in self.created or _runtime.value_id(t) != self._ids[id(t)]

  def is_variable(self, tensor):
    if self.variable_ids is None:
      self.variable_ids = {id(t) for t, *_ in self.variables}
    return id(tensor) in self.variable_ids

  # -- writes that combine the replicas' values ----------------------------------
  def _expected(self, t):
    return self._sanctioned.get(id(t), self._ids[id(t)])

  def clean(self, tensors):
    """Which of `tensors` have no write since entry or their last combined write."""
    return [t for t in tensors if _runtime.value_id(t) == self._expected(t)]

  def sanction(self, tensors):
    """Records the current values of `tensors` as written by a combining API."""
    for t in tensors:
      self._pins.append(torch.ops.aten.alias(t.data))
      self._sanctioned[id(t)] = _runtime.value_id(t)

  def is_aggregated(self, t):
    return any(a is t for a in self.aggregated)

  def sanctioned(self, t):
    return id(t) in self._sanctioned and _runtime.value_id(t) == self._sanctioned[id(t)]

  def updating(self, fn):
    """Calls `fn()` in an update context: what it writes is each replica's own
    component, as written (TF's extended.update)."""
    before = [(t, _runtime.value_id(t)) for t in self.aggregated]
    result = fn()
    self.sanction([t for t, ir in before if _runtime.value_id(t) != ir])
    return result

  def combining(self, fn):
    """Calls `fn()`; mirrored variables with an aggregation that it writes, and
    that had no other write before, count as written by a combining API."""
    if not self.aggregated:
      return fn()
    clean = self.clean(self.aggregated)
    result = fn()
    self.sanction([t for t in clean if _runtime.value_id(t) != self._expected(t)])
    return result
