"""ZeRO-3's peak inside a step, by depth (issue 60): what a device must hold to train.

The MLP of bench/sharding.py (L x Linear(1024, 1024) + tanh, torch's
initialization, seed 0), 4 replicas x `--rows` rows, the mean square of the
output as the loss, `--steps` steps of plain SGD (lr 1e-2, no momentum: the
memory is parameters and gradients only) or `--optimizer adamw` (torch's AdamW,
lr 1e-3), at each depth of `--depths` (default 16, 32, 64), each variant in a
process of its own:

  * xla-mirrored / jax-mirrored: xladist's MirroredStrategy on torch_xla / jax;
  * xla-parameters / jax-parameters: the same with
    `ShardingOptions(shard="parameters", min_shard_bytes=0)`, each Linear a unit;
  * xla-fsdpv2: torch_xla's FSDPv2 (`SpmdFullyShardedDataParallel`) around the
    whole model on a 1-D "fsdp" mesh, `torch_xla.sync()` after each step;
  * jax-scan / jax-scan-remat: hand-written JAX FSDP as MaxText writes it: the
    layers' weights stacked (L, 1024, 1024) and sharded on their rows over an
    "fsdp" axis, one `lax.scan` over the layers whose body gathers its layer
    (`with_sharding_constraint` to replicated), the gradients sharded as the
    weights (GSPMD reduce-scatters them), with and without `jax.checkpoint` on
    the body; one `jax.jit`, parameters (and optimizer state) donated.

Reported per variant and depth:

  * program bytes per device, as a multiple of P (the model's parameter bytes):
    XLA's own accounting of the step's compiled program, arguments + outputs +
    temporaries - aliased (donated) bytes; on torch_xla the largest "Total bytes
    used" of the buffer assignments XLA dumps for the process's programs (the
    step's is the largest), on jax the step program's `memory_analysis()`;
  * peak RSS increment: the child's peak resident set minus its resident set after
    its imports (bench/memory.py's measure: on XLA:CPU the devices' buffers are
    host memory), and between consecutive depths the extra peak RSS per extra
    parameter byte (all 4 devices together: 4 x 1.0 is a whole copy on each);
  * step ms: the median of steps 4..N (timed as bench/sharding.py does) and the
    ratio to MirroredStrategy on the same runtime at the same depth.

  make bench-sharding-depth                      # both runtimes, SGD, 16/32/64 layers
  python bench/sharding_depth.py --depths 32 --variants xla-mirrored,xla-parameters
"""

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
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

