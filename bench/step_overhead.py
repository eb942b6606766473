"""Step overhead of xladist against hand-written torch_xla SPMD training steps.

Run (XLA:CPU, 4 virtual devices)::

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 PYTHONPATH=. python bench/step_overhead.py

What is compared
  Two variants of the same data-parallel training step (forward, cross-entropy
  on random labels, backward, SGD with momentum), in one process, on the same
  devices, with the same model architecture, the same initial weights (both load
  the state_dict of one CPU model) and the same data:

  * xladist: the model and the optimizer are made under
    `xd.MirroredStrategy().scope()`; a step is `strategy.run(step, (xb, yb))`
    followed by `_runtime.sync()`. `xb`/`yb` are PerReplica values built once
    with `experimental_distribute_values_from_function` and reused every step.
  * hand-written: the idiomatic torch_xla SPMD step: the model moved to 'xla'
    (parameters replicated, the SPMD default), the global batch (N*b, ...)
    staged on the device once and sharded over a 1-D ("data",) mesh with
    `xs.mark_sharding`, and `loss = CE(model(x), y); zero_grad; backward; step;
    torch_xla.sync()`.

  * hand-manual: xladist's own route written by hand with torch_xla's bindings
    (every parameter, momentum buffer and input enters the manual region, one
    packed SPMD all-reduce of the gradients, everything leaves again). The
    ratio xladist / hand-manual is what xladist's bookkeeping costs on top of
    the route; hand-manual / hand-written is what the route itself costs.

  * replay: xladist's default (replay on, docs/architecture.md "Replay"):
    after its first traces the step's compiled program is run again by `run`
    without tracing the step function; `run` launches it, so no sync follows
    (one would only wait for the device). On a MirroredStrategy of its own; the
    xladist variant above passes RunOptions(experimental_replay=False): it is
    the traced step ("replay off").

  * AdamW + cosine (--no-adamw skips it): torch's default AdamW with a
    CosineAnnealingLR stepped after every step, the loop most users run, as
    xladist's default (replay, on a MirroredStrategy of its own) and written by
    hand in torch_xla (as hand-written above). Their parameters agree to float32
    rounding (xladist keeps AdamW's step counter on the device, capturable).

  All of them do the same math (the mean of the per-replica mean losses is the
  global mean loss), so their parameters must agree after the same number of
  steps; the script checks that (replay against traced xladist: bit for bit).

  JAX row (the floor): the same MLP step as one `jax.jit` on 4 XLA:CPU devices,
  run after the others in a child interpreter that has jax (--jax-python,
  default $XLADIST_JAX_PYTHON or ~/.cache/xladist/jaxspike-venv/bin/python);
  skipped when there is none.

  Models: (1) an MLP of 10 Linear layers, width 256 (20 parameter tensors);
  (2) 9 nn.TransformerEncoderLayer (d_model 64, 4 heads, FF 128, dropout 0,
  batch_first), mean pooling and a linear head (110 parameter tensors).

Method
  * The strategy is created first (it switches torch_xla to SPMD mode). Each
    model is benchmarked on its own: the previous model's variants are freed
    first, because xladist traces every live variable of the strategy into
    each step.
  * Each variant is warmed up (--warmup steps, default 3) until its graphs are
    compiled. For the timed steps the script prints the number of XLA
    compilations (must be 0), of executions per step (must be 1) and of
    device->host transfers (must be 0: nothing is read back).
  * --rounds rounds; in each round both variants run a steady-state block, the
    order alternating between rounds, then both run an isolated block:
      steady-state block (--steps steps): steps back to back, no waiting, with
        `xm.wait_device_ops()` before the block and at its end, so that queued
        device work of one variant does not leak into the other's timings.
        wall: from a step's start to the next step's start (device work may
        overlap the next step's tracing); the last step of a block runs until
        the final wait_device_ops returns, so the drain is counted. Reported as
        the median per step, and as the sum of block totals / steps.
        host (steady state): from a step's start until sync() returns. Note:
        torch_xla's sync waits for the previous execution on the device to
        finish before it launches the next, so in steady state this includes
        waiting for the device and is close to the wall time.
      isolated block (--isolated steps): wait_device_ops before every step, so
        the device is idle when the step starts; host (isolated) is from the
        step's start until sync() returns = Python + tracing + graph hashing +
        launching the asynchronous execution. This is the "host" of the main
        table; it is also split into trace (until just before sync) and sync.
  * --profile N cProfiles N isolated steps of each variant of each model
    (profiler off while waiting for the device) and prints the most expensive
    xladist functions and the top functions overall.

On XLA:CPU the devices share the host's CPU cores (2 on the reference machine),
so device work competes with tracing and timings are noisy; run it more than
once. In an isolated step the device is idle only until sync() launches the
execution, so the end of sync() can already compete with it: the trace part is
the cleanest measure of host overhead.
"""

