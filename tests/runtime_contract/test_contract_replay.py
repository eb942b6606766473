"""The runtime contract's program replay (`ProgramReplay`).

A runtime hands over the program of the step just traced and runs it again on
new inputs: in the "graph" form (a lazily recorded step) the program that
computes given tensors is cut from them and takes device tensors as
parameters, recognised by their buffer ids; in the "program" form (a step the
runtime traced and ran as a program) the program is handed over with its
inputs and results. Each form is checked directly where it applies, and both
through the public replay (`strategy.run` of the same step several times,
`experimental_run_steps`), with values checked against plain torch.
"""

import pytest
import torch
import torch.nn.functional as F

import xladist as xd
from xladist import runtime

N = 4
GRAPH = pytest.mark.skipif(runtime.REPLAY_KIND != "graph", reason='the "graph" form')
PROGRAM = pytest.mark.skipif(runtime.REPLAY_KIND != "program", reason='the "program" form')


def _host_copy(t):
  """A tensor as a host tensor (device tensors copied with `to_host`)."""
  t = torch.as_tensor(t)
  return runtime.to_host([t])[0] if runtime.is_device_tensor(t) else t


def _rows(offset=0.0):
  return torch.arange(N * 3, dtype=torch.float32).reshape(N, 3) + offset


def test_no_step_is_traced_outside_steps():
  """ProgramReplay.in_traced_step: false outside any step."""
  assert runtime.in_traced_step() is False


def test_buffer_ids_name_buffers():
  """ProgramReplay.buffer_ids: one id per tensor; the same tensor twice has one
  id, two placed tensors two."""
  a, b = runtime.place_split(_rows()), runtime.place_split(_rows(1.0))
  runtime.wait()
  ids = runtime.buffer_ids([a, a, b])
  assert len(ids) == 3
  assert ids[0] is not None and ids[2] is not None
  assert ids[0] == ids[1]
  assert ids[0] != ids[2]
  assert runtime.buffer_ids([]) == []


@GRAPH
def test_graph_a_pending_value_has_no_buffer_yet():
  """ProgramReplay.buffer_ids ("graph"): None for a value recorded and not yet
  run; its buffer once it has run."""
  y = runtime.place_split(_rows()) * 2
  assert runtime.buffer_ids([y]) == [None]
  runtime.sync([y])
  runtime.wait()
  assert runtime.buffer_ids([y])[0] is not None


@GRAPH
def test_graph_last_program_runs_again_on_new_parameters(host):
  """ProgramReplay.last_program(outputs) / run_program ("graph"): the program
  cut from `y = x * 2 + 1` runs on a new x (found among its parameters by
  buffer id) and gives 2 * new + 1; PendingInput for a parameter still being
  computed."""
  x = runtime.place_split(torch.ones(N, 3))
  runtime.wait()
  y = x * 2 + 1
  program, consts, params, results = runtime.last_program([y])
  assert consts is None
  assert len(results) == 1 and results[0] is y
  assert all(runtime.is_device_tensor(p) for p in params)
  ids = runtime.buffer_ids(params)
  (x_id,) = runtime.buffer_ids([x])
  assert ids.count(x_id) == 1
  new = _rows(0.5)
  placed = runtime.place_split(new)
  runtime.wait()
  inputs = [placed if i == x_id else p for p, i in zip(params, ids)]
  (out,) = runtime.run_program(program, consts, inputs)
  assert torch.equal(host(out), new * 2 + 1)
  assert torch.equal(host(y), torch.full((N, 3), 3.0))  # the traced values, unchanged
  pending = runtime.place_split(new) - 1
  inputs = [pending if i == x_id else p for p, i in zip(params, ids)]
  with pytest.raises(runtime.PendingInput):
    runtime.run_program(program, consts, inputs)
  runtime.sync()
  runtime.wait()
  (out,) = runtime.run_program(program, consts, inputs)
  assert torch.equal(host(out), (new - 1) * 2 + 1)


