"""The replay recorder's tables (xladist/_step/bytecode.py) and its closed world
(issue 59), alone: plain Python, CPU tensors, no strategy, no XLA compile.

The world is closed: every opcode of a supported Python is in a table (handled or
inert), an opcode in none makes the step not replayable, code without a file
(`python -c`, a REPL, exec, a notebook's cells) is followed like any other, and a
value the recorder cannot guard makes the step not replayable, saying where. Each
test here would fail on the recorder before issue 59 (which dropped `<string>`
code, guarded containers by identity, skipped `_`-prefixed attributes of modules,
ignored `getattr` with a computed name, hooks, generators and other threads).
"""

import dis
import functools
import os
import sys
import threading

import numpy as np
import pytest
import torch

from xladist._step import bytecode
from xladist._step import python_effects as pe
from xladist._step import read_guards as rg

pytestmark = pytest.mark.skipif(
  sys.version_info[:2] not in bytecode.SUPPORTED, reason="no tables for this Python"
)

LW = {"ce": 1.0, "reg": 0.1}
REGS = [0.1]


def _record(fn, *args):
  recorder = pe.Recorder(fn)
  with recorder:
    out = fn(*args)
  return recorder, out


def _key(recorder):
  w = rg.Watched()
  w.add(recorder)
  return w, w.key()


def test_every_opcode_of_this_python_is_classified():
  """No opcode falls outside the tables but the ones deliberately not modelled
  (and the instrumented forms `dis` never shows)."""
  names = {n for n in dis.opmap if not n.startswith("INSTRUMENTED_")}
  assert names - bytecode.known() - bytecode.UNMODELLED == set()


def test_an_opcode_in_no_table_makes_the_step_not_replayable(monkeypatch):
  def step(x):
    return x + LW["ce"]

  monkeypatch.setattr(bytecode, "known", lambda version=None: set())
  pe._INFO.clear()
  pe._PLANS.clear()
  try:
    recorder, _ = _record(step, torch.ones(2))
  finally:
    pe._INFO.clear()
    pe._PLANS.clear()
  why = recorder.why_not_replayed()
  assert why.kind is pe.Reason.UNFOLLOWED and "which xladist's recorder does not model" in why
  assert "test_bytecode.py" in why  # the place


def test_code_without_a_file_is_followed():
  assert bytecode.followed("<string>") and bytecode.followed("<stdin>")
  assert bytecode.followed("<ipython-input-3-abc>")
  assert not bytecode.followed("<frozen importlib._bootstrap>")
  assert not bytecode.followed(os.__file__)  # the standard library
  env = {"LW": dict(LW)}
  exec("def step(x):\n  return x * LW['reg']\n", env)  # noqa: S102
  recorder, _ = _record(env["step"], torch.ones(2))
  assert "step.<locals>" not in str([loc.label for loc, _ in recorder.locations()])
  assert any(loc.label == "step" or "LW" in loc.label for loc, _ in recorder.locations())


def test_a_container_read_at_a_computed_key_is_guarded_by_content():
  def step(x):
    for k in ("reg",):
      x = x * LW[k]
    return x

  recorder, _ = _record(step, torch.ones(2))
  assert recorder.why_not_replayed() is None
  watched, before = _key(recorder)
  LW["reg"] = 0.5
  try:
    assert watched.key() != before
  finally:
    LW["reg"] = 0.1
  assert watched.key() == before


def test_a_constant_key_of_a_dict_is_an_item_not_the_whole_dict():
  """`LW["reg"]` guards that item (a float that changes can become a program
  input); the dict's other items are not part of the key."""

  def step(x):
    return x * LW["reg"]

  recorder, _ = _record(step, torch.ones(2))
  watched, before = _key(recorder)
  LW["other"] = 3.0
  try:
    assert watched.key() == before
  finally:
    del LW["other"]
  assert [loc.kind for loc, _ in recorder.locations()] == ["global", "item"]


def test_a_list_item_rebound_and_a_nested_subscript_are_guarded():
  conf = {"loss": {"l2": 0.1}}

  def step(x):
    for r in REGS:
      x = x * r
    return x * conf["loss"]["l2"]

  recorder, _ = _record(step, torch.ones(2))
  watched, before = _key(recorder)
  REGS[0] = 0.3
  try:
    assert watched.key() != before
  finally:
    REGS[0] = 0.1
  conf["loss"]["l2"] = 0.2
  assert watched.key() != before


def test_getattr_with_a_computed_name_guards_the_objects_attributes():
  class Cfg:
    w_reg = None

  cfg = Cfg()
  cfg.w_reg = 0.1

  def step(x, name="reg"):
    return x * getattr(cfg, "w_" + name)

  recorder, _ = _record(step, torch.ones(2))
  assert recorder.why_not_replayed() is None
  watched, before = _key(recorder)
  cfg.w_reg = 0.2
  assert watched.key() != before


