"""Distributed input: experimental_distribute_dataset, distribute_datasets_from_function."""

import collections
import dataclasses
import gc
import re
import threading
import traceback

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import xladist as xd
from xladist.input import prefetch
from xladist.runtime import xla as _runtime

Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Batch:
  x: torch.Tensor
  y: torch.Tensor
  tag: str = "train"


def replica_rows(strategy, value):
  """The per-replica components of `value`, read back to the host and stacked."""
  return torch.stack([torch.as_tensor(v).cpu() for v in strategy.experimental_local_results(value)])


def prefetch_threads():
  return [
    t for t in threading.enumerate() if t.name.startswith(prefetch.THREAD_NAME) and t.is_alive()
  ]


def features(n, width=3):
  return torch.arange(n * width, dtype=torch.float32).reshape(n, width)


def test_replica_r_gets_rows_r_b_to_r_plus_1_b(strategy):
  x, y = features(16), torch.arange(16)
  loader = DataLoader(TensorDataset(x, y), batch_size=8)
  dist = strategy.experimental_distribute_dataset(loader)
  elements = list(dist)
  assert len(elements) == 2
  for step, (px, py) in enumerate(elements):
    assert isinstance(px, xd.PerReplica) and isinstance(py, xd.PerReplica)
    got_x, got_y = replica_rows(strategy, px), replica_rows(strategy, py)
    for r in range(4):
      rows = slice(step * 8 + r * 2, step * 8 + (r + 1) * 2)
      np.testing.assert_array_equal(got_x[r].numpy(), x[rows].numpy())
      np.testing.assert_array_equal(got_y[r].numpy(), y[rows].numpy())
  # The elements go straight into strategy.run: each replica sees its own rows.
  out = strategy.run(lambda a, b: a.sum(1) + b, args=elements[0])
  expected = (x[:8].sum(1) + y[:8]).reshape(4, 2)
  np.testing.assert_array_equal(replica_rows(strategy, out).numpy(), expected.numpy())


def test_two_epochs_give_the_same_batches(strategy):
  loader = DataLoader(TensorDataset(features(12)), batch_size=4)
  dist = strategy.experimental_distribute_dataset(
    loader, xd.InputOptions(experimental_per_replica_buffer_size=3)
  )
  epochs = [[replica_rows(strategy, x) for (x,) in dist] for _ in range(2)]
  assert len(epochs[0]) == 3
  for a, b in zip(*epochs):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  np.testing.assert_array_equal(
    torch.cat([e.reshape(4, 3) for e in epochs[1]]).numpy(), features(12).numpy()
  )


def test_nested_structures_namedtuples_and_plain_leaves(strategy):
  x = features(8)
  batches = [{"pair": Pair(x, x * 10), "ids": np.arange(8), "name": "train", "none": None}]
  dist = strategy.experimental_distribute_dataset(batches)
  (element,) = list(dist)
  assert set(element) == {"pair", "ids", "name", "none"}
  assert isinstance(element["pair"], Pair)
  assert element["name"] == "train" and element["none"] is None
  np.testing.assert_array_equal(
    replica_rows(strategy, element["pair"].b).numpy(), (x * 10).reshape(4, 2, 3).numpy()
  )
  np.testing.assert_array_equal(
    replica_rows(strategy, element["ids"]).numpy(), np.arange(8).reshape(4, 2)
  )
  it = iter(dist)
  spec = it.element_spec
  assert spec["pair"] == Pair(
    (torch.Size([2, 3]), torch.float32), (torch.Size([2, 3]), torch.float32)
  )
  assert spec["ids"] == (torch.Size([2]), torch.int64)
  assert spec["name"] is str
  # Reading the spec does not consume the element.
  assert next(it)["name"] == "train"
  assert dist.element_spec["ids"] == (torch.Size([2]), torch.int64)


