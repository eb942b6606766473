"""Faults: nothing a user writes kills the process, answers wrongly without a
word, or half-restores a checkpoint (docs/architecture.md, "Failure model")."""

import copy
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torch_xla.core.xla_model as xm
from conftest import local_values

import xladist as xd
import xladist.checkpoint as xc
from xladist.runtime import xla as _runtime

HERE = pathlib.Path(__file__).parent


def _child_env():
  env = dict(
    os.environ,
    PJRT_DEVICE="CPU",
    CPU_NUM_DEVICES="4",
    PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]),
  )
  return env


# -- A. what used to kill the process -------------------------------------------


@pytest.fixture(scope="module")
def death_cases():
  proc = subprocess.run(
    [sys.executable, str(HERE / "_faults_child.py")],
    env=_child_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  lines = {}
  for line in proc.stdout.splitlines():
    if line.startswith("CASE "):
      name, outcome = line[5:].split(" ", 1)
      lines[name] = outcome
  return proc, lines


def test_process_survives_every_case(death_cases):
  proc, lines = death_cases
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.rstrip().endswith("done")
  assert "Check failed" not in proc.stderr


@pytest.mark.parametrize(
  "case,call", [("list", "add"), ("dict", "__repr__"), ("attribute", "cpu"), ("set", "item")]
)
def test_a_tensor_kept_from_a_step_raises_naming_strategy_run(death_cases, case, call):
  """Issue 16 A.1: history.append(loss) in the step, history[0] read after it."""
  _, lines = death_cases
  assert lines[case].startswith(
    f"RuntimeError: {call}: this tensor was made inside strategy.run (keeps at "
  )
  assert lines["sync_after"].startswith("ok ")  # and the next sync runs


def test_a_returned_dataclass_comes_back_as_per_replica_values(death_cases):
  """Issue 16 A.2."""
  _, lines = death_cases
  assert lines["dataclass"].startswith("ok [") and lines["frozen_dataclass"] == "ok PerReplica"


@pytest.mark.parametrize(
  "case,where",
  [
    ("moved_by_hand", "on the XLA device, but not made under this strategy's scope"),
    ("cpu_model", "on the cpu device"),
    ("deepcopy", "on the XLA device, but not made under this strategy's scope"),
    ("other_strategy", "on the XLA device, but not made under this strategy's scope"),
  ],
)
def test_a_model_that_is_not_the_strategys_is_refused_before_it_gets_gradients(
  death_cases, case, where
):
  """Issue 16 A.3, A.4 and D.17: the error names the parameter, its device and the
  fix, and the model keeps no replica-local gradient."""
  _, lines = death_cases
  assert lines[case].startswith(
    "RuntimeError: strategy.run: linear got a Parameter of shape (2, 3) that requires "
    f"gradients and is {where}"
  )
  assert lines["moved_by_hand_after"] == "ok (None, True)"
  assert lines["other_strategy_grad"] == "ok None"
  assert lines["train_after_other"] == "ok PerReplica"
  assert lines["adopted"] == "ok PerReplica"


@pytest.mark.parametrize("how", ["print", "tolist", "item", "bool", "numpy", "sync", "mark_step"])
def test_a_host_read_in_a_step_leaves_the_next_steps_working(death_cases, how):
  """Issue 16 A.5: the exception is kept (except ... as e), the next step runs."""
  _, lines = death_cases
  assert lines[f"read_{how}"].startswith("raised strategy.run: the step function read")
  assert lines[f"after_{how}"] == "ok True"


# -- B. silently wrong answers ------------------------------------------------------


def test_xm_collectives_reduce_across_replicas(strategy, per_replica):
  """Issue 16 B.6: torch_xla's own idioms compute the cross-replica result."""
  x = per_replica(lambda r: torch.full((4,), float(r + 1)))

  def step(t):
    total = xm.all_reduce(xm.REDUCE_SUM, t)
    largest = xm.all_reduce(xm.REDUCE_MAX, t, scale=2.0)
    gathered = xm.all_gather(t, dim=0)
    shard = xm.reduce_scatter(xm.REDUCE_SUM, t, 1.0, 0, 4)
    listed = [t * 1, t * 2]
    xm.all_reduce(xm.REDUCE_SUM, listed)  # the list form works in place
    return total, largest, gathered, shard, listed[1]

  total, largest, gathered, shard, listed = strategy.run(step, args=(x,))
  assert [v.tolist() for v in local_values(strategy, total)] == [[10.0] * 4] * 4
  assert local_values(strategy, largest)[0].tolist() == [8.0] * 4
  assert local_values(strategy, gathered)[2].tolist() == sum(
    ([float(r)] * 4 for r in range(1, 5)), []
  )
  assert [v.tolist() for v in local_values(strategy, shard)] == [[10.0]] * 4
  assert local_values(strategy, listed)[3].tolist() == [20.0] * 4
  for call, match in (
    (lambda t: xm.mesh_reduce("x", t, sum), "xm.mesh_reduce inside"),
    (lambda t: xm.all_to_all(t, 0, 0, 4), "xm.all_to_all inside"),
    (lambda t: xm.all_reduce("mul", t), "REDUCE_SUM, REDUCE_MIN"),
    (lambda t: xm.all_reduce("sum", t, groups=[[0, 1], [2, 3]]), r"groups=\[\[0, 1\], \[2, 3\]\]"),
  ):
    with pytest.raises((RuntimeError, ValueError), match=match):
      strategy.run(call, args=(x,))
  assert xm.all_reduce is not None and xm.all_reduce.__module__ == "torch_xla.core.xla_model"


def test_torch_xla_world_size_and_ordinals_in_a_step(strategy, per_replica):
  """Issue 16 B.6 siblings: xr.world_size() is the replica count (it would say 1);
  ordinals, one per replica, raise naming replica_id_in_sync_group."""
  import torch_xla.runtime as xr

  x = per_replica(lambda r: torch.ones(2))
  out = strategy.run(lambda t: t / xr.world_size(), args=(x,))
  assert local_values(strategy, out)[0].tolist() == [0.25, 0.25]
  for module, name in (
    (xr, "global_ordinal"),
    (xr, "local_ordinal"),
    (xm, "get_local_ordinal"),
    (xm, "is_master_ordinal"),
  ):
    with pytest.raises(
      RuntimeError,
      match=re.escape(f"{name}() inside strategy.run: ") + ".*replica_id_in_sync_group",
    ):
      strategy.run(lambda t, m=module, n=name: t * getattr(m, n)(), args=(x,))
  assert xr.world_size() == 1  # put back after the step


def test_xm_optimizer_step_trains_like_optimizer_step(strategy, per_replica):
  """Issue 16 B.6 sibling: xm.optimizer_step inside run is optimizer.step()
  (which aggregates the gradients once)."""
  results = []
  for use_xm in (False, True):
    torch.manual_seed(3)
    with strategy.scope():
      model = torch.nn.Linear(3, 1)
      opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = per_replica(lambda r: torch.full((2, 3), float(r)))

    def step(t, use_xm=use_xm):
      opt.zero_grad()
      model(t).sum().backward()
      xm.optimizer_step(opt) if use_xm else opt.step()

    strategy.run(step, args=(x,))
    results.append(model.weight.detach().cpu())
  torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_dropout_differs_per_replica_and_equals_the_global_batch_on_one_device(strategy):
  """Issue 16 B.7: each replica draws its own mask; dropout over N replicas of b
  rows is dropout over the N * b rows of the global batch (same seed), and
  torch.manual_seed makes it reproducible."""
  rows = torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5) + 1
  x = strategy.experimental_distribute_values_from_function(
    lambda ctx: rows[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
  )

  def draw(seed):
    torch.manual_seed(seed)
    out = strategy.run(
      lambda t: (
        F.dropout(t, 0.5),
        torch.rand(3, device=t.device),
        F.dropout2d(t.reshape(2, 5, 1, 1), 0.5).reshape(2, 5),
      ),
      args=(x,),
    )
    return [torch.cat(local_values(strategy, o)) for o in out]

  masks, rand, channels = draw(11)
  assert len({tuple(r.tolist()) for r in rand.reshape(4, 3)}) == 4  # replicas differ
  assert not torch.equal(masks[:2] != 0, masks[2:4] != 0)
  one = xd.OneDeviceStrategy()
  xm.set_rng_state(11)
  reference = one.run(lambda t: F.dropout(t, 0.5), args=(rows.to(_runtime.device()),))
  torch.testing.assert_close(masks, reference.cpu(), rtol=0, atol=0)
  again = draw(12)
  assert not torch.equal(again[0], masks)
  repeat = draw(11 + 2**40)  # a new seed reseeds; back to 11 repeats the draws
  torch.manual_seed(99)
  assert not torch.equal(repeat[0], masks)
  torch.testing.assert_close(draw(11)[0], masks, rtol=0, atol=0)


def test_per_replica_components_of_different_dtypes_are_refused(strategy):
  """Issue 16 B.8 (and its siblings in reduce and gather)."""
  mixed = xd.PerReplica(
    [torch.tensor([1]), torch.tensor([1.0]), torch.tensor([1]), torch.tensor([1])]
  )
  for call in (
    lambda: strategy.run(lambda v: v, args=(mixed,)),
    lambda: strategy.reduce("sum", mixed, axis=None),
    lambda: strategy.gather(mixed, 0),
  ):
    with pytest.raises(ValueError, match=re.escape("'torch.int64', 'torch.float32'")):
      call()


@pytest.mark.parametrize(
  "bad,what",
  [
    ({"x": torch.ones(8, 3, dtype=torch.float64), "y": torch.zeros(8)}, "float64"),
    ({"x": torch.ones(8, 4), "y": torch.zeros(8)}, "(4,) torch.float32"),
    ({"x": torch.ones(8, 3), "z": torch.zeros(8)}, "'z'"),
    ({"x": torch.ones(8, 3), "y": torch.zeros(8), "w": torch.zeros(8)}, "'w'"),
  ],
)
def test_a_batch_unlike_the_first_is_refused_before_the_step(strategy, bad, what):
  """Issue 16 B.9: dtype, feature size and structure are checked against the
  first batch (the element_spec)."""
  batches = [{"x": torch.ones(8, 3), "y": torch.zeros(8)}] * 2 + [bad]
  it = iter(strategy.experimental_distribute_dataset(batches))
  next(it), next(it)
  with pytest.raises(
    ValueError,
    match=r"batch 2 of the epoch does not match the "
    r"element_spec taken from the first batch: it is .*" + re.escape(what),
  ):
    next(it)
  per_replica = strategy.distribute_datasets_from_function(
    lambda ctx: [torch.ones(2, 3)] * 5 + [torch.ones(2, 3, dtype=torch.int32)]
  )
  it = iter(per_replica)
  next(it)
  with pytest.raises(ValueError, match=r"per-replica batch 5 of the epoch does not match"):
    next(it)


def test_restored_position_past_the_end_of_a_shorter_dataset_raises(strategy, tmp_path):
  """Issue 16 B.10: sized datasets at restore (before anything changes), unsized
  ones at the next element."""
  long = [torch.ones(8, 2) * i for i in range(6)]
  it = iter(strategy.experimental_distribute_dataset(long))
  for _ in range(5):
    next(it)
  xc.Checkpoint(it=it).save(tmp_path / "c.pt")
  short = iter(strategy.experimental_distribute_dataset(long[:3]))
  with pytest.raises(
    ValueError,
    match=r"is the iterator position 5 .* the dataset has at "
    r"most 3 elements in an epoch now",
  ):
    xc.Checkpoint(it=short).restore(tmp_path / "c.pt")

  class Unsized:
    def __iter__(self):
      return iter(long[:3])

  unsized = iter(strategy.experimental_distribute_dataset(Unsized()))
  xc.Checkpoint(it=unsized).restore(tmp_path / "c.pt")
  with pytest.raises(
    ValueError,
    match=r"restored to position 5 \(batches already taken "
    r"in this epoch\), but the dataset has only 3 batches",
  ):
    next(unsized)


# -- C. checkpoints that half-apply or disappear -------------------------------------


def _model(strategy, seed=0):
  torch.manual_seed(seed)
  with strategy.scope():
    model = torch.nn.Sequential(
      torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )
  return model


def _train(strategy, model, opt, steps=2):
  x = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.randn(
      4, 3, generator=torch.Generator().manual_seed(ctx.replica_id_in_sync_group)
    )
  )

  def step(t):
    opt.zero_grad()
    model(t).pow(2).mean().backward()
    opt.step()

  for _ in range(steps):
    strategy.run(step, args=(x,))
  _runtime.sync()


