"""Training run shared by tests/test_checkpoint.py and its subprocesses.

`train()` trains the MLP of `_models` with MirroredStrategy on a DataLoader
through `experimental_distribute_dataset`, with SGD + momentum; each step's
loss is scaled by draws of torch's, numpy's and Python's global generators, so
a resumed run matches an uninterrupted one only if the RNG states were
restored too. Run as a script it trains (restoring the newest checkpoint of
--dir first) and saves the result with torch.save.

`--host RANK --port PORT` runs one of two processes that stand for two hosts
saving and restoring a sharded checkpoint together (`two_hosts`).
"""

import argparse
import datetime
import json
import random
import sys
import time

import _models
import numpy as np
import torch
import torch.nn.functional as F

import xladist as xd
import xladist.checkpoint as xc

GLOBAL_BATCH = 12
NUM_BATCHES = 24
FEATURES = 12


def make_loader():
  g = torch.Generator().manual_seed(3)
  n = GLOBAL_BATCH * NUM_BATCHES
  x = torch.randn(n, FEATURES, generator=g)
  y = torch.randint(0, 5, (n,), generator=g)
  idx = torch.arange(n)
  return torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(x, y, idx), batch_size=GLOBAL_BATCH
  )


def build(strategy):
  """Model, optimizer, iterator, step function and Checkpoint, all in their initial state."""
  state = _models.initial_state("mlp")
  model, opt = _models.build_xladist(strategy, "mlp", state)
  iterator = iter(strategy.experimental_distribute_dataset(make_loader()))
  torch.manual_seed(7)
  np.random.seed(7)
  random.seed(7)

  def step(x, y, scale):
    loss = F.cross_entropy(model(x), y) * scale
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  ckpt = xc.Checkpoint(model=model, optimizer=opt, iterator=iterator)
  return model, opt, iterator, step, ckpt


def train_one(strategy, iterator, step):
  import torch_xla

  x, y, _ = next(iterator)
  # Host RNG draws: a resumed run only matches with the generators restored.
  s = 1.0 + 0.1 * float(torch.rand(())) + 0.1 * random.random() + 0.1 * np.random.rand()
  scale = torch.tensor(s, device=torch_xla.device())
  strategy.run(step, args=(x, y, scale))
  torch_xla.sync()


def result(strategy, model, opt, iterator):
  """CPU copies of the parameters, momentum buffers and the next input batch."""
  x, _, idx = next(iterator)
  return {
    "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    "momentum": [opt.state[p]["momentum_buffer"].cpu().clone() for p in model.parameters()],
    "next_x": strategy.gather(x, axis=0).cpu(),
    "next_idx": strategy.gather(idx, axis=0).cpu(),
    "num_replicas": strategy.num_replicas_in_sync,
  }


def run(strategy, directory, steps, restore=None, sleep=0.0, on_step=None):
  """Restores (`restore` or the newest checkpoint in `directory`), trains until
  `steps` steps in all, saves; returns `result()`. SIGTERM: save and exit(0)."""
  model, opt, iterator, step, ckpt = build(strategy)
  manager = xc.CheckpointManager(ckpt, directory, max_to_keep=2)
  with iterator, xc.PreemptionCheckpointHandler(manager) as handler:
    restored = ckpt.restore(restore) if restore else manager.restore_or_initialize()
    print(f"restored {restored} at step {handler.total_run_calls}", flush=True)
    while handler.total_run_calls < steps:
      handler.run(train_one, strategy, iterator, step)
      print(f"step {handler.total_run_calls}", flush=True)
      if on_step is not None:
        on_step(handler.total_run_calls, manager)
      if sleep:
        time.sleep(sleep)
    manager.save(checkpoint_number=handler.total_run_calls)
    return result(strategy, model, opt, iterator)


def two_hosts(rank, port, directory):
  """Host `rank` of 2: saves a sharded checkpoint twice through a manager
  (max_to_keep=1), changes everything, restores; prints a JSON line.

  The hosts meet in a gloo process group (what `init_method="xla://"` gives
  on a pod) and are a 2-worker cluster to xladist. XLA:CPU has no runtime
  across processes, so the state is CPU tensors, the same on both hosts as
  replicated state is.
  """
  import torch.distributed as dist

  from xladist.cluster_resolver import _multihost

  dist.init_process_group(
    "gloo",
    init_method=f"tcp://127.0.0.1:{port}",
    rank=rank,
    world_size=2,
    timeout=datetime.timedelta(seconds=60),
  )
  hosts = ("127.0.0.1:1", "127.0.0.2:1")
  _multihost._process_cluster = _multihost.ClusterInfo(
    2, rank, rank == 0, hosts, hosts[0], ("worker", rank)
  )
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  model(torch.ones(4, 16)).sum().backward()
  opt.step()
  ckpt = xc.Checkpoint(model=model, optimizer=opt, step=3)
  manager = xc.CheckpointManager(
    ckpt, directory, max_to_keep=1, options=xc.CheckpointOptions(sharded=True)
  )
  manager.save()
  path = manager.save()
  expected = copy_state(model, opt)
  with torch.no_grad():
    for p in model.parameters():
      p.zero_()
  opt.state.clear()
  ckpt.step = 0
  restored = manager.restore_or_initialize()
  torch.testing.assert_close(copy_state(model, opt), expected, rtol=0, atol=0)
  dist.barrier()
  dist.destroy_process_group()
  print(json.dumps({"rank": rank, "path": path, "restored": restored, "step": ckpt.step}))


def copy_state(model, opt):
  return {
    "model": {k: v.clone() for k, v in model.state_dict().items()},
    "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir", required=True)
  p.add_argument("--steps", type=int, help="train until this many in all")
  p.add_argument("--out", help="torch.save the result here at the end")
  p.add_argument("--sleep", type=float, default=0.0)
  p.add_argument("--restore", help="restore this file instead of the newest in --dir")
  p.add_argument("--host", type=int, help="run host RANK of two_hosts() instead")
  p.add_argument("--port", type=int, help="two_hosts(): the process group's port")
  args = p.parse_args()
  if args.host is not None:
    two_hosts(args.host, args.port, args.dir)
    return
  out = run(xd.MirroredStrategy(), args.dir, args.steps, args.restore, args.sleep)
  if args.out:
    torch.save(out, args.out)
  print("done", flush=True)


if __name__ == "__main__":
  sys.exit(main())
