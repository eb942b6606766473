"""ZeRO-3 inside a step: a unit's parameters are whole only while it runs (issue 60).

Under `ShardingOptions(shard="parameters")` a parameter is its rows between
steps (sharded_state.py). Inside a traced step its whole value is needed where
the model uses it, and nowhere else:

* **units.** A module that owns sharded parameters is a unit (its own
  parameters, not its children's), unless `ShardingOptions(units=...)` groups
  them: a module it names (a class of the tuple, or a module the predicate
  accepts) is one unit with every parameter below it, except those below a
  nested module it also names (FSDP's auto-wrap policies). When a unit's forward
  begins, its parameters are all-gathered from their current rows (`pre`); one
  call of a unit is a `_Call`.
* **no whole copy kept for backward.** Autograd saves the weights a
  backward formula needs (a Linear saves `weight.t()`); a saved tensor hook
  (`pack`) keeps instead the parameter's rows and how the saved tensor was made
  from the whole value (`_view_func_unsafe`), and backward gathers the rows
  again (`unpack`). The gather in backward is tied to the gradient that reaches
  the unit's output (`_on_output_grad`, `_tied`: an exact zero made from it,
  and an optimization barrier): XLA can then neither merge it with the
  forward's gather (CSE) nor compute it before backward reaches the unit, so
  the forward's whole copy dies when the unit's forward ends, and the
  backward's when the unit's backward ends. Forward gathers are tied the same
  way to the previous unit's input (one unit ahead, `prefetch`). A saved
  parameter whose unit's output got no gradient hook (an output in a container
  torch's pytree does not know, a parameter used outside any module) is gathered
  again with a barrier over its rows alone.
* **gradients.** Each parameter's whole gradient is reduce-scattered by
  `optimizer.step()` (or clipping) in packs of one unit's gradients; the
  reduce-scatter depends on nothing else, so XLA computes it when backward
  leaves the unit and frees the whole gradient there.

Only values XLA computes are affected: what the step's Python sees is what it
saw before (a sharded parameter is whole inside the step until
`optimizer.step()`, then rows until a module that holds it runs again).
"""

import torch

from xladist import _settings, sharded_state
from xladist import runtime as _runtime


def prefetch():
  """XLADIST_SHARD_PREFETCH: units gathered ahead of the one that runs (0 or 1;
  default 1, FSDP2's forward and backward prefetch)."""
  value, _ = _settings.whole_number("XLADIST_SHARD_PREFETCH", 1, "units gathered ahead")
  if value not in (0, 1):
    raise ValueError(f"XLADIST_SHARD_PREFETCH must be 0 or 1 (units gathered ahead), got {value}.")
  return value


class _Call:
  """One forward call of a unit: its parameters, the rows they were gathered
  from, and (once backward reaches its output) their whole values gathered again."""

  __slots__ = ("params", "rows", "ids", "again", "anchor", "previous", "hooked")

  def __init__(self, params, rows, anchor, previous):
    self.params = params
    self.rows = rows
    self.ids = {id(p) for p in params}
    self.again = None  # {id(param): its whole value, gathered in backward}
    self.anchor = anchor  # the tensor its forward gather waits for (its input)
    self.previous = previous  # the unit call before it in forward
    self.hooked = False  # its outputs carry the hook that gathers it again

  def row_of(self, param):
    for p, row in zip(self.params, self.rows):
      if p is param:
        return row
    return None


class _Saved:
  """What autograd keeps of a saved sharded parameter (or a view of it)."""

  __slots__ = ("call", "param", "row", "view")

  def __init__(self, call, param, row, view):
    self.call, self.param, self.row, self.view = call, param, row, view


def _anchor(tree):
  """A tensor of `tree` (a forward's arguments or outputs) to tie a gather to, or None."""
  leaves, _ = torch.utils._pytree.tree_flatten(tree)
  for t in leaves:
    if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point():
      return t
  return None


def _tied(rows, grad, barrier=True):
  """Copies of `rows` that XLA cannot compute before `grad` exists, nor take for
  the rows themselves: each plus an exact zero made from one element of `grad`
  (nan_to_num of it times 0), then an optimization barrier over them and the
  gradient. XLA:CPU removes optimization barriers before its common-subexpression
  pass (checked on torch_xla 2.9 and jax), so the barrier alone let it merge the
  backward's gather with the forward's; the zero is the dependency every
  backend keeps."""
  tied = [r.detach() for r in rows]
  if grad is not None and grad.numel():
    one = grad.detach().reshape(-1)[:1]
    zero = torch.nan_to_num(one * 0, nan=0.0, posinf=0.0, neginf=0.0)
    tied = [r + zero.to(r.dtype) for r in tied]
  else:
    tied = [r.clone() for r in tied]
  if barrier:
    _runtime.optimization_barrier_(tied + ([] if grad is None else [grad]))
  return tied


def unit_rule(units):
  """A function module -> True when `units` (ShardingOptions.units) names it as a unit."""
  if units is None:
    return lambda module: False
  if isinstance(units, tuple):  # classes (ShardingOptions made it a tuple)
    return lambda module: isinstance(module, units)
  return lambda module: bool(units(module))


