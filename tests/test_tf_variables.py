"""TF 2's variable semantics, case by case, each mirroring the TF test it cites.

TF sources: tensorflow/python/distribute/{values.py, values_util.py,
distribute_utils.py, mirrored_strategy.py} and the tests named in each docstring.
"""

import copy
import re

import pytest
import torch
from conftest import local_values

import xladist as xd
from xladist.runtime import xla as _runtime

VS, VA = xd.VariableSynchronization, xd.VariableAggregation


def _components(strategy, v):
  return [float(torch.as_tensor(c).cpu()) for c in strategy.experimental_local_results(v)]


def _rid():
  return xd.get_replica_context().replica_id_in_sync_group


def test_sum_write_of_a_non_distributed_value_in_replica_context_raises(strategy):
  """mirrored_strategy_test.py MirroredVariableUpdateTest.
  testAssignMirroredVarReplicaContextWithSum: assign(5.0) of a SUM mirrored
  variable in a replica context raises "A non-DistributedValues value 5.0 cannot
  be reduced with the given reduce op ReduceOp.SUM" (cross_device_ops.
  reduce_non_distributed_value) instead of adding it N times; a value computed
  in the step is each replica's own and is summed (vars_test.py
  OnWriteVariableSync.testAssignPerReplicaVal)."""
  with strategy.scope():
    v = xd.Variable(1.0, aggregation="sum")
  for value in (5.0, torch.tensor(5.0)):
    for method in ("assign", "assign_add", "assign_sub"):
      with pytest.raises(
        ValueError,
        match=r"a non-DistributedValues value .* cannot be "
        r"reduced with ReduceOp\.SUM",
      ):
        strategy.run(lambda: getattr(v, method)(value))
  assert v.value.item() == 1.0  # nothing was written
  strategy.run(lambda: v.assign(_rid().float() + 1))  # 1 + 2 + 3 + 4
  assert v.value.item() == 10.0
  assert _components(strategy, v) == [10.0] * 4


def test_mean_and_first_replica_writes_of_a_single_value(strategy):
  """mirrored_strategy_test.py MirroredVariableUpdateTest.
  testAssignMirroredVarReplicaContextWithSingleValue (MEAN, assign(5.0) -> 5.0),
  testAssignAddMirroredVarReplicaContextWithSingleValue (6.0),
  testAssignSubMirroredVarReplicaContextWithSingleValue (4.0),
  testAssignMirroredVarReplicaContext (assign(replica_id) -> 0.5 of 2 replicas:
  here 1.5 of 4), and vars_test.py OnWriteVariableSync.testAggregationOnlyFirstReplica."""
  with strategy.scope():
    a = xd.Variable(1.0, aggregation="mean")
    b = xd.Variable(5.0, aggregation="mean")
    c = xd.Variable(1.0, aggregation="mean")
    first = xd.Variable(3.0, aggregation=VA.ONLY_FIRST_REPLICA)

  def step():
    a.assign_add(5.0)
    b.assign_sub(1.0)
    c.assign(_rid().float())
    first.assign_add(_rid().float() * 7 + 7)

  strategy.run(step)
  assert (a.value.item(), b.value.item(), c.value.item(), first.value.item()) == (
    6.0,
    4.0,
    1.5,
    10.0,
  )
  assert _components(strategy, first) == [10.0] * 4


