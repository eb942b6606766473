"""TF 2 semantics that must hold on every runtime: the acceptance suite run by
`make test` on torch_xla (the main suite) and on jax (`make test-jax`, with
XLADIST_BACKEND=jax), 4 replicas on 4 virtual CPU devices each time.

Public API only, and every expected value computed here with numpy or plain
torch on the CPU. The TF tests each case mirrors are named in its docstring
(tensorflow/python/distribute/...).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import xladist as xd
from xladist import runtime

N = 4


@pytest.fixture(scope="module")
def strategy():
  s = xd.MirroredStrategy()
  assert s.num_replicas_in_sync == N
  return s


def host(strategy, value):
  return [torch.as_tensor(v).detach().cpu() for v in strategy.experimental_local_results(value)]


def test_the_runtime_is_the_one_selected():
  import os

  assert runtime.BACKEND == (os.environ.get("XLADIST_BACKEND") or "torch_xla")


def test_replica_id_and_all_reduce(strategy):
  """strategy_common_test.py ReduceTest / mirrored_strategy_test.py
  testReplicaId: each replica's id; all_reduce SUM, MEAN, MAX, MIN."""

  def fn():
    ctx = xd.get_replica_context()
    x = (ctx.replica_id_in_sync_group + 1).float()
    return (
      ctx.replica_id_in_sync_group,
      ctx.all_reduce("sum", x),
      ctx.all_reduce("mean", x),
      ctx.all_reduce("max", x),
      ctx.all_reduce("min", x),
    )

  ids, s, m, mx, mn = strategy.run(fn)
  assert [int(v) for v in host(strategy, ids)] == list(range(N))
  vals = np.arange(1, N + 1, dtype=np.float32)
  for got, want in ((s, vals.sum()), (m, vals.mean()), (mx, vals.max()), (mn, vals.min())):
    assert [float(v) for v in host(strategy, got)] == [float(want)] * N


def test_merge_call_batch_reduce(strategy):
  """strategy_test_lib.py / cross_device_ops_test.py testBatchReduce: merge_fn
  reduces the replicas' values onto every replica."""

  def merge_fn(s, a, b):
    return s.extended.batch_reduce_to("sum", [(a, a), (b, b)])

  def fn():
    ctx = xd.get_replica_context()
    r = ctx.replica_id_in_sync_group.float()
    return ctx.merge_call(merge_fn, args=(r.repeat(2), r * r))

  a, b = strategy.run(fn)
  ids = np.arange(N, dtype=np.float32)
  for v in host(strategy, a):
    np.testing.assert_array_equal(v.numpy(), [ids.sum()] * 2)
  assert [float(v) for v in host(strategy, b)] == [float((ids**2).sum())] * N


def test_reduce_and_gather_of_per_replica(strategy):
  """strategy_common_test.py ReduceTest, GatherTest: strategy.reduce over the
  replicas and over the batch axis; strategy.gather concatenates."""
  pr = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.full((2,), float(ctx.replica_id_in_sync_group + 1))
  )
  ones = strategy.run(lambda x: x * 1, args=(pr,))
  vals = np.repeat(np.arange(1, N + 1, dtype=np.float32)[:, None], 2, axis=1)
  np.testing.assert_allclose(
    strategy.reduce("sum", ones, axis=None).cpu().numpy(), vals.sum(0), rtol=0, atol=0
  )
  np.testing.assert_allclose(
    strategy.reduce("mean", ones, axis=0).cpu().numpy(), vals.mean(), rtol=1e-7
  )
  np.testing.assert_array_equal(strategy.gather(ones, axis=0).cpu().numpy(), vals.reshape(-1))


def test_distributed_dataset_splits_the_global_batch(strategy):
  """input_lib_test.py (DistributedIteratorTest): each replica gets its slice
  of the global batch, in order."""
  data = torch.arange(16, dtype=torch.float32).reshape(8, 2)
  loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
  (batch,) = next(iter(strategy.experimental_distribute_dataset(loader)))
  parts = host(strategy, batch)
  for r, part in enumerate(parts):
    np.testing.assert_array_equal(part.numpy(), data[2 * r : 2 * r + 2].numpy())


def test_sync_on_read_variable(strategy):
  """values_test.py SyncOnReadVariableTest: each replica adds to its own
  component; a cross-replica read sums them."""
  with strategy.scope():
    v = xd.Variable(
      0.0, synchronization=xd.VariableSynchronization.ON_READ, aggregation="sum", name="total"
    )

  def fn():
    ctx = xd.get_replica_context()
    v.assign_add(ctx.replica_id_in_sync_group.float() + 1)

  strategy.run(fn)
  strategy.run(fn)
  assert float(v.read_value()) == pytest.approx(2 * sum(range(1, N + 1)))


def test_mirrored_variable_with_mean_aggregation(strategy):
  """mirrored_variable_test.py testAssignMirroredVarReplicaContext: assign in a
  replica context with MEAN writes the mean of the replicas' values."""
  with strategy.scope():
    v = xd.Variable(1.0, aggregation="mean", name="v")

  def fn():
    v.assign(xd.get_replica_context().replica_id_in_sync_group.float())

  strategy.run(fn)
  assert float(v.read_value()) == pytest.approx(np.arange(N).mean())


def test_training_step_equals_single_device(strategy):
  """mirrored_strategy_test.py (MirroredStrategyVariableCreationTest and the
  keras correctness tests): the step on N replicas equals one device on the
  global batch."""
  torch.manual_seed(1)
  ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
  with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
  ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
  x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
  dist = strategy.experimental_distribute_dataset(
    torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
  )

  def step(xb, yb):
    opt.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    return loss

  for _ in range(3):
    xb, yb = next(iter(dist))
    loss = strategy.reduce("mean", strategy.run(step, args=(xb, yb)), axis=None)
    ref_opt.zero_grad()
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    ref_opt.step()
    assert float(loss) == pytest.approx(ref_loss.item(), abs=1e-6)
  for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-6, rtol=1e-6)


def test_host_read_inside_run_is_refused(strategy):
  """TPUStrategy semantics (tpu_strategy_test.py): a traced value has no host
  value inside the step; the error says so and names the user's line."""

  def fn():
    r = xd.get_replica_context().replica_id_in_sync_group
    if r == 0:  # a Python branch on a traced tensor
      return r
    return r

  with pytest.raises(RuntimeError, match="read a traced tensor's value on the host"):
    strategy.run(fn)


def test_checkpoint_round_trip(strategy, tmp_path):
  """checkpoint_utils_test.py / tf.train.Checkpoint with a strategy: a saved
  and restored model has the saved values."""
  with strategy.scope():
    model = torch.nn.Linear(3, 2)
  saved = [p.detach().cpu().clone() for p in model.parameters()]
  ckpt = xd.checkpoint.Checkpoint(model=model)
  path = ckpt.write(str(tmp_path / "ckpt"))
  with torch.no_grad():
    for p in model.parameters():
      p.mul_(0)
  ckpt.restore(path)
  for p, q in zip(model.parameters(), saved):
    torch.testing.assert_close(p.detach().cpu(), q, atol=0, rtol=0)