class UnitGathers:
  """The units of one traced step: its forward hooks (`pre`, `post`) and saved
  tensor hooks (`saved_tensors`), installed by the step engine while it traces."""

  def __init__(self, sharded, units):
    self.sharded = sharded
    self.names = unit_rule(units)
    self.active = []  # (module, _Call or None) of each module whose forward runs now
    self._members = {}  # id(module) -> parameters of the unit it names
    self.last = None  # a tensor output of the last module that ran
    self.previous = None  # the last unit call
    self.prefetch = prefetch()
    # What the step's graphs may still hold when it ends (`close` empties them).
    self._calls, self._saved, self._hooks = [], [], []

  # -- forward ---------------------------------------------------------------------------
  def pre(self, module, args):
    params = self._gathered_by(module)
    call = None
    if params:
      rows = [self.sharded.rows[id(p)] for p in params]
      anchor = _anchor(args)
      if anchor is None:
        anchor = self.last
      call = _Call(params, rows, anchor, self.previous)
      self._calls.append(call)
      # Tied to the previous unit's input (prefetch: one unit ahead), or to this
      # unit's: XLA:CPU's scheduler otherwise computed every unit's gather when
      # the step began.
      before = self.previous.anchor if self.prefetch and self.previous is not None else None
      self.sharded.gather(params, _tied(rows, anchor if before is None else before, barrier=False))
      self.previous = call
      for p in params:
        self.sharded.unit_of.setdefault(id(p), id(module))
    self.active.append((module, call))

  def post(self, module, args, output):
    last = _anchor(output)
    if last is not None:
      self.last = last
    while self.active:
      entry, call = self.active.pop()
      if entry is module:
        break
    else:
      return
    if call is None or not torch.is_grad_enabled():
      return
    leaves, _ = torch.utils._pytree.tree_flatten(output)
    hooked = False
    for t in leaves:
      if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
        self._hooks.append(t.register_hook(self._on_output_grad(call)))
        hooked = True
    call.hooked = hooked
    if not hooked:
      call.again = {}  # nothing to tie to: `unpack` gathers with a barrier over the rows

  def _gathered_by(self, module):
    """The sharded parameters a module's forward gathers: the whole unit's when
    the rule names it, else its own; none that an enclosing unit's call gathered."""
    if self.names(module):
      members = self._members.get(id(module))
      if members is None:
        members = self._members[id(module)] = self._unit_members(module)
    else:
      members = [p for p in module._parameters.values() if p is not None]
    covered = set()
    for _, call in self.active:
      if call is not None:
        covered |= call.ids
    out, seen = [], set()
    for p in members:
      if id(p) in seen or id(p) in covered or not self.sharded.gatherable(p):
        continue
      seen.add(id(p))
      out.append(p)
    return out

  def _unit_members(self, module):
    out, stack = [], [module]
    while stack:
      m = stack.pop()
      out.extend(p for p in m._parameters.values() if p is not None)
      stack.extend(
        c for c in reversed(list(m._modules.values())) if c is not None and not self.names(c)
      )
    return out

  # -- backward ----------------------------------------------------------------------------
  def _on_output_grad(self, call):
    def hook(grad):
      # This unit's gather again, and (prefetch) the unit backward reaches next:
      # the one that ran before it in forward.
      todo = [call]
      if self.prefetch and call.previous is not None and call.previous.hooked:
        todo.append(call.previous)
      for c in todo:
        if c.again is None:
          whole = self._whole(c.params, _tied(c.rows, grad))
          c.again = {id(p): w for p, w in zip(c.params, whole)}
      return grad

    return hook

  def _whole(self, params, rows):
    """The whole values of these parameters from `rows` (tied copies of theirs)."""
    layouts = [sharded_state.layout_of(p) for p in params]
    return sharded_state.gather(rows, layouts, self.sharded.region)

  def pack(self, t):
    sharded = self.sharded
    param, view = t, None
    if id(t) not in sharded.rows:
      base = t._base
      if base is None or id(base) not in sharded.rows:
        return t
      param, view = base, t._view_func_unsafe
    if not sharded.is_gathered(param):
      return t  # rows, or written by the step's own code: kept as it is
    call = None
    for _, c in reversed(self.active):
      if c is not None and id(param) in c.ids:
        call = c
        break
    saved = _Saved(call, param, sharded.rows[id(param)], view)
    self._saved.append(saved)
    return saved

  def unpack(self, saved):
    if not isinstance(saved, _Saved):
      return saved
    if saved.row is None:
      raise RuntimeError(
        "backward() of a graph made inside strategy.run, after the step ended, under "
        "ShardingOptions(shard='parameters'): the sharded parameters it used are rows "
        "again. Call backward() inside the step that ran the forward."
      )
    call, param = saved.call, saved.param
    whole = None
    same = call is not None and call.row_of(param) is saved.row
    if same and call.again:
      whole = call.again.get(id(param))
    if whole is None:
      whole = self._whole([param], _tied([saved.row], None))[0]
      if same and call.again is not None:
        call.again[id(param)] = whole
    return whole if saved.view is None else saved.view(whole)

  def close(self):
    """Drops every tensor of the step it holds (the step has ended)."""
    self.active, self._members = [], {}
    self.last = self.previous = None
    # Graphs and outputs the step's code kept must not keep the step's values: a
    # later sync would compute them from buffers the next step has given up.
    for hook in self._hooks:
      hook.remove()
    for call in self._calls:
      call.params, call.rows, call.again, call.anchor, call.previous = [], [], {}, None, None
    for saved in self._saved:
      saved.call = saved.param = saved.row = saved.view = None
    self._calls, self._saved, self._hooks = [], [], []

  def saved_tensors(self):
    return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
