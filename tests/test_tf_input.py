"""TF 2's input semantics for elements without a batch dimension (issue 23).

Per-replica datasets (`distribute_datasets_from_function`) split nothing, so
TF delivers each replica its own element, scalars included; a single-replica
strategy splits nothing either. Each test mirrors the TF test named in its
docstring (tensorflow/python/distribute/input_lib_test.py,
mirrored_strategy_test.py, one_device_strategy_test.py, strategy_test_lib.py).
1 and 2 replicas: tests/test_device_counts.py (the same cases run by
tests/_device_count_worker.py).
"""

import logging
import re

import numpy as np
import pytest
import torch
from conftest import local_values
from torch.utils.data import DataLoader

import xladist as xd
from xladist import _nest

PER_REPLICA = xd.InputOptions(experimental_replication_mode=xd.InputReplicationMode.PER_REPLICA)


def _rid():
  return xd.get_replica_context().replica_id_in_sync_group


def _steps(strategy, dist):
  """Each step's per-replica values as Python numbers (nests kept)."""
  out = []
  for element in dist:
    leaves, spec = _nest.flatten(element)
    values = [[v.item() for v in local_values(strategy, x)] for x in leaves]
    out.append(_nest.unflatten(spec, values) if len(values) > 1 else values[0])
  return out


def test_per_worker_scalars_go_one_to_each_replica(strategy):
  """mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.testReplicateDataset
  (Dataset.range(10) from distribute_datasets_from_function: local results [i, i+1])
  and input_lib_test.py DistributedIteratorTest.testTwoDevicesOneGPUOneCPU
  ("input_fn"), here with 4 replicas; strategy_test_lib.py's
  _test_input_fn_iterable: StopIteration at the end, a second iter() again."""
  contexts = []

  def dataset_fn(ctx):
    contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
    return [torch.tensor(i) for i in range(12)]  # Dataset.range: int64 scalars

  dist = strategy.distribute_datasets_from_function(dataset_fn)
  assert contexts == [(1, 0, 4)]
  it = iter(dist)
  assert it.element_spec == (torch.Size([]), torch.int64)
  for step in range(3):
    x = next(it)
    assert isinstance(x, xd.PerReplica)
    assert all(v.shape == () and v.dtype == torch.int64 for v in x.values)
    assert [int(v) for v in local_values(strategy, x)] == [4 * step + r for r in range(4)]
  with pytest.raises(StopIteration):
    next(it)
  assert _steps(strategy, dist) == [[4 * s + r for r in range(4)] for s in range(3)]
  # Each replica's step sees its own 0-d element.
  out = strategy.run(lambda v: v * 100 + _rid(), args=(next(iter(dist)),))
  assert [int(v) for v in local_values(strategy, out)] == [0, 101, 202, 303]


def test_tuples_of_scalars(strategy):
  """input_lib_test.py DistributedIteratorTest.testTupleDataset ("input_fn"): a
  zip of Dataset.range(10) and its squares gives each replica (i, i**2)."""
  dist = strategy.distribute_datasets_from_function(
    lambda ctx: [(torch.tensor(i), torch.tensor(i) ** 2) for i in range(8)]
  )
  assert dist.element_spec == ((torch.Size([]), torch.int64), (torch.Size([]), torch.int64))
  assert _steps(strategy, dist) == [
    ([4 * s + r for r in range(4)], [(4 * s + r) ** 2 for r in range(4)]) for s in range(2)
  ]
  (a, b) = next(iter(dist))
  out = strategy.run(lambda x, y: y - x * x, args=(a, b))
  assert [int(v) for v in local_values(strategy, out)] == [0] * 4


