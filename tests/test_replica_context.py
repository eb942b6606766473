"""ReplicaContext inside MirroredStrategy.run on 4 replicas: ids, collectives, merge_call."""

import collections
import dataclasses
import re

import numpy as np
import pytest
import torch
from conftest import local_values

import xladist as xd
from xladist.runtime import xla as _runtime

# Traced and left lazy (replay off for this run): its program's HLO is readable.
LAZY = xd.RunOptions(experimental_replay=False)


@dataclasses.dataclass
class Stats:
  loss: object
  name: object


def _ids(strategy):
  return strategy.run(lambda: xd.get_replica_context().replica_id_in_sync_group * 1)


def test_replica_id_is_a_traced_int32_tensor_per_replica(strategy):
  seen = {}

  def fn():
    rid = xd.get_replica_context().replica_id_in_sync_group
    seen["type"], seen["dtype"], seen["shape"] = type(rid), rid.dtype, rid.shape
    return rid * 1

  out = strategy.run(fn)
  assert seen == {"type": torch.Tensor, "dtype": torch.int32, "shape": torch.Size([])}
  assert [int(v) for v in local_values(strategy, out)] == [0, 1, 2, 3]


def test_python_control_flow_on_replica_id_raises_and_says_why(strategy):
  def fn():
    if xd.get_replica_context().replica_id_in_sync_group == 0:
      return torch.zeros(())
    return torch.ones(())

  with pytest.raises(RuntimeError, match=re.escape("replica_id_in_sync_group is a traced tensor")):
    strategy.run(fn)
  # The strategy still works afterwards.
  assert [int(v) for v in local_values(strategy, _ids(strategy))] == [0, 1, 2, 3]


def test_item_inside_step_raises_naming_the_line(strategy, per_replica):
  x = per_replica(lambda r: torch.tensor(float(r)))

  def fn(x):
    return x.item() + 1

  with pytest.raises(
    RuntimeError,
    match=r"read a traced tensor's value on the host "
    r"\(at .*test_replica_context.py:\d+: return x.item\(\) \+ 1\)",
  ):
    strategy.run(fn, args=(x,))


def test_host_read_error_restores_variables(strategy):
  with strategy.scope():
    lin = torch.nn.Linear(2, 2)
  before = lin.weight.detach().cpu().clone()

  def fn():
    lin.weight.data.mul_(2)
    return bool(lin.weight.sum() > 0)

  with pytest.raises(RuntimeError, match="read a traced tensor's value"):
    strategy.run(fn)
  torch.testing.assert_close(lin.weight.detach().cpu(), before, rtol=0, atol=0)


def test_num_replicas_strategy_and_devices(strategy):
  seen = {}

  def fn():
    ctx = xd.get_replica_context()
    seen.update(
      n=ctx.num_replicas_in_sync,
      s=ctx.strategy,
      d=ctx.devices,
      cross=xd.in_cross_replica_context(),
      cur=xd.get_strategy(),
      crossctx=xd.get_cross_replica_context(),
    )

  strategy.run(fn)
  assert seen["n"] == 4 and seen["s"] is strategy and seen["cur"] is strategy
  assert seen["cross"] is False and seen["crossctx"] is None
  assert len(seen["d"]) == 1 and seen["d"][0].type == "xla"


@pytest.mark.parametrize(
  "op,expected",
  [
    ("sum", lambda v: v.sum(0)),
    ("mean", lambda v: v.mean(0)),
    (xd.ReduceOp.MIN, lambda v: v.min(0)),
    (xd.ReduceOp.MAX, lambda v: v.max(0)),
  ],
)
def test_all_reduce_nested_structure(strategy, per_replica, op, expected):
  rng = np.random.default_rng(0)
  a = rng.standard_normal((4, 3)).astype(np.float32)
  b = rng.standard_normal((4, 2, 2)).astype(np.float32)
  Pair = collections.namedtuple("Pair", "first second")
  x = per_replica(lambda r: {"a": torch.from_numpy(a[r]), "b": [Pair(torch.from_numpy(b[r]), 7)]})

  out = strategy.run(lambda v: xd.get_replica_context().all_reduce(op, v), args=(x,))
  assert set(out) == {"a", "b"} and isinstance(out["b"][0], Pair)
  # A Python number leaf is converted to a tensor and reduced too (as in TF).
  for got in local_values(strategy, out["b"][0].second):
    assert got.item() == expected(np.full((4,), 7))
  for got in local_values(strategy, out["a"]):
    np.testing.assert_allclose(got.numpy(), expected(a), rtol=1e-6, atol=1e-6)
  for got in local_values(strategy, out["b"][0].first):
    np.testing.assert_allclose(got.numpy(), expected(b), rtol=1e-6, atol=1e-6)


