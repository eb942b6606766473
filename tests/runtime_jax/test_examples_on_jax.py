"""Both examples, unchanged, on the jax runtime in this environment (no torch_xla):
examples/train_digits.py (8 epochs) and examples/train_charlm.py (shortened by
its flags, the same as tests/test_examples.py gives it on torch_xla). Each runs in
a child process with XLADIST_BACKEND=jax and 4 virtual CPU devices."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import _xla_flags  # noqa: E402
import test_examples  # noqa: E402  (the shortened charlm flags)


def _run(args, timeout=300):
  assert importlib.util.find_spec("torch_xla") is None, "the jax environment has no torch_xla"
  env = dict(
    os.environ,
    XLADIST_BACKEND="jax",
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=_xla_flags.for_child(4),
    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
  )
  proc = subprocess.run(
    [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
  )
  assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
  return proc.stdout


def test_digits_demo_trains_on_jax():
  out = _run([str(ROOT / "examples" / "train_digits.py"), "--epochs", "8"])
  accuracy = float(re.search(r"held-out accuracy: (\S+)", out).group(1))
  assert accuracy >= 0.95, out  # the demo's own bar, after 8 of its 20 epochs
  assert "jax" in out, out  # the summary names the runtime it ran on


def test_charlm_trains_on_jax(tmp_path):
  summary = tmp_path / "summary.json"
  _run(
    [str(test_examples.SCRIPT), *test_examples.TINY]
    + ["--checkpoint-dir", str(tmp_path / "ckpt"), "--summary", str(summary)]
  )
  result = json.loads(summary.read_text())
  assert result["step"] == 2 * test_examples.N, result
  # Trained a little: finite, and better than guessing uniformly over the vocabulary.
  assert math.isfinite(result["perplexity"]) and 1 < result["perplexity"] < result["vocab"], result