def test_a_dataclass_batch_is_split_like_a_tuple(strategy):
  # A dataclass is a nest in a batch as in a step's result (xladist/_nest.py):
  # its tensor fields are split over the replicas, a plain field passes whole.
  x, y = features(16), torch.arange(16)
  as_tuples = list(strategy.experimental_distribute_dataset([(x[:8], y[:8]), (x[8:], y[8:])]))
  dist = strategy.experimental_distribute_dataset([Batch(x[:8], y[:8]), Batch(x[8:], y[8:])])
  elements = list(dist)
  assert len(elements) == 2
  for element, (tx, ty) in zip(elements, as_tuples):
    assert isinstance(element, Batch) and element.tag == "train"
    assert isinstance(element.x, xd.PerReplica) and isinstance(element.y, xd.PerReplica)
    np.testing.assert_array_equal(replica_rows(strategy, element.x), replica_rows(strategy, tx))
    np.testing.assert_array_equal(replica_rows(strategy, element.y), replica_rows(strategy, ty))
  assert dist.element_spec == Batch(
    (torch.Size([2, 3]), torch.float32), (torch.Size([2]), torch.int64), str
  )
  out = strategy.run(lambda b: b.x.sum(1) + b.y, args=(elements[0],))
  expected = (x[:8].sum(1) + y[:8]).reshape(4, 2)
  np.testing.assert_array_equal(replica_rows(strategy, out).numpy(), expected.numpy())

  def dataset_fn(ctx):
    b = ctx.get_per_replica_batch_size(8)
    i = ctx.input_pipeline_id
    return [Batch(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])]

  options = xd.InputOptions(experimental_replication_mode=xd.InputReplicationMode.PER_REPLICA)
  (element,) = list(strategy.distribute_datasets_from_function(dataset_fn, options))
  assert isinstance(element, Batch)
  first_x = replica_rows(strategy, as_tuples[0][0])
  np.testing.assert_array_equal(replica_rows(strategy, element.x), first_x)


def test_get_next_as_optional_and_the_end_of_an_epoch(strategy):
  dist = strategy.experimental_distribute_dataset([features(4)])
  it = iter(dist)
  first = it.get_next_as_optional()
  assert first.has_value()
  np.testing.assert_array_equal(
    replica_rows(strategy, first.get_value()).numpy(), features(4).reshape(4, 1, 3).numpy()
  )
  empty = it.get_next_as_optional()
  assert not empty.has_value()
  with pytest.raises(
    ValueError,
    match=re.escape("the optional is empty because the DistributedIterator had no more elements"),
  ):
    empty.get_value()
  with pytest.raises(StopIteration):
    it.get_next()
  assert it.element_spec == (torch.Size([1, 3]), torch.float32)  # kept after the end
  with pytest.raises(ValueError, match="the dataset produced no element"):
    iter(strategy.experimental_distribute_dataset([])).element_spec


def test_per_replica_mode_gives_each_replica_its_own_pipeline(strategy):
  contexts = []

  def dataset_fn(ctx):
    contexts.append(ctx)
    b = ctx.get_per_replica_batch_size(8)
    pid = ctx.input_pipeline_id
    return [torch.full((b, 2), float(10 * pid + step)) for step in range(3)]

  options = xd.InputOptions(experimental_replication_mode=xd.InputReplicationMode.PER_REPLICA)
  dist = strategy.distribute_datasets_from_function(dataset_fn, options)
  assert [
    (c.input_pipeline_id, c.num_input_pipelines, c.num_replicas_in_sync) for c in contexts
  ] == [(i, 4, 4) for i in range(4)]
  elements = list(dist)
  assert len(elements) == 3
  for step, element in enumerate(elements):
    expected = torch.tensor([10.0 * r + step for r in range(4)]).reshape(4, 1, 1).expand(4, 2, 2)
    np.testing.assert_array_equal(replica_rows(strategy, element).numpy(), expected.numpy())
  assert len(contexts) == 4  # dataset_fn is not called again for a new epoch
  assert len(list(dist)) == 3


def test_per_worker_function_takes_consecutive_per_replica_batches(strategy):
  contexts = []

  def dataset_fn(ctx):
    contexts.append(ctx)
    return DataLoader(TensorDataset(torch.arange(16)), batch_size=ctx.get_per_replica_batch_size(8))

  dist = strategy.distribute_datasets_from_function(dataset_fn)
  assert [(c.input_pipeline_id, c.num_input_pipelines) for c in contexts] == [(0, 1)]
  got = [replica_rows(strategy, x) for (x,) in dist]
  np.testing.assert_array_equal(torch.stack(got).numpy(), np.arange(16).reshape(2, 4, 2))


class FailingDataset(IterableDataset):
  """Yields two batches, then fails."""

  def __iter__(self):
    for i in range(2):
      yield torch.full((4, 2), float(i))
    raise KeyError("the record store went away after 2 batches")


