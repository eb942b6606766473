"""Which tests end differently on a GPU than on one XLA:CPU device.

  python bench/gpu_tests_compare.py GPU_XML CPU_XML

Both files are pytest's --junitxml of the same selection: GPU_XML from
bench/gpu_check.sh on a lent GPU ($OUT/tests.xml), CPU_XML from the same command
run here on ONE XLA:CPU device (the suites assume 4 devices, so a test that fails on
one CPU device for that reason fails on one GPU too). Prints the counts of each
outcome on each, then every test whose outcome differs; exits 1 when a test that
passes on one CPU device does not pass on the GPU.
"""

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path):
  """{test id: 'passed' | 'failed' | 'error' | 'skipped'} from a junit XML."""
  out = {}
  for case in ET.parse(path).getroot().iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
    out[name] = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
      kinds[0] if kinds else None, "passed"
    )
  return out


def main(argv):
  if len(argv) != 3:
    sys.exit(__doc__)
  gpu, cpu = outcomes(argv[1]), outcomes(argv[2])
  for label, found in (("GPU", gpu), ("one CPU device", cpu)):
    print(f"{label}: " + ", ".join(f"{n} {k}" for k, n in sorted(Counter(found.values()).items())))
  differ = sorted(t for t in gpu.keys() | cpu.keys() if gpu.get(t) != cpu.get(t))
  for t in differ:
    print(f"  {t}: GPU {gpu.get(t, 'not run')}, one CPU device {cpu.get(t, 'not run')}")
  broken = [t for t in differ if cpu.get(t) == "passed" and gpu.get(t) not in (None, "passed")]
  print(f"{len(differ)} differ; {len(broken)} pass on one CPU device and not on the GPU")
  return 1 if broken else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
