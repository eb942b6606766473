"""Several steps per execution: extended.experimental_run_steps."""

import re

import _models
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from xladist.runtime import xla as _runtime


def _loader(steps, n=4, b=3):
  xs, ys = _models.make_data("mlp", n, steps=steps, b=b)
  return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=n * b)


@pytest.mark.parametrize("replay", [False, True], ids=["traced", "replayed"])
def test_k_steps_are_one_execution_and_equal_k_single_steps(strategy, monkeypatch, replay):
  """Traced: each call of 4 steps is one program, one execution. Replayed (the
  default): once the step's key and the group of the 3 steps after it are
  captured, a call is two executions (the replayed first step, then the other
  3 as one program: Replayer.replay_steps) and compiles nothing."""
  monkeypatch.setenv("XLADIST_REPLAY", "1" if replay else "0")
  calls = 8 if replay else 4
  state = _models.initial_state("mlp")
  loader = _loader(steps=4 * calls)
  # Reference: separate steps, one execution each.
  model, opt = _models.build_xladist(strategy, "mlp", state)
  step = _models.make_step(model, opt)
  single_losses = []
  for x, y in strategy.experimental_distribute_dataset(loader):
    single_losses.append(strategy.reduce("mean", strategy.run(step, args=(x, y)), axis=None))
    _runtime.sync()
  single = {k: v.cpu() for k, v in model.state_dict().items()}

  model, opt = _models.build_xladist(strategy, "mlp", state)
  step = _models.make_step(model, opt)
  it = iter(strategy.experimental_distribute_dataset(loader))
  outputs, executions, compiles = [], [], []
  for _ in range(calls):
    e, c = _runtime.execute_count(), _runtime.compile_count()
    outputs += strategy.extended.experimental_run_steps(step, it, 4)
    _runtime.wait()
    executions.append(_runtime.execute_count() - e)
    compiles.append(_runtime.compile_count() - c)
  if replay:
    # Warm-up (calls 1-3): the step's key is captured and confirmed, the group's
    # first trace analysed and its second captured; from call 4 on it is replayed.
    assert executions[3:] == [2] * 5
    assert compiles[3:] == [0] * 5
    assert strategy.extended._engine._replayer.replays >= 16
  else:
    assert executions == [1] * calls  # one execution for 4 steps
  assert strategy.extended.experimental_run_steps(step, it, 4) == []  # the iterator is done
  assert len(outputs) == 4 * calls
  got = {k: v.cpu() for k, v in model.state_dict().items()}
  _models.assert_close_to_scale(got, single, 1e-6)
  losses = torch.stack([strategy.reduce("mean", o, axis=None).cpu() for o in outputs])
  _models.assert_close_to_scale(losses, torch.stack([l.cpu() for l in single_losses]), 1e-6)


def test_run_steps_errors(strategy):
  with pytest.raises(
    ValueError, match=re.escape("experimental_run_steps: steps must be a positive int, got 0")
  ):
    strategy.extended.experimental_run_steps(lambda x: x, iter([]), 0)
  with pytest.raises(
    RuntimeError, match=re.escape("experimental_run_steps requires being in cross-replica context")
  ):
    strategy.run(lambda: strategy.extended.experimental_run_steps(lambda x: x, iter([]), 1))
