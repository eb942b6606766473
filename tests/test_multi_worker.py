"""MultiWorkerMirroredStrategy, multi-host initialisation and host-level behaviour.

Real multi-host cannot run here (torch_xla 2.9's XLA:CPU runtime is local to
one process). What runs for real: single-worker clusters in this process. What
is simulated: a non-chief host or host h of H, built with `simulated_host`
(the strategy's own extended class for a cluster the resolver describes, over
this process's 4 devices, without starting a multi-host runtime), and the
mapping resolver -> torch_xla settings, which is made of pure functions.
"""

import json
import os
import threading

import _models
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import xladist as xd
import xladist.checkpoint as xc
from xladist import cluster_resolver as cr
from xladist.cluster_resolver import _multihost
from xladist.input import sharding
from xladist.runtime import xla as _runtime
from xladist.strategies.multi_worker import MultiWorkerExtended

API = "MultiWorkerMirroredStrategy"


@pytest.fixture(autouse=True)
def _no_tf_config(monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)


def workers(n, port=2222):
  return {"worker": [f"10.0.0.{2 + i}:{port}" for i in range(n)]}


def resolver(cluster, task_type="worker", task_id=0):
  return cr.SimpleClusterResolver(cr.ClusterSpec(cluster), task_type=task_type, task_id=task_id)


def simulated_host(cluster_resolver):
  """The strategy of `cluster_resolver`'s task, built in this process.

  The multi-host runtime is not started: this process's 4 devices stand for
  the cluster's replicas, host h of H owning replicas [h*4/H, (h+1)*4/H).
  """
  s = xd.MultiWorkerMirroredStrategy.__new__(xd.MultiWorkerMirroredStrategy)
  cluster = _multihost.cluster_info(cluster_resolver, "test")
  xd.Strategy.__init__(s, MultiWorkerExtended(s, cluster, cluster_resolver))
  return s


@pytest.fixture(scope="module")
def mwms():
  """A single-worker MultiWorkerMirroredStrategy (no TF_CONFIG) on 4 devices."""
  saved = os.environ.pop("TF_CONFIG", None)
  try:
    return xd.MultiWorkerMirroredStrategy()
  finally:
    if saved is not None:
      os.environ["TF_CONFIG"] = saved


# ---- single worker: trains like MirroredStrategy and plain PyTorch ----


def _train_from_loader(strategy, state, xs, ys):
  model, opt = _models.build_xladist(strategy, "mlp", state)
  step = _models.make_step(model, opt)
  loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=xs[0].shape[0])
  losses = []
  for x, y in strategy.experimental_distribute_dataset(loader):
    losses.append(strategy.reduce("mean", strategy.run(step, args=(x, y)), axis=None))
  return (
    torch.stack([l.cpu() for l in losses]),
    {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
  )


def test_single_worker_trains_like_mirrored_and_plain_pytorch(mwms, strategy):
  assert mwms.num_replicas_in_sync == 4
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=8)
  ref_losses, ref_state = _models.train_reference("mlp", state, xs, ys)
  losses, final = _train_from_loader(mwms, state, xs, ys)
  _models.assert_close_to_scale(losses, ref_losses, 1e-5)
  _models.assert_close_to_scale(final, ref_state, 1e-5)
  with pytest.raises(AssertionError):  # it did train: not within 1e-2 of the initial state
    _models.assert_close_to_scale(final, state, 1e-2)
  m_losses, m_final = _train_from_loader(strategy, state, xs, ys)
  torch.testing.assert_close(losses, m_losses, rtol=0, atol=0)
  for k in final:
    torch.testing.assert_close(final[k], m_final[k], rtol=0, atol=0)


def test_single_worker_from_tf_config_and_simple_resolver(monkeypatch):
  monkeypatch.setenv(
    "TF_CONFIG",
    json.dumps({"cluster": {"worker": ["localhost:2222"]}, "task": {"type": "worker", "index": 0}}),
  )
  s = xd.MultiWorkerMirroredStrategy(
    communication_options=xd.experimental.CommunicationOptions(timeout_seconds=30)
  )
  assert isinstance(s.cluster_resolver, cr.TFConfigClusterResolver)
  assert s.cluster_resolver.cluster_spec().as_dict() == {"worker": ["localhost:2222"]}
  assert s.num_replicas_in_sync == 4
  r = resolver({"chief": ["localhost:2222"]}, "chief", 0)
  s = xd.MultiWorkerMirroredStrategy(r)
  assert s.cluster_resolver is r
  out = s.run(lambda: xd.get_replica_context().all_reduce("sum", torch.ones(())))
  assert [float(v) for v in s.experimental_local_results(out)] == [4.0] * 4