def test_fresh_on_read_sum_reads_n_times_and_update_assigns_each_component(strategy):
  """mirrored_variable_test.py MirroredVariableCreationTest.testSyncOnReadVariableUpdate:
  an ON_READ SUM variable made with 1.0 reads 2.0 on 2 replicas (every
  component starts at 1.0); extended.update(v, assign, 5.0) sets each
  component to 5 and the read is 5 * N. mirrored_strategy_test.py
  SyncOnReadVariableAssignTest.testAssignReplicaLocalVarSumAggregation: a
  cross-replica assign(6.0) reads 6.0 (each component 6 / N)."""
  with strategy.scope():
    v = xd.Variable(1.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
  assert v.value.item() == 4.0
  assert strategy.extended.read_var(v).item() == 4.0
  assert _components(strategy, v) == [1.0] * 4
  out = strategy.extended.update(v, lambda c, x: c.assign(x), args=(5.0,), group=False)
  assert isinstance(out, tuple) and len(out) == 4
  assert _components(strategy, v) == [5.0] * 4
  assert v.value.item() == 20.0
  v.assign(6.0)
  assert v.value.item() == 6.0
  assert _components(strategy, v) == [1.5] * 4


def test_tower_local_var_scope_docstring_matches_the_code(strategy):
  """The docstring of tower_local_var_scope says every replica starts from the
  same initial value; for SUM the cross-replica read is then N times it
  (MirroredExtended._get_variable_creator_initial_value)."""
  assert "Every replica starts from the same initial value" in (
    strategy.tower_local_var_scope.__doc__
  )
  with strategy.scope():
    with strategy.tower_local_var_scope("sum"):
      v = xd.Variable(torch.tensor([1.0, 2.0]))
  comps = torch.stack(strategy.experimental_local_results(v)).cpu()
  torch.testing.assert_close(comps, torch.tensor([[1.0, 2.0]] * 4), rtol=0, atol=0)
  torch.testing.assert_close(v.value.cpu(), torch.tensor([4.0, 8.0]), rtol=0, atol=0)


def test_sync_on_read_components_survive_between_steps(strategy):
  """mirrored_variable_test.py MirroredVariableCreationTest.testSyncOnReadVariable:
  each replica keeps its own component (SUM 1 + 2 + id, MEAN 6 * id) and the
  cross-replica read is their sum / mean. Here over two steps: the second
  starts from each replica's own component, not from the aggregate."""
  with strategy.scope():
    total = xd.Variable(1.0, synchronization="on_read", aggregation="sum")
    mean = xd.Variable(4.0, synchronization="on_read", aggregation="mean")

  def step():
    total.assign_add(2.0 + _rid().float())
    mean.assign(6.0 * _rid().float() + mean.value)
    return total.value * 1

  out = strategy.run(step)
  assert [t.item() for t in local_values(strategy, out)] == [3.0, 4.0, 5.0, 6.0]
  assert total.value.item() == 18.0 and mean.value.item() == 13.0
  out = strategy.run(step)
  assert [t.item() for t in local_values(strategy, out)] == [5.0, 7.0, 9.0, 11.0]
  assert _components(strategy, mean) == [4.0, 16.0, 28.0, 40.0]
  assert total.value.item() == 32.0 and mean.value.item() == 22.0


def test_restored_sum_variable_spreads_its_value(strategy, tmp_path):
  """values_test.py SyncOnReadVariableTest.testSaveAndRestoreReplicaLocalSumOneGraph:
  components [3, 4] save 7; after other writes, restoring gives [3.5, 3.5]
  (values_util.get_on_read_restore_ops divides SUM by N). Here 4 replicas."""
  import xladist.checkpoint as xc

  with strategy.scope():
    v = xd.Variable(0.0, synchronization="on_read", aggregation="sum")
  strategy.run(lambda: v.assign(_rid().float() + 3))  # 3, 4, 5, 6
  ckpt = xc.Checkpoint(v=v)
  ckpt.save(tmp_path / "c.pt")
  assert xc.read(tmp_path / "c.pt")["objects"]["v"]["value"]["value_"].item() == 18.0
  strategy.run(lambda: v.assign_add(_rid().float()))
  ckpt.restore(tmp_path / "c.pt")
  assert v.value.item() == 18.0
  assert _components(strategy, v) == [4.5] * 4


def test_writes_outside_a_step_reach_the_components(strategy):
  """vars_test.py OnReadVariableSyncTest.testAssignWithAggregationSum (a
  cross-replica write is spread over the components) for writes that are not
  Variable.assign: load_state_dict, a BatchNorm forward in cross-replica context
  (torch_xla's kernel bumps no counter), reset_running_stats."""
  with strategy.scope():
    bn = torch.nn.BatchNorm1d(2)
  x = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.full((2, 2), float(ctx.replica_id_in_sync_group))
  )
  strategy.run(lambda t: bn(t), args=(x,))
  comps = torch.stack(strategy.experimental_local_results(bn.running_mean)).cpu()
  torch.testing.assert_close(
    comps, torch.tensor([[0.0, 0.0], [0.1, 0.1], [0.2, 0.2], [0.3, 0.3]]), rtol=1e-5, atol=1e-8
  )
  with torch.no_grad():  # momentum 0.1 from the mean of the components, 0.15
    bn(torch.full((4, 2), 100.0, device=_runtime.device()))
  torch.testing.assert_close(bn.running_mean.cpu(), torch.full((2,), 10.135), rtol=1e-5, atol=1e-8)
  torch.testing.assert_close(
    torch.stack(strategy.experimental_local_results(bn.running_mean)).cpu(),
    torch.full((4, 2), 10.135),
    rtol=1e-5,
    atol=1e-8,
  )
  bn.reset_running_stats()
  assert torch.stack(strategy.experimental_local_results(bn.running_var)).cpu().eq(1).all()
  bn.load_state_dict({**bn.state_dict(), "running_mean": torch.tensor([2.0, 3.0])})
  comps = torch.stack(strategy.experimental_local_results(bn.running_mean)).cpu()
  torch.testing.assert_close(comps, torch.tensor([[2.0, 3.0]] * 4), rtol=0, atol=0)


