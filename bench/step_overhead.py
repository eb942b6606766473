"""Step overhead of xladist against a hand-written torch_xla SPMD training step.

Run (XLA:CPU, 4 virtual devices)::

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 PYTHONPATH=. python bench/step_overhead.py

What is compared
  Two variants of the same data-parallel training step, in one process, on the
  same devices, with the same model architecture, the same initial weights (both
  load the state_dict of one CPU model) and the same data:

  * xladist: the model and a momentum SGD are made under
    `xd.MirroredStrategy().scope()`; a step is `strategy.run(step, (xb, yb))`
    followed by `_runtime.sync()`. `xb`/`yb` are PerReplica values built once
    with `experimental_distribute_values_from_function` and reused every step.
  * hand-written: the idiomatic torch_xla SPMD step: the model moved to 'xla'
    (parameters replicated by default), the global batch (N*b, ...) staged on the
    device once and sharded over a 1-D ("data",) mesh with `xs.mark_sharding`,
    and `loss = CE(model(x), y); zero_grad; backward; step; torch_xla.sync()`.

  Both compute the same math (the mean of the per-replica mean losses equals the
  global mean loss), so their parameters must agree after the same number of
  steps; the script checks that.

  Models: (1) an MLP of 10 Linear layers (20 parameter tensors), (2) 9
  nn.TransformerEncoderLayer (d_model 64, 4 heads, FF 128, dropout 0,
  batch_first) with mean pooling and a linear head (110 parameter tensors).

Method
  * The strategy is created first (it switches torch_xla to SPMD mode).
  * Each variant is warmed up (--warmup steps, default 3) until its graphs are
    compiled; the number of XLA compilations during the timed loop is read from
    torch_xla's metrics and printed (it must be 0), as are the numbers of XLA
    executions per step (must be 1) and of device->host transfers (must be 0:
    nothing is read back inside the timed loop).
  * Timed loop: --rounds rounds; in each round --steps steps of one variant, then
    --steps of the other, alternating which goes first. `xm.wait_device_ops()`
    is called before and at the end of each variant's block so that queued
    device work of one variant does not leak into the other's timings.
  * Per step we record
      host:  from the step's start until `sync()` returns (Python + tracing +
             graph hashing + launching the asynchronous execution);
      wall:  from the step's start to the next step's start (device work of a
             step may overlap the tracing of the next); for the last step of a
             block the wall time runs to the end of the block's final
             `wait_device_ops()`, so the drain is included.
    Reported: the median per-step wall and host times, and the block total
    (sum over blocks of start-of-block to end-of-drain) divided by the number
    of steps.
  * --profile N runs cProfile over N further steps of each variant of the
    transformer and prints the most expensive xladist functions.

Caveat: on XLA:CPU the "device" shares the host's CPU cores, so device work of a
step competes with the tracing of the next one; wall times on a 2-core machine
are noisy. Host times are the better measure of xladist's own overhead.
"""

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import xladist as xd
from xladist import _runtime


# -- models --------------------------------------------------------------------

class MLP(nn.Module):

  def __init__(self, width=256, depth=10, classes=10):
    super().__init__()
    layers = [nn.Linear(width, width) for _ in range(depth - 1)]
    self.hidden = nn.ModuleList(layers)
    self.out = nn.Linear(width, classes)

  def forward(self, x):
    for layer in self.hidden:
      x = F.relu(layer(x))
    return self.out(x)