import argparse
import copy
import cProfile
import gc
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
from _plot import add_plot_argument, save_plot
from torch import nn

import xladist as xd
from xladist import runtime as _runtime

# -- models --------------------------------------------------------------------


class MLP(nn.Module):
  def __init__(self, width=256, depth=10, classes=10):
    super().__init__()
    self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
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
      nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=ff, dropout=0.0, batch_first=True)
      for _ in range(layers)
    )
    self.head = nn.Linear(d_model, classes)

  def forward(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(x.mean(dim=1))


MODELS = {"mlp": MLP, "transformer": Encoder}


def make_data(name, n, b, seq, generator):
  if name == "mlp":
    x = torch.randn(n * b, 256, generator=generator)
  else:
    x = torch.randn(n * b, seq, 64, generator=generator)
  y = torch.randint(0, 10, (n * b,), generator=generator)
  return x, y


# -- the two variants ----------------------------------------------------------

LR, MOMENTUM = 0.01, 0.9
ADAMW_LR, COSINE_STEPS = 1e-3, 1000


def make_optimizer(params, loop):
  """(optimizer, scheduler or None) of a loop: "sgd" (SGD with momentum, constant
  learning rate) or "adamw-cosine" (torch's default AdamW, a CosineAnnealingLR
  stepped after every step: the loop most users run)."""
  if loop == "sgd":
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM), None
  opt = torch.optim.AdamW(params, lr=ADAMW_LR)
  return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=COSINE_STEPS)


perf = time.perf_counter
TRACE = xd.RunOptions(experimental_replay=False)  # the traced xladist variant
REPLAY = xd.RunOptions(experimental_replay=True)  # the replay variant


class XladistVariant:
  name = "xladist"

  def __init__(self, strategy, factory, state, x, y, b, loop="sgd"):
    self.strategy = strategy
    with strategy.scope():
      self.model = factory()
      self.model.load_state_dict(state)
      self.opt, self.sched = make_optimizer(self.model.parameters(), loop)
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

    self._fn = step
    # Pre-staged inputs: the PerReplica values are built once and reused.
    self.xb = strategy.experimental_distribute_values_from_function(
      lambda ctx: x[ctx.replica_id_in_sync_group * b : (ctx.replica_id_in_sync_group + 1) * b]
    )
    self.yb = strategy.experimental_distribute_values_from_function(
      lambda ctx: y[ctx.replica_id_in_sync_group * b : (ctx.replica_id_in_sync_group + 1) * b]
    )

  def step(self):
    """One step; returns perf_counter() at the end of tracing (before sync)."""
    self.strategy.run(self._fn, args=(self.xb, self.yb), options=TRACE)
    if self.sched is not None:
      self.sched.step()
    t = perf()
    _runtime.sync()
    return t


class ReplayVariant(XladistVariant):
  """xladist with replay: after its first traces the step's compiled program is
  replayed, launched by `run` itself; no sync is needed (one would only wait
  for the device). On a strategy of its own, so that the traced variant's
  steps do not enter its variables (and the other way round)."""

  name = "replay"

  def step(self):
    self.strategy.run(self._fn, args=(self.xb, self.yb), options=REPLAY)
    if self.sched is not None:
      self.sched.step()
    return perf()


class HandWrittenVariant:
  name = "hand-written"

  def __init__(self, factory, state, x, y, n, loop="sgd"):
    import torch_xla
    import torch_xla.distributed.spmd as xs

    self._sync = torch_xla.sync
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    model = factory()
    model.load_state_dict(state)
    self.model = model.to("xla")  # parameters: replicated (the SPMD default)
    self.opt, self.sched = make_optimizer(self.model.parameters(), loop)
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
    if self.sched is not None:
      self.sched.step()
    t = perf()
    self._sync()
    return t


