"""CrossDeviceOps and CommunicationOptions on 4 replicas: values, packing (HLO), errors."""

import math
import re
import time

import _models
import numpy as np
import pytest
import torch
from conftest import local_values

import xladist as xd
from xladist.experimental import CommunicationImplementation, CommunicationOptions
from xladist.runtime import xla as _runtime

N = 4
IMPLEMENTATIONS = {
  "default": lambda: None,
  "nccl1": lambda: xd.NcclAllReduce(num_packs=1),
  "nccl0": lambda: xd.NcclAllReduce(num_packs=0),
  "hierarchical2": lambda: xd.HierarchicalCopyAllReduce(num_packs=2),
  "one_device": lambda: xd.ReductionToOneDevice(),
}

# Traced and left lazy (replay off for this run): its program's HLO is readable.
LAZY = xd.RunOptions(experimental_replay=False)


def _all_reduces(hlo):
  return len(re.findall(r" all-reduce\(", hlo))


def _numpy_values(seed=0):
  """Per-replica numpy values: a (3,) and a (2, 2) float32 array and a (2,) int64 one."""
  rng = np.random.default_rng(seed)
  return [
    (
      rng.standard_normal(3).astype(np.float32),
      rng.standard_normal((2, 2)).astype(np.float32),
      rng.integers(-50, 50, 2).astype(np.int64),
    )
    for _ in range(N)
  ]


def _per_replica(strategy, arrays):
  return strategy.experimental_distribute_values_from_function(
    lambda c: tuple(torch.from_numpy(a) for a in arrays[c.replica_id_in_sync_group])
  )


def _reference(op, arrays, k):
  stacked = np.stack([a[k] for a in arrays])
  if op == "sum":
    return stacked.sum(0)
  if stacked.dtype.kind == "i":
    return stacked.sum(0) // N  # floor of the mean, dtype kept (ReplicaContext.all_reduce)
  return stacked.mean(0)


def _close(actual, expected):
  actual = torch.as_tensor(actual).detach().cpu().numpy()
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_reduce_and_batch_reduce_of_run_outputs_match_numpy(name, op):
  ops = IMPLEMENTATIONS[name]()
  strategy = xd.MirroredStrategy(cross_device_ops=ops)
  arrays = _numpy_values()
  a, b, c = strategy.run(
    lambda v: (v[0] * 2, v[1] + 1, v[2]), args=(_per_replica(strategy, arrays),)
  )
  ints = np.stack([x[2] for x in arrays])
  r = strategy.reduce(op, c, axis=None)
  if op == "mean":  # strategy.reduce: the mean of integers is a float
    assert r.dtype == torch.float32
    _close(r, ints.mean(0))
  else:
    assert r.dtype == torch.int64
    np.testing.assert_array_equal(r.cpu().numpy(), ints.sum(0))
  ref_a = _reference(op, [(x[0] * 2,) for x in arrays], 0)
  ref_b = _reference(op, [(x[1] + 1,) for x in arrays], 0)
  _close(strategy.extended.reduce_to(op, a, "cpu"), ref_a)
  _close(strategy.reduce(op, b, axis=None), ref_b)
  ra, rb = strategy.extended.batch_reduce_to(op, [(a, "cpu"), (b, "cpu")])
  _close(ra, ref_a)
  _close(rb, ref_b)
  if ops is not None:  # the CrossDeviceOps' own public methods, in cross-replica context
    with strategy.scope():
      _close(ops.reduce(op, a, "cpu"), ref_a)
      ra, rb = ops.batch_reduce(op, [(a, "cpu"), (b, "cpu")])
    _close(ra, ref_a)
    _close(rb, ref_b)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_batch_reduce_inside_merge_call_and_all_reduce_match_numpy(name, op):
  ops = IMPLEMENTATIONS[name]()
  strategy = xd.MirroredStrategy(cross_device_ops=ops)
  arrays = _numpy_values(1)

  def merge_fn(s, a, b):
    r = s.extended.batch_reduce_to(op, [(a, a), (b, b)])
    if ops is not None:
      r += ops.batch_reduce(op, [(a, a), (b, b)])
    return r

  def fn(v):
    ctx = xd.get_replica_context()
    merged = ctx.merge_call(merge_fn, args=(v[0], v[1]))
    nested = ctx.all_reduce(op, {"x": v[0], "y": [v[1], v[2]]})
    return merged, nested

  merged, nested = strategy.run(fn, args=(_per_replica(strategy, arrays),))
  refs = [_reference(op, arrays, k) for k in range(3)]
  assert len(merged) == (2 if ops is None else 4)
  for i, m in enumerate(merged):
    for v in local_values(strategy, m):
      _close(v, refs[i % 2])
  for v in local_values(strategy, nested["x"]):
    _close(v, refs[0])
  for v in local_values(strategy, nested["y"][0]):
    _close(v, refs[1])
  for v in local_values(strategy, nested["y"][1]):
    assert v.dtype == torch.int64
    np.testing.assert_array_equal(v.numpy(), refs[2])


