"""MirroredStrategy's cross-replica API on 4 replicas, checked against numpy."""

import collections
import re

import numpy as np
import pytest
import torch
from conftest import local_values

import xladist as xd
from xladist.runtime import xla as _runtime

Point = collections.namedtuple("Point", "x y")
VALS = np.arange(24, dtype=np.float32).reshape(4, 2, 3) - 7.0  # replica r holds VALS[r]


@pytest.fixture
def v(per_replica):
  return per_replica(lambda r: torch.from_numpy(VALS[r].copy()))


def test_run_traces_fn_once_and_passes_structures_through(strategy, per_replica):
  calls = []
  x = per_replica(lambda r: {"a": torch.full((2,), float(r)), "b": (torch.tensor(r), "tag")})

  def fn(inp, scale, point, flag=None):
    calls.append(1)
    assert inp["a"].shape == (2,) and inp["b"][1] == "tag" and flag == "on"
    return Point(inp["a"] * scale + point.x, [inp["b"][0] + point.y, None, "text"])

  out = strategy.run(
    fn, args=(x, 10.0, Point(torch.tensor(1.0), torch.tensor(5))), kwargs={"flag": "on"}
  )
  assert len(calls) == 1
  assert isinstance(out, Point) and out.y[1] is None and out.y[2] == "text"
  assert isinstance(out.x, xd.PerReplica)
  assert [t.tolist() for t in local_values(strategy, out.x)] == [
    [10 * r + 1.0] * 2 for r in range(4)
  ]
  assert [int(t) for t in local_values(strategy, out.y[0])] == [5, 6, 7, 8]


def test_run_output_shapes_are_per_replica_shapes(strategy, v):
  out = strategy.run(lambda x: (x, x.sum()), args=(v,))
  assert [t.shape for t in out[0].values] == [torch.Size([2, 3])] * 4
  assert [t.shape for t in out[1].values] == [torch.Size([])] * 4
  np.testing.assert_array_equal(np.stack([t.numpy() for t in local_values(strategy, out[0])]), VALS)


def test_run_with_plain_and_mirrored_tensors(strategy):
  m = xd.Mirrored([torch.tensor([1.0, 2.0])] * 4)
  out = strategy.run(
    lambda a, b: a + b + xd.get_replica_context().replica_id_in_sync_group,
    args=(torch.tensor([10.0, 20.0]), m),
  )
  assert [t.tolist() for t in local_values(strategy, out)] == [
    [11.0 + r, 22.0 + r] for r in range(4)
  ]


def test_run_output_feeds_the_next_run(strategy, v):
  once = strategy.run(lambda x: x * 2, args=(v,))
  twice = strategy.run(lambda x: x + 1, args=(once,))
  np.testing.assert_array_equal(
    np.stack([t.numpy() for t in local_values(strategy, twice)]), VALS * 2 + 1
  )


@pytest.mark.parametrize(
  "op,axis,ref",
  [
    ("sum", None, lambda a: a.sum(0)),
    ("mean", None, lambda a: a.mean(0)),
    ("min", None, lambda a: a.min(0)),
    ("max", None, lambda a: a.max(0)),
    ("sum", 0, lambda a: a.sum((0, 1))),
    ("mean", 1, lambda a: a.mean((0, 2))),
    ("max", -1, lambda a: a.max((0, 2))),
    (xd.ReduceOp.MIN, 1, lambda a: a.min((0, 2))),
  ],
)
def test_reduce(strategy, v, op, axis, ref):
  for value in (v, strategy.run(lambda x: x * 1, args=(v,))):
    got = strategy.reduce(op, value, axis=axis)
    np.testing.assert_allclose(got.cpu().numpy(), ref(VALS), rtol=1e-6)


def test_reduce_mirrored_and_plain_values(strategy):
  m = xd.Mirrored([torch.tensor(3.0)] * 4)
  assert strategy.reduce("sum", m, axis=None).item() == 12.0
  assert strategy.reduce("mean", m, axis=None).item() == 3.0
  assert strategy.reduce("mean", torch.tensor([1.0, 3.0]), axis=0).item() == 2.0
  with pytest.raises(
    ValueError, match=re.escape("cannot be reduced with ReduceOp.SUM over 4 replicas")
  ):
    strategy.reduce("sum", torch.tensor(1.0), axis=None)


