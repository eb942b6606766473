"""One training step on an NVIDIA GPU: xladist (jax runtime) beside hand-written
`jax.jit`, torch eager and `torch.compile`, one run, ratios printed.

The step: an MLP of `--layers` Linear(`--width`) + ReLU layers and a 10-class
head, cross-entropy on a batch of `--batch` rows, SGD with momentum 0.9. Each
variant runs in a child interpreter of its own (importing torchax beside torch's
own CUDA path breaks the latter: docs/architecture.md, "The jax runtime"), times
`--steps` steps after `--warmup`, waiting for the device after every step, and
reports the median wall time per step. The parent prints a table, the ratio of
each variant to xladist, and writes the figures as JSON (`--out`).

`--device cpu` runs the same comparison on the CPU (jax's CPU platform, torch's
CPU kernels): how the script is checked on machines without a GPU.

Run by `make gpu-check` (bench/gpu_check.sh) on a lent GPU machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("xladist", "jax.jit", "torch eager", "torch.compile")
MARK = "GPU_STEP_JSON "


def _timed(step, wait, warmup, steps):
  for _ in range(warmup):
    step()
  wait()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    step()
    wait()
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def _torch_mlp(args):
  import torch

  layers = []
  for _ in range(args.layers):
    layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
  return torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))


def _data(args):
  import numpy as np

  rng = np.random.RandomState(0)
  x = rng.randn(args.batch, args.width).astype(np.float32)
  y = rng.randint(0, 10, args.batch).astype(np.int64)
  return x, y


def run_torch(args, compiled):
  import torch
  import torch.nn.functional as F

  device = torch.device("cuda" if args.device == "gpu" else "cpu")
  torch.manual_seed(0)
  model = _torch_mlp(args).to(device)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
  forward = torch.compile(model) if compiled else model
  x, y = (torch.from_numpy(a).to(device) for a in _data(args))

  def step():
    optimizer.zero_grad()
    F.cross_entropy(forward(x), y).backward()
    optimizer.step()

  def wait():
    if device.type == "cuda":
      torch.cuda.synchronize()

  name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
  ms = _timed(step, wait, args.warmup, args.steps)
  return {"ms": ms, "device": name, "torch": torch.__version__}


def run_jax(args):
  import jax
  import jax.numpy as jnp

  x, y = _data(args)
  key = jax.random.PRNGKey(0)
  params = []
  sizes = [args.width] * (args.layers + 1) + [10]
  for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
    key, k1 = jax.random.split(key)
    bound = 1 / fan_in**0.5
    params.append(
      (
        jax.random.uniform(k1, (fan_in, fan_out), minval=-bound, maxval=bound),
        jnp.zeros((fan_out,)),
      )
    )
  momentum = jax.tree.map(jnp.zeros_like, params)
  x, y = jnp.asarray(x), jnp.asarray(y.astype("int32"))

  def loss_fn(params):
    h = x
    for w, b in params[:-1]:
      h = jax.nn.relu(h @ w + b)
    w, b = params[-1]
    logp = jax.nn.log_softmax(h @ w + b)
    return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()

  @jax.jit
  def train_step(params, momentum):
    grads = jax.grad(loss_fn)(params)
    momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
    params = jax.tree.map(lambda p, m: p - 0.01 * m, params, momentum)
    return params, momentum

  state = [params, momentum]

  def step():
    state[0], state[1] = train_step(*state)

  ms = _timed(step, lambda: jax.block_until_ready(state[0]), args.warmup, args.steps)
  return {"ms": ms, "device": str(jax.devices()[0]), "jax": jax.__version__}


def run_xladist(args):
  os.environ["XLADIST_BACKEND"] = "jax"
  import torch
  import torch.nn.functional as F

  import xladist as xd
  from xladist import runtime

  strategy = xd.MirroredStrategy()
  torch.manual_seed(0)
  with strategy.scope():
    model = _torch_mlp(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
  n = strategy.num_replicas_in_sync
  x, y = (torch.from_numpy(a) for a in _data(args))
  per = args.batch // n
  xs, ys = (
    strategy.experimental_distribute_values_from_function(
      lambda c, t=t: t[c.replica_id_in_sync_group * per : (c.replica_id_in_sync_group + 1) * per]
    )
    for t in (x, y)
  )

  def train_step(x, y):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()

  def step():
    strategy.run(train_step, args=(xs, ys))
    runtime.sync()

  ms = _timed(step, runtime.wait, args.warmup, args.steps)
  return {
    "ms": ms,
    "device": f"{runtime.device_type()} x {n}",
    "compilations": runtime.compile_count(),
  }


def child(args):
  run = {
    "xladist": run_xladist,
    "jax.jit": run_jax,
    "torch eager": lambda a: run_torch(a, compiled=False),
    "torch.compile": lambda a: run_torch(a, compiled=True),
  }[args.child]
  print(MARK + json.dumps(run(args)), flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
  parser.add_argument("--layers", type=int, default=10)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--warmup", type=int, default=10)
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--timeout", type=float, default=300, help="seconds per variant")
  parser.add_argument("--out", help="write the figures here as JSON")
  parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    return child(args)
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cuda" if args.device == "gpu" else "cpu"
  if args.device == "cpu":
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  results = {}
  passed = []
  for name in ("device", "layers", "width", "batch", "warmup", "steps"):
    passed += [f"--{name}", str(getattr(args, name))]
  for variant in VARIANTS:
    cmd = [sys.executable, os.path.abspath(__file__), *passed, "--child", variant]
    proc = subprocess.Popen(
      cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
      out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, _ = proc.communicate(timeout=30)
      out += f"\n(timed out after {args.timeout} s)"
    line = next((ln for ln in out.splitlines() if ln.startswith(MARK)), None)
    if line is None:
      results[variant] = {"error": out.strip().splitlines()[-5:]}
    else:
      results[variant] = json.loads(line[len(MARK) :])
  base = results["xladist"].get("ms")
  print(
    f"MLP step ({args.layers} x Linear({args.width}), batch {args.batch}), median of "
    f"{args.steps} steps, one run on {args.device}:"
  )
  for variant in VARIANTS:
    r = results[variant]
    if "ms" in r:
      ratio = f"{r['ms'] / base:.3f}" if base else "-"
      print(f"  {variant:14s} {r['ms']:8.3f} ms  ({ratio} of xladist)  {r.get('device', '')}")
    else:
      print(f"  {variant:14s} failed: {' | '.join(r['error'])}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "results": results}, f, indent=2)
  return 0 if all("ms" in r for r in results.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
