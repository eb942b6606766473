"""Sharded training state (ZeRO 1-3) against MirroredStrategy and hand-written FSDP (issue 51).

Per sharding level of `xd.experimental.ShardingOptions` (min_shard_bytes=0), beside
MirroredStrategy (nothing sharded), beside torch_xla's FSDPv2 and beside `jax.jit`
with `NamedSharding`, the same loop reports:

  * state bytes: `strategy.extended.experimental_state_bytes()` after the last step, the
    parameters, gradients and optimizer state its fullest device holds (xladist
    only; the step ends with `optimizer.zero_grad()`, so no gradient is held then);
  * peak RSS increment: the child's peak resident set
    (`resource.getrusage(...).ru_maxrss`) minus its RSS right after its imports, as
    in bench/memory.py: on XLA:CPU every device's buffers are host memory, so
    starting the runtime, placing the model, compiling and the steps are counted;
  * step time: the median wall time of steps 5..N, each timed from its start
    until the devices have finished it (xladist: `runtime.sync()` then
    `runtime.wait()` after `run` and the scheduler's step, as bench/step_overhead.py
    does; torch_xla: `torch_xla.sync()` then `xm.wait_device_ops()`; jax:
    `jax.block_until_ready` of the new parameters, state and loss); the
    fastest of those steps is printed beside it: on a shared machine another
    process's work shows as steps of twice the time, which move the median.

The loop: an MLP of `--layers` x Linear(1024, 1024) (+ tanh), 24 layers = 25.2M
parameters, 4 replicas x `--rows` rows, the mean square of the output as the loss,
`loss.backward()`, `torch.nn.utils.clip_grad_norm_(params, 1.0)`, torch's AdamW
(lr 1e-3, weight decay 1e-2), `optimizer.zero_grad()`, a CosineAnnealingLR
(T_max 1000) stepped after every step; `--steps` steps (default 20). Every variant
starts from the same weights (torch's initialization, seed 0) and the same batch.
The torch variants' final losses agree to about 5 digits; jax's drifts further
(about 6% after 20 steps at 24 layers): this loop amplifies float32 rounding
(AdamW normalizes the deep layers' tiny gradients, and the loss spikes around
step 12), and jax's rounding differs from torch's from the first step on (the
same two loops on the CPU in one process: weights 2e-8 apart after one step,
6e-3 after 20). Each variant runs in a process of its own, one after the other:

  * xladist, torch_xla: `MirroredStrategy()`, then
    `MirroredStrategy(experimental_sharding=ShardingOptions(shard=...))` for
    "optimizer_state", "gradients" and "parameters"; the step is the user's
    unchanged step inside `strategy.run`.
  * hand-written torch_xla FSDPv2: `SpmdFullyShardedDataParallel` around the
    whole model on a 1-D mesh whose axis is named "fsdp" (`xr.use_spmd()`,
    `xs.set_global_mesh`), each parameter sharded on its largest dimension, the
    batch split over the same axis, AdamW, `torch_xla.sync()` after each step.
  * hand-written jax: the same MLP as a pure function, one `jax.jit` of the
    loss's gradient and optax's chain of `clip_by_global_norm(1.0)` and `adamw`
    with a cosine schedule; parameters and optimizer state placed with
    `NamedSharding(mesh, P("fsdp", None))` (FSDP style: weights on dimension 0,
    biases and the batch on the same axis; scalars replicated), kept so by the
    jit's shardings, and donated.
  * `--jax`: the four xladist variants on the jax runtime too.

Ratios are to MirroredStrategy on the same runtime (the torch_xla one for the
hand-written jax row when xladist did not run on jax). The issue's targets: peak
RSS increment at most 0.40x under "parameters", 0.60x under "gradients", 0.75x
under "optimizer_state"; step time at most 1.5x under "parameters" and 1.15x
under the others; parameter bytes about 1/4 under "parameters". One run each;
the machine is noisy (RSS moves by tens of MB, step times by tens of percent):
compare ratios.

  make bench-sharding                   # torch_xla variants, FSDPv2, jax.jit
  make bench-sharding ARGS=--jax        # and xladist on the jax runtime
  python bench/sharding.py --jax-python PY --variants xla-mirrored,xla-parameters
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _memory_shared import (
  WIDTH,
  add_interpreter_arguments,
  batch,
  mlp,
  peak,
  rss,
  timed,
  timed_jax_steps,
)

LR, WD, T_MAX, MAX_NORM = 1e-3, 1e-2, 1000, 1.0
MB = 1024 * 1024
FIRST_TIMED = 5  # step times: the median of steps 5..N (1-based), after warm-up

XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLADIST_BACKEND": "torch_xla"}
JAX_ENV = {
  "XLADIST_BACKEND": "jax",
  "JAX_PLATFORMS": "cpu",
  "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
}
LEVELS = ("optimizer_state", "gradients", "parameters")
# variant -> (label, runtime, sharding level or None, kind)
VARIANTS = {"xla-mirrored": ("xladist MirroredStrategy, torch_xla", "xla", None, "xladist")}
VARIANTS.update(
  {f"xla-{lv}": (f'xladist shard="{lv}", torch_xla', "xla", lv, "xladist") for lv in LEVELS}
)
VARIANTS["xla-fsdpv2"] = ("hand-written torch_xla FSDPv2", "xla", None, "fsdpv2")
VARIANTS["jax-mirrored"] = ("xladist MirroredStrategy, jax", "jax", None, "xladist")
VARIANTS.update(
  {f"jax-{lv}": (f'xladist shard="{lv}", jax', "jax", lv, "xladist") for lv in LEVELS}
)
VARIANTS["jax-hand"] = ("hand-written jax.jit + NamedSharding", "jax", None, "jax")
DEFAULT = ["xla-mirrored"] + [f"xla-{lv}" for lv in LEVELS] + ["xla-fsdpv2", "jax-hand"]
ON_JAX = ["jax-mirrored"] + [f"jax-{lv}" for lv in LEVELS]  # --jax
# the plot's names of the variants (with the runtime below)
SHORT = {"optimizer_state": "opt. state", "fsdpv2": "FSDPv2", "hand": "jax.jit"}
# level -> (peak RSS increment, step time) at most these multiples of MirroredStrategy
TARGETS = {"optimizer_state": (0.75, 1.15), "gradients": (0.60, 1.15), "parameters": (0.40, 1.5)}


def _torch_loop(model):
  """(optimizer, scheduler, step) of the loop every torch variant runs."""
  import torch

  opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
  sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=T_MAX)
  params = list(model.parameters())

  def step(x):
    loss = model(x).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    opt.step()
    opt.zero_grad()
    return loss

  return opt, sched, step


# -- the children: one variant each ---------------------------------------------------------


def _xladist(level, layers, rows, steps):
  import xladist as xd
  from xladist import runtime as _runtime

  base = rss()
  sharding = None
  if level is not None:
    sharding = xd.experimental.ShardingOptions(shard=level, min_shard_bytes=0)
  strategy = xd.MirroredStrategy(experimental_sharding=sharding)
  assert strategy.num_replicas_in_sync == 4, "needs 4 devices"
  with strategy.scope():
    model = mlp(layers)
    opt, sched, step = _torch_loop(model)

  data = batch(rows)

  def rows_of(ctx):
    i = ctx.replica_id_in_sync_group
    return data[i * rows : (i + 1) * rows]

  x = strategy.experimental_distribute_values_from_function(rows_of)
  out = []

  def one_step():
    out[:] = [strategy.run(step, args=(x,))]
    sched.step()
    _runtime.sync()  # launches a traced step; a replayed one is launched by `run`
    _runtime.wait()

  times = timed(steps, one_step)
  loss = strategy.reduce("mean", out[0], axis=None).item()
  # On `strategy.extended` in this release (issue 51 names it on the strategy).
  owner = strategy if hasattr(strategy, "experimental_state_bytes") else strategy.extended
  held = owner.experimental_state_bytes()
  counts = strategy.extended.experimental_replay_counts
  note = f"{counts['replayed']} of {steps} steps replayed"
  return base, loss, times, held, note


def _fsdpv2(layers, rows, steps):
  import numpy as np
  import torch_xla
  import torch_xla.core.xla_model as xm
  import torch_xla.distributed.spmd as xs
  import torch_xla.runtime as xr
  from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
  )

  base = rss()
  xr.use_spmd()
  mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))
  xs.set_global_mesh(mesh)
  model = FSDPv2(mlp(layers))  # moves the model to the device, shards every parameter
  opt, sched, step = _torch_loop(model)
  x = batch(rows).to(torch_xla.device())
  xs.mark_sharding(x, mesh, ("fsdp", None))
  out = []

  def one_step():
    out[:] = [step(x)]
    sched.step()
    torch_xla.sync()
    xm.wait_device_ops()

  times = timed(steps, one_step)
  return base, out[0].item(), times, None, ""


def _hand_jax(layers, rows, steps):
  import jax
  import numpy as np
  import optax
  from _jax_reference import mlp_loss
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  base = rss()
  mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))

  def fsdp(shape):  # dimension 0 over the "fsdp" axis; a scalar replicated
    return NamedSharding(mesh, P("fsdp", *([None] * (len(shape) - 1))) if shape else P())

  model = mlp(layers)
  params = [
    tuple(
      jax.device_put(a, fsdp(a.shape)) for a in (m.weight.detach().numpy(), m.bias.detach().numpy())
    )
    for m in model
    if hasattr(m, "weight")
  ]
  del model
  opt = optax.chain(
    optax.clip_by_global_norm(MAX_NORM),
    optax.adamw(optax.cosine_decay_schedule(LR, T_MAX), weight_decay=WD),
  )
  param_sh = jax.tree.map(lambda a: a.sharding, params)
  state_sh = jax.tree.map(lambda s: fsdp(s.shape), jax.eval_shape(opt.init, params))
  state = jax.jit(opt.init, out_shardings=state_sh)(params)
  replicated = NamedSharding(mesh, P())

  def train_step(params, state, x):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  jitted = jax.jit(
    train_step,
    in_shardings=(param_sh, state_sh, fsdp((1, 1))),
    out_shardings=(param_sh, state_sh, replicated),
    donate_argnums=(0, 1),
  )
  x = jax.device_put(batch(rows).numpy(), fsdp((1, 1)))
  times, loss = timed_jax_steps(steps, jitted, params, state, x)
  return base, loss, times, None, ""


def _child(variant, layers, rows, steps):
  """Imports what the variant's runtime needs, then runs it; prints one JSON line."""
  import torch  # noqa: F401

  import xladist  # noqa: F401

  _, runtime, level, kind = VARIANTS[variant]
  if runtime == "xla":
    import torch_xla  # noqa: F401
    import torch_xla.distributed.spmd  # noqa: F401
    import torch_xla.experimental.spmd_fully_sharded_data_parallel  # noqa: F401
    import torch_xla.runtime  # noqa: F401
  else:
    import jax  # noqa: F401
    import optax  # noqa: F401
  if kind == "xladist":
    base, loss, times, held, note = _xladist(level, layers, rows, steps)
  elif kind == "fsdpv2":
    base, loss, times, held, note = _fsdpv2(layers, rows, steps)
  else:
    base, loss, times, held, note = _hand_jax(layers, rows, steps)
  kept = times[min(FIRST_TIMED - 1, len(times) - 1) :]
  result = {
    "base": base,
    "peak": peak(),
    "end": rss(),
    "loss": loss,
    "step_s": statistics.median(kept),
    "fastest_s": min(kept),
    "times_s": times,
    "state_bytes": held,
    "note": note,
  }
  print(json.dumps(result), flush=True)


