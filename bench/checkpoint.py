"""Checkpoint save and restore: time and peak host memory against model size, both formats.

Run (XLA:CPU)::

  PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 PYTHONPATH=. python bench/checkpoint.py [--plot]

For each model size (--sizes, parameters in millions; default 10, 100 and 400)
the model is a stack of Linear(--width, --width) layers (default 2048: 4.2 M
parameters and 2 tensors a layer) made under `MirroredStrategy().scope()`
(replicated on the CPU_NUM_DEVICES devices), fp32, no optimizer. On XLA:CPU
the devices' buffers are host memory: a replicated model takes
CPU_NUM_DEVICES times its size there before any checkpoint is made, so the
400 M model needs about 12 GB with 4 devices and 6 GB with 1. For each format ("file":
one torch.save file; "sharded": a torch.distributed.checkpoint directory) two
fresh processes run, one per measurement:

* save: builds the model (seed 0), waits for the devices, then times
  `Checkpoint(model=model).save(path, options)`, which includes reading the
  values back from the devices, the SHA-256 digests and the fsyncs;
* restore: builds the model with other weights (seed 1), then times
  `Checkpoint(model=model).restore(path)` up to the point where the restored
  values are on the devices (`wait_device_ops`); the parent checks that they
  are the saved ones.

Each process runs its operation --repeats times (default 3; a save replaces
the checkpoint it wrote) and reports the median time. DCP and torch_xla's
planners are imported before the clock starts (a second, once per process).

Peak host memory is the kernel's high-water mark of the process's resident
set (VmHWM, the counter `getrusage` reports as ru_maxrss), reset with
`/proc/self/clear_refs` just before the operation; the table shows how far it
rose above the resident set at the start of the operation. (tracemalloc would
miss tensor storage, which is not allocated through Python.) On XLA:CPU the
devices' buffers are host memory too: a new replicated copy of a tensor costs
CPU_NUM_DEVICES times its size there (on a TPU it is device memory).

The restore reads files the save has just written, so they come from the page
cache: the times are CPU and memory bound, not disk bound, for both formats.

--plot [PATH] draws the times (PATH, default docs/img/checkpoint.png) and the
memory (PATH with -memory before .png) against the parameter count (needs
matplotlib).
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _plot import add_plot_argument, save_plot

FORMATS = ("file", "sharded")


def _status(field):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024  # kB
  raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak():
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark of the resident set := the resident set now


def _build(layers, width, seed):
  import torch

  import xladist as xd
  from xladist import runtime as _runtime

  strategy = xd.MirroredStrategy()
  torch.manual_seed(seed)
  with strategy.scope():
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
  _runtime.sync()
  _runtime.wait()
  return model


def _fingerprint(model):
  """A few numbers that differ between the two seeds' models."""
  return [float(p.detach()[:2].sum().cpu()) for p in list(model.parameters())[:4]]


def child(args):
  """One measurement in this process (--repeats runs of the operation); prints a JSON line."""
  import xladist.checkpoint as xc
  from xladist import runtime as _runtime
  from xladist.checkpoint import sharded

  sharded._dcp()  # DCP and torch_xla's planners imported before the clock starts
  model = _build(args.layers, args.width, seed=0 if args.op == "save" else 1)
  ckpt = xc.Checkpoint(model=model)
  times, peaks = [], []
  for _ in range(args.repeats):
    gc.collect()
    before = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if args.op == "save":
      ckpt.save(args.path, options=xc.CheckpointOptions(sharded=args.format == "sharded"))
    else:
      ckpt.restore(args.path)
      _runtime.sync()
      _runtime.wait()
    times.append(time.perf_counter() - t0)
    peaks.append(_status("VmHWM") - before)
  print(
    json.dumps(
      {
        "seconds": statistics.median(times),
        "times": times,
        "peak": max(peaks),
        "fingerprint": _fingerprint(model),
        "params": sum(p.numel() for p in model.parameters()),
      }
    ),
    flush=True,
  )


