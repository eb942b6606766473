"""Sharded training state (ZeRO 1-3): where each replica's 1/N lives, and how a step uses it.

A tensor that a strategy's `ShardingOptions` shards is kept between steps as
its *rows*: the tensor flattened, padded with zeros to N*k elements and viewed
as (N, k), split over the replica axis (row r on replica r's device), the
layout of `ReplicaCopies` and of PerReplica values. Any shape shards evenly;
entering a step gives each replica its row (k,) with no collective.

Inside a traced step (docs/architecture.md, "Sharded state"):

* optimizer state (every level): `optimizer.step()` runs on each replica's
  rows. Before it, a sharded parameter's `.data` and `.grad` become the rows
  of its value and of its aggregated gradient (`ShardedStep.to_shards`); the
  optimizer makes its state from them, so the state is rows too; after it,
  the new rows are gathered into the full parameter (`from_shards`) under
  "optimizer_state" and "gradients", or kept as they are under "parameters".
* gradients ("gradients", "parameters"): the aggregated gradient is
  reduce-scattered: each replica keeps the rows of its share.
* parameters ("parameters"): the parameter itself is rows between steps; inside
  a step each unit (a module that holds some) gathers its rows when it runs and
  again in its backward (sharded_units.py), so whole copies live only while
  their unit computes. The step's own code sees whole parameters too: a gather
  of every sharded parameter when the step begins, which XLA drops where nothing
  uses it.

`state_dict()` of a module or an optimizer returns whole tensors, and
`load_state_dict` takes whole tensors (`watch_module`, `watch_optimizer`).
"""

import math

import torch

from xladist import _settings, collectives
from xladist import runtime as _runtime

_LAYOUT = "_xladist_rows"  # attribute of a sharded parameter: its Layout
# The sharded state's collectives (gathers, reduce-scatters) work on packs of at
# most this many whole-tensor bytes, a bigger tensor alone: one collective for
# all of a model's tensors made XLA:CPU 4.7x slower and 2.4x bigger in memory
# than one per tensor (docs/performance.md); small tensors still share one.
# XLADIST_SHARD_PACK_BYTES overrides it (read when a step packs).
PACK_BYTES = 4 << 20


def pack_bytes():
  return _settings.whole_number("XLADIST_SHARD_PACK_BYTES", PACK_BYTES, "bytes")[0]