def test_all_reduce_integers_and_bools(strategy, per_replica):
  x = per_replica(lambda r: (torch.tensor([r, 10 * r], dtype=torch.int64), torch.tensor(r == 2)))

  def fn(v):
    ctx = xd.get_replica_context()
    return ctx.all_reduce("sum", v[0]), ctx.all_reduce("mean", v[0]), ctx.all_reduce("max", v[1])

  s, m, anyb = strategy.run(fn, args=(x,))
  for v in local_values(strategy, s):
    assert v.dtype == torch.int64 and v.tolist() == [6, 60]
  for v in local_values(strategy, m):
    assert v.tolist() == [1, 15]  # floor of the mean, integer dtype kept
  assert [bool(v) for v in local_values(strategy, anyb)] == [True] * 4


def test_all_reduce_packs_a_nested_structure_into_one_collective_per_dtype(strategy, per_replica):
  x = per_replica(
    lambda r: (
      [torch.full((3,), float(r)) for _ in range(20)] + [torch.tensor([r], dtype=torch.int32)]
    )
  )
  out = strategy.run(
    lambda v: xd.get_replica_context().all_reduce("sum", v), args=(x,), options=LAZY
  )
  hlo = _runtime.hlo_text([o._stacked for o in out])
  assert len(re.findall(r" all-reduce\(", hlo)) == 2  # one f32 pack, one s32
  assert [v.tolist() for v in local_values(strategy, out[7])] == [[6.0] * 3] * 4


def test_all_reduce_sum_is_differentiable(strategy, per_replica):
  x = per_replica(lambda r: torch.tensor([float(r + 1)]))

  def fn(v):
    v = v.clone().requires_grad_(True)
    total = xd.get_replica_context().all_reduce("sum", v * v)
    total.sum().backward()
    return v.grad

  # d/dv_r of sum_q(sum_s v_s^2) over the 4 replicas' copies = 4 * 2 v_r
  grads = local_values(strategy, strategy.run(fn, args=(x,)))
  assert [g.item() for g in grads] == [8.0, 16.0, 24.0, 32.0]


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_concatenates_along_axis(strategy, per_replica, axis):
  vals = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(4)]
  x = per_replica(lambda r: vals[r])
  out = strategy.run(lambda v: xd.get_replica_context().all_gather(v, axis), args=(x,))
  expected = torch.cat(vals, dim=axis)
  for got in local_values(strategy, out):
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_all_gather_keeps_every_value_exact(strategy, per_replica):
  # (XLA:CPU flushes subnormal floats to zero in any computation, so none here.)
  special = torch.tensor([float("inf"), -float("inf"), 3.0e38, -1.5e-30])
  x = per_replica(lambda r: special * (r + 1) if r != 2 else torch.tensor([float("nan")] * 4))
  out = strategy.run(lambda v: xd.get_replica_context().all_gather(v, 0), args=(x,))
  got = local_values(strategy, out)[0]
  expected = torch.cat(
    [special * (r + 1) if r != 2 else torch.tensor([float("nan")] * 4) for r in range(4)]
  )
  # Every value bit for bit, the NaNs in the same places.
  torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_all_gather_of_a_scalar_is_rejected(strategy):
  def fn():
    return xd.get_replica_context().all_gather(torch.tensor(1.0), 0)

  with pytest.raises(ValueError, match=re.escape("must have rank >= 1")):
    strategy.run(fn)

  def nested():
    return xd.get_replica_context().all_gather({"a": torch.ones(2), "b": [torch.tensor(1.0)]}, 0)

  with pytest.raises(
    ValueError,
    match=re.escape(
      "ReplicaContext.all_gather: value['b'][0]: per-replica values must have rank >= 1"
    ),
  ):
    strategy.run(nested)


def test_all_gather_axis_out_of_range(strategy):
  def fn():
    return xd.get_replica_context().all_gather(torch.ones(2), 1)

  with pytest.raises(
    ValueError, match=re.escape("axis 1 is out of range for a per-replica value of rank 1")
  ):
    strategy.run(fn)


def _merge_example(strategy):
  def merge_fn(s, v):
    assert xd.in_cross_replica_context() and xd.get_replica_context() is None
    assert isinstance(v, xd.PerReplica)
    return s.reduce(xd.ReduceOp.SUM, v, axis=None)

  def fn(three):
    ctx = xd.get_replica_context()
    v = three + ctx.replica_id_in_sync_group
    s = ctx.merge_call(merge_fn, args=(v,))
    return s + v

  return strategy.run(fn, args=(torch.tensor(3.0),), options=LAZY)


