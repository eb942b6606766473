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


def _values(strategy, v):
  """Each replica's component as a float (with one replica the result of
  experimental_local_results is the variable itself, as in TF)."""
  return [float(c.value if isinstance(c, xd.Variable) else c) for c in strategy.unwrap(v)]


@pytest.mark.parametrize("kind", ["default", "one_device", "mirrored"])
def test_tower_local_variables_made_in_the_tower_fetch_their_aggregate(kind, strategy):
  """tf.contrib mirrored_strategy_multigpu_test.py
  MirroredStrategyVariableCreationTest.testTowerLocalVariable: variables made in
  call_for_each_tower under get_tower_context().tower_local_var_scope("sum") /
  ("mean"), given worker_device_index, are one variable for every tower;
  tower i's components are 1 + 2 + i and 6 * i, and fetch (like read_var and
  the plain read) gives their sum and mean. TF 1's tower_local_var_scope needs
  the strategy's scope only (_require_distribution_strategy_scope), so it works
  inside the tower and for the default strategy too."""
  s = {"default": xd.get_strategy(), "one_device": xd.OneDeviceStrategy()}.get(kind, strategy)
  n = s.num_replicas_in_sync
  made = []

  def model_fn(device_id):
    tower_context = xd.get_tower_context()
    with tower_context.tower_local_var_scope("sum"):
      v_sum = xd.Variable(1.0)
    with tower_context.tower_local_var_scope("mean"):
      v_mean = xd.Variable(4.0)
    assert (v_sum.synchronization, v_sum.aggregation) == (VS.ON_READ, VA.SUM)
    assert (v_mean.synchronization, v_mean.aggregation) == (VS.ON_READ, VA.MEAN)
    v_sum.assign_add(2.0 + device_id)
    v_mean.assign(6.0 * device_id)
    made.append((v_sum, v_mean))
    return v_sum, v_mean

  with s.scope():
    ret_v_sum, ret_v_mean = s.call_for_each_tower(model_fn, s.worker_device_index)
    assert made == [(ret_v_sum, ret_v_mean)]  # traced once: one object for every tower
    assert _values(s, ret_v_sum) == [i + 3.0 for i in range(n)]
    assert _values(s, ret_v_mean) == [i * 6.0 for i in range(n)]
    expected_sum = sum(i + 3.0 for i in range(n))
    expected_mean = sum(i * 6.0 for i in range(n)) / n
    assert float(s.fetch(ret_v_sum)) == expected_sum
    assert float(s.fetch(ret_v_mean)) == expected_mean
    assert float(s.extended.read_var(ret_v_sum)) == expected_sum
    assert float(ret_v_sum.value) == expected_sum and float(ret_v_mean.value) == expected_mean
  assert float(s.fetch(ret_v_sum)) == expected_sum
  with pytest.raises(
    RuntimeError,
    match=re.escape("strategy.worker_device_index requires being in cross-replica context"),
  ):
    s.run(lambda: s.worker_device_index)


def test_tower_local_sum_variable_fetched_in_the_scope_that_made_it(strategy):
  """The same test's cross-tower reads, made before the scope that created the
  variables is left (xladist places variables when the scope ends): TF's
  variable has its N components from creation on, so fetch of a fresh SUM
  variable is N times its initial value at once, and its components can be
  listed; a Parameter made there is fetched as its value."""
  with strategy.scope():
    with strategy.tower_local_var_scope("sum"):
      v = xd.Variable(1.0)
      lin = torch.nn.Linear(1, 1, bias=False)
    assert float(strategy.fetch(v)) == 4.0 and float(v.value) == 4.0
    assert _values(strategy, v) == [1.0] * 4
    first = float(_values(strategy, lin.weight)[0])
    assert float(strategy.fetch(lin.weight)) == pytest.approx(4 * first)
  assert float(strategy.fetch(v)) == 4.0


def test_sync_on_read_variables_read_in_merge_fn_give_their_aggregate(strategy):
  """values_test.py SyncOnReadVariableTest.testReadValueInCrossReplicaContext
  (replica r assigns r; read in cross-replica context, SUM gives the sum of
  the replicas' values, MEAN their mean, ONLY_FIRST_REPLICA replica 0's),
  read inside merge_fn, the cross-replica context within a step: value,
  read_value, extended.read_var and fetch all give the aggregate on every
  replica (SyncOnReadVariable._get_cross_replica), not the replica's own
  component; inside extended.update the component is read."""
  with strategy.scope():
    made = {
      agg: xd.Variable(0.0, synchronization="on_read", aggregation=agg)
      for agg in ("sum", "mean", "only_first_replica")
    }
  expected = {"sum": 6.0, "mean": 1.5, "only_first_replica": 0.0}

  def merge_fn(s):
    out = {}
    for agg, v in made.items():
      out[agg] = (v.value * 1, v.read_value(), s.extended.read_var(v), s.fetch(v, "xla:0"))
      out[agg + "/update"] = s.extended.update(v, lambda c: c.value * 1)
    return out

  def step():
    for v in made.values():
      v.assign(_rid().float())
    return xd.get_replica_context().merge_call(merge_fn)

  out = strategy.run(step)
  for agg, value in expected.items():
    for read in out[agg]:
      assert _components(strategy, read) == [value] * 4, agg
    assert _components(strategy, out[agg + "/update"]) == [0.0, 1.0, 2.0, 3.0], agg
    assert float(strategy.fetch(made[agg])) == value


@pytest.mark.parametrize("kind", ["one_device", "mirrored"])
def test_assign_of_a_number_to_a_sum_variable_made_in_call_for_each_replica(kind, strategy):
  """mirrored_variable_test.py MirroredVariableUpdateTest.
  testAssignMirroredVarReplicaContextWithSum as TF writes it: the SUM variable
  is made in call_for_each_replica (which raised "written in place ... not
  through Variable.assign" when that step ended), then assign(5.0) in a replica
  context raises TF's ValueError "A non-DistributedValues value 5.0 cannot be
  reduced with ... SUM"; with one replica there is nothing to add up, and the
  value is assigned (reduce_non_distributed_value with one replica)."""
  s = xd.OneDeviceStrategy() if kind == "one_device" else strategy
  with s.scope():
    mirrored_var = s.extended.call_for_each_replica(
      lambda: xd.Variable(1.0, name="foo", aggregation="sum")
    )
    assert isinstance(mirrored_var, xd.Variable)
    assert mirrored_var.synchronization is VS.ON_WRITE and float(mirrored_var.read_value()) == 1.0
    if s.num_replicas_in_sync > 1:
      with pytest.raises(
        ValueError,
        match=r"a non-DistributedValues value \(float 5\.0\) cannot be reduced with ReduceOp\.SUM",
      ):
        s.extended.call_for_each_replica(lambda: mirrored_var.assign(5.0))
      assert float(mirrored_var.read_value()) == 1.0
    else:
      s.extended.call_for_each_replica(lambda: mirrored_var.assign(5.0))
      assert float(mirrored_var.read_value()) == 5.0

  def raw_write():
    w = xd.Variable(1.0, aggregation="sum")
    with torch.no_grad():
      w.value_.add_(1.0)

  if s.num_replicas_in_sync > 1:  # an in-place write after creation is still refused
    with pytest.raises(RuntimeError, match="was written in place inside the step"):
      s.run(raw_write)
