"""The runtime contract's sharded checkpoints (`ShardedCheckpoints`).

`is_sharded` tells a split global tensor from a replicated one; a runtime that
runs torch.distributed.checkpoint of global tensors gives its save and load
planners and makes empty tensors placed like others to load into; one that
does not refuses both with an error that names what to use instead (the
file checkpoints of xladist.checkpoint). torch_xla runs them; the jax runtime
refuses them.
"""

import pytest
import torch
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from xladist import runtime

N = 4
SHARDED = runtime.BACKEND == "torch_xla"  # runtimes that run sharded checkpoints


def test_is_sharded():
  """ShardedCheckpoints.is_sharded: true for a split tensor, false for a
  replicated one."""
  x = torch.arange(N * 2, dtype=torch.float32).reshape(N, 2)
  assert runtime.is_sharded(runtime.place_split(x)) is True
  assert runtime.is_sharded(runtime.place_replicated(x)) is False


@pytest.mark.skipif(not SHARDED, reason="a runtime that runs sharded checkpoints")
def test_checkpoint_planners():
  """ShardedCheckpoints.checkpoint_planners: (save planner, load planner, ...)
  of torch.distributed.checkpoint."""
  planners = runtime.checkpoint_planners()
  save, load = planners[0], planners[1]
  assert isinstance(save, type) and issubclass(save, SavePlanner)
  assert isinstance(load, type) and issubclass(load, LoadPlanner)


@pytest.mark.skipif(not SHARDED, reason="a runtime that runs sharded checkpoints")
def test_empty_sharded_like_is_placed_like_its_model():
  """ShardedCheckpoints.empty_sharded_like: a global tensor of the shape and
  dtype asked, placed as `like` (split or replicated)."""
  x = torch.arange(N * 2, dtype=torch.float32).reshape(N, 2)
  for like in (runtime.place_split(x), runtime.place_replicated(x)):
    t = runtime.empty_sharded_like(torch.Size((N, 6)), torch.bfloat16, like)
    assert runtime.is_device_tensor(t)
    assert tuple(t.shape) == (N, 6) and t.dtype == torch.bfloat16
    assert runtime.is_sharded(t) == runtime.is_sharded(like)
    assert runtime.sharding_spec(t) == runtime.sharding_spec(
      runtime.place_split(torch.zeros(N, 6))
      if runtime.is_sharded(like)
      else runtime.place_replicated(torch.zeros(N, 6))
    )


@pytest.mark.skipif(SHARDED, reason="a runtime that refuses sharded checkpoints")
def test_sharded_checkpoints_are_refused_with_the_alternative():
  """ShardedCheckpoints.checkpoint_planners / empty_sharded_like: refused with an
  error naming the file checkpoints to use instead."""
  like = runtime.place_split(torch.zeros(N, 2))
  for call in (
    runtime.checkpoint_planners,
    lambda: runtime.empty_sharded_like(torch.Size((N, 2)), torch.float32, like),
  ):
    with pytest.raises((RuntimeError, NotImplementedError)) as e:
      call()
    message = str(e.value)
    assert "torch.distributed.checkpoint" in message and "Checkpoint" in message, message
