"""xladist.checkpoint: Checkpoint, CheckpointManager, PreemptionCheckpointHandler.

The tests that are about what a checkpoint keeps and refuses run on both
formats (`fmt`: "file", one torch.save file; "sharded", a directory written by
torch.distributed.checkpoint); tests/test_checkpoint_sharded.py has the
sharded format's own.
"""

import collections
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import _checkpoint_worker as worker
import _models
import numpy as np
import optree
import pytest
import torch
import torch_xla

import xladist as xd
import xladist.checkpoint as xc
from xladist.checkpoint import file_io, sharded

HERE = pathlib.Path(__file__).parent
STEPS = 20
HALF = 10
FORMATS = ["file", "sharded"]


@pytest.fixture(params=FORMATS)
def fmt(request):
  return request.param


def _options(fmt):
  return xc.CheckpointOptions(sharded=fmt == "sharded")


def _name(stem, fmt):
  """The file name of checkpoint `stem`, or the directory name when sharded."""
  return stem if fmt == "sharded" else f"{stem}.pt"


def _env(num_devices):
  env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(num_devices))
  env.pop("XLA_USE_SPMD", None)  # set by this process's xr.use_spmd(); not inherited
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
  return env


def _worker_cmd(directory, steps, **flags):
  cmd = [
    sys.executable,
    str(HERE / "_checkpoint_worker.py"),
    "--dir",
    str(directory),
    "--steps",
    str(steps),
  ]
  for k, v in flags.items():
    cmd += [f"--{k}", str(v)]
  return cmd


