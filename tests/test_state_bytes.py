"""`strategy.extended.experimental_state_bytes()` on the strategies that do not
shard (issue 51): every tensor whole, from the runtime's placement, against the
arithmetic of the model (tests/shared/test_sharded_state.py checks the sharded
levels and MirroredStrategy on both runtimes)."""

import torch

import xladist as xd


def _loop(strategy):
  with strategy.scope():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

  def step(x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()

  def accumulate(x):
    model(x).square().mean().backward()

  x = torch.randn(8, 7)
  if strategy.num_replicas_in_sync > 1:
    x = strategy.experimental_distribute_values_from_function(
      lambda ctx: x[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
    )
  strategy.run(step, args=(x,))
  after_step = strategy.extended.experimental_state_bytes()
  strategy.run(accumulate, args=(x,))  # gradients kept: no optimizer.step()
  return after_step, strategy.extended.experimental_state_bytes()


def test_unsharded_strategies_hold_every_tensor_whole():
  params = (7 * 33 + 33 + 33 * 5 + 5) * 4
  want = {"parameters": params, "gradients": 0, "optimizer_state": 2 * params + 4 * 4}
  for make in (xd.OneDeviceStrategy, xd.MirroredStrategy, xd.experimental.CentralStorageStrategy):
    strategy = make("xla:0") if make is xd.OneDeviceStrategy else make()
    after_step, accumulating = _loop(strategy)
    assert after_step == want, (make.__name__, after_step)
    assert accumulating == dict(want, gradients=params), (make.__name__, accumulating)
