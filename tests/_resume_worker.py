"""A training run with a shuffled DataLoader, checkpointed as a user writes it.

Run by tests/test_resume_shuffled.py in fresh processes: it trains the MLP of
`_models` with MirroredStrategy on `DataLoader(shuffle=True, drop_last=True)`
through `experimental_distribute_dataset`, rolls over epochs by putting each
new epoch's iterator into the Checkpoint, saves with a CheckpointManager every
step, and (with --kill-after K) sends itself SIGKILL right after the save of
step K. Started again with the same arguments it restores the newest
checkpoint and goes on. At the end it writes every step's loss and the final
weights (host tensors) with torch.save.

--generator default: the DataLoader has no generator (its order comes from
torch's global generator); explicit: DataLoader(generator=Generator().manual_seed(5));
distributed: a DistributedSampler(shuffle=True) with set_epoch.
"""

import argparse
import os
import signal

import _models
import torch
import torch.nn.functional as F

import xladist as xd
import xladist.checkpoint as xc

GLOBAL_BATCH = 16
EXAMPLES = 16 * 5  # 5 steps an epoch


def make_loader(kind):
  g = torch.Generator().manual_seed(3)
  x = torch.randn(EXAMPLES, 12, generator=g)
  y = torch.randint(0, 5, (EXAMPLES,), generator=g)
  data = torch.utils.data.TensorDataset(x, y)
  if kind == "distributed":
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=11)
    loader = torch.utils.data.DataLoader(
      data, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True
    )
    return loader, sampler
  generator = torch.Generator().manual_seed(5) if kind == "explicit" else None
  loader = torch.utils.data.DataLoader(
    data, batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True, generator=generator
  )
  return loader, None


class Pipeline:
  """One model trained from one kind of DataLoader, checkpointed in its own directory."""

  def __init__(self, strategy, kind, directory):
    self.strategy, self.kind = strategy, kind
    self.model, self.optimizer = _models.build_xladist(
      strategy, "mlp", _models.initial_state("mlp")
    )
    loader, self.sampler = make_loader(kind)
    self.dataset = strategy.experimental_distribute_dataset(loader)
    self.ckpt = xc.Checkpoint(
      model=self.model,
      optimizer=self.optimizer,
      iterator=iter(self.dataset),
      epoch=0,
      step=0,
      losses=[],
    )
    self.manager = xc.CheckpointManager(self.ckpt, os.path.join(directory, kind), max_to_keep=2)
    self.manager.restore_or_initialize()
    if self.sampler is not None:
      self.sampler.set_epoch(self.ckpt.epoch)

  def step_fn(self, x, y):
    loss = F.cross_entropy(self.model(x), y)
    self.optimizer.zero_grad()
    loss.backward()
    self.optimizer.step()
    return loss

  def train_step(self):
    ckpt = self.ckpt
    while True:
      try:
        x, y = next(ckpt.iterator)
        break
      except StopIteration:  # the next epoch: a new iterator, in the checkpoint
        ckpt.epoch += 1
        if self.sampler is not None:
          self.sampler.set_epoch(ckpt.epoch)
        ckpt.iterator = iter(self.dataset)
    per_replica = self.strategy.run(self.step_fn, args=(x, y))
    loss = self.strategy.reduce("mean", per_replica, axis=None)
    ckpt.losses = ckpt.losses + [float(loss.cpu())]
    ckpt.step += 1
    self.manager.save(checkpoint_number=ckpt.step)

  def result(self):
    weights = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
    return {"losses": self.ckpt.losses, "weights": weights, "epoch": self.ckpt.epoch}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dir", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--kinds", default="default,explicit,distributed")
  p.add_argument("--steps", type=int, default=14)
  p.add_argument("--kill-after", type=int, default=-1)
  args = p.parse_args()

  torch.manual_seed(0)  # the user's seed: the default DataLoader draws from it
  strategy = xd.MirroredStrategy()
  pipelines = [Pipeline(strategy, kind, args.dir) for kind in args.kinds.split(",")]
  step = min(p.ckpt.step for p in pipelines)
  while step < args.steps:
    for pipeline in pipelines:
      pipeline.train_step()
    step += 1
    if step == args.kill_after:
      os.kill(os.getpid(), signal.SIGKILL)
  torch.save({p.kind: p.result() for p in pipelines}, args.out)


if __name__ == "__main__":
  main()