def _run_worker(num_devices, directory, steps, **flags):
  proc = subprocess.run(
    _worker_cmd(directory, steps, **flags),
    env=_env(num_devices),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """20 uninterrupted steps on 4 replicas in this process; saves after step 10 too."""
  directory = tmp_path_factory.mktemp("reference")
  saved = {}

  def on_step(i, manager):
    if i == HALF:
      saved["path"] = manager.save()
      saved["sharded"] = manager.checkpoint.save(
        os.path.join(manager.directory, "half-sharded"), options=_options("sharded")
      )
      saved["state"] = {
        k: v.detach().cpu().clone() for k, v in manager.checkpoint.model.state_dict().items()
      }

  out = worker.run(xd.MirroredStrategy(), directory, STEPS, on_step=on_step)
  half = {"file": saved["path"], "sharded": saved["sharded"]}
  return dict(out, half=half, half_state=saved["state"])


def _assert_matches(got, ref, tol):
  """Equal (tol=0), or within `tol` of the values' scale (1 here)."""
  for key in ("state", "momentum", "next_x"):
    torch.testing.assert_close(got[key], ref[key], rtol=tol, atol=tol)
  torch.testing.assert_close(got["next_idx"], ref["next_idx"], rtol=0, atol=0)


@pytest.mark.parametrize(
  "num_devices, fmt",
  [(4, "file"), (2, "file"), (2, "sharded")],
  ids=["4-file", "2-file", "2-sharded"],
)
def test_resume_in_new_process_matches_uninterrupted_run(reference, tmp_path, num_devices, fmt):
  # 10 steps here (4 replicas), then 10 more in a new process with 4 or 2 replicas.
  out = tmp_path / "result.pt"
  _run_worker(num_devices, tmp_path, STEPS, restore=reference["half"][fmt], out=out)
  got = torch.load(out)
  assert got["num_replicas"] == num_devices
  # 4 replicas: the same programs, so equal; 2 replicas: the means of
  # gradients are summed in another order (measured: 4e-7 on the momentum).
  _assert_matches(got, reference, 0 if num_devices == 4 else 1e-5)


def test_sigterm_saves_exits_cleanly_and_the_restarted_run_matches(reference, tmp_path):
  stderr = tmp_path / "stderr.txt"
  with open(stderr, "w") as err:
    proc = subprocess.Popen(
      _worker_cmd(tmp_path, STEPS, sleep=0.2),
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=err,
      text=True,
    )
    try:
      lines = []
      for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "step 4":
          proc.send_signal(signal.SIGTERM)
          break
      rest = proc.stdout.read()
      rc = proc.wait(timeout=120)
    finally:
      if proc.poll() is None:
        proc.kill()
  assert rc == 0, rest + stderr.read_text()[-3000:]
  assert "done" not in rest
  with xc.CheckpointManager(xc.Checkpoint(), tmp_path) as manager:  # then the worker's
    stopped = int(pathlib.Path(manager.latest_checkpoint).stem.split("-")[1])
  printed = [int(l.split()[1]) for l in lines + rest.splitlines() if l.startswith("step ")]
  # The step that was running (or, during the sleep, the next one) finished
  # and was saved before its "step k" line.
  assert printed[-1] <= stopped <= printed[-1] + 1 < STEPS

  out = tmp_path / "result.pt"
  stdout = _run_worker(4, tmp_path, STEPS, out=out)
  assert f"at step {stopped}" in stdout
  _assert_matches(torch.load(out), reference, 0)


@pytest.mark.parametrize("trained_first", [False, True])
def test_restore_in_process_keeps_parameters_replicated_and_continues(
  reference, trained_first, fmt
):
  strategy = xd.MirroredStrategy()
  model, opt, iterator, step, ckpt = worker.build(strategy)
  with iterator:
    if trained_first:  # the optimizer's state already lives in the strategy
      for _ in range(3):
        worker.train_one(strategy, iterator, step)
    ckpt.restore(reference["half"][fmt])
    for p in model.parameters():
      assert p.device.type == "xla"
      assert "replicated" in torch_xla._XLAC._get_xla_sharding_spec(p)
    for _ in range(STEPS - HALF):
      worker.train_one(strategy, iterator, step)
    _assert_matches(worker.result(strategy, model, opt, iterator), reference, 0)


def test_both_formats_hold_the_same_content(reference):
  file, sharded = xc.read(reference["half"]["file"]), xc.read(reference["half"]["sharded"])
  assert (file["format"], sharded["format"]) == ("xladist.checkpoint", "xladist.checkpoint.sharded")
  _assert_same_tree(sharded["objects"], file["objects"])
  _assert_same_tree(sharded["rng"], file["rng"])
  # A module's state dict stays an OrderedDict with its _metadata (module versions).
  assert type(file["objects"]["model"]["value"]) is collections.OrderedDict
  assert (
    file["objects"]["model"]["value"]._metadata == sharded["objects"]["model"]["value"]._metadata
  )
  assert file["objects"]["model"]["value"]._metadata[""]["version"] == 1


def _assert_same_tree(got, expected):
  """Same containers (types, keys), tensors equal, other leaves equal and of one type."""
  got_leaves, got_spec = optree.tree_flatten(got, none_is_leaf=True)
  leaves, spec = optree.tree_flatten(expected, none_is_leaf=True)
  assert got_spec == spec
  for a, b in zip(got_leaves, leaves, strict=True):
    if isinstance(b, torch.Tensor):
      torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
      assert (type(a), a) == (type(b), b)


def test_saved_state_dict_loads_into_a_plain_torch_model(reference):
  content = torch.load(reference["half"]["file"], weights_only=True)
  state = content["objects"]["model"]["value"]
  assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())
  model = _models.make_mlp()
  model.load_state_dict(state)
  for k, v in model.state_dict().items():
    assert torch.equal(v, reference["half_state"][k])
  momentum = content["objects"]["optimizer"]["value"]["state"][0]["momentum_buffer"]
  assert momentum.device.type == "cpu"
  plain_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  plain_opt.load_state_dict(content["objects"]["optimizer"]["value"])
  assert torch.equal(plain_opt.state[model[0].weight]["momentum_buffer"], momentum)


def test_sharded_checkpoint_loads_into_a_plain_torch_model_with_dcp(reference):
  """torch.distributed.checkpoint alone reads it: "model" holds the model's state dict."""
  import torch.distributed.checkpoint as dcp

  model = _models.make_mlp()
  state = {"model": model.state_dict()}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process
    dcp.load(state, checkpoint_id=reference["half"]["sharded"])
  model.load_state_dict(state["model"])
  torch.testing.assert_close(model.state_dict(), reference["half_state"], rtol=0, atol=0)


