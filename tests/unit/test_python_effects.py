"""The recorder of a traced step's Python reads and writes (xladist/_step/python_effects.py),
alone: plain Python functions and CPU tensors, no strategy, no XLA compile.

What it must find is what a replay would otherwise get wrong (issue 50): a value the
step reads through a helper, an attribute path or a dict item (a guard), and a write
the replay would skip (a global counter, a helper object's attribute, a list append,
the host random generators, print, logging). What the step makes itself is neither.
TF's counterpart is tf.function's documented rule that Python side effects run only
while tracing (tensorflow/python/eager/polymorphic_function/polymorphic_function_test.py,
testPythonSideEffects-style cases); xladist instead traces such a step at every call.
"""

import copy
import gc
import logging
import random
import weakref

import pytest
import torch

from xladist._step import python_effects as pe
from xladist._step import read_guards as rg

COUNTER = 0
SETTINGS = {"beta": 0.5, "mode": "kl"}
SCALE = 2.0


class Config:
  def __init__(self, beta):
    self.beta = beta


class Ema:
  def __init__(self):
    self.num_updates = 0
    self.decay = 0.99

  def update(self):
    self.num_updates += 1
    return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))


def _helper(x):
  return x * SCALE


def _record(fn, *args):
  recorder = pe.Recorder(fn)
  with recorder:
    out = fn(*args)
  return recorder, out


def _labels(recorder):
  return {loc.label: value for loc, value in recorder.locations()}


def test_reads_through_helpers_attributes_and_dict_items_are_recorded():
  cfg = Config(0.25)
  model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3)).eval()
  model.use_aux = True  # (eval: CPU dropout would draw from torch's CPU generator)

  def step(x):
    y = model(x)
    if model.use_aux:
      y = y * 2
    return _helper(y) * cfg.beta + SETTINGS["beta"]

  recorder, _ = _record(step, torch.ones(1, 2))
  read = _labels(recorder)
  assert read["global 'SCALE' of " + __name__] == 2.0  # read by a helper
  assert read["Config.beta"] == 0.25  # an attribute of an object in a closure
  assert read["Sequential.use_aux"] is True  # a flag on the top module
  assert read["Dropout.p"] == 0.3  # a module that owns no parameters, in its forward
  assert read["SETTINGS['beta']"] == 0.5  # a dict item under a constant key
  assert "closure variable 'cfg' of " in " ".join(read)
  assert not any(label.endswith(".training") for label in read)  # the signature's modes
  assert recorder.why_not_replayed() is None


def test_a_location_reads_the_value_now_and_the_key_follows_it():
  cfg = Config(0.25)

  def step():
    return cfg.beta

  recorder, _ = _record(step)
  watched = rg.Watched()
  watched.add(recorder)
  before = watched.key()
  cfg.beta = 0.5
  after = watched.key()
  assert before != after
  assert watched.changed(before, after) == ["Config.beta (0.25 -> 0.5)"]
  # only a float changed: it is an input from now on, the key keeps its class
  assert watched.namespaces() == [(cfg.__dict__, "beta")]
  assert watched.key() == watched.key()
  cfg.beta = 0.75
  assert watched.key()[-1] == ("a float input", "a number")
  cfg.beta = 0.0
  assert watched.key()[-1] == ("a float input", 0.0)


def test_an_object_read_is_guarded_by_identity():
  holder = Config(None)
  holder.inner = Config(1.0)

  def step():
    return holder.inner.beta

  recorder, _ = _record(step)
  watched = rg.Watched()
  watched.add(recorder)
  key = watched.key()
  holder.inner = Config(1.0)  # the same value through another object
  assert watched.key() != key


@pytest.mark.parametrize(
  "name, words",
  [
    ("global counter", "sets global 'COUNTER'"),
    ("helper attribute", "sets self.num_updates (Ema)"),
    ("list append", "changes history (list.append)"),
    ("dict item", "sets an item of SETTINGS (dict)"),
    ("host random", "host random-number generator of random"),
    ("torch CPU random", "host random-number generator of torch's CPU generator"),
    ("print", "prints (print)"),
    ("logging", "logs (logger 'user.train')"),
  ],
)
def test_writes_outside_the_program_are_found(name, words, capsys):
  ema = Ema()
  history = []
  log = logging.getLogger("user.train")

  def step():
    global COUNTER
    if name == "global counter":
      COUNTER += 1
    elif name == "helper attribute":
      ema.update()
    elif name == "list append":
      history.append(1)
    elif name == "dict item":
      SETTINGS["mode"] = "kl"
    elif name == "host random":
      random.random()
    elif name == "torch CPU random":
      torch.rand(2)
    elif name == "print":
      print("step")
    elif name == "logging":
      log.warning("step")
    return 0

  recorder, _ = _record(step)
  why = recorder.why_not_replayed()
  assert why is not None and why.startswith(pe.WROTE) and why.kind is pe.Reason.WROTE, why
  assert words in why, why


def test_what_the_step_makes_itself_is_not_a_write():
  class Out:
    def __init__(self):
      self.loss = None

  def step(x):
    out = {}
    out["y"] = x + 1
    parts = []
    parts.append(x)
    result = Out()
    result.loss = x.sum()
    state = {"n": 0}
    state["n"] += 1
    return out, parts, result

  recorder, _ = _record(step, torch.ones(2))
  assert recorder.why_not_replayed() is None, recorder.writes
  # nor are its objects guarded (they die with the step)
  assert not any(loc.kind == "item" for loc, _ in recorder.locations())


