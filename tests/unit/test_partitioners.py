"""Variable partitioners (xladist/partitioners.py): partitions per dimension and shard rows.

The shard counts are TF's (tensorflow/python/ops/partitioned_variables.py:
`min_max_variable_partitioner` and `variable_axis_size_partitioner`, which
tf.distribute.experimental.partitioners call): a row of `row_bytes` bytes, `k =
max(1, floor(bound / row_bytes))` rows per shard, `ceil(rows / k)` shards, at most
`max_shards` and at most `rows`. Each expected count below is worked out by hand in
its comment.
"""

import numpy as np
import pytest
import torch

from xladist import partitioners as P

F32 = torch.float32


@pytest.mark.parametrize(
  "num_shards, shape, axis, expected",
  [
    (2, (10, 3), 0, [2, 1]),
    (5, (3, 2), 0, [3, 1]),  # fewer rows than shards: one row each
    (4, (0, 3), 0, [1, 1]),  # no rows: one (empty) shard
    (3, (4, 6), 1, [1, 3]),  # another axis
    (1, (7,), 0, [1]),
    (8, torch.Size([16, 2, 2]), 0, [8, 1, 1]),
  ],
)
def test_fixed_shards(num_shards, shape, axis, expected):
  assert P.FixedShardsPartitioner(num_shards)(shape, F32, axis=axis) == expected


@pytest.mark.parametrize(
  "kwargs, shape, dtype, expected",
  [
    # row 5 * 4 = 20 bytes; 100 // 20 = 5 rows per shard; ceil(50 / 5) = 10
    (dict(min_shard_bytes=100, max_shards=100), (50, 5), F32, [10, 1]),
    # ceil(51 / 5) = 11 (the last shard holds one row)
    (dict(min_shard_bytes=100, max_shards=100), (51, 5), F32, [11, 1]),
    # ceil(49 / 5) = 10
    (dict(min_shard_bytes=100, max_shards=100), (49, 5), F32, [10, 1]),
    (dict(min_shard_bytes=100, max_shards=4), (50, 5), F32, [4, 1]),
    (dict(min_shard_bytes=100), (50, 5), F32, [1, 1]),  # max_shards defaults to 1
    # float16: row 10 bytes, 10 rows per shard, ceil(50 / 10) = 5
    (dict(min_shard_bytes=100, max_shards=100), (50, 5), torch.float16, [5, 1]),
    # int8: row 5 bytes, 20 rows per shard, ceil(50 / 20) = 3
    (dict(min_shard_bytes=100, max_shards=100), (50, 5), torch.int8, [3, 1]),
    # float64: row 40 bytes, 100 // 40 = 2 rows per shard, 25 shards
    (dict(min_shard_bytes=100, max_shards=100), (50, 5), torch.float64, [25, 1]),
    # a row larger than the bound: one row per shard, at most `rows` shards
    (dict(min_shard_bytes=4, max_shards=100), (6, 3), F32, [6, 1]),
    # TF's own cases (sharded_variable_test.py)
    (dict(min_shard_bytes=4, max_shards=2), (6, 1), F32, [2, 1]),
    (dict(min_shard_bytes=4, max_shards=10), (6, 1), F32, [6, 1]),
    # 256 KiB default; 1000 x 10 float32 is 40 kB: one shard
    (dict(max_shards=8), (1000, 10), F32, [1, 1]),
    # 100000 x 10 float32: row 40 B, 6553 rows per shard, ceil(100000 / 6553) = 16 -> 8
    (dict(max_shards=8), (100000, 10), F32, [8, 1]),
    (dict(min_shard_bytes=100, max_shards=100), (0, 5), F32, [1, 1]),
  ],
)
def test_min_size(kwargs, shape, dtype, expected):
  assert P.MinSizePartitioner(**kwargs)(shape, dtype) == expected


@pytest.mark.parametrize(
  "kwargs, shape, dtype, expected",
  [
    # row 20 bytes, 5 rows per shard: ceil(50 / 5) = 10, ceil(51 / 5) = 11
    (dict(max_shard_bytes=100), (50, 5), F32, [10, 1]),
    (dict(max_shard_bytes=100), (51, 5), F32, [11, 1]),
    (dict(max_shard_bytes=119), (50, 5), F32, [10, 1]),  # floor(119 / 20) = 5
    (dict(max_shard_bytes=120), (50, 5), F32, [9, 1]),  # 6 rows per shard: ceil(50 / 6) = 9
    (dict(max_shard_bytes=100, max_shards=7), (50, 5), F32, [7, 1]),
    (dict(max_shard_bytes=10), (50, 5), F32, [50, 1]),  # a row over the bound: one per shard
    (dict(max_shard_bytes=100), (50, 5), torch.float64, [25, 1]),  # 2 rows per shard
    (dict(max_shard_bytes=100), (50, 5), torch.bfloat16, [5, 1]),  # 10 rows per shard
    (dict(max_shard_bytes=4), (6, 1), F32, [6, 1]),  # TF's cases
    (dict(max_shard_bytes=4, max_shards=2), (6, 1), F32, [2, 1]),
    (dict(max_shard_bytes=1024), (6, 1), F32, [1, 1]),
    (dict(max_shard_bytes=32), (6, 2), torch.float64, [3, 1]),
    (dict(max_shard_bytes=8), (0, 2), F32, [1, 1]),
  ],
)
def test_max_size(kwargs, shape, dtype, expected):
  assert P.MaxSizePartitioner(**kwargs)(shape, dtype) == expected


