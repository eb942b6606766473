"""Sync-on-read variables' per-replica components, kept between steps.

A sync-on-read (ON_READ) variable of a strategy with several replicas keeps each
replica's component in one hidden (num_replicas, ...) tensor split over the
replica axis (`ReplicaCopies`, reached with `copies_of`); the module attribute
holds their aggregate, which is what cross-replica code reads. A write of the
attribute outside a step is a cross-replica assignment, spread to the
components by TF's rule (`spread`) at their next use.
"""

import torch

from xladist import runtime as _runtime
from xladist import variable_policy as policies

VA = policies.VariableAggregation
_COPIES = "_xladist_replicas"  # attribute of an ON_READ tensor (see ReplicaCopies)
_tracing = [0]  # how many steps are being traced (any strategy, any thread)


def count_traced_step(delta):
  """A step's trace starts (+1) or ends (-1) (VariableStore's enter, exit,
  restore): a forward while no step is traced writes outside a step (`watch_forward`)."""
  _tracing[0] += delta


def spread(value, aggregation, num_replicas):
  """The (num_replicas, ...) components a cross-replica assignment of `value` gives.

  TF's rule (values_util.on_read_assign_cross_replica, get_on_read_restore_ops):
  SUM divides the value among the replicas, the others give it to each.
  Integers are divided exactly: replica 0 takes the remainder (TF truncates
  value / N, which loses it).
  """
  stacked_shape = (num_replicas,) + tuple(value.shape)
  if aggregation is not VA.SUM:
    return value.unsqueeze(0).expand(stacked_shape)
  if value.is_floating_point() or value.is_complex():
    return (value / num_replicas).unsqueeze(0).expand(stacked_shape)
  share = torch.div(value, num_replicas, rounding_mode="floor")
  first = value - share * (num_replicas - 1)
  return torch.cat(
    [first.unsqueeze(0), share.unsqueeze(0).expand((num_replicas - 1,) + tuple(value.shape))]
  )


def aggregate_host(stacked, aggregation):
  """The cross-replica value of (num_replicas, ...) components (global view)."""
  if aggregation is VA.SUM:
    return stacked.sum(0)
  if aggregation is VA.MEAN:
    if stacked.is_floating_point():
      return stacked.mean(0)
    return torch.div(stacked.sum(0), stacked.shape[0], rounding_mode="floor")
  return stacked[0]


class ReplicaCopies:
  """The per-replica components of one sync-on-read variable, between steps.

  TF keeps each replica's component of a SyncOnReadVariable and reduces them
  when it is read in cross-replica context. Here the components live in one
  hidden (num_replicas, ...) tensor split over the replica axis, and the module
  attribute (what `state_dict()`, checkpoints and any cross-replica code read)
  holds their aggregate. A write to the attribute outside a step is a
  cross-replica assignment: the next use spreads it to the components (TF's
  rule, `spread`). Such writes are found without reading values: by the
  tensor's version counter, its functionalization mutation counter and
  torch_xla's id of the tensor behind it (all unchanged by `torch_xla.sync()`),
  and, for
  torch_xla's batch-norm kernel, which updates running statistics without
  touching either, by a forward pre-hook on the module (`watch_forward`).
  """

  __slots__ = ("stacked", "num_replicas", "aggregation", "stamp", "dirty")

  def __init__(self, stacked, num_replicas, aggregation):
    self.stacked = stacked
    self.num_replicas = num_replicas
    self.aggregation = aggregation
    self.stamp = None
    self.dirty = False

  @classmethod
  def create(cls, t, num_replicas):
    """Every replica starts from the tensor's value (TF: components start equal);
    the attribute then holds their aggregate (SUM: num_replicas times it)."""
    aggregation = policies.policy_of(t).aggregation
    with torch.no_grad():
      stacked = _runtime.place_split(
        t.detach().unsqueeze(0).expand((num_replicas,) + tuple(t.shape)).clone()
      )
      if aggregation is VA.SUM:
        t.mul_(num_replicas)
    copies = cls(stacked, num_replicas, aggregation).attach(t)
    copies.restamp(t)
    return copies

  def copy_to(self, t):
    """Gives `t` (a copy of this variable's tensor) a copy of these components."""
    copies = ReplicaCopies(
      _runtime.place_split(self.stacked.clone()), self.num_replicas, self.aggregation
    ).attach(t)
    copies.restamp(t)

  def attach(self, t):
    """Makes these the components of `t` (what `copies_of(t)` returns); returns them."""
    setattr(t, _COPIES, self)
    return self

  def restamp(self, t):
    self.stamp = _write_stamp(t)
    self.dirty = False

  def changed(self, t):
    return self.dirty or _write_stamp(t) != self.stamp

  def current(self, t, describe):
    """The components, after applying a cross-replica write of the attribute."""
    if self.changed(t):
      value = t.detach()
      if tuple(value.shape) != tuple(self.stacked.shape[1:]) or value.dtype != self.stacked.dtype:
        raise RuntimeError(
          f"xladist: the sync-on-read variable {describe(t)} was replaced outside "
          f"strategy.run by a tensor of shape {tuple(value.shape)} and dtype "
          f"{value.dtype}, but its per-replica components have shape "
          f"{tuple(self.stacked.shape[1:])} and dtype {self.stacked.dtype}; "
          "write values of the variable's shape and dtype (e.g. with copy_)."
        )
      with torch.no_grad():
        self.stacked = _runtime.place_split(
          spread(_runtime.ensure_sharded(value), self.aggregation, self.num_replicas).contiguous()
        )
      self.restamp(t)
    return self.stacked


def _write_stamp(t):
  """What changes when `t` is written outside a step, and not when it is synced:
  its version counter (in-place ops), its functionalization mutation counter
  (also `t.data.copy_`, whose version counter is another) and torch_xla's id
  of the tensor behind it (`.data =`, `set_`; ids are never reused)."""
  if torch._is_functional_tensor(t):
    return (t._version, torch._functionalize_mutation_counter(t), _runtime.creation_index(t))
  return (t._version, _runtime.creation_index(t))


def watch_forward(module):
  """Marks a module's sync-on-read buffers as written when it runs outside a step.

  torch_xla 2.9's batch-norm kernel updates running statistics in place without
  bumping the version or mutation counters, so a forward in training mode in
  cross-replica context would otherwise go unnoticed.
  """
  if getattr(module, "_xladist_watched", False):
    return

  def pre_hook(mod, args):
    if _tracing[0]:
      return None  # inside a step: the step's exit sees the writes
    for t in mod._buffers.values():
      copies = getattr(t, _COPIES, None) if t is not None else None
      if copies is not None:
        copies.dirty = True
    return None

  module.register_forward_pre_hook(pre_hook)
  module._xladist_watched = True


def copies_of(t):
  """The ReplicaCopies of a sync-on-read variable with several replicas, else None."""
  return getattr(t, _COPIES, None)
