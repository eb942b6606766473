"""What a training run keeps in memory: xladist against the same loop written by hand (issue 41).

On XLA:CPU every device's buffers are host memory, so a process's peak resident
set shows what a run keeps alive. Each variant runs in a process of its own:
the figure is the child's peak RSS (`resource.getrusage(...).ru_maxrss`) minus
its RSS right after its imports (torch and its runtime's libraries, xladist),
so starting the runtime, placing the model, compiling and 20 steps are counted.

The loop: torch's default AdamW on an MLP of `--layers` x Linear(1024, 1024)
(+ tanh), 8 layers = 8.4M parameters, 24 = 25.2M, 4 replicas x `--rows` rows,
`--steps` steps (default 20), the mean square of the output as the loss.

  * xladist: `MirroredStrategy`, `strategy.run(step)` (the default: replayed
    once two captures agree), on the runtime the child's interpreter runs.
  * hand-written torch_xla: the idiomatic SPMD step (the batch split over a
    ("data",) mesh with `mark_sharding`, parameters replicated, AdamW,
    `torch_xla.sync()` after each step).
  * hand-written jax: one `jax.jit` of the loss's gradient and optax's AdamW,
    parameters and optimizer state donated (`donate_argnums`), the batch split
    over the 4 devices.

Ratios are to hand-written torch_xla at the same size. One run each; RSS moves by
tens of MB between runs on a shared machine: compare ratios.

  make bench-memory                   # xladist on torch_xla, hand-written torch_xla
  make bench-memory BACKEND=jax       # xladist on jax, jax.jit + optax, the torch_xla reference
"""

import argparse
import json
import os
import subprocess
import sys

from _memory_shared import WIDTH, add_interpreter_arguments, batch, mlp, peak, rss

LR, WD = 1e-3, 1e-2
MB = 1024 * 1024

XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLADIST_BACKEND": "torch_xla"}
JAX_ENV = {
  "XLADIST_BACKEND": "jax",
  "JAX_PLATFORMS": "cpu",
  "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
}
# variant -> (label, runtime, environment)
VARIANTS = {
  "xladist-xla": ("xladist, torch_xla", "xla", XLA_ENV),
  "hand-xla": ("hand-written torch_xla", "xla", XLA_ENV),
  "xladist-jax": ("xladist, jax", "jax", JAX_ENV),
  "hand-jax": ("hand-written jax.jit + optax", "jax", JAX_ENV),
}
REFERENCE = "hand-xla"


# -- the children: one variant each ---------------------------------------------------------


def _xladist(layers, rows, steps):
  import torch

  import xladist as xd

  base = rss()
  strategy = xd.MirroredStrategy()
  assert strategy.num_replicas_in_sync == 4, "needs 4 devices"
  with strategy.scope():
    model = mlp(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)

  def step(x):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  data = batch(rows)

  def rows_of(ctx):
    i = ctx.replica_id_in_sync_group
    return data[i * rows : (i + 1) * rows]

  x = strategy.experimental_distribute_values_from_function(rows_of)
  for _ in range(steps):
    out = strategy.run(step, args=(x,))
  loss = strategy.reduce("mean", out, axis=None).item()
  counts = strategy.extended.experimental_replay_counts
  return base, loss, f"{counts['replayed']} of {steps} steps replayed"


def _hand_xla(layers, rows, steps):
  import numpy as np
  import torch
  import torch_xla
  import torch_xla.distributed.spmd as xs
  import torch_xla.runtime as xr

  base = rss()
  xr.use_spmd()
  mesh = xs.Mesh(np.arange(4), (4,), ("data",))
  device = torch_xla.device()
  model = mlp(layers).to(device)
  opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
  x = batch(rows).to(device)
  xs.mark_sharding(x, mesh, ("data", None))
  for _ in range(steps):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    torch_xla.sync()
  return base, loss.item(), ""


def _hand_jax(layers, rows, steps):
  import jax
  import jax.numpy as jnp
  import optax
  from _jax_reference import donated_step, mesh_shardings

  base = rss()
  replicated, split = mesh_shardings()
  model = mlp(layers)
  params = [
    (jnp.asarray(m.weight.detach().numpy()), jnp.asarray(m.bias.detach().numpy()))
    for m in model
    if hasattr(m, "weight")
  ]
  del model
  params = jax.device_put(params, replicated)
  opt = optax.adamw(LR, weight_decay=WD)
  state = jax.device_put(opt.init(params), replicated)
  step = donated_step(opt)
  x = jax.device_put(jnp.asarray(batch(rows).numpy()), split)
  for _ in range(steps):
    params, state, loss = step(params, state, x)
  return base, float(loss), ""


