"""Signature differences in words (xladist/_step/signature.py), on hand-made signatures,
and the parts of a signature taken from plain Python (closures, globals, train/eval
modes, optimizers' groups on the CPU): no strategy, no device.

A signature maps a readable place to an entry: ("tensor", shape, dtype, sharding[,
requires_grad, grad]), ("value", v), ("hyper", 0.0 | 1.0 | "a number"), ("function",
qualname, code id), ("PerReplica", ...), ("pending", ...). `differences` names what
changed between two steps' signatures (compile_watch.py's explanations).
"""

import functools

import torch

from xladist._step import signature as sig
from xladist._step.signature import ByName

SHARDED = "{devices=[4,1]0,1,2,3}"


def tensor(shape, dtype=torch.float32, sharding=""):
  return ("tensor", tuple(shape), dtype, sharding)


def variable(shape, sharding="{replicated}", requires_grad=True, grad=None):
  return ("tensor", tuple(shape), torch.float32, sharding, requires_grad, grad)


def base():
  return {
    "fn": ("function", "train_step", 1),
    "args[0]['x']": tensor((8, 4)),
    ByName("global 'flag'"): ("value", True),
    "Linear#0.weight": variable((4, 4)),
    "optimizer 0 (SGD) state entries": ("value", 1),
    "optimizer 0 group 0 'lr'": ("hyper", "a number"),
  }


def test_equal_signatures_have_no_differences():
  assert sig.differences(base(), base()) is None
  assert sig.explain(base(), base()) is None


def test_a_tensors_shape_and_dtype():
  new = base()
  new["args[0]['x']"] = tensor((16, 4), torch.bfloat16)
  assert sig.differences(base(), new) == (
    "args[0]['x'] changed shape and dtype: tensor[8, 4] float32 -> tensor[16, 4] bfloat16"
  )
  new["args[0]['x']"] = tensor((8, 4), torch.float64)
  assert sig.differences(base(), new) == (
    "args[0]['x'] changed dtype: tensor[8, 4] float32 -> tensor[8, 4] float64"
  )


def test_a_variables_sharding_requires_grad_and_grad():
  new = base()
  new["Linear#0.weight"] = variable((4, 4), SHARDED, requires_grad=False)
  assert sig.differences(base(), new) == (
    "Linear#0.weight changed sharding and requires_grad: tensor[4, 4] float32 replicated -> "
    f"tensor[4, 4] float32 sharded {SHARDED} (requires_grad=False)"
  )
  new["Linear#0.weight"] = variable((4, 4), grad=((4, 4), torch.float32))
  assert sig.differences(base(), new) == (
    "Linear#0.weight changed grad: tensor[4, 4] float32 -> tensor[4, 4] float32 with a .grad"
  )


def test_a_value_a_kind_and_a_function():
  new = base()
  new[ByName("global 'flag'")] = ("value", False)
  assert sig.differences(base(), new) == "global 'flag' changed value: True -> False"
  new = base()
  new["args[0]['x']"] = ("value", 3)
  assert sig.differences(base(), new) == "args[0]['x'] changed kind: tensor[8, 4] float32 -> 3"
  new = base()
  new["fn"] = ("function", "eval_step", 2)
  assert sig.differences(base(), new) == "a different fn (train_step -> eval_step)"
  new = base()
  new["args[0]['x']"] = ("object", "Batch")
  assert sig.differences(base(), new) == (
    "args[0]['x'] changed kind: tensor[8, 4] float32 -> a Batch"
  )


def test_a_hyperparameters_class():
  """The key keeps whether a hyperparameter is 0, 1 or another number."""
  new = base()
  new["optimizer 0 group 0 'lr'"] = ("hyper", 0.0)
  line = sig.differences(base(), new)
  assert line.startswith("optimizer 0 group 0 'lr' changed ")
  assert line.endswith(": 'a number' -> 0.0")


