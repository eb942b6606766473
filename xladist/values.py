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

from xladist import runtime as _runtime

_NOT_CONSTANT = object()


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
        f"per replica, got {type(values).__name__}."
      )
    if not values:
      raise ValueError("PerReplica(values): values must not be empty.")
    self._values = tuple(values)
    self._stacked = None
    self._local = None
    self._n = len(self._values)

  @classmethod
  def __torch_function__(cls, func, types, args=(), kwargs=None):
    raise ValueError(
      f"{getattr(func, '__name__', func)} got a PerReplica (one value per replica) "
      "outside a replica context; it is not a tensor. Pass it to strategy.run, "
      "where each replica sees its own component, or combine it first with "
      "strategy.reduce / strategy.gather / experimental_local_results."
    )

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
    self._values, self._stacked, self._local, self._n = (
      None,
      None,
      (local, region),
      region.num_replicas,
    )
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

  def _constant(self):
    """The common value when every component is the same Python value (not a
    tensor), else _NOT_CONSTANT."""
    if self._values is None:
      return _NOT_CONSTANT
    first = self._values[0]
    if isinstance(first, (torch.Tensor, DistributedValues)):
      return _NOT_CONSTANT
    try:
      if all(type(c) is type(first) and c == first for c in self._values[1:]):
        return first
    except (TypeError, ValueError, RuntimeError):
      pass
    return _NOT_CONSTANT

  def _stacked_global(self, num_replicas):
    """The global (num_replicas, ...) tensor, placed split over the replica axis."""
    if self._stacked is None:
      if self._local is not None:
        raise RuntimeError(
          "A PerReplica made inside merge_call cannot leave the step; return "
          "it from merge_fn (each replica then gets its own component) instead."
        )
      comps = check_components(self._values, "strategy.run")
      if _runtime.is_device_tensor(comps[0]):
        stacked = torch.stack(comps)
      else:
        stacked = torch.stack([c.detach().cpu() for c in comps])
      self._stacked = _runtime.place_split(stacked)
    return self._stacked


class Mirrored(DistributedValues):
  """Holds a value that is identical on every replica.

  As TF's DistributedDelegate, a Mirrored behaves as its value in operators
  (`m + 1`, `m @ w`, `-m`, `m[0]`), torch functions (`torch.add(m, 1)`) and
  attribute reads (`m.shape`); the results are ordinary tensors.
  """

  __slots__ = ("_primary",)

  def __getattr__(self, name):
    if name.startswith("__") or name == "_primary":
      raise AttributeError(name)
    return getattr(self._primary, name)

  @classmethod
  def __torch_function__(cls, func, types, args=(), kwargs=None):
    args, kwargs = optree.tree_map(
      _primary_of,
      (args, kwargs or {}),
      is_leaf=lambda x: isinstance(x, DistributedValues),
      none_is_leaf=True,
    )
    return func(*args, **kwargs)

  def __init__(self, values):
    if isinstance(values, DistributedValues) or not isinstance(values, (tuple, list)):
      raise TypeError(
        "Mirrored(values): values must be a tuple or list with one (identical) "
        f"component per replica, got {type(values).__name__}."
      )
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


def as_components(values):
  """The components of a PerReplica as tensors."""
  if all(isinstance(c, torch.Tensor) for c in values):
    return tuple(values)
  return tuple(torch.as_tensor(c) for c in values)


def check_components(values, api):
  """The components as tensors, checked to have one shape and one dtype.

  Raises:
    ValueError: the components differ in shape or dtype.
  """
  comps = as_components(values)
  shapes = [tuple(c.shape) for c in comps]
  if len(set(shapes)) != 1:
    raise ValueError(
      f"{api}: xladist traces all replicas into one program, so the components "
      f"of a PerReplica must have one shape; got shapes {shapes} (replica 0, "
      "1, ...). Pad the components to a common shape (and mask the padding)."
    )
  dtypes = [c.dtype for c in comps]
  if len(set(dtypes)) != 1:
    raise ValueError(
      f"{api}: the components of a PerReplica must have one dtype, got "
      f"{[str(d) for d in dtypes]} (replica 0, 1, ...); xladist would otherwise "
      "cast them silently. Convert them to one dtype first."
    )
  return comps


def _primary_of(x):
  return x.primary if isinstance(x, Mirrored) else x


def _delegate(name):
  def method(self, *args):
    return getattr(self._primary, name)(*[_primary_of(a) for a in args])

  method.__name__ = name
  return method


for _name in (
  "__add__",
  "__radd__",
  "__sub__",
  "__rsub__",
  "__mul__",
  "__rmul__",
  "__truediv__",
  "__rtruediv__",
  "__floordiv__",
  "__rfloordiv__",
  "__mod__",
  "__rmod__",
  "__pow__",
  "__rpow__",
  "__matmul__",
  "__rmatmul__",
  "__lt__",
  "__le__",
  "__gt__",
  "__ge__",
  "__and__",
  "__rand__",
  "__or__",
  "__ror__",
  "__xor__",
  "__rxor__",
  "__neg__",
  "__abs__",
  "__invert__",
  "__getitem__",
):
  setattr(Mirrored, _name, _delegate(_name))


def reduce_by_form(values, reduce_global, reduce_local):
  """Reduces a batch of values, each group in one call, results in input order.

  `reduce_local` gets the PerReplica values made inside merge_call (their local
  form), `reduce_global` all the others; each returns one result per value.
  """
  local = [i for i, v in enumerate(values) if isinstance(v, PerReplica) and v._local is not None]
  local_set = set(local)
  others = [i for i in range(len(values)) if i not in local_set]
  out = [None] * len(values)
  for indices, reduce in ((others, reduce_global), (local, reduce_local)):
    if indices:
      for i, r in zip(indices, reduce([values[i] for i in indices])):
        out[i] = r
  return out