# ---- resolver validation ----


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: resolver({"ps": ["p:1"]}, "ps", 0), r"has the job\(s\) \['ps'\]"),
    (lambda: resolver({"evaluator": ["e:1"]}, "evaluator", 0), 'has no "worker" or "chief" job'),
    (lambda: resolver(workers(2), None, None), "does not say which task this process is"),
    (lambda: resolver(workers(2), "worker", 2), "has no task 2 in job 'worker'"),
    (lambda: resolver(workers(2), "chief", 0), "has no task 0 in job 'chief'"),
    (lambda: resolver({"worker": {0: "a:1", 2: "c:1"}}, "worker", 0), r"worker indices \[0, 2\]"),
    (lambda: resolver({"chief": {1: "c:1"}, "worker": ["a:1"]}, "worker", 0), r"chief tasks \[1\]"),
    (
      lambda: resolver({"worker": ["a:99999", "b:1"]}, "worker", 0),
      "the address 'a:99999' is not 'host:port'",
    ),
    (
      lambda: resolver({"worker": ["a:1"], "evaluator": ["e:1"]}, "evaluator", 0),
      "this process is the evaluator task",
    ),
  ],
)
def test_malformed_clusters_are_refused_before_torch_xla_is_touched(make, match):
  with pytest.raises(ValueError, match=match):
    xd.MultiWorkerMirroredStrategy(make())
  assert _multihost.process_cluster() is None or _multihost.process_cluster().num_workers == 1


def test_wrong_argument_types():
  with pytest.raises(
    TypeError,
    match=r"MultiWorkerMirroredStrategy\(cluster_resolver=\.\.\.\): "
    r"expected an xladist\.cluster_resolver\.ClusterResolver .* got dict",
  ):
    xd.MultiWorkerMirroredStrategy({"worker": ["a:1"]})
  with pytest.raises(
    TypeError,
    match=r"MultiWorkerMirroredStrategy\(communication_options="
    r"\.\.\.\): expected an xladist\.experimental\.CommunicationOptions "
    "or None, got dict",
  ):
    xd.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 5})


def test_several_hosts_on_xla_cpu_is_a_documented_gap():
  with pytest.raises(
    NotImplementedError, match="XLA:CPU, whose PJRT client in torch_xla 2.9 is local to one process"
  ):
    xd.MultiWorkerMirroredStrategy(resolver(workers(2), "worker", 1))


def test_default_resolver_reads_tf_config_then_the_tpu_slice(monkeypatch):
  assert not _multihost.default_resolver("CPU").cluster_spec()
  for name, value in {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-16",
    "TPU_WORKER_ID": "2",
    "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3",
  }.items():
    monkeypatch.setenv(name, value)
  tpu = _multihost.default_resolver("TPU")
  assert isinstance(tpu, cr.TPUClusterResolver) and tpu.task_id == 2
  monkeypatch.setenv(
    "TF_CONFIG", json.dumps({"cluster": workers(2), "task": {"type": "worker", "index": 1}})
  )
  assert isinstance(_multihost.default_resolver("TPU"), cr.TFConfigClusterResolver)


# ---- host-level properties ----


def _flags(s):
  e = s.extended
  return (
    e.experimental_between_graph,
    e.experimental_should_init,
    e.should_checkpoint,
    e.should_save_summary,
  )


def test_single_host_strategies_have_tf_host_flags_and_no_resolver(strategy):
  for s in (strategy, xd.OneDeviceStrategy(), xd.get_strategy()):
    assert _flags(s) == (False, True, True, True)
    assert s.cluster_resolver is None


def test_chief_and_non_chief_host_flags(mwms):
  assert _flags(mwms) == (True, True, True, True)
  assert isinstance(mwms.cluster_resolver, cr.TFConfigClusterResolver)
  cases = [
    (resolver(workers(2), "worker", 0), True),
    (resolver(workers(2), "worker", 1), False),
    (resolver({"chief": ["c:1"], "worker": ["a:1"]}, "chief", 0), True),
    (resolver({"chief": ["c:1"], "worker": ["a:1"]}, "worker", 0), False),
  ]
  for r, chief in cases:
    s = simulated_host(r)
    assert _flags(s) == (True, True, chief, chief), (r.task_type, r.task_id)
    assert s.cluster_resolver is r