def test_per_replica_pipelines_of_python_and_numpy_scalars(strategy):
  """input_lib_test.py testTupleDataset with one pipeline per replica
  (InputReplicationMode.PER_REPLICA): replica r gets pipeline r's element.
  Python and numpy numbers become tensors with the dtypes torch.tensor gives
  them (int -> int64, float -> float32, bool -> bool; TF's tf.constant makes
  an int int32, a documented difference), a numpy scalar keeps its dtype."""

  def dataset_fn(ctx):
    r = ctx.input_pipeline_id
    return [
      {"id": 10 * r + i, "w": 0.5 * r, "even": i % 2 == 0, "n": np.float64(r), "tag": "t"}
      for i in range(3)
    ]

  dist = strategy.distribute_datasets_from_function(dataset_fn, PER_REPLICA)
  assert dist.element_spec == {
    "id": (torch.Size([]), torch.int64),
    "w": (torch.Size([]), torch.float32),
    "even": (torch.Size([]), torch.bool),
    "n": (torch.Size([]), torch.float64),
    "tag": str,
  }
  steps = list(dist)
  assert len(steps) == 3
  for i, element in enumerate(steps):
    assert element["tag"] == "t"  # other leaves pass through as before
    assert [int(v) for v in local_values(strategy, element["id"])] == [10 * r + i for r in range(4)]
    assert [float(v) for v in local_values(strategy, element["w"])] == [0.5 * r for r in range(4)]
    assert [bool(v) for v in local_values(strategy, element["even"])] == [i % 2 == 0] * 4
    assert [float(v) for v in local_values(strategy, element["n"])] == [0.0, 1.0, 2.0, 3.0]
  # A Python int too large for int32 is int64 too.
  big = strategy.distribute_datasets_from_function(
    lambda ctx: [2**40 + ctx.input_pipeline_id], PER_REPLICA
  )
  (x,) = list(big)
  assert x.values[0].dtype == torch.int64
  assert [int(v) for v in local_values(strategy, x)] == [2**40 + r for r in range(4)]


def test_per_replica_elements_of_any_rank_are_taken_whole(strategy):
  """input_lib_test.py testTupleDataset's promise (each replica gets exactly its
  element) for elements whose tensors share no batch dimension: a 0-d tensor
  beside a vector, and vectors of different lengths; nothing is split."""

  def dataset_fn(ctx):
    r = ctx.input_pipeline_id
    return [(torch.tensor(float(r)), torch.full((3,), r), torch.arange(2) + r) for _ in range(2)]

  dist = strategy.distribute_datasets_from_function(dataset_fn, PER_REPLICA)
  assert dist.element_spec == (
    (torch.Size([]), torch.float32),
    (torch.Size([3]), torch.int64),
    (torch.Size([2]), torch.int64),
  )
  a, b, c = next(iter(dist))
  for r, (va, vb, vc) in enumerate(
    zip(local_values(strategy, a), local_values(strategy, b), local_values(strategy, c))
  ):
    assert float(va) == r and vb.tolist() == [r] * 3 and vc.tolist() == [r, r + 1]


def test_a_replica_whose_scalars_run_out_ends_the_epoch_as_in_tf(strategy, caplog):
  """input_lib_test.py testUnevenDatasetBatches of TF 1.14-2.0 (Dataset.range(11)
  over two devices: five steps, the 11th element unused) and input_lib.py
  `_enable_get_next_as_optional`: elements with static shapes (scalars) get no
  partial-batch handling, so the iterator ends as soon as one replica's does.
  xladist logs it (a warning); "drop" ends it quietly; "mask" goes on with zeros
  and a 0-d mask per replica (TF's multi-worker partial handling fills with
  `_dummy_tensor_fn`'s zeros) until every replica's dataset has ended."""
  caplog.set_level(logging.WARNING, logger="xladist")
  per_worker = lambda ctx: [torch.tensor(i) for i in range(10)]
  assert _steps(strategy, strategy.distribute_datasets_from_function(per_worker)) == [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
  ]
  (record,) = [r for r in caplog.records if r.name == "xladist"]
  assert re.search(
    r"no element for replicas \[2, 3\] at step 2 \(their datasets ended\): the epoch "
    r"ends here, as in TF, and the elements replicas \[0, 1\] had for this step are not used",
    record.getMessage(),
  )
  caplog.clear()
  dropped = strategy.distribute_datasets_from_function(
    per_worker, xd.InputOptions(experimental_partial_batch="drop")
  )
  assert len(list(dropped)) == 2 and not caplog.records

  masked = list(
    strategy.distribute_datasets_from_function(
      per_worker, xd.InputOptions(experimental_partial_batch="mask")
    )
  )
  assert len(masked) == 3
  last, mask = masked[2]
  assert [int(v) for v in local_values(strategy, last)] == [8, 9, 0, 0]
  assert [float(v) for v in local_values(strategy, mask)] == [1.0, 1.0, 0.0, 0.0]
  assert mask.values[0].shape == () and mask.values[0].dtype == torch.float32

  def unequal(ctx):  # pipeline r has r + 1 elements
    return [torch.tensor(10 * ctx.input_pipeline_id + i) for i in range(ctx.input_pipeline_id + 1)]

  assert _steps(strategy, strategy.distribute_datasets_from_function(unequal, PER_REPLICA)) == [
    [0, 10, 20, 30]
  ]
  options = xd.InputOptions(
    experimental_replication_mode=xd.InputReplicationMode.PER_REPLICA,
    experimental_partial_batch="mask",
  )
  got = _steps(strategy, strategy.distribute_datasets_from_function(unequal, options))
  assert got == [
    ([0, 10, 20, 30], [1.0] * 4),
    ([0, 11, 21, 31], [0.0, 1.0, 1.0, 1.0]),
    ([0, 0, 22, 32], [0.0, 0.0, 1.0, 1.0]),
    ([0, 0, 0, 33], [0.0, 0.0, 0.0, 1.0]),
  ]