class HandManualVariant:
  """The same manual-region step as xladist's, written by hand with torch_xla's bindings.

  Each parameter, momentum buffer and input enters the manual region with
  `_spmd_full_to_shard_shape` and leaves with `_spmd_shard_to_full_shape`; the
  gradients are packed into one buffer and all-reduced with
  `_xla_spmd_all_reduce` (MEAN). This is the least a hand-written version of
  xladist's route must do, so xladist / hand-manual isolates xladist's own
  bookkeeping from the cost of the route.
  """

  name = "hand-manual"

  def __init__(self, factory, state, x, y, n):
    import torch_xla
    import torch_xla.distributed.spmd as xs

    self._x, self._sync, self.n = torch_xla._XLAC, torch_xla.sync, n
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    self._rep = {d: mesh.get_op_sharding((None,) * d) for d in range(5)}
    self._split = {d: mesh.get_op_sharding((0,) + (None,) * (d - 1)) for d in range(1, 6)}
    self._manual = self._x.OpSharding([], [], [], xs.ShardingType.MANUAL)
    model = factory()
    model.load_state_dict(state)
    self.model = model.to("xla")
    for p in self.model.parameters():
      self._x._xla_mark_sharding(p, self._rep[p.dim()])
    self.params = list(self.model.parameters())
    self.opt = torch.optim.SGD(self.params, lr=LR, momentum=MOMENTUM)
    b = x.shape[0] // n
    self.x = x.reshape((n, b) + tuple(x.shape[1:])).to("xla")
    self.y = y.reshape(n, b).to("xla")
    self._x._xla_mark_sharding(self.x, self._split[self.x.dim()])
    self._x._xla_mark_sharding(self.y, self._split[self.y.dim()])
    torch_xla.sync()

  def _out(self, t, sharding, shape):
    self._x._mark_manual_sharding(t, self._manual)
    return self._x._spmd_shard_to_full_shape(t, sharding, shape, t.dtype)

  def step(self):
    x, params, opt = self._x, self.params, self.opt
    for p in params:
      p.data = x._spmd_full_to_shard_shape(p.data)
    states = [st for st in opt.state.values()]
    for st in states:
      st["momentum_buffer"] = x._spmd_full_to_shard_shape(st["momentum_buffer"])
    xl = x._spmd_full_to_shard_shape(self.x).squeeze(0)
    yl = x._spmd_full_to_shard_shape(self.y).squeeze(0)
    loss = F.cross_entropy(self.model(xl), yl)
    opt.zero_grad()
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    flat = x._xla_spmd_all_reduce("sum", flat, 1.0 / self.n, [list(range(self.n))])
    for p, g in zip(params, flat.split([p.numel() for p in params])):
      p.grad = g.view(p.shape)
    opt.step()
    for p in params:
      p.data = self._out(p.data, self._rep[p.dim()], p.shape)
      p.grad = None
    for st in opt.state.values():
      buf = st["momentum_buffer"]
      st["momentum_buffer"] = self._out(buf, self._rep[buf.dim()], buf.shape)
    # The per-replica losses leave the region too, as xladist's step returns them.
    self.loss = self._out(loss.detach().reshape(1), self._split[1], torch.Size([self.n]))
    t = perf()
    self._sync()
    return t


# -- timing --------------------------------------------------------------------


def _metric(name):
  import torch_xla.debug.metrics as met

  data = met.metric_data(name)
  return (0, 0.0) if data is None else (data[0], data[1])


class Record:
  def __init__(self):
    self.wall, self.host, self.iso_host, self.iso_trace, self.iso_sync = [], [], [], [], []
    self.iso_cpu = []  # the calling thread's CPU time of an isolated step
    self.total = 0.0
    self.steps = self.compiles = self.executes = self.d2h = 0

  def counters(self):
    return (
      _runtime.compile_count(),
      _runtime.execute_count(),
      _metric("TransferFromDeviceTime")[0],
    )

  def add_counters(self, before):
    after = self.counters()
    self.compiles += after[0] - before[0]
    self.executes += after[1] - before[1]
    self.d2h += after[2] - before[2]


def steady_block(variant, steps, rec):
  _runtime.wait()
  before = rec.counters()
  starts, host = [], []
  for _ in range(steps):
    t0 = perf()
    variant.step()
    t1 = perf()
    starts.append(t0)
    host.append(t1 - t0)
  _runtime.wait()
  end = perf()
  rec.add_counters(before)
  rec.host += host
  rec.wall += [b - a for a, b in zip(starts, starts[1:] + [end])]
  rec.total += end - starts[0]
  rec.steps += steps


def isolated_block(variant, steps, rec):
  before = rec.counters()
  for _ in range(steps):
    _runtime.wait()
    c0 = time.thread_time()
    t0 = perf()
    t_trace = variant.step()
    t1 = perf()
    rec.iso_cpu.append(time.thread_time() - c0)
    rec.iso_host.append(t1 - t0)
    rec.iso_trace.append(t_trace - t0)
    rec.iso_sync.append(t1 - t_trace)
    rec.steps += 1
  _runtime.wait()
  rec.add_counters(before)


