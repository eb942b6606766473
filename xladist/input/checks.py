"""Checks of a dataset before and while it is read: that it can be iterated again
each epoch, the batch size it declares, a short last batch or a batch size the
replicas cannot split refused before any step, and the errors for batches of
the wrong size (raised by `builder.py` as the batches come).
"""

import torch

from xladist.input.elements import flatten, has_batch_dim


def check_dataset(dataset, api, what="dataset"):
  """Raises TypeError unless `dataset` can be iterated more than once."""
  if not hasattr(dataset, "__iter__"):
    raise TypeError(
      f"{api}: {what} must be a torch DataLoader or another iterable of batches, "
      f"got {type(dataset).__name__}."
    )
  if hasattr(dataset, "__next__") and iter(dataset) is dataset:
    raise TypeError(
      f"{api}: {what} is a one-pass iterator ({type(dataset).__name__}), but each "
      "epoch iterates the dataset again. Pass a re-iterable object (a DataLoader, "
      "a list, an IterableDataset whose __iter__ makes a new iterator), e.g. wrap "
      "a generator function in a class whose __iter__ calls it."
    )


def _past_the_end(api, position, count, what):
  """`what`: the plural of what an element is ("batches", "steps", "elements")."""
  return ValueError(
    f"{api}: the iterator was restored to position {position} ({what} already "
    f"taken in this epoch), but the dataset has only {count} {what} in an epoch "
    "now: it is shorter than when the checkpoint was saved. Restore with the "
    "dataset the checkpoint was made with, or start a new epoch (iter() of the "
    "distributed dataset) instead of restoring the position."
  )


_PARTIAL_ADVICE = (
  "Every step must have the same shapes (a new shape compiles a new XLA "
  "program), so xladist does not pad or drop it silently: pass "
  "options=xd.InputOptions(experimental_partial_batch='mask') to pad it and get a "
  "mask of the real rows, or experimental_partial_batch='drop' to skip it (or "
  "batch with drop_last=True)."
)


def _partial_error(api, what, size, full):
  return ValueError(
    f"{api}: a {what} of {size} examples came after {what}es of {full} (the size "
    f"taken from the first {what}). " + _PARTIAL_ADVICE
  )


def _short_only_batch_error(api, what, size, full, n):
  return ValueError(
    f"{api}: the dataset's only {what} has {size} examples, fewer than its "
    f"{what} size {full} (the DataLoader's batch_size), and {size} rows cannot be "
    f"split evenly over the {n} replicas in sync. Pass "
    "options=xd.InputOptions(experimental_partial_batch='mask') to pad it to "
    f"{full} rows and get a mask of the real ones, or experimental_partial_batch="
    "'drop' to skip it."
  )


def _larger_error(api, what, size, full):
  return ValueError(
    f"{api}: a {what} of {size} examples came after a first {what} of {full}; the "
    f"{what} size is taken from the first {what} and later ones may only be "
    "smaller (a partial last batch). Give every batch the same size."
  )


def declared_batch_size(dataset):
  """The batch size a dataset declares, or None: a DataLoader's with automatic
  batching and the default collate_fn (its BatchSampler's `batch_size`; a
  custom collate_fn may make batches of other sizes). Its partial batches, the
  first one included when the data is smaller than one batch, are measured
  against it rather than against the first batch."""
  if isinstance(dataset, torch.utils.data.DataLoader):
    sampler = dataset.batch_sampler
    if (
      isinstance(sampler, torch.utils.data.BatchSampler)
      and sampler.batch_size
      and dataset.collate_fn is torch.utils.data.default_collate
    ):
      return int(sampler.batch_size)
  return None


def _batch_sizes_known_now(dataset):
  """(first batch size, last batch size, batches) of an epoch when known without
  reading the data, else None.

  A DataLoader with automatic batching knows both from its sampler's length,
  `batch_size` and `drop_last` (data smaller than one batch, with the default
  collate_fn: one partial batch); a list or tuple of batches from its first
  and last entries (already in memory).
  """
  if isinstance(dataset, torch.utils.data.DataLoader):
    sampler = dataset.batch_sampler
    if not isinstance(sampler, torch.utils.data.BatchSampler):
      return None
    try:
      examples = len(sampler.sampler)
    except TypeError:
      return None
    b = sampler.batch_size
    if examples < b:
      if examples == 0 or sampler.drop_last or declared_batch_size(dataset) is None:
        return None
      return b, examples, 1
    if sampler.drop_last:
      return b, b, examples // b
    return b, examples % b or b, -(-examples // b)
  if isinstance(dataset, (list, tuple)) and dataset:
    sizes = []
    for batch in (dataset[0], dataset[-1]):
      leaves, _ = flatten(batch)
      if not has_batch_dim(leaves):
        return None  # elements taken whole: no batch size to check
      sizes.append(next(t for t in leaves if isinstance(t, torch.Tensor)).shape[0])
    return sizes[0], sizes[1], len(dataset)
  return None


def check_last_batch(dataset, options, api, n, what="batch"):
  """Refuses now, before any step, a dataset whose last batch is known to be
  short (or whose batch size cannot be split over `n` replicas), unless
  `experimental_partial_batch` says what to do with it.

  Datasets that do not tell their sizes are checked as their batches come.
  """
  sizes = _batch_sizes_known_now(dataset)
  if sizes is None:
    return
  full, last, batches = sizes
  if n and full % n:
    raise ValueError(
      f"{api}: the global batch size {full} is not divisible by the {n} replicas "
      "in sync; each replica must get the same number of rows. Use a batch size "
      f"that is a multiple of {n}."
    )
  if last < full and options.experimental_partial_batch is None:
    if batches == 1:
      # One batch, one shape: taken as it is, when the replicas can share it.
      if n and last % n:
        raise _short_only_batch_error(api, what, last, full, n)
      return
    raise ValueError(
      f"{api}: the dataset's last {what} will have {last} examples, the others "
      f"{full}. " + _PARTIAL_ADVICE
    )