def _measure(args, op, fmt, layers, path):
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--child",
    op,
    "--format",
    fmt,
    "--layers",
    str(layers),
    "--width",
    str(args.width),
    "--path",
    path,
    "--repeats",
    str(args.repeats),
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
  if proc.returncode != 0:
    raise RuntimeError(f"{op} {fmt} {layers} layers failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _disk_bytes(path):
  if os.path.isdir(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
  return os.path.getsize(path)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="10,100,400", help="parameters in millions, comma-separated")
  p.add_argument("--width", type=int, default=2048)
  p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
  p.add_argument("--repeats", type=int, default=3, help="runs per measurement (median time)")
  p.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
  add_plot_argument(p)
  p.add_argument("--child", choices=("save", "restore"), dest="op", help=argparse.SUPPRESS)
  p.add_argument("--format", choices=FORMATS, help=argparse.SUPPRESS)
  p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
  p.add_argument("--path", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.op:
    child(args)
    return

  per_layer = args.width * args.width + args.width
  sizes = [float(s) for s in args.sizes.split(",")]
  root = args.dir or tempfile.mkdtemp(prefix="xladist-bench-checkpoint-")
  os.makedirs(root, exist_ok=True)
  devices = os.environ.get("CPU_NUM_DEVICES", "?")
  print(
    f"Linear({args.width}, {args.width}) stacks under MirroredStrategy on "
    f"{devices} XLA:CPU devices, fp32; one process per measurement; checkpoints in {root}"
  )
  header = (
    f"{'params':>8} {'format':>8} {'on disk':>9} {'save s':>7} {'save peak':>10} "
    f"{'restore s':>9} {'restore peak':>12} {'save GB/s':>9} {'restore GB/s':>12}"
  )
  print(header)
  rows = []
  t_start = time.perf_counter()
  for millions in sizes:
    layers = max(1, round(millions * 1e6 / per_layer))
    for fmt in FORMATS:
      path = os.path.join(root, f"m{layers}-{fmt}" + (".pt" if fmt == "file" else ""))
      save = _measure(args, "save", fmt, layers, path)
      disk = _disk_bytes(path)
      restore = _measure(args, "restore", fmt, layers, path)
      if restore["fingerprint"] != save["fingerprint"]:
        raise RuntimeError(f"{fmt}: the restored model is not the saved one")
      row = {
        "params": save["params"],
        "format": fmt,
        "disk": disk,
        "save_s": save["seconds"],
        "save_peak": save["peak"],
        "save_times": save["times"],
        "restore_times": restore["times"],
        "restore_s": restore["seconds"],
        "restore_peak": restore["peak"],
      }
      rows.append(row)
      print(
        f"{row['params'] / 1e6:>7.1f}M {fmt:>8} {disk / 2**20:>7.0f}MB {row['save_s']:>7.2f} "
        f"{row['save_peak'] / 2**20:>8.0f}MB {row['restore_s']:>9.2f} "
        f"{row['restore_peak'] / 2**20:>10.0f}MB {disk / row['save_s'] / 1e9:>9.2f} "
        f"{disk / row['restore_s'] / 1e9:>12.2f}",
        flush=True,
      )
      if os.path.isdir(path):
        shutil.rmtree(path)
      else:
        os.unlink(path)
  if not args.dir:
    shutil.rmtree(root, ignore_errors=True)
  print(
    f"times: median of {args.repeats} runs in the process; peak: how far the resident set "
    "rose above its size when an operation began (the largest of the runs)"
  )
  print(
    "all runs (s):", json.dumps([[r["format"], r["save_times"], r["restore_times"]] for r in rows])
  )
  print(f"total bench time {time.perf_counter() - t_start:.0f} s")
  if args.plot:
    print(f"wrote {plot(args.plot, rows, devices)}")


def plot(path, rows, devices):
  series_s, series_mb = {}, {}
  for fmt in FORMATS:
    mine = [r for r in rows if r["format"] == fmt]
    xs = [r["params"] / 1e6 for r in mine]
    series_s[f"save, {fmt}"] = (xs, [r["save_s"] for r in mine])
    series_s[f"restore, {fmt}"] = (xs, [r["restore_s"] for r in mine])
    series_mb[f"save, {fmt}"] = (xs, [r["save_peak"] / 2**20 for r in mine])
    series_mb[f"restore, {fmt}"] = (xs, [r["restore_peak"] / 2**20 for r in mine])
  base, ext = os.path.splitext(path)
  save_plot(
    path,
    f"Checkpoint save and restore time (XLA:CPU, {devices} device(s))",
    "parameters (millions)",
    "seconds",
    series_s,
    logx=True,
    logy=True,
  )
  memory = f"{base}-memory{ext or '.png'}"
  save_plot(
    memory,
    f"Peak host memory above the start (XLA:CPU, {devices} device(s))",
    "parameters (millions)",
    "MiB",
    series_mb,
    logx=True,
    logy=True,
  )
  return f"{path} and {memory}"


if __name__ == "__main__":
  main()