def _state(model, opt):
  return (
    {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    copy.deepcopy({k: v for k, v in opt.state_dict().items() if k != "state"}),
    {
      k: {s: t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t for s, t in st.items()}
      for k, st in opt.state_dict()["state"].items()
    },
  )


def _assert_same(before, after):
  torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_restoring_sgd_into_adam_changes_nothing_and_names_both(strategy, tmp_path):
  """Issue 16 C.11 and C.12."""
  model = _model(strategy)
  sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  _train(strategy, model, sgd)
  xc.Checkpoint(model=model, optimizer=sgd).save(tmp_path / "sgd.pt")
  target = _model(strategy, seed=1)
  adam = torch.optim.Adam(target.parameters(), lr=0.01)
  _train(strategy, target, adam)
  before = _state(target, adam)
  with pytest.raises(
    ValueError,
    match=re.escape("'optimizer' in") + r".* was saved from a SGD and is restored into a Adam",
  ):
    xc.Checkpoint(model=target, optimizer=adam).restore(tmp_path / "sgd.pt")
  _assert_same(before, _state(target, adam))
  _train(strategy, target, adam)  # Adam still trains
  # An optimizer whose groups do not fit (another model's parameters).
  small = torch.nn.Linear(3, 1)
  other = torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9)
  before = _state(target, other)
  with pytest.raises(
    ValueError,
    match=r"parameter group 0 has 6 parameters in the file "
    r"and 2 in the SGD",
  ):
    xc.Checkpoint(model=target, optimizer=other).restore(tmp_path / "sgd.pt")
  _assert_same(before, _state(target, other))