def test_tf_merge_call_example(strategy):
  # v_r = 3 + r; s = sum_r v_r = 18; replica r returns s + v_r.
  out = _merge_example(strategy)
  assert [v.item() for v in local_values(strategy, out)] == [21.0, 22.0, 23.0, 24.0]


def test_merge_fn_that_only_reduces_costs_one_all_reduce(strategy):
  out = _merge_example(strategy)
  hlo = _runtime.hlo_text([out._stacked])
  assert len(re.findall(r" all-reduce\(", hlo)) == 1
  # An all-gather would be a one-hot select over a (4,) buffer before its all-reduce.
  assert "f32[4]{0} all-reduce" not in hlo


def test_merge_fn_reading_values_sees_every_replica(strategy):
  def merge_fn(s, v):
    vals = v.values
    assert len(vals) == 4
    # A PerReplica result gives each replica its own component.
    return xd.PerReplica([vals[(r + 1) % 4] for r in range(4)])

  def fn():
    rid = xd.get_replica_context().replica_id_in_sync_group
    return xd.get_replica_context().merge_call(merge_fn, args=(rid.float() * 10,))

  assert [v.item() for v in local_values(strategy, strategy.run(fn))] == [10.0, 20.0, 30.0, 0.0]


def test_merge_call_batch_reduce_to_and_gather(strategy):
  def merge_fn(s, a, b):
    ra, rb = s.extended.batch_reduce_to("mean", [(a, a), (b, b)])
    assert isinstance(ra, xd.Mirrored)
    return ra, rb, s.gather(b, axis=0)

  def fn():
    rid = xd.get_replica_context().replica_id_in_sync_group.float()
    return xd.get_replica_context().merge_call(merge_fn, args=(rid, torch.stack([rid, rid])))

  ra, rb, g = strategy.run(fn)
  assert [v.item() for v in local_values(strategy, ra)] == [1.5] * 4
  assert [v.tolist() for v in local_values(strategy, rb)] == [[1.5, 1.5]] * 4
  assert local_values(strategy, g)[3].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_merge_call_passes_variables_through(strategy):
  with strategy.scope():
    lin = torch.nn.Linear(2, 1)
  seen = {}

  def merge_fn(s, w, x):
    seen["w"], seen["x"] = type(w), type(x)
    return w.sum()

  strategy.run(
    lambda: xd.get_replica_context().merge_call(merge_fn, args=(lin.weight, lin.weight * 2))
  )
  assert seen == {"w": torch.nn.Parameter, "x": xd.PerReplica}


def test_merge_call_kwargs_and_python_values(strategy):
  def merge_fn(s, x, scale=1, label=""):
    return s.reduce("sum", x, axis=None) * scale, label + "!"

  def fn():
    return xd.get_replica_context().merge_call(
      merge_fn, args=(torch.ones(()),), kwargs={"scale": 2, "label": "hi"}
    )

  total, label = strategy.run(fn)
  assert label == "hi!"
  assert [v.item() for v in local_values(strategy, total)] == [8.0] * 4


def test_a_state_dict_keeps_its_metadata_in_merge_call_all_reduce_and_run(strategy, per_replica):
  """Module.state_dict() is an OrderedDict with `_metadata` (which load_state_dict
  reads); every nest xladist rebuilds keeps it."""
  meta = torch.nn.Linear(2, 2).state_dict()._metadata
  x = per_replica(lambda r: torch.tensor([float(r)]))
  seen = {}

  def merge_fn(s, sd):
    seen["merge_fn"] = (type(sd), sd._metadata, type(sd["weight"]))
    return sd

  def fn(v):
    sd = collections.OrderedDict(weight=v * 2, bias=v + 1)
    sd._metadata = meta
    ctx = xd.get_replica_context()
    merged = ctx.merge_call(merge_fn, args=(sd,))
    seen["merged"] = (type(merged), merged._metadata)
    return ctx.all_reduce("sum", merged)

  out = strategy.run(fn, args=(x,))
  assert seen["merge_fn"] == (collections.OrderedDict, meta, xd.PerReplica)
  assert seen["merged"] == (collections.OrderedDict, meta)
  assert type(out) is collections.OrderedDict and out._metadata is meta
  assert list(out) == ["weight", "bias"]
  for got in local_values(strategy, out["weight"]):
    torch.testing.assert_close(got, torch.tensor([12.0]), rtol=0, atol=0)
  for got in local_values(strategy, out["bias"]):
    torch.testing.assert_close(got, torch.tensor([10.0]), rtol=0, atol=0)