def test_the_partitioned_axis_sets_the_row():
  # axis 1 of (5, 50): a "row" is 5 float32s = 20 bytes: 5 per 100-byte shard, 10 shards
  assert P.MinSizePartitioner(100, max_shards=100)((5, 50), F32, axis=1) == [1, 10]
  assert P.MaxSizePartitioner(100)((5, 50), F32, axis=1) == [1, 10]
  # axis 0: 200-byte rows, over the bound: one row per shard, 5 shards
  assert P.MaxSizePartitioner(100)([5, 50], F32) == [5, 1]


@pytest.mark.parametrize(
  "make",
  [
    lambda v: P.FixedShardsPartitioner(v),
    lambda v: P.MinSizePartitioner(min_shard_bytes=v),
    lambda v: P.MinSizePartitioner(max_shards=v),
    lambda v: P.MinSizePartitioner(bytes_per_string=v),
    lambda v: P.MaxSizePartitioner(max_shard_bytes=v),
    lambda v: P.MaxSizePartitioner(8, max_shards=v),
    lambda v: P.MaxSizePartitioner(8, bytes_per_string=v),
  ],
  ids=[
    "fixed num_shards",
    "min min_shard_bytes",
    "min max_shards",
    "min bytes_per_string",
    "max max_shard_bytes",
    "max max_shards",
    "max bytes_per_string",
  ],
)
def test_arguments_must_be_positive_ints(make):
  for bad in (0, -1, 2.0, True, "2"):
    with pytest.raises(ValueError, match=r"`\w+` must be a positive int, got " + repr(bad)):
      make(bad)
  make(1)


def test_the_arguments_error_names_the_class_and_the_argument():
  with pytest.raises(ValueError) as info:
    P.MaxSizePartitioner(max_shard_bytes=0)
  assert str(info.value) == "MaxSizePartitioner: `max_shard_bytes` must be a positive int, got 0."
  assert repr(P.MaxSizePartitioner(8)) == "MaxSizePartitioner(max_shard_bytes=8, max_shards=None)"


@pytest.mark.parametrize(
  "partitioner",
  [P.FixedShardsPartitioner(2), P.MinSizePartitioner(4, 2), P.MaxSizePartitioner(4)],
  ids=["fixed", "min", "max"],
)
def test_shapes_axes_and_dtypes_that_cannot_be_partitioned(partitioner):
  name = type(partitioner).__name__
  with pytest.raises(ValueError, match=rf"^{name}: a scalar \(shape \(\)\) cannot be partitioned"):
    partitioner((), F32)
  with pytest.raises(ValueError, match=rf"^{name}: axis 2 is out of range for shape \(4, 3\)"):
    partitioner((4, 3), F32, axis=2)
  with pytest.raises(ValueError, match="axis -1 is out of range"):
    partitioner((4, 3), F32, axis=-1)
  with pytest.raises(TypeError, match=rf"^{name}: dtype must be a torch.dtype, got str"):
    partitioner((4, 3), "float32")


def test_reprs_and_the_base_class():
  assert repr(P.FixedShardsPartitioner(3)) == "FixedShardsPartitioner(num_shards=3)"
  assert repr(P.MinSizePartitioner(10, 2)) == "MinSizePartitioner(min_shard_bytes=10, max_shards=2)"
  assert repr(P.MaxSizePartitioner(10, 2)) == "MaxSizePartitioner(max_shard_bytes=10, max_shards=2)"
  with pytest.raises(NotImplementedError):
    P.Partitioner()((4,), F32)


def test_shard_rows_by_hand():
  assert P.shard_rows(10, 3) == [(0, 4), (4, 3), (7, 3)]
  assert P.shard_rows(11, 3) == [(0, 4), (4, 4), (8, 3)]
  assert P.shard_rows(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
  assert P.shard_rows(0, 2) == [(0, 0), (0, 0)]


def test_shard_rows_is_numpys_array_split():
  """numpy.array_split gives the first `rows % n` parts one more row: TF's layout."""
  for rows in range(0, 23):
    for n in range(1, 8):
      parts = np.array_split(np.arange(rows), n)
      starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])[:-1]])
      assert P.shard_rows(rows, n) == [(int(s), len(p)) for s, p in zip(starts, parts)]
