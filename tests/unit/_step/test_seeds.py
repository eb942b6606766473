"""Seed arithmetic of steps (xladist/_step/seeds.py, and `signed` of replay_program.py), alone:
a stand-in runtime holds the running seed, so no XLA device is touched.

torch_xla 2.9 gives each random op of a traced graph the next running seed,
`seed * 214013 + 2531011` in uint64 (XLAGraphExecutor's GetRngSeed); a replay accounts
for the draws it makes without tracing them (`run_n`, `draws_between`, `_Seeds`). The
references below are numpy's uint64 arithmetic (which wraps by itself) and hand-computed
numbers, not seeds.py's mask.
"""

import numpy as np
import pytest
import torch

from xladist._step import seeds
from xladist._step.replay_program import signed

MUL, ADD = 214013, 2531011  # torch_xla 2.9's GetRngSeed (kSeedMul, kSeedAdd)


def lcg(seed, n):
  """n random ops' worth of torch_xla's running seed, in numpy's uint64 (wraps mod 2**64)."""
  with np.errstate(over="ignore"):
    x = np.array([seed], dtype=np.uint64)
    for _ in range(n):
      x = x * np.uint64(MUL) + np.uint64(ADD)
  return int(x[0])


SEEDS = [0, 1, 12345, 2**32 + 7, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]


def test_run_n_by_hand():
  assert seeds.run_n(0, 0) == 0
  assert seeds.run_n(0, 1) == 2531011
  assert seeds.run_n(1, 1) == 214013 + 2531011
  assert seeds.run_n(0, 2) == 2531011 * 214013 + 2531011
  # uint64 wrap-around: 2**64 - 1 is -1, and 214013 * 2**63 is 2**63 (mod 2**64).
  assert seeds.run_n(2**64 - 1, 1) == 2531011 - 214013
  assert seeds.run_n(2**63, 1) == 2**63 + 2531011


@pytest.mark.parametrize("seed", SEEDS)
def test_run_n_is_torch_xlas_uint64_arithmetic(seed):
  for n in (1, 2, 3, 10, 257):
    out = seeds.run_n(seed, n)
    assert out == lcg(seed, n)
    assert 0 <= out < 2**64


@pytest.mark.parametrize("seed", SEEDS)
def test_draws_between_counts_the_random_ops(seed):
  for n in (0, 1, 2, 7, 300):
    assert seeds.draws_between(seed, lcg(seed, n)) == n


def test_draws_between_looks_as_far_as_a_capture_accepts():
  start = 2**64 - 5
  seed = start
  for _ in range(1 << 16):  # (Python ints mod 2**64: numpy's loop is slower)
    seed = (seed * MUL + ADD) % 2**64
  assert seeds._MAX_DRAWS == 1 << 16
  assert seeds.draws_between(start, seed) == 1 << 16
  assert seeds.draws_between(start, (seed * MUL + ADD) % 2**64) is None


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1, lcg(2**64 - 1, 5)])
def test_signed_is_the_int64_a_graphs_seed_parameter_holds(seed):
  """A uint64 seed as the int64 of a device scalar (replay_program.signed)."""
  expected = int(np.array([seed], dtype=np.uint64).view(np.int64)[0])
  assert signed(seed) == expected
  assert signed(seed) == int.from_bytes(seed.to_bytes(8, "little"), "little", signed=True)
  assert -(2**63) <= signed(seed) < 2**63


def test_signed_by_hand():
  assert signed(2**64 - 1) == -1
  assert signed(2**63) == -(2**63)
  assert signed(2**63 - 1) == 2**63 - 1
  assert signed(5) == 5


def test_global_shape():
  assert seeds._global_shape((3, 5), 4) == (12, 5)
  assert seeds._global_shape(torch.Size([2]), 3) == (6,)
  assert seeds._global_shape((), 4) == (4,)


# -- the seed rule around steps, with a stand-in runtime -----------------------------------------


class _Runtime:
  """The runtime functions seeds.py calls: a running seed random ops move on (`draw`)
  and that `sync` moves as torch_xla's MarkStep does."""

  def __init__(self, seed):
    self.running = seed
    self.marks = 0
    self.set = []  # every set_seed(value)

  def seed(self, running=False):
    assert running
    return self.running

  def set_seed(self, value, running=False):
    assert running
    self.running = value
    self.set.append(value)

  def boundary_count(self):
    return self.marks

  def sync(self):
    self.marks += 1
    self.running = lcg(self.running ^ 0xDEADBEEF, 1)  # moved on: not the running seed

  def draw(self, n):
    self.running = lcg(self.running, n)


@pytest.fixture
def rt(monkeypatch):
  runtime = _Runtime(2**64 - 3)
  monkeypatch.setattr(seeds, "_runtime", runtime)
  return runtime


def test_a_step_after_random_ops_starts_from_the_running_seed_made_the_base(rt):
  s = seeds._Seeds()
  s0 = rt.running
  assert s.start_step() == s0 and rt.set == []  # the first step: the running seed as it is
  rt.draw(3)  # the traced step's random ops
  assert s.after_trace() == lcg(s0, 3)
  second = s.start_step()  # no sync since: the running seed moved away from the base
  assert second == lcg(s0, 3) and rt.set == [second]


