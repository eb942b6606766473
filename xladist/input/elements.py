"""What one element of a dataset is: its leaves, whether it has a batch dimension,
and the check that every element has the first one's spec.

An element (a batch, or a per-replica element) is a nest of tuples, lists,
dicts, namedtuples and dataclasses (`xladist._nest`). Its leaves are tensors
(numpy arrays are converted), Python and numpy numbers, and other values
(strings, None), which are passed through.

It HAS A BATCH DIMENSION when it holds at least one tensor and every tensor has
a dim 0 of one size (the batch size). Only such elements can be split between
replicas, padded or cut short. An element WITHOUT one (a 0-d tensor among its
tensors, tensors whose dim 0 differ, or only numbers) is taken whole: a
per-replica element goes to its replica as it is, Python and numpy numbers
made tensors as TF makes them (`numbers_as_tensors`), and its shapes may not
change between elements (one XLA program).
"""

import numpy as np
import torch

from xladist import _nest


def flatten(batch):
  """A batch's leaves (numpy arrays as tensors) and spec: xladist's nests, so a
  dataclass batch is split by its fields as a step's dataclass result is."""
  leaves, spec = _nest.flatten(batch)
  return [torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in leaves], spec


def has_batch_dim(leaves):
  """True when the tensors among `leaves` share a batch dimension (see above)."""
  tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
  if not tensors or any(t.dim() == 0 for t in tensors):
    return False
  return len({t.shape[0] for t in tensors}) == 1


def _number_as_tensor(x, api):
  if isinstance(x, np.generic):  # before float: np.float64 is a Python float too
    if np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_:
      return torch.from_numpy(np.asarray(x))  # keeps the numpy dtype
    return x
  if isinstance(x, (bool, int, float, complex)):
    try:
      return torch.tensor(x)  # torch's dtypes: int64, float32 (the default), ...
    except RuntimeError:  # overflow
      raise ValueError(
        f"{api}: an element holds the Python number {x}, which does not fit in "
        f"{'int64' if isinstance(x, int) else 'a torch dtype'}; make it a float or a "
        "tensor of your choice in the dataset."
      ) from None
  return x


def numbers_as_tensors(leaves, api):
  """`leaves` with Python and numpy numbers made 0-d tensors, with the dtypes
  `torch.tensor` gives them (bool -> bool, int -> int64, float -> the default
  float dtype, complex -> the default complex dtype: what PyTorch losses
  expect; TF's tf.constant makes an int int32); a numpy scalar keeps its dtype.
  Other leaves are returned unchanged."""
  return [_number_as_tensor(x, api) for x in leaves]


def batch_size(leaves, api, what, num_replicas=None):
  """The common dim-0 size of the tensors among `leaves`.

  Raises a ValueError when they have none: `num_replicas` (a global batch to
  split) says how many replicas it should have been split between; None: the
  first element had a batch dimension and this one has not.
  """
  if num_replicas is None:
    reason = (
      f", as the first {what} had (every {what} of a dataset must have the same "
      "structure); fix the dataset or its collate function."
    )
  else:
    reason = (
      f" to be split between the {num_replicas} replicas. Batch the dataset (global "
      f"batches of {num_replicas} x the per-replica batch size), or give each replica "
      "its own elements with strategy.distribute_datasets_from_function, which "
      "delivers elements without a batch dimension whole."
    )
  sizes = set()
  for t in leaves:
    if isinstance(t, torch.Tensor):
      if t.dim() == 0:
        raise ValueError(
          f"{api}: a {what} holds a scalar tensor ({t!r}); every tensor of a {what} "
          f"needs a batch dimension (dim 0){reason}"
        )
      sizes.add(t.shape[0])
  if not sizes:
    raise ValueError(f"{api}: a {what} holds no tensor, so it has no batch dimension{reason}")
  if len(sizes) > 1:
    raise ValueError(
      f"{api}: the tensors of one {what} have different sizes in dim 0 "
      f"({sorted(sizes)}); all of them need the batch size there{reason}"
    )
  return sizes.pop()


class SpecCheck:
  """Refuses an element whose structure, dtypes or shapes differ from the first
  element's (after the batch dim, when elements have one): a new element_spec
  would be a new XLA program, or a silently different input, so it is an error
  before the step runs."""

  def __init__(self, api, what, batched=True):
    self.api, self.what, self.batched = api, what, batched
    self.first = None

  def _shape(self, t):
    return tuple(t.shape[1:]) if self.batched else tuple(t.shape)

  def _key(self, spec, leaves):
    return spec, tuple(
      (self._shape(t), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in leaves
    )

  def _describe(self, spec, leaves):
    parts = [
      f"{self._shape(t)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
      for t in leaves
    ]
    shape = "shape after the batch dim" if self.batched else "shape"
    return f"{spec} with leaves [{', '.join(parts)}] ({shape}, dtype)"

  def check(self, spec, leaves, index):
    key = self._key(spec, leaves)
    if self.first is None:
      self.first = key, self._describe(spec, leaves)
      return
    if key != self.first[0]:
      if self.batched:
        same = "per-example shapes (only a partial last batch may have fewer rows)"
      else:
        same = "shapes (elements without a batch dimension are taken whole)"
      raise ValueError(
        f"{self.api}: {self.what} {index} of the epoch does not match the "
        f"element_spec taken from the first {self.what}: it is "
        f"{self._describe(spec, leaves)}, the first was {self.first[1]}. Every "
        f"{self.what} must have the same structure, dtypes and {same}, since a "
        "new shape is a new XLA program; fix the dataset or its collate function."
      )