# -- files, manager, errors (plain CPU objects: fast) ---------------------------------


def _small():
  torch.manual_seed(0)
  model = torch.nn.Linear(3, 2)
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  return model, opt


def _train_once(model, opt):
  opt.zero_grad()
  model(torch.ones(4, 3)).sum().backward()
  opt.step()


def _files(directory):
  """The directory's files but the managers' lock files (.<name>.lock)."""
  return sorted(f for f in os.listdir(directory) if not f.endswith(".lock"))


def test_manager_numbers_keeps_max_to_keep_and_leaves_no_temp_files(tmp_path, fmt):
  model, opt = _small()
  manager = xc.CheckpointManager(
    xc.Checkpoint(model=model, optimizer=opt), tmp_path, max_to_keep=2, options=_options(fmt)
  )
  assert manager.latest_checkpoint is None
  assert manager.restore_or_initialize() is None
  paths = [manager.save() for _ in range(4)]
  assert [os.path.basename(p) for p in paths] == [_name(f"ckpt-{i}", fmt) for i in (1, 2, 3, 4)]
  assert manager.checkpoints == paths[2:]
  assert manager.latest_checkpoint == paths[3]
  assert _files(tmp_path) == [_name("ckpt-3", fmt), _name("ckpt-4", fmt)]
  assert manager.save(checkpoint_number=10) == str(tmp_path / _name("ckpt-10", fmt))
  assert _files(tmp_path) == [_name("ckpt-10", fmt), _name("ckpt-4", fmt)]
  manager.close()  # one live manager per name and directory
  keep_all = xc.CheckpointManager(
    manager.checkpoint, tmp_path, max_to_keep=None, options=_options(fmt)
  )
  keep_all.save()
  assert len(keep_all.checkpoints) == 3
  # A save in the other format joins the same numbered list.
  other = "file" if fmt == "sharded" else "sharded"
  assert keep_all.save(options=_options(other)) == str(tmp_path / _name("ckpt-12", other))
  assert keep_all.latest_checkpoint == str(tmp_path / _name("ckpt-12", other))
  assert len(keep_all.checkpoints) == 4


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_latest_checkpoint_is_a_clear_error_and_the_previous_one_loads(
  tmp_path, damage, fmt
):
  model, opt = _small()
  ckpt = xc.Checkpoint(model=model, optimizer=opt, step=0)
  manager = xc.CheckpointManager(ckpt, tmp_path, options=_options(fmt))
  _train_once(model, opt)
  ckpt.step = 1
  good = manager.save()
  good_weight = model.weight.detach().clone()
  _train_once(model, opt)
  ckpt.step = 2
  bad = manager.save()
  # The file that holds the weight: the checkpoint, or a data file in its directory.
  damaged = _data_file(bad, "model.weight") if fmt == "sharded" else pathlib.Path(bad)
  data = damaged.read_bytes()
  if damage == "truncate":
    data = data[: len(data) // 2]
  elif damage == "flip":  # a byte of tensor data: only the digest notices
    pos = data.index(model.weight.detach().numpy().tobytes()) + 1
    data = data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1 :]
  else:
    data = b"not a checkpoint"
  damaged.write_bytes(data)

  weight = model.weight.detach().clone()
  momentum = opt.state[model.weight]["momentum_buffer"].clone()
  rng = torch.get_rng_state()
  torch.rand(3)  # the restore must not set the generators back either
  rng_after = torch.get_rng_state()
  assert manager.latest_checkpoint == bad
  name = re.escape(_name("ckpt-2", fmt))
  with pytest.raises(
    ValueError,
    match=rf"xladist.checkpoint.restore: '.*{name}' is "
    r"not a valid xladist checkpoint \(truncated or corrupt\)",
  ):
    manager.restore_or_initialize()
  with pytest.raises(ValueError, match=rf"xladist.checkpoint.read: '.*{name}' is not a "):
    xc.read(bad)
  torch.testing.assert_close(model.weight, weight, rtol=0, atol=0)
  torch.testing.assert_close(opt.state[model.weight]["momentum_buffer"], momentum, rtol=0, atol=0)
  assert ckpt.step == 2
  torch.testing.assert_close(torch.get_rng_state(), rng_after, rtol=0, atol=0)
  assert not torch.equal(rng, rng_after)

  assert ckpt.restore(manager.checkpoints[-2]) == good
  assert ckpt.step == 1
  torch.testing.assert_close(model.weight, good_weight, rtol=0, atol=0)


