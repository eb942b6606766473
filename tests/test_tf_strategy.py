"""TF 2's strategy semantics, case by case, each mirroring the TF test it cites.

TF sources: tensorflow/python/distribute/{distribute_lib.py, mirrored_strategy.py,
distribute_utils.py, cross_device_ops.py} and the tests named in each docstring.
"""

import contextlib
import re

import pytest
import torch
from conftest import local_values

import xladist as xd


def _rid():
  return xd.get_replica_context().replica_id_in_sync_group


class _UserError(Exception):
  pass


def _strategy_of(kind, mirrored):
  """TF's strategy_combinations in this process: the default strategy, a
  OneDeviceStrategy and the 4-replica MirroredStrategy (1 and 2 replicas:
  tests/test_device_counts.py)."""
  if kind == "default":
    return xd.get_strategy()
  if kind == "one_device":
    return xd.OneDeviceStrategy()
  return mirrored


_KINDS = ["default", "one_device", "mirrored"]


def test_values_from_function_wrap_a_constant_in_a_per_replica(strategy):
  """values_test.py DistributedValuesTest.testMakeDistributedValueTupleConstant
  and the docstring example of experimental_distribute_values_from_function
  (returning ctx.num_replicas_in_sync gives local results (2, 2)):
  distribute_utils.regroup(..., always_wrap=True) wraps every leaf."""
  v = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
  assert isinstance(v, xd.PerReplica)
  assert strategy.experimental_local_results(v) == (4, 4, 4, 4)
  t = strategy.experimental_distribute_values_from_function(lambda ctx: (1.0, 2.0, 3.0))
  assert isinstance(t, tuple) and all(isinstance(x, xd.PerReplica) for x in t)
  assert strategy.experimental_local_results(t[2]) == (3.0,) * 4
  # The step still gets the Python value (it is the same on every replica).
  seen = []
  strategy.run(lambda n: seen.append(n), args=(v,))
  assert seen == [4]


def test_run_returns_host_tensors_made_in_fn_as_per_replica(strategy):
  """strategy_common_test.py StrategyLocalResultTest.testLocalResultForTensor /
  testLocalResultForDictionary: tensors made inside fn come back as PerReplica
  (one per replica); a Python value shared by all replicas comes back as is."""
  out = strategy.run(lambda: {"a": torch.tensor([2.0, 3.0]), "b": 7})
  assert isinstance(out["a"], xd.PerReplica) and out["b"] == 7
  results = strategy.experimental_local_results(out["a"])
  assert len(results) == 4
  for r in results:
    torch.testing.assert_close(r, torch.tensor([2.0, 3.0]), rtol=0, atol=0)


def test_local_results_of_variables_and_nests(strategy):
  """strategy_common_test.py StrategyLocalResultTest.testLocalResultForNestedStruct
  (a nest gives one structure per replica, also one without distributed values:
  testLocalResultForNestedStructWithoutTensor) and mirrored_variable_test.py
  _test_mv_properties (a variable gives one component per replica)."""
  with strategy.scope():
    w = xd.Variable(2.0)
    lin = torch.nn.Linear(2, 2)
  assert len(strategy.experimental_local_results(w)) == 4
  assert len(strategy.experimental_local_results(lin.weight)) == 4
  out = strategy.run(lambda: {"x": _rid().float(), "y": [_rid() * 2, 5]})
  nests = strategy.experimental_local_results(out)
  assert isinstance(nests, tuple) and len(nests) == 4
  for r, nest in enumerate(nests):
    assert nest["x"].item() == r and nest["y"][0].item() == 2 * r and nest["y"][1] == 5
  assert strategy.experimental_local_results({"a": 1}) == ({"a": 1},) * 4
  assert strategy.experimental_local_results(1) == (1,)