@PROGRAM
def test_program_last_program_runs_again(host):
  """ProgramReplay.last_program() / run_program ("program"): the program of the
  step just traced, run again on its inputs, gives the step's results."""
  x = _rows()
  split = runtime.place_split(x)

  def body():
    local = runtime.to_local(split)
    total = runtime.spmd_all_reduce("sum", local, 1.0, runtime.replica_groups(N))
    return (
      runtime.to_global(local * 2 + 1, runtime.sharding(2, N), torch.Size((N, 3))),
      runtime.to_global(total, runtime.sharding(2, N, split=False), total.shape),
    )

  out, total = runtime.traced_step(body)
  program, consts, inputs, results = runtime.last_program()
  assert len(results) == 2 and len(inputs) >= 1
  again = runtime.run_program(program, consts, inputs)
  assert len(again) == 2
  got = runtime.to_host(list(again))
  assert torch.equal(got[0], x * 2 + 1) and torch.equal(got[0], host(out))
  assert torch.equal(got[1], x.sum(0, keepdim=True)) and torch.equal(got[1], host(total))


def test_replayed_steps_equal_plain_torch(strategy):
  """ProgramReplay through `strategy.run`: a training step run 6 times (a
  learning rate that changes every step) is replayed after its first runs, and
  trains as plain PyTorch on the CPU does on the global batch."""
  torch.manual_seed(0)
  reference = torch.nn.Linear(3, 2)
  torch.manual_seed(0)
  with strategy.scope():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
  sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
  ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
  ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1.0 + s))
  g = torch.Generator().manual_seed(1)
  data = [
    (torch.randn(N * 2, 3, generator=g), torch.randn(N * 2, 2, generator=g)) for _ in range(6)
  ]

  def split(t):
    return strategy.experimental_distribute_values_from_function(
      lambda ctx: t[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
    )

  def step(x, y):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  before = dict(strategy.extended.experimental_replay_counts)
  losses = []
  for x, y in data:
    losses.append(strategy.reduce("mean", strategy.run(step, (split(x), split(y))), axis=None))
    sched.step()
  counts = strategy.extended.experimental_replay_counts
  assert counts["replayed"] - before["replayed"] >= 3, counts
  want = []
  for x, y in data:
    loss = F.mse_loss(reference(x), y)
    ref_opt.zero_grad()
    loss.backward()
    ref_opt.step()
    ref_sched.step()
    want.append(loss.detach())
  got = torch.stack([_host_copy(v) for v in losses])
  torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-6)
  for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(_host_copy(p.detach()), q.detach(), rtol=1e-5, atol=1e-6)


def test_run_steps_equal_separate_steps(strategy, local_results):
  """ProgramReplay through `experimental_run_steps` (after a replayed step the
  other k - 1 are traced as one program, captured and replayed like a step, on
  every runtime): k steps at once give what k runs give."""
  with strategy.scope():
    total = xd.Variable(torch.zeros(2), name="contract_total")

  def fn(x):
    total.assign_add(x)
    return total.value * 1

  items = [torch.tensor([float(i), -0.5 * i]) for i in range(1, 21)]
  it = iter(items)
  for _ in range(4):  # warm-up: the step traced, captured, replayed
    strategy.extended.experimental_run_steps(fn, it, 1)
  for _ in range(3):  # warm-up: the group of steps after the first
    strategy.extended.experimental_run_steps(fn, it, 4)
  before = dict(strategy.extended.experimental_replay_counts)
  outs = strategy.extended.experimental_run_steps(fn, it, 4)
  assert len(outs) == 4
  counts = strategy.extended.experimental_replay_counts
  assert counts["replayed"] - before["replayed"] == 4, counts
  assert counts["traced"] == before["traced"], counts
  running = torch.cumsum(torch.stack(items), 0)
  for k, out in enumerate(outs):
    torch.testing.assert_close(local_results(out), running[16 + k].expand(N, 2))
  torch.testing.assert_close(_host_copy(total.read_value()), running[-1])