def test_reduce_errors(strategy, v):
  with pytest.raises(
    ValueError, match=re.escape("axis 3 is out of range for a per-replica value of rank 2")
  ):
    strategy.reduce("sum", v, axis=3)
  with pytest.raises(ValueError, match=re.escape("'prod' is not a reduction")):
    strategy.reduce("prod", v, axis=None)
  with pytest.raises(TypeError, match=re.escape("expected a ReduceOp or its name, got int")):
    strategy.reduce(1, v, axis=None)
  with pytest.raises(
    RuntimeError,
    match=re.escape(
      "strategy.reduce requires being in cross-replica context, but it was called in a "
      "replica context"
    ),
  ):
    strategy.run(lambda: strategy.reduce("sum", torch.ones(()), axis=None))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather(strategy, v, axis):
  got = strategy.gather(v, axis=axis)
  np.testing.assert_array_equal(got.cpu().numpy(), np.concatenate(list(VALS), axis=axis))
  out = strategy.run(lambda x: x, args=(v,))
  np.testing.assert_array_equal(
    strategy.gather(out, axis).cpu().numpy(), np.concatenate(list(VALS), axis=axis)
  )


def test_gather_errors(strategy, per_replica):
  with pytest.raises(ValueError, match=re.escape("must have rank >= 1")):
    strategy.gather(per_replica(lambda r: torch.tensor(float(r))), axis=0)
  with pytest.raises(
    RuntimeError, match=re.escape("Use get_replica_context().all_gather() inside a step")
  ):
    strategy.run(lambda: strategy.gather(torch.ones(1), 0))


def test_experimental_local_results(strategy, v):
  assert strategy.experimental_local_results(3) == (3,)
  m = xd.Mirrored([torch.ones(1)] * 4)
  assert len(strategy.experimental_local_results(m)) == 4
  assert len(strategy.experimental_local_results(v)) == 4
  assert strategy.unwrap(v) == strategy.experimental_local_results(v)


def test_distribute_values_from_function(strategy):
  seen = []

  def value_fn(ctx):
    seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
    return {"x": torch.tensor([ctx.replica_id_in_sync_group]), "name": "same"}

  value = strategy.experimental_distribute_values_from_function(value_fn)
  assert seen == [(r, 4) for r in range(4)]
  # TF wraps every leaf, a constant too (regroup(..., always_wrap=True)).
  assert isinstance(value["name"], xd.PerReplica) and isinstance(value["x"], xd.PerReplica)
  assert value["name"].values == ("same",) * 4
  assert [t.item() for t in value["x"].values] == [0, 1, 2, 3]
  with pytest.raises(TypeError, match=re.escape("value_fn must be callable, got int")):
    strategy.experimental_distribute_values_from_function(5)


def test_distribute_values_keeps_containers_and_state_dict_metadata(strategy):
  meta = torch.nn.Linear(2, 2).state_dict()._metadata

  def value_fn(ctx):
    r = ctx.replica_id_in_sync_group
    sd = collections.OrderedDict(weight=torch.full((2,), float(r)), step=torch.tensor(r))
    sd._metadata = meta
    return Point(sd, [torch.tensor(10.0 * r)])

  value = strategy.experimental_distribute_values_from_function(value_fn)
  assert isinstance(value, Point) and type(value.x) is collections.OrderedDict
  assert value.x._metadata is meta and list(value.x) == ["weight", "step"]
  assert all(isinstance(leaf, xd.PerReplica) for leaf in (*value.x.values(), value.y[0]))
  torch.testing.assert_close(
    torch.stack(value.x["weight"].values),
    torch.arange(4.0).unsqueeze(1).expand(4, 2),
    rtol=0,
    atol=0,
  )
  # A step sees each replica's own components in the same containers.
  out = strategy.run(lambda p: p.x["weight"] * 2 + p.y[0], args=(value,))
  torch.testing.assert_close(
    torch.stack(local_values(strategy, out)),
    torch.tensor([[12.0 * r] * 2 for r in range(4)]),
    rtol=0,
    atol=0,
  )


def test_distribute_values_with_different_shapes_is_rejected(strategy, per_replica):
  x = per_replica(lambda r: torch.ones(r + 1))
  with pytest.raises(
    ValueError,
    match=re.escape(
      "components of a PerReplica must have one shape; got shapes [(1,), (2,), (3,), (4,)]"
    ),
  ):
    strategy.run(lambda a: a, args=(x,))


