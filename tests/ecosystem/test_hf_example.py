"""examples/train_hf_causal_lm.py end to end in a subprocess, on the runtime of this
run (torch_xla, or jax in the jax environments): a transformers causal LM made with
`AutoModelForCausalLM.from_config`, AdamW with a warm-up schedule, trained by
`strategy.run`; its loss falls and its steps replay after the first three."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "examples" / "train_hf_causal_lm.py"
STEPS = 12
TINY = ["--steps", str(STEPS), "--per-replica-batch", "2", "--seq-len", "16", "--dim", "16"]
TINY += ["--layers", "1", "--heads", "2", "--chars", "20000", "--warmup", "2", "--lr", "1e-2"]
TINY += ["--log-every", "1"]


def test_the_causal_lm_example_trains_and_replays(tmp_path):
  summary = tmp_path / "summary.json"
  env = dict(os.environ, XLADIST_COMPILE_CACHE="off")
  proc = subprocess.run(
    [sys.executable, str(SCRIPT), *TINY, "--summary", str(summary)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(summary.read_text())
  losses = [loss for _, loss in result["losses"]]
  assert [s for s, _ in result["losses"]] == list(range(1, STEPS + 1))
  assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
  assert result["traced"] == 3 and result["replayed"] == STEPS - 3, result
  assert f"steps traced 3, replayed {STEPS - 3}" in proc.stdout