def test_reduce_and_gather_components_of_different_shapes(strategy, per_replica):
  """mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.testReduceAxisToCpu
  (replica i holds [i] * (i + 1): SUM over axis 0 and the exact MEAN over all
  elements) and strategy_gather_test.py GatherTest.testGatherDiffShapeAtAxis0 /
  testGatherDiffShapeAtAxis1 / testGatherRaiseDiffShapeAtNonAxis."""
  v = per_replica(lambda r: torch.full((r + 1,), float(r)))
  assert strategy.reduce("sum", v, axis=0).item() == sum(r * (r + 1) for r in range(4))
  assert strategy.reduce("mean", v, axis=0).item() == pytest.approx(20.0 / 10)
  assert strategy.reduce("max", v, axis=0).item() == 3.0
  with pytest.raises(
    ValueError,
    match=re.escape(
      "strategy.reduce: the PerReplica's components have different shapes [(1,), (2,), "
      "(3,), (4,)], so they cannot be reduced elementwise (axis=None)"
    ),
  ):
    strategy.reduce("sum", v, axis=None)
  rows = per_replica(lambda r: torch.full((r + 1, 1), float(r)))
  assert strategy.gather(rows, 0).shape == (10, 1)
  cols = per_replica(lambda r: torch.full((1, r + 1), float(r)))
  torch.testing.assert_close(
    strategy.gather(cols, 1), torch.tensor([[0.0, 1, 1, 2, 2, 2, 3, 3, 3, 3]]), rtol=0, atol=0
  )
  with pytest.raises(
    ValueError,
    match=re.escape(
      "strategy.gather: the components have shapes [(1, 1), (1, 2), (1, 3), (1, 4)]; "
      "they may differ only along the gathered axis 0."
    ),
  ):
    strategy.gather(cols, 0)
  with pytest.raises(ValueError, match="must have one dtype"):
    strategy.run(
      lambda x: x, args=(per_replica(lambda r: torch.tensor(1) if r else torch.tensor(1.0)),)
    )


def test_extended_update_with_per_replica_args(strategy, per_replica):
  """distributed_variable_test.py DistributedVariableTest.testStrategyExtendedUpdate:
  PerReplica([1., 2.]) assigned gives components [1, 2], assign_add doubles them
  (MirroredExtended._update with distribute_utils.select_replica)."""
  with strategy.scope():
    v = xd.Variable(0.0, synchronization="on_read", aggregation="mean")
    m = xd.Variable(0.0)
  ones = per_replica(lambda r: torch.tensor(float(r + 1)))
  strategy.extended.update(v, lambda c, x: c.assign(x), args=(ones,))
  assert [float(c) for c in strategy.experimental_local_results(v)] == [1.0, 2.0, 3.0, 4.0]
  strategy.extended.update(v, lambda c, x: c.assign_add(x), args=(ones,))
  assert [float(c) for c in strategy.experimental_local_results(v)] == [2.0, 4.0, 6.0, 8.0]
  assert v.value.item() == 5.0
  strategy.extended.update(m, lambda c, x: c.assign(x), args=(ones,))
  assert [float(c) for c in strategy.experimental_local_results(m)] == [1.0, 2.0, 3.0, 4.0]


def test_cross_device_ops_take_variables_as_values_and_destinations(strategy, per_replica):
  """cross_device_ops_test.py CollectiveOpsTest.testReduceDense /
  testBatchReduceDense (a distributed value as destination gives a Mirrored on
  its devices) and strategy_test_lib.py _test_minimize_loss_eager
  (reduce_to(..., destinations=<MirroredVariable>)); distribute_lib_test.py
  TestStrategyTest.testReduceTo runs them outside the scope too."""
  with strategy.scope():
    var = xd.Variable(3.0)
    counts = xd.Variable(1.0, synchronization="on_read", aggregation="sum")
  ops = xd.NcclAllReduce()
  v = per_replica(lambda r: torch.tensor(float(r)))
  for reduce in (
    lambda: ops.reduce("sum", v, destinations=var),
    lambda: strategy.extended.reduce_to("sum", v, destinations=var),
    lambda: ops.batch_reduce("sum", [(v, var)])[0],
  ):
    out = reduce()
    assert isinstance(out, xd.Mirrored) and out.num_replicas == 4
    assert out.primary.device.type == "xla" and out.primary.item() == 6.0
  assert ops.reduce("mean", var, destinations=var).primary.item() == 3.0
  assert ops.reduce("sum", var, destinations=var).primary.item() == 12.0
  assert ops.reduce("sum", counts, destinations="cpu").item() == 4.0
  b = ops.broadcast(var, destinations=var)
  assert isinstance(b, xd.Mirrored) and b.primary.item() == 3.0
  with strategy.scope():
    assert strategy.extended.reduce_to("mean", var, destinations=var).primary.item() == 3.0