def _recording_max(calls):
  def accumulate(values):
    calls.append([tuple(v.shape) for v in values])
    return torch.stack(values).amax(0)

  return accumulate


def test_accumulation_fn_is_called_with_the_list_of_replica_values():
  calls = []
  ops = xd.ReductionToOneDevice(accumulation_fn=_recording_max(calls))
  strategy = xd.MirroredStrategy(cross_device_ops=ops)
  arrays = _numpy_values(2)
  ref_max = np.stack([a[0] for a in arrays]).max(0)

  def fn(v):
    ctx = xd.get_replica_context()
    merged = ctx.merge_call(lambda s, a: s.extended.reduce_to("sum", a, a), args=(v[0],))
    return merged, ctx.all_reduce("mean", v[0])

  merged, mean = strategy.run(fn, args=(_per_replica(strategy, arrays),))
  assert calls == [[(3,)] * N, [(3,)] * N]  # merge_call, then all_reduce
  for v in local_values(strategy, merged):
    _close(v, ref_max)  # SUM through accumulation_fn = the max
  for v in local_values(strategy, mean):
    _close(v, ref_max / N)  # MEAN divides the accumulated value by N
  # Outside a step: the components are stacked and accumulated the same way.
  out = strategy.run(lambda v: v[0] * 1, args=(_per_replica(strategy, arrays),))
  _close(strategy.reduce("sum", out, axis=None), ref_max)
  assert len(calls) == 3 and calls[-1] == [(3,)] * N


def test_gradient_aggregation_uses_the_strategy_cross_device_ops():
  calls = []
  strategy = xd.MirroredStrategy(
    cross_device_ops=xd.ReductionToOneDevice(
      accumulation_fn=lambda vs: (calls.append(len(vs)), torch.stack(vs).sum(0))[1]
    )
  )
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", N, steps=3)
  ref_losses, ref_state = _models.train_reference("mlp", state, xs, ys)
  losses, final = _models.train_xladist(strategy, "mlp", state, xs, ys)
  assert calls.count(N) >= 3 * 6  # six gradients per step went through accumulation_fn
  _models.assert_close_to_scale(losses, ref_losses, 1e-5)
  _models.assert_close_to_scale(final, ref_state, 1e-5)


def _all_reduce_200(strategy, options=None, merge=False):
  """Traces one batch reduction of 200 f32[10] tensors; returns (outputs, HLO)."""

  def fn():
    ctx = xd.get_replica_context()
    rid = ctx.replica_id_in_sync_group.float()
    ts = [torch.full((10,), float(i), device=_runtime.device()) + rid for i in range(200)]
    if merge:
      return ctx.merge_call(
        lambda s, *vs: s.extended.batch_reduce_to("sum", [(v, v) for v in vs], options), args=ts
      )
    return ctx.all_reduce("sum", ts, options)

  out = strategy.run(fn, options=LAZY)
  return out, _runtime.hlo_text([o._stacked for o in out])


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("bytes_per_pack", [400, 1000, 3000, 8000, 1 << 20])
def test_bytes_per_pack_gives_ceil_total_over_bucket_all_reduces(bytes_per_pack, merge):
  strategy = xd.MirroredStrategy()
  out, hlo = _all_reduce_200(strategy, CommunicationOptions(bytes_per_pack=bytes_per_pack), merge)
  assert _all_reduces(hlo) == math.ceil(200 * 10 * 4 / bytes_per_pack)
  for i in (0, 57, 199):
    for v in local_values(strategy, out[i]):
      assert v.tolist() == [4.0 * i + 6.0] * 10


