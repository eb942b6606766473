"""Closures per second of ParameterServerStrategy with 1, 2 and 4 workers.

Run::

  PYTHONPATH=. python bench/parameter_server.py [--closures 200] [--workers 1 2 4]

For each worker count a chief process (this script with `--chief N`; a
process joins one cluster in its life) starts a cluster of that many workers
and 2 ps tasks on this machine (this script with `--task`, one XLA:CPU device
and one intra-op thread per worker), schedules a training step
of an MLP (64 -> width -> width -> 10, a per-worker batch of 64 made on the
worker, SGD with momentum applied on the ps tasks) and times `--closures`
scheduled steps after a warm-up in which every worker compiled the step. A
closure is one round trip chief -> worker, one read of the variables from the
ps tasks, one XLA execution, one gradient update on the ps tasks.

The figures are closures per second (mean of `--repeats` timed runs), its
spread, and the ratio to the 1-worker figure. The tasks share this machine's
cores, so the ratio says how much of the work the workers overlap here, not
how a cluster of separate hosts scales.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import xladist as xd

WIDTH = 256
BATCH = 64


class MLP(torch.nn.Module):
  def __init__(self, width):
    super().__init__()
    self.layers = torch.nn.Sequential(
      torch.nn.Linear(64, width),
      torch.nn.ReLU(),
      torch.nn.Linear(width, width),
      torch.nn.ReLU(),
      torch.nn.Linear(width, 10),
    )

  def forward(self, x):
    return self.layers(x)


def make_batch():
  """Runs on each worker once: its batch, kept on its device."""
  g = torch.Generator().manual_seed(0)
  device = xd.get_strategy().extended.worker_devices[0]
  x = torch.randn(BATCH, 64, generator=g)
  y = torch.randint(0, 10, (BATCH,), generator=g)
  return x.to(device), y.to(device)


def train_step(model, optimizer, batch):
  x, y = batch
  loss = F.cross_entropy(model(x), y)
  optimizer.zero_grad()
  loss.backward()
  optimizer.step()
  return loss.detach()


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def measure(num_workers, closures, repeats):
  cluster = {
    "chief": [f"127.0.0.1:{free_port()}"],
    "worker": [f"127.0.0.1:{free_port()}" for _ in range(num_workers)],
    "ps": [f"127.0.0.1:{free_port()}" for _ in range(2)],
  }
  env = dict(
    os.environ,
    PJRT_DEVICE="CPU",
    CPU_NUM_DEVICES="1",
    OMP_NUM_THREADS="1",
  )
  here = os.path.abspath(__file__)
  procs = [
    subprocess.Popen(
      [sys.executable, here, "--task", f"{job}:{i}", "--cluster", json.dumps(cluster)], env=env
    )
    for job, n in (("worker", num_workers), ("ps", 2))
    for i in range(n)
  ]
  coordinator = None
  try:
    resolver = xd.cluster_resolver.SimpleClusterResolver(cluster, task_type="chief", task_id=0)
    strategy = xd.ParameterServerStrategy(resolver)
    coordinator = xd.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
      torch.manual_seed(0)
      model = MLP(WIDTH)
      optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = coordinator.per_worker_values(make_batch)
    for _ in range(4 * num_workers):  # every worker compiles the step
      coordinator.schedule(train_step, args=(model, optimizer, batch))
    coordinator.join()
    rates = []
    for _ in range(repeats):
      start = time.perf_counter()
      for _ in range(closures):
        coordinator.schedule(train_step, args=(model, optimizer, batch))
      coordinator.join()
      rates.append(closures / (time.perf_counter() - start))
    done = [s["completed"] for s in coordinator.experimental_worker_stats]
    return rates, done
  finally:
    if coordinator is not None:
      coordinator.shutdown()
    deadline = time.monotonic() + 60
    for p in procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--closures", type=int, default=200, help="closures per timed run")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs per worker count")
  parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--task", help=argparse.SUPPRESS)
  parser.add_argument("--cluster", help=argparse.SUPPRESS)
  parser.add_argument("--chief", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.task:
    job, index = args.task.split(":")
    xd.Server(json.loads(args.cluster), job_name=job, task_index=int(index)).join()
    return
  if args.chief:
    rates, done = measure(args.chief, args.closures, args.repeats)
    print("RESULT " + json.dumps({"rates": rates, "done": done}), flush=True)
    return

  results = {}
  for n in args.workers:
    cmd = [sys.executable, os.path.abspath(__file__), "--chief", str(n)]
    cmd += ["--closures", str(args.closures), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not lines:
      sys.exit(f"the {n}-worker run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    results[n] = result["rates"]
    rates = [f"{r:.1f}" for r in result["rates"]]
    print(f"{n} worker(s): {rates} closures/s; closures per worker {result['done']}", flush=True)
  base = statistics.mean(results[args.workers[0]])
  print(
    f"\nParameterServerStrategy, MLP width {WIDTH}, batch {BATCH} per closure, 2 ps tasks, "
    f"{os.cpu_count()} CPU cores shared by every task, {args.closures} closures x "
    f"{args.repeats} runs; load average {os.getloadavg()[0]:.1f}\n"
  )
  print(f"| workers | closures/s | spread | ratio to {args.workers[0]} worker |")
  print("|---:|---:|---:|---:|")
  for n, rates in results.items():
    mean = statistics.mean(rates)
    spread = f"{min(rates):.1f}-{max(rates):.1f}"
    print(f"| {n} | {mean:.1f} | {spread} | {mean / base:.2f} |")


if __name__ == "__main__":
  main()
