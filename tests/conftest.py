"""Test setup: 4 virtual XLA:CPU devices in this process, other counts in subprocesses."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
# Compilation counts are part of what the tests check: no persistent cache here
# (tests/test_runtime_defaults.py turns it on where it is the subject).
os.environ.setdefault("XLADIST_COMPILE_CACHE", "off")
# torch_xla keeps every compiled program in an in-memory cache, and each XLA:CPU
# executable holds hundreds to thousands of memory maps (one per JIT'd kernel): the
# suite's ~1,400 tests in one process passed Linux's 65,530 maps (vm.max_map_count)
# and XLA's next compile died with a segfault. A test uses far fewer than 64 programs.
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "64")
# XLA:CPU compiles the tests' programs cheaply (no costly LLVM passes; its older
# fusion emitters where it has them): tests/_xla_flags.py. Subprocesses inherit it.
from _xla_flags import with_cheap_codegen  # noqa: E402

os.environ["XLA_FLAGS"] = with_cheap_codegen(os.environ.get("XLA_FLAGS", ""))

import pytest  # noqa: E402
import torch  # noqa: E402

import xladist as xd  # noqa: E402


@pytest.fixture
def strategy():
  """A MirroredStrategy over the process's 4 XLA:CPU devices."""
  s = xd.MirroredStrategy()
  assert s.num_replicas_in_sync == 4
  return s


@pytest.fixture
def per_replica(strategy):
  """Builds a PerReplica from a function of the replica id."""

  def make(fn):
    return strategy.experimental_distribute_values_from_function(
      lambda ctx: fn(ctx.replica_id_in_sync_group)
    )

  return make


def local_values(strategy, value):
  """The per-replica components of `value`, read back to the host."""
  return [torch.as_tensor(v).detach().cpu() for v in strategy.experimental_local_results(value)]


# `pytest --hypothesis-profile=debug`: no shrinking, for a quick look at a failure.
from hypothesis import Phase, settings  # noqa: E402

settings.register_profile("debug", phases=[Phase.explicit, Phase.generate])