def test_a_load_that_fails_while_applying_is_undone(strategy, tmp_path):
  """Issue 16 C.11 sibling: a state dict that passes the checks and still fails
  to load undoes what was already applied (model, buffers' per-replica
  components included)."""
  model = _model(strategy)
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  _train(strategy, model, opt)

  class Fragile:
    def __init__(self):
      self.value = 1

    def state_dict(self):
      return {"value": self.value}

    def load_state_dict(self, state):
      raise RuntimeError("fragile object refuses")

  ckpt = xc.Checkpoint(model=model, optimizer=opt, fragile=Fragile())
  ckpt.save(tmp_path / "c.pt")
  _train(strategy, model, opt)
  before = _state(model, opt)
  components = torch.stack(strategy.experimental_local_results(model[1].running_mean)).cpu()
  with pytest.raises(RuntimeError, match="fragile object refuses"):
    ckpt.restore(tmp_path / "c.pt")
  _assert_same(before, _state(model, opt))
  _assert_same(
    components, torch.stack(strategy.experimental_local_results(model[1].running_mean)).cpu()
  )


def test_max_to_keep_is_a_hard_bound_in_save_order(tmp_path):
  """Issue 16 C.13 (TF's CheckpointManager counts in save order)."""
  manager = xc.CheckpointManager(xc.Checkpoint(step=0), tmp_path, max_to_keep=3)
  for _ in range(4):
    manager.save()
  latest = manager.save(checkpoint_number=0)
  names = sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt"))
  assert names == ["ckpt-0.pt", "ckpt-3.pt", "ckpt-4.pt"]
  assert manager.latest_checkpoint == latest
  assert [os.path.basename(p) for p in manager.checkpoints] == [
    "ckpt-3.pt",
    "ckpt-4.pt",
    "ckpt-0.pt",
  ]
  assert manager.save().endswith("ckpt-5.pt")  # numbers go on from the highest


