"""The runtime contract's step region: `traced_step`, `to_local`, `to_global`,
`spmd_all_reduce`, `spmd_reduce_scatter`, `spmd_all_gather`, `optimization_barrier_`,
`no_execution` and `foreign_idioms` (and `held_bytes`, which reads a placement).

Twice over: the operations called directly (a step body that enters a split
and a replicated tensor, reduces across replicas and leaves, as the step
engine does), and through the public API they serve (`strategy.run` with
`ReplicaContext.all_reduce`). Values are checked against numpy / plain torch on
the CPU. A host read inside a step must raise `HostReadInStep` naming the
user's line.
"""

import gc
import os
import sys

import numpy as np
import pytest
import torch

import xladist as xd
from xladist import runtime

N = 4
HERE = os.path.basename(__file__)


def _rows(cols=3):
  return torch.arange(N * cols, dtype=torch.float32).reshape(N, cols) - 5


def test_a_traced_step_enters_reduces_and_leaves(host):
  """Runtime.traced_step / to_local / spmd_all_reduce / to_global / sharding:
  a split tensor's local view is the replica's row, a replicated one's the
  whole; sum (with a scale), max and min across replicas; a split output
  stacks the replicas' rows, a replicated one is the common value."""
  x = _rows()
  w = torch.tensor([[1.0, -2.0, 0.5]])
  split, replicated = runtime.place_split(x), runtime.place_replicated(w)
  groups = runtime.replica_groups(N)
  seen = {}

  def body():
    with runtime.no_execution():
      local = runtime.to_local(split)  # (1, 3): this replica's row
      weight = runtime.to_local(replicated)  # (1, 3): the whole tensor
      seen["shapes"] = (tuple(local.shape), tuple(weight.shape))
      seen["device"] = runtime.is_device_tensor(local)
      mean = runtime.spmd_all_reduce("sum", local, 1.0 / N, groups)
      high = runtime.spmd_all_reduce("max", local * weight, 1.0, groups)
      low = runtime.spmd_all_reduce("min", local, 2.0, groups)
      out = local * weight - mean  # each replica's own row
      return (
        runtime.to_global(out, runtime.sharding(2, N), torch.Size((N, 3))),
        runtime.to_global(high, runtime.sharding(2, N, split=False), high.shape),
        runtime.to_global(low, runtime.sharding(2, N, split=False), low.shape),
      )

  out, high, low = runtime.traced_step(body)
  assert seen == {"shapes": ((1, 3), (1, 3)), "device": True}
  assert runtime.is_device_tensor(out) and tuple(out.shape) == (N, 3)
  got_out, got_high, got_low = runtime.to_host([out, high, low])
  xn, wn = x.numpy(), w.numpy()
  np.testing.assert_allclose(got_out.numpy(), xn * wn - xn.mean(0, keepdims=True), rtol=1e-6)
  np.testing.assert_allclose(got_high.numpy(), (xn * wn).max(0, keepdims=True), rtol=1e-6)
  np.testing.assert_allclose(got_low.numpy(), 2 * xn.min(0, keepdims=True), rtol=1e-6)
  assert runtime.sharding_spec(out) == runtime.sharding_spec(runtime.place_split(x))
  assert runtime.sharding_spec(high) == runtime.sharding_spec(runtime.place_replicated(w))


def test_a_host_read_in_a_traced_step_raises_host_read_in_step():
  """Runtime.no_execution: reading a traced value on the host raises
  `HostReadInStep` naming the user's line (no hang, no value)."""
  split = runtime.place_split(_rows())

  def body():
    with runtime.no_execution():
      local = runtime.to_local(split)
      return float(local.sum())  # the user's line

  line = body.__code__.co_firstlineno + 3
  message = None
  try:
    runtime.traced_step(body)
  except runtime.HostReadInStep as e:
    message = str(e)
  # The step's traced values die with the traceback (they must not reach a later sync).
  gc.collect()
  assert message is not None, "no HostReadInStep"
  assert f"{HERE}:{line}" in message, message
  assert "float(local.sum())" in message, message
  runtime.sync()
  runtime.wait()


def test_reduce_scatter_and_all_gather_in_a_traced_step():
  """Runtime.spmd_reduce_scatter / spmd_all_gather (sharded state, issue 51):
  each replica's (N, 5) local tensor summed over the replicas, replica r keeping
  row r (with a scale); each replica's row gathered (N, 5) on every replica."""
  x = torch.arange(N * N * 5, dtype=torch.float32).reshape(N, N, 5) - 40  # x[r]: replica r's
  split = runtime.place_split(x)
  iota = runtime.place_split(torch.arange(N, dtype=torch.int32).to(runtime.device()))
  groups = runtime.replica_groups(N)

  def body():
    with runtime.no_execution():
      local = runtime.to_local(split).squeeze(0)  # (N, 5): replica r's own
      replica = runtime.to_local(iota).reshape(())
      row = runtime.spmd_reduce_scatter(local, 0.5, groups)  # (5,)
      gathered = runtime.spmd_all_gather(row * (replica + 1), replica, groups)  # (N, 5)
      return (
        runtime.to_global(row.unsqueeze(0), runtime.sharding(2, N), torch.Size((N, 5))),
        runtime.to_global(gathered, runtime.sharding(2, N, split=False), gathered.shape),
      )

  rows, gathered = runtime.to_host(list(runtime.traced_step(body)))
  want = 0.5 * x.numpy().sum(0)  # row r of the sum, on replica r
  np.testing.assert_allclose(rows.numpy(), want, rtol=1e-6)
  np.testing.assert_allclose(gathered.numpy(), want * np.arange(1, N + 1)[:, None], rtol=1e-6)


