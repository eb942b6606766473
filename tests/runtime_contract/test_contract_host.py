"""The runtime contract's host side: boundaries, waits, counters and diagnostics.

`sync` starts the work recorded so far and passes a boundary (`boundary_count`,
callbacks of `on_boundary`); `wait` blocks until it has run. Counters: a step
compiles once and not when it runs again (`compile_count`), runs a program each
time (`execute_count`); `graph_hash` keys the work that makes tensors;
`hlo_text` is the program's HLO. Values are checked against plain torch.
"""

import pytest
import torch

import xladist as xd
from xladist import runtime

N = 4


def _placed(cols=3):
  return runtime.place_split(torch.arange(N * cols, dtype=torch.float32).reshape(N, cols))


def test_sync_then_wait_computes_the_pending_work(host):
  """Runtime.sync / wait: the work recorded so far runs; its values are torch's."""
  x = torch.arange(N * 3, dtype=torch.float32).reshape(N, 3)
  y = runtime.place_split(x) * 3 - 1
  runtime.sync()
  runtime.wait()
  assert torch.equal(host(y), x * 3 - 1)
  z = runtime.place_split(x) + 10
  runtime.sync([z])  # what z needs
  runtime.wait()
  assert torch.equal(host(z), x + 10)


def test_sync_passes_a_boundary():
  """Runtime.sync / boundary_count: every sync is a boundary (the count grows)."""
  before = runtime.boundary_count()
  assert isinstance(before, int)
  _ = _placed() * 2
  runtime.sync()
  runtime.wait()
  assert runtime.boundary_count() >= before + 1
  middle = runtime.boundary_count()
  runtime.sync()
  assert runtime.boundary_count() >= middle + 1


def test_on_boundary_calls_back_once_at_the_next_boundary():
  """Runtime.on_boundary: `callback()` once, at the next sync, not before and not again."""
  calls = []
  runtime.on_boundary(lambda: calls.append(runtime.boundary_count()))
  assert calls == []
  _ = _placed() + 1
  runtime.sync()
  assert len(calls) == 1
  runtime.sync()
  runtime.wait()
  assert len(calls) == 1


def test_sync_without_a_boundary(host):
  """Runtime.sync(boundary=False): starts the work without a boundary (no
  callbacks, boundary_count unchanged); the next sync is the boundary."""
  calls = []
  runtime.sync()
  runtime.on_boundary(lambda: calls.append(1))
  before = runtime.boundary_count()
  y = _placed() * 5
  runtime.sync(boundary=False)
  runtime.wait()
  assert runtime.boundary_count() == before
  assert calls == []
  assert torch.equal(host(y), torch.arange(N * 3, dtype=torch.float32).reshape(N, 3) * 5)
  runtime.sync()
  assert calls == [1]


def test_wait_with_a_timeout_returns_when_the_work_is_done(host):
  """Runtime.wait(timeout_seconds=...): returns once nothing is pending."""
  runtime.wait(timeout_seconds=60)
  y = _placed() + 2
  runtime.sync()
  runtime.wait(timeout_seconds=60, what="the contract test's work")
  runtime.wait(timeout_seconds=60)
  assert torch.equal(host(y), torch.arange(N * 3, dtype=torch.float32).reshape(N, 3) + 2)


def test_a_step_compiles_once(strategy, local_results):
  """Runtime.compile_count / Diagnostics.execute_count: the first run of a step
  compiles its program, runs of the same step on same-shaped inputs compile
  nothing more (a cache hit, or a replay of the program); every run executes."""
  x = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.full((7, 3), float(ctx.replica_id_in_sync_group))
  )

  def fn(t):  # a program no other test compiles (its shape and constants)
    return xd.get_replica_context().all_reduce(xd.ReduceOp.SUM, t * 0.375 + 0.125)

  runtime.sync()
  runtime.wait()
  compiles, executions = runtime.compile_count(), runtime.execute_count()
  out = strategy.run(fn, (x,))
  runtime.sync()
  runtime.wait()
  assert runtime.compile_count() > compiles
  assert runtime.execute_count() > executions
  compiles, executions = runtime.compile_count(), runtime.execute_count()
  for _ in range(3):
    out = strategy.run(fn, (x,))
    runtime.sync()
  runtime.wait()
  assert runtime.compile_count() == compiles
  assert runtime.execute_count() >= executions + 3
  want = sum(r * 0.375 + 0.125 for r in range(N))
  assert torch.allclose(local_results(out), torch.full((N, 7, 3), want))


def test_graph_hash_keys_the_work():
  """Runtime.graph_hash: bytes; equal for the same work on equal-shaped inputs."""
  a, b = _placed(), runtime.place_split(torch.ones(N, 3))
  ha, hb = runtime.graph_hash([a * 2 + 1]), runtime.graph_hash([b * 2 + 1])
  assert isinstance(ha, bytes)
  assert ha == hb
  runtime.sync()
  runtime.wait()


@pytest.mark.skipif(runtime.REPLAY_KIND != "graph", reason="work is pending on lazy runtimes")
def test_graph_hash_tells_pending_work_apart():
  """Runtime.graph_hash ("graph" runtimes, which record work lazily): a different
  computation of the same inputs is a different key; done work is data only."""
  a = _placed()
  assert runtime.graph_hash([a * 2 + 1]) != runtime.graph_hash([a * 3])
  assert runtime.graph_hash([a * 2 + 1]) != runtime.graph_hash([a])
  y = a * 3
  runtime.sync()
  runtime.wait()
  assert runtime.graph_hash([y]) == runtime.graph_hash([_placed()])


@pytest.mark.skipif(runtime.REPLAY_KIND != "program", reason="eager runtimes have no pending work")
def test_graph_hash_of_computed_values_is_that_of_data():
  """Runtime.graph_hash ("program" runtimes, whose values outside steps are
  computed when made): no pending work, so every computed value keys as data."""
  a = _placed()
  assert runtime.graph_hash([a * 2 + 1]) == runtime.graph_hash([a])
  assert runtime.graph_hash([a * 3]) == runtime.graph_hash([a])


def test_hlo_text_of_a_step():
  """Diagnostics.hlo_text(tensors): the HLO of the step that makes them (a step
  with an all-reduce has the collective)."""
  split = _placed(cols=2)

  def body():
    local = runtime.to_local(split) - 0.25
    high = runtime.spmd_all_reduce("max", local, 1.0, runtime.replica_groups(N))
    return runtime.to_global(high, runtime.sharding(2, N, split=False), high.shape)

  out = runtime.traced_step(body)
  text = runtime.hlo_text([out])
  assert isinstance(text, str) and "HloModule" in text, text[:500]
  assert "all-reduce" in text, text[:2000]
  runtime.sync()
  runtime.wait()


def test_cache_hits_is_a_count():
  """Diagnostics.cache_hits: a count of programs found compiled (never negative)."""
  hits = runtime.cache_hits()
  assert isinstance(hits, int) and hits >= 0
