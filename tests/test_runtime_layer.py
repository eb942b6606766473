"""The runtime layer (issue 21): xladist imports without torch_xla, names the
missing runtime when a strategy starts it, and only runtime/xla.py imports
torch_xla (import-linter's contract in pyproject.toml, run by `make lint`)."""

import os
import subprocess
import sys

import xladist.runtime as runtime

_BLOCK = """
import sys
class _NoTorchXla:
  def find_spec(self, name, path=None, target=None):
    if name == "torch_xla" or name.startswith("torch_xla."):
      raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
    return None
sys.meta_path.insert(0, _NoTorchXla())
"""


_NO_JAX = """
class _NoJax:
  def find_spec(self, name, path=None, target=None):
    if name in ("jax", "torchax") or name.startswith(("jax.", "torchax.")):
      raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
    return None
sys.meta_path.insert(0, _NoJax())
"""


def _run(code, **env):
  out = subprocess.run(
    [sys.executable, "-c", _BLOCK + code],
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, **env),
  )
  return out.returncode, out.stdout + out.stderr


_NAMES_MISSING = (
  "import xladist as xd, xladist.checkpoint, xladist.coordinator, "
  "xladist.cluster_resolver, xladist.experimental\n"
  "assert 'torch_xla' not in sys.modules\n"
  "print('imported', xd.runtime.BACKEND)\n"
  "try:\n"
  "  xd.MirroredStrategy()\n"
  "except RuntimeError as e:\n"
  "  print('error:', e)\n"
)


def test_import_xladist_works_without_torch_xla_and_a_strategy_names_it():
  rc, out = _run(_NAMES_MISSING, XLADIST_BACKEND="torch_xla")
  assert rc == 0, out
  assert "imported torch_xla" in out
  assert "error: xladist: the torch_xla runtime" in out
  assert "needs torch_xla, which cannot be imported here" in out
  assert "torch==2.9.0 torch_xla==2.9.0" in out


def test_without_torch_xla_the_default_is_jax_and_a_missing_jax_is_named():
  """This environment has no jax: with torch_xla blocked, neither runtime is there."""
  env = {k: v for k, v in os.environ.items() if k != "XLADIST_BACKEND"}
  out = subprocess.run(
    [sys.executable, "-c", _BLOCK + "import builtins\n" + _NO_JAX + _NAMES_MISSING],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )
  text = out.stdout + out.stderr
  assert out.returncode == 0, text
  assert "imported jax" in text
  assert "the jax runtime (chosen because torch_xla is not installed either)" in text
  assert "'xladist[xla]'" in text and "'xladist[jax]'" in text


def test_an_unknown_backend_is_refused_when_a_strategy_starts():
  rc, out = _run(
    "import xladist as xd\n"
    "try:\n"
    "  xd.MirroredStrategy()\n"
    "except RuntimeError as e:\n"
    "  print('error:', e)\n",
    XLADIST_BACKEND="cuda",
  )
  assert rc == 0, out
  assert "XLADIST_BACKEND='cuda' names no runtime of this release" in out


def test_the_facade_binds_every_name_of_the_interface_from_the_backend():
  from xladist.runtime import xla

  for name in runtime.INTERFACE:
    assert hasattr(runtime, name), name
    if name != "initialize":
      assert getattr(runtime, name) is getattr(xla, name), name
  assert runtime.BACKEND in runtime.BACKENDS