def test_scope_objects_may_be_reentered(strategy):
  """distribute_lib_test.py TestStrategyTest.testSameScopeNesting: with scope_a:
  with scope_b: with scope_a: (same strategy) keeps the strategy current and
  the context stack intact; another strategy's scope inside raises "Mixing
  different ..."."""
  a, b = strategy.scope(), strategy.scope()
  with a:
    with b:
      with a:
        assert xd.get_strategy() is strategy
      assert xd.get_strategy() is strategy and xd.in_cross_replica_context()
    with pytest.raises(RuntimeError, match="Mixing different strategies"):
      with xd.OneDeviceStrategy("cpu").scope():
        pass
    assert xd.get_strategy() is strategy
  assert not xd.has_strategy()
  with b:
    assert xd.get_strategy() is strategy
  assert not xd.has_strategy()


def test_default_strategy_scope_keeps_the_default_replica_context(strategy):
  """distribute_lib_test.py DefaultDistributionStrategyTest.testScopeMostlyNoOp:
  inside the default strategy's scope the thread stays in the default state
  (default replica context, not in cross-replica context, has_strategy False),
  nesting it in itself too; entering another strategy's scope inside it raises."""
  default = xd.get_strategy()
  with default.scope():
    ctx = xd.get_replica_context()
    assert ctx is not None and ctx.strategy is default
    assert not xd.in_cross_replica_context() and not xd.has_strategy()
    with default.scope():
      assert xd.get_replica_context() is ctx
    with pytest.raises(RuntimeError, match="Mixing different strategies"):
      with strategy.scope():
        pass
  with strategy.scope():
    with pytest.raises(RuntimeError, match="Must not nest strategy scopes"):
      with default.scope():
        pass


def test_exceptions_in_merge_fn_reach_the_caller(strategy):
  """mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.
  testCallAndMergeExceptions (strategy_test_lib._test_call_and_merge_exceptions):
  the user's exception propagates from fn, from merge_fn, from a
  call_for_each_replica inside merge_fn and from a merge_fn inside that."""

  def raises(*args):
    raise _UserError("boom")

  def merge_raises():
    return xd.get_replica_context().merge_call(raises)

  def merge_calls_run():
    return xd.get_replica_context().merge_call(lambda s: s.extended.call_for_each_replica(raises))

  def merge_calls_run_merge():
    return xd.get_replica_context().merge_call(
      lambda s: s.extended.call_for_each_replica(merge_raises)
    )

  for fn in (raises, merge_raises, merge_calls_run, merge_calls_run_merge):
    with pytest.raises(_UserError, match="boom"):
      strategy.run(fn)

  # call_for_each_replica in merge_fn runs every replica with its own values.
  def nested(s, v):
    return s.extended.call_for_each_replica(lambda x: x * 10, args=(v,))

  out = strategy.run(lambda: xd.get_replica_context().merge_call(nested, args=(_rid().float(),)))
  assert [t.item() for t in local_values(strategy, out)] == [0.0, 10.0, 20.0, 30.0]


