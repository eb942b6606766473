"""Replay on the jax runtime (on by default there): once a step's signature
repeats, `strategy.run` runs the step's program again without tracing `fn`.

The contract is tf.function's (`def_function_test.py`: a traced function's
Python runs on tracing only; a new Python value it reads makes a new trace), and
the results must be bit for bit those of tracing every step. Runs in this
process: 4 XLA:CPU devices, `XLADIST_BACKEND=jax` (set by tests/runtime_jax's
conftest).
"""

import pytest
import torch
import torch.nn.functional as F

import xladist as xd
from xladist import runtime

pytestmark = pytest.mark.skipif(
  runtime.BACKEND != "jax", reason="tests/runtime_jax runs on the jax runtime (make test-jax)"
)

NO_REPLAY = xd.RunOptions(experimental_replay=False)


def _train(strategy, steps, options=None, dropout=0.0, seed=0):
  torch.manual_seed(1)
  with strategy.scope():
    model = torch.nn.Sequential(
      torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 3)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  g = torch.Generator().manual_seed(2)
  x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
  batch = next(
    iter(
      strategy.experimental_distribute_dataset(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
      )
    )
  )

  def step(xb, yb):
    opt.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    return loss

  runtime.set_seed(seed)
  losses = [
    strategy.reduce("mean", strategy.run(step, args=batch, options=options), axis=None)
    for _ in range(steps)
  ]
  return [float(v) for v in losses], [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_replayed_steps_equal_traced_steps_bit_for_bit(dropout):
  replayed = xd.MirroredStrategy()
  traced = xd.MirroredStrategy()
  losses_r, params_r = _train(replayed, 7, dropout=dropout)
  losses_t, params_t = _train(traced, 7, options=NO_REPLAY, dropout=dropout)
  rep = replayed.extended._engine._replayer
  assert rep.replays >= 3, list(rep.reasons)
  assert traced.extended._engine._replayer.replays == 0
  assert losses_r == losses_t
  for a, b in zip(params_r, params_t):
    torch.testing.assert_close(a, b, atol=0, rtol=0)
  if dropout:
    assert len(set(losses_r)) == len(losses_r)  # every step drew a new mask


def test_fn_python_runs_only_when_traced_and_nothing_compiles_after_warm_up():
  strategy = xd.MirroredStrategy()
  with strategy.scope():
    v = xd.Variable(0.0, name="counter")

  def fn():
    v.assign_add(1.0)
    return v.value * 1

  for _ in range(3):
    strategy.run(fn)
  runtime.wait()
  compiles = runtime.compile_count()
  for _ in range(5):
    out = strategy.run(fn)
  rep = strategy.extended._engine._replayer
  assert rep.traces == 2  # the first trace, and the capture that confirms it
  assert rep.replays == 6
  assert runtime.compile_count() == compiles
  assert float(v.read_value()) == 8.0
  assert [float(t) for t in strategy.experimental_local_results(out)] == [8.0] * 4


def test_a_python_side_effect_traces_every_call_and_compiles_nothing_new():
  """Issue 50: a list `fn` appends to is a write a replay would skip, so the step
  is traced at every call (the append happens 8 times, as in PyTorch), and said
  so in the replay counts; its program is compiled once all the same."""
  strategy = xd.MirroredStrategy()
  calls = []
  with strategy.scope():
    v = xd.Variable(0.0, name="counter")

  def fn():
    calls.append(1)  # a Python side effect
    v.assign_add(1.0)
    return v.value * 1

  for _ in range(3):
    strategy.run(fn)
  runtime.wait()
  compiles = runtime.compile_count()
  for _ in range(5):
    out = strategy.run(fn)
  counts = strategy.extended.experimental_replay_counts
  assert len(calls) == 8
  assert counts["traced"] == 8 and counts["replayed"] == 0, counts
  assert counts["traced_for_writes"] >= 5, counts
  assert runtime.compile_count() == compiles
  assert float(v.read_value()) == 8.0
  assert [float(t) for t in strategy.experimental_local_results(out)] == [8.0] * 4


def test_a_new_python_value_that_fn_reads_traces_again():
  """def_function_test.py testFunctionRelaxationLosesInnerDimWithKeywordArgument's
  rule for Python values: a changed closure value is a new signature."""
  strategy = xd.MirroredStrategy()
  scale = 1.0

  def fn(x):
    return x * scale

  x = torch.ones(4)
  outs = []
  for s in (1.0, 1.0, 1.0, 3.0, 3.0):
    scale = s
    out = strategy.run(fn, (x,))
    outs.append([float(t[0]) for t in strategy.experimental_local_results(out)])
  assert outs == [[1.0] * 4] * 3 + [[3.0] * 4] * 2
  reasons = [why for _, why in strategy.extended._engine._replayer.reasons]
  assert any("scale" in why for why in reasons), reasons


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw-cosine"])
def test_run_steps_replays_the_group_as_one_program_and_equals_separate_steps(optimizer):
  """`experimental_run_steps(k)`: once its first step is replayed, the other
  k - 1 steps are traced as ONE program, captured twice and then replayed like a
  step (as on torch_xla: tests/test_run_steps.py); a call is then two executions
  and traces nothing, and the results are those of k runs. With torch's default
  AdamW (host step counters, read in Python by its bias corrections) and a
  schedule stepped between calls, the group replays too: its steps' counters are
  one chain of expressions (before, the jax runtime scanned the step's program,
  which feeds every step the same scalars, and such a group was traced at every
  call)."""
  grouped = xd.MirroredStrategy()
  separate = xd.MirroredStrategy()

  def setup(strategy):
    torch.manual_seed(3)
    with strategy.scope():
      model = torch.nn.Linear(5, 2)
      if optimizer == "sgd-momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = None
      else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
    g = torch.Generator().manual_seed(4)
    data = torch.utils.data.TensorDataset(
      torch.randn(160, 5, generator=g), torch.randn(160, 2, generator=g)
    )
    it = iter(
      strategy.experimental_distribute_dataset(torch.utils.data.DataLoader(data, batch_size=8))
    )

    def step(xb, yb):
      opt.zero_grad()
      loss = F.mse_loss(model(xb), yb)
      loss.backward()
      opt.step()
      return loss

    return model, opt, sched, it, step

  model_g, opt_g, sched_g, it_g, step_g = setup(grouped)
  model_s, opt_s, sched_s, it_s, step_s = setup(separate)

  def call(k):
    out = grouped.extended.experimental_run_steps(step_g, it_g, k)
    if sched_g is not None:
      sched_g.step()
    return out

  for _ in range(4):  # warm-up: the step traced 3 times, then replayed
    call(1)
  call(4)  # the group's first trace, captured
  call(4)  # its second, compared: promoted
  runtime.wait()
  rep = grouped.extended._engine._replayer
  executions, replays, traces = runtime.execute_count(), rep.replays, rep.traces
  losses_g = call(4)
  runtime.wait()
  assert runtime.execute_count() - executions == 2  # the first step, then the other 3
  assert rep.traces == traces, list(rep.reasons)
  assert rep.replays - replays == 4
  assert len(losses_g) == 4
  for i in range(16):
    last = separate.run(step_s, args=next(it_s))
    if sched_s is not None and i in (0, 1, 2, 3, 7, 11, 15):  # where `call` stepped it
      sched_s.step()
  torch.testing.assert_close(
    separate.reduce("mean", last, axis=None).cpu(),
    grouped.reduce("mean", losses_g[-1], axis=None).cpu(),
    atol=1e-6,
    rtol=1e-6,
  )
  for a, b in zip(model_g.parameters(), model_s.parameters()):
    torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), atol=1e-6, rtol=1e-6)
  for a, b in zip(opt_g.state.values(), opt_s.state.values()):
    for name in a:
      torch.testing.assert_close(a[name].cpu(), b[name].cpu(), atol=1e-6, rtol=1e-6, msg=name)