@pytest.mark.parametrize("num_packs", [0, 1, 2, 5])
@pytest.mark.parametrize("cls", [xd.NcclAllReduce, xd.HierarchicalCopyAllReduce])
def test_num_packs_gives_exactly_num_packs_all_reduces(cls, num_packs):
  strategy = xd.MirroredStrategy(cross_device_ops=cls(num_packs=num_packs))
  for merge in (False, True):
    out, hlo = _all_reduce_200(strategy, merge=merge)
    assert _all_reduces(hlo) == (num_packs or 200)
    for v in local_values(strategy, out[199]):
      assert v.tolist() == [4.0 * 199 + 6.0] * 10


def test_default_packs_one_per_dtype_and_call_options_beat_num_packs():
  _, hlo = _all_reduce_200(xd.MirroredStrategy())
  assert _all_reduces(hlo) == 1
  strategy = xd.MirroredStrategy(cross_device_ops=xd.NcclAllReduce(num_packs=5))
  _, hlo = _all_reduce_200(strategy, CommunicationOptions(bytes_per_pack=4000))
  assert _all_reduces(hlo) == 2
  # The strategy's communication_options apply to every call.
  strategy = xd.MirroredStrategy(communication_options=CommunicationOptions(bytes_per_pack=1000))
  _, hlo = _all_reduce_200(strategy)
  assert _all_reduces(hlo) == 8
  # ReductionToOneDevice packs its gathers the same way.
  strategy = xd.MirroredStrategy(cross_device_ops=xd.ReductionToOneDevice())
  out, hlo = _all_reduce_200(strategy)
  assert _all_reduces(hlo) == 1
  _, hlo = _all_reduce_200(strategy, CommunicationOptions(bytes_per_pack=1000))
  assert _all_reduces(hlo) == 8
  assert [v.tolist() for v in local_values(strategy, out[3])] == [[18.0] * 10] * N


def test_num_packs_per_dtype():
  strategy = xd.MirroredStrategy(cross_device_ops=xd.NcclAllReduce(num_packs=2))

  def fn():
    ctx = xd.get_replica_context()
    rid = ctx.replica_id_in_sync_group
    ts = [rid.float() + i for i in range(6)] + [rid + i for i in range(6)] + [rid.double()]
    return ctx.all_reduce("sum", ts)

  out = strategy.run(fn, options=LAZY)
  # f32: 2 packs, s32: 2 packs, f64: one tensor, one all-reduce.
  assert _all_reduces(_runtime.hlo_text([o._stacked for o in out])) == 5
  assert [int(v) for v in local_values(strategy, out[8])] == [6 + 4 * 2] * N


class _ManyLinears(torch.nn.Module):
  def __init__(self, n=50, width=4):
    super().__init__()
    self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

  def forward(self, x):
    for layer in self.layers:
      x = torch.tanh(layer(x))
    return x


@pytest.mark.parametrize(
  "ops, limit",
  [(None, 1), (xd.NcclAllReduce(num_packs=4), 4), (xd.HierarchicalCopyAllReduce(num_packs=2), 2)],
)
def test_training_step_of_100_tensors_has_at_most_its_pack_count(ops, limit):
  strategy = xd.MirroredStrategy(cross_device_ops=ops)
  torch.manual_seed(0)
  with strategy.scope():
    model = _ManyLinears()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
  assert len(list(model.parameters())) == 100

  def step(x):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  x = strategy.experimental_distribute_values_from_function(
    lambda c: torch.randn(2, 4, generator=torch.Generator().manual_seed(c.replica_id_in_sync_group))
  )
  strategy.run(step, args=(x,), options=LAZY)
  hlo = _runtime.hlo_text(list(model.parameters()))
  assert 1 <= _all_reduces(hlo) <= limit
  _runtime.sync()


