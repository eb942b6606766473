"""How a replayed step's cost grows with the number of parameter tensors (issues 40, 61).

The loop most users run: torch's AdamW and a CosineAnnealingLR stepped after every
step (`--optimizer adamw`, the default), or SGD with momentum (`--optimizer sgd`), on
L/2 x (Linear(64, 64) + tanh) (L parameter tensors), 4 replicas x 8 rows, on whichever
runtime XLADIST_BACKEND selects. On the jax runtime the same step written by hand (one
`jax.jit` of the loss's gradient and optax's AdamW with a cosine schedule, or optax's
SGD with momentum; parameters replicated and the batch split over the 4 devices,
parameters and optimizer state donated) runs in the same process.

Method (these machines are noisy: a neighbour's load doubles a time for seconds):
after warm-up, `--rounds` rounds alternate the variants, each round `--steps` steps
and one wait for the device; the ratio of each round's two times is taken, and the
medians are printed. Every timed xladist step must be a replay (checked; a round with
a trace is timed again). Compare the ratios, not the milliseconds.

  make bench-scaling                    # torch_xla
  make bench-scaling BACKEND=jax        # jax runtime, beside jax.jit + optax
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
from _plot import add_plot_argument, save_plot

import xladist as xd
from xladist import runtime

ROWS, WIDTH, LR, T_MAX, WD, MOMENTUM = 8, 64, 1e-3, 1000, 1e-2, 0.9


def training_loop(strategy, tensors, optimizer="adamw"):
  """run(k) -> the last result of k steps of the loop (`strategy.run`, then the
  scheduler's step), on a model and optimizer made now under `strategy`."""
  with strategy.scope():
    layers = []
    for _ in range(tensors // 2):
      layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers)
    if optimizer == "adamw":
      opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
      sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_MAX)
    else:
      opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
      sched = None

  def step(x):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  x = strategy.experimental_distribute_values_from_function(lambda ctx: torch.randn(ROWS, WIDTH))

  def run(k):
    for _ in range(k):
      out = strategy.run(step, args=(x,))
      if sched is not None:
        sched.step()
    return out

  return run


def _xladist_loop(strategy, tensors, optimizer):
  """steps(k) -> wall seconds of k replayed steps and a wait."""
  run = training_loop(strategy, tensors, optimizer)
  counts = strategy.extended

  def steps(k):
    for _ in range(3):
      before = counts.experimental_replay_counts["replayed"]
      start = time.perf_counter()
      run(k)
      runtime.wait()
      took = time.perf_counter() - start
      if counts.experimental_replay_counts["replayed"] - before == k:
        return took
    # (a hyperparameter input's first change since the capture is confirmed by one
    # trace: with the cosine, `1 - lr * wd` first changes in float32 around step 28)
    raise AssertionError(f"a traced step in 3 windows of {k} ({counts.experimental_replay_counts})")

  steps(40)
  strategy.reduce("mean", run(1), axis=None).item()
  return steps


def _jax_loop(tensors, optimizer):
  import jax
  import jax.numpy as jnp
  import optax
  from _jax_reference import donated_step, mesh_shardings

  replicated, split = mesh_shardings()
  keys = jax.random.split(jax.random.PRNGKey(0), tensors // 2)
  params = [(jax.random.normal(k, (WIDTH, WIDTH)) * WIDTH**-0.5, jnp.zeros((WIDTH,))) for k in keys]
  params = jax.device_put(params, replicated)
  if optimizer == "adamw":
    opt = optax.adamw(optax.cosine_decay_schedule(LR, T_MAX), weight_decay=WD)
  else:
    opt = optax.sgd(LR, momentum=MOMENTUM)
  state = [params, jax.device_put(opt.init(params), replicated)]
  step = donated_step(opt)
  x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (4 * ROWS, WIDTH)), split)

  def steps(k):
    start = time.perf_counter()
    for _ in range(k):
      state[0], state[1], loss = step(state[0], state[1], x)
    loss.block_until_ready()
    return time.perf_counter() - start

  steps(10)
  return steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tensors", type=int, nargs="+", default=[4, 32, 128, 512])
  parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
  parser.add_argument("--steps", type=int, default=10, help="steps per round")
  parser.add_argument("--rounds", type=int, default=15)
  add_plot_argument(parser)
  args = parser.parse_args()
  strategy = xd.MirroredStrategy()
  assert strategy.num_replicas_in_sync == 4, "run with 4 devices (make bench-scaling)"
  backend = os.environ.get("XLADIST_BACKEND", "torch_xla (default)")
  what = "AdamW + CosineAnnealingLR" if args.optimizer == "adamw" else "SGD with momentum"
  print(
    f"{what}, replayed, 4 replicas x {ROWS} rows; runtime {backend}; medians of "
    f"{args.rounds} alternating rounds of {args.steps} steps"
  )
  jax_side = os.environ.get("XLADIST_BACKEND") == "jax"
  header = "| parameter tensors | xladist ms/step |"
  print(header + (" jax.jit + optax ms/step | xladist / jax.jit |" if jax_side else ""), flush=True)
  curves = {}
  for n in args.tensors:
    ours = _xladist_loop(strategy, n, args.optimizer)
    ref = _jax_loop(n, args.optimizer) if jax_side else None
    times, refs, ratios = [], [], []
    for _ in range(args.rounds):
      times.append(ours(args.steps) / args.steps * 1e3)
      if ref is not None:
        refs.append(ref(args.steps) / args.steps * 1e3)
        ratios.append(times[-1] / refs[-1])
    row = f"| {n} | {statistics.median(times):.2f} |"
    if ref is not None:
      row += f" {statistics.median(refs):.2f} | {statistics.median(ratios):.2f} |"
    print(row, flush=True)
    curves.setdefault("xladist", ([], []))
    curves["xladist"][0].append(n)
    curves["xladist"][1].append(statistics.median(times))
    if refs:
      curves.setdefault("jax.jit + optax", ([], []))
      curves["jax.jit + optax"][0].append(n)
      curves["jax.jit + optax"][1].append(statistics.median(refs))
    del ours, ref
  if args.plot:
    path = save_plot(
      args.plot,
      f"Replayed {what} step by parameter tensors ({backend})",
      "parameter tensors",
      "ms per step (median of rounds)",
      curves,
      logx=True,
      logy=True,
    )
    print(f"plot: {path}")


if __name__ == "__main__":
  main()