def test_a_second_manager_of_the_same_files_is_refused(tmp_path):
  """Issue 16 C.14: B's rotation would delete A's checkpoints; B is refused
  (also from another process) until A is closed."""
  a = xc.CheckpointManager(xc.Checkpoint(step=0), tmp_path, max_to_keep=1)
  a.save()
  with pytest.raises(
    RuntimeError,
    match=re.escape(
      f"another CheckpointManager keeps the 'ckpt' checkpoints in {str(tmp_path)!r} "
      f"(process {os.getpid()} on "
    ),
  ):
    xc.CheckpointManager(xc.Checkpoint(step=1), tmp_path, max_to_keep=1)
  other_name = xc.CheckpointManager(xc.Checkpoint(step=1), tmp_path, checkpoint_name="b")
  other_name.save()
  code = (
    "import sys, xladist.checkpoint as xc\n"
    "try:\n  xc.CheckpointManager(xc.Checkpoint(), sys.argv[1])\n"
    "except RuntimeError as e:\n  print('refused', 'another CheckpointManager' in str(e))\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code, str(tmp_path)],
    env=_child_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.stdout.strip() == "refused True", proc.stderr[-2000:]
  a.close()
  b = xc.CheckpointManager(xc.Checkpoint(step=1), tmp_path, max_to_keep=1)
  assert b.latest_checkpoint.endswith("ckpt-1.pt")


# -- D. errors that say what to do ----------------------------------------------------


def test_communication_timeouts_inf_means_no_bound_and_others_are_checked(strategy, per_replica):
  """Issue 16 D.15."""
  unbounded = xd.experimental.CommunicationOptions(timeout_seconds=float("inf"))
  assert unbounded.timeout_seconds is None
  v = per_replica(lambda r: torch.tensor(float(r)))
  assert strategy.extended.reduce_to("sum", v, "cpu", options=unbounded).item() == 6.0
  for bad in (1e300, -1.0, 0, float("nan"), float("-inf")):
    with pytest.raises(
      ValueError,
      match=re.escape(
        "timeout_seconds must be None or inf (no bound) or a positive number of seconds up to"
      ),
    ):
      xd.experimental.CommunicationOptions(timeout_seconds=bad)


def test_accumulation_fn_returning_no_tensor_is_named(per_replica):
  """Issue 16 D.16, inside a step and outside."""
  strategy = xd.MirroredStrategy(
    cross_device_ops=xd.ReductionToOneDevice(accumulation_fn=lambda values: None)
  )
  v = per_replica(lambda r: torch.tensor([float(r)]))
  with pytest.raises(
    TypeError,
    match=re.escape(
      "ReductionToOneDevice: accumulation_fn '<lambda>' returned NoneType for a list of 4 tensors"
    ),
  ):
    strategy.reduce("sum", v, axis=None)
  with pytest.raises(TypeError, match="accumulation_fn '<lambda>' returned NoneType"):
    strategy.run(lambda t: xd.get_replica_context().all_reduce("sum", t), args=(v,))
  wrong = xd.ReductionToOneDevice(accumulation_fn=lambda values: torch.stack(values))
  with pytest.raises(
    ValueError,
    match=r"returned a tensor of shape \(4, 1\) for values of "
    r"shape \(1,\)",
  ):
    wrong.reduce("sum", v, destinations="cpu")


def test_a_per_replica_of_another_strategy_is_named(per_replica):
  """Issue 16 D.18."""
  v = per_replica(lambda r: torch.tensor(float(r)))
  with pytest.raises(
    ValueError,
    match=re.escape(
      "OneDeviceStrategy.run: args[0] is a PerReplica with 4 components (made for a strategy "
      "with 4 replicas), passed to OneDeviceStrategy, which has 1 replica"
    ),
  ):
    xd.OneDeviceStrategy().run(lambda t: t, args=(v,))
  # Deep in a nest, the message names the leaf.
  with pytest.raises(
    ValueError,
    match=re.escape("OneDeviceStrategy.run: kwargs['batch'][1]['x'] is a PerReplica with 4"),
  ):
    xd.OneDeviceStrategy().run(lambda batch: batch, kwargs={"batch": (1, {"x": v})})