def test_getattr_of_a_value_the_recorder_cannot_follow_is_not_replayable():
  class Cfg:
    w = 1.0

  def step(x, name="w"):
    return x * getattr([Cfg()][0], name)

  recorder, _ = _record(step, torch.ones(2))
  assert "getattr() of a value xladist cannot follow" in recorder.why_not_replayed()


def test_partial_numpy_cpu_tensor_and_environ_are_guarded_by_content():
  smooth = functools.partial(torch.nn.functional.smooth_l1_loss, beta=1.0)
  w = np.array([0.5], dtype=np.float32)
  scale = torch.tensor(2.0)

  def step(x):
    y = smooth(x, torch.zeros_like(x)) * float(torch.from_numpy(w).sum()) * float(scale)
    return y * float(os.environ.get("XLADIST_TEST_BYTECODE", "1"))

  recorder, _ = _record(step, torch.ones(2))
  assert recorder.why_not_replayed() is None
  watched, before = _key(recorder)
  for change, undo in (
    (lambda: smooth.keywords.__setitem__("beta", 0.5), lambda: smooth.keywords.update(beta=1.0)),
    (lambda: w.__setitem__(0, 0.25), lambda: w.__setitem__(0, 0.5)),
    (lambda: scale.fill_(3.0), lambda: scale.fill_(2.0)),
    (
      lambda: os.environ.__setitem__("XLADIST_TEST_BYTECODE", "2"),
      lambda: os.environ.pop("XLADIST_TEST_BYTECODE"),
    ),
  ):
    change()
    assert watched.key() != before
    undo()
    assert watched.key() == before


def test_a_private_attribute_of_a_module_is_guarded_and_its_tables_are_not():
  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.lin = torch.nn.Linear(2, 2)
      self._progress = 1.0

    @property
    def alpha(self):
      return self._progress

    def forward(self, x):
      return self.lin(x) * self.alpha

  net = Net()

  def step(x):
    return net(x)

  recorder, _ = _record(step, torch.ones(1, 2))
  labels = [loc.label for loc, _ in recorder.locations()]
  assert "Net._progress" in labels
  assert not any("_parameters" in label or "_modules" in label for label in labels)


def test_hooks_and_modes_of_every_module_run_are_in_the_key():
  class Trainer:
    def __init__(self):
      self.net = torch.nn.Sequential(torch.nn.Linear(2, 2))

  trainer = Trainer()

  def step(x):
    return trainer.net(x)

  recorder, _ = _record(step, torch.ones(1, 2))
  watched, before = _key(recorder)
  trainer.net.eval()
  assert watched.key() != before
  trainer.net.train()
  assert watched.key() == before
  handle = trainer.net[0].register_forward_hook(lambda m, a, out: out * 2)
  assert watched.key() != before
  handle.remove()
  assert watched.key() == before


def test_torch_modes_follow_autocast_default_dtype_and_determinism():
  before = rg.torch_modes()
  with torch.autocast("cpu", dtype=torch.bfloat16):
    assert rg.torch_modes() != before
  torch.set_default_dtype(torch.float64)
  try:
    assert rg.torch_modes() != before
  finally:
    torch.set_default_dtype(torch.float32)
  with torch.no_grad():
    assert rg.torch_modes() != before
  assert rg.torch_modes() == before


def test_an_iterator_made_before_the_step_is_not_replayable():
  betas = iter([0.1, 0.2, 0.3])

  def step(x):
    return x * next(betas)

  recorder, _ = _record(step, torch.ones(2))
  why = recorder.why_not_replayed()
  assert why.startswith(pe.UNFOLLOWED) and "an iterator made before the step" in why


def test_a_write_by_code_the_recorder_does_not_follow_is_seen_at_the_end():
  import heapq

  heap = [3, 5]

  def step(x):
    heapq.heappush(heap, 1)  # the standard library (C) changes a list the step read
    return x

  recorder, _ = _record(step, torch.ones(2))
  why = recorder.why_not_replayed()
  assert why is not None and "in code xladist does not follow" in why, why


def test_reads_of_other_threads_are_not_the_steps():
  seen = {}
  flag = {"on": True}

  def other():
    seen["v"] = flag["on"]

  def step(x):
    t = threading.Thread(target=other)
    t.start()
    t.join(timeout=30)
    return x

  recorder, _ = _record(step, torch.ones(2))
  assert seen == {"v": True}
  assert not any("flag" in loc.label for loc, _ in recorder.locations())


def test_a_python_without_tables_traces_every_step(monkeypatch):
  monkeypatch.setattr(bytecode, "SUPPORTED", ())

  def step(x):
    return x

  recorder, _ = _record(step, torch.ones(2))
  assert "bytecode tables" in recorder.why_not_replayed()