def _data_file(path, fqn):
  """The file of a sharded checkpoint that holds the tensor `fqn` (DCP's name)."""
  import torch.distributed.checkpoint as dcp

  storage = dcp.FileSystemReader(path).read_metadata().storage_data
  (name,) = {info.relative_path for index, info in storage.items() if index.fqn == fqn}
  return pathlib.Path(path, name)


def test_restore_sets_back_rng_states_tensors_and_values(tmp_path, fmt):
  counter = torch.zeros(2)
  ckpt = xc.Checkpoint(counter=counter, epoch=3, info={"name": "run", "lr": [0.1, None]})
  torch.manual_seed(1)
  np.random.seed(1)
  random.seed(1)
  path = ckpt.save(str(tmp_path / _name("c", fmt)), options=_options(fmt))
  expected = (torch.rand(2), np.random.rand(), random.random())
  counter += 5
  ckpt.epoch = 4
  ckpt.restore(path)
  torch.testing.assert_close(counter, torch.zeros(2), rtol=0, atol=0)
  assert ckpt.epoch == 3 and ckpt.info == {"name": "run", "lr": [0.1, None]}
  got = (torch.rand(2), np.random.rand(), random.random())
  torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
  assert got[1:] == expected[1:]


def test_restore_sets_back_the_xla_seed(strategy, tmp_path, fmt):
  import torch_xla.core.xla_model as xm

  xm.set_rng_state(1234)
  path = xc.Checkpoint().save(str(tmp_path / _name("c", fmt)), options=_options(fmt))
  xm.set_rng_state(99)
  xc.Checkpoint().restore(path)
  assert xm.get_rng_state() == 1234


def _dist_iterator(strategy, n=10):
  batches = [torch.full((8, 2), float(i)) for i in range(n)]
  return strategy.experimental_distribute_dataset(batches)


def _first_value(strategy, element):
  return float(strategy.gather(element, axis=0)[0, 0].cpu())


def test_iterator_position_counts_returned_elements_not_prefetched_ones(strategy, tmp_path, fmt):
  dist = _dist_iterator(strategy)
  it = iter(dist)
  for _ in range(3):
    next(it)
  time.sleep(0.2)  # let the prefetch thread run ahead
  ckpt = xc.Checkpoint(iterator=it)
  path = ckpt.save(str(tmp_path / _name("c", fmt)), options=_options(fmt))
  assert _first_value(strategy, next(it)) == 3.0

  fresh = iter(dist)
  assert fresh.element_spec is not None  # peeked, not returned: not consumed
  xc.Checkpoint(iterator=fresh).restore(path)
  assert [_first_value(strategy, x) for x in fresh] == [float(i) for i in range(3, 10)]
  ckpt.restore(path)  # an iterator that ran further goes back
  assert _first_value(strategy, next(it)) == 3.0
  it.close()
  fresh.close()


