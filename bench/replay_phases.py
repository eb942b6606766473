"""Where a replayed step's host time goes, by phase (issue 61).

The loop of bench/replay_scaling.py (torch's AdamW + CosineAnnealingLR stepped after
every step, L/2 x (Linear(64, 64) + tanh), 4 replicas x 8 rows) on whichever runtime
XLADIST_BACKEND selects. After warm-up (replay reached, verification traces off),
`--steps` replayed steps run once timed (wall per step) and once under cProfile; each
phase is the cumulative profiled time of the functions that do it (listed in PHASES,
none called inside another), scaled by wall / profiled so that the phases add up to
the wall time per step (cProfile's overhead is spread evenly: an estimate, not a
measurement of each phase alone). "rest" is what `strategy.run` spends outside them.

  make bench-phases                  # torch_xla
  make bench-phases BACKEND=jax      # jax runtime
"""

import argparse
import cProfile
import os
import pstats
import time

from _plot import add_plot_argument, save_plot
from replay_scaling import training_loop

import xladist as xd
from xladist import runtime

# phase -> (file name, function name) of the functions doing it
PHASES = {
  "signature": [("compile_watch.py", "before_step"), ("strategy.py", "_end_previous_step")],
  "key": [
    ("replay_slots.py", "fn_refs"),
    ("replay_slots.py", "arg_refs"),
    ("replay_slots.py", "store_refs"),
    ("read_guards.py", "torch_modes"),
    ("read_guards.py", "key"),
    ("signature.py", "replay_entries"),
    ("_nest.py", "flatten"),
  ],
  "guards": [("replay_program.py", "_guards_fail"), ("replay.py", "check")],
  "hyperparameters": [
    ("replay_program.py", "_hyper_values"),
    ("replay_program.py", "_hyper_value"),
    ("jax_programs.py", "_fed"),
  ],
  "slots in": [
    ("replay_slots.py", "get"),
    ("replay_program.py", "arg_global"),
    ("replay_program.py", "_seed_tensor"),
  ],
  "dispatch": [
    ("jax_programs.py", "call"),
    ("jax_programs.py", "_donating_call"),
    ("xla_programs.py", "run_program"),
  ],
  "wait": [("xla.py", "wait")],
  "results as tensors": [("jax_devices.py", "_wrap")],
  "write-back": [
    ("replay_program.py", "write_back"),
    ("replay_program.py", "advance_host_scalars"),
  ],
  "seeds": [("seeds.py", "start_step"), ("seeds.py", "after_replay")],
  "placeholders": [("replay_program.py", "arg_entry")],
}


def _phases(stats, total):
  by_name = {}
  for (path, _, name), (_, _, _, cum, _) in stats.stats.items():
    by_name.setdefault((os.path.basename(path), name), 0.0)
    by_name[(os.path.basename(path), name)] += cum
  out = {phase: sum(by_name.get(f, 0.0) for f in funcs) for phase, funcs in PHASES.items()}
  out["rest"] = total - sum(out.values())
  return out


def measure(strategy, tensors, steps):
  """(wall µs per step, {phase: µs per step}) of `steps` replayed steps."""
  run = training_loop(strategy, tensors)
  run(60)
  runtime.wait()
  counts = strategy.extended.experimental_replay_counts
  before = counts["replayed"]
  start = time.perf_counter()
  out = run(steps)
  runtime.wait()
  wall = (time.perf_counter() - start) / steps * 1e6
  profile = cProfile.Profile()
  profile.enable()
  out = run(steps)
  runtime.wait()
  profile.disable()
  strategy.reduce("mean", out, axis=None).item()
  replayed = strategy.extended.experimental_replay_counts["replayed"] - before
  if replayed != 2 * steps:
    raise AssertionError(f"{replayed} of {2 * steps} measured steps replayed")
  stats = pstats.Stats(profile)
  total = sum(
    cum
    for (path, _, name), (*_, cum, _) in stats.stats.items()
    if name == "run" and os.path.basename(path) == "strategy.py"
  )
  scale = wall / (total / steps * 1e6)
  return wall, {k: v / steps * 1e6 * scale for k, v in _phases(stats, total).items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tensors", type=int, nargs="+", default=[4, 32, 128])
  parser.add_argument("--steps", type=int, default=100)
  add_plot_argument(parser)
  args = parser.parse_args()
  os.environ["XLADIST_REPLAY_VERIFY"] = "0"
  strategy = xd.MirroredStrategy()
  assert strategy.num_replicas_in_sync == 4, "run with 4 devices (make bench-phases)"
  backend = os.environ.get("XLADIST_BACKEND", "torch_xla")
  print(f"replayed AdamW + cosine step by phase, µs per step (and per tensor); runtime {backend}")
  rows = []
  for n in args.tensors:
    wall, phases = measure(strategy, n, args.steps)
    rows.append((n, wall, phases))
  names = list(rows[0][2])
  print("| phase | " + " | ".join(f"{n} tensors" for n, _, _ in rows) + " |")
  print("|---" * (len(rows) + 1) + "|")
  print("| wall per step | " + " | ".join(f"{w:.0f}" for _, w, _ in rows) + " |")
  for name in names:
    cells = [f"{p[name]:.0f} ({p[name] / n:.1f})" for n, _, p in rows]
    print(f"| {name} | " + " | ".join(cells) + " |")
  if args.plot:
    small = {"guards", "wait", "seeds", "placeholders"}  # (a few µs: left out of the figure)
    series = {
      name: {f"{n} tensors": p[name] for n, _, p in rows} for name in names if name not in small
    }
    path = save_plot(
      args.plot,
      f"A replayed AdamW + cosine step's host time by phase ({backend})",
      "parameter tensors",
      "µs per step",
      series,
      kind="bar",
      logy=True,
    )
    print(f"plot: {path}")


if __name__ == "__main__":
  main()
