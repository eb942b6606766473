"""A second clone tests its own code (issue 52).

The virtual environments live outside the clone (~/.cache/xladist, shared by every
clone and CI run) and hold an editable install of whichever clone installed last.
The Makefile puts its own clone first on every interpreter's path (`export
PYTHONPATH`) and checks it before the tests and the demo (`make own-code`). This
test makes a second clone of the committed tree and asks its Makefile which
xladist each environment imports there: the second clone's, although the
environments' editable install points at this clone. It also checks that the
check fails loudly when the path is forced back to this clone.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _make(clone, *args, env):
  return subprocess.run(
    ["make", "--no-print-directory", "-C", str(clone), *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_a_second_clone_imports_its_own_xladist(tmp_path):
  if shutil.which("make") is None or shutil.which("git") is None:
    pytest.fail("make and git are needed (.ci/run installs make)")
  if not (ROOT / ".git").exists():
    pytest.fail(f"{ROOT} is not a git clone")
  clone = tmp_path / "second-clone"
  subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
  env = dict(os.environ, XLADIST_VENV=sys.prefix)
  env.pop("MAKEFLAGS", None)
  env.pop("MAKELEVEL", None)
  # This interpreter's editable install (or this tree on its path) is this clone's.
  here = subprocess.run(
    [sys.executable, "-c", "import os, xladist; print(os.path.realpath(xladist.__file__))"],
    env={k: v for k, v in env.items() if k != "PYTHONPATH"},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert here.returncode == 0, here.stderr
  assert not here.stdout.strip().startswith(str(clone.resolve())), here.stdout

  out = _make(clone, "which-xladist", env=env)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.split()
  assert lines, out
  assert lines == [str(clone.resolve())] * len(lines), out.stdout
  assert _make(clone, "own-code", env=env).returncode == 0

  # Forced back to this clone, the check says so and fails.
  bad = _make(clone, "own-code", f"PYTHONPATH={ROOT}", env=env)
  assert bad.returncode != 0
  assert "imports xladist from" in bad.stderr and "not from this clone" in bad.stderr, bad.stderr
