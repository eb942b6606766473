#!/usr/bin/env bash
# The GPU check: run on a lent NVIDIA machine in ONE call of the device tool, from
# the repository root, with .gpu-wheels/ carried (`make gpu-wheels` fills it here):
#
#   run(command="bash bench/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=540)
#
# That machine has Python, torch, jax with its CUDA plugin and optax, and no network:
# the wheels it lacks (torchax, xladist's pure-Python dependencies, scikit-learn for
# the demo, pytest) come from .gpu-wheels/. It installs them, then runs the jax
# runtime's tests with JAX_PLATFORMS=cuda, the digits demo and the step benchmark
# (bench/gpu_step.py), each with a time limit, and writes one report:
# $OUT/report.md (the device tool's $OUT; ./gpu-report elsewhere), logs beside it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-report}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
REPORT="$OUT/report.md"
# GPU_CHECK_PLATFORM=cpu rehearses the script on a machine without a GPU (with
# GPU_CHECK_INSTALL=0 it leaves the environment as it is).
PLATFORM=${GPU_CHECK_PLATFORM:-cuda}
export XLADIST_BACKEND=jax JAX_PLATFORMS=$PLATFORM PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

section() { printf '\n## %s\n\n```\n' "$1" >> "$REPORT"; }
endsection() { printf '```\n' >> "$REPORT"; }

{
  echo "# xladist GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$REPORT"

section "machine and versions"
{
  nvidia-smi -L 2>&1 | head -8
  $PY - <<'PYEOF' 2>&1
import sys
print("python", sys.version.split()[0])
for name in ("torch", "jax", "jaxlib", "optax", "torchax"):
  try:
    print(name, __import__(name).__version__)
  except Exception as e:
    print(name, "not importable:", type(e).__name__, e)
import jax
print("jax devices:", jax.devices())
PYEOF
} >> "$REPORT"
endsection

section "install from .gpu-wheels"
if [ "${GPU_CHECK_INSTALL:-1}" = 0 ]; then
  echo "skipped (GPU_CHECK_INSTALL=0)" >> "$REPORT"
elif [ -d .gpu-wheels ]; then
  $PY -m pip install --quiet --no-index --find-links .gpu-wheels --no-deps torchax >> "$REPORT" 2>&1
  $PY -m pip install --quiet --no-index --find-links .gpu-wheels \
    optree cloudpickle tqdm scikit-learn pytest hypothesis >> "$REPORT" 2>&1
  echo "pip exit $?" >> "$REPORT"
  $PY -c 'import torchax; print("torchax", torchax.__version__)' >> "$REPORT" 2>&1
else
  echo "no .gpu-wheels/ carried (run make gpu-wheels here, carry it)" >> "$REPORT"
fi
endsection

section "jax runtime tests on CUDA (tests/unit, the torchax fixes and conversions, tests/shared)"
# The suites are written for 4 XLA:CPU devices (tests/conftest.py); CUDA has no
# virtual devices, so on one GPU every test that asserts 4 replicas fails. Each
# test's outcome goes to $OUT/tests.xml: `python bench/gpu_tests_compare.py
# <that xml> <xml of the same tests on ONE XLA:CPU device>` (GPU_CHECK_PLATFORM=cpu
# CPU_NUM_DEVICES=1 XLA_FLAGS=--xla_force_host_platform_device_count=1 here) names the
# tests whose outcome differs: what CUDA itself breaks.
timeout 270 $PY -m pytest -q -p no:cacheprovider -m "not ecosystem_matrix and not xla_depth" \
  tests/unit tests/runtime_jax/test_torchax_fixes.py tests/runtime_jax/test_torchax_conversions.py \
  tests/shared --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
echo "exit $?" >> "$REPORT"
tail -n 25 "$OUT/tests.log" >> "$REPORT"
endsection

section "digits demo (examples/train_digits.py)"
timeout 150 $PY examples/train_digits.py > "$OUT/demo.log" 2>&1
echo "exit $?" >> "$REPORT"
tail -n 15 "$OUT/demo.log" >> "$REPORT"
endsection

section "step benchmark (bench/gpu_step.py, one run)"
[ "$PLATFORM" = cuda ] && device=gpu || device=cpu
timeout 120 $PY bench/gpu_step.py --device "$device" --timeout 100 --out "$OUT/gpu_step.json" > "$OUT/bench.log" 2>&1
echo "exit $?" >> "$REPORT"
cat "$OUT/bench.log" >> "$REPORT"
endsection

cat "$REPORT"