def test_optimization_barrier_keeps_the_values_and_the_gradient():
  """Runtime.optimization_barrier_ (ZeRO-3's gathers again in backward, issue 60):
  in place, the tensors keep their values; autograd does not see it (a gradient
  through a tensor it rewrote is the gradient without it)."""
  x = torch.arange(N * 3, dtype=torch.float32).reshape(N, 3) - 5
  split = runtime.place_split(x)

  def body():
    with runtime.no_execution():
      local = runtime.to_local(split).squeeze(0)  # (3,): replica r's row
      w = (local * 2).requires_grad_()
      h = w * w
      other = local + 1
      runtime.optimization_barrier_([h, other])
      (g,) = torch.autograd.grad(h.sum(), [w])
      out = torch.stack([h.detach(), other, g])  # (3, 3)
      return runtime.to_global(out.unsqueeze(0), runtime.sharding(3, N), torch.Size((N, 3, 3)))

  (got,) = runtime.to_host([runtime.traced_step(body)])
  w = 2 * x.numpy()
  want = np.stack([w * w, x.numpy() + 1, 2 * w], axis=1)  # (N, 3, 3)
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_held_bytes_is_what_the_fullest_device_holds():
  """Runtime.held_bytes: a tensor split over the replicas holds one row per
  device, a replicated one the whole; a host tensor its own size."""
  x = torch.zeros(N, 6, dtype=torch.float32)
  assert runtime.held_bytes(runtime.place_split(x)) == 6 * 4
  assert runtime.held_bytes(runtime.place_replicated(x)) == N * 6 * 4
  assert runtime.held_bytes(x) == N * 6 * 4


def test_ensure_sharded_tensors_enter_a_step(host):
  """Runtime.ensure_sharded then to_local: a device tensor computed outside any
  placement enters a step as a replicated value."""
  made = runtime.ensure_sharded(torch.arange(3, dtype=torch.float32, device=runtime.device()) + 1)

  def body():
    local = runtime.to_local(made)
    total = runtime.spmd_all_reduce("sum", local, 1.0, runtime.replica_groups(N))
    return runtime.to_global(total, runtime.sharding(1, N, split=False), total.shape)

  assert torch.equal(host(runtime.traced_step(body)), N * torch.tensor([1.0, 2.0, 3.0]))


def test_strategy_run_all_reduces_like_numpy(strategy, local_results):
  """to_local / spmd_all_reduce / to_global through `strategy.run`:
  ReplicaContext.all_reduce SUM, MEAN, MAX, MIN across the replicas' rows."""
  rows = np.arange(N * 5, dtype=np.float32).reshape(N, 5) * 1.5 - 7
  per_replica = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.from_numpy(rows[ctx.replica_id_in_sync_group].copy())
  )

  def fn(x):
    ctx = xd.get_replica_context()
    ops = (xd.ReduceOp.SUM, xd.ReduceOp.MEAN, xd.ReduceOp.MAX, xd.ReduceOp.MIN)
    return tuple(ctx.all_reduce(op, x) for op in ops) + (x * 2,)

  outs = strategy.run(fn, (per_replica,))
  got = [local_results(o).numpy() for o in outs]
  wants = [rows.sum(0), rows.mean(0), rows.max(0), rows.min(0)]
  for g, want in zip(got[:4], wants):
    np.testing.assert_allclose(g, np.broadcast_to(want, (N, 5)), rtol=1e-6)
  np.testing.assert_allclose(got[4], rows * 2, rtol=1e-6)


def test_a_host_read_in_strategy_run_names_the_users_line(strategy):
  """Runtime.no_execution through `strategy.run`: `float(x)` in the step
  function fails with an error naming that line."""
  x = torch.ones(3)

  def fn(t):
    return float(t.sum())  # the user's line

  line = fn.__code__.co_firstlineno + 1
  with pytest.raises(RuntimeError, match="read a traced tensor's value on the host") as e:
    strategy.run(fn, (x,))
  assert f"{HERE}:{line}" in str(e.value)
  del e
  gc.collect()


def _module_attributes():
  """{(module, attribute): value} of every module loaded."""
  out = {}
  for name, module in list(sys.modules.items()):
    attrs = getattr(module, "__dict__", None)
    if isinstance(attrs, dict):
      for key, value in list(attrs.items()):
        out[name, key] = value
  return out


def _changed(before, after):
  return sorted(k for k in before.keys() | after.keys() if before.get(k) is not after.get(k))


FAKE_HANDLERS = {
  "replica_context": lambda: None,
  "select_own": lambda stacked, replica_id: stacked[0],
  "reduce_ops": {"sum": xd.ReduceOp.SUM, "min": xd.ReduceOp.MIN, "max": xd.ReduceOp.MAX},
}


def test_foreign_idioms_puts_everything_back():
  """Runtime.foreign_idioms: whatever it replaces while the block runs is put
  back when it ends (normally or by an error); outside a step it raises nothing.
  The garbage collector is off meanwhile: its callbacks (hypothesis times the
  collections in module globals) would change attributes under the snapshots."""
  with runtime.foreign_idioms(dict(FAKE_HANDLERS)):
    pass  # first use: what it imports is loaded before the snapshots
  gc.collect()
  gc.disable()
  try:
    before = _module_attributes()
    with runtime.foreign_idioms(dict(FAKE_HANDLERS)):
      inside = _module_attributes()
    after = _module_attributes()
    patched = [k for k in _changed(before, inside) if k in before]
    assert not [k for k in patched if after.get(k) is not before[k]], patched
    with pytest.raises(ZeroDivisionError):
      with runtime.foreign_idioms(dict(FAKE_HANDLERS)):
        1 / 0  # noqa: B018
    again = _module_attributes()
    assert not [k for k in patched if again.get(k) is not before[k]], patched
  finally:
    gc.enable()
