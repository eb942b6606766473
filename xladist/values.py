"""Distributed values: one component per replica.

A `PerReplica` is held in whichever form is cheapest where it was made:

* a tuple of per-replica components (built on the host, e.g. by
  `experimental_distribute_values_from_function`);
* one global tensor of shape (num_replicas, *component_shape) sharded over the
  replica axis (what `strategy.run` returns: no per-replica copies exist);
* inside `merge_call`, each replica's own traced tensor (the "local" form):
  reductions of it lower to one all-reduce, and only reading `.values` needs an
  all-gather.

A `Mirrored` holds one tensor that is the same on every replica.
"""

import optree
import torch


class DistributedValues:
  """A value with one component per replica; `.values` is the tuple of components."""

  __slots__ = ("_n",)

  @property
  def values(self):
    raise NotImplementedError  # each subclass says how its components are held

  @property
  def num_replicas(self):
    return self._n

  def __repr__(self):
    parts = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self.values))
    return f"{type(self).__name__}:{{\n{parts}\n}}"


class PerReplica(DistributedValues):
  """Holds a (possibly different) value per replica.

  Example: with two replicas, `PerReplica((torch.tensor(1.), torch.tensor(2.)))`
  gives replica 0 the value 1 and replica 1 the value 2 when passed to
  `strategy.run`.
  """

  __slots__ = ("_values", "_stacked", "_local")

  def __init__(self, values):
    if isinstance(values, DistributedValues) or not isinstance(values, (tuple, list)):
      raise TypeError(
          "PerReplica(values): values must be a tuple or list with one component "
          f"per replica, got {type(values).__name__}.")
    if not values:
      raise ValueError("PerReplica(values): values must not be empty.")
    self._values = tuple(values)
    self._stacked = None
    self._local = None
    self._n = len(self._values)

  @classmethod
  def _from_stacked(cls, stacked, num_replicas):
    """Wraps a global (num_replicas, ...) tensor whose row r is replica r's value."""
    self = cls.__new__(cls)
    self._values, self._stacked, self._local, self._n = None, stacked, None, num_replicas
    return self

  @classmethod
  def _from_local(cls, local, region):
    """Wraps one replica's traced value inside a manual region (merge_call)."""
    self = cls.__new__(cls)
    self._values, self._stacked, self._local, self._n = None, None, (local, region), region.num_replicas
    return self

  @property
  def values(self):
    if self._values is None:
      if self._stacked is not None:
        self._values = tuple(self._stacked.unbind(0))
      else:
        local, region = self._local
        region.require_active("PerReplica.values")
        gathered = region.gather_stacked(local)
        self._values = tuple(gathered.unbind(0))
    return self._values

  def _stacked_global(self, num_replicas):
    """The global (num_replicas, ...) tensor, placed split over the replica axis."""
    from xladist import _runtime
    if self._stacked is None:
      if self._local is not None:
        raise RuntimeError(
            "A PerReplica made inside merge_call cannot leave the step; return "
            "it from merge_fn (each replica then gets its own component) instead.")
      comps = self._values
      if not all(isinstance(c, torch.Tensor) for c in comps):
        comps = tuple(torch.as_tensor(c) for c in comps)
      shapes = {tuple(c.shape) for c in comps}
      if len(shapes) != 1:
        raise ValueError(
            "xladist traces all replicas into one program, so the components of a "
            f"PerReplica must have one shape; got shapes {sorted(shapes)}. Pad the "
            "components to a common shape (and mask the padding).")
      if comps[0].device.type == "xla":
        stacked = torch.stack(comps)
      else:
        stacked = torch.stack([c.detach().cpu() for c in comps])
      self._stacked = _runtime.place_split(stacked)
    return self._stacked


class Mirrored(DistributedValues):
  """Holds a value that is identical on every replica."""

  __slots__ = ("_primary",)

  def __init__(self, values):
    if isinstance(values, DistributedValues) or not isinstance(values, (tuple, list)):
      raise TypeError(
          "Mirrored(values): values must be a tuple or list with one (identical) "
          f"component per replica, got {type(values).__name__}.")
    if not values:
      raise ValueError("Mirrored(values): values must not be empty.")
    self._primary = values[0]
    self._n = len(values)

  @classmethod
  def _from_primary(cls, primary, num_replicas):
    self = cls.__new__(cls)
    self._primary, self._n = primary, num_replicas
    return self

  @property
  def values(self):
    return (self._primary,) * self._n

  @property
  def primary(self):
    return self._primary


def reduce_by_form(values, reduce_global, reduce_local):
  """Reduces a batch of values, each group in one call, results in input order.

  `reduce_local` gets the PerReplica values made inside merge_call (their local
  form), `reduce_global` all the others; each returns one result per value.
  """
  local = [i for i, v in enumerate(values)
           if isinstance(v, PerReplica) and v._local is not None]
  local_set = set(local)
  others = [i for i in range(len(values)) if i not in local_set]
  out = [None] * len(values)
  for indices, reduce in ((others, reduce_global), (local, reduce_local)):
    if indices:
      for i, r in zip(indices, reduce([values[i] for i in indices])):
        out[i] = r
  return out


def flatten(structure):
  """Leaves of a nested structure; distributed values and None are leaves."""
  return optree.tree_flatten(
      structure, is_leaf=lambda x: isinstance(x, DistributedValues), none_is_leaf=True)


def unflatten(treespec, leaves):
  return optree.tree_unflatten(treespec, leaves)
