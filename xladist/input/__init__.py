"""Distributed input: datasets whose elements are ready for `strategy.run`.

* `options.py`: `InputContext`, `InputOptions`, `InputReplicationMode`.
* `dataset.py`: `DistributedDataset` and `DistributedIterator` (making the
  datasets, iterating an epoch, saving and restoring an iterator's position).
* `builder.py`: turning batches into elements (splitting global batches,
  stacking per-replica ones, padding or dropping partial ones, placing the shards).
* `checks.py`: checks of a dataset (re-iterable, its declared batch size, a short
  last batch refused before any step) and the errors for batches of the wrong size.
* `elements.py`: what one element is (its leaves, whether it has a batch
  dimension, Python numbers as tensors) and the element_spec check.
* `prefetch.py`: the background thread that builds and transfers the next
  elements while the current step runs.
* `sharding.py`: multi-host input, which rows of each global batch a host feeds.

The public names are re-exported by `xladist/__init__.py`.
"""
