"""Turning the dataset's batches into elements ready for `strategy.run`.

Every element is built in the prefetch thread (`prefetch.py`):

1. the dataset yields a batch: a tensor, or nested tuples, lists, dicts and
   namedtuples of tensors (numpy arrays are converted; other leaves, e.g.
   strings, are passed through unchanged);
2. each tensor becomes a host tensor of shape (N, b, ...) whose row r is replica
   r's per-replica batch: a global batch of B = N * b rows gives replica r the
   rows [r * b, (r + 1) * b) (a view, no copy); per-replica batches from
   `distribute_datasets_from_function` are stacked. On several hosts
   (`hosts=(num_hosts, host_index)`) a host keeps only the rows of its own
   replicas (see `sharding.py` for the policy), so the tensor has one row per
   local replica. An element without a batch dimension (`elements.py`: a 0-d
   tensor, or only Python numbers) is split by nobody: per-replica elements
   are stacked on a new leading replica axis, so replica r gets exactly its
   element, and one replica gets a global element whole (with several, such an
   element is refused: there is nothing to split);
3. with `experimental_fetch_to_device` the strategy places it: on a
   MirroredStrategy one transfer sends row r straight to replica r's device and
   the tensor becomes a `PerReplica`; a single-replica strategy gets the batch
   itself on its device.

Shapes never change between steps (a new shape is a new XLA program): a batch
smaller than the first one is padded, dropped or refused according to
`InputOptions.experimental_partial_batch`. Elements without a batch dimension
have no partial batch: when a replica's dataset ends before the others', the
epoch ends there as in TF (logged), unless "mask" asks for zeros and a mask.
"""

import logging

import torch

from xladist import _nest
from xladist.input.checks import (
  _larger_error,
  _partial_error,
  _past_the_end,
  _short_only_batch_error,
  declared_batch_size,
)
from xladist.input.elements import (
  SpecCheck,
  batch_size,
  flatten,
  has_batch_dim,
  numbers_as_tensors,
)
from xladist.values import PerReplica

logger = logging.getLogger("xladist")