# ---- resolver -> torch_xla's multi-host settings (pure functions) ----


def test_two_host_tf_config_cluster_maps_to_tpu_and_coordinator_settings():
  r = cr.TFConfigClusterResolver(
    env={"TF_CONFIG": json.dumps({"cluster": workers(2), "task": {"type": "worker", "index": 1}})}
  )
  c = _multihost.cluster_info(r, API)
  assert (c.num_workers, c.task_index, c.is_chief) == (2, 1, False)
  assert c.hosts == ("10.0.0.2:2222", "10.0.0.3:2222") and c.coordinator == "10.0.0.2:2222"
  assert _multihost.runtime_env(c, "TPU", API) == {
    "TPU_WORKER_ID": "1",
    "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3",
  }
  assert _multihost.runtime_env(c, "CUDA", API, {"PJRT_DYNAMIC_PLUGINS": "1"}) == {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
    "PJRT_LOCAL_PROCESS_RANK": "0",
    "PJRT_LOCAL_PROCESS_COUNT": "1",
    "MASTER_ADDR": "10.0.0.2",
    "XLA_COORDINATOR_PORT": "2222",
  }
  with pytest.raises(NotImplementedError, match="XLA:CPU"):
    _multihost.runtime_env(c, "CPU", API)
  with pytest.raises(NotImplementedError, match="PJRT_DYNAMIC_PLUGINS=1"):
    _multihost.runtime_env(c, "CUDA", API, {})
  chief = _multihost.cluster_info(resolver(workers(2), "worker", 0), API)
  assert (chief.task_index, chief.is_chief) == (0, True)
  assert _multihost.runtime_env(chief, "TPU", API)["TPU_WORKER_ID"] == "0"


def test_four_host_cluster_with_a_chief_puts_the_chief_first():
  cluster = {"chief": ["[fd00::1]:5000"], "worker": ["w0:5000", "w1:5000", "w2"]}
  expected_hosts = ("[fd00::1]:5000", "w0:5000", "w1:5000", "w2")
  for task, index in ((("chief", 0), 0), (("worker", 0), 1), (("worker", 2), 3)):
    c = _multihost.cluster_info(resolver(cluster, *task), API)
    assert (c.num_workers, c.task_index, c.is_chief) == (4, index, task[0] == "chief")
    assert c.hosts == expected_hosts and c.coordinator == "[fd00::1]:5000"
    env = _multihost.runtime_env(c, "NEURON", API, {"PJRT_DYNAMIC_PLUGINS": "true"})
    assert (env["RANK"], env["WORLD_SIZE"]) == (str(index), "4")
    assert (env["MASTER_ADDR"], env["XLA_COORDINATOR_PORT"]) == ("[fd00::1]", "5000")
    assert _multihost.runtime_env(c, "TPU", API) == {
      "TPU_WORKER_ID": str(index),
      "TPU_WORKER_HOSTNAMES": "[fd00::1],w0,w1,w2",
    }
  # A coordinator given without a port gets torch_xla's default one.
  c = _multihost.cluster_info(resolver({"worker": ["a", "b"]}, "worker", 1), API)
  assert (
    _multihost.runtime_env(c, "X", API, {"PJRT_DYNAMIC_PLUGINS": "1"})["XLA_COORDINATOR_PORT"]
    == "8547"
  )


def test_four_host_tpu_slice_maps_onto_its_own_worker_ids():
  r = cr.TPUClusterResolver(
    env={
      "TPU_ACCELERATOR_TYPE": "v5litepod-16",
      "TPU_WORKER_ID": "2",
      "TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3",
    },
    metadata=lambda k: None,
  )
  c = _multihost.cluster_info(r, API)
  assert (c.num_workers, c.task_index, c.is_chief) == (4, 2, False)
  assert c.coordinator == "t0:8470"
  assert _multihost.runtime_env(c, "TPU", API) == {
    "TPU_WORKER_ID": "2",
    "TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3",
  }
  one = cr.TPUClusterResolver(env={"TPU_ACCELERATOR_TYPE": "v4-8"}, metadata=lambda k: None)
  single = _multihost.cluster_info(one, API)
  assert (single.num_workers, single.is_chief) == (1, True)
  assert _multihost.runtime_env(single, "TPU", API) == {}
  assert _multihost.cluster_info(resolver({}, None, None), API).num_workers == 1


