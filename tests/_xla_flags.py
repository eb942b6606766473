"""XLA_FLAGS for the tests' processes (tests/conftest.py puts them in this process's
environment; the processes a test starts inherit them).

XLA:CPU compiles the tests' programs without LLVM's costly optimizations, and with
its older fusion emitters (XLA's LLVM IR emitters, not the MLIR ones) where its
version has them: the same HLO, the same ops and collectives, less CPU time
(docs/testing.md: the torch_xla suite alone 630 CPU-s with the MLIR emitters, 475
with the older ones). torch_xla 2.9's XLA and jaxlib 0.10's have the flag (checked);
jaxlib 0.12's has only the MLIR emitters and aborts on it. `XLADIST_TEST_XLA_OPT=1`
keeps XLA's defaults; `XLADIST_TEST_DEFAULT_EMITTERS=1` only the default emitters.
"""

import importlib.metadata
import os

CHEAP_CODEGEN = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_DEVICE_COUNT = "--xla_force_host_platform_device_count="


def _has_older_emitters():
  """Whether this process's XLA takes OLDER_EMITTERS: torch_xla's (the default
  runtime), or jaxlib's before 0.11 on the jax runtime."""
  if os.environ.get("XLADIST_BACKEND", "") != "jax":
    return True
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return False
  return tuple(int(p) for p in version.split(".")[:2]) < (0, 11)


def default_emitters():
  """Whether this process's XLA:CPU uses its default fusion emitters."""
  return OLDER_EMITTERS not in os.environ.get("XLA_FLAGS", "").split()


def with_cheap_codegen(flags):
  """`flags` (an XLA_FLAGS string) with CHEAP_CODEGEN added (and OLDER_EMITTERS
  where XLA has them), unless XLADIST_TEST_XLA_OPT=1."""
  parts = (flags or "").split()
  if os.environ.get("XLADIST_TEST_XLA_OPT", "") == "1":
    return " ".join(parts)
  cheap = list(CHEAP_CODEGEN)
  if os.environ.get("XLADIST_TEST_DEFAULT_EMITTERS", "") != "1" and _has_older_emitters():
    cheap.append(OLDER_EMITTERS)
  return " ".join(parts + [f for f in cheap if f not in parts])


def for_child(devices=None):
  """XLA_FLAGS for a child process: this process's, without its virtual device count
  (a jax child takes `CPU_NUM_DEVICES`, or `devices` here), with CHEAP_CODEGEN."""
  parts = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
  if devices is not None:
    parts.append(f"{_DEVICE_COUNT}{devices}")
  return with_cheap_codegen(" ".join(parts))


def default_emitters_env():
  """The environment of a child process that uses XLA:CPU's default fusion
  emitters: this process's, without OLDER_EMITTERS (its conftest adds them no more)."""
  env = dict(os.environ, XLADIST_TEST_DEFAULT_EMITTERS="1")
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != OLDER_EMITTERS)
  return env
