"""README.md's runnable blocks, unchanged, on the jax runtime (issue 31): the same
child process as tests/test_readme.py runs them in on torch_xla, in this
environment (which has no torch_xla), with XLADIST_BACKEND=jax and 4 virtual CPU
devices; the same checks of what they print."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _xla_flags  # noqa: E402
import test_readme  # noqa: E402  (tests/test_readme.py: the blocks and the checks)


def test_marked_blocks_run_unchanged_on_jax(tmp_path):
  assert importlib.util.find_spec("torch_xla") is None, "the jax environment has no torch_xla"
  test_readme.run_marked_blocks(
    tmp_path,
    {
      "XLADIST_BACKEND": "jax",
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": _xla_flags.for_child(4),
      "JAX_DEFAULT_MATMUL_PRECISION": "highest",
    },
  )


if __name__ == "__main__":
  sys.exit(pytest.main([__file__]))
