"""The sharded checkpoint format (CheckpointOptions(sharded=True)): what it
does beyond the tests both formats share in tests/test_checkpoint.py."""

import json
import os
import pathlib
import pickle
import re
import socket
import subprocess
import sys

import _sharding
import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import xladist.checkpoint as xc
from xladist.checkpoint import sharded
from xladist.cluster_resolver import _multihost
from xladist.runtime import xla as _runtime

HERE = pathlib.Path(__file__).parent
SHARDED = xc.CheckpointOptions(sharded=True)


def _spec(t):
  return torch_xla._XLAC._get_xla_sharding_spec(t)


def _on_mesh(t, spec):
  """`t` on the 4 devices with sharding `spec` (a partition spec of the mesh's one axis)."""
  x = t.to(torch_xla.device())
  xs.mark_sharding(x, xs.Mesh(np.arange(4), (4,), ("d",)), spec)
  return x


def _metadata(path):
  import torch.distributed.checkpoint as dcp

  return dcp.FileSystemReader(str(path)).read_metadata()


def _data_file(path, fqn):
  """The file that holds the tensor `fqn` (DCP's name)."""
  (name,) = {i.relative_path for x, i in _metadata(path).storage_data.items() if x.fqn == fqn}
  return os.path.join(path, name)


def test_a_sharded_tensor_is_written_as_its_shards_and_read_into_any_sharding(strategy, tmp_path):
  expected = torch.arange(32.0).reshape(8, 4)
  rows = _on_mesh(expected, ("d", None))
  path = xc.Checkpoint(t=rows).save(tmp_path / "c", options=SHARDED)
  chunks = _metadata(path).state_dict_metadata["t"].chunks
  assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [
    ((r, 0), (2, 4)) for r in (0, 2, 4, 6)
  ]
  # Restored in place into a tensor split by columns, a replicated one and a CPU one.
  columns = _on_mesh(torch.zeros(8, 4), (None, "d"))
  replicated = _on_mesh(torch.zeros(8, 4), (None, None))
  cpu = torch.zeros(8, 4)
  for target in (columns, replicated, cpu):
    before = _spec(target) if target.device.type == "xla" else None
    xc.Checkpoint(t=target).restore(path)
    torch.testing.assert_close(target.cpu(), expected, rtol=0, atol=0)
    if before is not None:
      assert _spec(target) == before
  assert _spec(columns) == "{devices=[1,4]0,1,2,3}"


