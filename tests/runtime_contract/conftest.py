"""Fixtures of the runtime contract's tests (tests/runtime_contract/).

The tests say, operation by operation, what a runtime must do
(xladist/runtime/contract.py), through the facade `xladist.runtime` and public
xladist API only, so that the same files run on every runtime: `make test` on
torch_xla (tests/conftest.py gives it 4 XLA:CPU devices) and, in the jax
environment, `XLADIST_BACKEND=jax` (4 CPU devices from the same variables).
"""

import pytest
import torch

import xladist as xd
from xladist import runtime

N = 4  # replicas (and devices) of the test process


@pytest.fixture(scope="module", autouse=True)
def started():
  """The runtime, started (what a strategy does first)."""
  runtime.initialize()


@pytest.fixture(scope="module")
def strategy():
  """One MirroredStrategy over the process's 4 devices per test module."""
  s = xd.MirroredStrategy()
  assert s.num_replicas_in_sync == N
  return s


@pytest.fixture
def host():
  """`host(t)`: the host (CPU) copy of one device tensor."""

  def read(t):
    (out,) = runtime.to_host([t])
    return out

  return read


@pytest.fixture
def local_results(strategy):
  """`local_results(value)`: a step result's per-replica components, stacked on
  the host (one row per replica)."""

  def read(value):
    parts = list(strategy.experimental_local_results(value))
    parts = [p if isinstance(p, torch.Tensor) else torch.as_tensor(p) for p in parts]
    on_device = [p for p in parts if runtime.is_device_tensor(p)]
    copies = iter(runtime.to_host(on_device) if on_device else ())
    return torch.stack([next(copies) if runtime.is_device_tensor(p) else p for p in parts])

  return read