class _Builder:
  """Turns host batches into elements (runs in the prefetch thread).

  `num_replicas`: the replicas a global batch is split between; `rows`: None,
  or the range of replicas whose rows this host keeps (multi-host).
  """

  def __init__(self, num_replicas, options, place, rows=None):
    self.n = num_replicas
    self.partial = options.experimental_partial_batch
    self.place = place
    self.rows = rows

  def element(self, spec, leaves, mask):
    """`leaves`: (N, b, ...) host tensors and passed-through values."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if mask is not None:
      tensors.append(mask)
    placed = iter(self.place(tensors))
    out = _nest.unflatten(
      spec, [next(placed) if isinstance(x, torch.Tensor) else x for x in leaves]
    )
    if mask is not None:
      return out, next(placed)
    return out

  def from_global(self, leaves, size, full):
    """A global batch of `size` rows (`full` rows when complete) -> stacked leaves."""
    n, b = self.n, full // self.n
    out = []
    for t in leaves:
      if isinstance(t, torch.Tensor):
        if size < full:
          padded = t.new_zeros((full,) + tuple(t.shape[1:]))
          padded[:size] = t
          t = padded
        t = t.reshape((n, b) + tuple(t.shape[1:]))
        if self.rows is not None:
          t = t[self.rows.start : self.rows.stop]
      out.append(t)
    mask = None
    if self.partial == "mask":
      mask = (torch.arange(full) < size).to(torch.float32).reshape(n, b)
      if self.rows is not None:
        mask = mask[self.rows.start : self.rows.stop]
    return out, mask

  def from_chunks(self, chunks, sizes, b):
    """N per-replica leaf lists (None: no data for that replica) -> stacked leaves."""
    template = next(c for c in chunks if c is not None)
    full = all(s == b for s in sizes)
    out = []
    for j, leaf in enumerate(template):
      if isinstance(leaf, torch.Tensor):
        if full:
          out.append(torch.stack([c[j] for c in chunks]))
        else:
          stacked = leaf.new_zeros((self.n, b) + tuple(leaf.shape[1:]))
          for r, c in enumerate(chunks):
            if c is not None:
              stacked[r, : sizes[r]] = c[j]
          out.append(stacked)
      else:
        values = [template[j] if c is None else c[j] for c in chunks]
        out.append(_group_plain(values))
    mask = None
    if self.partial == "mask":
      mask = torch.stack([(torch.arange(b) < s).to(torch.float32) for s in sizes])
    return out, mask

  def from_elements(self, chunks):
    """N per-replica leaf lists of elements without a batch dim (None: no element
    for that replica) -> leaves stacked on a new replica axis; a missing element
    is zeros (its mask entry 0)."""
    template = next(c for c in chunks if c is not None)
    out = []
    for j, leaf in enumerate(template):
      if isinstance(leaf, torch.Tensor):
        out.append(torch.stack([leaf.new_zeros(leaf.shape) if c is None else c[j] for c in chunks]))
      else:
        out.append(_group_plain([template[j] if c is None else c[j] for c in chunks]))
    mask = None
    if self.partial == "mask":
      mask = torch.tensor([c is not None for c in chunks], dtype=torch.float32)
    return out, mask


def _group_plain(values):
  """Per-replica non-tensor leaves: one value if all are equal, else a PerReplica."""
  first = values[0]
  try:
    if all(v == first for v in values[1:]):
      return first
  except (TypeError, ValueError, RuntimeError):
    pass
  return PerReplica(values)


def _global_batch_elements(dataset, builder, api, skip=0):
  """Elements of `experimental_distribute_dataset` (the dataset yields global batches).

  Calls `iter(dataset)` at once (in the caller's thread); the elements are made
  as the returned generator is iterated. The first `skip` elements are read
  and checked but not built or transferred.
  """
  return _global_batches(iter(dataset), builder, api, skip, declared_batch_size(dataset))


def _global_batches(batches, builder, api, skip, declared=None):
  """`declared`: the dataset's own batch size when it has one (a DataLoader's
  `batch_size`). With `experimental_partial_batch` set it is the global batch
  size (a dataset smaller than one batch has one partial batch); else the
  first batch's size is (a dataset of one batch has one shape, nothing to pad)."""
  full = declared if builder.partial is not None else None
  whole = specs = None
  divisible = False
  position, count = skip, 0
  for index, batch in enumerate(batches):
    leaves, spec = flatten(batch)
    if whole is None:
      # One replica splits nothing: an element without a batch dim goes whole.
      whole = builder.n == 1 and not has_batch_dim(leaves)
      specs = SpecCheck(api, "element" if whole else "batch", batched=not whole)
    if whole:
      leaves = numbers_as_tensors(leaves, api)
      specs.check(spec, leaves, index)
      count += 1
      if skip:
        skip -= 1
        continue
      stacked, mask = builder.from_elements([leaves])
      yield builder.element(spec, stacked, mask)
      continue
    size = batch_size(leaves, api, "batch", builder.n if builder.n > 1 else None)
    specs.check(spec, leaves, index)
    if full is None:
      full = size
    if not divisible:
      if full % builder.n:
        if declared is not None and full < declared:
          raise _short_only_batch_error(api, "batch", full, declared, builder.n)
        source = "the DataLoader's batch_size" if full == declared else "taken from the first batch"
        raise ValueError(
          f"{api}: the global batch size {full} ({source}) is "
          f"not divisible by the {builder.n} replicas in sync; each replica must "
          f"get the same number of rows. Use a batch size that is a multiple of "
          f"{builder.n}."
        )
      divisible = True
    if size > full:
      raise _larger_error(api, "batch", size, full)
    if size < full:
      if builder.partial is None:
        raise _partial_error(api, "batch", size, full)
      if builder.partial == "drop":
        continue
    count += 1
    if skip:
      skip -= 1
      continue
    stacked, mask = builder.from_global(leaves, size, full)
    yield builder.element(spec, stacked, mask)
  if skip:
    raise _past_the_end(api, position, count, "elements" if whole else "batches")