class Encoder(nn.Module):
  """nn.TransformerEncoder's computation (no mask, no final norm) + mean pool + head.

  The layers are built one by one instead of with nn.TransformerEncoder, which
  deep-copies one layer: xladist does not place modules that `copy.deepcopy`
  makes inside `strategy.scope()` (their parameters stay on the CPU).
  """

  def __init__(self, d_model=64, nhead=4, ff=128, layers=9, classes=10):
    super().__init__()
    self.layers = nn.ModuleList(
        nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=ff, dropout=0.0,
                                   batch_first=True) for _ in range(layers))
    self.head = nn.Linear(d_model, classes)

  def forward(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(x.mean(dim=1))


def make_data(name, n, b, seq, generator):
  if name == "mlp":
    x = torch.randn(n * b, 256, generator=generator)
  else:
    x = torch.randn(n * b, seq, 64, generator=generator)
  y = torch.randint(0, 10, (n * b,), generator=generator)
  return x, y


# -- the two variants ----------------------------------------------------------

LR, MOMENTUM = 0.01, 0.9


class XladistVariant:
  name = "xladist"

  def __init__(self, strategy, factory, state, x, y, b):
    self.strategy = strategy
    with strategy.scope():
      self.model = factory()
      self.model.load_state_dict(state)
      self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
    model, opt = self.model, self.opt
    cpu = [name for name, p in model.named_parameters() if p.device.type != "xla"]
    if cpu:
      raise RuntimeError(f"xladist left {len(cpu)} parameters on the CPU: {cpu[:3]}")

    def step(xr, yr):
      loss = F.cross_entropy(model(xr), yr)
      opt.zero_grad()
      loss.backward()
      opt.step()
      return loss
    self._step = step
    # Pre-staged inputs: the PerReplica values are built once and reused.
    self.xb = strategy.experimental_distribute_values_from_function(
        lambda ctx: x[ctx.replica_id_in_sync_group * b:(ctx.replica_id_in_sync_group + 1) * b])
    self.yb = strategy.experimental_distribute_values_from_function(
        lambda ctx: y[ctx.replica_id_in_sync_group * b:(ctx.replica_id_in_sync_group + 1) * b])

  def step(self):
    out = self.strategy.run(self._step, args=(self.xb, self.yb))
    _runtime.sync()
    return out

  def params(self):
    return [p.detach().cpu() for p in self.model.parameters()]


class HandWrittenVariant:
  name = "hand-written"

  def __init__(self, factory, state, x, y, n):
    import torch_xla
    import torch_xla.distributed.spmd as xs
    self._sync = torch_xla.sync
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    model = factory()
    model.load_state_dict(state)
    self.model = model.to("xla")  # parameters: replicated (the SPMD default)
    self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
    self.x = x.to("xla")
    self.y = y.to("xla")
    xs.mark_sharding(self.x, mesh, ("data",) + (None,) * (x.dim() - 1))
    xs.mark_sharding(self.y, mesh, ("data",))
    torch_xla.sync()

  def step(self):
    loss = F.cross_entropy(self.model(self.x), self.y)
    self.opt.zero_grad()
    loss.backward()
    self.opt.step()
    self._sync()
    return loss

  def params(self):
    return [p.detach().cpu() for p in self.model.parameters()]


# -- timing --------------------------------------------------------------------

def _metric_count(name):
  import torch_xla.debug.metrics as met
  data = met.metric_data(name)
  return 0 if data is None else data[0]


def _counter(name):
  import torch_xla.debug.metrics as met
  return met.counter_value(name) or 0


def run_block(variant, steps, rec):
  """`steps` timed steps of `variant`; appends to rec (a dict of lists)."""
  _runtime.wait()
  perf = time.perf_counter
  starts, host = [], []
  c0, e0 = _runtime.compile_count(), _runtime.execute_count()
  d0 = _metric_count("TransferFromDeviceTime")
  for _ in range(steps):
    t0 = perf()
    variant.step()
    t1 = perf()
    starts.append(t0)
    host.append(t1 - t0)
  _runtime.wait()
  end = perf()
  rec["compiles"] += _runtime.compile_count() - c0
  rec["executes"] += _runtime.execute_count() - e0
  rec["d2h"] += _metric_count("TransferFromDeviceTime") - d0
  rec["host"] += host
  rec["wall"] += [b - a for a, b in zip(starts, starts[1:] + [end])]
  rec["total"] += end - starts[0]
  rec["steps"] += steps


def new_record():
  return {"host": [], "wall": [], "total": 0.0, "steps": 0, "compiles": 0,
          "executes": 0, "d2h": 0}


def max_abs_diff(a, b):
  return max(float((p - q).abs().max()) for p, q in zip(a, b))


def profile_steps(variant, steps, top):
  _runtime.wait()
  prof = cProfile.Profile()
  t0 = time.perf_counter()
  prof.enable()
  for _ in range(steps):
    variant.step()
  prof.disable()
  host = (time.perf_counter() - t0) / steps
  _runtime.wait()
  stream = io.StringIO()
  stats = pstats.Stats(prof, stream=stream)
  stats.sort_stats("cumulative")
  return prof, stats, stream, host


def print_profile(name, variant, steps, top):
  prof, stats, stream, host = profile_steps(variant, steps, top)
  print(f"\ncProfile of {steps} {name} steps ({host * 1e3:.2f} ms/step under the "
        "profiler); xladist functions by cumulative time:")
  rows = []
  for (path, line, func), (cc, nc, tt, ct, _) in stats.stats.items():
    if os.sep + "xladist" + os.sep in path:
      rel = path[path.rindex(os.sep + "xladist" + os.sep) + 1:]
      rows.append((ct, tt, nc, f"{rel}:{line}({func})"))
  rows.sort(reverse=True)
  print(f"  {'cum ms/step':>11} {'self ms/step':>12} {'calls/step':>10}  function")
  for ct, tt, nc, where in rows[:top]:
    print(f"  {ct / steps * 1e3:11.3f} {tt / steps * 1e3:12.3f} {nc / steps:10.1f}  {where}")
  print("  top functions overall (cumulative):")
  stats.print_stats(top)
  lines = stream.getvalue().splitlines()
  start = next(i for i, l in enumerate(lines) if "ncalls" in l)
  for l in lines[start:start + top + 1]:
    print("   ", l)


# -- main ----------------------------------------------------------------------

def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
  parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
  parser.add_argument("--batch", type=int, default=16, help="per-replica batch size")
  parser.add_argument("--seq", type=int, default=16, help="transformer sequence length")
  parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant")
  parser.add_argument("--models", default="mlp,transformer",
                      help="comma-separated subset of mlp,transformer")
  parser.add_argument("--profile", type=int, default=0, metavar="N",
                      help="after timing, cProfile N steps of each variant of the "
                      "transformer and print the top xladist functions")
  parser.add_argument("--top", type=int, default=25, help="rows of the profile")
  args = parser.parse_args(argv)

  start_time = time.perf_counter()
  strategy = xd.MirroredStrategy()  # first: puts torch_xla in SPMD mode
  n = strategy.num_replicas_in_sync
  b = args.batch
  import torch_xla
  print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, "
        f"{_runtime.initialize().device_type} with {n} devices, per-replica batch {b}, "
        f"warm-up {args.warmup}, {args.rounds} rounds x {args.steps} steps per variant")

  factories = {"mlp": MLP, "transformer": Encoder}
  results, profiled = [], None
  for name in args.models.split(","):
    factory = factories[name]
    torch.manual_seed(0)
    state = copy.deepcopy(factory().state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = make_data(name, n, b, args.seq, g)

    t = time.perf_counter()
    xd_v = XladistVariant(strategy, factory, state, x, y, b)
    hw_v = HandWrittenVariant(factory, state, x, y, n)
    nparams = len(list(hw_v.model.parameters()))
    for v in (xd_v, hw_v):
      for _ in range(args.warmup):
        v.step()
      _runtime.wait()
    warm_s = time.perf_counter() - t

    recs = {xd_v.name: new_record(), hw_v.name: new_record()}
    for r in range(args.rounds):
      order = (xd_v, hw_v) if r % 2 == 0 else (hw_v, xd_v)
      for v in order:
        run_block(v, args.steps, recs[v.name])

    total_steps = args.warmup + args.rounds * args.steps
    diff = max_abs_diff(xd_v.params(), hw_v.params())
    scale = max(float(p.abs().max()) for p in hw_v.params())
    results.append((name, nparams, recs, diff, scale, total_steps, warm_s))
    if name == "transformer":
      profiled = (xd_v, hw_v)
    else:
      del xd_v, hw_v

  print()
  for name, nparams, recs, diff, scale, total_steps, warm_s in results:
    for vname, rec in recs.items():
      print(f"{name:12s} {vname:13s} compilations in timed loop: {rec['compiles']}, "
            f"executions/step: {rec['executes'] / rec['steps']:.2f}, "
            f"device->host transfers: {rec['d2h']}  (warm-up + setup {warm_s:.1f} s)")
  print()
  print("| model | #param tensors | xladist wall ms | hand-written wall ms | wall ratio "
        "| xladist wall ms (block total/steps) | hand-written wall ms (block total/steps) "
        "| ratio | xladist host ms | hand-written host ms | host ratio |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name, nparams, recs, diff, scale, total_steps, warm_s in results:
    a, h = recs["xladist"], recs["hand-written"]
    wa, wh = statistics.median(a["wall"]) * 1e3, statistics.median(h["wall"]) * 1e3
    ta, th = a["total"] / a["steps"] * 1e3, h["total"] / h["steps"] * 1e3
    ha, hh = statistics.median(a["host"]) * 1e3, statistics.median(h["host"]) * 1e3
    print(f"| {name} | {nparams} | {wa:.2f} | {wh:.2f} | {wa / wh:.3f} | {ta:.2f} | "
          f"{th:.2f} | {ta / th:.3f} | {ha:.2f} | {hh:.2f} | {ha / hh:.3f} |")
  print()
  for name, nparams, recs, diff, scale, total_steps, warm_s in results:
    ok = "agree" if diff <= 1e-4 * max(1.0, scale) else "DISAGREE"
    print(f"{name}: final parameters after {total_steps} steps each {ok}: "
          f"max |xladist - hand-written| = {diff:.3g} (max |param| {scale:.3g})")

  if args.profile and profiled is not None:
    print_profile("xladist (transformer)", profiled[0], args.profile, args.top)
    print_profile("hand-written (transformer)", profiled[1], args.profile, args.top)
  print(f"\ntotal run time {time.perf_counter() - start_time:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