def test_iterator_of_distribute_datasets_from_function(strategy, tmp_path, fmt):
  def dataset_fn(ctx):
    return [torch.full((2, 1), float(i)) for i in range(12)]

  dist = strategy.distribute_datasets_from_function(dataset_fn)
  with iter(dist) as it:
    next(it)  # 4 per-replica batches: elements 0-3
    path = xc.Checkpoint(iterator=it).save(str(tmp_path / _name("c", fmt)), options=_options(fmt))
  with iter(dist) as fresh:
    xc.Checkpoint(iterator=fresh).restore(path)
    assert _first_value(strategy, next(fresh)) == 4.0

  # Saved with another replica count: the position would mean other data. (A
  # forged entry with a matching digest: a damaged one would be refused first.)
  if fmt == "sharded":
    c8 = tmp_path / "c8"
    shutil.copytree(path, c8)
    manifest_path = c8 / sharded.MANIFEST
    manifest = torch.load(manifest_path, weights_only=True)
    manifest["objects"]["iterator"]["value"]["num_replicas"] = 8
    manifest["digest"] = sharded._manifest_digest(manifest)
    torch.save(manifest, manifest_path)
  else:
    content = xc.read(path)
    content["objects"]["iterator"]["value"]["num_replicas"] = 8
    content["digest"] = file_io.digest({"objects": content["objects"], "rng": content["rng"]})
    c8 = tmp_path / "c8.pt"
    torch.save(content, c8)
  with (
    iter(dist) as fresh,
    pytest.raises(
      ValueError,
      match=r"distribute_datasets_from_function iterator with 8 replicas, "
      r"restored into one with 4",
    ),
  ):
    xc.Checkpoint(iterator=fresh).restore(c8)
  with (
    iter(_dist_iterator(strategy)) as other,
    pytest.raises(
      ValueError,
      match=r"position of an distribute_datasets_from_function iterator, "
      r"restored into an experimental_distribute_dataset one",
    ),
  ):
    xc.Checkpoint(iterator=other).restore(path)


def test_iterator_of_per_replica_scalars_from_shuffled_loaders(strategy, tmp_path, fmt):
  """Issue 23: per-replica elements without a batch dim (each replica gets its
  own 0-d element) resume where they were saved, in the saved shuffle order
  (TF: tensorflow/python/data/kernel_tests/checkpoint_test.py
  testSaveRestoreOneShotIterator; mirrored_strategy_test.py testReplicateDataset
  for the elements)."""

  def dataset_fn(ctx):
    g = torch.Generator().manual_seed(7 + ctx.input_pipeline_id)
    data = [100 * ctx.input_pipeline_id + i for i in range(6)]  # Python ints: int64 tensors
    return torch.utils.data.DataLoader(data, batch_size=None, shuffle=True, generator=g)

  options = xd.InputOptions(experimental_replication_mode=xd.InputReplicationMode.PER_REPLICA)
  dist = strategy.distribute_datasets_from_function(dataset_fn, options)

  def values(x):
    assert all(v.shape == () and v.dtype == torch.int64 for v in x.values)
    return [int(v) for v in strategy.experimental_local_results(x)]

  with iter(dist) as it:
    seen = [values(next(it)) for _ in range(2)]
    path = xc.Checkpoint(iterator=it).save(str(tmp_path / _name("c", fmt)), options=_options(fmt))
    rest = [values(x) for x in it]
  assert len(rest) == 4
  for r in range(4):  # each replica saw a permutation of its own pipeline
    assert sorted(step[r] for step in seen + rest) == [100 * r + i for i in range(6)]
  with iter(dist) as fresh:
    xc.Checkpoint(iterator=fresh).restore(path)
    assert [values(x) for x in fresh] == rest


def test_iter_draws_the_dataloader_seed_in_the_calling_thread(strategy):
  # A DataLoader's iter() draws from torch's global generator; done in the
  # prefetch thread it would land at a random point of the main thread's draws.
  loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.ones(8, 2)), batch_size=4
  )
  threads = []

  class Recording:
    def __iter__(self):
      threads.append(threading.current_thread())
      return iter(loader)

  dist = strategy.experimental_distribute_dataset(Recording())
  torch.manual_seed(5)
  torch.empty((), dtype=torch.int64).random_()
  expected = torch.get_rng_state()
  torch.manual_seed(5)
  with iter(dist):
    assert threads == [threading.current_thread()]
    assert torch.equal(torch.get_rng_state(), expected)