# -- the parent ------------------------------------------------------------------------------


def _measure(python, variant, layers, rows, steps, timeout):
  """The child's result, or {"error": the last lines of its output} when it failed."""
  env = dict(os.environ, **(XLA_ENV if VARIANTS[variant][1] == "xla" else JAX_ENV))
  # The child imports this checkout's xladist, whatever the interpreter has installed.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  command = [python, os.path.abspath(__file__), "--child", variant]
  command += ["--layers", str(layers), "--rows", str(rows), "--steps", str(steps)]
  start = time.perf_counter()
  try:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    tail = (e.stderr or b"")[-2000:]
    tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
    return {"error": f"no result within {timeout} s\n{tail}", "wall_s": timeout}
  lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
  if done.returncode != 0 or not lines:
    tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
    return {"error": f"exit {done.returncode}\n{tail}", "wall_s": time.perf_counter() - start}
  return dict(json.loads(lines[-1]), wall_s=time.perf_counter() - start)


def _reference(variant, results):
  """The MirroredStrategy variant a row's ratios are to (or None)."""
  own = f"{VARIANTS[variant][1]}-mirrored"
  for ref in (own, "xla-mirrored"):
    if "error" not in results.get(ref, {"error": ""}):
      return ref
  return None


def _held_cell(held):
  if not held:
    return "-"
  return " / ".join(f"{held[k] / MB:.1f}" for k in ("parameters", "gradients", "optimizer_state"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--rows", type=int, default=8, help="rows per replica")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument(
    "--variants",
    default=None,
    help=f"a comma list of {', '.join(VARIANTS)} (default: {', '.join(DEFAULT)})",
  )
  parser.add_argument("--jax", action="store_true", help="the xladist variants on jax too")
  add_interpreter_arguments(parser)
  parser.add_argument("--json", default=None, metavar="OUT", help="also write the results here")
  parser.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
  parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
  from _plot import add_plot_argument, save_plot

  add_plot_argument(parser)
  args = parser.parse_args()
  if args.child:
    return _child(args.child, args.layers, args.rows, args.steps)
  on_jax = os.environ.get("XLADIST_BACKEND") == "jax"
  pythons = {
    "xla": args.xla_python or (None if on_jax else sys.executable),
    "jax": args.jax_python or (sys.executable if on_jax else None),
  }
  if args.variants:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
      parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
  else:
    variants = DEFAULT + (ON_JAX if args.jax else [])
  # In VARIANTS' order: MirroredStrategy first on each runtime (the ratios are to it).
  order = list(VARIANTS)
  variants = sorted(dict.fromkeys(variants), key=order.index)
  params = args.layers * (WIDTH * WIDTH + WIDTH)
  print(
    f"MLP of {args.layers} x Linear({WIDTH}, {WIDTH}) ({params / 1e6:.1f}M parameters), "
    f"AdamW + clip_grad_norm_ + CosineAnnealingLR, 4 replicas x {args.rows} rows, "
    f"{args.steps} steps, min_shard_bytes=0; each variant in its own process; state MB: "
    "parameters / gradients / optimizer state on the fullest device after the last step; "
    f"step ms: median (fastest) of steps {FIRST_TIMED}..{args.steps}",
    flush=True,
  )
  results, skipped = {}, []
  for variant in variants:
    python = pythons[VARIANTS[variant][1]]
    if python is None:
      skipped.append(variant)
      continue
    results[variant] = _measure(python, variant, args.layers, args.rows, args.steps, args.timeout)
    r = results[variant]
    status = "failed" if "error" in r else f"{r['step_s'] * 1e3:.0f} ms/step"
    print(f"  {variant}: {status} ({r['wall_s']:.0f} s)", flush=True)
  print()
  print(
    "| variant | state MB (P / G / O) | peak increment MB | peak vs mirrored "
    "| step ms (fastest) | step vs mirrored | final loss | note |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---|")
  ratios = {}
  for variant, r in results.items():
    label = VARIANTS[variant][0]
    if "error" in r:
      first = r["error"].splitlines()[0]
      print(f"| {label} | - | - | - | - | - | - | FAILED ({first}; traceback below) |")
      continue
    ref = _reference(variant, results)
    peak_mb = (r["peak"] - r["base"]) / MB
    cells = ["-", "-"]
    if ref:
      rr = results[ref]
      peak_ratio = peak_mb / ((rr["peak"] - rr["base"]) / MB)
      step_ratio = r["step_s"] / rr["step_s"]
      ratios[variant] = (peak_ratio, step_ratio, ref)
      cells = [f"{peak_ratio:.2f}", f"{step_ratio:.2f}"]
      if ref != f"{VARIANTS[variant][1]}-mirrored":
        cells = [c + " (torch_xla's)" for c in cells]
    print(
      f"| {label} | {_held_cell(r['state_bytes'])} | {peak_mb:.0f} | {cells[0]} "
      f"| {r['step_s'] * 1e3:.0f} ({r['fastest_s'] * 1e3:.0f}) | {cells[1]} "
      f"| {r['loss']:.6g} | {r['note']} |",
      flush=True,
    )
  print("\nThe issue's targets (vs MirroredStrategy on the same runtime):")
  for variant, r in results.items():
    level = VARIANTS[variant][2]
    if level is None or "error" in r or variant not in ratios:
      continue
    peak_ratio, step_ratio, ref = ratios[variant]
    peak_bound, step_bound = TARGETS[level]
    checks = [
      ("peak RSS increment", peak_ratio, peak_bound),
      ("step time", step_ratio, step_bound),
      ("fastest step", r["fastest_s"] / results[ref]["fastest_s"], step_bound),
    ]
    if level == "parameters":
      whole = results[ref]["state_bytes"]["parameters"]
      checks.append(("parameter bytes", r["state_bytes"]["parameters"] / whole, 0.26))
    print(
      f"  {VARIANTS[variant][0]}: "
      + "; ".join(
        f"{what} {ratio:.2f}x (target <= {bound:.2f}x: {'met' if ratio <= bound else 'NOT met'})"
        for what, ratio, bound in checks
      )
    )
  for variant in skipped:
    print(f"  {variant}: skipped (no interpreter for it: --{VARIANTS[variant][1]}-python)")
  for variant, r in results.items():
    if "error" in r:
      print(f"\n{variant} failed: {r['error']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {
          "layers": args.layers,
          "rows": args.rows,
          "steps": args.steps,
          "results": {v: dict(r, label=VARIANTS[v][0]) for v, r in results.items()},
        },
        f,
        indent=2,
      )
    print(f"wrote {args.json}")
  if args.plot and ratios:
    series = {"peak RSS increment": {}, "step time": {}}
    for variant, (peak_ratio, step_ratio, _) in ratios.items():
      runtime, what = variant.split("-", 1)
      name = f"{SHORT.get(what, what)}\n{'torch_xla' if runtime == 'xla' else runtime}"
      series["peak RSS increment"][name] = peak_ratio
      series["step time"][name] = step_ratio
    path = save_plot(
      args.plot,
      f"Sharded state, {params / 1e6:.1f}M parameters, AdamW, 4 replicas",
      "variant",
      "x MirroredStrategy",
      series,
      kind="bar",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