def profile_text(variant, steps, top, model):
  prof = cProfile.Profile()
  host = 0.0
  for _ in range(steps):
    _runtime.wait()
    t0 = perf()
    prof.enable()
    variant.step()
    prof.disable()
    host += perf() - t0
  _runtime.wait()
  stream = io.StringIO()
  stats = pstats.Stats(prof, stream=stream)
  stats.sort_stats("cumulative")
  out = [
    f"cProfile of {steps} isolated {variant.name} steps ({model}): "
    f"{host / steps * 1e3:.2f} ms/step host under the profiler"
  ]
  rows = []
  pkg = os.path.dirname(os.path.abspath(xd.__file__))
  for (path, line, func), (_, nc, tt, ct, _) in stats.stats.items():
    if os.path.abspath(path).startswith(pkg + os.sep):
      rel = os.path.relpath(path, os.path.dirname(pkg))
      rows.append((ct, tt, nc, f"{rel}:{line}({func})"))
  if rows:
    rows.sort(reverse=True)
    out.append("  xladist functions by cumulative time:")
    out.append(f"  {'cum ms/step':>11} {'self ms/step':>12} {'calls/step':>10}  function")
    for ct, tt, nc, where in rows[:top]:
      out.append(f"  {ct / steps * 1e3:11.3f} {tt / steps * 1e3:12.3f} {nc / steps:10.1f}  {where}")
  out.append("  top functions overall (cumulative, totals over all steps):")
  stats.print_stats(top)
  lines = stream.getvalue().splitlines()
  start = next(i for i, l in enumerate(lines) if "ncalls" in l)
  out += ["    " + l for l in lines[start : start + top + 1]]
  return "\n".join(out)


def _named(variant, name):
  variant.name = name
  return variant


def bench_model(name, strategy, replay_strategy, args, adamw_strategy=None):
  n, b = strategy.num_replicas_in_sync, args.batch
  factory = MODELS[name]
  torch.manual_seed(0)
  state = copy.deepcopy(factory().state_dict())
  x, y = make_data(name, n, b, args.seq, torch.Generator().manual_seed(1))

  t = perf()
  variants = (
    XladistVariant(strategy, factory, state, x, y, b),
    HandWrittenVariant(factory, state, x, y, n),
    HandManualVariant(factory, state, x, y, n),
    ReplayVariant(replay_strategy, factory, state, x, y, b),
  )
  if adamw_strategy is not None:  # the AdamW + cosine loop: default replay vs hand-written
    variants += (
      _named(HandWrittenVariant(factory, state, x, y, n, loop="adamw-cosine"), "hw-adamw"),
      _named(
        ReplayVariant(adamw_strategy, factory, state, x, y, b, loop="adamw-cosine"), "replay-adamw"
      ),
    )
  nparams = len(list(variants[1].model.parameters()))
  for v in variants:
    for _ in range(args.warmup):
      v.step()
      # Each variant's warm-up steps are cut on their own (the replay variant's
      # first, traced, steps would otherwise run inside another variant's sync).
      _runtime.sync()
    _runtime.wait()
  warm_s = perf() - t

  recs = {v.name: Record() for v in variants}
  for r in range(args.rounds):
    order = variants if r % 2 == 0 else variants[::-1]
    for v in order:
      steady_block(v, args.steps, recs[v.name])
    for v in order:
      isolated_block(v, args.isolated, recs[v.name])

  steps_each = args.warmup + args.rounds * (args.steps + args.isolated)
  xd_p = [p.detach().cpu() for p in variants[0].model.parameters()]
  hw_p = [p.detach().cpu() for p in variants[1].model.parameters()]
  init = list(state.values())
  diff = max(float((p - q).abs().max()) for p, q in zip(xd_p, hw_p))
  hm_p = [p.detach().cpu() for p in variants[2].model.parameters()]
  diff_manual = max(float((p - q).abs().max()) for p, q in zip(xd_p, hm_p))
  rp_p = [p.detach().cpu() for p in variants[3].model.parameters()]
  diff_replay = max(float((p - q).abs().max()) for p, q in zip(xd_p, rp_p))
  replayer = replay_strategy.extended._engine._replayer
  adamw = None
  if adamw_strategy is not None:
    hw_a = [p.detach().cpu() for p in variants[4].model.parameters()]
    rp_a = [p.detach().cpu() for p in variants[5].model.parameters()]
    counts = adamw_strategy.extended.experimental_replay_counts
    adamw = dict(
      diff=max(float((p - q).abs().max()) for p, q in zip(hw_a, rp_a)),
      moved=max(float((p - q).abs().max()) for p, q in zip(hw_a, init)),
      replayed=(counts["replayed"], counts["traced"]),
    )
  moved = max(float((p - q).abs().max()) for p, q in zip(hw_p, init))
  scale = max(float(p.abs().max()) for p in hw_p)

  guards = {"sgd": _guard_cost(replay_strategy)}
  if adamw_strategy is not None:
    guards["adamw-cosine"] = _guard_cost(adamw_strategy)
  prof = None
  if args.profile:
    prof = [profile_text(v, args.profile, args.top, name) for v in variants]
  return dict(
    name=name,
    nparams=nparams,
    recs=recs,
    diff=diff,
    moved=moved,
    diff_manual=diff_manual,
    diff_replay=diff_replay,
    replayed=(replayer.replays, replayer.traces) if replayer is not None else (0, 0),
    scale=scale,
    steps_each=steps_each,
    warm_s=warm_s,
    adamw=adamw,
    prof=prof,
    guards=guards,
  )