def test_a_replicated_tensor_is_written_once_by_the_host_with_least_to_write():
  """Two hosts' plans (simulated): torch_xla's own planner gives every
  replicated tensor to the first host; xladist's spreads them by size."""
  from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

  _, SavePlanner, *_ = sharded._dcp()
  state = {f"w{i}": torch.ones(64, 16 * (i + 1)) for i in range(6)}

  def plans(planner_class):
    local = []
    for host in range(2):
      planner = planner_class()
      planner.set_up_planner(state, is_coordinator=host == 0)
      local.append(planner.create_local_plan())
    return planner.create_global_plan(local)[0]

  theirs = plans(SPMDSavePlanner)
  assert [len(p.items) for p in theirs] == [6, 0]
  ours = plans(SavePlanner)
  written = [{item.index.fqn for item in p.items} for p in ours]
  assert written[0].isdisjoint(written[1]) and written[0] | written[1] == set(state)
  sizes = [sum(state[name].numel() for name in names) for names in written]
  assert min(sizes) > 0 and abs(sizes[0] - sizes[1]) <= max(t.numel() for t in state.values())


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_hosts_each_write_their_own_files_and_restore_together(tmp_path):
  """Two processes in a gloo group as two hosts (tests/_checkpoint_worker.py,
  two_hosts): each writes its share into one directory, the chief the index
  and the manifest, and both restore the same values."""
  port = _free_port()
  env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
  env.pop("XLA_USE_SPMD", None)
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
  cmd = [sys.executable, str(HERE / "_checkpoint_worker.py"), "--dir", str(tmp_path)]
  procs = [
    subprocess.Popen(
      [*cmd, "--host", str(rank), "--port", str(port)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for rank in (0, 1)
  ]
  try:
    outputs = [p.communicate(timeout=180) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, out[-2000:] + err[-3000:]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
  path = str(tmp_path / "ckpt-2")
  assert [r["path"] for r in results] == [path, path]
  assert [r["restored"] for r in results] == [path, path]
  assert [r["step"] for r in results] == [3, 3]
  assert sorted(f for f in os.listdir(tmp_path) if not f.endswith(".lock")) == ["ckpt-2"]
  files = sorted(os.listdir(path))
  manifest = torch.load(os.path.join(path, "xladist.pt"), weights_only=True)
  assert sorted(manifest["files"]) == [f for f in files if f != "xladist.pt"]
  assert ".metadata" in files
  # Every item was written once, each host writing its own files (__<rank>_<n>).
  written_by = {0: set(), 1: set()}
  for index, info in _metadata(path).storage_data.items():
    rank = int(re.fullmatch(r"__(\d)_\d+\.distcp", info.relative_path).group(1))
    written_by[rank].add(index.fqn)
  assert written_by[0] and written_by[1] and written_by[0].isdisjoint(written_by[1])
  expected = {"model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias", "step"}
  assert expected <= written_by[0] | written_by[1]


# -- refusals -------------------------------------------------------------------------


def _saved(tmp_path):
  model = torch.nn.Linear(3, 2)
  ckpt = xc.Checkpoint(model=model, step=1)
  path = ckpt.save(str(tmp_path / "c"), options=SHARDED)
  return model, ckpt, path


def _forge_metadata(path, payload):
  """Replaces .metadata and re-digests the manifest, as a forger would."""
  with open(os.path.join(path, ".metadata"), "wb") as f:
    f.write(payload)
  manifest_path = os.path.join(path, "xladist.pt")
  manifest = torch.load(manifest_path, weights_only=True)
  manifest["files"][".metadata"] = sharded._sha256(os.path.join(path, ".metadata"))
  manifest["digest"] = sharded._manifest_digest(manifest)
  torch.save(manifest, manifest_path)


class _MakeDir:
  """A pickle that calls os.mkdir when loaded."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (os.mkdir, (self.path,))


@pytest.mark.parametrize(
  "damage, reason",
  [
    ("no manifest", r"has no xladist.pt \(a save that did not finish"),
    ("manifest flipped", r"xladist.pt"),
    ("metadata flipped", r"the SHA-256 digest of .metadata does not match"),
    ("data file missing", r"__0_\d+.distcp: FileNotFoundError"),
    ("forged metadata", r"posix.mkdir may not be named in DCP metadata"),
  ],
)
def test_a_damaged_directory_is_refused_before_anything_changes(tmp_path, damage, reason):
  model, ckpt, path = _saved(tmp_path)
  marker = tmp_path / "unpickled"
  if damage == "no manifest":
    os.unlink(os.path.join(path, "xladist.pt"))
  elif damage == "data file missing":
    os.unlink(_data_file(path, "model.weight"))
  elif damage == "forged metadata":
    _forge_metadata(path, pickle.dumps(_MakeDir(str(marker))))
  else:
    name = "xladist.pt" if damage == "manifest flipped" else ".metadata"
    data = bytearray(pathlib.Path(path, name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    pathlib.Path(path, name).write_bytes(bytes(data))
  weight = model.weight.detach().clone()
  ckpt.step = 2
  with pytest.raises(
    ValueError,
    match=rf"xladist.checkpoint.restore: '.*c' is not a valid xladist checkpoint "
    rf"\(truncated or corrupt\): .*{reason}",
  ):
    ckpt.restore(path)
  torch.testing.assert_close(model.weight, weight, rtol=0, atol=0)
  assert ckpt.step == 2
  assert not marker.exists()


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(
    ValueError, match=r"xladist.checkpoint.read: '.*empty' is not a valid .* has no xladist.pt"
  ):
    xc.read(tmp_path / "empty")


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_directory(
  tmp_path, monkeypatch
):
  model, ckpt, path = _saved(tmp_path)
  saved = model.weight.detach().clone()
  with torch.no_grad():
    model.weight.add_(1.0)

  def fail(*args):
    raise OSError("disk full")

  monkeypatch.setattr(sharded, "write_atomic", fail)  # just before the rename
  with pytest.raises(OSError, match="disk full"):
    ckpt.save(path, options=SHARDED)
  monkeypatch.undo()
  assert sorted(os.listdir(tmp_path)) == ["c"]
  ckpt.restore(path)
  torch.testing.assert_close(model.weight, saved, rtol=0, atol=0)
  # Saving again over it replaces it, leaving nothing behind.
  with torch.no_grad():
    model.weight.add_(1.0)
  ckpt.save(path, options=SHARDED)
  assert sorted(os.listdir(tmp_path)) == ["c"]
  with torch.no_grad():
    model.weight.zero_()
  ckpt.restore(path)
  torch.testing.assert_close(model.weight, saved + 1.0, rtol=0, atol=0)


def test_several_hosts_without_a_process_group_are_refused(tmp_path, monkeypatch):
  hosts = ("10.0.0.2:2222", "10.0.0.3:2222")
  chief = _multihost.ClusterInfo(2, 0, True, hosts, hosts[0], ("worker", 0))
  monkeypatch.setattr(_multihost, "_process_cluster", chief)
  with pytest.raises(
    RuntimeError,
    match=re.escape("a sharded checkpoint of 2 host(s) is planned by ")
    + r".*default group has 1 process\(es\).*init_method=\"xla://\"",
  ):
    xc.Checkpoint(step=1).save(tmp_path / "c", options=SHARDED)
  assert os.listdir(tmp_path) == []


# -- all or nothing, on XLA (as tests/test_faults.py for the file format) ----------------


def _model(strategy, seed=0):
  torch.manual_seed(seed)
  with strategy.scope():
    return torch.nn.Sequential(
      torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )


def _train(strategy, model, opt):
  x = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.randn(
      4, 3, generator=torch.Generator().manual_seed(ctx.replica_id_in_sync_group)
    )
  )

  def step(t):
    opt.zero_grad()
    model(t).pow(2).mean().backward()
    opt.step()

  strategy.run(step, args=(x,))
  _runtime.sync()


def _state(model, opt):
  return {
    "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    "optimizer": [
      {k: v.detach().cpu().clone() for k, v in s.items()}
      for s in opt.state_dict()["state"].values()
    ],
  }


def test_restoring_sgd_into_adam_changes_nothing(strategy, tmp_path):
  model = _model(strategy)
  sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  _train(strategy, model, sgd)
  path = xc.Checkpoint(model=model, optimizer=sgd).save(tmp_path / "sgd", options=SHARDED)
  target = _model(strategy, seed=1)
  adam = torch.optim.Adam(target.parameters(), lr=0.01)
  _train(strategy, target, adam)
  before = _state(target, adam)
  with pytest.raises(ValueError, match=r"'optimizer' in .* was saved from a SGD and is restored"):
    xc.Checkpoint(model=target, optimizer=adam).restore(path)
  torch.testing.assert_close(_state(target, adam), before, rtol=0, atol=0)


def test_a_load_that_fails_while_applying_is_undone(strategy, tmp_path):
  model = _model(strategy)
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  _train(strategy, model, opt)

  class Fragile:
    def state_dict(self):
      return {"value": 1}

    def load_state_dict(self, state):
      raise RuntimeError("fragile object refuses")

  ckpt = xc.Checkpoint(model=model, optimizer=opt, fragile=Fragile())
  path = ckpt.save(tmp_path / "c", options=SHARDED)
  _train(strategy, model, opt)
  before = _state(model, opt)
  components = torch.stack(strategy.experimental_local_results(model[1].running_mean)).cpu()
  with pytest.raises(RuntimeError, match="fragile object refuses"):
    ckpt.restore(path)
  torch.testing.assert_close(_state(model, opt), before, rtol=0, atol=0)
  torch.testing.assert_close(
    torch.stack(strategy.experimental_local_results(model[1].running_mean)).cpu(),
    components,
    rtol=0,
    atol=0,
  )


def test_a_save_runs_one_program_for_pending_values_and_copies_without_more(strategy, tmp_path):
  model = _model(strategy)
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  _train(strategy, model, opt)
  ckpt = xc.Checkpoint(model=model, optimizer=opt)
  _runtime.wait()
  with torch.no_grad():
    model[0].weight.mul_(2.0)  # pending
  before = _runtime.execute_count()
  path = ckpt.save(tmp_path / "c", options=SHARDED)
  _runtime.wait()
  assert _runtime.execute_count() - before == 1
  saved = xc.read(path)["objects"]["model"]["value"]
  torch.testing.assert_close(saved, _state(model, opt)["model"], rtol=0, atol=0)


@pytest.mark.parametrize(
  "first, second", [("parameters", None), (None, "parameters"), ("gradients", "parameters")]
)
def test_sharded_training_state_is_written_by_each_device_and_restores_into_any_level(
  tmp_path, first, second
):
  """Issue 51: under ShardingOptions each device writes its own rows of the
  parameters and optimizer state (DCP chunks of k elements at row offsets, no
  tensor gathered whole), and the checkpoint restores into a run with another
  level or none: 10 + 10 steps equal to 20 uninterrupted ones (1e-5)."""
  want_losses, want, _, _ = _sharding.adamw_loop(None)
  losses1, _, _, (model, opt, sched, _) = _sharding.adamw_loop(first, steps=10)
  path = xc.Checkpoint(model=model, optimizer=opt, scheduler=sched).save(
    tmp_path / "c", options=SHARDED
  )
  metadata = _metadata(path).state_dict_metadata
  weight = metadata["model.body.weight"]  # 33 x 6 = 198 elements
  if first == "parameters":
    k = -(-198 // 4)
    assert tuple(weight.size) == (4, k)
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in weight.chunks) == [
      ((r, 0), (1, k)) for r in range(4)
    ]
  else:
    assert tuple(weight.size) == (33, 6) and len(weight.chunks) == 1  # mirrored: written once
  if first is not None:  # every level shards the optimizer state
    avg = [v for name, v in metadata.items() if name.endswith(".exp_avg")]
    assert avg and all(len(v.chunks) == 4 for v in avg)
  strategy = _sharding.make_strategy(second)
  with strategy.scope():
    model2 = _sharding.make_model()
    opt2 = _sharding.make_adamw(model2)
  sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=20)
  xc.Checkpoint(model=model2, optimizer=opt2, scheduler=sched2).restore(path)
  losses2 = _sharding.continue_adamw(strategy, model2, opt2, sched2, _sharding.make_data(20)[10:])
  torch.testing.assert_close(torch.cat([losses1, losses2]), want_losses, rtol=1e-5, atol=1e-6)
  _sharding.assert_equal_by_scale(_sharding.state_tensors(model2, opt2), want)
