"""Replay's per-step host cost, this tree against another revision, in one run.

Run (XLA:CPU, 4 virtual devices; `make bench-replay-ab BASE=<rev>`)::

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python bench/replay_ab.py --base 27cf8e2

Both trees run the same loop, alternating round by round in ABBA order (each round a
fresh process per tree, so neither inherits the other's caches): an MLP (4 Linear 64->64 + Tanh)
under MirroredStrategy, SGD with momentum and a StepLR stepped after every `run`, a
step function that reads a config object (`cfg.beta`) and a module flag, 20 warm-up
steps, then `--steps` replayed steps timed end to end (`run` + `sync` at the end).
Prints each round's milliseconds per step and the median ratio this tree / base
(below 1: this tree is faster). The base revision is checked out with `git worktree`
into a temporary folder and removed after.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOOP = r"""
import sys, time, torch
import torch.nn as nn, torch.nn.functional as F
import xladist as xd
from xladist import runtime as rt
steps = int(sys.argv[1])
class Cfg: beta = 0.1
cfg = Cfg()
strategy = xd.MirroredStrategy()
with strategy.scope():
  torch.manual_seed(0)
  model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())])
  model.use_reg = True
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.9)
x = strategy.experimental_distribute_values_from_function(lambda c: torch.randn(8, 64))
def step(x):
  out = model(x)
  loss = out.square().mean()
  if model.use_reg:
    loss = loss + cfg.beta * out.abs().mean()
  opt.zero_grad(); loss.backward(); opt.step()
  return loss
for _ in range(20):
  strategy.run(step, (x,)); sched.step()
rt.sync()
t = time.perf_counter()
for _ in range(steps):
  strategy.run(step, (x,)); sched.step()
rt.sync()
ms = (time.perf_counter() - t) / steps * 1e3
c = strategy.extended.experimental_replay_counts
assert c["replayed"] >= steps, c
print(f"MS {ms:.4f}")
"""


def _run(tree, steps, script):
  env = dict(os.environ, PYTHONPATH=tree)
  env.setdefault("PJRT_DEVICE", "CPU")
  env.setdefault("CPU_NUM_DEVICES", "4")
  out = subprocess.run(
    [sys.executable, script, str(steps)],
    capture_output=True, text=True, timeout=600, env=env, cwd=tree,
  )  # fmt: skip
  for line in out.stdout.splitlines():
    if line.startswith("MS "):
      return float(line[3:])
  raise RuntimeError(f"{tree}: no timing\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--base", required=True, help="the revision to compare with")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--steps", type=int, default=1500)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    # A file, not `python -c`: before issue 59 the recorder skipped `<string>` code
    # (it guarded nothing there), which would not be the same work.
    script = os.path.join(tmp, "loop.py")
    with open(script, "w") as f:
      f.write(LOOP)
    base = os.path.join(tmp, "base")
    subprocess.run(["git", "worktree", "add", "--detach", base, args.base], cwd=HERE,
                   check=True, capture_output=True)  # fmt: skip
    try:
      ratios = []
      for r in range(args.rounds):
        if r % 2:  # ABBA: neither tree always runs first
          b, a = _run(base, args.steps, script), _run(HERE, args.steps, script)
        else:
          a, b = _run(HERE, args.steps, script), _run(base, args.steps, script)
        ratios.append(a / b)
        print(f"round {r + 1}: this tree {a:.3f} ms/step, {args.base} {b:.3f} ms/step, "
              f"ratio {a / b:.3f}", flush=True)  # fmt: skip
      print(f"median ratio this tree / {args.base}: {statistics.median(ratios):.3f} "
            f"({args.rounds} rounds of {args.steps} replayed steps)")  # fmt: skip
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", base], cwd=HERE,
                     capture_output=True)  # fmt: skip


if __name__ == "__main__":
  main()
