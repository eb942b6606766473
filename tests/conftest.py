"""Test setup: 4 virtual XLA:CPU devices in this process, other counts in subprocesses."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
# Compilation counts are part of what the tests check: no persistent cache here
# (tests/test_runtime_defaults.py turns it on where it is the subject).
os.environ.setdefault("XLADIST_COMPILE_CACHE", "off")
# XLA:CPU compiles the tests' programs cheaply (no costly LLVM passes; its older
# fusion emitters where it has them): tests/_xla_flags.py. Subprocesses inherit it.
from _xla_flags import with_cheap_codegen  # noqa: E402

os.environ["XLA_FLAGS"] = with_cheap_codegen(os.environ.get("XLA_FLAGS", ""))

import pytest  # noqa: E402
import torch  # noqa: E402

import xladist as xd  # noqa: E402

# Files whose tests run several processes at once (a parameter-server cluster, two
# checkpointing hosts, a chief and a worker) run last in their suite: `make test` runs
# three suites on two cores, the last one to end runs alone, and these use both cores
# where an in-process test would leave one idle (docs/testing.md). Order within a file
# is kept; no test depends on another file's.
_SEVERAL_PROCESSES_AT_ONCE = (
  "test_parameter_server.py",
  "test_checkpoint_sharded.py",
  "test_multiprocess.py",
)


def pytest_collection_modifyitems(items):
  items.sort(key=lambda item: item.path.name in _SEVERAL_PROCESSES_AT_ONCE)


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
