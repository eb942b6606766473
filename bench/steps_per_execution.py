"""Per-step wall time with k training steps per XLA execution (k = 1, 4, 16).

Run (XLA:CPU, 4 virtual devices)::

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 PYTHONPATH=. python bench/steps_per_execution.py

One MirroredStrategy training step (an MLP, cross-entropy, SGD with momentum)
fed from `strategy.experimental_distribute_dataset(DataLoader(...))`, run as
`strategy.extended.experimental_run_steps(step, iterator, k)`: k steps traced
back to back and cut once, so one compiled program runs k steps. Every k runs
the same number of steps per round (a multiple of 16) on the same data; each k
is warmed up first (its programs compiled); rounds alternate the order of the
k values, with `wait_device_ops()` around each timed block (the warm-up runs
both orders, so every transition between k values is compiled before timing). The figure is wall
time per step (block time / steps, device drain included), median over
rounds, and its ratio to k = 1. No value is read back in the timed loop.

--plot [PATH] also draws ms per step against k as a PNG (default
docs/img/steps_per_execution.png; needs matplotlib).

With replay (the default, docs/architecture.md "Replay"), after its first
traces a call replays its first step, then the other k - 1 steps as ONE
captured program (Replayer.replay_steps): two executions per call for k > 1,
none of them traced. --no-replay runs the same traced (XLADIST_REPLAY=0): k
steps traced back to back and cut once, one execution per call.
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _plot import add_plot_argument, save_plot

import xladist as xd
from xladist import runtime as _runtime

perf = time.perf_counter


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=32, help="steps per round (multiple of 16)")
  parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
  parser.add_argument("--batch", type=int, default=16, help="per-replica batch (default 16)")
  parser.add_argument("--width", type=int, default=128, help="MLP width (default 128)")
  parser.add_argument(
    "--no-replay",
    dest="replay",
    action="store_false",
    help="trace every step (XLADIST_REPLAY=0), see above",
  )
  add_plot_argument(parser)
  args = parser.parse_args(argv)
  if args.steps % 16:
    parser.error("--steps must be a multiple of 16")
  os.environ["XLADIST_REPLAY"] = "1" if args.replay else "0"

  strategy = xd.MirroredStrategy()
  n, b = strategy.num_replicas_in_sync, args.batch
  g = torch.Generator().manual_seed(0)
  x = torch.randn(args.steps * n * b, 32, generator=g)
  y = torch.randint(0, 10, (args.steps * n * b,), generator=g)
  loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=n * b)
  dataset = strategy.experimental_distribute_dataset(loader)

  with strategy.scope():
    model = torch.nn.Sequential(
      torch.nn.Linear(32, args.width),
      torch.nn.ReLU(),
      torch.nn.Linear(args.width, args.width),
      torch.nn.ReLU(),
      torch.nn.Linear(args.width, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

  def step(xb, yb):
    loss = F.cross_entropy(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  def epoch(k):
    it = iter(dataset)
    done = 0
    while True:
      out = strategy.extended.experimental_run_steps(step, it, k)
      if not out:
        return done
      done += len(out)

  ks = (1, 4, 16)
  # Warm-up: one round in each order. The programs that run right after another
  # k's are compiled separately (their inputs come from a different program),
  # so every transition between k values is warmed up, not only each k.
  for order in (ks, ks[::-1]):
    for k in order:
      epoch(k)
      epoch(k)
  _runtime.wait()
  compiles, executions = _runtime.compile_count(), _runtime.execute_count()
  per_step = {k: [] for k in ks}
  for r in range(args.rounds):
    for k in ks if r % 2 == 0 else ks[::-1]:
      _runtime.wait()
      t = perf()
      done = epoch(k)
      _runtime.wait()
      per_step[k].append((perf() - t) / done)
  added = _runtime.compile_count() - compiles
  ran = _runtime.execute_count() - executions
  expected = args.rounds * sum(args.steps // k for k in ks)
  if args.replay:  # the replayed first step, then the other k - 1 as one program
    expected = args.rounds * sum(args.steps // k * (1 if k == 1 else 2) for k in ks)
  replayer = strategy.extended._engine._replayer

  print(
    f"{n} replicas, per-replica batch {b}, {args.steps} steps per round, "
    f"{args.rounds} rounds, replay {'on' if args.replay else 'off'}; compilations "
    f"during the timed rounds: {added}; executions: {ran} (expected {expected}: "
    f"{'one for k = 1, two per call for k > 1' if args.replay else 'one per k steps'}); "
    "steps replayed in all: "
    f"{replayer.replays if replayer is not None else 0}\n"
  )
  print("| k steps per execution | ms per step (median) | ratio to k = 1 |")
  print("|---:|---:|---:|")
  base = statistics.median(per_step[1])
  for k in ks:
    m = statistics.median(per_step[k])
    print(f"| {k} | {m * 1e3:.2f} | {m / base:.3f} |")
  if args.plot:
    path = save_plot(
      args.plot,
      f"Steps per execution: MLP step, {n} replicas x batch {b}",
      "k training steps per XLA execution",
      "wall ms per step (median over rounds)",
      {"ms per step": {f"k = {k}": statistics.median(per_step[k]) * 1e3 for k in ks}},
      kind="bar",
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