def test_distributed_values_name_the_part_that_changed():
  old, new = base(), base()
  old["args[0]['x']"] = ("PerReplica", (tensor((2, 4)),) * 4)
  new["args[0]['x']"] = ("PerReplica", (tensor((3, 4)),) * 4)
  assert sig.differences(old, new) == (
    "args[0]['x'] changed shape: PerReplica of 4 x tensor[2, 4] float32 -> "
    "PerReplica of 4 x tensor[3, 4] float32"
  )
  new["args[0]['x']"] = (
    "PerReplica",
    (tensor((2, 4)), tensor((2, 4)), tensor((2, 4), torch.int64)),
  )
  assert sig.differences(old, new) == (
    "args[0]['x'] changed kind: PerReplica of 4 x tensor[2, 4] float32 -> PerReplica of "
    "tensor[2, 4] float32, tensor[2, 4] float32, tensor[2, 4] int64"
  )
  old["args[0]['x']"] = ("PerReplica", tensor((8, 4), sharding=SHARDED))
  new["args[0]['x']"] = ("PerReplica", tensor((8, 4), sharding="{replicated}"))
  assert sig.differences(old, new) == (
    f"args[0]['x'] changed sharding: PerReplica of tensor[8, 4] float32 sharded {SHARDED} -> "
    "PerReplica of tensor[8, 4] float32 replicated"
  )
  old["args[0]['x']"] = ("Mirrored", (tensor((4,)),))
  new["args[0]['x']"] = ("Mirrored", (tensor((5,)),))
  assert sig.differences(old, new) == (
    "args[0]['x'] changed shape: Mirrored of 1 x tensor[4] float32 -> "
    "Mirrored of 1 x tensor[5] float32"
  )


def test_new_and_gone_places():
  new = base()
  new["args[1]"] = ("value", 2)
  del new[ByName("global 'flag'")]
  assert sig.differences(base(), new) == ("args[1] is new (2); global 'flag' is gone (was True)")


def test_an_optimizer_new_to_xladist_is_said_once():
  """Its group entries are unknown before its first step, not each new."""
  new = base()
  new["optimizer 1 (Adam) state entries"] = ("value", 3)
  new["optimizer 1 group 0 'lr'"] = ("hyper", "a number")
  new["optimizer 1 group 0 params"] = ("value", 3)
  new["args[0]['x']"] = tensor((4, 4))
  assert sig.differences(base(), new) == (
    "optimizer 1 (Adam) is new to xladist since the previous step began (it knows an "
    "optimizer from a name fn reads or from its first step() inside strategy.run); it has "
    "state for 3 parameters; args[0]['x'] changed shape: tensor[8, 4] float32 -> tensor[4, 4] "
    "float32"
  )
  # A new entry of an optimizer xladist knew is named as new.
  new = base()
  new["optimizer 0 group 1 'lr'"] = ("hyper", "a number")
  assert sig.differences(base(), new) == "optimizer 0 group 1 'lr' is new ('a number')"


def test_at_most_three_places_then_a_count():
  new = {"fn": ("function", "other", 9)}
  line = sig.differences(base(), new)
  assert line == (
    "a different fn (train_step -> other); args[0]['x'] is gone (was tensor[8, 4] float32); "
    "global 'flag' is gone (was True); and 3 more"
  )
  assert sig.differences(base(), new, limit=6).count(";") == 5
  assert "more" not in sig.differences(base(), new, limit=6)


def test_pending_work():
  key = "pending work in the variables and their gradients"
  old, new = base(), base()
  old[key], new[key] = ("pending", None), ("pending", "ab12")
  assert sig.differences(old, new) == (
    "the step's variables and their gradients: device data only when the previous step "
    "began, work traced and not executed yet (it joins the step's program) now"
  )
  old[key] = ("pending", "cd34")
  assert sig.differences(old, new) == (
    "the step's variables and their gradients hold other work traced and not executed yet "
    "than when the previous step began"
  )
  old[key] = sig.UNSYNCED
  assert sig.differences(old, new) == (
    "the step's variables and their gradients: not checked (no torch_xla.sync() since the "
    "step before) when the previous step began, work traced and not executed yet (it joins "
    "the step's program) now"
  )