def test_per_tensor_all_reduce_of_a_training_step():
  strategy = xd.MirroredStrategy(cross_device_ops=xd.NcclAllReduce(num_packs=0))
  with strategy.scope():
    model = _ManyLinears(n=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

  def step(x):
    model(x).sum().backward()
    opt.step()

  strategy.run(step, args=(torch.ones(2, 4),), options=LAZY)
  assert _all_reduces(_runtime.hlo_text(list(model.parameters()))) == 10
  _runtime.sync()


def test_broadcast():
  strategy = xd.MirroredStrategy()
  ops = xd.NcclAllReduce()
  with strategy.scope():
    m = ops.broadcast(torch.tensor([1.0, 2.0]), strategy.extended.worker_devices)
    t = ops.broadcast(torch.tensor([3.0]), "cpu")
  assert isinstance(m, xd.Mirrored) and len(m.values) == N
  assert m.primary.cpu().tolist() == [1.0, 2.0]
  assert t.tolist() == [3.0]


def test_timeout_bounds_the_host_wait(monkeypatch):
  strategy = xd.MirroredStrategy()
  arrays = _numpy_values(3)
  out = strategy.run(lambda v: v[0] + 1, args=(_per_replica(strategy, arrays),))
  ref = np.stack([a[0] + 1 for a in arrays]).sum(0)
  r = strategy.extended.reduce_to("sum", out, "cpu", CommunicationOptions(timeout_seconds=60))
  _close(r, ref)

  monkeypatch.setattr(_runtime, "_wait_device_ops", lambda: time.sleep(2))
  out = strategy.run(lambda v: v[0] + 1, args=(_per_replica(strategy, arrays),))
  start = time.perf_counter()
  with pytest.raises(
    TimeoutError,
    match=re.escape(
      "reduce_to: the reduction did not finish within 0.1 s (CommunicationOptions.timeout_seconds)"
    ),
  ):
    strategy.extended.reduce_to("sum", out, "cpu", CommunicationOptions(timeout_seconds=0.1))
  assert time.perf_counter() - start < 1.5
  with pytest.raises(
    TimeoutError, match="batch_reduce_to: the reduction did not finish within 0.2 s"
  ):
    strategy.extended.batch_reduce_to(
      "sum", [(out, "cpu")], CommunicationOptions(timeout_seconds=0.2)
    )
  # Results left on the device are not waited for.
  r = strategy.extended.reduce_to("sum", out, "xla:0", CommunicationOptions(timeout_seconds=0.1))
  monkeypatch.undo()
  _close(r, ref)


def test_wait_reraises_errors_of_the_wait(monkeypatch):
  def fail():
    raise RuntimeError("device lost")

  monkeypatch.setattr(_runtime, "_wait_device_ops", fail)
  with pytest.raises(RuntimeError, match="device lost"):
    _runtime.wait(5)


def test_communication_options_fields():
  o = CommunicationOptions(bytes_per_pack=64, timeout_seconds=1.5, implementation="nccl")
  assert o.implementation is CommunicationImplementation.NCCL
  assert CommunicationOptions().implementation is CommunicationImplementation.AUTO
  merged = CommunicationOptions(bytes_per_pack=8, timeout_seconds=3).merge(
    CommunicationOptions(timeout_seconds=5)
  )
  assert (merged.bytes_per_pack, merged.timeout_seconds) == (8, 5)
  with pytest.raises(dataclasses_error()):
    o.bytes_per_pack = 1
  assert xd.experimental.CommunicationOptions is CommunicationOptions


def dataclasses_error():
  import dataclasses

  return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (
      {"bytes_per_pack": -1},
      ValueError,
      "bytes_per_pack must be >= 0 (0 = automatic packing), got -1",
    ),
    ({"bytes_per_pack": 1.5}, TypeError, "bytes_per_pack must be an int >= 0, got float 1.5"),
    ({"bytes_per_pack": True}, TypeError, "bytes_per_pack must be an int >= 0, got bool"),
    (
      {"timeout_seconds": 0},
      ValueError,
      "timeout_seconds must be None or inf (no bound) or a positive",
    ),
    ({"timeout_seconds": -2.0}, ValueError, "got -2.0"),
    (
      {"timeout_seconds": "1"},
      TypeError,
      "timeout_seconds must be None or a positive number, got str",
    ),
    (
      {"implementation": "tree"},
      ValueError,
      "implementation 'tree' is not one of ['AUTO', 'RING', 'NCCL']",
    ),
    (
      {"implementation": 3},
      TypeError,
      "implementation must be a CommunicationImplementation or its name, got int",
    ),
  ],
)
def test_communication_options_validation(kwargs, error, message):
  with pytest.raises(error, match=re.escape(message)):
    CommunicationOptions(**kwargs)


