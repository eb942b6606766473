"""DistributedIterator.state_dict / load_state_dict: an iterator's place in its
epoch, saved and restored without xladist.checkpoint.

TF checkpoints a distributed iterator the same way
(tensorflow/python/distribute/input_lib_test.py saves one mid-epoch and
restores it into a fresh iterator of the same dataset). xladist.checkpoint
saves iterators through these methods; tests/test_checkpoint.py and
tests/test_resume_shuffled.py cover that path.
"""

import pytest
import torch

import xladist.checkpoint as xc


def _rows(strategy, element):
  (x,) = element
  return torch.cat(strategy.experimental_local_results(x)).cpu().flatten().tolist()


def _loader(generator=None, sampler=None):
  data = torch.utils.data.TensorDataset(torch.arange(32.0).reshape(32, 1))
  return torch.utils.data.DataLoader(
    data,
    batch_size=8,
    shuffle=generator is not None,
    generator=generator,
    sampler=sampler,
  )


def test_state_dict_holds_the_position_layout_and_order(strategy):
  it = iter(strategy.experimental_distribute_dataset(_loader(torch.Generator().manual_seed(0))))
  with it:
    next(it)
    state = it.state_dict()
  assert set(state) == {"position", "num_replicas", "global_batches", "order"}
  assert (state["position"], state["num_replicas"], state["global_batches"]) == (1, 4, True)
  assert set(state["order"]) == {"host", "generators", "epochs"}
  assert list(state["order"]["generators"]) == ["dataset.sampler.generator"]


def test_load_state_dict_continues_the_saved_epoch_in_its_order(strategy):
  g = torch.Generator().manual_seed(3)
  dist = strategy.experimental_distribute_dataset(_loader(g))
  with iter(dist) as it:
    next(it)
    next(it)
    state = it.state_dict()
    want = [_rows(strategy, e) for e in it]
  for _ in range(2):  # later epochs: the generator moves on
    with iter(dist) as other:
      list(other)
  with iter(dist) as fresh:
    fresh.load_state_dict(state)
    assert fresh.state_dict()["position"] == 2
    assert [_rows(strategy, e) for e in fresh] == want


def test_load_state_dict_refuses_a_state_that_does_not_fit_and_changes_nothing(strategy):
  dist = strategy.experimental_distribute_dataset(_loader())
  with iter(dist) as it:
    next(it)
    good = it.state_dict()
  with_generator = strategy.experimental_distribute_dataset(_loader(torch.Generator()))
  with iter(with_generator) as other:
    foreign = other.state_dict()
  cases = [
    ([good], TypeError, r"load_state_dict: the state is a list, not the dict"),
    ({"position": 1}, ValueError, r"lacks the keys \['global_batches', 'num_replicas'\]"),
    (dict(good, position=-1), ValueError, r"has the position -1; a position is a non-negative"),
    (dict(good, position=5), ValueError, r"position 5 .* at most 4 elements in an epoch"),
    (
      dict(good, global_batches=False, num_replicas=4),
      ValueError,
      r"position of an distribute_datasets_from_function iterator, restored into an "
      r"experimental_distribute_dataset one",
    ),
    (foreign, ValueError, r"drew its order from the generator at dataset\.sampler\.generator"),
  ]
  with iter(dist) as fresh:
    for state, error, match in cases:
      with pytest.raises(error, match=match):
        fresh.load_state_dict(state)
    assert fresh.state_dict()["position"] == 0
    assert _rows(strategy, next(fresh)) == list(range(8))


def test_per_replica_positions_need_the_saved_replica_count(strategy):
  def dataset_fn(ctx):
    return [torch.full((2, 1), float(i)) for i in range(8)]

  dist = strategy.distribute_datasets_from_function(dataset_fn)
  with iter(dist) as it:
    next(it)
    state = it.state_dict()
  assert (state["position"], state["global_batches"]) == (1, False)
  with iter(dist) as fresh:
    with pytest.raises(ValueError, match=r"iterator with 8 replicas, restored into one with 4"):
      fresh.load_state_dict(dict(state, num_replicas=8))
    fresh.load_state_dict(state)
    assert fresh.state_dict()["position"] == 1


class _FlakySampler(torch.utils.data.Sampler):
  """A sampler with set_epoch (its epoch is part of an iterator's state) that
  refuses the epoch once told to."""

  def __init__(self, n):
    self.n, self.epoch, self.fail = n, 0, False

  def __iter__(self):
    return iter(range(self.n))

  def __len__(self):
    return self.n

  def set_epoch(self, epoch):
    if self.fail:
      raise RuntimeError("flaky sampler refuses the epoch")
    self.epoch = epoch


def test_a_restore_that_fails_on_a_later_iterator_puts_the_first_one_back(strategy, tmp_path):
  """The undo of xladist.checkpoint's all-or-nothing restore, for iterators:
  `a` is restored first, `b` then fails, and `a` goes back to where it was."""
  sampler = _FlakySampler(32)
  a = iter(strategy.experimental_distribute_dataset(_loader()))
  b = iter(strategy.experimental_distribute_dataset(_loader(sampler=sampler)))
  with a, b:
    next(a)
    next(b)
    path = xc.Checkpoint(a=a, b=b).save(str(tmp_path / "c.pt"))
    next(a)
    next(a)
    sampler.fail = True
    with pytest.raises(RuntimeError, match="flaky sampler refuses the epoch"):
      xc.Checkpoint(a=a, b=b).restore(path)
    assert a.state_dict()["position"] == 3
    assert _rows(strategy, next(a)) == list(range(24, 32))