def test_an_error_in_the_dataset_reaches_the_training_loop(strategy):
  dist = strategy.experimental_distribute_dataset(
    DataLoader(FailingDataset(), batch_size=None),
    xd.InputOptions(experimental_per_replica_buffer_size=2),
  )
  seen = []
  with pytest.raises(KeyError, match="the record store went away after 2 batches") as info:
    for x in dist:
      seen.append(replica_rows(strategy, strategy.run(lambda v: v * 2, args=(x,))))
  assert [float(s[0, 0, 0]) for s in seen] == [0.0, 2.0]  # the 2 good batches arrived
  frames = [(f.name, f.filename) for f in traceback.extract_tb(info.tb)]
  assert ("__iter__", __file__) in frames  # the dataset's own frame
  assert not prefetch_threads()


def test_no_prefetch_thread_is_left_behind(strategy):
  dist = strategy.experimental_distribute_dataset(
    DataLoader(TensorDataset(features(40)), batch_size=4)
  )
  it = iter(dist)
  next(it)
  assert len(prefetch_threads()) == 1
  it.close()
  assert not prefetch_threads()
  with pytest.raises(StopIteration):
    next(it)

  assert len(list(dist)) == 10  # exhausted
  assert not prefetch_threads()

  for _ in dist:
    break  # the abandoned iterator is garbage-collected
  gc.collect()
  assert not prefetch_threads()

  with iter(dist) as it:
    next(it)
  assert not prefetch_threads()


def _eval_data(n=22):
  g = torch.Generator().manual_seed(3)
  return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_masked_evaluation_matches_single_device_and_does_not_recompile(strategy):
  x, y = _eval_data()
  torch.manual_seed(0)
  reference = torch.nn.Linear(6, 3)
  expected_correct = int((reference(x).argmax(1) == y).sum())
  with strategy.scope():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)

  def step(inputs, mask):
    xb, yb = inputs
    correct = (model(xb).argmax(1) == yb).to(torch.float32)
    return (correct * mask).sum(), mask.sum()

  dist = strategy.experimental_distribute_dataset(
    DataLoader(TensorDataset(x, y), batch_size=8),
    xd.InputOptions(experimental_partial_batch="mask"),
  )

  def evaluate():
    correct = count = 0.0
    for inputs, mask in dist:
      c, n = strategy.run(step, args=(inputs, mask))
      _runtime.sync()
      correct = correct + strategy.reduce("sum", c, axis=None)
      count = count + strategy.reduce("sum", n, axis=None)
    return float(correct), float(count)

  assert evaluate() == (expected_correct, 22.0)  # warm-up: every program compiles
  # With replay (the default) the running totals' programs outside fn settle one
  # pass later: the first pass traced the step and its reduction as one program.
  assert evaluate() == (expected_correct, 22.0)
  before = _runtime.compile_count()
  assert evaluate() == (expected_correct, 22.0)
  assert _runtime.compile_count() == before


class _LazyLoader:
  """A DataLoader behind an object that does not tell its size (checked lazily)."""

  def __init__(self, examples, batch_size):
    self.loader = DataLoader(TensorDataset(torch.arange(examples)), batch_size=batch_size)

  def __iter__(self):
    return iter(self.loader)


def test_partial_batches_mask_drop_and_the_default_error(strategy):
  loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=4)
  masked = list(
    strategy.experimental_distribute_dataset(
      loader, xd.InputOptions(experimental_partial_batch="mask")
    )
  )
  assert len(masked) == 3
  (last,), mask = masked[2]
  np.testing.assert_array_equal(replica_rows(strategy, last).numpy(), [[8], [9], [0], [0]])
  np.testing.assert_array_equal(replica_rows(strategy, mask).numpy(), [[1.0], [1.0], [0.0], [0.0]])
  assert mask.values[0].dtype == torch.float32
  kept = torch.cat(
    [
      replica_rows(strategy, v).flatten()[replica_rows(strategy, m).flatten() > 0]
      for (v,), m in masked
    ]
  )
  np.testing.assert_array_equal(kept.numpy(), np.arange(10))  # nothing lost or repeated

  dropped = list(
    strategy.experimental_distribute_dataset(
      loader, xd.InputOptions(experimental_partial_batch="drop")
    )
  )
  assert [replica_rows(strategy, v).flatten().tolist() for (v,) in dropped] == [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
  ]

  # A dataset that does not tell its sizes is refused at the short batch itself
  # (a DataLoader is refused before the first step: test_input_fail_fast.py).
  class Unsized:
    def __iter__(self):
      return iter(loader)

  it = iter(strategy.experimental_distribute_dataset(Unsized()))
  next(it), next(it)
  with pytest.raises(
    ValueError,
    match=re.escape(
      "a batch of 2 examples came after batches of 4 (the size taken from the first batch)"
    )
    + ".*experimental_partial_batch='mask'.*experimental_partial_batch='drop'",
  ):
    next(it)
  assert not prefetch_threads()

  with pytest.raises(
    ValueError,
    match=re.escape(
      "the global batch size 6 (taken from the first batch) is not divisible by the 4 replicas"
    ),
  ):
    list(strategy.experimental_distribute_dataset(_LazyLoader(12, 6)))
  with pytest.raises(
    ValueError, match=re.escape("a batch of 8 examples came after a first batch of 4")
  ):
    list(strategy.experimental_distribute_dataset([torch.zeros(4), torch.zeros(8)]))