def test_uneven_per_replica_batches_differ_from_tf_by_design(strategy):
  """input_lib_test.py DistributedIteratorTest.testUnevenDatasetBatches
  ("input_fn"): Dataset.range(9).batch(2) per worker gives, with
  drop_remainder=False, a last step where replica 0 has [8] and the others an
  empty batch, shapes one XLA program cannot have (docs/architecture.md,
  "Differences from TF 2"). xladist refuses it by default, before the first
  step; "mask" pads and masks those rows; "drop" gives TF's
  drop_remainder=True steps."""
  fn = lambda ctx: DataLoader(torch.arange(9), batch_size=2)
  with pytest.raises(
    ValueError,
    match=re.escape("the dataset's last per-replica batch will have 1 examples, the others 2")
    + ".*experimental_partial_batch='mask'",
  ):
    strategy.distribute_datasets_from_function(fn)
  dropped = strategy.distribute_datasets_from_function(
    fn, xd.InputOptions(experimental_partial_batch="drop")
  )
  assert [[v.tolist() for v in local_values(strategy, x)] for x in dropped] == [
    [[0, 1], [2, 3], [4, 5], [6, 7]]
  ]
  masked = strategy.distribute_datasets_from_function(
    fn, xd.InputOptions(experimental_partial_batch="mask")
  )
  steps = [
    (
      [v.tolist() for v in local_values(strategy, x)],
      [m.tolist() for m in local_values(strategy, k)],
    )
    for x, k in masked
  ]
  assert steps == [
    ([[0, 1], [2, 3], [4, 5], [6, 7]], [[1.0, 1.0]] * 4),
    ([[8, 0], [0, 0], [0, 0], [0, 0]], [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),
  ]


@pytest.mark.parametrize(
  "make", [lambda: xd.OneDeviceStrategy(), lambda: xd.get_strategy()], ids=["one_device", "default"]
)
def test_a_single_replica_gets_scalar_elements_whole(make):
  """one_device_strategy_test.py OneDeviceStrategyTest.testReplicateDataset and
  testMakeInputFnIteratorWithDataset (Dataset.range(10): local results [i]),
  input_lib_test.py DistributedIteratorTest.testOneDeviceCPU ("dataset" and
  "input_fn") and testIterableIterator: one replica splits nothing, so
  experimental_distribute_dataset takes scalars and tuples of scalars too."""
  s = make()
  device = "cpu" if s is xd.get_strategy() else "xla"
  data = [torch.tensor(i) for i in range(10)]
  for dist in (
    s.experimental_distribute_dataset(data),
    s.distribute_datasets_from_function(lambda ctx: data),
  ):
    assert dist.element_spec == (torch.Size([]), torch.int64)
    got = list(dist)
    assert all(isinstance(x, torch.Tensor) and x.shape == () for x in got)
    assert all(x.device.type == device and x.dtype == torch.int64 for x in got)
    assert [s.experimental_local_results(x)[0].item() for x in got] == list(range(10))
  pairs = s.experimental_distribute_dataset([(i, float(i) ** 2) for i in range(3)])
  assert pairs.element_spec == ((torch.Size([]), torch.int64), (torch.Size([]), torch.float32))
  assert [(a.item(), b.item()) for a, b in pairs] == [(0, 0.0), (1, 1.0), (2, 4.0)]
  a, b = next(iter(pairs))
  assert s.run(lambda x, y: x + y, args=(a, b)).item() == 0.0
  # With "mask" every element is (element, mask), whatever it holds.
  masked = s.experimental_distribute_dataset(
    data, xd.InputOptions(experimental_partial_batch="mask")
  )
  x, m = next(iter(masked))
  assert x.item() == 0 and m.shape == () and m.item() == 1.0


def test_unbatched_global_elements_are_refused_with_several_replicas(strategy):
  """TF's experimental_distribute_dataset rebatches global batches, and its
  rebatch op (tensorflow/core/kernels/data/experimental/rebatch_dataset_op.cc)
  refuses a scalar component: with N > 1 replicas a global element needs a
  batch dimension to split. The error names distribute_datasets_from_function
  as the way to give each replica its own element."""
  advice = (
    "to be split between the 4 replicas. Batch the dataset (global batches of 4 x the "
    "per-replica batch size), or give each replica its own elements with "
    "strategy.distribute_datasets_from_function"
  )
  with pytest.raises(
    ValueError,
    match=re.escape("a batch holds a scalar tensor (tensor(1)); ") + ".*" + re.escape(advice),
  ):
    list(strategy.experimental_distribute_dataset([torch.tensor(1)]))
  with pytest.raises(
    ValueError, match=re.escape("a batch holds no tensor, so it has no batch dimension " + advice)
  ):
    list(strategy.experimental_distribute_dataset([1, 2]))


def test_unbatched_elements_whose_shapes_change_are_refused(strategy):
  """One XLA program per shape: a per-replica element without a batch dim must
  keep its shape and dtype (TF's element_spec is fixed by the dataset too)."""

  def dataset_fn(ctx):
    return [torch.zeros(()), torch.zeros(()), torch.zeros(()), torch.zeros(2)] * 2

  it = iter(strategy.distribute_datasets_from_function(dataset_fn))
  with pytest.raises(
    ValueError,
    match=re.escape("per-replica element 3 of the epoch does not match the element_spec")
    + r".*\[\(2,\) torch.float32\] \(shape, dtype\), the first was .*\[\(\) torch.float32\] "
    r"\(shape, dtype\)\..*taken whole",
  ):
    next(it)
  it = iter(strategy.distribute_datasets_from_function(lambda ctx: [1] * 4 + [1.0] * 4))
  next(it)
  with pytest.raises(ValueError, match=r"\(\) torch.float32\].*the first was .*\(\) torch.int64"):
    next(it)
  with pytest.raises(
    ValueError,
    match=re.escape("a per-replica batch holds a scalar tensor (tensor(0)); ")
    + ".*as the first per-replica batch had",
  ):
    list(
      strategy.distribute_datasets_from_function(
        lambda ctx: [torch.zeros(2)] * 4 + [torch.tensor(0)] * 4
      )
    )


def test_position_of_an_iterator_of_scalars_is_restored(strategy):
  """tensorflow/python/data/kernel_tests/checkpoint_test.py
  testSaveRestoreOneShotIterator (an iterator saved mid-epoch goes on with the
  next element after a restore), for per-replica scalars: the position counts
  steps; a position past the end of a shorter epoch is refused. Through
  xladist.checkpoint, with a shuffled DataLoader: tests/test_checkpoint.py."""
  fn = lambda ctx: [torch.tensor(10 * ctx.input_pipeline_id + i) for i in range(5)]
  dist = strategy.distribute_datasets_from_function(fn, PER_REPLICA)
  with iter(dist) as it:
    next(it), next(it)
    state = it.state_dict()
  assert state["position"] == 2 and not state["global_batches"]
  with iter(dist) as fresh:
    fresh.load_state_dict(state)
    assert _steps(strategy, fresh) == [[i, 10 + i, 20 + i, 30 + i] for i in (2, 3, 4)]
  short = strategy.distribute_datasets_from_function(
    lambda ctx: [torch.tensor(0)] if ctx.input_pipeline_id else [torch.tensor(0)] * 3, PER_REPLICA
  )
  with iter(short) as it:
    it.load_state_dict(state)
    with pytest.raises(ValueError, match=r"restored to position 2 \(steps already taken"):
      next(it)
