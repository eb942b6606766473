"""torch_xla's own collective and sync idioms inside `strategy.run`.

Code ported from torch_xla's one-process-per-device model calls
`xm.all_reduce(xm.REDUCE_SUM, t)`, `xm.all_gather`, `xm.reduce_scatter`,
`xm.optimizer_step(opt)` or `torch_xla.sync()` inside its step. In xladist's
SPMD program these would be wrong without a word: the program has one replica
in torch_xla's sense, so `xm.all_reduce` returns each replica's own value, and
a sync refused inside the trace leaves every tensor it touched without data.
While a step is traced these names are replaced (and put back when the trace
ends, also on errors):

* `xm.all_reduce`, `xm.all_gather`, `xm.reduce_scatter` compute the
  cross-replica result with xladist's collectives (as `ReplicaContext.all_reduce`
  / `all_gather`); `xm.optimizer_step(opt)` is `opt.step()` (which aggregates
  the gradients already);
* the other collectives (`all_to_all`, `collective_permute`, `send`, `recv`,
  `mesh_reduce`, the coalesced and bucketized forms, `reduce_gradients`) raise
  an error naming xladist's equivalent;
* torch_xla's sync bindings (`torch_xla.sync`, `xm.mark_step`,
  `xm.wait_device_ops`, ...) raise the host-read error before torch_xla starts;
* `xr.world_size()` is the number of replicas in sync (what it means in
  torch_xla's one-process-per-device model; it would say 1 here), and the
  ordinals (`xr.global_ordinal`, `xr.local_ordinal`, `xm.get_local_ordinal`,
  `xm.is_master_ordinal`), which differ per replica, raise an error naming
  `replica_id_in_sync_group`.

The raw collective bindings are guarded too, for code that imported the
functions before the step (`from torch_xla.core.xla_model import all_reduce`).

This is the torch_xla runtime's `foreign_idioms` (runtime/contract.py): the step
engine hands over xladist's meaning of each idiom (`handlers`: the current
replica context, how a replica picks its own block, the reduce ops), and this
module knows torch_xla's names and signatures.
"""

import contextlib
import importlib

import torch

_handlers = {}  # the step engine's, while a step is traced (`foreign_idioms`)

_RAISING_BINDINGS = (
  "_xla_all_reduce",
  "_xla_all_reduce_inplace",
  "_xla_all_gather",
  "_xla_all_gather_out",
  "_xla_all_gather_coalesced",
  "_xla_all_gather_coalesced_out",
  "_xla_reduce_scatter",
  "_xla_reduce_scatter_out",
  "_xla_reduce_scatter_coalesced",
  "_xla_reduce_scatter_coalesced_out",
  "_xla_all_to_all",
  "_xla_collective_permute",
  "_xla_send",
  "_xla_recv",
)
_SYNC_BINDINGS = (
  "_xla_step_marker",
  "_xla_sync_multi",
  "_xla_sync_live_tensors",
  "_xla_wait_device_ops",
  "_xla_get_cpu_tensors",
)
_UNSUPPORTED = (
  "all_to_all",
  "collective_permute",
  "send",
  "recv",
  "mesh_reduce",
  "all_gather_bucketized",
  "reduce_scatter_bucketized",
  "all_reduce_bucketized_gradients",
  "reduce_gradients",
  "rendezvous",
)


def _ctx(api):
  ctx = _handlers["replica_context"]()
  if ctx is None:
    raise RuntimeError(
      f"xm.{api} inside strategy.run can only be used in the replica context (the "
      "step function), not inside merge_fn; there use strategy.reduce / "
      "strategy.gather."
    )
  return ctx


def _check_groups(groups, api, n):
  if not groups:
    return
  if len(groups) == 1 and sorted(groups[0]) == list(range(n)):
    return
  raise ValueError(
    f"xm.{api}(groups={groups!r}) inside strategy.run: xladist's collectives run over "
    f"all {n} replicas; use ReplicaContext.all_reduce / all_gather without groups, or "
    "reduce a subset with masks (torch.where on replica_id_in_sync_group)."
  )


def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
  ctx = _ctx("all_reduce")
  op = _handlers["reduce_ops"].get(reduce_type)
  if op is None:
    raise ValueError(
      f"xm.all_reduce({reduce_type!r}, ...) inside strategy.run: xladist reduces with "
      "REDUCE_SUM, REDUCE_MIN and REDUCE_MAX (ReplicaContext.all_reduce also takes "
      "MEAN); compute other reductions from those."
    )
  _check_groups(groups, "all_reduce", ctx.num_replicas_in_sync)
  single = isinstance(inputs, torch.Tensor)
  tensors = [inputs] if single else list(inputs)
  reduced = ctx.all_reduce(op, tensors)
  if scale != 1.0:
    reduced = [r * scale for r in reduced]
  if single:
    return reduced[0]
  with torch.no_grad():
    for t, r in zip(tensors, reduced):
      t.copy_(r)  # torch_xla's list form reduces in place
  return inputs


def all_gather(value, dim=0, groups=None, output=None, pin_layout=True):
  ctx = _ctx("all_gather")
  _check_groups(groups, "all_gather", ctx.num_replicas_in_sync)
  result = ctx.all_gather(value, axis=dim)
  if output is not None:
    with torch.no_grad():
      output.copy_(result)
    return output
  return result