def test_merge_call_errors(strategy):
  with pytest.raises(TypeError, match=re.escape("merge_call: merge_fn must be callable, got int")):
    strategy.run(lambda: xd.get_replica_context().merge_call(3))

  def nested():
    ctx = xd.get_replica_context()
    ctx.merge_call(lambda s: ctx.merge_call(lambda s2: None))

  with pytest.raises(RuntimeError, match=re.escape("must be called in this replica context")):
    strategy.run(nested)

  # TF allows call_for_each_replica (and run) inside merge_fn
  # (strategy_test_lib._test_call_and_merge_exceptions).
  def run_in_merge():
    return xd.get_replica_context().merge_call(lambda s: s.run(lambda: 3))

  assert strategy.run(run_in_merge) == 3


def test_all_reduce_rejects_non_tensors(strategy):
  with pytest.raises(
    TypeError,
    match=re.escape(
      "ReplicaContext.all_reduce: value is a str; expected tensors or Python numbers "
      "(in nested tuples, lists, dicts, namedtuples or dataclasses)."
    ),
  ):
    strategy.run(lambda: xd.get_replica_context().all_reduce("sum", "x"))
  # In a nest, the message names the leaf (a namedtuple's field as an attribute).
  Pair = collections.namedtuple("Pair", "first second")
  nest = {"loss": [torch.ones(1), Pair(torch.ones(1), "x")], "n": 3}
  with pytest.raises(
    TypeError, match=re.escape("ReplicaContext.all_reduce: value['loss'][1].second is a str;")
  ):
    strategy.run(lambda: xd.get_replica_context().all_reduce("sum", nest))
  # A dataclass's field too.
  with pytest.raises(
    TypeError, match=re.escape("ReplicaContext.all_reduce: value[0].name is a str;")
  ):
    strategy.run(lambda: xd.get_replica_context().all_reduce("sum", [Stats(torch.ones(1), "x")]))
  with pytest.raises(ValueError, match=re.escape("'avg' is not a reduction")):
    strategy.run(lambda: xd.get_replica_context().all_reduce("avg", torch.ones(1)))


def test_tower_aliases(strategy):
  seen = {}

  def fn():
    ctx = xd.get_tower_context()
    seen["same"] = ctx is xd.get_replica_context()
    seen["tower"] = isinstance(ctx, xd.TowerContext)
    return ctx.tower_id * 1

  out = strategy.run(fn)
  assert seen == {"same": True, "tower": True}
  assert [int(v) for v in local_values(strategy, out)] == [0, 1, 2, 3]


def test_min_max_all_reduce_is_not_differentiable(strategy, per_replica):
  x = per_replica(lambda r: torch.tensor([float(r)]))

  def fn(v):
    v = v.clone().requires_grad_(True)
    xd.get_replica_context().all_reduce("max", v).sum().backward()

  with pytest.raises(
    RuntimeError,
    match=re.escape(
      "ReplicaContext.all_reduce with ReduceOp.MAX is not differentiable; only "
      "ReduceOp.SUM and ReduceOp.MEAN are"
    ),
  ):
    strategy.run(fn, args=(x,))


def test_all_reduce_of_a_distributed_value_inside_the_step_is_rejected(strategy):
  m = xd.Mirrored([torch.ones(1)] * 4)
  with pytest.raises(
    TypeError,
    match=re.escape(
      "ReplicaContext.all_reduce: value is a Mirrored; inside the step each replica passes "
      "its own tensor"
    ),
  ):
    strategy.run(lambda: xd.get_replica_context().all_reduce("sum", m))


def test_all_gather_is_differentiable(strategy, per_replica):
  x = per_replica(lambda r: torch.tensor([float(r + 1), 1.0]))

  def fn(v):
    v = v.clone().requires_grad_(True)
    g = xd.get_replica_context().all_gather(v, 0)  # (8,) on every replica
    weights = torch.arange(8, dtype=torch.float32, device=g.device)
    (g * weights).sum().backward()
    return v.grad

  # Replica r's elements sit at 2r, 2r+1; all 4 replicas' losses use them.
  grads = local_values(strategy, strategy.run(fn, args=(x,)))
  assert [g.tolist() for g in grads] == [[4.0 * 2 * r, 4.0 * (2 * r + 1)] for r in range(4)]