def test_explain_leaves_out_the_modes_a_function_sets_itself():
  old, new = base(), base()
  old["model (Sequential) training"] = ("value", True)
  new["model (Sequential) training"] = ("value", False)
  assert sig.explain(old, new) == "model (Sequential) training changed value: True -> False"
  old[sig._SETS_MODES] = new[sig._SETS_MODES] = ("value", True)
  assert sig.explain(old, new) is None
  new["args[0]['x']"] = tensor((2, 4))
  assert sig.explain(old, new) == (
    "args[0]['x'] changed shape: tensor[8, 4] float32 -> tensor[2, 4] float32"
  )


def test_replay_entries_leave_out_values_read_by_name():
  entries = dict(sig.replay_entries(base()))
  assert set(entries) == set(base()) - {"global 'flag'"}
  assert "fn" in entries and "Linear#0.weight" in entries


def test_hyper_class():
  assert sig._hyper_class(0.0) == 0.0
  assert sig._hyper_class(1.0) == 1.0
  assert sig._hyper_class(0.5) == "a number"
  assert sig._hyper_class(-1.0) == "a number"
  assert sig._hyper_class(3) == ("int", 3)


# -- entries taken from plain Python -------------------------------------------------------------

FLAG = True
MODEL = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
OPT = torch.optim.SGD(MODEL.parameters(), lr=0.1, momentum=0.9)


def _make_step():
  n, name, items = 3, "x", [1]

  def step(x):
    MODEL.train()
    OPT.step()
    return x * n + FLAG, name, items

  return step


def test_python_values_reads_closures_globals_modes_and_optimizers():
  out, optimizers = {}, {}
  sig._python_values(_make_step(), out, optimizers)
  assert out == {
    sig._SETS_MODES: ("value", True),
    "fn's closure variable 'n'": ("value", 3),
    "fn's closure variable 'name'": ("value", "x"),
    "global 'FLAG'": ("value", True),
    "MODEL (Sequential) training": ("value", True),
    "MODEL.0 (Linear) training": ("value", True),
    "MODEL.1 (Dropout) training": ("value", True),
  }
  assert {type(k) for k in out if "closure" in k or "global" in k} == {ByName}
  assert list(optimizers.values()) == [OPT]
  MODEL[1].eval()
  try:
    out = {}
    sig._python_values(_make_step(), out, {})
    assert out["MODEL.1 (Dropout) training"] == ("value", False)
  finally:
    MODEL.train()


def test_a_callable_objects_attributes_are_read():
  class Step:
    def __init__(self):
      self.scale = 2.0
      self.model = MODEL

    def __call__(self, x):
      return x * self.scale

  out = {}
  sig._python_values(Step(), out, {})
  assert out[ByName("Step.scale")] == ("value", 2.0)
  assert out["Step.model (Sequential) training"] == ("value", True)
  assert sig._SETS_MODES not in out


def test_unwrap():
  step = _make_step()
  obj, func = sig._unwrap(functools.partial(functools.partial(step, 1)))
  assert obj is None and func is step

  class Holder:
    def run(self, x):
      return x

    def __call__(self, x):
      return x

  h = Holder()
  assert sig._unwrap(h.run) == (h, Holder.run)
  assert sig._unwrap(h) == (h, Holder.__call__)


def test_sets_modes_looks_into_nested_functions():
  def outer():
    def inner(m):
      m.eval()

    return inner

  def plain(x):
    return x.training

  assert sig._sets_modes(outer.__code__) is True
  assert sig._sets_modes(plain.__code__) is False


