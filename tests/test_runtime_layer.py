"""The runtime layer (issue 21): xladist imports without torch_xla, names the
missing runtime when a strategy starts it, and only the torch_xla runtime's
modules (runtime/xla*.py) import torch_xla (import-linter's contract in
pyproject.toml, run by `make lint`)."""

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


def _modules_above_the_runtime():
  import pathlib

  package = pathlib.Path(runtime.__file__).resolve().parent.parent
  for path in sorted(package.rglob("*.py")):
    if "runtime" not in path.relative_to(package).parts[:1]:
      yield path.relative_to(package.parent), path.read_text()


def test_layers_above_the_runtime_use_only_the_contract():
  """Issue 33: every name a module above xladist/runtime/ reads from the facade
  is an operation of the runtime contract (runtime/contract.py) or one of the
  facade's own runtime-independent names; none reaches a runtime's internals
  (torch_xla's bindings, torchax's arrays behind a tensor)."""
  import ast

  own = {"BACKEND", "backend", "call_with_timeout", "user_frame", "shares_storage", "initialize"}
  allowed = set(runtime.INTERFACE) | own
  found = {}
  for name, text in _modules_above_the_runtime():
    tree = ast.parse(text)
    aliases = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module == "xladist":
        aliases |= {a.asname or a.name for a in node.names if a.name == "runtime"}
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id in aliases:
          if node.attr not in allowed:
            found.setdefault(str(name), set()).add(node.attr)
        if node.attr in ("_elem", "_XLAC") or node.attr.startswith("_xla_"):
          found.setdefault(str(name), set()).add(node.attr)
  assert found == {}
  # the names of torch_xla's lazy-tensor idioms are gone from the facade too
  for old in ("ir_id", "tensor_id", "next_tensor_id", "native", "patched", "sync_count"):
    assert old not in allowed, old


def test_the_selected_runtime_fulfils_the_contract():
  from xladist.runtime import contract

  assert contract.missing(runtime.backend) == []
  assert set(runtime.INTERFACE) == {n for p in contract.PROTOCOLS for n in contract.operations(p)}
