"""The jax runtime beside plain torch in one process, and what it refuses.

torchax's modes are on for the whole process once a strategy starts the jax
runtime, so host (CPU) torch must keep its own meaning there (a reference model,
a deepcopy), and what the runtime does not support must say so by name.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import xladist as xd
from xladist import runtime

pytestmark = pytest.mark.skipif(
  runtime.BACKEND != "jax", reason="tests/runtime_jax runs on the jax runtime (make test-jax)"
)


@pytest.fixture(scope="module")
def strategy():
  return xd.MirroredStrategy()


def test_cpu_torch_beside_the_runtime(strategy):
  """torchax fix 7: host ops are torch's own while the runtime's modes are on."""
  torch.manual_seed(0)
  cpu = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU())
  twin = copy.deepcopy(cpu)  # storage clones: no torchax lowering exists for them
  x = torch.randn(2, 2, 6, 6)
  cpu(x).sum().backward()
  twin(x).sum().backward()
  assert type(cpu[0].weight.grad) is torch.Tensor
  torch.testing.assert_close(cpu[0].weight.grad, twin[0].weight.grad, atol=0, rtol=0)


def test_data_is_a_new_tensor_over_the_same_array(strategy):
  """torchax fix 6: `saved = t.data; t.data = other; t.data = saved` restores t."""
  with strategy.scope():
    lin = torch.nn.Linear(2, 2)
  w = lin.weight
  saved = w.data
  assert saved is not w
  before = w.detach().cpu().clone()
  w.data = torch.zeros(2, 2).to(runtime.device())
  assert float(w.detach().cpu().abs().sum()) == 0.0
  w.data = saved
  torch.testing.assert_close(w.detach().cpu(), before, atol=0, rtol=0)


def test_per_replica_dropout_masks_differ_and_follow_the_global_draw(strategy):
  """Each replica its own rows of one global draw (_step/seeds.py), on jax too."""

  def fn():
    ones = torch.ones(8, device=runtime.device())
    return F.dropout(ones, 0.5, training=True)

  masks = [t.cpu() for t in strategy.experimental_local_results(strategy.run(fn))]
  assert len({tuple(m.tolist()) for m in masks}) > 1
  for m in masks:
    assert set(m.tolist()) <= {0.0, 2.0}


def test_what_the_runtime_refuses_is_named():
  assignment = xd.experimental.DeviceAssignment.build(computation_shape=[2], num_replicas=2)
  with pytest.raises(NotImplementedError, match="several devices per replica"):
    xd.TPUStrategy(experimental_device_assignment=assignment)
  with pytest.raises(RuntimeError, match="sharded checkpoints"):
    runtime.checkpoint_planners()
  with pytest.raises(NotImplementedError, match="CentralStorageStrategy does not run on the jax"):
    xd.experimental.CentralStorageStrategy()
  with pytest.raises(NotImplementedError, match="ParameterServerStrategy does not run on the jax"):
    xd.experimental.ParameterServerStrategy()