def test_objects_a_library_makes_in_the_step_are_the_steps_own():
  """Born in the step without a Python __init__ of its own: copies, a list made by
  a builtin; the garbage collector began tracking them during the trace."""
  ema = Ema()

  def step(x):
    shadow = copy.copy(ema)  # (Ema.__init__ does not run)
    shadow.num_updates = 5
    seen = list(range(2))
    seen.append(x)
    return shadow, seen

  recorder, _ = _record(step, 1)
  assert recorder.why_not_replayed() is None, recorder.writes


def _dict_made_before():
  return dict(beta=0.9)  # atomic values: CPython does not track it


@pytest.mark.parametrize(
  "how",
  ["argument", "alias", "display or argument", "after a freeze of the user's"],
)
def test_a_dict_of_plain_values_made_before_the_step_is_written(how):
  """A dict of atomic values is not tracked by the collector, so tracking does not
  date it: only a local that the frame binds to dict displays alone is the step's
  own; any other such dict is older than the step, and writing it stops replay."""
  cfg = _dict_made_before()
  assert not gc.is_tracked(cfg)

  def by_argument(d):
    d["beta"] = 0.5

  def by_alias(d):
    alias = d
    alias["beta"] = 0.5

  def display_or_argument(d, fresh=False):
    out = d if not fresh else {}  # a jump lands on the store: not a display alone
    out["beta"] = 0.5

  fn = {"argument": by_argument, "alias": by_alias, "display or argument": display_or_argument}
  frozen_before = gc.get_freeze_count()
  if how == "after a freeze of the user's":
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
      recorder, _ = _record(by_argument, cfg)
      assert gc.get_freeze_count() == frozen  # the user's freeze is left as it was
    finally:
      gc.unfreeze()
  else:
    recorder, _ = _record(fn[how], cfg)
    assert gc.get_freeze_count() <= frozen_before  # the recorder's own freeze undone
  assert "sets an item of " in (recorder.why_not_replayed() or ""), recorder.writes


def test_garbage_made_before_the_trace_is_collected_as_young_garbage_after_it():
  """The recorder freezes the collector's generations for the trace; garbage of the
  young generations must not come back as old (collected only by a full collection:
  an abandoned input iterator's prefetch thread lived on)."""

  class Node:
    pass

  collected = []
  node = Node()
  node.me = node  # a cycle: only the collector frees it
  weakref.finalize(node, collected.append, "node")
  del node
  _record(lambda: 1)
  gc.collect(1)  # the young generations only
  assert collected == ["node"]


def test_a_nonlocal_of_the_enclosing_function_is_a_write_and_its_own_cell_is_not():
  total = 0

  def step():
    nonlocal total
    total += 1

  def step_with_inner():
    n = 0

    def bump():
      nonlocal n
      n += 1

    bump()
    return n

  assert "sets nonlocal 'total'" in (_record(step)[0].why_not_replayed() or "")
  assert _record(step_with_inner)[0].why_not_replayed() is None


def test_a_busy_tracing_hook_makes_the_step_unrecordable():
  """Python 3.11 follows frames with sys.settrace (another trace function, a
  debugger's or coverage's, is in the way); 3.12 with sys.monitoring's tool id 4."""
  import sys

  if sys.version_info >= (3, 12):
    sys.monitoring.use_tool_id(4, "someone else")
    try:
      recorder, _ = _record(lambda: 1)
    finally:
      sys.monitoring.free_tool_id(4)
    assert "tool id 4 is taken" in recorder.why_not_replayed()
    return
  sys.settrace(lambda frame, event, arg: None)
  try:
    recorder, _ = _record(lambda: 1)
  finally:
    sys.settrace(None)
  assert "a trace function" in recorder.why_not_replayed()


def test_static_get_runs_no_code():
  calls = []

  class WithProperty:
    limit = 3  # a plain class attribute

    @property
    def value(self):
      calls.append(1)
      return 1

  obj = WithProperty()
  assert rg.static_get(obj, "value") is rg.SKIP
  assert rg.static_get(obj, "limit") == 3
  assert rg.static_get(obj, "missing") is rg.MISSING
  module = torch.nn.Linear(2, 2)
  assert rg.static_get(module, "weight") is module.weight
  assert calls == []


def test_the_fast_check_agrees_with_reading_every_location():
  """Watched.key() first asks a function made for the last key's values; any
  change it misses would replay a stale program, so every kind of change is
  tried against a fresh Watched that reads everything."""
  cfg = Config(0.25)
  holder = Config(None)
  holder.inner = Config(1.0)
  model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3)).eval()

  def step(x):
    y = model(x) * cfg.beta * SETTINGS["beta"] * _helper(1.0)
    return y * holder.inner.beta

  recorder, _ = _record(step, torch.ones(1, 2))

  def fresh_key():
    w = rg.Watched()
    w.add(recorder)
    return w.key()

  watched = rg.Watched()
  watched.add(recorder)
  assert watched.key() == fresh_key()
  assert watched.key() == fresh_key()  # the fast path
  changes = [
    lambda: setattr(cfg, "beta", 1.0),  # a plain value
    lambda: setattr(cfg, "beta", 1),  # an equal number of another type
    lambda: setattr(holder, "inner", Config(1.0)),  # another object
    lambda: setattr(model[1], "p", 0.0),  # a module's setting
    lambda: model.__setattr__("1", torch.nn.Identity()),  # another submodule
    lambda: SETTINGS.__setitem__("beta", 0.25),  # a dict item
    lambda: globals().__setitem__("SCALE", 3.0),  # a helper's global
    lambda: globals().pop("SCALE"),  # gone
  ]
  try:
    for change in changes:
      before = watched.key()
      change()
      after = watched.key()
      assert after == fresh_key()
      assert after != before
  finally:
    SETTINGS["beta"] = 0.5
    globals()["SCALE"] = 2.0