def test_replaced_sync_on_read_tensor_of_another_shape_raises(strategy):
  """A write outside a step that cannot be spread over the components (a new
  shape) raises instead of guessing."""
  with strategy.scope():
    bn = torch.nn.BatchNorm1d(2)
  bn.running_mean.data = torch.zeros(3, device=_runtime.device())
  x = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(2, 2))
  with pytest.raises(
    RuntimeError,
    match=re.escape(
      "BatchNorm1d.running_mean (shape (3,)) was replaced outside strategy.run by a "
      "tensor of shape (3,)"
    ),
  ):
    strategy.run(lambda t: bn(t), args=(x,))


def test_none_synchronization_is_refused_under_mirrored_and_tpu_strategy():
  """mirrored_variable_test.py MirroredVariableCreationTest.
  testNoneSynchronizationWithVariable: "`NONE` variable synchronization mode is
  not supported with ..." (distribute_utils._validate_synchronization); the
  one-device and default strategies accept it."""
  for s in (xd.MirroredStrategy(), xd.TPUStrategy()):
    with s.scope():
      with pytest.raises(
        ValueError,
        match=re.escape(
          f"`NONE` variable synchronization mode is not supported with {type(s).__name__}"
        ),
      ):
        xd.Variable(1.0, synchronization=VS.NONE, name="v")
  with xd.OneDeviceStrategy("cpu").scope():
    assert xd.Variable(1.0, synchronization="none").synchronization is VS.NONE
  assert xd.Variable(1.0, synchronization="none").value.item() == 1.0


def test_aggregation_none_mirrored_write_in_replica_context_writes_each_copy(strategy):
  """mirrored_strategy_test.py MirroredVariableUpdateTest.
  testAssignMirroredVarReplicaContextWithoutAggregationType: current TF 2 lets
  each replica write its own component (values._on_write_update_replica), no
  error; vars_test.py OnWriteVariableSyncScatterTests.testScatterOpsWithNoneAggregation."""
  with strategy.scope():
    v = xd.Variable(1.0)
  strategy.run(lambda: v.assign(5.0))
  assert v.value.item() == 5.0
  strategy.run(lambda: v.assign_add(_rid().float()))
  assert _components(strategy, v) == [5.0, 6.0, 7.0, 8.0]
  assert v.value.item() == 5.0  # the first replica's copy


def test_variable_attributes_as_tf(strategy):
  """distributed_variable_test.py DistributedVariableTest.testSaveNonDistributed
  (ON_READ with trainable=True is accepted), values_test.py
  SyncOnReadVariableTest.testProperties (constraint, name), mirrored_variable_test.py
  MirroredVariableCreationTest.testVarDistributeStrategy."""
  with strategy.scope():
    r = xd.Variable(1.0, synchronization="on_read", aggregation="mean", trainable=True, name="r")
    clip = xd.Variable(torch.tensor([0.5, -2.0]), constraint=lambda t: t.clamp(-1, 1))
  plain = xd.Variable(2.0)
  assert r.trainable and r.name == "r" and r.constraint is None
  assert r.distribute_strategy is strategy and clip.distribute_strategy is strategy
  assert plain.distribute_strategy is xd.get_strategy()
  # The constraint is applied after an optimizer's update (as TF's optimizers do).
  with strategy.scope():
    opt = torch.optim.SGD(clip.parameters(), lr=1.0)

  def step():
    opt.zero_grad()
    (clip.value * torch.tensor([-4.0, 0.0], device=clip.value.device)).sum().backward()
    opt.step()

  strategy.run(step)
  torch.testing.assert_close(clip.value.cpu(), torch.tensor([1.0, -1.0]), rtol=0, atol=0)
  with pytest.raises(TypeError, match="constraint"):
    xd.Variable(1.0, constraint=3)


def test_deepcopy_of_a_variable_is_a_variable_of_the_same_strategy(strategy):
  """distributed_variable_test.py DistributedVariableTest.testDeepCopy: the copy
  has the same type, aggregation and distribute_strategy, a distinct policy,
  equal values and its own components; deep-copying under another strategy's
  scope raises ("Mixing different ...")."""
  with strategy.scope():
    v = xd.Variable(1.0, synchronization="on_read", aggregation="sum")
  strategy.run(lambda: v.assign(_rid().float()))
  c = copy.deepcopy(v)
  assert isinstance(c, xd.Variable) and c.aggregation is VA.SUM
  assert c.distribute_strategy is strategy and c._policy is not v._policy
  assert strategy.extended.variable_created_in_scope(c)
  assert _components(strategy, c) == [0.0, 1.0, 2.0, 3.0] == _components(strategy, v)
  strategy.run(lambda: c.assign_add(1.0))
  assert _components(strategy, v) == [0.0, 1.0, 2.0, 3.0]
  assert c.value.item() == 10.0
  with xd.OneDeviceStrategy("cpu").scope():
    with pytest.raises(RuntimeError, match="mixing different strategies"):
      copy.deepcopy(v)