def test_no_array_of_an_old_step_outlives_it():
  """Issue 41: the runtime held the last traced step's input and result arrays
  (for `hlo_text` and the capture) until the next trace, so replayed steps kept
  a copy of the parameters and optimizer state of that step alive. The capture
  takes them; what stays is their shapes and placements."""
  import gc
  import weakref

  strategy = xd.MirroredStrategy()
  torch.manual_seed(1)
  with strategy.scope():
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
  x = strategy.experimental_distribute_values_from_function(lambda ctx: torch.randn(4, 6))
  step = _square_loss_step(model, opt)
  for _ in range(2):
    strategy.run(step, args=(x,))
  old = weakref.ref(model.weight._elem)  # an input of step 3, the last traced step
  for _ in range(4):
    strategy.run(step, args=(x,))
  runtime.wait()
  rep = strategy.extended._engine._replayer
  assert rep.replays >= 2 and rep.traces == 3, list(rep.reasons)
  gc.collect()
  assert old() is None


def test_a_replayed_step_gives_up_the_buffers_it_overwrites(monkeypatch):
  """Issue 41: the replayed program is compiled at the capture with the
  parameters, gradients and AdamW state it overwrites donated (`donate_argnums`):
  the buffer a parameter held before a replay holds one of its results after
  it (written in place; the old array is deleted). A `detach()`
  the user keeps (it shares the parameter's array) stays readable with its value
  (the replay gives up a copy), nothing compiles after the warm-up, and the run
  equals one without replay bit for bit."""

  monkeypatch.setenv("XLADIST_DONATE_MIN_BYTES", "0")  # a small model donates too

  def run(replay):
    monkeypatch.setenv("XLADIST_REPLAY", "1" if replay else "0")
    strategy = xd.MirroredStrategy()
    torch.manual_seed(1)
    with strategy.scope():
      model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
      opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(16, 6, generator=g) for _ in range(8)]
    step = _square_loss_step(model, opt)

    def run_step(i):
      x = strategy.experimental_distribute_values_from_function(
        lambda ctx: xs[i][ctx.replica_id_in_sync_group * 4 : (ctx.replica_id_in_sync_group + 1) * 4]
      )
      loss = strategy.run(step, args=(x,))
      runtime.wait()
      return loss

    losses = [run_step(i) for i in range(4)]
    compiles = runtime.compile_count()
    kept = None
    if replay:
      rep = strategy.extended._engine._replayer
      assert rep.replays >= 1, list(rep.reasons)
      (entry,) = [e for e in rep._entries.values() if e.promoted]
      # 4 parameters and their exp_avg and exp_avg_sq (AdamW's step counters are host tensors)
      assert len(entry.program.donate) == 12
      # The weight's buffer (seen by its address: holding its array would keep it)
      # holds one of the replay's results (the array written in place).
      old = _buffers([model[0].weight])
      losses.append(run_step(4))
      assert old <= _buffers(list(model.parameters()) + _opt_state(opt))
      kept = model[0].weight.detach()  # shares the parameter's array
      mine = _buffers([kept])
      before = kept.cpu().clone()
      losses.append(run_step(5))
      assert not kept._elem.is_deleted()  # a copy was given up instead
      assert not mine & _buffers(list(model.parameters()) + _opt_state(opt))
      kept = (kept.cpu(), before)
      assert rep.replays >= 3, list(rep.reasons)
      assert runtime.compile_count() == compiles
    else:
      losses += [run_step(4), run_step(5)]
    losses.append(run_step(6))
    losses = [float(strategy.reduce("mean", l, axis=None)) for l in losses]
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
      for k, v in s.items():
        state[f"opt{i}.{k}"] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
    return losses, state, kept

  losses_r, state_r, kept = run(True)
  losses_t, state_t, _ = run(False)
  assert losses_r == losses_t
  assert state_r.keys() == state_t.keys()
  for k in state_r:
    if isinstance(state_r[k], torch.Tensor):
      torch.testing.assert_close(state_r[k], state_t[k], rtol=0, atol=0, msg=k)
    else:
      assert state_r[k] == state_t[k], k
  torch.testing.assert_close(kept[0], kept[1], rtol=0, atol=0)


def _opt_state(opt):
  return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _buffers(tensors):
  """The addresses of the device buffers behind tensors (every replica's)."""
  return {
    shard.data.unsafe_buffer_pointer()
    for t in tensors
    if hasattr(t, "_elem")  # not AdamW's step counters (host tensors)
    for shard in t._elem.addressable_shards
  }


def _square_loss_step(model, opt):
  """A training step on the mean square of the model's output."""

  def step(x):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  return step