def test_legacy_merge_call_positional_form_and_fetch(strategy):
  """tf.contrib.distribute (TF 1.11): TowerContext.merge_call(merge_fn, *args,
  **kwargs); DistributionStrategy.fetch(val, destination="/device:CPU:0")
  returns a copy of the value on the host."""

  def merge_fn(s, a, b, scale=1.0):
    return s.reduce("sum", a, axis=None) * scale + b

  def step():
    v = _rid().float()
    legacy = xd.get_replica_context().merge_call(merge_fn, v, 1.0, scale=2.0)
    tf2 = xd.get_replica_context().merge_call(merge_fn, (v, 1.0), {"scale": 2.0})
    keyword = xd.get_replica_context().merge_call(merge_fn, args=(v, 1.0))
    return legacy, tf2, keyword

  legacy, tf2, keyword = strategy.run(step)
  assert local_values(strategy, legacy)[0].item() == 13.0
  assert local_values(strategy, tf2)[3].item() == 13.0
  assert local_values(strategy, keyword)[0].item() == 7.0
  with strategy.scope():
    v = xd.Variable(3.0)
    lin = torch.nn.Linear(2, 2)
  fetched = strategy.fetch(v)
  assert fetched.device.type == "cpu" and fetched.item() == 3.0
  assert strategy.fetch(lin.weight).device.type == "cpu"
  with pytest.raises(
    ValueError, match=re.escape("strategy.fetch: 'xla:9' is not a device of this process")
  ):
    strategy.fetch(v, destination="xla:9")


def test_worker_devices_are_devices_a_tensor_can_be_put_on(strategy):
  """values_test.py DistributedValuesTest.testMakeDistributedValueExplicitDevicePlacement:
  value_fn places each component on worker_devices[i]; every listed device
  must be usable, and a device xladist cannot use gets its own clear error
  instead of torch_xla's `vector::_M_range_check`."""
  devices = strategy.extended.worker_devices
  assert len(devices) == 4
  v = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.full(
      (2,), float(ctx.replica_id_in_sync_group), device=devices[ctx.replica_id_in_sync_group]
    )
  )
  out = strategy.run(lambda x: x * 2, args=(v,))
  assert [t[0].item() for t in local_values(strategy, out)] == [0.0, 2.0, 4.0, 6.0]
  with strategy.scope():
    assert torch.zeros(1, device=xd.current_device()).device.type == "xla"
  assert strategy.run(lambda: torch.zeros(1, device=xd.current_device()) + 1) is not None
  assert xd.MirroredStrategy(devices=devices).num_replicas_in_sync == 4
  assert strategy.extended.reduce_to("sum", v, destinations="xla:0").device.type == "xla"
  for call in (
    lambda: strategy.fetch(xd.Mirrored([torch.ones(1)] * 4), destination="xla:7"),
    lambda: strategy.extended.reduce_to("sum", v, destinations="xla:7"),
    lambda: xd.NcclAllReduce().reduce("sum", v, destinations=["xla:0", "tpu:1"]),
  ):
    with pytest.raises(ValueError, match="is not a device of this process"):
      call()


def test_the_default_strategy_is_in_its_default_replica_context():
  """distribute_lib_test.py _assert_in_default_state and
  DefaultDistributionStrategyTest.testMergeCall / testScopeMostlyNoOp: outside
  any scope, and inside the default strategy's scope(), get_replica_context()
  is the default replica context (not None), in_cross_replica_context() is
  False and get_cross_replica_context() None; its merge_call runs merge_fn in
  the default strategy's cross-replica context and returns what it returned."""
  default = xd.get_strategy()
  ctx = xd.get_replica_context()
  assert isinstance(ctx, xd.ReplicaContext) and ctx.strategy is default
  seen = []

  def merge_fn(dist, s):
    seen.append((dist, xd.get_replica_context(), xd.get_cross_replica_context(), xd.has_strategy()))
    return "foo_" + s

  for scope in (contextlib.nullcontext(), default.scope()):
    with scope:
      assert xd.get_replica_context() is ctx
      assert not xd.in_cross_replica_context() and xd.get_cross_replica_context() is None
      assert xd.get_strategy() is default and not xd.has_strategy()
      assert ctx.merge_call(merge_fn, args=("bar",)) == "foo_bar"
  assert seen == [(default, None, default, False)] * 2