def test_per_replica_pipelines_that_run_out_early_are_masked(strategy):
  def dataset_fn(ctx):
    n = 3 if ctx.input_pipeline_id == 0 else 2  # pipeline 0 has one more row
    return [torch.arange(n) + 100 * ctx.input_pipeline_id]

  options = xd.InputOptions(
    experimental_replication_mode=xd.InputReplicationMode.PER_REPLICA,
    experimental_partial_batch="mask",
  )
  ((element, mask),) = list(strategy.distribute_datasets_from_function(dataset_fn, options))
  np.testing.assert_array_equal(
    replica_rows(strategy, element).numpy(),
    [[0, 1, 2], [100, 101, 0], [200, 201, 0], [300, 301, 0]],
  )
  np.testing.assert_array_equal(
    replica_rows(strategy, mask).numpy(), [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]]
  )


def test_fetch_to_device_false_keeps_host_tensors(strategy):
  x = features(8)
  dist = strategy.experimental_distribute_dataset(
    [x], xd.InputOptions(experimental_fetch_to_device=False)
  )
  (element,) = list(dist)
  assert isinstance(element, xd.PerReplica)
  assert all(v.device.type == "cpu" for v in element.values)
  np.testing.assert_array_equal(torch.stack(element.values).numpy(), x.reshape(4, 2, 3).numpy())
  out = strategy.run(lambda v: v * 2, args=(element,))
  np.testing.assert_array_equal(
    replica_rows(strategy, out).numpy(), (x * 2).reshape(4, 2, 3).numpy()
  )


@pytest.mark.parametrize(
  "make", [lambda: xd.OneDeviceStrategy(), lambda: xd.get_strategy()], ids=["one_device", "default"]
)
def test_single_replica_strategies_iterate_the_same_dataset(make):
  s = make()
  x, y = features(10), torch.arange(10)
  loader = DataLoader(TensorDataset(x, y), batch_size=4)
  dist = s.experimental_distribute_dataset(
    loader, xd.InputOptions(experimental_partial_batch="mask")
  )
  got = list(dist)
  assert len(got) == 3
  device = "cpu" if s is xd.get_strategy() else "xla"
  for step, ((bx, by), mask) in enumerate(got):
    assert isinstance(bx, torch.Tensor) and bx.device.type == device
    assert mask.shape == (4,)
    rows = slice(step * 4, step * 4 + 4)
    n = int(mask.sum())
    np.testing.assert_array_equal(bx.cpu()[:n].numpy(), x[rows].numpy())
    np.testing.assert_array_equal(by.cpu()[:n].numpy(), y[rows].numpy())
  assert [float(m.sum()) for _, m in got] == [4.0, 4.0, 2.0]
  out = s.run(lambda a, b: a.sum(1) + b, args=got[0][0])
  np.testing.assert_array_equal(out.cpu().numpy(), (x[:4].sum(1) + y[:4]).numpy())
  # the legacy tf.contrib name, with a dataset function
  legacy = [
    b.cpu()
    for (b, _) in s.distribute_dataset(lambda: DataLoader(TensorDataset(x, y), batch_size=5))
  ]
  np.testing.assert_array_equal(torch.cat(legacy).numpy(), x.numpy())


def test_input_context():
  ctx = xd.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
  assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 4)
  assert ctx.get_per_replica_batch_size(32) == 8
  with pytest.raises(
    ValueError,
    match=re.escape("the global batch size 30 is not divisible by num_replicas_in_sync 4"),
  ):
    ctx.get_per_replica_batch_size(30)
  assert xd.InputContext().get_per_replica_batch_size(7) == 7
  with pytest.raises(
    ValueError, match=re.escape("input_pipeline_id 2 is out of range for 2 input pipelines")
  ):
    xd.InputContext(2, 2, 4)
  with pytest.raises(TypeError, match="num_replicas_in_sync must be an int, got float"):
    xd.InputContext(1, 0, 2.0)