def test_checkpoint_errors(strategy, tmp_path, fmt):
  model, opt = _small()
  dist = _dist_iterator(strategy)
  with pytest.raises(TypeError, match=r"iterator= is a DistributedDataset.*iter\(dist_dataset\)"):
    xc.Checkpoint(iterator=dist)
  with pytest.raises(TypeError, match=r"thing= is a object, which a checkpoint cannot hold"):
    xc.Checkpoint(thing=object())
  with pytest.raises(TypeError, match=r"value=\[1\]\['k'\] is a set"):
    xc.Checkpoint(value=[0, {"k": {1}}])
  # Containers torch.load(weights_only=True) would not read back are refused
  # when saving, by the path of the leaf (optree walks the value).
  pair = collections.namedtuple("Pair", "a b")
  with pytest.raises(TypeError, match=r"value=\[0\] is a Pair, which a checkpoint cannot hold"):
    xc.Checkpoint(value=[pair(1, 2)])

  class Odd:
    def state_dict(self):
      return {"slots": collections.defaultdict(int)}

    def load_state_dict(self, state):
      pass

  with pytest.raises(TypeError, match=r"odd.state_dict\(\)\['slots'\] is a defaultdict"):
    xc.Checkpoint(odd=Odd()).save(tmp_path / "odd.pt")
  Odd.state_dict = lambda self: {"ids": {(1, object()): 2}}
  with pytest.raises(
    TypeError, match=r"odd.state_dict\(\)\['ids'\] key \(1, <object .* is a object"
  ):
    xc.Checkpoint(odd=Odd()).save(tmp_path / "odd.pt")
  assert not (tmp_path / "odd.pt").exists()
  with pytest.raises(ValueError, match=r"'save' is the name of a Checkpoint"):
    xc.Checkpoint(save=1)
  path = xc.Checkpoint(model=model).save(str(tmp_path / _name("c", fmt)), options=_options(fmt))
  with pytest.raises(ValueError, match=r"has no object named 'optimizer'.*\['model'\]"):
    xc.Checkpoint(model=model, optimizer=opt).restore(path)
  with pytest.raises(
    ValueError,
    match=r"'model' in .* was saved from a module but is "
    r"restored into a stateful \(SGD\)",
  ):
    xc.Checkpoint(model=opt).restore(path)
  other = torch.nn.Linear(4, 2)
  weight = other.weight.detach().clone()
  with pytest.raises(ValueError, match=r"weight has shape \(2, 3\) in the file and \(2, 4\)"):
    xc.Checkpoint(model=other).restore(path)
  torch.testing.assert_close(other.weight, weight, rtol=0, atol=0)
  with pytest.raises(FileNotFoundError, match=r"no checkpoint file at '.*missing.pt'"):
    xc.Checkpoint(model=model).restore(str(tmp_path / "missing.pt"))
  with pytest.raises(TypeError, match=r"CheckpointOptions: sharded must be True .* got 'dcp'"):
    xc.CheckpointOptions(sharded="dcp")
  with pytest.raises(TypeError, match=r"checkpoint.save: options must be an xladist.checkpoint"):
    xc.Checkpoint(model=model).save(str(tmp_path / "o.pt"), options={"format": fmt})
  with pytest.raises(TypeError, match=r"CheckpointManager: options must be an xladist"):
    xc.CheckpointManager(xc.Checkpoint(), tmp_path / "m", options=fmt)
  for call in (
    lambda: xc.Checkpoint(model=model).save("gs://bucket/c", options=_options(fmt)),
    lambda: xc.Checkpoint(model=model).restore("gs://bucket/c"),
    lambda: xc.read("gs://bucket/c"),
    lambda: xc.CheckpointManager(xc.Checkpoint(), "gs://bucket/run"),
  ):
    with pytest.raises(ValueError, match=r"'gs://bucket/.*' is a URL.*gcsfuse"):
      call()
  assert not os.path.exists("gs:")

  with strategy.scope():
    v = torch.nn.Linear(2, 2)

  def step(x):
    xc.Checkpoint(v=v).save(str(tmp_path / "in_step.pt"))
    return x

  with pytest.raises(RuntimeError, match=r"checkpoint.save was called inside strategy.run"):
    strategy.run(step, args=(torch.ones(2, device=torch_xla.device()),))

  with pytest.raises(TypeError, match=r"checkpoint must be an xladist.checkpoint.Checkpoint"):
    xc.CheckpointManager(model, tmp_path)
  with pytest.raises(ValueError, match=r"max_to_keep must be a positive int or None.*got 0"):
    xc.CheckpointManager(xc.Checkpoint(), tmp_path, max_to_keep=0)
  with pytest.raises(ValueError, match=r"checkpoint_name must be .*got 'a/b'"):
    xc.CheckpointManager(xc.Checkpoint(), tmp_path, checkpoint_name="a/b")
  with pytest.raises(ValueError, match=r"checkpoint_number must be a non-negative int.*-1"):
    xc.CheckpointManager(xc.Checkpoint(), tmp_path).save(checkpoint_number=-1)
  with pytest.raises(TypeError, match=r"checkpoint_manager must be an xladist"):
    xc.PreemptionCheckpointHandler(xc.Checkpoint())