def reduce_scatter(
  reduce_type, input, scale, scatter_dim, shard_count, groups=None, output=None, pin_layout=True
):
  ctx = _ctx("reduce_scatter")
  n = ctx.num_replicas_in_sync
  _check_groups(groups, "reduce_scatter", n)
  if isinstance(input, (list, tuple)):
    raise ValueError(
      "xm.reduce_scatter of a list inside strategy.run is not supported; "
      "reduce_scatter each tensor."
    )
  if shard_count != n:
    raise ValueError(
      f"xm.reduce_scatter(shard_count={shard_count}) inside strategy.run: the "
      f"strategy has {n} replicas, so shard_count must be {n}."
    )
  reduced = all_reduce(reduce_type, input, scale)
  moved = reduced.movedim(scatter_dim, 0)
  if moved.shape[0] % n:
    raise ValueError(
      f"xm.reduce_scatter: dimension {scatter_dim} of size {moved.shape[0]} does not "
      f"divide into {n} shards."
    )
  shards = moved.reshape((n, moved.shape[0] // n) + tuple(moved.shape[1:]))
  own = _handlers["select_own"](shards, ctx.replica_id_in_sync_group).movedim(0, scatter_dim)
  if output is not None:
    with torch.no_grad():
      output.copy_(own)
    return output
  return own


def optimizer_step(optimizer, barrier=False, optimizer_args=None, groups=None, pin_layout=True):
  """`optimizer.step()`: inside strategy.run it aggregates the gradients itself."""
  _check_groups(groups, "optimizer_step", _ctx("optimizer_step").num_replicas_in_sync)
  return optimizer.step(**(optimizer_args or {}))


def _unsupported(name):
  def refuse(*args, **kwargs):
    raise RuntimeError(
      f"xm.{name} inside strategy.run: torch_xla's per-process collectives do not "
      "reach the other replicas of xladist's one SPMD program. Use "
      "ReplicaContext.all_reduce / all_gather (inside the step) or strategy.reduce / "
      "strategy.gather (outside it); gradients are aggregated by optimizer.step()."
    )

  return refuse


def _ordinal(name):
  def refuse(*args, **kwargs):
    raise RuntimeError(
      f"{name}() inside strategy.run: every replica is traced at once, so no Python "
      "int can say which replica runs. Use "
      "xd.get_replica_context().replica_id_in_sync_group (a traced tensor: "
      "torch.where, masks), or move the code out of the step."
    )

  return refuse


def _world_size():
  return _ctx("world_size").num_replicas_in_sync


def _raw_binding(name):
  def refuse(*args, **kwargs):
    raise RuntimeError(
      f"torch_xla._XLAC.{name} inside strategy.run (a torch_xla collective): it would "
      "reduce nothing across xladist's replicas. Call xm.all_reduce / xm.all_gather "
      "through the module (xladist computes them), or use ReplicaContext.all_reduce."
    )

  return refuse


def _sync_binding(name):
  def refuse(*args, **kwargs):
    from xladist.runtime import host

    raise host.HostReadInStep(
      f"{host.user_frame()} (torch_xla.sync, xm.mark_step or another host sync)"
    )

  return refuse


@contextlib.contextmanager
def foreign_idioms(handlers):
  """Replaces torch_xla's collective and sync idioms while a step is traced
  (put back when the block ends, also on errors).

  `handlers`: {"replica_context": () -> the current ReplicaContext inside a
  step's replica function, else None; "select_own": (stacked, replica id) ->
  the replica's own row; "reduce_ops": {"sum" | "min" | "max": ReduceOp}}.
  """
  saved_handlers = dict(_handlers)
  _handlers.update(handlers)
  try:
    with _patched(_replacements()):
      yield
  finally:
    _handlers.clear()
    _handlers.update(saved_handlers)


def _replacements():
  replacements = {
    ("xm", "all_reduce"): all_reduce,
    ("xm", "all_gather"): all_gather,
    ("xm", "reduce_scatter"): reduce_scatter,
    ("xm", "optimizer_step"): optimizer_step,
    ("xr", "world_size"): _world_size,
  }
  for name in _UNSUPPORTED:
    replacements["xm", name] = _unsupported(name)
  for module, name in (
    ("xr", "global_ordinal"),
    ("xr", "local_ordinal"),
    ("xm", "get_local_ordinal"),
    ("xm", "is_master_ordinal"),
  ):
    replacements[module, name] = _ordinal(f"{module}.{name}")
  for name in _RAISING_BINDINGS:
    replacements["_XLAC", name] = _raw_binding(name)
  for name in _SYNC_BINDINGS:
    replacements["_XLAC", name] = _sync_binding(name)
  return replacements


_PATCHABLE = {
  "torch_xla": "torch_xla",
  "xm": "torch_xla.core.xla_model",
  "xr": "torch_xla.runtime",
  "_XLAC": "torch_xla._XLAC",
}


@contextlib.contextmanager
def _patched(replacements):
  """Replaces attributes of torch_xla's modules while the block runs.

  `replacements`: {(module key, name): value}, module key one of "torch_xla",
  "xm" (torch_xla.core.xla_model), "xr" (torch_xla.runtime), "_XLAC". Names the
  module does not have are left alone. Everything is put back on exit.
  """
  import torch_xla

  modules = {
    key: torch_xla._XLAC if key == "_XLAC" else importlib.import_module(name)
    for key, name in _PATCHABLE.items()
  }
  saved = []
  try:
    for (key, name), value in replacements.items():
      owner = modules[key]
      if hasattr(owner, name):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)
    yield
  finally:
    for owner, name, value in reversed(saved):
      setattr(owner, name, value)
