"""Collectives on XLA:CPU: packed vs per-tensor gradient all-reduce, and all-reduce bandwidth.

Run (XLA:CPU, 4 virtual devices)::

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 PYTHONPATH=. python bench/collectives.py

(a) Training step time of a model with many small parameter tensors (--layers
    Linear(--width, --width) layers, two tensors each; default 100 layers = 200
    tensors), SGD, per-replica batch --batch:
      * per-tensor: MirroredStrategy(cross_device_ops=xd.NcclAllReduce(num_packs=0)),
        one all-reduce per gradient;
      * packed: MirroredStrategy() (the default), one all-reduce per dtype.
    Both start from the same weights and see the same data. Each variant is
    warmed up until compiled; then --rounds rounds, each running a block of
    --steps steps of each variant (order alternating between rounds) with
    `wait_device_ops` before the block and at its end. A step's time runs from
    its start to the next step's start (the last one until the final wait
    returns); nothing is read back to the host inside the timed loop. In
    steady state the device runs a step while the host traces the next, so
    the step time is the larger of the two; each round therefore also runs
    --steps isolated steps per variant (wait_device_ops after each) and times
    the device part: from the launch (sync() returned) until wait_device_ops
    returns. Reported: the median step time and device time of each variant
    over all rounds, their ratios, and the number of all-reduces in each
    variant's HLO (XLA:CPU does not combine all-reduces: its optimised HLO
    keeps them all, checked with XLA_FLAGS=--xla_dump_to). The compile count
    of the timed loop must be 0.

(b) All-reduce bandwidth for sizes 1 KiB .. 64 MiB per replica (powers of 4):
    a `strategy.run` whose step does k chained `ReplicaContext.all_reduce("mean", x)`
    on an f32 tensor of that size (each one depends on the last, so none can be
    merged or dropped). The time of one all-reduce is the slope
    (t(k2) - t(k1)) / (k2 - k1) between two such programs (median of --reps
    executions each, wall time from launch to wait_device_ops), which cancels
    the per-execution cost (tracing, launch, region entry/exit). For comparison
    the table also shows t(k1) and the time of the same step with no collective
    (one elementwise `x * 0.5 + 0.25`: the per-execution cost plus one pass
    over x; a chain of those would be fused into one pass, so it has no slope
    to take). algbw = bytes per replica / time; busbw =
    algbw * 2 (N - 1) / N (the NCCL-tests convention: the bytes each device
    must move in a ring all-reduce). Printed next to the machine's memory-copy
    bandwidth (numpy copy of a 256 MiB array; bytes copied / time, so memory
    traffic is twice that).

    On XLA:CPU the "devices" are threads of one process sharing this host's
    memory, so an all-reduce is memory traffic and its bandwidth is bounded by
    the copy bandwidth, not by an interconnect.

--plot [PATH] also draws (b) as a PNG (log-log: algbw and busbw against size,
the memory-copy bandwidth as a reference line; default
docs/img/collectives.png; needs matplotlib).
"""

import argparse
import gc
import statistics
import time

import numpy as np
import torch
from _plot import add_plot_argument, save_plot

import xladist as xd
from xladist import runtime as _runtime


class ManyLinears(torch.nn.Module):
  def __init__(self, layers, width):
    super().__init__()
    self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

  def forward(self, x):
    for layer in self.layers:
      x = torch.tanh(layer(x))
    return x


def _count_all_reduces(tensors):
  return _runtime.hlo_text(tensors).count(" all-reduce(")


def bench_packing(args):
  torch.manual_seed(0)
  state = ManyLinears(args.layers, args.width).state_dict()
  variants = {}
  for name, ops in (("per-tensor", xd.NcclAllReduce(num_packs=0)), ("packed", None)):
    strategy = xd.MirroredStrategy(cross_device_ops=ops)
    with strategy.scope():
      model = ManyLinears(args.layers, args.width)
      model.load_state_dict(state)
      opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x, model=model, opt=opt):
      loss = model(x).square().mean()
      opt.zero_grad()
      loss.backward()
      opt.step()
      return loss

    x = strategy.experimental_distribute_values_from_function(
      lambda c: torch.randn(
        args.batch, args.width, generator=torch.Generator().manual_seed(c.replica_id_in_sync_group)
      )
    )
    variants[name] = (strategy, step, x, model)

  counts = {}
  for name, (strategy, step, x, model) in variants.items():
    strategy.run(step, args=(x,))
    counts[name] = _count_all_reduces(list(model.parameters()))
    _runtime.sync()
    for _ in range(args.warmup):
      strategy.run(step, args=(x,))
      _runtime.sync()
    _runtime.wait()

  times = {name: [] for name in variants}
  device = {name: [] for name in variants}
  compiles = _runtime.compile_count()
  names = list(variants)
  for r in range(args.rounds):
    for name in names if r % 2 == 0 else names[::-1]:
      strategy, step, x, _ = variants[name]
      _runtime.wait()
      starts = []
      for _ in range(args.steps):
        starts.append(time.perf_counter())
        strategy.run(step, args=(x,))
        _runtime.sync()
      _runtime.wait()
      starts.append(time.perf_counter())
      times[name] += [b - a for a, b in zip(starts, starts[1:])]
      for _ in range(args.steps):  # isolated: the device is idle when a step starts
        strategy.run(step, args=(x,))
        _runtime.sync()
        launched = time.perf_counter()
        _runtime.wait()
        device[name].append(time.perf_counter() - launched)
  compiles = _runtime.compile_count() - compiles

  n_params = len(list(variants["packed"][3].parameters()))
  print(
    f"(a) training step, {args.layers} x Linear({args.width}, {args.width}) = "
    f"{n_params} parameter tensors, {variants['packed'][0].num_replicas_in_sync} "
    f"replicas, per-replica batch {args.batch}; {args.rounds} rounds x {args.steps} "
    f"steps per variant, interleaved; compiles in timed loop: {compiles}"
  )
  med, dev = {}, {}
  for name in names:
    med[name] = statistics.median(times[name])
    dev[name] = statistics.median(device[name])
    print(
      f"    {name:<11} all-reduces in HLO: {counts[name]:>4}   median step "
      f"{med[name] * 1e3:8.2f} ms   mean {statistics.fmean(times[name]) * 1e3:8.2f} ms"
      f"   ({len(times[name])} steps)   device (launch -> done, isolated): median "
      f"{dev[name] * 1e3:7.2f} ms"
    )
  print(
    f"    per-tensor / packed: step time {med['per-tensor'] / med['packed']:.2f}x, "
    f"device time {dev['per-tensor'] / dev['packed']:.2f}x"
  )
  # Both variants trained identically: same weights after the same steps.
  a, b = (list(variants[n][3].parameters()) for n in names)
  diff = max(float((p.detach().cpu() - q.detach().cpu()).abs().max()) for p, q in zip(a, b))
  print(f"    max |param difference| between the variants after training: {diff:.2e}")
  # Free both models before (b): every torch_xla.sync() walks all live XLA
  # tensors, so leftovers would add to each execution measured there.
  variants.clear()
  del a, b
  gc.collect()


