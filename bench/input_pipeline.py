"""Does the input pipeline make the step wait? Three feeders of one training step.

Run (XLA:CPU, 4 virtual devices)::

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 PYTHONPATH=. python bench/input_pipeline.py

One xladist MirroredStrategy training step (an MLP, cross-entropy, SGD with
momentum), fed three ways in one process, on the same data:

* pre-staged: every step's PerReplica inputs are transferred to the devices
  before the timed loop (the input pipeline costs nothing: the upper bound);
* xladist: `strategy.experimental_distribute_dataset(DataLoader(...))`, whose
  background thread splits each global batch and transfers each replica's
  rows to its device while the previous step runs;
* MpDeviceLoader: torch_xla's own `MpDeviceLoader(loader, device,
  input_sharding={"x": ShardingSpec(mesh, (0, None)), "y": ShardingSpec(mesh,
  (0,))})` (batches are dicts so that both tensors are sharded); its global
  sharded batch is viewed as (replicas, b, ...) and wrapped as a PerReplica for
  the same step.

Each round runs an epoch of each feeder (order alternating between rounds),
with `wait_device_ops()` before and after, so queued device work of one feeder
does not leak into another's time. The figures are steps per second over all
rounds, and the ratios xladist / pre-staged (target >= 0.95) and
xladist / MpDeviceLoader (target >= 1.0), over all rounds and as the median of
the per-round ratios (robust to the machine's slow drifts). No value is read
back in the loop.

--plot [PATH] also draws the steps per second of each feeder as a PNG
(default docs/img/input_pipeline.png; needs matplotlib).
"""

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from _plot import add_plot_argument, save_plot

import xladist as xd
from xladist import runtime as _runtime
from xladist.values import PerReplica

perf = time.perf_counter


def make_model(width):
  return torch.nn.Sequential(
    torch.nn.Linear(64, width),
    torch.nn.ReLU(),
    torch.nn.Linear(width, width),
    torch.nn.ReLU(),
    torch.nn.Linear(width, 10),
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=40, help="steps per epoch (default 40)")
  parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
  parser.add_argument("--batch", type=int, default=64, help="per-replica batch (default 64)")
  parser.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
  parser.add_argument(
    "--buffer",
    type=int,
    default=1,
    help="xladist prefetch depth, InputOptions."
    "experimental_per_replica_buffer_size (default 1, as in TF)",
  )
  add_plot_argument(parser)
  args = parser.parse_args(argv)

  strategy = xd.MirroredStrategy()
  import torch_xla
  import torch_xla.distributed.parallel_loader as pl
  import torch_xla.distributed.spmd as xs

  n, b = strategy.num_replicas_in_sync, args.batch
  global_batch = n * b
  g = torch.Generator().manual_seed(0)
  x = torch.randn(args.steps * global_batch, 64, generator=g)
  y = torch.randint(0, 10, (args.steps * global_batch,), generator=g)
  # Dict batches: MpDeviceLoader shards a batch per key only for dicts.
  examples = [{"x": x[i], "y": y[i]} for i in range(len(x))]
  loader = torch.utils.data.DataLoader(examples, batch_size=global_batch, shuffle=False)

  with strategy.scope():
    model = make_model(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

  def step(batch):
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  def split(t):
    return strategy.experimental_distribute_values_from_function(
      lambda ctx: t[ctx.replica_id_in_sync_group * b : (ctx.replica_id_in_sync_group + 1) * b]
    )

  staged = [{"x": split(batch["x"]), "y": split(batch["y"])} for batch in loader]
  for batch in staged:  # transfer now, outside the timed loop
    for v in batch.values():
      v._stacked_global(n)
  _runtime.wait()

  mesh = xs.Mesh(np.arange(n), (n,), ("data",))
  shardings = {"x": xs.ShardingSpec(mesh, (0, None)), "y": xs.ShardingSpec(mesh, (0,))}

  def as_per_replica(t):
    # MpDeviceLoader gives one global tensor sharded on dim 0; each replica's
    # rows are already on its device.
    return PerReplica._from_stacked(_runtime.place_split(t.view((n, b) + tuple(t.shape[1:]))), n)

  def feed_staged():
    return iter(staged)

  def feed_xladist():
    options = xd.InputOptions(experimental_per_replica_buffer_size=args.buffer)
    return iter(strategy.experimental_distribute_dataset(loader, options))

  def feed_mp():
    mp_loader = pl.MpDeviceLoader(loader, torch_xla.device(), input_sharding=shardings)
    return ({k: as_per_replica(v) for k, v in batch.items()} for batch in mp_loader)

  feeders = {"pre-staged": feed_staged, "xladist": feed_xladist, "MpDeviceLoader": feed_mp}

  def epoch(feed):
    count = 0
    for batch in feed():
      strategy.run(step, args=(batch,))
      _runtime.sync()
      count += 1
    return count

  for feed in feeders.values():  # warm-up: compile every graph
    epoch(feed)
  _runtime.wait()
  compiles = _runtime.compile_count()
  times = {name: 0.0 for name in feeders}
  steps = {name: 0 for name in feeders}
  names = list(feeders)
  round_rates = []
  for r in range(args.rounds):
    rates = {}
    for name in names if r % 2 == 0 else names[::-1]:
      _runtime.wait()
      t = perf()
      count = epoch(feeders[name])
      _runtime.wait()
      elapsed = perf() - t
      steps[name] += count
      times[name] += elapsed
      rates[name] = count / elapsed
    round_rates.append(rates)
  added = _runtime.compile_count() - compiles

  rate = {name: steps[name] / times[name] for name in names}
  print(
    f"{n} replicas, per-replica batch {b}, {args.steps} steps per epoch, "
    f"{args.rounds} rounds, xladist prefetch depth {args.buffer}; compilations "
    f"during the timed epochs: {added}\n"
  )
  print("| feeder | steps/s | ms/step |")
  print("|---|---:|---:|")
  for name in names:
    print(f"| {name} | {rate[name]:.1f} | {1e3 / rate[name]:.2f} |")
  print(
    "\nRatios of throughput: over all rounds; median of the per-round ratios "
    "(the feeders of one round run back to back) and their range.\n"
  )
  print("| ratio | all rounds | median per round | range per round | target |")
  print("|---|---:|---:|---:|---:|")
  for other, target in (("pre-staged", ">= 0.95"), ("MpDeviceLoader", ">= 1.0")):
    per_round = sorted(rr["xladist"] / rr[other] for rr in round_rates)
    print(
      f"| xladist / {other} | {rate['xladist'] / rate[other]:.3f} | "
      f"{statistics.median(per_round):.3f} | {per_round[0]:.3f} .. "
      f"{per_round[-1]:.3f} | {target} |"
    )
  if args.plot:
    path = save_plot(
      args.plot,
      f"Input pipeline: one training step, {n} replicas x batch {b}",
      "feeder",
      "training steps per second (higher is better)",
      {"steps/s over all rounds": {name: rate[name] for name in names}},
      kind="bar",
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
