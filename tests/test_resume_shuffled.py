"""Exact resume with a shuffled DataLoader (issue 26, point 1).

TF checkpoints an iterator's shuffle state, so a restored run sees the same
data order as one never interrupted (tensorflow/python/distribute/
checkpointing_test.py and input_lib_test.py save and restore distributed
iterators mid-epoch). Here a DataLoader with shuffle=True draws its order from
a generator when each epoch starts; the iterator's checkpoint holds that state.

Each run below is a fresh process (tests/_resume_worker.py) that trains three
models, one per kind of shuffled DataLoader: no generator (torch's global one),
an explicit generator, and a DistributedSampler with set_epoch. The first run
is SIGKILLed right after the save of step 3 (first epoch), the second resumes
and is SIGKILLed after step 7 (second epoch: 5 steps an epoch), the third
resumes and finishes at step 14 (third epoch). Every step's loss and the final
weights must be bit-identical to an uninterrupted run's.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import xladist.checkpoint as xc

HERE = Path(__file__).parent
KINDS = ("default", "explicit", "distributed")
TIMEOUT_S = 240


def _run(tmp_path, name, *extra):
  out = tmp_path / f"{name}.pt"
  env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
  env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
  proc = subprocess.Popen(
    [sys.executable, str(HERE / "_resume_worker.py"), "--out", str(out), *extra],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    log, _ = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    raise
  return proc.returncode, out, log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("resume")
  rc, ref_out, log = _run(tmp, "reference", "--dir", str(tmp / "reference"))
  assert rc == 0, log
  chain = str(tmp / "chain")
  rc, _, log = _run(tmp, "first", "--dir", chain, "--kill-after", "3")
  assert rc == -signal.SIGKILL, log
  rc, _, log = _run(tmp, "second", "--dir", chain, "--kill-after", "7")
  assert rc == -signal.SIGKILL, log
  rc, out, log = _run(tmp, "third", "--dir", chain)
  assert rc == 0, log
  return torch.load(ref_out), torch.load(out)


@pytest.mark.parametrize("kind", KINDS)
def test_killed_twice_and_resumed_matches_the_uninterrupted_run_bit_for_bit(runs, kind):
  reference, resumed = runs[0][kind], runs[1][kind]
  assert len(reference["losses"]) == 14 and reference["epoch"] == 2
  assert resumed["epoch"] == 2
  # Bit-identical: the same floats, step by step (steps 4-7 came from the
  # second process, 8-14 from the third).
  assert resumed["losses"] == reference["losses"]
  for name, w in reference["weights"].items():
    assert torch.equal(resumed["weights"][name], w), name


def test_the_order_is_shuffled_and_differs_between_epochs(runs):
  """The check above could fail: the three pipelines see different orders,
  and each reshuffles every epoch (else any resume would trivially match)."""
  reference = runs[0]
  losses = {k: reference[k]["losses"] for k in KINDS}
  assert losses["default"] != losses["explicit"] != losses["distributed"]
  for kind in KINDS:
    first, second = losses[kind][:5], losses[kind][5:10]
    assert len(set(np.round(first, 6)) & set(np.round(second, 6))) < 5


def _order_of(strategy, loader):
  """The first column of every batch of one epoch, in order."""
  it = iter(strategy.experimental_distribute_dataset(loader))
  rows = [torch.cat(strategy.experimental_local_results(x)).cpu() for (x,) in it]
  return torch.cat(rows).tolist()


def _loader(generator=None, **kw):
  data = torch.utils.data.TensorDataset(torch.arange(32.0).reshape(32, 1))
  return torch.utils.data.DataLoader(
    data, batch_size=8, shuffle=True, drop_last=True, generator=generator, **kw
  )


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_restore_in_process_replays_the_saved_epochs_order(strategy, tmp_path, fmt):
  """An iterator made after more draws from the generator (another epoch's
  order) is put back on the saved epoch's order and position, in both formats;
  the global generators end as they were at the save."""
  g = torch.Generator().manual_seed(1)
  loader = _loader(g)
  dist = strategy.experimental_distribute_dataset(loader)
  it = iter(dist)
  first = next(it)[0]
  ckpt = xc.Checkpoint(iterator=it)
  options = xc.CheckpointOptions(sharded=fmt == "sharded")
  path = ckpt.save(str(tmp_path / "ckpt"), options=options)
  expected_rest = [torch.cat(strategy.experimental_local_results(x)).cpu() for (x,) in it]
  torch_state = torch.get_rng_state()
  it.close()
  for _ in range(3):  # later epochs: the generator moves on
    _order_of(strategy, loader)
  torch.manual_seed(123)
  other = iter(dist)
  ckpt2 = xc.Checkpoint(iterator=other)
  ckpt2.restore(path)
  rest = [torch.cat(strategy.experimental_local_results(x)).cpu() for (x,) in other]
  assert len(rest) == 3 and len(first.values) == 4
  for got, want in zip(rest, expected_rest):
    assert torch.equal(got, want)
  assert torch.equal(torch.get_rng_state(), torch_state)


def test_persistent_workers_are_refused_when_saved(strategy, tmp_path):
  loader = _loader(num_workers=1, persistent_workers=True)
  it = iter(strategy.experimental_distribute_dataset(loader))
  try:
    with pytest.raises(
      ValueError,
      match=r"DistributedIterator.state_dict: the iterator reads dataset, a DataLoader with "
      r"persistent_workers=True.*persistent_workers=False",
    ):
      it.state_dict()
    with pytest.raises(
      ValueError,
      match=r"checkpoint.save: 'iterator' cannot be saved\. .*persistent_workers=True.*"
      r"persistent_workers=False",
    ):
      xc.Checkpoint(iterator=it).save(str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt")
  finally:
    it.close()


def test_restore_into_another_pipeline_names_the_missing_generator(strategy, tmp_path):
  with_generator = iter(strategy.experimental_distribute_dataset(_loader(torch.Generator())))
  path = xc.Checkpoint(iterator=with_generator).save(str(tmp_path / "ckpt"))
  with_generator.close()
  sampler = torch.utils.data.DistributedSampler(range(32), num_replicas=1, rank=0)
  loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.zeros(32, 1)), batch_size=8, sampler=sampler
  )
  other = iter(strategy.experimental_distribute_dataset(loader))
  try:
    with pytest.raises(ValueError, match=r"dataset\.sampler\.generator.*same dataset pipeline"):
      xc.Checkpoint(iterator=other).restore(path)
  finally:
    other.close()


def test_an_unshuffled_loader_has_no_generator_to_restore(strategy):
  loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), 4)
  it = iter(strategy.experimental_distribute_dataset(loader))
  try:
    state = it.state_dict()
    assert state["order"]["generators"] == {} and state["order"]["epochs"] == {}
    assert state["position"] == 0 and state["num_replicas"] == 4
  finally:
    it.close()