def test_mirrored_operators_behave_as_the_value(strategy):
  """mirrored_values_test.py MirroredTest.testAddOp (m + m = 6, m + 1 = 4, the
  same as math_ops.add(m, 1)) and values_test.py DistributedDelegateTest.
  testOperatorOverride / testGetAttr; values_test.py PerReplicaTest.
  testUsePerReplicaInvalidContextGivesError (a PerReplica used as a tensor
  outside a replica context raises ValueError)."""
  m = xd.Mirrored([torch.tensor(3.0)] * 4)
  assert (m + m).item() == 6.0 and (m + 1).item() == 4.0 and (1 + m).item() == 4.0
  assert torch.add(m, 1).item() == 4.0 and (-m).item() == -3.0 and (m**2).item() == 9.0
  assert (m > 2).item() and m.shape == () and m.dtype == torch.float32
  v = xd.Mirrored([torch.tensor([7.0, 8.0])] * 2)
  assert v[1].item() == 8.0 and (v @ v).item() == 113.0
  with pytest.raises(ValueError, match="PerReplica .* outside a replica context"):
    torch.add(xd.PerReplica([torch.tensor(1.0)] * 2), 1)


def test_variable_created_inside_run_is_updated_in_the_same_step(strategy):
  """mirrored_variable_test.py MirroredVariableCreationTest.testSyncOnReadVariable
  (ON_READ variables created and updated in the same replica function) and
  testSingleVariable; vars_test.py testInitializedToSameValueInsideEagerRun
  (components start equal, from replica 0's value)."""
  made = []

  def step(x):
    with strategy.scope():
      count = xd.Variable(0.0, synchronization="on_read", aggregation="sum")
      mirrored = xd.Variable(x * 0 + 10, aggregation="mean")
    made.extend([count, mirrored])
    count.assign_add(_rid().float() + 1)
    mirrored.assign_add(x)
    return mirrored.value * 1

  x = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group))
  )
  out = strategy.run(step, args=(x,))
  count, mirrored = made
  assert count.value.item() == 10.0
  assert _components(strategy, count) == [1.0, 2.0, 3.0, 4.0]
  assert mirrored.value.item() == 11.5  # 10 (replica 0's initial value) + mean(0..3)
  assert [t.item() for t in local_values(strategy, out)] == [11.5] * 4
  assert strategy.extended.variable_created_in_scope(count)
  strategy.run(lambda: count.assign_add(1.0))  # and it is a variable of later steps
  assert count.value.item() == 14.0


def test_sync_on_read_none_aggregation_has_no_cross_replica_value(strategy):
  """vars_test.py OnReadVariableSyncTest.testReadValueWithAggregationNoneInCrossReplicaContext:
  reading an ON_READ NONE variable in cross-replica context raises ValueError."""
  with strategy.scope():
    v = xd.Variable(1.0, synchronization="on_read", aggregation="none")
  with pytest.raises(ValueError, match="aggregation NONE has no value in cross-replica"):
    v.value
  with pytest.raises(ValueError, match="aggregation NONE has no value in cross-replica"):
    strategy.extended.read_var(v)
  out = strategy.run(lambda: v.value * 2)
  assert [t.item() for t in local_values(strategy, out)] == [2.0] * 4


def test_cross_replica_assign_add_of_sync_on_read_sum_raises(strategy):
  """vars_test.py OnReadVariableSyncTest.testAssignAddSubWithAggregationSum:
  "SyncOnReadVariable does not support `assign_add` in cross-replica context
  when aggregation is set to `tf.VariableAggregation.SUM`"; with MEAN the delta
  goes to each component (values_util.on_read_assign_add_cross_replica)."""
  with strategy.scope():
    s = xd.Variable(1.0, synchronization="on_read", aggregation="sum")
    m = xd.Variable(1.0, synchronization="on_read", aggregation="mean")
  for method in ("assign_add", "assign_sub"):
    with pytest.raises(
      ValueError,
      match=re.escape(f"SyncOnReadVariable does not support `{method}` in cross-replica context"),
    ):
      getattr(s, method)(1.0)
  strategy.run(lambda: m.assign(_rid().float()))
  m.assign_add(10.0)
  assert _components(strategy, m) == [10.0, 11.0, 12.0, 13.0]
  assert m.value.item() == 11.5
