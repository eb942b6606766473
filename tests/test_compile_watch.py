"""Recompilations explained (issue 11): each cause is provoked for real and the
one-line explanation must name it; a settled loop compiles nothing more."""

import functools
import logging
import re

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import xladist as xd

FLAG = True


@pytest.fixture
def explain(monkeypatch):
  monkeypatch.setenv("XLADIST_EXPLAIN_COMPILES", "1")


@pytest.fixture(autouse=True)
def _traced(monkeypatch, request):
  """These tests count the compilations of traced steps: replay (on by default)
  is turned off, unless a test asks for it (`replay` in its name). With replay
  a step's key is compiled once more when it is captured (test_replay.py)."""
  if "replay" not in request.node.name:
    monkeypatch.setenv("XLADIST_REPLAY", "0")


def _steps(strategy, fn, make_args, count):
  """Runs `count` steps, each cut and executed (as a training loop does)."""
  outs = []
  for i in range(count):
    out = strategy.run(fn, make_args(i))
    torch_xla.sync()
    outs.append(out)
  return outs


def _one_line(strategy):
  lines = strategy.extended.experimental_compile_explanations
  assert len(lines) == 1, lines
  assert "\n" not in lines[0]
  return lines[0]


def _per_replica(strategy, rows, dtype=torch.float32, cols=3):
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.ones(rows, cols, dtype=dtype) * (ctx.replica_id_in_sync_group + 1)
  )