def test_extended_reduce_to_batch_reduce_to_broadcast_to(strategy, v):
  ext = strategy.extended
  m = ext.reduce_to("sum", v, destinations=ext.worker_devices)
  assert isinstance(m, xd.Mirrored) and len(m.values) == 4
  np.testing.assert_array_equal(m.values[2].cpu().numpy(), VALS.sum(0))
  one = ext.reduce_to("mean", v, destinations="cpu")
  assert isinstance(one, torch.Tensor) and one.device.type == "cpu"
  np.testing.assert_allclose(one.numpy(), VALS.mean(0), rtol=1e-6)
  a, b = ext.batch_reduce_to("max", [(v, v), (v, "xla:0")])
  assert isinstance(a, xd.Mirrored) and isinstance(b, torch.Tensor)
  np.testing.assert_array_equal(b.cpu().numpy(), VALS.max(0))
  bc = ext.broadcast_to(torch.tensor([1.0, 2.0]), destinations=v)
  assert isinstance(bc, xd.Mirrored)
  out = strategy.run(
    lambda t: t * (xd.get_replica_context().replica_id_in_sync_group + 1), args=(bc,)
  )
  assert [t.tolist() for t in local_values(strategy, out)] == [
    [r + 1.0, 2 * r + 2.0] for r in range(4)
  ]


def test_extended_errors(strategy, v):
  ext = strategy.extended
  with pytest.raises(
    ValueError,
    match=re.escape(
      "value_destination_pairs must be a list or tuple of (value, destinations) pairs"
    ),
  ):
    ext.batch_reduce_to("sum", [v])
  with pytest.raises(ValueError, match=re.escape("destinations must be a device")):
    ext.reduce_to("sum", v, destinations=3)
  with pytest.raises(ValueError, match=re.escape("destinations must be a device")):
    ext.reduce_to("sum", v, destinations=[])
  with pytest.raises(
    TypeError, match=re.escape("broadcast_to: expected a tensor, got a PerReplica")
  ):
    ext.broadcast_to(v, "xla:0")
  with pytest.raises(
    RuntimeError, match=re.escape("reduce_to requires being in cross-replica context")
  ):
    strategy.run(lambda: ext.reduce_to("sum", torch.ones(()), "xla:0"))


def test_call_for_each_replica_and_tower_names(strategy, v):
  out = strategy.extended.call_for_each_replica(lambda x, k=0: x + k, args=(v,), kwargs={"k": 1})
  np.testing.assert_array_equal(
    strategy.gather(out, 0).cpu().numpy(), np.concatenate(list(VALS + 1))
  )
  out = strategy.call_for_each_tower(lambda x, k=0: x * k, v, k=2)
  np.testing.assert_array_equal(
    strategy.gather(out, 0).cpu().numpy(), np.concatenate(list(VALS * 2))
  )
  out = strategy.for_each_tower(lambda d: d["x"] - 1, {"x": v})
  np.testing.assert_array_equal(
    strategy.gather(out, 0).cpu().numpy(), np.concatenate(list(VALS - 1))
  )
  assert strategy.num_towers == 4 and strategy.is_single_tower is False
  assert strategy.worker_devices == ("xla:0",) * 4  # devices a tensor can be put on
  assert strategy.parameter_devices == strategy.worker_devices