def _guard_cost(strategy, calls=2000):
  """(locations the replayed step's key reads, microseconds to read them all):
  the guards from the trace (issue 50) checked before every replay."""
  replayer = strategy.extended._engine._replayer
  watched = list(replayer._reads.values()) if replayer is not None else []
  count = sum(len(w.locations) for w in watched)
  t = perf()
  for _ in range(calls):
    for w in watched:
      w.key()
  return count, (perf() - t) / calls * 1e6


def med(xs):
  return statistics.median(xs) * 1e3


def report(results):
  print()
  for res in results:
    for loop, (count, us) in res["guards"].items():
      print(
        f"guards from the trace, {res['name']} {loop}: {count} locations read before each "
        f"replay, {us:.1f} us to read them"
      )
  for res in results:
    for vname, rec in res["recs"].items():
      print(
        f"{res['name']:12s} {vname:13s} timed steps: {rec.steps}, compilations: "
        f"{rec.compiles}, executions/step: {rec.executes / rec.steps:.2f}, "
        f"device->host transfers: {rec.d2h}   (setup + warm-up of both: "
        f"{res['warm_s']:.1f} s)"
      )
  print(
    "\nMain table, xladist traced (replay off). wall: median per-step wall time in "
    "steady state; host: median "
    "host time of an isolated step (device idle at its start) until sync() returns.\n"
  )
  print(
    "| model | #param tensors | xladist wall ms | hand-written wall ms | wall ratio "
    "| xladist host ms | hand-written host ms | host ratio |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  for res in results:
    a, h = res["recs"]["xladist"], res["recs"]["hand-written"]
    wa, wh, ha, hh = med(a.wall), med(h.wall), med(a.iso_host), med(h.iso_host)
    print(
      f"| {res['name']} | {res['nparams']} | {wa:.2f} | {wh:.2f} | {wa / wh:.3f} | "
      f"{ha:.2f} | {hh:.2f} | {ha / hh:.3f} |"
    )
  print(
    "\nDefault (replay): xladist replaying the step's compiled program against "
    "the same hand-written step. host: median time until `run` returns for a step "
    "started on an idle device (a replayed step is launched by `run`; no sync "
    "needed); cpu: the calling thread's CPU time over the same span (less sensitive "
    "to the devices' threads competing for the cores); wall: median per-step wall "
    "time in steady state. The traced xladist step "
    "(RunOptions(experimental_replay=False)) is shown for comparison.\n"
  )
  print(
    "| model | replay host ms | hand-written host ms | host ratio | replay cpu ms "
    "| hand-written cpu ms | cpu ratio | replay wall ms | hand-written wall ms | wall ratio "
    "| traced xladist host ms |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for res in results:
    r, h, a = res["recs"]["replay"], res["recs"]["hand-written"], res["recs"]["xladist"]
    hr, hh, wr, wh = med(r.iso_host), med(h.iso_host), med(r.wall), med(h.wall)
    cr, ch = med(r.iso_cpu), med(h.iso_cpu)
    print(
      f"| {res['name']} | {hr:.2f} | {hh:.2f} | {hr / hh:.3f} | {cr:.2f} | {ch:.2f} "
      f"| {cr / ch:.3f} | {wr:.2f} | {wh:.2f} | {wr / wh:.3f} | {med(a.iso_host):.2f} |"
    )
  print(
    "\nTargets (issue 25) against the hand-written step: default (replay) host <= 0.4x, "
    "replay off (traced) host <= 1.3x, default wall <= 0.8x."
  )
  for res in results:
    r, h, a = res["recs"]["replay"], res["recs"]["hand-written"], res["recs"]["xladist"]
    checks = (
      ("default host", med(r.iso_host) / med(h.iso_host), 0.4),
      ("replay off host", med(a.iso_host) / med(h.iso_host), 1.3),
      ("default wall", med(r.wall) / med(h.wall), 0.8),
    )
    print(
      f"{res['name']}: "
      + "; ".join(
        f"{what} {ratio:.3f} ({'met' if ratio <= bound else 'NOT met'})"
        for what, ratio, bound in checks
      )
    )
  if any(res["adamw"] for res in results):
    print(
      "\nAdamW + cosine (torch's default AdamW, CosineAnnealingLR stepped after every "
      "step): xladist's default (replay) against the same loop written by hand in "
      "torch_xla. Target (issue 32): wall <= 0.5x.\n"
    )
    print(
      "| model | replay wall ms | hand-written wall ms | wall ratio | replay host ms "
      "| hand-written host ms | host ratio | steps replayed / traced | max param diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
      if not res["adamw"]:
        continue
      r, h = res["recs"]["replay-adamw"], res["recs"]["hw-adamw"]
      wr, wh, hr, hh = med(r.wall), med(h.wall), med(r.iso_host), med(h.iso_host)
      replays, traces = res["adamw"]["replayed"]
      print(
        f"| {res['name']} | {wr:.2f} | {wh:.2f} | {wr / wh:.3f} | {hr:.2f} | {hh:.2f} "
        f"| {hr / hh:.3f} | {replays} / {traces} | {res['adamw']['diff']:.3g} "
        f"(moved {res['adamw']['moved']:.3g}) |"
      )
  for res in results:
    replays, traces = res["replayed"]
    print(
      f"{res['name']}: replay variant: {replays} steps replayed, {traces} traced "
      "(warm-up); max |replay - traced xladist| of the final parameters = "
      f"{res['diff_replay']:.3g}"
    )
  print(
    "\nAgainst the same manual-region step written by hand (hand-manual): what "
    "xladist's own bookkeeping costs on top of its route.\n"
  )
  print(
    "| model | xladist wall ms | hand-manual wall ms | wall ratio | xladist host ms "
    "| hand-manual host ms | host ratio |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|")
  for res in results:
    a, m = res["recs"]["xladist"], res["recs"]["hand-manual"]
    wa, wm, ha, hm = med(a.wall), med(m.wall), med(a.iso_host), med(m.iso_host)
    print(
      f"| {res['name']} | {wa:.2f} | {wm:.2f} | {wa / wm:.3f} | {ha:.2f} | {hm:.2f} "
      f"| {ha / hm:.3f} |"
    )
  print(
    "\nDetails (ms; xladist / hand-written = ratio). block wall: sum of steady-state "
    "block totals (incl. final drain) / steps; steady host: step start to sync() "
    "return in steady state (includes waiting in sync for the previous execution); "
    "trace / sync: the isolated host time split at the call of sync().\n"
  )
  print("| model | block wall | steady host | isolated trace | isolated sync |")
  print("|---|---|---|---|---|")
  for res in results:
    a, h = res["recs"]["xladist"], res["recs"]["hand-written"]
    cells = []
    for fa, fh in (
      (a.total / len(a.wall) * 1e3, h.total / len(h.wall) * 1e3),
      (med(a.host), med(h.host)),
      (med(a.iso_trace), med(h.iso_trace)),
      (med(a.iso_sync), med(h.iso_sync)),
    ):
      cells.append(f"{fa:.2f} / {fh:.2f} = {fa / fh:.3f}")
    print(f"| {res['name']} | " + " | ".join(cells) + " |")
  print()
  for res in results:
    ok = res["diff"] <= 1e-4 * max(1.0, res["scale"])
    print(
      f"{res['name']}: final parameters after {res['steps_each']} steps each "
      f"{'agree' if ok else 'DISAGREE'}: max |xladist - hand-written| = "
      f"{res['diff']:.3g} (max |param| {res['scale']:.3g}, max change from the "
      f"initial weights {res['moved']:.3g}); max |xladist - hand-manual| = "
      f"{res['diff_manual']:.3g}"
    )
  for res in results:
    for text in res["prof"] or ():
      print("\n" + text)


def plot_results(results, path):
  """--plot: median steady-state wall ms per step of every variant, grouped by model."""
  labels = {"xladist": "xladist, traced", "replay": "xladist, replayed (default)"}
  variants = {}
  for res in results:
    for vname, rec in res["recs"].items():
      variants.setdefault(labels.get(vname, vname), {})[res["name"]] = med(rec.wall)
  return save_plot(
    path,
    "Training step time: xladist against hand-written torch_xla SPMD",
    "model",
    "wall ms per step (steady state, median; log scale)",
    variants,
    kind="bar",
    logy=True,
  )


# -- the JAX floor --------------------------------------------------------------

JAX_PYTHON = os.path.join(
  os.path.expanduser("~"),
  ".cache",
  "xladist",
  "venv-jax-torch2.9.0-jax0.10.2-torchax0.0.13-py{}.{}".format(*sys.version_info[:2]),
  "bin",
  "python",
)

# The MLP step (same sizes, SGD with momentum, cross-entropy) as one `jax.jit`
# over 4 XLA:CPU devices: the batch split over a 1-D mesh, the parameters
# replicated (XLA inserts the gradient all-reduce), parameters and momentum
# donated. Run in its own interpreter (JAX and torch_xla each bring an XLA).
JAX_STEP = r"""
import json, os, statistics, sys, time
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

cfg = json.loads(sys.argv[1])
n, b, width, depth = 4, cfg["batch"], 256, 10
mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
rng = np.random.RandomState(0)
params = []
for i in range(depth):
  out = width if i < depth - 1 else 10
  bound = 1 / np.sqrt(width)
  params.append((rng.uniform(-bound, bound, (width, out)).astype(np.float32),
                 np.zeros(out, np.float32)))
params = jax.device_put(params, rep)
mom = jax.tree.map(jnp.zeros_like, params)
x = jax.device_put(rng.randn(n * b, width).astype(np.float32), split)
y = jax.device_put(rng.randint(0, 10, n * b).astype(np.int32), split)

def loss_fn(params, x, y):
  h = x
  for w, c in params[:-1]:
    h = jax.nn.relu(h @ w + c)
  w, c = params[-1]
  logp = jax.nn.log_softmax(h @ w + c)
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

def step(params, mom, x, y):
  loss, g = jax.value_and_grad(loss_fn)(params, x, y)
  mom = jax.tree.map(lambda m, d: 0.9 * m + d, mom, g)
  params = jax.tree.map(lambda p, m: p - 0.01 * m, params, mom)
  return params, mom, loss

step = jax.jit(step, donate_argnums=(0, 1))
for _ in range(cfg["warmup"]):
  params, mom, loss = step(params, mom, x, y)
jax.block_until_ready(loss)
host, cpu, wall = [], [], []
perf = time.perf_counter
for _ in range(cfg["rounds"]):
  for _ in range(cfg["isolated"]):
    jax.block_until_ready(params)
    c = time.thread_time()
    t = perf()
    params, mom, loss = step(params, mom, x, y)
    host.append(perf() - t)
    cpu.append(time.thread_time() - c)
  jax.block_until_ready(params)
  starts = []
  for _ in range(cfg["steps"]):
    starts.append(perf())
    params, mom, loss = step(params, mom, x, y)
  jax.block_until_ready(params)
  end = perf()
  wall += [b - a for a, b in zip(starts, starts[1:] + [end])]
out = {"jax": jax.__version__, "host": statistics.median(host) * 1e3,
       "cpu": statistics.median(cpu) * 1e3, "wall": statistics.median(wall) * 1e3,
       "steps": len(host) + len(wall)}

# The same step written for xladist (torch code), on xladist's jax runtime, in
# this process: strategy.run of the user's step (replayed after its first
# traces), timed like the jax.jit step above.
os.environ["XLADIST_BACKEND"] = "jax"
import torch, torch.nn.functional as F
import xladist as xd
from xladist import runtime as xrt

strategy = xd.MirroredStrategy()
with strategy.scope():
  layers = []
  for i in range(depth):
    layers.append(torch.nn.Linear(width, width if i < depth - 1 else 10))
    if i < depth - 1:
      layers.append(torch.nn.ReLU())
  model = torch.nn.Sequential(*layers)
  opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
xt = torch.from_numpy(rng.randn(n * b, width).astype(np.float32))
yt = torch.from_numpy(rng.randint(0, 10, n * b).astype(np.int64))
xb, yb = next(iter(strategy.experimental_distribute_dataset(
  torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xt, yt), batch_size=n * b))))

def xstep(xb, yb):
  opt.zero_grad()
  loss = F.cross_entropy(model(xb), yb)
  loss.backward()
  opt.step()
  return loss

for _ in range(max(cfg["warmup"], 4)):
  strategy.run(xstep, args=(xb, yb))
xrt.wait()
compiles = xrt.compile_count()
xhost, xcpu, xwall = [], [], []
for _ in range(cfg["rounds"]):
  for _ in range(cfg["isolated"]):
    xrt.wait()
    c = time.thread_time()
    t = perf()
    strategy.run(xstep, args=(xb, yb))
    xhost.append(perf() - t)
    xcpu.append(time.thread_time() - c)
  xrt.wait()
  starts = []
  for _ in range(cfg["steps"]):
    starts.append(perf())
    strategy.run(xstep, args=(xb, yb))
  xrt.wait()
  end = perf()
  xwall += [b - a for a, b in zip(starts, starts[1:] + [end])]
rep_ = strategy.extended._engine._replayer
out["xladist"] = {"host": statistics.median(xhost) * 1e3, "cpu": statistics.median(xcpu) * 1e3,
                  "wall": statistics.median(xwall) * 1e3,
                  "compiles": xrt.compile_count() - compiles, "replays": rep_.replays,
                  "torch": torch.__version__}
print(json.dumps(out))
"""


def jax_row(args, mlp):
  """The JAX floor: the MLP step with jax.jit in a child interpreter (skipped
  cleanly when there is no Python with jax)."""
  import json
  import subprocess

  python = args.jax_python
  if not python or not os.path.exists(os.path.expanduser(python)):
    print(f"\nJAX row skipped: no Python with jax at {python!r} (--jax-python).")
    return
  cfg = dict(
    batch=args.batch,
    warmup=args.warmup,
    rounds=args.rounds,
    steps=args.steps,
    isolated=args.isolated,
  )
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "PYTHON"))}
  env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(xd.__file__)))
  try:
    proc = subprocess.run(
      [os.path.expanduser(python), "-c", JAX_STEP, json.dumps(cfg)],
      capture_output=True,
      text=True,
      timeout=900,
      env=env,
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
  except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
    tail = locals().get("proc")
    detail = tail.stderr.strip().splitlines()[-1:] if tail is not None else []
    print(f"\nJAX row skipped: the JAX step did not run ({type(e).__name__}: {e}; {detail}).")
    return
  h = mlp["recs"]["hand-written"]
  r = mlp["recs"]["replay"]
  hh, wh = med(h.iso_host), med(h.wall)
  print(
    f"\nThe floor: the same MLP step as one jax.jit (jax {got['jax']}, 4 XLA:CPU "
    f"devices, {got['steps']} timed steps, run after the others in its own "
    "interpreter). host: until the jitted call returns (dispatch), device idle at "
    "its start; cpu: the calling thread's CPU time over that span. Ratios to the "
    "hand-written torch_xla step of this run.\n"
  )
  print("| model | variant | host ms | host ratio | cpu ms | cpu ratio | wall ms | wall ratio |")
  print("|---|---|---:|---:|---:|---:|---:|---:|")
  ch = med(h.iso_cpu)
  x = got["xladist"]
  for name, host, cpu, wall in (
    ("jax.jit", got["host"], got["cpu"], got["wall"]),
    ("xladist on jax", x["host"], x["cpu"], x["wall"]),
    ("xladist replay", med(r.iso_host), med(r.iso_cpu), med(r.wall)),
    ("hand-written torch_xla", hh, ch, wh),
  ):
    print(
      f"| mlp | {name} | {host:.3f} | {host / hh:.3f} | {cpu:.3f} | {cpu / ch:.3f} "
      f"| {wall:.2f} | {wall / wh:.3f} |"
    )
  print(
    f"\nxladist on the jax runtime (torch {x['torch']}, replay on: {x['replays']} steps "
    f"replayed, {x['compiles']} compilations while timed) against the hand-written "
    f"jax.jit step, same process: host {x['host'] / got['host']:.3f}, cpu "
    f"{x['cpu'] / got['cpu']:.3f}, wall {x['wall'] / got['wall']:.3f} (per step)."
  )


def _source_digest():
  """A short digest of xladist's sources, to tell which version was measured."""
  import hashlib

  root = os.path.dirname(os.path.abspath(xd.__file__))
  h = hashlib.sha1()
  for dirpath, dirnames, files in sorted(os.walk(root)):
    dirnames.sort()
    for f in sorted(files):
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as fh:
          h.update(fh.read())
  return h.hexdigest()[:12]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--steps", type=int, default=8, help="steady-state steps per variant per round (default 8)"
  )
  parser.add_argument(
    "--isolated", type=int, default=8, help="isolated steps per variant per round (default 5)"
  )
  parser.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
  parser.add_argument("--batch", type=int, default=16, help="per-replica batch (default 16)")
  parser.add_argument("--seq", type=int, default=16, help="transformer sequence length")
  parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant")
  parser.add_argument(
    "--models", default="mlp,transformer", help="comma-separated subset of " + ",".join(MODELS)
  )
  parser.add_argument(
    "--profile",
    type=int,
    default=0,
    metavar="N",
    help="after timing, cProfile N isolated steps of each variant",
  )
  parser.add_argument("--top", type=int, default=25, help="rows per profile listing")
  parser.add_argument(
    "--no-adamw",
    action="store_true",
    help="skip the AdamW + cosine loop (its two variants: default replay, hand-written)",
  )
  parser.add_argument(
    "--jax-python",
    default=os.environ.get("XLADIST_JAX_PYTHON", JAX_PYTHON),
    help="a Python with jax for the JAX row (default: $XLADIST_JAX_PYTHON, else "
    "~/.cache/xladist/jaxspike-venv/bin/python); the row is skipped without one",
  )
  add_plot_argument(parser)
  args = parser.parse_args(argv)

  t_start = perf()
  strategy = xd.MirroredStrategy()  # first: puts torch_xla in SPMD mode
  replay_strategy = xd.MirroredStrategy()
  adamw_strategy = None if args.no_adamw else xd.MirroredStrategy()
  import torch_xla

  print(
    f"xladist {xd.__version__} from {os.path.dirname(xd.__file__)} (sources sha1 "
    f"{_source_digest()}), "
    f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, "
    f"{_runtime.initialize().device_type} with {strategy.num_replicas_in_sync} "
    f"devices; per-replica batch {args.batch}; warm-up {args.warmup}; {args.rounds} "
    f"rounds x ({args.steps} steady + {args.isolated} isolated) steps per variant",
    flush=True,
  )
  results = []
  for name in args.models.split(","):
    results.append(bench_model(name, strategy, replay_strategy, args, adamw_strategy))
    gc.collect()  # the variants are gone: the next model's steps trace only its own
  report(results)
  mlp = next((r for r in results if r["name"] == "mlp"), None)
  if mlp is not None:
    jax_row(args, mlp)
  if args.plot:
    print(f"\nwrote {plot_results(results, args.plot)}")
  print(f"\ntotal run time {perf() - t_start:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