def _child(variant, layers, rows, steps):
  """Imports what the variant's runtime needs, then runs it; prints one JSON line."""
  import torch  # noqa: F401

  import xladist  # noqa: F401

  if VARIANTS[variant][1] == "xla":
    import torch_xla  # noqa: F401
    import torch_xla.distributed.spmd  # noqa: F401
    import torch_xla.runtime  # noqa: F401
  else:
    import jax  # noqa: F401
    import optax  # noqa: F401
  run = {"xladist-xla": _xladist, "xladist-jax": _xladist, "hand-xla": _hand_xla}
  base, loss, note = run.get(variant, _hand_jax)(layers, rows, steps)
  print(
    json.dumps({"base": base, "peak": peak(), "end": rss(), "loss": loss, "note": note}),
    flush=True,
  )


# -- the parent ------------------------------------------------------------------------------


def _measure(python, variant, layers, rows, steps):
  env = dict(os.environ, **VARIANTS[variant][2])
  # The child imports this checkout's xladist, whatever the interpreter has installed.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  command = [python, os.path.abspath(__file__), "--child", variant]
  command += ["--layers", str(layers), "--rows", str(rows), "--steps", str(steps)]
  done = subprocess.run(command, env=env, capture_output=True, text=True)
  lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
  if done.returncode != 0 or not lines:
    sys.stderr.write(done.stderr[-4000:])
    raise SystemExit(
      f"bench/memory.py: {variant} at {layers} layers failed (exit {done.returncode})"
    )
  return json.loads(lines[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[8, 24])
  parser.add_argument("--rows", type=int, default=8, help="rows per replica")
  parser.add_argument("--steps", type=int, default=20)
  add_interpreter_arguments(parser)
  parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=None)
  parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
  from _plot import add_plot_argument, save_plot

  add_plot_argument(parser)
  args = parser.parse_args()
  if args.child:
    return _child(args.child, args.layers[0], args.rows, args.steps)
  on_jax = os.environ.get("XLADIST_BACKEND") == "jax"
  pythons = {
    "xla": args.xla_python or (None if on_jax else sys.executable),
    "jax": args.jax_python or (sys.executable if on_jax else None),
  }
  variants = args.variants or [v for v in VARIANTS if pythons[VARIANTS[v][1]]]
  if pythons["xla"]:  # the reference first: every ratio is to it
    variants = [REFERENCE] + [v for v in variants if v != REFERENCE]
  print(
    f"AdamW, MLP of Linear({WIDTH}, {WIDTH}), 4 replicas x {args.rows} rows, {args.steps} "
    "steps; peak RSS over the RSS after imports, each variant in its own process"
  )
  print(
    "| parameters | variant | peak increment MB | end increment MB "
    "| vs hand-written torch_xla | note |"
  )
  print("|---|---|---:|---:|---:|---|")
  figures = {}
  for layers in args.layers:
    params = layers * (WIDTH * WIDTH + WIDTH)
    ref = None
    for variant in variants:
      python = pythons[VARIANTS[variant][1]]
      if python is None:
        continue
      m = _measure(python, variant, layers, args.rows, args.steps)
      peak, end = (m["peak"] - m["base"]) / MB, (m["end"] - m["base"]) / MB
      if variant == REFERENCE:
        ref = peak
      ratio = f"{peak / ref:.2f}" if ref else "-"
      figures.setdefault(VARIANTS[variant][0], {})[f"{params / 1e6:.1f}M"] = peak
      print(
        f"| {params / 1e6:.1f}M | {VARIANTS[variant][0]} | {peak:.0f} | {end:.0f} | {ratio} "
        f"| loss {m['loss']:.6g}{'; ' + m['note'] if m['note'] else ''} |",
        flush=True,
      )
  if args.plot:
    path = save_plot(
      args.plot,
      f"Peak RSS over imports, AdamW, 4 replicas, {args.steps} steps",
      "parameters",
      "MB",
      figures,
      kind="bar",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
