"""The runtime contract's random state and tensor identities.

Random state: the runtime's seed and its running seed read back what was set
(`seed`, `set_seed`), the running seed decides the draws, and dropout inside a
step follows `torch.manual_seed` (the same seed, the same mask). Identities:
`value_id` names the value a tensor holds now (a write gives a new one, a read
does not); `creation_index` orders a tensor against a step's start. Each test
puts the seeds back as it found them.
"""

import pytest
import torch
import torch.nn.functional as F

from xladist import runtime

N = 4


@pytest.fixture
def seeds_kept():
  """The runtime's seeds (and torch's random state) as they were before the test."""
  kept = (runtime.seed(), runtime.seed(running=True))
  with torch.random.fork_rng(devices=[]):
    yield
  runtime.set_seed(kept[0])
  runtime.set_seed(kept[1], running=True)


def test_seed_round_trips(seeds_kept):
  """Runtime.seed / set_seed: the runtime's seed reads back what was set."""
  assert runtime.seed() is not None  # started
  runtime.set_seed(1234)
  assert runtime.seed() == 1234
  runtime.set_seed(987654321)
  assert runtime.seed() == 987654321


def test_running_seed_round_trips(seeds_kept):
  """Runtime.seed(running=True) / set_seed(v, running=True): what was read can be
  set back, and reads back equal."""
  first = runtime.seed(running=True)
  runtime.set_seed(first, running=True)
  assert runtime.seed(running=True) == first
  runtime.set_seed(5, running=True)
  assert runtime.seed(running=True) != first or first == 5
  runtime.set_seed(first, running=True)
  assert runtime.seed(running=True) == first


def _draw():
  return torch.rand(N, 5, device=runtime.device())


def test_the_running_seed_decides_the_draws(seeds_kept):
  """Runtime.set_seed(v, running=True): "the running seed the next traced random
  op draws from": the same seed, the same numbers; another seed, others."""
  runtime.set_seed(77, running=True)
  a = _draw()
  runtime.set_seed(77, running=True)
  b = _draw()
  runtime.set_seed(78, running=True)
  c = _draw()
  runtime.sync()
  a, b, c = runtime.to_host([a, b, c])
  assert torch.equal(a, b)
  assert not torch.equal(a, c)


def test_dropout_in_a_step_follows_torch_manual_seed(strategy, local_results, seeds_kept):
  """Runtime.seed / set_seed through `strategy.run` (the step engine sets the
  running seed from torch's): dropout with the same torch.manual_seed draws the
  same mask, with another seed another one; replicas draw different rows."""
  x = torch.ones(8, 16)

  def fn(t):
    return F.dropout(t, 0.5)

  masks = []
  # A new seed value reseeds (docs/architecture.md): the first step only makes
  # sure that 12 is new (whatever ran before this test).
  for seed in (11, 12, 11, 12):
    torch.manual_seed(seed)
    masks.append(local_results(strategy.run(fn, (x,))))
  _, same, other, again = masks
  assert set(same.unique().tolist()) <= {0.0, 2.0}
  assert 0 < int((same == 0).sum()) < same.numel()
  assert torch.equal(same, again)
  assert not torch.equal(same, other)
  assert not all(torch.equal(same[0], same[r]) for r in range(1, N))


def test_value_id_changes_with_every_write():
  """Runtime.value_id: a new id after an in-place write and after `.data =`;
  the same after a read; two tensors' values have two ids."""
  t = runtime.place_replicated(torch.zeros(3))
  first = runtime.value_id(t)
  assert runtime.value_id(t) == first
  _ = t * 2 + 1  # a read
  assert runtime.value_id(t) == first
  t.add_(1)
  written = runtime.value_id(t)
  assert written != first
  t.data = runtime.place_replicated(torch.ones(3))
  assigned = runtime.value_id(t)
  assert assigned != written
  t.mul_(3)
  assert runtime.value_id(t) != assigned
  _ = t.sum()  # a read
  other = runtime.place_replicated(torch.zeros(3))
  assert runtime.value_id(other) != runtime.value_id(t)
  assert torch.equal(runtime.to_host([t])[0], torch.full((3,), 3.0))


def test_creation_index_orders_against_the_mark_of_a_step():
  """Runtime.creation_index: a token equal for the same value, and ordered
  against the mark `creation_index()` taken as a step's trace begins: a tensor
  made before the step is below the mark, one made in the step is not."""
  older = runtime.place_replicated(torch.zeros(2))
  split = runtime.place_split(torch.zeros(N, 2))
  assert runtime.creation_index(older) == runtime.creation_index(older)
  seen = {}

  def body():
    mark = runtime.creation_index()
    local = runtime.to_local(split) + 1
    made = local * 2
    seen["older"] = runtime.creation_index(older) < mark
    seen["made"] = runtime.creation_index(made) < mark
    return runtime.to_global(made, runtime.sharding(2, N), split.shape)

  out = runtime.traced_step(body)
  runtime.sync()
  assert seen == {"older": True, "made": False}
  assert torch.equal(runtime.to_host([out])[0], torch.full((N, 2), 2.0))