def test_apply_env_sets_missing_values_and_refuses_contradictions():
  environ = {"WORLD_SIZE": "2", "OTHER": "x"}
  values = {"RANK": "1", "WORLD_SIZE": "2"}
  assert _multihost.apply_env(values, environ, API) == ["RANK"]
  assert environ == {"RANK": "1", "WORLD_SIZE": "2", "OTHER": "x"}
  assert _multihost.apply_env(values, environ, API) == []
  environ = {"TPU_WORKER_ID": "0"}
  with pytest.raises(
    ValueError,
    match="the environment sets TPU_WORKER_ID='0', but the "
    "cluster resolver makes this process TPU_WORKER_ID='3'",
  ):
    _multihost.apply_env({"TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "3"}, environ, API)
  assert environ == {"TPU_WORKER_ID": "0"}  # nothing was set


def test_check_runtime_compares_torch_xla_with_the_resolver():
  two = _multihost.cluster_info(resolver(workers(2), "worker", 1), API)
  _multihost.check_runtime(two, 2, 1, API)
  with pytest.raises(
    RuntimeError,
    match=r"describes 2 host\(s\).*has 1 process\(es\)\. "
    "torch_xla started a runtime of this process alone",
  ):
    _multihost.check_runtime(two, 1, 0, API)
  with pytest.raises(RuntimeError, match="numbers this process 0"):
    _multihost.check_runtime(two, 2, 0, API)
  one = _multihost.cluster_info(resolver({}, None, None), API)
  with pytest.raises(RuntimeError, match="has 4 process.*TPUClusterResolver"):
    _multihost.check_runtime(one, 4, 2, API)


def test_the_wait_for_other_hosts_has_a_timeout_that_names_them():
  c = _multihost.cluster_info(resolver(workers(2), "worker", 1), API)
  message = _multihost._join_message(c, API, 0.2, {"TPU_WORKER_ID": "1"})
  for part in (
    "0.2 s",
    "host 1 of 2",
    "10.0.0.2:2222",
    "10.0.0.3:2222",
    "coordinator (chief) 10.0.0.2:2222",
    "TPU_WORKER_ID=1",
    "timeout_seconds",
  ):
    assert part in message
  release = threading.Event()
  with pytest.raises(TimeoutError, match="host 1 of 2"):
    _runtime.call_with_timeout(release.wait, 0.2, message)
  release.set()
  assert _runtime.call_with_timeout(lambda: 7, 5, message) == 7
  with pytest.raises(KeyError):
    _runtime.call_with_timeout(lambda: {}["x"], 5, message)


def test_local_devices_must_be_the_hosts_replicas():
  replicas = range(4, 8)
  assert _multihost.local_shard_rows(["TPU:4", "TPU:5", "TPU:6", "TPU:7"], replicas) == [0, 1, 2, 3]
  assert _multihost.local_shard_rows(["TPU:6", "TPU:4", "TPU:7", "TPU:5"], replicas) == [2, 0, 3, 1]
  with pytest.raises(
    RuntimeError,
    match=r"feeds replicas \[4, 5, 6, 7\].*devices are "
    r"\[0, 1, 2, 3\]",
  ):
    _multihost.local_shard_rows(["TPU:0", "TPU:1", "TPU:2", "TPU:3"], replicas)
  c = _multihost.cluster_info(resolver(workers(3), "worker", 0), API)
  with pytest.raises(ValueError, match="4 replicas cannot be spread evenly over 3 hosts"):
    _multihost.host_replicas(c, 4, API)


def test_global_tensor_from_this_hosts_shards(mwms):
  """The torch_xla call of multi-host input, run here with every replica local."""
  rows = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4, 2, 3)
  (g,) = _multihost.from_local_shards([rows], [0, 1, 2, 3], 4)
  (today,) = _multihost.place_host_rows([rows], range(4), 4)  # one host: place_split of a list
  import torch_xla

  for t in (g, today):
    assert tuple(t.shape) == (4, 2, 3)
    assert torch_xla._XLAC._get_xla_sharding_spec(t) == "{devices=[4,1,1]0,1,2,3}"
  out = mwms.run(lambda x: x.sum(), args=(xd.PerReplica._from_stacked(g, 4),))
  assert [float(v) for v in mwms.experimental_local_results(out)] == rows.sum((1, 2)).tolist()
  torch.testing.assert_close(g.cpu(), rows, rtol=0, atol=0)


# ---- chief-only checkpoints ----


def _checkpoint(strategy):
  with strategy.scope():
    model = torch.nn.Linear(3, 2)
  return model, xc.Checkpoint(model=model, step=5)


def test_the_chief_writes_checkpoints(mwms, tmp_path):
  model, ckpt = _checkpoint(mwms)
  path = tmp_path / "a.pt"
  assert ckpt.save(path) == path and path.exists()
  with mwms.scope():
    assert ckpt.write(tmp_path / "b.pt") == tmp_path / "b.pt"
  assert (tmp_path / "b.pt").exists()
  manager = xc.CheckpointManager(ckpt, tmp_path / "m", max_to_keep=1)
  with mwms.scope():
    manager.save()
    manager.save()
  assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-2.pt"]
  saved = xc.read(path)["objects"]["model"]["value"]
  torch.testing.assert_close(saved["weight"], model.weight.detach().cpu())


def test_non_chief_hosts_read_back_alike_and_write_nothing(tmp_path):
  chief = simulated_host(resolver(workers(2), "worker", 0))
  other = simulated_host(resolver(workers(2), "worker", 1))
  model, ckpt = _checkpoint(other)
  with chief.scope():
    chief_manager = xc.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    chief_manager.save()
    chief_manager.save()
  # The non-chief builds the content like every host: its pending computation
  # is executed and read back; then it writes and deletes no file.
  with other.scope():
    model.weight.data.mul_(2.0)
    _runtime.wait()
    executions = _runtime.execute_count()
    assert ckpt.save(tmp_path / "x.pt") == tmp_path / "x.pt"
    _runtime.wait()
    assert _runtime.execute_count() > executions
    other_manager = xc.CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    assert other_manager.save() == str(tmp_path / "ckpt-3.pt")
  assert sorted(f for f in os.listdir(tmp_path) if not f.endswith(".lock")) == [
    "ckpt-1.pt",
    "ckpt-2.pt",
  ]
  # A value a checkpoint cannot hold fails on the non-chief as on the chief.
  ckpt.bad = _BadState()
  for s in (chief, other):
    with s.scope(), pytest.raises(TypeError, match="which a checkpoint cannot hold"):
      ckpt.save(tmp_path / "y.pt")
  assert not (tmp_path / "y.pt").exists()


class _BadState:
  def state_dict(self):
    return {"x": object()}

  def load_state_dict(self, state):
    pass


def test_outside_any_scope_the_process_role_decides(tmp_path, monkeypatch):
  ckpt = xc.Checkpoint(model=torch.nn.Linear(3, 2))
  assert xc.should_write()
  ckpt.save(tmp_path / "chief.pt")
  non_chief = _multihost.cluster_info(resolver(workers(2), "worker", 1), API)
  monkeypatch.setattr(_multihost, "_process_cluster", non_chief)
  assert not xc.should_write()
  assert ckpt.save(tmp_path / "other.pt") == tmp_path / "other.pt"
  assert sorted(os.listdir(tmp_path)) == ["chief.pt"]


# ---- per-host input ----


def _ids_loader(num_examples, batch):
  ids = torch.arange(num_examples)
  return DataLoader(TensorDataset(ids, ids.float() * 10), batch_size=batch)


@pytest.fixture(scope="module")
def two_hosts():
  return [simulated_host(resolver(workers(2), "worker", h)) for h in range(2)]


def test_simulated_two_hosts_feed_every_example_to_exactly_one_replica(two_hosts):
  batch, num_examples = 8, 28  # 3 full global batches and a partial one of 4
  options = xd.InputOptions(experimental_fetch_to_device=False, experimental_partial_batch="mask")
  seen = {}  # example id -> (step, global replica)
  for h, s in enumerate(two_hosts):
    replicas = list(s.extended._host_replicas)
    assert replicas == [2 * h, 2 * h + 1]
    steps = list(s.experimental_distribute_dataset(_ids_loader(num_examples, batch), options))
    assert len(steps) == 4
    for step, ((ids, tens), mask) in enumerate(steps):
      assert isinstance(ids, xd.PerReplica) and len(ids.values) == 2  # local replicas only
      for k, replica in enumerate(replicas):
        real = mask.values[k].bool()
        np.testing.assert_array_equal(
          tens.values[k][real].numpy(), ids.values[k][real].numpy() * 10.0
        )
        for example in ids.values[k][real].tolist():
          assert example not in seen, f"example {example} fed twice"
          seen[example] = (step, replica)
  assert sorted(seen) == list(range(num_examples))
  # As on one host: replica r of step s gets rows [2r, 2r + 2) of global batch s.
  for example, (step, replica) in seen.items():
    assert (example - step * batch) // 2 == replica


def test_simulated_hosts_input_contexts(two_hosts, mwms):
  for h, s in enumerate(two_hosts):
    contexts = []

    def dataset_fn(ctx):
      contexts.append(ctx)
      start = ctx.input_pipeline_id * 100
      return [torch.arange(start + 2 * i, start + 2 * i + 2) for i in range(4)]

    options = xd.InputOptions(experimental_fetch_to_device=False)
    elements = list(s.distribute_datasets_from_function(dataset_fn, options))
    (ctx,) = contexts
    assert (ctx.input_pipeline_id, ctx.num_input_pipelines, ctx.num_replicas_in_sync) == (h, 2, 4)
    assert ctx.get_per_replica_batch_size(8) == 2
    # PER_WORKER: each step takes this pipeline's next 2 per-replica batches.
    assert len(elements) == 2
    assert [v.tolist() for v in elements[0].values] == [
      [h * 100, h * 100 + 1],
      [h * 100 + 2, h * 100 + 3],
    ]
    contexts.clear()
    per_replica = xd.InputOptions(
      experimental_fetch_to_device=False,
      experimental_replication_mode=xd.InputReplicationMode.PER_REPLICA,
    )
    elements = list(s.distribute_datasets_from_function(dataset_fn, per_replica))
    assert [(c.input_pipeline_id, c.num_input_pipelines) for c in contexts] == [
      (2 * h, 4),
      (2 * h + 1, 4),
    ]
    assert [v.tolist() for v in elements[0].values] == [
      [200 * h, 200 * h + 1],
      [200 * h + 100, 200 * h + 101],
    ]
  # One host: the contexts of a single-host strategy.
  seen = []
  mwms.distribute_datasets_from_function(lambda ctx: seen.append(ctx) or [torch.zeros(1)])
  assert [(c.input_pipeline_id, c.num_input_pipelines, c.num_replicas_in_sync) for c in seen] == [
    (0, 1, 4)
  ]
  assert [
    (c.input_pipeline_id, c.num_input_pipelines)
    for c in sharding.input_contexts(1, 0, 4, per_replica=True)
  ] == [(r, 4) for r in range(4)]


def test_single_worker_input_is_the_single_host_path(mwms):
  x = torch.arange(16.0).reshape(8, 2)
  (element,) = list(mwms.experimental_distribute_dataset([x]))
  assert isinstance(element, xd.PerReplica) and element._stacked is not None
  got = torch.stack([v.cpu() for v in mwms.experimental_local_results(element)])
  torch.testing.assert_close(got, x.reshape(4, 2, 2), rtol=0, atol=0)


def test_each_host_builds_and_reads_only_its_own_replicas_values(monkeypatch):
  """TF's meanings of experimental_distribute_values_from_function and
  experimental_local_results on several hosts (host 1 of 2, simulated)."""
  from xladist.runtime import xla as _runtime

  s = simulated_host(resolver({"worker": ["a:1", "b:1"]}, task_id=1))
  placed = []

  def place_host_rows(tensors, replica_ids, num_replicas):
    # Stands in for torch_xla's assembly from the hosts' shards: the other
    # host's rows (replicas 0 and 1) would come from that host.
    placed.append(list(replica_ids))
    full = torch.full((num_replicas,) + tuple(tensors[0].shape[1:]), -1.0)
    full[list(replica_ids)] = tensors[0]
    return _runtime.place_split([full])

  monkeypatch.setattr(_multihost, "place_host_rows", place_host_rows)
  calls = []
  v = s.experimental_distribute_values_from_function(
    lambda ctx: (
      calls.append(ctx.replica_id_in_sync_group)
      or torch.full((3,), float(ctx.replica_id_in_sync_group))
    )
  )
  assert calls == [2, 3] and placed == [[2, 3]]
  out = s.run(lambda x: x * 10 + 1, args=(v,))
  assert [t.tolist() for t in s.experimental_local_results(out)] == [[21.0] * 3, [31.0] * 3]
  assert s.experimental_local_results(5) == (5,)
  with pytest.raises(TypeError, match="on several hosts value_fn must return tensors"):
    s.experimental_distribute_values_from_function(lambda ctx: 1.5)


def test_local_components_with_two_devices_per_replica():
  from xladist.cluster_resolver import _multihost

  da = xd.experimental.DeviceAssignment.build(computation_shape=[2], num_replicas=2)
  t = xd.TPUStrategy(experimental_device_assignment=da)
  v = t.experimental_distribute_values_from_function(
    lambda ctx: torch.full((2,), float(ctx.replica_id_in_sync_group))
  )
  out = t.run(lambda x: x - 7, args=(v,))
  assert [c.tolist() for c in _multihost.local_components(out._stacked, [1, 0], 2)] == [
    [-6.0, -6.0],
    [-7.0, -7.0],
  ]
  with pytest.raises(RuntimeError, match=r"replicas \[2\] have no device on this host"):
    _multihost.local_components(out._stacked, [2], 2)


def test_host_waits_are_bounded_on_several_hosts(monkeypatch, tmp_path):
  """A stalled host must not leave the others waiting forever: xladist's own
  host reads (checkpoint saves, reductions to the host, local results) wait at
  most the strategy's timeout on a cluster, and without a bound on one host."""
  import time

  from xladist.runtime import xla as _runtime

  t = torch.arange(4.0).to(_runtime.device()) * 3  # pending: its program has not run
  assert _multihost.host_timeout() is None  # one host
  monkeypatch.setattr(
    _multihost,
    "_process_cluster",
    _multihost.ClusterInfo(
      2, 0, True, ("10.0.0.2:8476", "10.0.0.3:8476"), "10.0.0.2:8476", ("worker", 0)
    ),
  )
  monkeypatch.setattr(_multihost, "_host_timeout", 0.2)
  monkeypatch.setattr(_runtime, "_wait_device_ops", lambda: time.sleep(3))  # a stalled peer
  assert _multihost.host_timeout() == 0.2
  start = time.monotonic()
  with pytest.raises(TimeoutError) as e:
    xd.checkpoint.Checkpoint(t=t).save(str(tmp_path / "ckpt"))
  assert time.monotonic() - start < 2.5
  message = str(e.value)
  assert "xladist.checkpoint.save" in message and "within 0.2 s" in message
  assert "['10.0.0.2:8476', '10.0.0.3:8476']" in message
  assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("signalled", ["other host", "this host"])
def test_preemption_on_one_host_makes_every_host_save_at_the_same_step(
  monkeypatch, tmp_path, signalled
):
  """Host 1 of 2 (simulated): the hosts agree every 3 steps; a SIGTERM that
  reached either host makes this host save (as a non-chief: write nothing) and
  exit at the agreement step, not before."""
  import signal

  from xladist.runtime import xla as _runtime

  s = simulated_host(resolver({"worker": ["a:1", "b:1"]}, task_id=1))
  monkeypatch.setattr(_multihost, "_process_cluster", s.extended._cluster)
  other_flag = 1 if signalled == "other host" else 0

  def place_host_rows(tensors, replica_ids, num_replicas):
    # The other host's rows (replicas 0, 1) carry that host's flag.
    full = torch.full(
      (num_replicas,) + tuple(tensors[0].shape[1:]), other_flag, dtype=tensors[0].dtype
    )
    full[list(replica_ids)] = tensors[0]
    return _runtime.place_split([full])

  monkeypatch.setattr(_multihost, "place_host_rows", place_host_rows)
  with s.scope():
    weight = torch.zeros(3).to(_runtime.device())
  manager = xc.CheckpointManager(xc.Checkpoint(w=weight), str(tmp_path / "ckpts"))
  exits = []
  handler = xc.PreemptionCheckpointHandler(
    manager,
    exit_fn=lambda: exits.append(handler.total_run_calls),
    strategy=s,
    check_interval_steps=3,
  )
  try:
    if signalled == "this host":
      os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(5):
      handler.run(lambda: None)
  finally:
    handler.close()
  assert exits == [3]
  assert not handler.preemption_received
  assert not (tmp_path / "ckpts").exists() or not os.listdir(tmp_path / "ckpts")


def test_preemption_handler_arguments(tmp_path):
  manager = xc.CheckpointManager(xc.Checkpoint(), str(tmp_path))
  with pytest.raises(TypeError, match="check_interval_steps must be a positive int"):
    xc.PreemptionCheckpointHandler(manager, check_interval_steps=0)