def test_constructor_errors():
  with pytest.raises(
    TypeError,
    match=re.escape(
      "MirroredStrategy: cross_device_ops must be an xladist.CrossDeviceOps (e.g. "
      "xd.NcclAllReduce(num_packs=1)"
    ),
  ):
    xd.MirroredStrategy(cross_device_ops="x")
  with pytest.raises(
    TypeError,
    match=re.escape(
      "MirroredStrategy(communication_options=...): expected an "
      "xladist.experimental.CommunicationOptions or None, got dict"
    ),
  ):
    xd.MirroredStrategy(communication_options={})
  with pytest.raises(
    ValueError, match=re.escape("NCCL all-reduce requires num_packs >= 0, but -1 is specified")
  ):
    xd.NcclAllReduce(num_packs=-1)
  with pytest.raises(
    ValueError, match=re.escape("HierarchicalCopy requires num_packs >= 0, but -2 is specified")
  ):
    xd.HierarchicalCopyAllReduce(num_packs=-2)
  with pytest.raises(
    TypeError,
    match=re.escape("NcclAllReduce(num_packs): num_packs must be an int >= 0, got float 2.0"),
  ):
    xd.NcclAllReduce(num_packs=2.0)
  with pytest.raises(
    TypeError,
    match=re.escape(
      "ReductionToOneDevice(accumulation_fn): expected a function from a list of "
      "tensors to a tensor, got int"
    ),
  ):
    xd.ReductionToOneDevice(accumulation_fn=3)
  with pytest.raises(
    TypeError,
    match=re.escape(
      "ReductionToOneDevice(reduce_to_device): expected None, a device name or a "
      "torch.device, got int"
    ),
  ):
    xd.ReductionToOneDevice(reduce_to_device=0)
  assert repr(xd.NcclAllReduce(num_packs=3)) == "NcclAllReduce(num_packs=3)"
  assert xd.ReductionToOneDevice("xla:0").reduce_to_device == "xla:0"


@pytest.mark.parametrize(
  "pairs, got",
  [
    ([torch.ones(2)], "a list containing Tensor"),
    ([(1.0, "cpu")], "a list containing tuple (1.0, 'cpu')"),
    ([["pr", "cpu"]], "a list containing list"),
    ([], "got an empty list"),
    ("pairs", "got str"),
  ],
)
def test_batch_reduce_rejects_malformed_pairs(strategy, pairs, got):
  with pytest.raises(
    ValueError,
    match=re.escape(
      "NcclAllReduce.batch_reduce: value_destination_pairs should be a list or tuple "
      "of tuples of PerReplica objects and destinations, "
    ),
  ) as info:
    xd.NcclAllReduce().batch_reduce("sum", pairs)
  assert got in str(info.value)


def test_call_errors(strategy, per_replica):
  ops = xd.ReductionToOneDevice()
  v = per_replica(lambda r: torch.tensor([float(r)]))
  with pytest.raises(
    ValueError,
    match=re.escape(
      "ReductionToOneDevice.reduce: per_replica_value must be a PerReplica, Mirrored, "
      "variable or tensor, got list"
    ),
  ):
    ops.reduce("sum", [1.0], "cpu")
  with pytest.raises(
    ValueError, match=re.escape("ReductionToOneDevice.reduce: destinations must be a device")
  ):
    ops.reduce("sum", v, [])
  with pytest.raises(
    ValueError, match=re.escape("ReductionToOneDevice.batch_reduce: destinations must be a device")
  ):
    ops.batch_reduce("sum", [(v, None)])
  with pytest.raises(
    TypeError,
    match=re.escape(
      "ReductionToOneDevice.reduce: options must be an "
      "xladist.experimental.CommunicationOptions or None, got dict"
    ),
  ):
    ops.reduce("sum", v, "cpu", options={})
  with pytest.raises(
    TypeError,
    match=re.escape(
      "ReductionToOneDevice.broadcast: expected a tensor, a Mirrored or a mirrored "
      "variable, got a PerReplica"
    ),
  ):
    ops.broadcast(v, "cpu")
  with pytest.raises(ValueError, match=re.escape("ReductionToOneDevice.broadcast: destinations")):
    ops.broadcast(torch.ones(1), 3)
  with pytest.raises(
    TypeError,
    match=re.escape(
      "reduce_to: options must be an xladist.experimental.CommunicationOptions or None, got int"
    ),
  ):
    strategy.extended.reduce_to("sum", v, "cpu", options=3)
  with pytest.raises(TypeError, match=re.escape("batch_reduce_to: options must be")):
    strategy.extended.batch_reduce_to("sum", [(v, "cpu")], options="fast")

  def fn(x):
    return xd.get_replica_context().all_reduce("sum", x, options=8)

  with pytest.raises(
    TypeError,
    match=re.escape(
      "ReplicaContext.all_reduce: options must be an xladist.experimental.CommunicationOptions"
    ),
  ):
    strategy.run(fn, args=(v,))


