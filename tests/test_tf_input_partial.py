"""Partial batches measured against the DataLoader's own batch size.

TF's partial-batch semantics (strategy_common_test.py
testSimpleInputFromDatasetLastPartialBatch / testSimpleInputFromFnLastPartialBatch:
a batch smaller than the batch size is split over the replicas, the last
replicas getting fewer rows) with xladist's `experimental_partial_batch="mask"`
padding. Expected values are computed here with numpy.
"""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import xladist as xd

N = 4
MASK = xd.InputOptions(experimental_partial_batch="mask")


def _local(strategy, value):
  return [np.asarray(torch.as_tensor(v).cpu()) for v in strategy.experimental_local_results(value)]


def _expected_global(examples, global_batch):
  """Rows 0..examples-1 in global batches padded with zeros, split over N
  replicas: (values, mask) per batch, each (N, per-replica rows)."""
  out = []
  for start in range(0, examples, global_batch):
    rows = np.zeros(global_batch, np.float32)
    mask = np.zeros(global_batch, np.float32)
    real = np.arange(start, min(start + global_batch, examples), dtype=np.float32)
    rows[: len(real)] = real
    mask[: len(real)] = 1.0
    out.append((rows.reshape(N, -1), mask.reshape(N, -1)))
  return out


def test_a_dataset_smaller_than_one_global_batch_is_masked(strategy):
  """7 examples, DataLoader(batch_size=8): the one batch is partial (8 is the
  global batch size, not 7); with "mask" replica 3 gets [6, pad] and mask
  [1, 0]. Before, 7 was taken as the batch size and refused as not divisible."""
  data = torch.arange(7, dtype=torch.float32)
  loader = DataLoader(TensorDataset(data), batch_size=8)
  elements = list(strategy.experimental_distribute_dataset(loader, options=MASK))
  want = _expected_global(7, 8)
  assert len(elements) == len(want) == 1
  for ((x,), mask), (rows, mask_want) in zip(elements, want):
    np.testing.assert_array_equal(np.stack(_local(strategy, x)), rows)
    np.testing.assert_array_equal(np.stack(_local(strategy, mask)), mask_want)


def test_the_masked_rows_give_the_exact_global_mean(strategy):
  """The mask makes a step's loss the mean over the real rows only."""
  data = torch.arange(7, dtype=torch.float32) * 1.5
  loader = DataLoader(TensorDataset(data), batch_size=8)
  ((x,), mask) = next(iter(strategy.experimental_distribute_dataset(loader, options=MASK)))
  sums = strategy.run(lambda x, m: torch.stack([(x * m).sum(), m.sum()]), args=(x, mask))
  total = strategy.reduce("sum", sums, axis=None).cpu()
  assert float(total[0] / total[1]) == pytest.approx(float(data.numpy().mean()))


def test_without_options_a_short_only_batch_the_replicas_cannot_share_is_refused(strategy):
  """Without options the only batch is taken as it is (one batch, one shape)
  when the replicas can share it; 7 rows over 4 replicas are refused before
  any step, naming the DataLoader's batch size (not 7 as a "global batch
  size"). "drop" drops it, as TF's drop_remainder."""
  loader = DataLoader(TensorDataset(torch.arange(7.0)), batch_size=8)
  with pytest.raises(
    ValueError,
    match=r"only batch has 7 examples, fewer than its batch size 8 \(the DataLoader's "
    r"batch_size\), and 7 rows cannot be split evenly over the 4 replicas",
  ):
    strategy.experimental_distribute_dataset(loader)
  dropped = strategy.experimental_distribute_dataset(
    loader, options=xd.InputOptions(experimental_partial_batch="drop")
  )
  assert list(dropped) == []
  # An IterableDataset has no length: the check comes with the batch.
  streamed = DataLoader(_Stream(7), batch_size=8)
  with pytest.raises(ValueError, match="only batch has 7 examples.*split evenly over the 4"):
    list(strategy.experimental_distribute_dataset(streamed))
  ((x,), mask) = next(iter(strategy.experimental_distribute_dataset(streamed, options=MASK)))
  rows, mask_want = _expected_global(7, 8)[0]
  np.testing.assert_array_equal(np.stack(_local(strategy, x)), rows)
  np.testing.assert_array_equal(np.stack(_local(strategy, mask)), mask_want)
  eight = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=16)
  ((x,),) = list(strategy.experimental_distribute_dataset(eight))
  np.testing.assert_array_equal(np.stack(_local(strategy, x)), np.arange(8.0).reshape(N, 2))


class _Stream(torch.utils.data.IterableDataset):
  """Examples 0..n-1 as 1-tuples, without a length."""

  def __init__(self, n):
    self._n = n

  def __iter__(self):
    return ((torch.tensor(float(i)),) for i in range(self._n))


def test_a_last_partial_batch_is_still_measured_against_the_full_ones(strategy):
  """strategy_common_test.py testSimpleInputFromDatasetLastPartialBatch's
  shape: 14 examples in batches of 8 give a full batch and one of 6 rows."""
  loader = DataLoader(TensorDataset(torch.arange(14, dtype=torch.float32)), batch_size=8)
  elements = list(strategy.experimental_distribute_dataset(loader, options=MASK))
  want = _expected_global(14, 8)
  assert len(elements) == 2
  for ((x,), mask), (rows, mask_want) in zip(elements, want):
    np.testing.assert_array_equal(np.stack(_local(strategy, x)), rows)
    np.testing.assert_array_equal(np.stack(_local(strategy, mask)), mask_want)


def test_an_iterator_that_is_not_a_plain_dataloader_takes_the_first_batch_size(strategy):
  """A DataLoader whose collate_fn makes batches of another size (here twice
  the items) is measured by its first batch, as before."""
  items = torch.arange(8, dtype=torch.float32)
  loader = DataLoader(items, batch_size=4, collate_fn=lambda b: torch.stack(b).repeat(2))
  elements = list(strategy.experimental_distribute_dataset(loader))
  assert len(elements) == 2
  np.testing.assert_array_equal(
    np.concatenate(_local(strategy, elements[0])), np.tile(np.arange(4, dtype=np.float32), 2)
  )


def test_per_replica_batches_smaller_than_the_loaders_batch_size_are_masked(strategy):
  """strategy_common_test.py testSimpleInputFromFnLastPartialBatch's shape:
  a per-replica DataLoader(batch_size=4) over 3 examples gives replica 0 a
  batch of 3 real rows padded to 4 (mask [1, 1, 1, 0]) and the other
  replicas none (mask 0). Before, 3 was taken as the batch size."""

  def dataset_fn(ctx):
    return DataLoader(TensorDataset(torch.arange(3, dtype=torch.float32) + 1), batch_size=4)

  dist = strategy.distribute_datasets_from_function(dataset_fn, options=MASK)
  elements = list(dist)
  assert len(elements) == 1
  (x,), mask = elements[0]
  rows = np.zeros((N, 4), np.float32)
  rows[0, :3] = [1.0, 2.0, 3.0]
  mask_want = np.zeros((N, 4), np.float32)
  mask_want[0, :3] = 1.0
  np.testing.assert_array_equal(np.stack(_local(strategy, x)), rows)
  np.testing.assert_array_equal(np.stack(_local(strategy, mask)), mask_want)