def test_input_options_are_validated():
  o = xd.InputOptions()
  assert (
    o.experimental_fetch_to_device,
    o.experimental_replication_mode,
    o.experimental_place_dataset_on_device,
    o.experimental_per_replica_buffer_size,
    o.experimental_partial_batch,
  ) == (True, xd.InputReplicationMode.PER_WORKER, False, 1, None)
  with pytest.raises(AttributeError):
    o.experimental_fetch_to_device = False  # frozen
  with pytest.raises(ValueError, match="experimental_per_replica_buffer_size must be >= 1, got 0"):
    xd.InputOptions(experimental_per_replica_buffer_size=0)
  with pytest.raises(TypeError, match="experimental_fetch_to_device must be a bool, got str"):
    xd.InputOptions(experimental_fetch_to_device="yes")
  with pytest.raises(
    TypeError, match="experimental_replication_mode must be an InputReplicationMode, got str"
  ):
    xd.InputOptions(experimental_replication_mode="PER_REPLICA")
  with pytest.raises(
    ValueError, match="experimental_partial_batch must be None, 'mask' or 'drop', got 'pad'"
  ):
    xd.InputOptions(experimental_partial_batch="pad")
  with pytest.raises(
    TypeError,
    match="experimental_partial_batch must be None or a string \\('mask' or 'drop'\\), got bool",
  ):
    xd.InputOptions(experimental_partial_batch=True)
  with pytest.raises(
    ValueError,
    match=re.escape(
      "experimental_place_dataset_on_device=True requires experimental_fetch_to_device=False"
    ),
  ):
    xd.InputOptions(experimental_place_dataset_on_device=True)
  xd.InputOptions(experimental_place_dataset_on_device=True, experimental_fetch_to_device=False)


def test_distribution_errors(strategy):
  with pytest.raises(
    TypeError, match="dataset must be a torch DataLoader or another iterable of batches, got int"
  ):
    strategy.experimental_distribute_dataset(3)
  with pytest.raises(TypeError, match="dataset is a one-pass iterator \\(generator\\)"):
    strategy.experimental_distribute_dataset(b for b in [torch.zeros(4)])
  with pytest.raises(TypeError, match="options must be an xladist.InputOptions or None, got dict"):
    strategy.experimental_distribute_dataset([], {"experimental_fetch_to_device": False})
  with pytest.raises(
    ValueError, match="PER_REPLICA is only supported by strategy.distribute_datasets_from_function"
  ):
    strategy.experimental_distribute_dataset(
      [], xd.InputOptions(experimental_replication_mode=xd.InputReplicationMode.PER_REPLICA)
    )
  with pytest.raises(TypeError, match="dataset_fn must be callable, got list"):
    strategy.distribute_datasets_from_function([])
  with pytest.raises(
    TypeError, match="what dataset_fn returned for pipeline 0 must be a torch DataLoader"
  ):
    strategy.distribute_datasets_from_function(lambda ctx: None)
  with pytest.raises(ValueError, match="a batch holds a scalar tensor"):
    list(strategy.experimental_distribute_dataset([torch.tensor(1.0)]))
  with pytest.raises(ValueError, match=re.escape("have different sizes in dim 0 ([2, 4])")):
    list(strategy.experimental_distribute_dataset([(torch.zeros(4), torch.zeros(2))]))
  with pytest.raises(TypeError, match="DistributedDataset cannot be made directly"):
    xd.DistributedDataset()
  with pytest.raises(
    RuntimeError,
    match="strategy.experimental_distribute_dataset requires being in cross-replica context",
  ):
    strategy.run(lambda: strategy.experimental_distribute_dataset([]))
  with pytest.raises(RuntimeError, match="Mixing different strategies"):
    with xd.OneDeviceStrategy().scope():
      strategy.experimental_distribute_dataset([])
  with strategy.scope():  # in its own scope (cross-replica context) it works
    (x,) = list(
      strategy.experimental_distribute_datasets_from_function(lambda ctx: [torch.arange(2)] * 4)
    )
  np.testing.assert_array_equal(replica_rows(strategy, x).numpy(), [[0, 1]] * 4)