def test_settled_loop_compiles_nothing_more(strategy):
  with strategy.scope():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

  def step(x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss

  x = _per_replica(strategy, 2)
  _steps(strategy, step, lambda i: (x,), 3)  # momentum buffers appear in step 1
  warm = strategy.extended.experimental_compile_count
  assert warm >= 1
  _steps(strategy, step, lambda i: (x,), 5)
  assert strategy.extended.experimental_compile_count == warm
  assert strategy.extended.experimental_compile_explanations == []


def test_argument_shape(strategy, explain, caplog):
  caplog.set_level(logging.WARNING, logger="xladist")
  rows = [2, 2, 3]
  _steps(strategy, lambda x: x * 2, lambda i: (_per_replica(strategy, rows[i], cols=11),), 3)
  line = _one_line(strategy)
  assert line.startswith("xladist: step 3 (<lambda>) compiled again (1 XLA compilation)")
  assert "args[0] changed shape: PerReplica of 4 x tensor[2, 11] float32" in line
  assert "-> PerReplica of 4 x tensor[3, 11] float32" in line
  assert caplog.records[-1].getMessage() == line


def test_argument_dtype_in_a_nest(strategy, explain):
  dtypes = [torch.float32, torch.float32, torch.bfloat16]

  def args(i):
    pair = [_per_replica(strategy, 2, cols=12), _per_replica(strategy, 2, dtypes[i], 12)]
    return ({"batch": pair},)

  _steps(strategy, lambda d: d["batch"][0] + d["batch"][1].float(), args, 3)
  line = _one_line(strategy)
  assert "args[0]['batch'][1] changed dtype" in line
  assert "float32 -> PerReplica of 4 x tensor[2, 12] bfloat16" in line


def test_argument_sharding(strategy, explain):
  mesh = xs.Mesh(list(range(4)), (4, 1))

  def args(i):
    x = torch.ones(8, 13).to("xla")
    if i == 2:
      xs.mark_sharding(x, mesh, (0, None))
    return (x,)

  _steps(strategy, lambda x: x * 2, args, 3)
  line = _one_line(strategy)
  assert "args[0] changed sharding: tensor[8, 13] float32 -> tensor[8, 13] float32 sharded" in line


def test_python_global_and_closure_values(strategy, explain):
  global FLAG
  scale = 2

  def step(x):
    y = x * 3 if FLAG else x
    return y + 1 if scale > 1 else y

  x = _per_replica(strategy, 2)
  try:
    _steps(strategy, step, lambda i: (x,), 2)
    FLAG = False
    _steps(strategy, step, lambda i: (x,), 1)
    assert "global 'FLAG' changed value: True -> False" in _one_line(strategy)
    scale = 0
    _steps(strategy, step, lambda i: (x,), 1)
    lines = strategy.extended.experimental_compile_explanations
    assert "fn's closure variable 'scale' changed value: 2 -> 0" in lines[-1]
  finally:
    FLAG = True


def test_train_eval_mode_and_requires_grad(strategy, explain):
  with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

  def step(x):
    out = model(x).sum()
    out.backward()
    opt.step()
    opt.zero_grad()  # no .grad kept: the next step traces the same program
    return out

  x = _per_replica(strategy, 2)
  _steps(strategy, step, lambda i: (x,), 2)
  model.eval()
  _steps(strategy, step, lambda i: (x,), 1)
  assert "model.1 (Dropout) training changed value: True -> False" in _one_line(strategy)
  model[0].bias.requires_grad_(False)
  _steps(strategy, step, lambda i: (x,), 1)
  assert re.search(
    r"Linear#\d\.bias changed requires_grad: tensor\[3\] float32 -> tensor\[3\] float32 "
    r"\(requires_grad=False\)",
    strategy.extended.experimental_compile_explanations[-1],
  )


def test_new_variable(strategy, explain):
  with strategy.scope():
    first = torch.nn.Linear(3, 3)
  layers = [first]

  def step(x):
    for layer in layers:
      x = layer(x)
    return x.sum()

  x = _per_replica(strategy, 2)
  _steps(strategy, step, lambda i: (x,), 2)
  with strategy.scope():
    layers.append(torch.nn.Linear(3, 1))
  _steps(strategy, step, lambda i: (x,), 1)
  line = _one_line(strategy)
  assert "Linear#1.weight is new (tensor[1, 3] float32" in line
  assert "Linear#1.bias is new" in line


def test_program_of_code_between_steps_is_not_the_step(strategy, explain):
  """A program compiled after the step's sync by other code is not called a
  recompilation of the step."""
  x = _per_replica(strategy, 2, cols=16)
  outs = _steps(strategy, lambda x: x * 2, lambda i: (x,), 2)
  extra = strategy.reduce("sum", outs[-1], axis=0) * 5  # a new program, not the step's
  torch_xla.sync()
  del extra
  _steps(strategy, lambda x: x * 2, lambda i: (x,), 1)
  assert _one_line(strategy) == (
    "xladist: step 2 (<lambda>) did not compile: the torch_xla.sync() that ran "
    "it compiled nothing; 1 XLA compilation came after it, by code run between steps "
    "(evaluation outside strategy.run, a host read, a reduction of a new shape)."
  )


def test_pending_work_in_the_arguments(strategy, explain):
  """An argument computed before the step and not executed joins its program."""

  def args(i):
    x = torch.ones(8, 19).to("xla")
    if i == 0:
      x = x * 3  # not executed before the step: part of step 1's program
    return (x,)

  _steps(strategy, lambda x: x * 2, args, 2)
  line = _one_line(strategy)
  assert line == (
    "xladist: step 2 (<lambda>) compiled again (1 XLA compilation): the step's "
    "arguments: work traced and not executed yet (it joins the step's program) when "
    "the previous step began, device data only now"
  )


def _train_eval(strategy, cols):
  with strategy.scope():
    model = torch.nn.Sequential(
      torch.nn.Linear(cols, 7), torch.nn.Dropout(0.5), torch.nn.Linear(7, 2)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

  def train_step(x):
    model.train()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()  # creates the momentum buffers in the first step
    opt.zero_grad(set_to_none=True)
    return loss

  def eval_step(x):
    model.eval()
    with torch.no_grad():
      return model(x).square().mean()

  return train_step, eval_step


_NOTHING_SEEN = (
  "no change xladist can see since step {previous} (the previous step of {name}) in its "
  "arguments, variables, modules' train/eval modes, optimizer settings, work pending in "
  "its tensors, or the Python values fn reads by name, yet the program was new: it was "
  "compiled by the first torch_xla.sync() after the step began (or a host read before "
  "it), so it holds the step together with other work not executed yet, traced outside "
  "fn (e.g. a running total `total += strategy.reduce(...)` that starts as a Python "
  "number is another graph on its first step than on later ones), or fn branches on a "
  "value it reaches through another object or function."
)


def test_train_eval_alternation(strategy, explain):
  """The user's loop: train steps (model.train(), SGD with momentum) and eval
  steps (model.eval(), no_grad) alternate, twice. Three programs: the first
  train step (it creates the momentum buffers), the steady train step, the eval
  step; the one explanation names the real cause. Before: the first step's
  signature had no optimizer (it is known from its first step()), so step 2
  said "'lr' is new (0.1)", and steps that set modes themselves were said to
  have changed them."""
  train_step, eval_step = _train_eval(strategy, 17)
  x = _per_replica(strategy, 2, cols=17)
  for _ in range(2):
    _steps(strategy, train_step, lambda i: (x,), 3)
    _steps(strategy, eval_step, lambda i: (x,), 2)
  assert strategy.extended.experimental_compile_count == 3
  assert strategy.extended.experimental_compile_explanations == [
    "xladist: step 2 (train_step) compiled again (1 XLA compilation): "
    "optimizer 0 (SGD) state entries changed value: 0 -> 4"
  ]


def test_train_eval_alternation_with_replay(strategy, explain):
  """The same loop with replay on (the default): as many compilations as with
  replay off (issue 32: a captured step's program is the one it runs; docs/
  architecture.md, "Replay"); later rounds are replayed and compile nothing."""
  train_step, eval_step = _train_eval(strategy, 19)
  x = _per_replica(strategy, 2, cols=19)
  counts = []
  for _ in range(3):
    _steps(strategy, train_step, lambda i: (x,), 3)
    _steps(strategy, eval_step, lambda i: (x,), 2)
    counts.append(strategy.extended.experimental_compile_count)
  # Round 1: the first train program (it makes the momentum buffers), the
  # steady one (captured: compiled once, its second capture finds it), the eval
  # program. Later rounds compile nothing.
  assert counts == [3, 3, 3]
  assert strategy.extended._engine._replayer.replays == 6  # round 2: 2, round 3: 4
  assert strategy.extended.experimental_compile_explanations == [
    "xladist: step 2 (train_step) compiled again (1 XLA compilation): "
    "optimizer 0 (SGD) state entries changed value: 0 -> 4"
  ]


def test_train_eval_alternation_with_running_totals(strategy, explain):
  """The same loop summing the reduced losses into totals that start as 0.0:
  the first step of each phase adds `0.0 + loss`, later ones `total + loss`, so
  each step function has two programs. xladist sees no change in the steps and
  says where the program came from, without naming a change that did not
  happen."""
  train_step, eval_step = _train_eval(strategy, 18)
  x = _per_replica(strategy, 2, cols=18)
  totals = []
  for _ in range(2):
    for step, count in ((train_step, 3), (eval_step, 2)):
      total = 0.0
      for _ in range(count):
        total += strategy.reduce("mean", strategy.run(step, (x,)), axis=None)
        torch_xla.sync()
      totals.append(float(total))  # a transfer of device data: no program
  # train: first (momentum, 0.0 +), steady (total +), steady (0.0 +); eval: 0.0 +, total +
  assert strategy.extended.experimental_compile_count == 5
  lines = strategy.extended.experimental_compile_explanations
  assert lines == [
    "xladist: step 2 (train_step) compiled again (1 XLA compilation): "
    "optimizer 0 (SGD) state entries changed value: 0 -> 4",
    "xladist: step 5 (eval_step) compiled again (1 XLA compilation): "
    + _NOTHING_SEEN.format(previous=4, name="eval_step"),
    "xladist: step 6 (train_step) compiled again (1 XLA compilation, 2 steps in a row): "
    + _NOTHING_SEEN.format(previous=3, name="train_step"),
  ]
  for line in lines:
    assert "is new" not in line and "training changed" not in line


def test_optimizer_known_only_from_its_first_step(strategy, explain):
  """An optimizer fn does not reach by name is known from its first step()
  inside a step: its settings were not "new" at the next step."""
  with strategy.scope():
    model = torch.nn.Linear(3, 5)
  holder = {"opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}

  def step(x):
    loss = model(x).square().mean()
    loss.backward()
    holder["opt"].step()
    holder["opt"].zero_grad()
    return loss

  x = _per_replica(strategy, 2)
  _steps(strategy, step, lambda i: (x,), 3)
  assert _one_line(strategy) == (
    "xladist: step 2 (step) compiled again (1 XLA compilation): optimizer 0 (SGD) is "
    "new to xladist since the previous step began (it knows an optimizer from a name fn "
    "reads or from its first step() inside strategy.run); it has state for 2 parameters"
  )


def test_modes_set_by_fn_are_not_a_change(strategy, explain):
  """A step that calls model.train() traces in train mode whatever mode the
  eval step left: one train step, one eval step, one train step (whose program
  is the steady one: the momentum buffers exist now)."""
  train_step, eval_step = _train_eval(strategy, 21)
  x = _per_replica(strategy, 2, cols=21)
  _steps(strategy, train_step, lambda i: (x,), 1)
  _steps(strategy, eval_step, lambda i: (x,), 1)
  _steps(strategy, train_step, lambda i: (x,), 1)
  assert _one_line(strategy) == (
    "xladist: step 3 (train_step) compiled again (1 XLA compilation): "
    "optimizer 0 (SGD) state entries changed value: 0 -> 4"
  )


def test_first_program_of_a_function_is_not_called_a_recompilation(strategy, explain):
  """Eval steps whose results are not used run no program; the first one that
  does compile is not said to compile "again"."""
  x = _per_replica(strategy, 2, cols=22)
  keep = []
  for i in range(2):
    keep.append(strategy.run(lambda x: x + 3, (x,)))
    if i == 0:
      keep.clear()  # nothing of step 1 is left to compute
    torch_xla.sync()
  assert _one_line(strategy) == (
    "xladist: step 2 (<lambda>) compiled (its earlier steps did not) (1 XLA compilation): "
    "no change xladist can see since step 1 (the previous step of <lambda>), but no "
    "earlier step of <lambda> compiled (their results were not used, or their programs "
    "were in torch_xla's cache): this is its first program here."
  )


def test_partials_of_two_functions_are_two_step_functions(strategy, explain):
  """functools.partial objects are told apart by the function they call (they
  all used to be one "partial" whose signatures were compared with each other)."""

  def double(x, k):
    return x * k

  def shift(x, k):
    return x + k

  x = _per_replica(strategy, 2, cols=20)
  for _ in range(2):
    _steps(strategy, functools.partial(double, k=2), lambda i: (x,), 1)
    _steps(strategy, functools.partial(shift, k=2), lambda i: (x,), 1)
  assert strategy.extended.experimental_compile_count == 2
  assert strategy.extended.experimental_compile_explanations == []


def test_warns_without_the_flag_after_steps_in_a_row(strategy, monkeypatch, caplog):
  monkeypatch.delenv("XLADIST_EXPLAIN_COMPILES", raising=False)
  monkeypatch.setenv("XLADIST_RECOMPILE_WARN_AFTER", "2")
  caplog.set_level(logging.WARNING, logger="xladist")
  _steps(strategy, lambda x: x * 2, lambda i: (_per_replica(strategy, i + 1, cols=14),), 6)
  lines = strategy.extended.experimental_compile_explanations
  # Steps 2..6 each compiled again; the first two in a row are tolerated.
  assert [line.split(" (")[0] for line in lines] == [
    "xladist: step 4",
    "xladist: step 5",
    "xladist: step 6",
  ]
  assert "3 steps in a row" in lines[0]
  assert "tensor[3, 14] float32 -> PerReplica of 4 x tensor[4, 14]" in lines[0]
  assert [r.getMessage() for r in caplog.records if r.name == "xladist"] == lines


def test_bad_warn_after_setting(strategy, monkeypatch):
  monkeypatch.setenv("XLADIST_RECOMPILE_WARN_AFTER", "many")
  with pytest.raises(ValueError, match="XLADIST_RECOMPILE_WARN_AFTER must be an int"):
    _steps(
      strategy,
      lambda x: x * 2,
      lambda i: (_per_replica(strategy, i + 1, cols=15),),
      4,
    )


def test_count_is_zero_before_the_first_step():
  s = xd.MirroredStrategy()
  assert s.extended.experimental_compile_count == 0
  assert s.extended.experimental_compile_explanations == []