@pytest.mark.parametrize("kind", _KINDS)
def test_reduce_and_run_with_merge_call_in_and_out_of_the_scope(kind, strategy):
  """strategy_common_test.py ReduceTest.testBasic (reduce SUM of a PerReplica
  of ones gives num_replicas, inside strategy.scope() and outside any scope)
  and StrategyTest.testMergeCallInitScope (inside the scope, run of a function
  whose merge_fn returns 11 gives 12 on every replica), over
  strategy_combinations.all_strategies, the default strategy included: in its
  scope, which keeps the default replica context, both raised "called in a
  replica context (inside strategy.run)"."""
  s = _strategy_of(kind, strategy)
  n = s.num_replicas_in_sync
  ones = s.experimental_distribute_values_from_function(lambda _: torch.ones(()))

  def replica_fn():
    y = xd.get_replica_context().merge_call(lambda _: torch.tensor(11))
    return y + 1

  for scope in (s.scope(), contextlib.nullcontext()):
    with scope:
      assert float(s.reduce(xd.ReduceOp.SUM, ones, axis=None)) == 1.0 * n
      results = s.experimental_local_results(s.run(replica_fn))
      assert [int(r) for r in results] == [12] * n


def test_run_and_reduce_inside_the_default_strategys_run_are_refused():
  """distribute_lib.py _require_cross_replica_or_default_context_extended (what
  TestStrategyTest.testCallForEachReplica relies on): the replica context of
  run is not the default one, so run and reduce inside it raise, for the
  default strategy as for any other."""
  default = xd.get_strategy()
  with pytest.raises(
    RuntimeError, match=re.escape("strategy.run requires being in cross-replica context")
  ):
    default.run(lambda: default.run(lambda: None))
  with pytest.raises(
    RuntimeError, match=re.escape("strategy.reduce requires being in cross-replica context")
  ):
    with default.scope():
      default.run(lambda: default.reduce("sum", torch.ones(()), axis=None))
  assert xd.get_replica_context() is not None and not xd.in_cross_replica_context()


@pytest.mark.parametrize("kind", _KINDS)
def test_local_results_of_a_nest_without_tensors_has_one_entry_per_replica(kind, strategy):
  """strategy_common_test.py StrategyLocalResultTest.
  testLocalResultForNestedStructWithoutTensor (run of a function returning
  {"a": 1., "b": 2.} gives one dict per replica, as a tuple) and its siblings
  testLocalResultForDictionary / testLocalResultForList /
  testLocalResultForTuple with Python numbers instead of tensors
  (StrategyExtendedV2._local_results maps every nest over the local replicas);
  a value that is not a nest gives one entry."""
  s = _strategy_of(kind, strategy)
  n = s.num_replicas_in_sync
  with s.scope():
    for value in ({"a": 1.0, "b": 2.0}, [1.0, 2.0], (1.0, 2.0, 3.0)):
      results = s.experimental_local_results(s.run(lambda value=value: value))
      assert isinstance(results, tuple) and results == (value,) * n
    assert s.experimental_local_results(s.run(lambda: 1.0)) == (1.0,)
  nests = s.experimental_local_results(s.run(lambda: {"a": 1.0, "t": torch.ones(1)}))
  assert len(nests) == n and all(nest["a"] == 1.0 for nest in nests)


