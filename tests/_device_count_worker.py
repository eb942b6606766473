"""Runs in a subprocess with CPU_NUM_DEVICES set: xladist results for one device count.

usage: python _device_count_worker.py OUT_FILE
Writes a dict to OUT_FILE (torch.save); the parent test compares it with plain
PyTorch references it computes itself.
"""

import sys

import torch

import _models
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
  torch.save(result, out_file)


if __name__ == "__main__":
  main(sys.argv[1])