def test_legacy_reduce_batch_reduce_broadcast_fetch_group(strategy, v):
  total = strategy.reduce("sum", v, strategy.worker_devices)  # tf.contrib: destinations
  assert isinstance(total, xd.Mirrored)
  np.testing.assert_array_equal(total.values[0].cpu().numpy(), VALS.sum(0))
  mean = strategy.reduce("mean", v, destinations="cpu")
  assert mean.device.type == "cpu"
  np.testing.assert_allclose(mean.numpy(), VALS.mean(0), rtol=1e-6)
  s, m = strategy.batch_reduce("sum", [(v, "cpu"), (v, "cpu")])
  np.testing.assert_array_equal(s.numpy(), VALS.sum(0))
  b = strategy.broadcast(torch.tensor(2.0))
  assert isinstance(b, xd.Mirrored) and len(b.values) == 4
  b2 = strategy.broadcast(torch.tensor(2.0), devices=("xla:0", "xla:1"))
  assert isinstance(b2, xd.Mirrored)
  fetched = strategy.fetch(total, fn=lambda t: t * 2)
  assert fetched.device.type == "cpu"
  np.testing.assert_array_equal(fetched.numpy(), 2 * VALS.sum(0))
  with pytest.raises(
    ValueError, match=re.escape("strategy.fetch needs a mirrored value, got a PerReplica")
  ):
    strategy.fetch(v)
  # A step left pending (replay off: a captured step would have run in `run`).
  out = strategy.run(lambda x: x * 3, args=(v,), options=xd.RunOptions(experimental_replay=False))
  before = _runtime.execute_count()
  assert strategy.group(out) is None
  _runtime.wait()
  assert _runtime.execute_count() == before + 1  # group ran the pending step


def test_scala_reductions_and_current_device(strategy):
  assert xd.SumReduction is xd.ReduceOp.SUM and xd.MeanReduction is xd.ReduceOp.MEAN
  assert xd.current_device() == torch.device("cpu")  # default strategy outside scopes
  with strategy.scope():
    assert xd.current_strategy() is strategy
    assert xd.current_device().type == "xla"
  seen = []
  strategy.run(lambda: seen.append(xd.current_device()))
  assert seen[0].type == "xla"
  assert xd.current_update_device() is None


def test_run_argument_errors(strategy):
  with pytest.raises(TypeError, match=re.escape("strategy.run: fn must be callable, got int")):
    strategy.run(3)
  with pytest.raises(
    TypeError,
    match=re.escape(
      "args must be a tuple or list of arguments, got Tensor; pass a single argument as args=(x,)"
    ),
  ):
    strategy.run(lambda x: x, args=torch.ones(1))
  with pytest.raises(TypeError, match=re.escape("kwargs must be a dict, got list")):
    strategy.run(lambda: None, kwargs=[1])
  with pytest.raises(TypeError, match=re.escape("options must be an xladist.RunOptions, got dict")):
    strategy.run(lambda: None, options={})
  assert strategy.run(lambda: 5, options=xd.RunOptions()) == 5
  with pytest.raises(
    RuntimeError, match=re.escape("strategy.run requires being in cross-replica context")
  ):
    strategy.run(lambda: strategy.run(lambda: None))
  with pytest.raises(
    ValueError,
    match=re.escape("a PerReplica with 2 components was passed to a strategy with 4 replicas"),
  ):
    strategy.run(lambda x: x, args=(xd.PerReplica([torch.ones(1), torch.ones(1)]),))
  with pytest.raises(TypeError, match=re.escape("the step function returned a PerReplica")):
    strategy.run(lambda: xd.PerReplica([torch.ones(1)] * 4))


def test_exception_in_fn_propagates_and_leaves_state_intact(strategy):
  with strategy.scope():
    lin = torch.nn.Linear(2, 2)
  before = lin.weight.detach().cpu().clone()

  def fn():
    lin.weight.data.add_(1)
    raise KeyError("boom")

  with pytest.raises(KeyError, match="boom"):
    strategy.run(fn)
  torch.testing.assert_close(lin.weight.detach().cpu(), before, rtol=0, atol=0)
  assert xd.get_strategy() is not strategy  # contexts were unwound


