"""`DistributedDataset` and `DistributedIterator`: input ready for `strategy.run`.

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

import functools
import logging

import torch

from xladist import _nest
from xladist.input import order, prefetch
from xladist.input.elements import (
  SpecCheck,
  batch_size,
  flatten,
  has_batch_dim,
  numbers_as_tensors,
)
from xladist.input.options import InputReplicationMode
from xladist.input.sharding import host_replica_ids
from xladist.values import PerReplica

_NOTHING = object()
logger = logging.getLogger("xladist")


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


def _host_place(num_replicas, tensors):
  """fetch_to_device=False: per-replica host tensors (one replica: the batch)."""
  if num_replicas == 1:
    return [t[0] for t in tensors]
  return [PerReplica(tuple(t.unbind(0))) for t in tensors]


def _placer(extended, options, num_local):
  if options.experimental_fetch_to_device or options.experimental_place_dataset_on_device:
    return extended._place_inputs
  return functools.partial(_host_place, num_local)


def _host_rows(extended, hosts):
  """(all replicas, the range this host feeds or None) for `hosts`."""
  n = extended._num_replicas_in_sync
  if hosts is None:
    return n, None
  return n, host_replica_ids(hosts[0], hosts[1], n)


def from_dataset(extended, dataset, options, api, hosts=None):
  """The DistributedDataset of `experimental_distribute_dataset`.

  `hosts`: None (one host: every replica is fed here), or (num_hosts,
  host_index): this host reads every global batch and keeps the rows of its
  replicas (`sharding.host_replica_ids`); its elements have one row per local
  replica, in `extended._place_inputs`'s input.
  """
  n, rows = _host_rows(extended, hosts)
  check_last_batch(dataset, options, api, n)
  local = n if rows is None else len(rows)
  builder = _Builder(n, options, _placer(extended, options, local), rows)
  return DistributedDataset._make(
    functools.partial(_global_batch_elements, dataset, builder, api),
    [dataset],
    options,
    _Layout(n, global_batches=True, max_elements=_length(dataset)),
  )


def from_datasets(extended, datasets, options, api, hosts=None):
  """The DistributedDataset of `distribute_datasets_from_function`.

  `datasets`: this host's pipelines (one, PER_WORKER; one per local replica,
  PER_REPLICA). `hosts` as in `from_dataset`: each step takes one per-replica
  batch per LOCAL replica.
  """
  n, rows = _host_rows(extended, hosts)
  local = n if rows is None else len(rows)
  builder = _Builder(local, options, _placer(extended, options, local))
  for dataset in datasets:
    check_last_batch(dataset, options, api, 0, "per-replica batch")
  per_worker = options.experimental_replication_mode is InputReplicationMode.PER_WORKER
  lengths = [_length(d) for d in datasets]
  most = None
  if all(x is not None for x in lengths):
    most = -(-lengths[0] // local) if per_worker else max(lengths)
  return DistributedDataset._make(
    functools.partial(_per_replica_elements, datasets, per_worker, builder, api),
    list(datasets),
    options,
    _Layout(n, global_batches=False, max_elements=most),
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


def _length(dataset):
  """len(dataset) (batches per epoch) when the dataset tells it, else None."""
  try:
    return len(dataset)
  except TypeError:
    return None


class _Layout:
  """What one element of a dataset is, for checkpoints of an iterator's position.

  `global_batches`: an element is one batch of the user's dataset, whatever the
  replica count (`experimental_distribute_dataset`); else an element is one
  per-replica batch per replica, so a position means different data with
  another replica count.
  """

  __slots__ = ("num_replicas", "global_batches", "max_elements")

  def __init__(self, num_replicas, global_batches, max_elements=None):
    self.num_replicas = num_replicas
    self.global_batches = global_batches
    self.max_elements = max_elements  # at most this many elements per epoch, if known


def _leaf_spec(leaf):
  if isinstance(leaf, PerReplica):
    if leaf._stacked is not None:
      return leaf._stacked.shape[1:], leaf._stacked.dtype
    first = leaf.values[0]
    if isinstance(first, torch.Tensor):
      return first.shape, first.dtype
    return type(first)
  if isinstance(leaf, torch.Tensor):
    return leaf.shape, leaf.dtype
  return type(leaf)


def _element_spec(element):
  leaves, spec = _nest.flatten(element)
  return _nest.unflatten(spec, [_leaf_spec(x) for x in leaves])


class DistributedDataset:
  """A dataset whose elements are ready for `strategy.run` (one per step).

  Made by `strategy.experimental_distribute_dataset` or
  `strategy.distribute_datasets_from_function`. Each `iter()` starts a new epoch
  (the underlying dataset is iterated again) and returns a
  `DistributedIterator` with its own prefetch thread.

  Example, 2 replicas, global batches of 4 rows::

    dist = strategy.experimental_distribute_dataset(DataLoader(data, batch_size=4))
    for x, y in dist:     # x, y: PerReplica; replica 0 has rows 0-1, replica 1 rows 2-3
      loss = strategy.run(step, args=(x, y))
  """

  def __init__(self):
    raise TypeError(
      "DistributedDataset cannot be made directly; use "
      "strategy.experimental_distribute_dataset(dataset) or "
      "strategy.distribute_datasets_from_function(dataset_fn)."
    )

  @classmethod
  def _make(cls, make_elements, sources, options, layout):
    self = cls.__new__(cls)
    self._make_elements = make_elements
    self._sources = sources  # the user's datasets (their random state is checkpointed)
    self._options = options
    self._layout = layout
    return self

  def __iter__(self):
    return DistributedIterator._make(
      self._make_elements,
      self._sources,
      self._options.experimental_per_replica_buffer_size,
      self._layout,
    )

  @property
  def element_spec(self):
    """The structure of (shape, dtype) pairs of each replica's part of an element.

    Reads the first element of a new epoch (with its own prefetch thread) to
    find out; see `DistributedIterator.element_spec`.
    """
    it = iter(self)
    try:
      return it.element_spec
    finally:
      it.close()


class OptionalElement:
  """What `DistributedIterator.get_next_as_optional` returns (TF's tf.experimental.Optional)."""

  __slots__ = ("_value",)

  def __init__(self, value=_NOTHING):
    self._value = value

  def has_value(self):
    """True when the iterator had an element."""
    return self._value is not _NOTHING

  def get_value(self):
    """The element.

    Raises:
      ValueError: the optional is empty (the iterator was exhausted).
    """
    if self._value is _NOTHING:
      raise ValueError(
        "OptionalElement.get_value: the optional is empty because the "
        "DistributedIterator had no more elements; check has_value() first."
      )
    return self._value

  def __repr__(self):
    return f"OptionalElement(has_value={self.has_value()})"


class DistributedIterator:
  """Iterates one epoch of a `DistributedDataset`; elements go to `strategy.run`.

  A background thread ("xladist-prefetch-<k>") reads the dataset, builds the
  next `experimental_per_replica_buffer_size` elements and transfers them to the
  replicas' devices while the current step runs. An exception raised in the
  dataset is re-raised by the `next()` that would have returned that element,
  with the dataset's frames in its traceback. The thread ends when the epoch
  is exhausted, when `close()` is called and when the iterator is
  garbage-collected.
  """

  def __init__(self):
    raise TypeError("DistributedIterator cannot be made directly; call iter(distributed_dataset).")

  @classmethod
  def _make(cls, make_elements, sources, depth, layout):
    self = cls.__new__(cls)
    self._peeked = _NOTHING
    self._spec = None
    self._make_elements = make_elements
    self._sources = sources
    self._depth = depth
    self._layout = layout
    self._position = 0
    # What this epoch's order is drawn from, before the dataset is iterated.
    self._order = order.capture(sources)
    self._prefetcher = prefetch.Prefetcher(self, make_elements, depth)
    return self

  def __iter__(self):
    return self

  def __next__(self):
    return self.get_next()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False

  def _take(self):
    element = self._prefetcher.get()
    if self._spec is None:
      self._spec = _element_spec(element)
    return element

  def get_next(self):
    """The next element (what `strategy.run` takes as an argument).

    Raises:
      StopIteration: the epoch is over (TF raises OutOfRangeError).
      Exception: whatever the dataset raised while making this element, or a
        ValueError for a batch of the wrong size (see InputOptions).
    """
    if self._peeked is not _NOTHING:
      element, self._peeked = self._peeked, _NOTHING
    else:
      element = self._take()
    self._position += 1
    return element

  def get_next_as_optional(self):
    """An `OptionalElement`: the next element, or empty at the end of the epoch."""
    try:
      return OptionalElement(self.get_next())
    except StopIteration:
      return OptionalElement()

  @property
  def element_spec(self):
    """The structure of the elements with each leaf described per replica.

    The element's structure (tuples, lists, dicts, namedtuples, and the
    `(element, mask)` pair with `experimental_partial_batch="mask"`) with each
    tensor or PerReplica leaf replaced by a pair `(torch.Size, torch.dtype)`:
    the shape and dtype of ONE replica's part (e.g. `(torch.Size([b, 3]),
    torch.float32)` for a global batch of N*b rows of 3 features), and every
    other leaf replaced by its type. All elements have the same spec (shapes
    never change between steps). Waits for the first element if none was read
    yet; it is kept and returned by the next `get_next()`.

    Raises:
      ValueError: the epoch has no element to describe.
    """
    if self._spec is None:
      try:
        self._peeked = self._take()
      except StopIteration:
        raise ValueError(
          "DistributedIterator.element_spec: the dataset produced no element, so "
          "there is nothing to describe; check that the dataset is not "
          "empty."
        ) from None
    return self._spec

  def state_dict(self):
    """This iterator's place in its epoch, for a checkpoint (TF checkpoints an
    iterator's position the same way; `xladist.checkpoint.Checkpoint` saves it).

    Returns:
      A dict of plain values and CPU tensors (what `torch.save` with
      `weights_only=True` reads back):

      * "position": int, the elements `next()` returned in this epoch
        (elements only prefetched are not counted);
      * "num_replicas": int, the replicas in sync of the strategy that
        distributed the dataset;
      * "global_batches": bool, True for `experimental_distribute_dataset`
        (an element is one batch of the dataset, whatever the replica count),
        False for `distribute_datasets_from_function` (an element is one
        per-replica batch for each replica);
      * "order": what this epoch's order was drawn from, taken when the epoch
        started (see xladist/input/order.py): {"host": the states of torch's,
        Python's and numpy's global generators, "generators": {path: (kind,
        state)} of the generators found on the dataset, its samplers and
        their datasets, "epochs": {path: epoch} of samplers with
        `set_epoch`}.

    Raises:
      ValueError: the dataset is a DataLoader with `persistent_workers=True`
        (its workers' random state outlives the epoch, so no state can replay
        its data).
    """
    order.check_checkpointable(self._sources, "DistributedIterator.state_dict")
    return self._state()

  def _state(self):
    """`state_dict()` without the persistent-workers refusal: what a restore's
    undo puts back (xladist/checkpoint/objects.py)."""
    return {
      "position": self._position,
      "num_replicas": self._layout.num_replicas,
      "global_batches": self._layout.global_batches,
      "order": self._order,
    }

  def load_state_dict(self, state):
    """Restarts this iterator at the place `state` holds.

    `state` is what `state_dict()` returned, possibly in another process, for
    an iterator of the same dataset (typically a fresh `iter(dist_dataset)`).
    The dataset's random sources are put back as they were when the saved
    epoch started (so a shuffled epoch is drawn in the same order), the
    dataset is iterated again from its start, and its first "position"
    elements are read and checked but neither built nor transferred to the
    devices; elements this iterator had prefetched are discarded. The next
    `get_next()` returns the element that followed the saved position.

    It leaves torch's, Python's and numpy's global generators as the epoch's
    `iter()` left them, replayed from their saved state at the start of the
    epoch; `xladist.checkpoint` then puts them back to their state at the save.
    A state without "order" (a checkpoint of an older release) draws the order
    anew. Nothing changes when `state` does not fit this iterator.

    Example::

      state = it.state_dict()            # after 3 steps of the epoch
      ...
      it = iter(dist_dataset)            # in a new process
      it.load_state_dict(state)          # next(it) is the epoch's 4th element

    Raises:
      TypeError: `state` is not a dict.
      ValueError: `state` lacks a key or has a bad position; it was saved from
        an iterator of the other kind of dataset, or of
        `distribute_datasets_from_function` with another replica count; the
        dataset now has fewer elements than the position (found now when the
        dataset has a length, else by the `next()` that reaches its end); its
        order came from a random source this dataset does not have.
    """
    self._check_state(state, "DistributedIterator.load_state_dict: the state")
    self._restart_at(state["position"], state.get("order"))

  def _check_state(self, state, where):
    """Raises TypeError or ValueError, starting with `where`, unless `state` (a
    `state_dict()`; from a sharded checkpoint's manifest, its tensors are meta
    tensors) fits this iterator. Changes nothing."""
    if not isinstance(state, dict):
      raise TypeError(
        f"{where} is a {type(state).__name__}, not the dict that "
        "DistributedIterator.state_dict() returns; pass that dict."
      )
    missing = sorted({"position", "num_replicas", "global_batches"} - set(state))
    if missing:
      raise ValueError(
        f"{where} lacks the keys {missing} of an iterator state (position, "
        "num_replicas, global_batches, order); pass the dict that "
        "DistributedIterator.state_dict() returned."
      )
    position = state["position"]
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
      raise ValueError(
        f"{where} has the position {position!r}; a position is a non-negative int "
        "(the elements next() returned in the epoch)."
      )
    if "order" in state:
      order.check(self._sources, state["order"], where)
    layout = self._layout
    if layout.max_elements is not None and position > layout.max_elements:
      raise ValueError(
        f"{where} is the iterator position {position} (elements already "
        f"taken in its epoch), but the dataset has at most {layout.max_elements} "
        "elements in an epoch now: it is shorter than when the checkpoint was "
        "saved. Restore with the dataset the checkpoint was made with."
      )
    if not state["global_batches"] and state["num_replicas"] != layout.num_replicas:
      raise ValueError(
        f"{where} is the position of a distribute_datasets_from_function iterator "
        f"with {state['num_replicas']} replicas, restored into one with "
        f"{layout.num_replicas}; its elements are per-replica batches, so the "
        "position means other data with another replica count. Restore with "
        f"{state['num_replicas']} replicas, or use experimental_distribute_dataset "
        "(positions in global batches)."
      )
    if layout.global_batches != state["global_batches"]:
      kinds = {True: "experimental_distribute_dataset", False: "distribute_datasets_from_function"}
      raise ValueError(
        f"{where} is the position of an {kinds[state['global_batches']]} iterator, "
        f"restored into an {kinds[layout.global_batches]} one; restore into an "
        "iterator of the same kind of dataset."
      )

  def _restart_at(self, position, order_state=None):
    """Restarts the epoch so that the next element is element `position` (from 0)
    (`load_state_dict`, after `_check_state`).

    With `order_state` (what `order.capture` took when the saved epoch started)
    the dataset's random sources are put back first, so the epoch is drawn in
    the same order. `_position` counts the elements `next()` returned in this
    epoch, never the ones only prefetched.
    """
    self._prefetcher.close()  # its thread may be drawing from the same generators
    if order_state is not None:
      order.apply(self._sources, order_state)
      self._order = order_state
    else:  # a checkpoint of an older release: the order is drawn anew
      self._order = order.capture(self._sources)
    self._peeked = _NOTHING
    self._position = position
    make = self._make_elements
    if position:
      make = functools.partial(make, skip=position)
    self._prefetcher = prefetch.Prefetcher(self, make, self._depth)

  def close(self):
    """Stops the prefetch thread and waits for it; later `next()` calls stop."""
    self._peeked = _NOTHING
    self._prefetcher.close()