def test_reduction_to_one_device_min_max_and_integers(strategy, per_replica):
  s = xd.MirroredStrategy(cross_device_ops=xd.ReductionToOneDevice())
  ints = s.experimental_distribute_values_from_function(
    lambda c: torch.tensor([c.replica_id_in_sync_group * 3 - 4, 7])
  )

  def fn(v):
    ctx = xd.get_replica_context()
    return (
      ctx.all_reduce("min", v),
      ctx.all_reduce("max", v),
      ctx.all_reduce("mean", v),
      ctx.all_reduce("sum", v > 0),
    )

  lo, hi, mean, count = s.run(fn, args=(ints,))
  # Replica values: [-4, 7], [-1, 7], [2, 7], [5, 7].
  assert [v.tolist() for v in local_values(s, lo)] == [[-4, 7]] * N
  assert [v.tolist() for v in local_values(s, hi)] == [[5, 7]] * N
  assert [v.tolist() for v in local_values(s, mean)] == [[0, 7]] * N  # floor(2 / 4), 7
  assert [v.tolist() for v in local_values(s, count)] == [[2, 4]] * N


def test_all_reduce_through_reduction_to_one_device_is_differentiable():
  s = xd.MirroredStrategy(cross_device_ops=xd.ReductionToOneDevice())
  x = s.experimental_distribute_values_from_function(
    lambda c: torch.tensor([float(c.replica_id_in_sync_group + 1)])
  )

  def fn(v):
    v = v.clone().requires_grad_(True)
    total = xd.get_replica_context().all_reduce("sum", v * v)
    total.sum().backward()
    return v.grad

  # d/dv_r of sum_s (sum_q v_q^2) over the 4 replicas' losses = 4 * 2 v_r.
  assert [v.tolist() for v in local_values(s, s.run(fn, args=(x,)))] == [
    [8.0 * r] for r in range(1, 5)
  ]


@pytest.mark.parametrize(
  "ops, reductions",
  [(None, 2), (xd.NcclAllReduce(num_packs=3), 4), (xd.NcclAllReduce(num_packs=0), 21)],
)
def test_batch_reduce_of_run_outputs_is_packed(ops, reductions):
  # Outside a step the values are global (N, ...) tensors: one pack is one
  # concatenated reduction over the replica dim, which XLA's partitioner turns
  # into one all-reduce (checked in XLA:CPU's optimised HLO).
  strategy = xd.MirroredStrategy(cross_device_ops=ops)
  arrays = _numpy_values(4)
  outs = strategy.run(
    lambda v: [v[0] * i for i in range(20)] + [v[2]],
    args=(_per_replica(strategy, arrays),),
    options=LAZY,
  )
  host = xd.PerReplica([torch.tensor([float(r)]) for r in range(N)])  # reduced on its own
  pairs = [(o, "xla:0") for o in outs] + [(host, "cpu")]
  reduced = strategy.extended.batch_reduce_to("mean", pairs)
  hlo = _runtime.hlo_text(reduced[:-1])
  assert len(re.findall(r" reduce\(", hlo)) == reductions  # f32 packs + the s64 value
  for i in (0, 7, 19):
    _close(reduced[i], np.stack([a[0] * i for a in arrays]).mean(0))
  _close(reduced[20], np.stack([a[2] for a in arrays]).mean(0))
  _close(reduced[21], [1.5])
