"""TPUStrategy with 2 devices per replica: a batch-split step against the unsplit one.

Run (XLA:CPU, 4 virtual devices: 2 replicas x 2 devices)::

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 PYTHONPATH=. python bench/logical_devices.py

The same training step (an MLP, cross-entropy, SGD with momentum), once with
the replica's batch left whole on both of its devices and once split over them
with `experimental_split_to_logical_devices(x, [2, 1])`. Printed, split over
unsplit:

* matmul FLOPs per device, counted from the dots of each step's HLO (what
  dividing the work is for: about 1/2 for the layers, plus the reassembly);
* host time per step (tracing: the split tensor's rules run in Python);
* wall time per step (device drain included). On XLA:CPU the 4 virtual
  devices share the machine's cores, so halving each device's work does not
  shorten the step here; on TPU each device is a core of its own.

Both variants are warmed up (compiled) first; rounds alternate their order;
medians over rounds. No value is read back in the timed loop.

--plot [PATH] also draws the split / unsplit ratios (matmul FLOPs per device,
host time, wall time) as a PNG (default docs/img/logical_devices.png; needs
matplotlib).
"""

import argparse
import re
import statistics
import time

import torch
import torch.nn.functional as F
from _plot import add_plot_argument, save_plot

import xladist as xd
from xladist import runtime as _runtime

perf = time.perf_counter


def dot_flops(hlo):
  """2 * M * N * K summed over the 2-D dots of an HLO module's text."""
  total = 0
  for line in hlo.splitlines():
    m = re.search(r"f32\[(\d+),(\d+)\]\{[0-9,]*\} dot\(f32\[(\d+),(\d+)\]", line)
    if m:
      rows, cols, _, inner = (int(g) for g in m.groups())
      lhs_contracting = re.search(r"lhs_contracting_dims=\{(\d)\}", line)
      if lhs_contracting and lhs_contracting.group(1) == "0":
        inner = int(m.group(3))
      total += 2 * rows * cols * inner
  return total


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=20, help="steps per round (default 20)")
  parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
  parser.add_argument("--batch", type=int, default=64, help="per-replica batch (default 64)")
  parser.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
  add_plot_argument(parser)
  args = parser.parse_args(argv)

  assignment = xd.experimental.DeviceAssignment.build(computation_shape=[2], num_replicas=None)
  strategy = xd.TPUStrategy(experimental_device_assignment=assignment)
  n, b, w = strategy.num_replicas_in_sync, args.batch, args.width
  g = torch.Generator().manual_seed(0)
  xs = [torch.randn(n * b, w, generator=g) for _ in range(args.steps)]
  ys = [torch.randint(0, 10, (n * b,), generator=g) for _ in range(args.steps)]
  inputs = [
    (
      strategy.experimental_distribute_values_from_function(
        lambda ctx, x=x: x[
          ctx.replica_id_in_sync_group * b : (ctx.replica_id_in_sync_group + 1) * b
        ]
      ),
      strategy.experimental_distribute_values_from_function(
        lambda ctx, y=y: y[
          ctx.replica_id_in_sync_group * b : (ctx.replica_id_in_sync_group + 1) * b
        ]
      ),
    )
    for x, y in zip(xs, ys)
  ]

  with strategy.scope():
    model = torch.nn.Sequential(
      torch.nn.Linear(w, w),
      torch.nn.ReLU(),
      torch.nn.Linear(w, w),
      torch.nn.ReLU(),
      torch.nn.Linear(w, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

  def make_step(split):
    def step(x, y):
      if split:
        x = strategy.experimental_split_to_logical_devices(x, [2, 1])
      loss = F.cross_entropy(model(x), y)
      opt.zero_grad()
      loss.backward()
      opt.step()
      return loss

    return step

  steps = {"unsplit": make_step(False), "split": make_step(True)}

  flops = {}
  for name, step in steps.items():
    out = strategy.run(step, args=inputs[0])
    flops[name] = dot_flops(_runtime.hlo_text([out._stacked] + list(model.parameters())))
    _runtime.sync()

  def round_(name):
    host = 0.0
    _runtime.wait()
    start = perf()
    for x, y in inputs:
      t = perf()
      strategy.run(steps[name], args=(x, y))
      _runtime.sync()
      host += perf() - t
    _runtime.wait()
    return host / len(inputs), (perf() - start) / len(inputs)

  for name in list(steps) * 2:  # warm-up: compile both, in both orders
    round_(name)
  compiles = _runtime.compile_count()
  host = {k: [] for k in steps}
  wall = {k: [] for k in steps}
  for r in range(args.rounds):
    for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
      h, t = round_(name)
      host[name].append(h)
      wall[name].append(t)
  added = _runtime.compile_count() - compiles

  print(
    f"{n} replicas x 2 devices, per-replica batch {b}, width {w}, {args.steps} steps "
    f"per round, {args.rounds} rounds; compilations during the timed rounds: {added}\n"
  )
  print("| variant | matmul MFLOP per device per step | host ms per step | wall ms per step |")
  print("|---|---:|---:|---:|")
  for name in steps:
    print(
      f"| {name} | {flops[name] / 1e6:.1f} | {statistics.median(host[name]) * 1e3:.2f} | "
      f"{statistics.median(wall[name]) * 1e3:.2f} |"
    )
  print(
    f"\nsplit / unsplit: matmul FLOPs per device {flops['split'] / flops['unsplit']:.3f}, "
    f"host time {statistics.median(host['split']) / statistics.median(host['unsplit']):.3f}, "
    f"wall time {statistics.median(wall['split']) / statistics.median(wall['unsplit']):.3f}"
  )
  if args.plot:
    host_ms = {k: statistics.median(v) * 1e3 for k, v in host.items()}
    wall_ms = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
    measures = {
      f"matmul FLOPs per device\n(unsplit {flops['unsplit'] / 1e6:.1f} MFLOP)": flops,
      f"host time\n(unsplit {host_ms['unsplit']:.1f} ms)": host_ms,
      f"wall time\n(unsplit {wall_ms['unsplit']:.1f} ms)": wall_ms,
    }
    path = save_plot(
      args.plot,
      f"Batch split over 2 logical devices per replica ({n} replicas, width {w})",
      "per training step (times: median over rounds)",
      "relative to unsplit (unsplit = 1)",
      {
        name: {m: v[name] / v["unsplit"] for m, v in measures.items()}
        for name in ("unsplit", "split")
      },
      kind="bar",
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