def _next_or_none(iterator, done, i):
  if done[i]:
    return None
  try:
    return next(iterator)
  except StopIteration:
    done[i] = True
    return None


def _per_replica_elements(datasets, per_worker, builder, api, skip=0):
  """Elements of `distribute_datasets_from_function` (per-replica batches).

  `per_worker`: one pipeline whose consecutive elements go to replicas 0..N-1;
  else one pipeline per replica. Calls `iter()` on the datasets at once (in the
  caller's thread); the elements are made as the returned generator is
  iterated. The first `skip` elements are read and checked but not built or
  transferred.
  """
  sizes = {declared_batch_size(d) for d in datasets}
  declared = sizes.pop() if len(sizes) == 1 else None
  return _per_replica_batches([iter(d) for d in datasets], per_worker, builder, api, skip, declared)


def _per_replica_batches(iterators, per_worker, builder, api, skip, declared=None):
  """`declared`: the pipelines' own per-replica batch size when they have one
  (their DataLoaders' `batch_size`): the batch size with
  `experimental_partial_batch` set, else the first batch's size is."""
  n = builder.n
  done = [False] * len(iterators)
  b = declared if builder.partial is not None else None
  whole = specs = None
  what = "per-replica batch"
  position, count, index = skip, 0, 0
  while True:
    if per_worker:
      raw = [_next_or_none(iterators[0], done, 0) for _ in range(n)]
    else:
      raw = [_next_or_none(it, done, r) for r, it in enumerate(iterators)]
    if all(x is None for x in raw):
      break
    chunks, sizes, spec = [], [], None
    for x in raw:
      if x is None:
        chunks.append(None)
        sizes.append(0)
        continue
      leaves, s = flatten(x)
      if whole is None:
        # Nothing is split here: an element without a batch dim goes whole to its replica.
        whole = not has_batch_dim(leaves)
        what = "per-replica element" if whole else what
        specs = SpecCheck(api, what, batched=not whole)
      if spec is None:
        spec = s
      elif s != spec:
        raise ValueError(
          f"{api}: the replicas' {what}s of one step have different structures "
          f"({spec} vs {s}); every pipeline must yield the same structure."
        )
      if whole:
        leaves = numbers_as_tensors(leaves, api)
      else:
        sizes.append(batch_size(leaves, api, what))
      chunks.append(leaves)
      specs.check(s, leaves, index)
      index += 1
    if whole:
      if None in chunks and builder.partial != "mask":
        _end_at_a_missing_element(api, chunks, count, builder.partial)
        break
      count += 1
      if skip:
        skip -= 1
        continue
      stacked, mask = builder.from_elements(chunks)
      yield builder.element(spec, stacked, mask)
      continue
    if b is None:
      b = next(s for s in sizes if s)
    for s in sizes:
      if s > b:
        raise _larger_error(api, what, s, b)
    if any(s < b for s in sizes):
      if builder.partial is None:
        raise _partial_error(api, what, min(sizes), b)
      if builder.partial == "drop":
        continue
    count += 1
    if skip:
      skip -= 1
      continue
    stacked, mask = builder.from_chunks(chunks, sizes, b)
    yield builder.element(spec, stacked, mask)
  if skip:
    raise _past_the_end(api, position, count, "steps")


def _end_at_a_missing_element(api, chunks, step, partial):
  """The epoch of per-replica elements without a batch dim ends at the first step
  some replica has no element for, as in TF (their shapes are static, so TF's
  iterator ends as soon as one replica's does, input_lib's
  `_enable_get_next_as_optional`); logged unless "drop" asked for it."""
  if partial == "drop":
    return
  missing = [r for r, c in enumerate(chunks) if c is None]
  had = [r for r, c in enumerate(chunks) if c is not None]
  logger.warning(
    "%s: no element for replicas %s at step %d (their datasets ended): the epoch "
    "ends here, as in TF, and the elements replicas %s had for this step are not "
    "used. Pass options=xd.InputOptions(experimental_partial_batch='mask') to get "
    "them, with zeros and a mask for the replicas without one, or give every "
    "replica the same number of elements.",
    api,
    missing,
    step,
    had,
  )