def test_save_and_restore_work_in_the_default_strategy_scope_and_cross_replica_context(
  tmp_path, strategy
):
  # TF: tf.train.Checkpoint saves and restores in the default replica context
  # and in cross-replica context (mirrored_variable_test.py saves and restores
  # mirrored variables outside any step); only a step refuses it here.
  model, opt = _small()
  want = {k: v.detach().clone() for k, v in model.state_dict().items()}
  ckpt = xc.Checkpoint(model=model)
  manager = xc.CheckpointManager(ckpt, tmp_path / "m")
  with xd.get_strategy().scope():
    path = ckpt.save(str(tmp_path / "default"))
    ckpt.write(str(tmp_path / "default_write.pt"))
    manager.save()
    with torch.no_grad():
      model.weight.zero_()
    ckpt.restore(path)
  assert torch.equal(model.weight.detach().cpu(), want["weight"])

  with strategy.scope():
    v = xd.Variable(torch.ones(2))
  cv = xc.Checkpoint(v=v)
  with strategy.scope():
    assert xd.in_cross_replica_context()
    path = cv.save(str(tmp_path / "cross"))
    v.assign(torch.zeros(2))
    cv.restore(path)
    manager.save()
  assert torch.equal(v.read_value().cpu(), torch.ones(2))

  def step():
    def merge_fn(s):
      cv.save(str(tmp_path / "merge"))

    xd.get_replica_context().merge_call(merge_fn)

  with pytest.raises(RuntimeError, match=r"checkpoint.save was called inside strategy.run"):
    strategy.run(step)


def test_preemption_handler_saves_after_the_step_and_restores_the_signal_handler(tmp_path, fmt):
  model, opt = _small()
  ckpt = xc.Checkpoint(model=model, optimizer=opt)
  manager = xc.CheckpointManager(ckpt, tmp_path, options=_options(fmt))
  before = signal.getsignal(signal.SIGTERM)
  exits = []
  handler = xc.PreemptionCheckpointHandler(manager, exit_fn=lambda: exits.append(1))
  try:
    assert signal.getsignal(signal.SIGTERM) is not before
    handler.run(_train_once, model, opt)
    assert manager.latest_checkpoint is None and not handler.preemption_received

    def step_interrupted(model, opt):
      os.kill(os.getpid(), signal.SIGTERM)  # arrives during the step
      _train_once(model, opt)
      assert not exits  # nothing happens until the step finished

    handler.run(step_interrupted, model, opt)
    assert exits == [1]
    assert manager.latest_checkpoint == str(tmp_path / _name("ckpt-2", fmt))
    assert handler.total_run_calls == 2 and not handler.preemption_received
  finally:
    handler.close()
  assert signal.getsignal(signal.SIGTERM) is before

  # A restarted job: the count comes back with the checkpoint.
  with xc.PreemptionCheckpointHandler(manager) as restarted:
    manager.restore_or_initialize()
    assert restarted.total_run_calls == 2


def test_no_prefetch_thread_is_left_behind():  # every test above closes its iterators
  assert not [t for t in threading.enumerate() if t.name.startswith("xladist-prefetch")]