class Layout:
  """How one parameter (and the optimizer state made from it) is split.

  `shape`/`numel`: the full tensor's; `n`: the replicas; `k`: elements per
  row (ceil(numel / n)); `params`: True when the parameter itself is kept as
  rows between steps ("parameters"), False when only its optimizer state is.
  """

  __slots__ = ("shape", "numel", "n", "k", "params")

  def __init__(self, shape, n, params):
    self.shape = torch.Size(shape)
    self.numel = math.prod(self.shape)
    self.n = n
    self.k = -(-self.numel // n)
    self.params = params

  def to_rows(self, full):
    """(n, k) rows of a full tensor (any device; zeros pad the last row)."""
    flat = full.reshape(-1)
    pad = self.n * self.k - self.numel
    if pad:
      flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(self.n, self.k)

  def from_rows(self, rows):
    """The full tensor of (n, k) rows."""
    return rows.reshape(-1)[: self.numel].view(self.shape)

  def own_rows(self, full_local, replica_id):
    """This replica's row (k,) of a full tensor that every replica holds (in a step)."""
    return collectives.select_own(self.to_rows(full_local), replica_id)

  def local_row(self, local, replica_id):
    """A local view entered from a global tensor -> this replica's row (k,):
    rows enter as (1, k); a full tensor (state loaded as whole tensors) is cut."""
    if tuple(local.shape) == (1, self.k) and self.shape != local.shape:
      return local.squeeze(0)
    return self.own_rows(local, replica_id)

  def is_row(self, t):
    """True for one replica's row (k,) of the tensor (not the whole of a (k,) tensor)."""
    return tuple(t.shape) == (self.k,) and self.shape != t.shape

  def is_rows(self, t):
    return tuple(t.shape) == (self.n, self.k) and (self.shape != t.shape or self.n == 1)


def layout_of(t):
  """The Layout of a sharded parameter, else None."""
  return getattr(t, _LAYOUT, None)


def rows_layout(p):
  """The Layout of a parameter that holds its rows now (between steps under
  "parameters"), else None."""
  layout = layout_of(p) if p is not None else None
  if layout is not None and layout.params and layout.is_rows(p):
    return layout
  return None


def state_layout(p, v):
  """The Layout of `v`, an optimizer state tensor of parameter `p`: a sharded
  parameter's non-scalar state is sharded with it; else None."""
  layout = layout_of(p)
  return layout if layout is not None and v.dim() > 0 else None


def full_shape(t):
  """The shape of a tensor's whole value (a parameter kept as rows: its full shape)."""
  layout = rows_layout(t)
  return tuple(t.shape if layout is None else layout.shape)


def set_layout(t, layout):
  setattr(t, _LAYOUT, layout)


def choose(t, options, num_replicas):
  """The Layout a new variable gets under `options` (None: it stays mirrored).

  Parameters only: buffers (batch-norm statistics) stay mirrored; a tensor below
  `min_shard_bytes`, a scalar and a strategy of one replica never shard.
  """
  if options is None or num_replicas < 2 or not isinstance(t, torch.nn.Parameter):
    return None
  if layout_of(t) is not None:  # a tied weight, met again in another module
    return layout_of(t)
  if not options.splits(t):
    return None
  return Layout(t.shape, num_replicas, options.shards("parameters"))


def place_rows(t, layout):
  """The rows of `t` (a host or device tensor), split over the replicas."""
  rows = layout.to_rows(t.detach())
  if rows.device.type == "cpu":
    return _runtime.place_split([rows.contiguous()])[0]
  return _runtime.place_split(rows)


def to_global_rows(local_row, layout):
  """Leaves the region: each replica's row (k,) -> the (n, k) global rows."""
  return _runtime.to_global(
    local_row.unsqueeze(0), _runtime.sharding(2, layout.n), torch.Size((layout.n, layout.k))
  )


_GRADS = "_xladist_kept_grads"  # a "parameters" variable's unconsumed gradients


def keep_grads(t, local_grad, num_replicas):
  """Gradients of a "parameters" variable that no optimizer consumed in the step
  (accumulated over several `run` calls): each replica's partial sum stays its
  own, in a (n, *shape) tensor split over the replicas, until a step enters it
  again; `local_grad` None drops it."""
  if local_grad is None:
    if hasattr(t, _GRADS):
      delattr(t, _GRADS)
    return
  shape = (num_replicas,) + tuple(local_grad.shape)
  stacked = _runtime.to_global(
    local_grad.unsqueeze(0), _runtime.sharding(len(shape), num_replicas), torch.Size(shape)
  )
  setattr(t, _GRADS, stacked)


def kept_grads(t):
  return getattr(t, _GRADS, None)


def grad_between_steps(t):
  """Where a variable's gradient lives between steps (replay's GRAD slot): its
  `.grad`, or the kept gradients of a parameter kept as rows."""
  layout = layout_of(t)
  if layout is not None and layout.params:
    return getattr(t, _GRADS, None)
  return t.grad


def set_grad_between_steps(t, value):
  layout = layout_of(t)
  if layout is not None and layout.params:
    if value is None:
      keep_grads(t, None, layout.n)
    else:
      setattr(t, _GRADS, value)
  else:
    t.grad = value


def gather(rows_list, layouts, region):
  """Full tensors of each replica's rows (k,): all-gathers of packs of at most
  PACK_BYTES (a bigger tensor alone)."""
  rows_list = [r.detach() for r in rows_list]
  stacked = collectives.gather_stacked_many(
    rows_list,
    region.replica_id,
    region.num_replicas,
    packs=collectives.pack_by_bytes(rows_list, pack_bytes() // region.num_replicas),
  )
  return [layout.from_rows(s) for s, layout in zip(stacked, layouts)]


class ShardedStep:
  """The sharded parameters of one traced step (`StepWrites.sharded`)."""

  __slots__ = (
    "region",
    "rows",
    "full_ids",
    "dirty",
    "_gathered",
    "_grads",
    "_grad_rows",
    "stepping",
    "unit_of",
  )

  def __init__(self, region):
    self.region = region
    self.rows = {}  # id(param) -> its current row (k,) ("parameters")
    self.full_ids = {}  # id(param) -> value id of the full copy it holds
    self.dirty = set()  # ids of params whose rows the step changed
    self._gathered = []
    self._grads = {}  # id(param) -> its full aggregated gradient, during optimizer.step()
    self.stepping = {}  # id(optimizer) -> the parameters `to_shards` changed for it
    self._grad_rows = {}  # id(param) -> this replica's row of its reduce-scattered gradient
    self.unit_of = {}  # id(param) -> the unit that first gathered it (sharded_units.py)

  # -- "parameters": rows on entry, full copies while the step runs ---------------------
  def enter(self, t, local, layout):
    """`local`: the entered view of the parameter's global tensor."""
    self.rows[id(t)] = layout.local_row(local, self.region.replica_id)
    self._gathered.append(t)

  def gather_entered(self):
    """Every parameter entered as rows gets its full value (gathers per pack)."""
    todo, self._gathered = self._gathered, []
    self.gather(todo)

  def gatherable(self, p):
    """True for a parameter kept as rows whose whole value a unit may gather:
    the step's code has not written it (it holds a gather of its rows, or its
    rows after `optimizer.step()`)."""
    layout = layout_of(p)
    if id(p) not in self.rows or layout is None or not layout.params:
      return False
    return self.is_gathered(p) or layout.is_row(p)

  def is_gathered(self, p):
    """True while `p` holds a whole value gathered from its rows by this step."""
    return _runtime.value_id(p) == self.full_ids.get(id(p))

  def gather(self, params, rows=None):
    """These parameters get the whole value of their current rows (`rows`:
    copies of them to gather instead, as `sharded_units` ties them)."""
    if not params:
      return
    if rows is None:
      rows = [self.rows[id(p)] for p in params]
    full = gather(rows, [layout_of(p) for p in params], self.region)
    for p, value in zip(params, full):
      p.data = value
      self.full_ids[id(p)] = _runtime.value_id(p)

  def exit_value(self, t, data, layout):
    """The global value a "parameters" variable leaves with (`data`: what it entered from)."""
    vid = _runtime.value_id(t)
    if vid == self.full_ids.get(id(t)):
      if id(t) not in self.dirty:
        return data
      row = self.rows[id(t)]
    elif tuple(t.shape) == (layout.k,):
      row = t.data
    else:  # written as a whole by the step's own code
      row = layout.own_rows(t.data, self.region.replica_id)
    return to_global_rows(row, layout)

  # -- optimizer.step() on each replica's rows ---------------------------------------------
  def reduce_scatter(self, params, op, keep_grads=False):
    """Each replica's row of the aggregate (`op`: SUM, MEAN, or None: its own
    gradient's row) of these parameters' gradients: one reduce-scatter per
    pack (`pack_bytes`), with no whole aggregated gradient; a parameter done earlier in the
    step is not done again. Their `.grad` is then None until `to_shards` sets
    the rows, or (`keep_grads`: torch's clipping reads `.grad` again to scale
    it) stays the replica's own gradient."""
    params = [p for p in params if p.grad is not None and id(p) not in self._grad_rows]
    if not params:
      return
    layouts = [layout_of(p) for p in params]
    if op is None:
      rows = [lay.own_rows(p.grad, self.region.replica_id) for p, lay in zip(params, layouts)]
    else:
      stacked = [lay.to_rows(p.grad) for p, lay in zip(params, layouts)]
      rows = collectives.reduce_scatter(
        op, stacked, self.region.num_replicas, packs=self._packs(params, stacked)
      )
    for p, row in zip(params, rows):
      self._grad_rows[id(p)] = row
      if not keep_grads:
        p.grad = None

  def _packs(self, params, tensors):
    """Packs of at most `pack_bytes()` for the reduce-scatter of these gradients,
    none across units ("parameters": a pack of two units' gradients would keep
    the first's whole gradient until backward reaches the second)."""
    groups = {}
    for i, p in enumerate(params):
      groups.setdefault(self.unit_of.get(id(p)), []).append(i)
    packs = []
    for indices in groups.values():
      sub = collectives.pack_by_bytes([tensors[i] for i in indices], pack_bytes())
      packs.extend([indices[j] for j in pack] for pack in sub)
    return packs

  def grad_rows_of(self, params):
    return {id(p): self._grad_rows[id(p)] for p in params if id(p) in self._grad_rows}

  def grad_row_ids(self):
    return {id(row) for row in self._grad_rows.values()}

  def to_shards(self, params):
    """Each sharded parameter's `.data` and `.grad` become their rows (before
    `optimizer.step()`): the rows of its aggregated gradient, reduce-scattered
    (`reduce_scatter`) or cut from the all-reduced whole. Returns the parameters
    it changed."""
    rid = self.region.replica_id
    done = []
    for p in params:
      layout = layout_of(p)
      if layout is None:
        continue
      grad = p.grad
      scattered = self._grad_rows.pop(id(p), None)
      if layout.params and _runtime.value_id(p) == self.full_ids.get(id(p)):
        row = self.rows[id(p)]
      elif layout.is_row(p):
        row = p.data
      else:
        row = layout.own_rows(p.data, rid)
      if scattered is not None:
        g = scattered
      elif tuple(grad.shape) == (layout.k,):
        g = grad
      else:
        g = layout.own_rows(grad, rid)
      # After the update `.grad` is the whole aggregate where one exists (an
      # all-reduce), else None (reduce-scattered: only rows of it exist).
      self._grads[id(p)] = None if scattered is not None else grad
      p.grad = None
      p.data = row
      p.grad = g
      done.append(p)
    return done

  def from_shards(self, params):
    """After `optimizer.step()`: "parameters" keeps the new rows (gathered again
    by the next unit that holds them, sharded_units.py); the other levels gather
    the full values."""
    mirrored, grad_of = [], {}
    for p in params:
      layout = layout_of(p)
      grad = self._grads.pop(id(p))
      self.rows[id(p)] = p.data
      if layout.params:
        self.dirty.add(id(p))
      else:
        grad_of[id(p)] = grad
        mirrored.append(p)
    for p in mirrored:
      p.grad = None
    self.gather(mirrored)
    for p in mirrored:
      del self.rows[id(p)]
      p.grad = grad_of[id(p)]


def refuse_optimizer(optimizer):
  """Optimizers whose update needs whole tensors cannot run on rows."""
  names = {k.__name__ for k in type(optimizer).__mro__}
  for name in ("Adafactor", "Muon", "LBFGS"):
    if name in names:
      raise TypeError(
        f"optimizer.step() in strategy.run: torch.optim.{name} needs whole tensors "
        "(its update is not elementwise), and this strategy shards the optimizer state "
        "(experimental_sharding=ShardingOptions(...)). Use an elementwise optimizer "
        "(AdamW, Adam, SGD, ...), or a strategy without experimental_sharding."
      )


# -- state_dict / load_state_dict: whole tensors -----------------------------------------------
_ROWS_OF = "_xladist_rows_of"  # attribute of a whole tensor made from rows: (rows, layout)


def whole_of(rows, layout):
  """The whole tensor of `rows`, remembering them (a sharded checkpoint writes
  the rows themselves, each device its own: `rows_of`)."""
  whole = layout.from_rows(rows)
  setattr(whole, _ROWS_OF, (rows, layout))
  return whole


def detach(t):
  """`t.detach()`, still known as a whole view of its rows (`rows_of`)."""
  out = t.detach()
  found = rows_of(t)
  if found is not None:
    setattr(out, _ROWS_OF, found)
  return out


def rows_of(t):
  """(rows, Layout) when `t` is a state dict's whole view of rows, else None."""
  return getattr(t, _ROWS_OF, None)


def _module_state_dict_hook(module, state_dict, prefix, local_metadata):
  for name, p in module._parameters.items():
    layout, key = rows_layout(p), prefix + name
    if layout is not None and key in state_dict:
      state_dict[key] = whole_of(state_dict[key], layout)
  return state_dict


def _module_load_pre_hook(module, state_dict, prefix, *args):
  for name, p in module._parameters.items():
    layout, key = rows_layout(p), prefix + name
    if layout is None or key not in state_dict:
      continue
    value = state_dict[key]
    if tuple(value.shape) == tuple(layout.shape):
      with torch.no_grad():
        p.data = place_rows(value.to(p.dtype), layout)
      state_dict[key] = p.data  # copy_ of a tensor to itself does nothing


def _refuse_forward_outside_step(module, args):
  for name, p in module._parameters.items():
    layout = rows_layout(p)
    if layout is not None:
      raise RuntimeError(
        f"{type(module).__name__}.forward outside strategy.run: its parameter {name!r} is "
        "sharded over the replicas (experimental_sharding=ShardingOptions(shard="
        "'parameters')): between steps each device holds only its rows, shape "
        f"{tuple(p.shape)} for the full {tuple(layout.shape)}. Run the model inside "
        "strategy.run (an evaluation step), or read whole tensors with "
        "model.state_dict() (e.g. load them into a copy of the model on the CPU)."
      )


def watch_module(module):
  """A module with parameters kept as rows: whole tensors in and out of its
  state dicts; its forward outside a step is refused with an error that says why."""
  if getattr(module, "_xladist_rows_hooks", False):
    return
  module._register_state_dict_hook(_module_state_dict_hook)
  module._register_load_state_dict_pre_hook(_module_load_pre_hook, with_module=True)
  module.register_forward_pre_hook(_refuse_forward_outside_step)
  module._xladist_rows_hooks = True


def _params_in_order(optimizer):
  return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_state_dict_hook(optimizer, state_dict):
  for index, p in enumerate(_params_in_order(optimizer)):
    layout = layout_of(p)
    state = state_dict["state"].get(index)
    if layout is None or state is None:
      continue
    # torch packs the live per-parameter dicts: the whole tensors go in a copy.
    state = state_dict["state"][index] = dict(state)
    for key, v in list(state.items()):
      if isinstance(v, torch.Tensor) and v.dim() > 0 and layout.is_rows(v):
        state[key] = whole_of(v, layout)
  return state_dict


def _optimizer_load_post_hook(optimizer):
  for p in _params_in_order(optimizer):
    layout = layout_of(p)
    state = optimizer.state.get(p)
    if layout is None or not state:
      continue
    for key, v in list(state.items()):
      if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(layout.shape):
        state[key] = place_rows(v, layout)


def watch_optimizer(optimizer):
  """An optimizer of a sharding strategy: whole tensors in and out of its state dicts."""
  if getattr(optimizer, "_xladist_rows_hooks", False):
    return
  optimizer.register_state_dict_post_hook(_optimizer_state_dict_hook)
  optimizer.register_load_state_dict_post_hook(_optimizer_load_post_hook)
  optimizer._xladist_rows_hooks = True


# -- what each device holds ----------------------------------------------------------------------
def state_bytes(params, optimizers):
  """{"parameters", "gradients", "optimizer_state"}: bytes on the fullest device."""
  held = _runtime.held_bytes
  seen = set()
  out = {"parameters": 0, "gradients": 0, "optimizer_state": 0}
  for p in params:
    if id(p) in seen:
      continue
    seen.add(id(p))
    out["parameters"] += held(p)
    if p.grad is not None:
      out["gradients"] += held(p.grad)
  for optimizer in optimizers:
    for state in optimizer.state.values():
      for v in state.values():
        if isinstance(v, torch.Tensor):
          out["optimizer_state"] += held(v) if _runtime.is_device_tensor(v) else v.nbytes
  return out