def test_optimizer_entries():
  opt = torch.optim.SGD(
    [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))],
    lr=1.0,
    momentum=0.9,
    weight_decay=0,
  )
  opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.0})
  out, slots = {}, []
  sig._optimizer("optimizer 2", opt, out, slots)
  assert out["optimizer 2 (SGD) state entries"] == ("value", 0)
  assert out["optimizer 2 group 0 'lr'"] == ("hyper", 1.0)
  assert out["optimizer 2 group 0 'momentum'"] == ("hyper", "a number")
  assert out["optimizer 2 group 0 'weight_decay'"] == ("value", 0)  # an int
  assert out["optimizer 2 group 0 'nesterov'"] == ("value", False)
  assert out["optimizer 2 group 0 params"] == ("value", 2)
  assert out["optimizer 2 group 1 'lr'"] == ("hyper", 0.0)
  assert out["optimizer 2 group 1 params"] == ("value", 1)
  assert slots == []
  adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], betas=(0.0, 0.999))
  out = {}
  sig._optimizer("optimizer 0", adam, out, slots)
  assert out["optimizer 0 group 0 'betas'"] == ("hyper", (0.0, "a number"))


# -- the modules' part, checked rather than walked again (issue 61) ------------------------


class _Store:
  """What the signature reads of a VariableStore: its list of weakly held modules."""

  def __init__(self, *modules):
    import weakref

    self._modules = [weakref.ref(m) for m in modules]

  def modules(self):
    return (m for m in (r() for r in self._modules) if m is not None)

  def optimizers(self):
    return iter(())


def _walked(store):
  out = {}
  sig._module_walk(store, out)
  return out


def test_the_modules_part_is_checked_and_follows_every_change(monkeypatch):
  """After two equal walks the part comes from a generated check; each change a user
  can make between steps makes the check fail and the part walked again."""
  shardings = {}
  monkeypatch.setattr(sig._runtime, "sharding_spec", lambda t: shardings.get(id(t), ""))
  model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
  model[0].scale = 0.5  # a public plain attribute
  store = _Store(*model.modules())
  taken = lambda: sig._take(lambda: None, (), {}, store, None)  # noqa: E731
  for _ in range(3):
    assert sig._module_entries(store) == _walked(store)
  cached = sig._MODULE_ENTRIES[store]
  assert cached.same is not None and cached.same(store)
  assert sig._module_entries(store) is cached.entries  # not walked

  lin, bn = model[0], model[1]

  def grad(t):
    t.grad = torch.zeros_like(t)

  changes = [
    lambda: setattr(lin.weight, "data", torch.zeros(5, 4)),  # shape
    lambda: setattr(lin.weight, "data", torch.zeros(5, 4, dtype=torch.float64)),  # dtype
    lambda: lin.bias.requires_grad_(False),
    lambda: grad(lin.bias),  # a gradient appears
    lambda: setattr(lin.bias, "grad", None),
    lambda: shardings.__setitem__(id(lin.weight), "{devices=[4,1]0,1,2,3}"),
    lambda: setattr(lin, "scale", 0.25),  # a plain attribute's value
    lambda: setattr(lin, "extra", 3),  # a new one
    lambda: setattr(lin, "extra", torch.nn.ReLU()),  # plain -> not plain (a submodule)
    lambda: setattr(bn, "momentum", None),
    lambda: bn._buffers.__setitem__("running_mean", None),  # a buffer gone
    lambda: lin.register_buffer("step", torch.zeros(())),  # a new buffer (structure)
  ]
  for change in changes:
    before = dict(sig._module_entries(store))
    sig._module_entries(store)  # (stable again: checked)
    change()
    now = sig._module_entries(store)
    assert now == _walked(store) and now != before, change
    assert taken() == taken()
  del store._modules[1:]  # the store's list replaced by a shorter one
  store._modules = list(store._modules)
  assert sig._module_entries(store) == _walked(store)
  assert list(sig._module_entries(store)) == list(_walked(store))  # in the walk's order


def test_the_modules_check_keeps_no_store_alive():
  """The cache is weak in the store: its checker must not hold the store either."""
  import gc
  import weakref

  model = torch.nn.Linear(2, 2)
  store = _Store(model)
  for _ in range(3):
    sig._module_entries(store)
  assert sig._MODULE_ENTRIES[store].same is not None
  ref = weakref.ref(store)
  del store
  gc.collect()
  assert ref() is None
