"""`DistributedDataset` and `DistributedIterator`: input ready for `strategy.run`.

`from_dataset` and `from_datasets` make the datasets of
`experimental_distribute_dataset` and `distribute_datasets_from_function`
(whose elements `builder.py` builds, checked first by `checks.py`); the
iterator reads one epoch through its prefetch thread (`prefetch.py`), and saves
and restores its position for checkpoints.
"""

import functools

import torch

from xladist import _nest
from xladist.input import order, prefetch
from xladist.input.builder import _Builder, _global_batch_elements, _per_replica_elements

# check_dataset: re-exported, the strategies call it as input_dataset.check_dataset.
from xladist.input.checks import check_dataset as check_dataset
from xladist.input.checks import check_last_batch
from xladist.input.options import InputReplicationMode
from xladist.input.sharding import host_replica_ids
from xladist.values import PerReplica

_NOTHING = object()


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