MB = 1024 * 1024
SGD_LR, ADAMW_LR = 1e-2, 1e-3
FIRST_TIMED = 4
VARIANTS = {
  "xla-mirrored": ("xladist MirroredStrategy, torch_xla", "xla"),
  "xla-parameters": ('xladist shard="parameters", torch_xla', "xla"),
  "xla-fsdpv2": ("hand-written torch_xla FSDPv2", "xla"),
  "jax-mirrored": ("xladist MirroredStrategy, jax", "jax"),
  "jax-parameters": ('xladist shard="parameters", jax', "jax"),
  "jax-scan": ("hand-written jax FSDP (scan), no remat", "jax"),
  "jax-scan-remat": ("hand-written jax FSDP (scan) + jax.checkpoint", "jax"),
}
ENV = {
  "xla": {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLADIST_BACKEND": "torch_xla"},
  "jax": {
    "XLADIST_BACKEND": "jax",
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
  },
}


def _param_bytes(layers):
  return layers * (WIDTH * WIDTH + WIDTH) * 4


def _torch_optimizer(name, params):
  import torch

  if name == "sgd":
    return torch.optim.SGD(params, lr=SGD_LR)
  return torch.optim.AdamW(params, lr=ADAMW_LR)


# -- the children ------------------------------------------------------------------------------


def _xladist(variant, layers, rows, steps, optimizer):
  import xladist as xd
  from xladist import runtime as _runtime

  base = rss()
  sharding = None
  if variant.endswith("parameters"):
    sharding = xd.experimental.ShardingOptions(shard="parameters", min_shard_bytes=0)
  strategy = xd.MirroredStrategy(experimental_sharding=sharding)
  assert strategy.num_replicas_in_sync == 4, "needs 4 devices"
  with strategy.scope():
    model = mlp(layers)
    opt = _torch_optimizer(optimizer, model.parameters())
  data = batch(rows)
  x = strategy.experimental_distribute_values_from_function(
    lambda ctx: data[
      ctx.replica_id_in_sync_group * rows : (ctx.replica_id_in_sync_group + 1) * rows
    ]
  )

  def step(x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss

  out = []

  def one_step():
    out[:] = [strategy.run(step, args=(x,))]
    _runtime.sync()
    _runtime.wait()

  times = timed(steps, one_step)
  loss = strategy.reduce("mean", out[0], axis=None).item()
  counts = strategy.extended.experimental_replay_counts
  program = _jax_program_bytes() if variant.startswith("jax") else None
  return base, loss, times, program, f"{counts['replayed']} of {steps} replayed"


def _jax_program_bytes():
  """The jax runtime's last step program: XLA's bytes per device (arguments +
  outputs + temporaries - aliased). Reads the runtime's own record of it (a
  benchmark's view, not an API)."""
  import jax

  from xladist.runtime import jax_programs

  program, consts, key, abstract = jax_programs._last_program[0]
  compiled = [c for c in program.donating.values() if c is not None]
  if not compiled:
    compiled = [jax.jit(program.mapped).lower(consts[0], consts[1], key, *abstract).compile()]
  return _bytes_of(compiled[-1].memory_analysis())


def _bytes_of(ma):
  return (
    ma.argument_size_in_bytes
    + ma.output_size_in_bytes
    + ma.temp_size_in_bytes
    - ma.alias_size_in_bytes
  )


def _fsdpv2(layers, rows, steps, optimizer):
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
  model = FSDPv2(mlp(layers))
  opt = _torch_optimizer(optimizer, model.parameters())
  x = batch(rows).to(torch_xla.device())
  xs.mark_sharding(x, mesh, ("fsdp", None))
  out = []

  def one_step():
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    out[:] = [loss]
    torch_xla.sync()
    xm.wait_device_ops()

  times = timed(steps, one_step)
  return base, out[0].item(), times, None, ""


def _jax_scan(layers, rows, steps, optimizer, remat):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  base = rss()
  mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
  model = mlp(layers)
  linears = [m for m in model if hasattr(m, "weight")]
  w = np.stack([m.weight.detach().numpy() for m in linears])  # (L, out, in)
  b = np.stack([m.bias.detach().numpy() for m in linears])  # (L, out)
  del model, linears
  shard_w, shard_b = (
    NamedSharding(mesh, P(None, "fsdp", None)),
    NamedSharding(mesh, P(None, "fsdp")),
  )
  whole = NamedSharding(mesh, P())
  params = (jax.device_put(w, shard_w), jax.device_put(b, shard_b))
  param_sh = (shard_w, shard_b)

  def body(h, layer):
    lw, lb = layer
    lw = jax.lax.with_sharding_constraint(lw, whole)  # this layer's all-gather
    lb = jax.lax.with_sharding_constraint(lb, whole)
    return jnp.tanh(h @ lw.T + lb), None

  if remat:
    body = jax.checkpoint(body)

  def loss_fn(params, x):
    h, _ = jax.lax.scan(body, x, params)
    return jnp.mean(h**2)

  opt = optax.sgd(SGD_LR) if optimizer == "sgd" else optax.adamw(ADAMW_LR, weight_decay=1e-2)
  state_sh = jax.tree.map(
    lambda s: shard_w if s.ndim == 3 else shard_b if s.ndim == 2 else whole,
    jax.eval_shape(opt.init, params),
  )
  state = jax.jit(opt.init, out_shardings=state_sh)(params)

  def train_step(params, state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    grads = jax.lax.with_sharding_constraint(grads, param_sh)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  xs = NamedSharding(mesh, P("fsdp", None))
  jitted = jax.jit(
    train_step,
    in_shardings=(param_sh, state_sh, xs),
    out_shardings=(param_sh, state_sh, whole),
    donate_argnums=(0, 1),
  )
  x = jax.device_put(batch(rows).numpy(), xs)
  program = _bytes_of(jitted.lower(params, state, x).compile().memory_analysis())
  times, loss = timed_jax_steps(steps, jitted, params, state, x)
  return base, loss, times, program, ""


def _torch_xla_program_bytes(dump):
  """The largest "Total bytes used" of XLA's dumped buffer assignments (the step's program)."""
  best = 0
  for path in glob.glob(os.path.join(dump, "*buffer-assignment.txt")):
    with open(path) as f:
      found = re.search(r"Total bytes used: (\d+)", f.read())
    if found:
      best = max(best, int(found.group(1)))
  return best or None


def _child(variant, layers, rows, steps, optimizer, dump):
  import torch  # noqa: F401

  import xladist  # noqa: F401

  if VARIANTS[variant][1] == "xla":
    import torch_xla  # noqa: F401
    import torch_xla.distributed.spmd  # noqa: F401
    import torch_xla.experimental.spmd_fully_sharded_data_parallel  # noqa: F401
    import torch_xla.runtime  # noqa: F401
  else:
    import jax  # noqa: F401
    import optax  # noqa: F401
  if variant == "xla-fsdpv2":
    base, loss, times, program, note = _fsdpv2(layers, rows, steps, optimizer)
  elif variant.startswith("jax-scan"):
    base, loss, times, program, note = _jax_scan(
      layers, rows, steps, optimizer, variant.endswith("remat")
    )
  else:
    base, loss, times, program, note = _xladist(variant, layers, rows, steps, optimizer)
  if program is None and dump:
    program = _torch_xla_program_bytes(dump)
  kept = times[min(FIRST_TIMED - 1, len(times) - 1) :]
  print(
    json.dumps(
      {
        "base": base,
        "peak": peak(),
        "loss": loss,
        "step_s": statistics.median(kept),
        "program": program,
        "note": note,
      }
    ),
    flush=True,
  )


# -- the parent --------------------------------------------------------------------------------


def _measure(python, variant, layers, rows, steps, optimizer, timeout):
  runtime = VARIANTS[variant][1]
  env = dict(os.environ, **ENV[runtime])
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  dump = tempfile.mkdtemp(prefix="xladist-depth-") if runtime == "xla" else ""
  if dump:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
  command = [python, os.path.abspath(__file__), "--child", variant, "--optimizer", optimizer]
  command += ["--depths", str(layers), "--rows", str(rows), "--steps", str(steps)]
  command += ["--dump", dump]
  try:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"no result within {timeout} s"}
  finally:
    if dump:
      shutil.rmtree(dump, ignore_errors=True)
  lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
  if done.returncode != 0 or not lines:
    tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
    return {"error": f"exit {done.returncode}\n{tail}"}
  return json.loads(lines[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--depths", default="16,32,64", help="comma list of layer counts")
  parser.add_argument("--rows", type=int, default=2, help="rows per replica")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list")
  parser.add_argument("--json", default=None, metavar="OUT", help="also write the results here")
  parser.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
  parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
  parser.add_argument("--dump", default="", help=argparse.SUPPRESS)
  parser.add_argument(
    "--from-json", default=None, metavar="IN", help="print and plot a saved run (--json) again"
  )
  add_interpreter_arguments(parser)
  from _plot import add_plot_argument, save_plot

  add_plot_argument(parser)
  args = parser.parse_args()
  depths = [int(d) for d in args.depths.split(",")]
  if args.child:
    return _child(args.child, depths[0], args.rows, args.steps, args.optimizer, args.dump)
  if args.from_json:
    with open(args.from_json) as f:
      saved = json.load(f)
    results = {(k.split("@")[0], int(k.split("@")[1])): r for k, r in saved.items()}
    variants = list(dict.fromkeys(v for v, _ in results))
    depths = sorted({n for _, n in results})
    _report(results, variants, depths, args, save_plot)
    return None
  on_jax = os.environ.get("XLADIST_BACKEND") == "jax"
  pythons = {
    "xla": args.xla_python or (None if on_jax else sys.executable),
    "jax": args.jax_python or (sys.executable if on_jax else None),
  }
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
  print(
    f"L x Linear({WIDTH}, {WIDTH}) + tanh, {args.optimizer}, 4 replicas x {args.rows} rows, "
    f"{args.steps} steps; each variant and depth in its own process",
    flush=True,
  )
  results = {}
  for layers in depths:
    for variant in variants:
      python = pythons[VARIANTS[variant][1]]
      if python is None:
        continue
      start = time.perf_counter()
      r = _measure(python, variant, layers, args.rows, args.steps, args.optimizer, args.timeout)
      results[(variant, layers)] = r
      status = "failed" if "error" in r else f"{r['step_s'] * 1e3:.0f} ms/step"
      print(f"  {variant} x {layers}: {status} ({time.perf_counter() - start:.0f} s)", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({f"{v}@{n}": r for (v, n), r in results.items()}, f, indent=2)
    print(f"wrote {args.json}")
  _report(results, variants, depths, args, save_plot)
  return None


def _report(results, variants, depths, args, save_plot):
  print()
  print(
    "| variant | layers | program bytes / P | peak RSS increment MB | extra RSS per extra "
    "parameter byte | step ms | step vs mirrored | final loss | note |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
  for variant in variants:
    previous = None
    for layers in depths:
      r = results.get((variant, layers))
      if r is None:
        continue
      label = VARIANTS[variant][0]
      if "error" in r:
        print(f"| {label} | {layers} | FAILED: {r['error'].splitlines()[0]} |||||||")
        continue
      p = _param_bytes(layers)
      inc = r["peak"] - r["base"]
      program = f"{r['program'] / p:.2f}" if r.get("program") else "-"
      slope = "-"
      if previous is not None:
        slope = f"{(inc - previous[1]) / (p - previous[0]):.2f}"
      previous = (p, inc)
      ref = results.get((f"{VARIANTS[variant][1]}-mirrored", layers))
      ratio = f"{r['step_s'] / ref['step_s']:.2f}" if ref and "error" not in ref else "-"
      print(
        f"| {label} | {layers} | {program} | {inc / MB:.0f} | {slope} | "
        f"{r['step_s'] * 1e3:.0f} | {ratio} | {r['loss']:.6g} | {r['note']} |",
        flush=True,
      )
  for (variant, layers), r in results.items():
    if "error" in r:
      print(f"\n{variant} x {layers} failed: {r['error']}")
  if args.plot:
    series = {}
    for variant in variants:
      points = [
        (n, results[(variant, n)]["program"] / _param_bytes(n))
        for n in depths
        if (variant, n) in results and results[(variant, n)].get("program")
      ]
      if points:
        series[VARIANTS[variant][0]] = ([n for n, _ in points], [b for _, b in points])
    save_plot(
      args.plot,
      "One step's program bytes per device (XLA), 4 replicas",
      "layers of Linear(1024, 1024)",
      "bytes per device / the model's parameter bytes",
      series,
      logy=True,
    )
    print(f"wrote {args.plot}")


if __name__ == "__main__":
  main()