@pytest.mark.parametrize("batch", [False, True])
def test_reducing_a_variable_onto_itself_gives_a_mirrored(strategy, batch):
  """v1/cross_device_ops_test.py SingleWorkerCrossDeviceOpsTest.
  testReduceDistributedVariable: reduce(MEAN, v, v) (and batch_reduce of
  [(v, v)]) of a variable made under the scope, with ReductionToOneDevice and an
  all-reduce, gives a Mirrored whose components are tensors holding v's value;
  for a module's Parameter as for an xladist.Variable. With one replica the
  value comes back unwrapped (TF's regroup of a single component)."""
  with strategy.scope():
    lin = torch.nn.Linear(2, 1)
    v = xd.Variable(1.0)
  for ops in (xd.ReductionToOneDevice(), xd.NcclAllReduce()):
    for var, expected in ((v, torch.tensor(1.0)), (lin.weight, lin.weight.detach().cpu())):
      if batch:
        result = ops.batch_reduce(xd.ReduceOp.MEAN, [(var, var)])[0]
      else:
        result = ops.reduce(xd.ReduceOp.MEAN, var, var)
      assert isinstance(result, xd.Mirrored) and result.num_replicas == 4
      for c in result.values:
        assert isinstance(c, torch.Tensor) and not isinstance(c, torch.nn.Parameter)
        torch.testing.assert_close(c.detach().cpu(), expected, rtol=0, atol=0)
  # A Parameter is a distributed value for strategy.reduce too (as a Variable).
  assert torch.equal(strategy.reduce("sum", lin.bias, axis=None).detach().cpu(), lin.bias.cpu() * 4)
  one = xd.OneDeviceStrategy()
  with one.scope():
    w = torch.nn.Linear(2, 1).weight
  result = xd.ReductionToOneDevice().reduce(xd.ReduceOp.MEAN, w, w)
  assert isinstance(result, torch.Tensor) and torch.equal(result.detach().cpu(), w.detach().cpu())


def test_reduce_of_a_variable_in_merge_fn(strategy):
  # TF: in merge_fn a MirroredVariable or SyncOnReadVariable is still a
  # DistributedValues, so strategy.reduce reduces the replicas' values
  # (strategy_common_test.py's ReduceTest reduces in cross-replica context;
  # mirrored_strategy.py's _reduce_to returns a mirrored value unchanged for
  # MEAN). SUM of a mirrored variable gives N times it (TF asserts; see
  # docs/architecture.md, "Differences from TF 2").
  n = strategy.num_replicas_in_sync
  with strategy.scope():
    v = xd.Variable(torch.tensor([1.0, 2.0]))
    layer = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.constant_(layer.weight, 3.0)
    sor = xd.Variable(
      torch.tensor(0.0),
      synchronization=xd.VariableSynchronization.ON_READ,
      aggregation=xd.VariableAggregation.SUM,
    )

  def step():
    ctx = xd.get_replica_context()
    sor.assign(ctx.replica_id_in_sync_group.float() + 1.0)

    def merge_fn(s):
      return (
        s.reduce("sum", v, axis=None),
        s.reduce("mean", v, axis=None),
        s.reduce("sum", layer.weight, axis=None),
        s.reduce("sum", sor, axis=None),
        s.reduce("mean", sor, axis=None),
      )

    return ctx.merge_call(merge_fn)

  v_sum, v_mean, w_sum, sor_sum, sor_mean = strategy.run(step)
  total = float(sum(range(1, n + 1)))
  for r in range(n):
    assert torch.equal(local_values(strategy, v_sum)[r], torch.tensor([1.0, 2.0]) * n)
    assert torch.equal(local_values(strategy, v_mean)[r], torch.tensor([1.0, 2.0]))
    assert torch.equal(local_values(strategy, w_sum)[r], torch.full((1, 2), 3.0 * n))
    assert local_values(strategy, sor_sum)[r].item() == total
    assert local_values(strategy, sor_mean)[r].item() == total / n
  # The same as in cross-replica context.
  assert torch.equal(strategy.reduce("sum", v, axis=None).cpu(), torch.tensor([1.0, 2.0]) * n)
  assert strategy.reduce("sum", sor, axis=None).item() == total