def _chain_time(strategy, x, k, collective, reps):
  def fn(v):
    ctx = xd.get_replica_context()
    for _ in range(k):
      v = ctx.all_reduce("mean", v) if collective else v * 0.5 + 0.25
    return v

  out = strategy.run(fn, args=(x,))  # compile
  _runtime.sync()
  _runtime.wait()
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = strategy.run(fn, args=(x,))
    _runtime.sync()
    _runtime.wait()
    ts.append(time.perf_counter() - t0)
  del out
  return statistics.median(ts)


def memcpy_bandwidth():
  src = np.ones(64 * 1024 * 1024, dtype=np.float32)  # 256 MiB
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - t0)
  return src.nbytes / best / 1e9


def bench_bandwidth(args):
  strategy = xd.MirroredStrategy()
  n = strategy.num_replicas_in_sync
  copy_gbs = memcpy_bandwidth()
  print(
    f"\n(b) all-reduce (mean, f32) over {n} XLA:CPU devices; time per all-reduce = "
    f"slope between k1 and k2 chained all-reduces, median of {args.reps} executions"
  )
  print(f"    memory copy (numpy, 256 MiB): {copy_gbs:.2f} GB/s (bytes copied / time)")
  rows = []
  print(
    f"    {'size':>8} {'k1,k2':>7} {'per all-reduce':>13} {'algbw':>13} "
    f"{'busbw':>13} {'t(k1)':>12} {'no-coll.':>12}"
  )
  size = 1024
  while size <= args.max_bytes:
    numel = size // 4
    x = strategy.experimental_distribute_values_from_function(
      lambda c: torch.full((numel,), float(c.replica_id_in_sync_group))
    )
    k1, k2 = (8, 72) if size < (1 << 20) else (4, 16) if size < (16 << 20) else (2, 5)
    t1 = _chain_time(strategy, x, k1, True, args.reps)
    t2 = _chain_time(strategy, x, k2, True, args.reps)
    per = max((t2 - t1) / (k2 - k1), 1e-9)
    base = _chain_time(strategy, x, 1, False, args.reps)
    algbw = size / per / 1e9
    busbw = algbw * 2 * (n - 1) / n
    label = f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
    print(
      f"    {label:>8} {f'{k1},{k2}':>7} {per * 1e6:10.1f} us {algbw:8.3f} GB/s "
      f"{busbw:8.3f} GB/s {t1 * 1e3:9.2f} ms {base * 1e3:9.2f} ms",
      flush=True,
    )
    rows.append((size, label, algbw, busbw))
    del x
    size *= 4
  return n, copy_gbs, rows


def plot_bandwidth(path, n, copy_gbs, rows):
  sizes = [r[0] for r in rows]
  ends = [sizes[0], sizes[-1]]
  return save_plot(
    path,
    f"All-reduce (mean, f32) over {n} XLA:CPU devices",
    "bytes per replica",
    "bandwidth (GB/s)",
    {
      "algbw (bytes / time)": (sizes, [r[2] for r in rows]),
      f"busbw (algbw x 2({n}-1)/{n})": (sizes, [r[3] for r in rows]),
      "memory copy (numpy, 256 MiB)": (ends, [copy_gbs] * 2),
    },
    logx=True,
    logy=True,
    xticks={r[0]: r[1] for r in rows},
  )


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=100)
  p.add_argument("--width", type=int, default=16)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--max-bytes", type=int, default=64 << 20)
  p.add_argument("--skip-packing", action="store_true")
  p.add_argument("--skip-bandwidth", action="store_true")
  add_plot_argument(p)
  args = p.parse_args()
  if args.plot and args.skip_bandwidth:
    p.error("--plot draws the bandwidth figure of (b); drop --skip-bandwidth")
  t0 = time.perf_counter()
  if not args.skip_packing:
    bench_packing(args)
  if not args.skip_bandwidth:
    measured = bench_bandwidth(args)
    if args.plot:
      print(f"\nwrote {plot_bandwidth(args.plot, *measured)}")
  print(f"\ntotal bench time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