@pytest.mark.parametrize(
  "devices,message",
  [
    (["xla:0", "xla:1"], "mesh must cover every local XLA device"),
    (["xla:0", "xla:0", "xla:1", "xla:2"], "'xla:0' .. 'xla:3', each once"),
    (["cpu", "xla:1", "xla:2", "xla:3"], "'cpu' is not an XLA device"),
    (["/gpu:0"], "'/gpu:0' is not an XLA device"),
  ],
)
def test_mirrored_devices_must_be_all_local_devices(devices, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    xd.MirroredStrategy(devices=devices)


def test_mirrored_device_list_forms():
  assert xd.MirroredStrategy(devices=["xla:3", "xla:1", "xla:0", "xla:2"]).num_replicas_in_sync == 4
  assert (
    xd.MirroredStrategy(devices=[torch.device("xla", i) for i in range(4)]).num_replicas_in_sync
    == 4
  )
  with pytest.raises(TypeError, match=re.escape("devices must be a list of devices, got str")):
    xd.MirroredStrategy(devices="xla:0")
  with pytest.raises(
    TypeError, match=re.escape("cross_device_ops must be an xladist.CrossDeviceOps")
  ):
    xd.MirroredStrategy(cross_device_ops=object())


def test_placement_failure_names_the_cause_and_is_retried(strategy):
  with pytest.raises(
    RuntimeError,
    match=re.escape(
      "could not move Linear.weight (shape (2, 2)) to the strategy's devices: another reference"
    ),
  ):
    with strategy.scope():
      lin = torch.nn.Linear(2, 2)
      after = torch.nn.Linear(2, 2)
      view = lin.weight[0]  # noqa: F841  (the reference that blocks the move)
  # All or nothing: none of the failed module's tensors moved; the others did.
  assert lin.weight.device.type == "cpu" and lin.bias.device.type == "cpu"
  assert after.weight.device.type == "xla"
  # The strategy stays usable for everything else while the reference lives:
  # a retry that fails again raises nothing (issue 34).
  with strategy.scope():
    other = torch.nn.Linear(2, 1)
  out = strategy.run(lambda: other(torch.ones(1, 2, device=other.weight.device)).sum())
  assert [round(float(v), 5) for v in strategy.experimental_local_results(out)] == [
    round(float(other.weight.detach().cpu().sum() + other.bias.detach().cpu().sum()), 5)
  ] * 4
  del view
  strategy.run(lambda: None)  # placement is retried before each run
  assert lin.weight.device.type == "xla" and after.weight.device.type == "xla"


def test_adopting_a_recurrent_model_made_elsewhere(strategy):
  """An LSTM built outside the scope (its weights held by weak references in
  `_flat_weights`) is adopted, and runs with the adopted weights."""
  lstm = torch.nn.LSTM(3, 4, batch_first=True)
  x = torch.randn(2, 5, 3)
  want = lstm(x)[0].detach()
  assert strategy.extended.experimental_adopt(lstm) is lstm
  assert all(p.device.type == "xla" for p in lstm.parameters())
  out = strategy.run(lambda x: lstm(x)[0], args=(x,))
  for got in strategy.experimental_local_results(out):
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


def test_merge_call_values_cannot_outlive_the_step(strategy):
  kept = {}

  def merge_fn(s, v):
    kept["v"] = v
    return s.reduce("sum", v, axis=None)

  strategy.run(lambda: xd.get_replica_context().merge_call(merge_fn, args=(torch.ones(()),)))
  message = "belongs to a strategy.run call that has returned"
  with pytest.raises(RuntimeError, match=re.escape(message)):
    strategy.reduce("sum", kept["v"], axis=None)
  with pytest.raises(RuntimeError, match=re.escape(message)):
    kept["v"].values
  with pytest.raises(
    ValueError,
    match=re.escape("a PerReplica made inside merge_call cannot be passed to another strategy.run"),
  ):
    strategy.run(lambda x: x, args=(kept["v"],))


def test_axis_type_and_structure_errors(strategy, v):
  with pytest.raises(
    TypeError, match=re.escape("strategy.gather: axis must be an int or None, got str")
  ):
    strategy.gather(v, axis="0")
  with pytest.raises(
    ValueError,
    match=r"value_fn returned differently structured values for different replicas "
    r"\(replica 0: PyTreeSpec\(\(\*,\).*\), replica 1: PyTreeSpec\(\(\*, \*\)",
  ):
    strategy.experimental_distribute_values_from_function(
      lambda ctx: (torch.ones(1),) * (1 + ctx.replica_id_in_sync_group % 2)
    )
  with pytest.raises(
    RuntimeError, match=re.escape("strategy.group requires being in cross-replica context")
  ):
    strategy.run(lambda: strategy.group(torch.ones(1)))


def test_contexts_exited_out_of_order_raise(strategy):
  outer, inner = strategy.scope(), strategy.scope()
  outer.__enter__()
  inner.__enter__()
  with pytest.raises(RuntimeError, match=re.escape("xladist contexts were exited out of order")):
    outer.__exit__(None, None, None)
  inner.__exit__(None, None, None)
  outer.__exit__(None, None, None)
  assert not xd.has_strategy()
