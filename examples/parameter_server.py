"""Asynchronous parameter-server training of an MLP on scikit-learn's 8x8 digits.

One command starts the whole cluster on this machine: this process is the
chief (the coordinator); it starts 2 worker and 2 ps processes (this same
script with `--task worker:0` etc., each running `xd.Server(...).join()`) on
free localhost ports, and ends them when it is done (killing any that are
left, by pid).

What this demo shows:

* `xd.ParameterServerStrategy(resolver, variable_partitioner=...)`: the model
  and optimizer made under `strategy.scope()` live on the ps tasks; the first
  layer's weight (64 x 128 floats, 32 KiB) is split into two shards on the
  two ps tasks by `MaxSizePartitioner(16 KiB)`.
* `xd.coordinator.ClusterCoordinator(strategy)`: `schedule(train_step, ...)`
  returns a `RemoteValue` at once; the two workers take the scheduled steps
  from a queue and run them on their XLA device, asynchronously: each reads
  the current weights from the ps tasks, computes the gradients, and the ps
  tasks apply them (the optimizer's state stays there).
* `create_per_worker_dataset(dataset_fn)`: each worker builds its own input
  pipeline; `dataset_fn(input_context)` keeps the worker's shard of the
  training set (`input_pipeline_id` of `num_input_pipelines`).
* Evaluation on the chief: `coordinator.join()` reads the weights from the ps
  tasks into the chief's model (shards reassembled), which then runs as a
  plain module; a checkpoint is saved with `xladist.checkpoint`.

The data set is `sklearn.datasets.load_digits` (1797 images, bundled with
scikit-learn); 20% is held out, stratified.

Run:  PYTHONPATH=. python examples/parameter_server.py [--steps 400]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import xladist as xd
import xladist.checkpoint as xc

SEED = 0
BATCH = 32
WORKERS, PS = 2, 2
TARGET_ACCURACY = 0.9


class Net(nn.Module):
  def __init__(self):
    super().__init__()
    self.hidden = nn.Linear(64, 128)
    self.head = nn.Linear(128, 10)

  def forward(self, x):
    return self.head(F.relu(self.hidden(x)))


def load_data():
  digits = load_digits()
  x = digits.data.astype(np.float32) / 16.0
  y = digits.target.astype(np.int64)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=SEED)
  return (
    torch.from_numpy(x_tr),
    torch.from_numpy(y_tr),
    torch.from_numpy(x_te),
    torch.from_numpy(y_te),
  )


class ShuffledBatches:
  """Endless shuffled batches of one worker's shard (a new order every pass)."""

  def __init__(self, x, y, seed):
    self.x, self.y, self.seed = x, y, seed

  def __iter__(self):
    g = torch.Generator().manual_seed(self.seed)
    while True:
      order = torch.randperm(len(self.x), generator=g)
      for i in range(0, len(order) - BATCH + 1, BATCH):
        rows = order[i : i + BATCH]
        yield self.x[rows], self.y[rows]


def dataset_fn(input_context):
  """Runs on each worker: its shard of the training set."""
  x, y, _, _ = load_data()
  shard = slice(input_context.input_pipeline_id, None, input_context.num_input_pipelines)
  return ShuffledBatches(x[shard], y[shard], SEED + input_context.input_pipeline_id)


def train_step(model, optimizer, iterator):
  """Runs on a worker: one step on its next batch; returns the loss."""
  strategy = xd.get_strategy()

  def replica_fn(x, y):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # the gradients go to the ps tasks, which apply them
    return loss.detach()

  return strategy.run(replica_fn, args=next(iterator))


def accuracy(model, x, y):
  with torch.no_grad():
    return float((model(x).argmax(1) == y).float().mean())


# -- the cluster on this machine ------------------------------------------------------


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_tasks(cluster):
  """Starts every worker and ps task as a process running this script."""
  env = dict(
    os.environ,
    PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"),
    CPU_NUM_DEVICES="1",  # one XLA:CPU device per worker
    OMP_NUM_THREADS="1",
  )
  here = os.path.abspath(__file__)
  return {
    f"{job}:{i}": subprocess.Popen(
      [sys.executable, here, "--task", f"{job}:{i}", "--cluster", json.dumps(cluster)], env=env
    )
    for job, n in (("worker", WORKERS), ("ps", PS))
    for i in range(n)
  }


def run_task(task, cluster):
  job, index = task.split(":")
  xd.Server(json.loads(cluster), job_name=job, task_index=int(index)).join()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=400, help="training steps to schedule (default 400)")
  p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9")
  p.add_argument("--task", help=argparse.SUPPRESS)  # set for the worker and ps processes
  p.add_argument("--cluster", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.task:
    return run_task(args.task, args.cluster)

  cluster = {
    "chief": [f"127.0.0.1:{free_port()}"],
    "worker": [f"127.0.0.1:{free_port()}" for _ in range(WORKERS)],
    "ps": [f"127.0.0.1:{free_port()}" for _ in range(PS)],
  }
  tasks = start_tasks(cluster)
  coordinator = None
  try:
    start = time.perf_counter()
    resolver = xd.cluster_resolver.SimpleClusterResolver(cluster, task_type="chief", task_id=0)
    strategy = xd.ParameterServerStrategy(
      resolver, variable_partitioner=xd.experimental.partitioners.MaxSizePartitioner(16 << 10)
    )
    coordinator = xd.coordinator.ClusterCoordinator(strategy)
    print(
      f"cluster of {WORKERS} workers and {PS} ps tasks up in {time.perf_counter() - start:.1f} s"
    )

    with strategy.scope():
      torch.manual_seed(SEED)
      model = Net()
      optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for name, p_ in model.named_parameters():
      shards = strategy.extended.variable_shards(p_)
      where = ", ".join(f"{d.split('/')[1]}/{d.split('/')[3]} rows {r}" for d, _, r in shards)
      print(f"  {name:14s} {tuple(p_.shape)!s:10s} -> {where}")

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    _, _, x_test, y_test = load_data()
    print(f"test accuracy before training: {accuracy(model, x_test, y_test):.3f}")

    start = time.perf_counter()
    losses = [
      coordinator.schedule(train_step, args=(model, optimizer, iterator)) for _ in range(args.steps)
    ]
    coordinator.join()
    seconds = time.perf_counter() - start
    first = np.mean([float(rv.fetch()) for rv in losses[:20]])
    last = np.mean([float(rv.fetch()) for rv in losses[-20:]])
    print(
      f"{args.steps} steps in {seconds:.1f} s ({args.steps / seconds:.0f} steps/s); "
      f"loss {first:.3f} (first 20) -> {last:.3f} (last 20)"
    )
    for s in coordinator.experimental_worker_stats:
      print(f"  {s['task']}: {s['completed']} steps")

    acc = accuracy(model, x_test, y_test)
    print(f"test accuracy: {acc:.3f}")
    with tempfile.TemporaryDirectory() as d:
      path = xc.Checkpoint(model=model, optimizer=optimizer).save(os.path.join(d, "ckpt"))
      print(f"checkpoint: {os.path.getsize(path)} bytes, weights reassembled from the shards")
    if acc < TARGET_ACCURACY:
      sys.exit(f"test accuracy {acc:.3f} is below {TARGET_ACCURACY}")
  finally:
    if coordinator is not None:
      coordinator.shutdown()  # every worker and ps task's join() returns
    deadline = time.monotonic() + 60
    for proc in tasks.values():
      try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
  main()