def test_a_replayed_step_leaves_its_draws_for_the_next_step(rt):
  s = seeds._Seeds()
  start = s.start_step()
  s.after_trace()  # a step without random ops
  first = s.start_step()
  assert first == start
  s.after_replay(first, 5)  # the replay drew 5 numbers; the runtime's seed did not move
  assert rt.running == start
  assert s.start_step() == lcg(start, 5)  # as if the replayed step had been traced
  assert rt.set[-1] == lcg(start, 5)
  s.after_trace()
  s.after_replay(lcg(start, 5), 0)  # no random ops: nothing left over
  assert s.start_step() == lcg(start, 5)


def test_a_sync_or_a_new_seed_starts_afresh(rt):
  s = seeds._Seeds()
  start = s.start_step()
  s.after_trace()
  s.after_replay(start, 2)
  rt.sync()  # the user's torch_xla.sync(): the base moved on, the replay's draws dropped
  assert s.start_step() == rt.running != lcg(start, 2)
  s.after_trace()
  rt.running = 42  # torch.manual_seed / a checkpoint restore set the seed
  assert s.start_step() == 42


def test_sync_between_steps_keeps_the_seed(rt):
  s = seeds._Seeds()
  s0 = s.start_step()
  rt.draw(2)
  s.after_trace()
  s.sync_between_steps()
  assert rt.marks == 1 and rt.running == lcg(s0, 2)  # the sync's move undone
  assert s.start_step() == lcg(s0, 2)  # not afresh: the same as without the cut


def test_a_chain_of_steps_settles_where_separate_steps_would_have(rt):
  """experimental_run_steps' steps traced as one program: step 1 draws 2, step 2 draws 1."""
  s = seeds._Seeds()
  s0 = s.start_step()
  s.after_trace()
  with s.chained() as starts:
    assert s.start_step() == s0
    rt.draw(2)
    assert s.start_step() == lcg(s0, 2)
    rt.draw(1)
  assert starts == [s0, lcg(s0, 2)]
  assert rt.set == []  # inside the chain the seed went on as traced
  s.settle_chain(starts, rt.running)
  assert rt.set == [lcg(s0, 2)]  # the base the second step made
  assert s.start_step() == lcg(s0, 3)  # the next step goes on from the chain's end


def test_a_chain_on_a_runtime_whose_seed_is_a_key_needs_nothing(rt):
  rt.running = ("a jax key",)
  s = seeds._Seeds()
  with s.chained() as starts:
    assert s.chain is None
  assert starts == []
  s.settle_chain(starts, ("another key",))
  assert rt.set == []


@pytest.fixture
def torch_seed(monkeypatch):
  """torch's CPU seed and generator state are put back afterwards."""
  initial, state = torch.initial_seed(), torch.get_rng_state()
  monkeypatch.setattr(seeds, "_torch_seed_seen", [None])
  yield
  torch.manual_seed(initial)
  torch.set_rng_state(state)


def test_follow_torch_seed_sets_the_runtimes_seed_when_torchs_changes(rt, torch_seed):
  torch.manual_seed(2**64 - 1)  # the largest seed torch takes; the runtime's is below 2**63
  seeds.follow_torch_seed()
  assert rt.set == [2**63 - 1]
  seeds.follow_torch_seed()
  assert rt.set == [2**63 - 1]  # unchanged: not set again
  torch.manual_seed(2**63 + 5)
  seeds.follow_torch_seed()
  assert rt.set == [2**63 - 1, 5]
  torch.manual_seed(7)
  seeds.follow_torch_seed(reseed=False)  # a checkpoint restore set both: only noted
  seeds.follow_torch_seed()
  assert rt.set == [2**63 - 1, 5]


# -- the draw log of a step's recomputations ---------------------------------------------------


class _Mode:
  entered = exited = 0

  def __enter__(self):
    self.entered += 1

  def __exit__(self, *exc):
    self.exited += 1


def test_the_draw_log_repeats_a_steps_draws_in_order():
  mode = _Mode()
  log = seeds._DrawLog(mode)
  assert log.repeat((2,)) is None  # nothing drawn yet: draw anew
  a, b = torch.rand(2), torch.rand(3, 1)
  log.record((2,), a)
  log.record(torch.Size([3, 1]), b)
  assert log.position == 2 and log.repeat((2,)) is None
  log.seek(0)  # torch.utils.checkpoint set the RNG state back: a recomputation starts
  assert (mode.entered, mode.exited) == (1, 0)
  assert log.repeat((2,)) is a and log.repeat((3, 1)) is b
  assert log.repeat((2,)) is None
  log.seek(2)  # and ends
  assert (mode.entered, mode.exited) == (1, 1)
  log.seek(1)
  with pytest.raises(RuntimeError, match=r"of shape \(4,\) where its forward drew \(3, 1\)"):
    log.repeat((4,))


def test_draws_on_the_host_are_left_alone():
  assert seeds.draw(torch.rand, (2, 3), {}, region=None) is None
  assert seeds.draw(torch.rand, (2,), {"device": "cpu"}, region=None) is None
  assert seeds.draw(torch.rand_like, (torch.zeros(2),), {}, region=None) is None
  assert seeds.draw(torch.add, (torch.zeros(2), 1), {}, region=None) is None  # no draw
