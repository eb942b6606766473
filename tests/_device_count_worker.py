"""Runs in a subprocess with CPU_NUM_DEVICES set: xladist results for one device count.

usage: python _device_count_worker.py OUT_FILE
Writes a dict to OUT_FILE (torch.save); the parent test compares it with plain
PyTorch references it computes itself.
"""

import sys

import _models
import torch
from torch.utils.data import DataLoader

import xladist as xd


def main(out_file):
  strategy = xd.MirroredStrategy()
  n = strategy.num_replicas_in_sync
  result = {"num_replicas": n}

  def merge_fn(s, v):
    return s.reduce(xd.ReduceOp.SUM, v, axis=None)

  def fn(three):
    ctx = xd.get_replica_context()
    v = three + ctx.replica_id_in_sync_group
    return ctx.merge_call(merge_fn, args=(v,)) + v

  out = strategy.run(fn, args=(torch.tensor(3.0),))
  result["merge_type"] = type(out).__name__
  result["merge"] = [float(v) for v in strategy.experimental_local_results(out)]
  for kind in ("mlp", "cnn"):
    state = _models.initial_state(kind)
    xs, ys = _models.make_data(kind, n)
    losses, final = _models.train_xladist(strategy, kind, state, xs, ys)
    result[kind] = {"state": state, "xs": xs, "ys": ys, "losses": losses, "final": final}
  if n > 1:
    result["logical"] = logical_devices(n)
  result["input"] = input_without_batch_dim(strategy)
  result["tf_semantics"] = tf_semantics(strategy)
  torch.save(result, out_file)


def _local(strategy, value):
  return [torch.as_tensor(v).cpu().tolist() for v in strategy.experimental_local_results(value)]


def _error(fn):
  try:
    fn()
  except ValueError as e:
    return str(e)
  return None


def input_without_batch_dim(strategy):
  """Elements without a batch dim (tests/test_tf_input.py has the TF tests each
  case mirrors): per-replica scalars and tuples of them, scalars given to
  experimental_distribute_dataset, and TF's uneven per-replica batches."""
  out = {}
  scalars = strategy.distribute_datasets_from_function(
    lambda ctx: [torch.tensor(i) for i in range(10)]
  )
  out["spec"] = scalars.element_spec
  out["scalars"] = [_local(strategy, x) for x in scalars]
  first = next(iter(scalars))
  ids = strategy.run(
    lambda v: v * 100 + xd.get_replica_context().replica_id_in_sync_group, (first,)
  )
  out["run"] = _local(strategy, ids)
  out["local_type"] = type(strategy.experimental_local_results(first)[0]).__name__
  tuples = strategy.distribute_datasets_from_function(
    lambda ctx: [(torch.tensor(i), torch.tensor(i * i)) for i in range(10)]
  )
  out["tuples"] = [(_local(strategy, a), _local(strategy, b)) for a, b in tuples]
  global_scalars = lambda: list(
    strategy.experimental_distribute_dataset([torch.tensor(i) for i in range(10)])
  )
  out["distribute_dataset_error"] = _error(global_scalars)
  if out["distribute_dataset_error"] is None:
    out["distribute_dataset"] = [_local(strategy, x) for x in global_scalars()]
  uneven = lambda ctx: DataLoader(torch.arange(9), batch_size=2)
  out["uneven_error"] = _error(lambda: strategy.distribute_datasets_from_function(uneven))
  for policy in ("mask", "drop"):
    dist = strategy.distribute_datasets_from_function(
      uneven, xd.InputOptions(experimental_partial_batch=policy)
    )
    if policy == "mask":
      out["uneven_mask"] = [(_local(strategy, x), _local(strategy, m)) for x, m in dist]
    else:
      out["uneven_drop"] = [_local(strategy, x) for x in dist]
  return out


def tf_semantics(strategy):
  """Issue 23's TF cases on this device count (tests/test_tf_strategy.py and
  tests/test_tf_variables.py name the TF test each mirrors): the default
  strategy's reduce and merge_call in its scope, local results of a nest
  without tensors, tower-local variables made in the tower, assign(5.0) of a
  SUM variable made in call_for_each_replica, reduce of a Parameter onto itself."""
  out = {}
  default = xd.get_strategy()

  def plus_one_after_merge():
    return xd.get_replica_context().merge_call(lambda _: torch.tensor(11)) + 1

  with default.scope():
    out["default_reduce"] = float(default.reduce("sum", torch.ones(()), axis=None))
    out["default_merge"] = [
      int(r) for r in default.experimental_local_results(default.run(plus_one_after_merge))
    ]
  with strategy.scope():
    out["merge"] = [
      int(r) for r in strategy.experimental_local_results(strategy.run(plus_one_after_merge))
    ]
    out["nest"] = strategy.experimental_local_results(strategy.run(lambda: {"a": 1.0, "b": 2.0}))

    def model_fn(device_id):
      ctx = xd.get_tower_context()
      with ctx.tower_local_var_scope("sum"):
        v_sum = xd.Variable(1.0)
      with ctx.tower_local_var_scope("mean"):
        v_mean = xd.Variable(4.0)
      v_sum.assign_add(2.0 + device_id)
      v_mean.assign(6.0 * device_id)
      return v_sum, v_mean

    v_sum, v_mean = strategy.call_for_each_tower(model_fn, strategy.worker_device_index)
    out["tower_local"] = [
      [float(c.value if isinstance(c, xd.Variable) else c) for c in strategy.unwrap(v)]
      for v in (v_sum, v_mean)
    ]
    out["fetch"] = [float(strategy.fetch(v_sum)), float(strategy.fetch(v_mean))]
    summed = strategy.extended.call_for_each_replica(lambda: xd.Variable(1.0, aggregation="sum"))
    try:
      strategy.extended.call_for_each_replica(lambda: summed.assign(5.0))
      out["assign_sum"] = float(summed.read_value())
    except ValueError as e:
      out["assign_sum"] = str(e)
    lin = torch.nn.Linear(2, 1)
  reduced = xd.ReductionToOneDevice().reduce("mean", lin.weight, lin.weight)
  out["reduce_variable"] = (
    type(reduced).__name__,
    [
      torch.equal(c.detach().cpu(), lin.weight.detach().cpu())
      for c in strategy.experimental_local_results(reduced)
    ],
  )
  return out


def logical_devices(n):
  """TPUStrategy with 1 x 2 devices (n = 2) and 2 x 4 (n = 8); the MLP's input
  split on the batch, then on the features (n = 2) or on both (n = 8)."""
  k = 2 if n == 2 else 4
  assignment = xd.experimental.DeviceAssignment.build(computation_shape=[k], num_replicas=n // k)
  strategy = xd.TPUStrategy(experimental_device_assignment=assignment)
  out = {}
  for partition in ([k, 1], [1, 2] if k == 2 else [2, 2]):
    state = _models.initial_state("mlp")
    xs, ys = _models.make_data("mlp", n // k, steps=3, b=4)

    def make_forward(model, partition=partition):
      return lambda x: model(strategy.experimental_split_to_logical_devices(x, partition))

    losses, final = _models.train_xladist(strategy, "mlp", state, xs, ys, make_forward=make_forward)
    out[tuple(partition)] = {"state": state, "xs": xs, "ys": ys, "losses": losses, "final": final}
  return out


if __name__ == "__main__":
  main(sys.argv[1])
