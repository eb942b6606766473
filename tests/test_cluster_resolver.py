"""Cluster resolvers (TF_CONFIG, Cloud TPU VM environments) and multi-host input sharding."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from xladist import cluster_resolver as cr
from xladist.input import sharding
from xladist.input.options import InputContext


def _no_metadata(key):
  raise AssertionError(f"metadata {key!r} read although the environment had it")


def _metadata(values):
  return lambda key: values.get(key)


# ---- ClusterSpec ----


def test_cluster_spec_dense_and_sparse():
  spec = cr.ClusterSpec({"worker": ["w0:1", "w1:1"], "ps": {3: "p3:2"}})
  assert spec.jobs == ["ps", "worker"]
  assert spec.num_tasks("worker") == 2 and spec.num_tasks("ps") == 1
  assert spec.task_address("worker", 1) == "w1:1"
  assert spec.task_address("ps", 3) == "p3:2"
  assert spec.task_indices("ps") == [3]
  assert spec.job_tasks("ps") == [None, None, None, "p3:2"]
  assert spec.as_dict() == {"ps": {3: "p3:2"}, "worker": ["w0:1", "w1:1"]}
  assert cr.ClusterSpec(spec) == spec and bool(spec) and not cr.ClusterSpec()


def test_cluster_spec_errors():
  spec = cr.ClusterSpec({"worker": ["w0:1"]})
  with pytest.raises(ValueError, match="no job 'chief'.*jobs are \\['worker'\\]"):
    spec.num_tasks("chief")
  with pytest.raises(ValueError, match="job 'worker' has no task 5"):
    spec.task_address("worker", 5)
  with pytest.raises(TypeError, match="must be a dict"):
    cr.ClusterSpec(["w0:1"])
  with pytest.raises(TypeError, match="tasks of job 'worker' must be a list"):
    cr.ClusterSpec({"worker": "w0:1"})
  with pytest.raises(TypeError, match="task 0 of job 'worker' has the address 8470"):
    cr.ClusterSpec({"worker": [8470]})


# ---- SimpleClusterResolver ----


def test_simple_cluster_resolver():
  r = cr.SimpleClusterResolver(
    cr.ClusterSpec({"worker": ["a:1", "b:1"]}),
    task_type="worker",
    task_id=1,
    rpc_layer="grpc",
    num_accelerators={"TPU": 4},
    environment="cloud",
  )
  assert r.cluster_spec().as_dict() == {"worker": ["a:1", "b:1"]}
  assert r.master() == ""
  assert r.master("worker", 0) == "grpc://a:1"
  assert r.master("worker", 0, rpc_layer="") == "a:1"
  assert r.num_accelerators() == {"TPU": 4}
  assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("worker", 1, "grpc", "cloud")
  assert not cr.is_chief(r)
  r.task_id = 0
  assert cr.is_chief(r)
  assert cr.SimpleClusterResolver({}, master="m:1").master() == "m:1"


def test_simple_cluster_resolver_errors():
  with pytest.raises(TypeError, match="num_accelerators must be None or a dict"):
    cr.SimpleClusterResolver({}, num_accelerators=4)
  with pytest.raises(TypeError, match="task_id must be an int or None, got str '1'"):
    cr.SimpleClusterResolver({}, task_id="1")
  with pytest.raises(ValueError, match="task_id must be >= 0, got -1"):
    cr.SimpleClusterResolver({}, task_id=-1)


def test_base_num_accelerators_counts_local_xla_devices():
  r = cr.SimpleClusterResolver({})
  assert r.num_accelerators() == {"XLA": 4}  # PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4


def test_is_chief_with_chief_job():
  spec = {"chief": ["c:1"], "worker": ["w0:1"]}
  assert cr.is_chief(cr.SimpleClusterResolver(spec, task_type="chief", task_id=0))
  assert not cr.is_chief(cr.SimpleClusterResolver(spec, task_type="worker", task_id=0))
  assert cr.is_chief(cr.SimpleClusterResolver({}))
  with pytest.raises(TypeError, match="is_chief: expected a ClusterResolver, got dict"):
    cr.is_chief({})


# ---- TFConfigClusterResolver ----


def _tf_config(**config):
  return {"TF_CONFIG": json.dumps(config)}


def test_tf_config():
  env = _tf_config(
    cluster={"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]},
    task={"type": "worker", "index": 1},
    rpc_layer="grpc",
    environment="cloud",
  )
  r = cr.TFConfigClusterResolver(env=env)
  assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("worker", 1, "grpc", "cloud")
  assert r.cluster_spec().num_tasks("worker") == 2
  assert r.master() == "grpc://w1:2222"
  assert r.master("chief", 0) == "grpc://c:2222"
  assert not cr.is_chief(r)
  assert cr.is_chief(cr.TFConfigClusterResolver(task_type="chief", task_id=0, env=env))


def test_tf_config_task_from_arguments():
  env = _tf_config(cluster={"worker": ["w0:1", "w1:1"]})
  r = cr.TFConfigClusterResolver(task_type="worker", task_id=0, env=env)
  assert r.master() == "w0:1" and cr.is_chief(r)


def test_tf_config_unset_is_a_lone_process():
  r = cr.TFConfigClusterResolver(env={})
  assert not r.cluster_spec() and r.master() == "" and r.task_type is None
  assert cr.is_chief(r)


@pytest.mark.parametrize(
  "raw, match",
  [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ("[1, 2]", "TF_CONFIG must be a JSON object"),
    (
      json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}),
      'TF_CONFIG: "task" has no "type" key',
    ),
    (
      json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}),
      'TF_CONFIG: "task" has no "index" key',
    ),
    (
      json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}),
      'TF_CONFIG: "task": "index" must be an int, got \'0\'',
    ),
    (
      json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}),
      "TF_CONFIG: task type 'ps' is not a job of the cluster",
    ),
    (
      json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}),
      "TF_CONFIG: task index 1 is out of range for job 'worker' with 1 tasks",
    ),
    (
      json.dumps({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}),
      'TF_CONFIG: "cluster" is malformed',
    ),
    (
      json.dumps({"cluster": {"worker": ["a:1"]}, "task": "worker"}),
      'TF_CONFIG: "task" must be an object',
    ),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), 'TF_CONFIG has a "cluster" but no "task"'),
    (
      json.dumps({"task": {"type": "worker", "index": 0}}),
      'TF_CONFIG has a "task" .* but no "cluster"',
    ),
    (
      json.dumps(
        {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "rpc_layer": 5}
      ),
      'TF_CONFIG: "rpc_layer" must be a string, got 5',
    ),
  ],
)
def test_tf_config_malformed(raw, match):
  with pytest.raises(ValueError, match=match):
    cr.TFConfigClusterResolver(env={"TF_CONFIG": raw})


# ---- TPUClusterResolver ----

V5E_HOSTS = "10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5"


def test_tpu_v4_8_single_host():
  env = {
    "TPU_ACCELERATOR_TYPE": "v4-8",
    "TPU_WORKER_ID": "0",
    "TPU_WORKER_HOSTNAMES": "t1v-n-1234abcd-w-0",
    "TPU_SKIP_MDS_QUERY": "1",
  }
  r = cr.TPUClusterResolver(env=env)
  assert r.topology.num_hosts == 1 and r.topology.chips_per_host == 4
  assert r.num_accelerators() == {"TPU": 4}
  assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("worker", 0, "grpc", "")
  assert r.cluster_spec().as_dict() == {"worker": ["t1v-n-1234abcd-w-0:8470"]}
  assert r.master() == ""
  assert r.master("worker", 0) == "grpc://t1v-n-1234abcd-w-0:8470"
  assert cr.is_chief(r)


def test_tpu_v4_8_from_metadata_only():
  meta = {
    "accelerator-type": "v4-8",
    "agent-worker-number": "0",
    "worker-network-endpoints": "t1v-n-1234abcd-w-0:uid0:10.128.0.7",
  }
  r = cr.TPUClusterResolver(tpu="my-tpu", zone="us-central2-b", env={}, metadata=_metadata(meta))
  assert r.worker_hostnames == ["10.128.0.7"] and r.task_id == 0
  assert (r.tpu_name, r.zone) == ("my-tpu", "us-central2-b")
  assert r.num_accelerators() == {"TPU": 4}


def test_tpu_single_host_without_hostnames_is_localhost():
  r = cr.TPUClusterResolver(env={"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, metadata=_metadata({}))
  assert r.worker_hostnames == ["localhost"] and r.task_id == 0
  assert r.num_accelerators() == {"TPU": 8}


@pytest.mark.parametrize("accelerator", ["v5litepod-16", "v5e-16"])
def test_tpu_v5e_16_multi_host(accelerator):
  env = {
    "TPU_ACCELERATOR_TYPE": accelerator,
    "TPU_WORKER_ID": "2",
    "TPU_WORKER_HOSTNAMES": V5E_HOSTS,
  }
  r = cr.TPUClusterResolver(env=env, metadata=_no_metadata)
  assert (r.topology.num_hosts, r.topology.chips_per_host) == (4, 4)
  assert r.task_type == "worker" and r.task_id == 2
  assert r.num_accelerators() == {"TPU": 4}
  assert r.master() == "grpc://10.130.0.2:8470"
  assert r.cluster_spec().as_dict() == {"worker": [f"{h}:8470" for h in V5E_HOSTS.split(",")]}
  assert not cr.is_chief(r)


def test_tpu_v5e_16_from_metadata_endpoints():
  endpoints = ",".join(f"t1v-n-9-w-{i}:uid{i}:{ip}" for i, ip in enumerate(V5E_HOSTS.split(",")))
  meta = {
    "accelerator-type": "v5litepod-16",
    "agent-worker-number": "0",
    "worker-network-endpoints": endpoints,
  }
  r = cr.TPUClusterResolver(env={}, metadata=_metadata(meta))
  assert r.worker_hostnames == V5E_HOSTS.split(",") and cr.is_chief(r)


def test_tpu_bounds_override_and_cloud_task_id():
  env = {
    "TPU_ACCELERATOR_TYPE": "v4-16",
    "CLOUD_TPU_TASK_ID": "1",
    "TPU_WORKER_HOSTNAMES": "h0,h1",
    "TPU_HOST_BOUNDS": "1,1,2",
    "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
  }
  r = cr.TPUClusterResolver(env=env, metadata=_no_metadata)
  assert (r.topology.num_hosts, r.topology.chips_per_host, r.task_id) == (2, 4, 1)


@pytest.mark.parametrize(
  "accelerator, hosts, chips, per_chip",
  [
    ("v2-8", 1, 4, 2),
    ("v3-32", 4, 4, 2),
    ("v4-8", 1, 4, 1),
    ("v4-32", 4, 4, 1),
    ("v5p-8", 1, 4, 1),
    ("v5p-128", 16, 4, 1),
    ("v5litepod-1", 1, 1, 1),
    ("v5litepod-4", 1, 4, 1),
    ("v5litepod-8", 1, 8, 1),
    ("v5litepod-256", 64, 4, 1),
    ("v6e-8", 1, 8, 1),
    ("v6e-16", 4, 4, 1),
  ],
)
def test_accelerator_types(accelerator, hosts, chips, per_chip):
  t = cr._tpu_env.parse_accelerator_type(accelerator)
  assert (t.num_hosts, t.chips_per_host, t.devices_per_chip) == (hosts, chips, per_chip)


@pytest.mark.parametrize(
  "env, match",
  [
    (
      {"TPU_ACCELERATOR_TYPE": "v9-8"},
      "TPU_ACCELERATOR_TYPE='v9-8' is not a known accelerator type",
    ),
    (
      {"TPU_ACCELERATOR_TYPE": "v4-12"},
      "TPU_ACCELERATOR_TYPE='v4-12': the number of a v4 type counts TensorCores",
    ),
    (
      {"TPU_ACCELERATOR_TYPE": "v6e-18", "TPU_WORKER_ID": "0"},
      "TPU_ACCELERATOR_TYPE='v6e-18': the number of a v6e type counts chips",
    ),
    (
      {
        "TPU_ACCELERATOR_TYPE": "v5litepod-16",
        "TPU_WORKER_ID": "4",
        "TPU_WORKER_HOSTNAMES": V5E_HOSTS,
      },
      r"TPU_WORKER_ID='4' is outside the 4 workers .*expected 0 \.\. 3",
    ),
    (
      {
        "TPU_ACCELERATOR_TYPE": "v5litepod-16",
        "TPU_WORKER_ID": "two",
        "TPU_WORKER_HOSTNAMES": V5E_HOSTS,
      },
      "TPU_WORKER_ID='two' is not a worker index",
    ),
    (
      {"TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "a,b"},
      "TPU_WORKER_HOSTNAMES='a,b' lists 2 workers, but the slice 'v5litepod-16' has 4 hosts",
    ),
    (
      {"TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_WORKER_ID": "0"},
      "has 4 hosts, but TPU_WORKER_HOSTNAMES is unset",
    ),
    (
      {"TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_WORKER_HOSTNAMES": V5E_HOSTS},
      "TPU_WORKER_ID is unset",
    ),
    (
      {"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_CHIPS_PER_HOST_BOUNDS": "2,x,1"},
      "TPU_CHIPS_PER_HOST_BOUNDS='2,x,1' is not a bounds string",
    ),
    (
      {"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_WORKER_HOSTNAMES": "a,"},
      "TPU_WORKER_HOSTNAMES='a,' has an empty entry",
    ),
    ({}, "no accelerator type: TPU_ACCELERATOR_TYPE is unset"),
  ],
)
def test_tpu_malformed_environment(env, match):
  with pytest.raises(ValueError, match=match):
    cr.TPUClusterResolver(env=env, metadata=_metadata({}))


def test_tpu_malformed_metadata_endpoints():
  meta = {
    "accelerator-type": "v4-16",
    "agent-worker-number": "0",
    "worker-network-endpoints": "w0:uid0:10.0.0.1,w1",
  }
  with pytest.raises(ValueError, match="'worker-network-endpoints'=.* has the entry 'w1'"):
    cr.TPUClusterResolver(env={}, metadata=_metadata(meta))


def test_tpu_remote_address_and_bad_tpu():
  with pytest.raises(NotImplementedError, match="grpc://10.0.0.2:8470.*remote TPU node"):
    cr.TPUClusterResolver(tpu="grpc://10.0.0.2:8470", env={"TPU_ACCELERATOR_TYPE": "v4-8"})
  with pytest.raises(TypeError, match="tpu must be a string or None, got int 3"):
    cr.TPUClusterResolver(tpu=3, env={"TPU_ACCELERATOR_TYPE": "v4-8"})


def test_tpu_skip_mds_query_never_reads_metadata(monkeypatch):
  monkeypatch.setattr(cr._tpu_env, "gce_metadata", _no_metadata)
  r = cr.TPUClusterResolver(env={"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_SKIP_MDS_QUERY": "1"})
  assert r.task_id == 0


# ---- multi-host input sharding ----


def _global_batches(num_batches, batch):
  ids = torch.arange(num_batches * batch)
  return [
    (ids[i * batch : (i + 1) * batch], {"x": np.arange(i * batch, (i + 1) * batch) * 10})
    for i in range(num_batches)
  ]


@pytest.mark.parametrize("num_hosts, replicas_per_host, batch", [(2, 2, 8), (3, 2, 12), (2, 4, 16)])
def test_simulated_hosts_cover_every_example_once(num_hosts, replicas_per_host, batch):
  num_replicas = num_hosts * replicas_per_host
  batches = _global_batches(5, batch)
  seen = {}  # example id -> (step, global replica id)
  for host in range(num_hosts):
    local = sharding.HostShardedDataset(batches, num_hosts, host, num_replicas)
    replicas = sharding.host_replica_ids(num_hosts, host, num_replicas)
    assert list(replicas) == list(range(host * replicas_per_host, (host + 1) * replicas_per_host))
    for step, (ids, extra) in enumerate(local):
      assert ids.shape[0] == batch // num_hosts
      np.testing.assert_array_equal(extra["x"], ids.numpy() * 10)
      per_replica = batch // num_replicas
      for k, replica in enumerate(replicas):  # the host splits its rows in order
        for example in ids[k * per_replica : (k + 1) * per_replica].tolist():
          assert example not in seen, f"example {example} fed twice"
          seen[example] = (step, replica)
  assert sorted(seen) == list(range(5 * batch))
  # Replica r of step s gets rows [r*b, (r+1)*b) of global batch s, as on one host.
  for example, (step, replica) in seen.items():
    assert (example - step * batch) // (batch // num_replicas) == replica


def test_input_context_helper_matches_host_batch():
  (batch,) = _global_batches(1, 12)
  for host in range(3):
    ctx = sharding.input_context_for_host(3, host, 6)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (
      3,
      host,
      6,
    )
    ids, _ = sharding.shard_for_input_context(batch, ctx)
    assert ids.tolist() == list(range(4 * host, 4 * host + 4))
  assert sharding.host_row_range(12, 3, 1, 6) == (4, 8)


@dataclasses.dataclass
class _Batch:
  ids: torch.Tensor
  tag: str


def test_host_batch_splits_a_dataclass_by_its_fields():
  # As experimental_distribute_dataset does (xladist/_nest.py): its tensors by rows.
  got = sharding.host_batch(_Batch(torch.arange(12), "train"), 3, 1, 6)
  assert isinstance(got, _Batch) and got.tag == "train"
  assert got.ids.tolist() == [4, 5, 6, 7]


def test_sharding_errors():
  (batch,) = _global_batches(1, 10)
  with pytest.raises(ValueError, match="global batch size 10 is not divisible by the 4 replicas"):
    sharding.host_batch(batch, 2, 0, 4)
  with pytest.raises(ValueError, match="3 replicas cannot be spread evenly over 2 hosts"):
    sharding.host_replica_ids(2, 0, 3)
  with pytest.raises(ValueError, match="host_index 2 is out of range for 2 hosts"):
    sharding.HostShardedDataset([batch], 2, 2, 4)
  with pytest.raises(TypeError, match="num_hosts must be an int, got str '2'"):
    sharding.host_replica_ids("2", 0, 4)
  with pytest.raises(TypeError, match="input_context must be an InputContext"):
    sharding.shard_for_input_context(batch, (2, 0, 4))
  with pytest.raises(ValueError, match="different sizes in dim 0 \\(\\[2, 4\\]\\)"):
    sharding.host_batch((torch.zeros(4), torch.zeros(2)), 2, 0, 2)
  with pytest.raises(ValueError, match="holds a scalar"):
    sharding.host_batch((torch.zeros(4), torch.tensor(1.0)), 2, 0, 2)
  with pytest.raises(ValueError, match="holds no tensor"):
    sharding.host_batch(["a"], 2, 0, 2)
  with pytest.raises(TypeError, match="dataset must be an iterable of global batches, got int"):
    sharding.HostShardedDataset(3, 2, 0, 2)
  batches = sharding.HostShardedDataset(_global_batches(1, 10), 2, 0, 4)
  with pytest.raises(ValueError, match="global batch size 10 is not divisible"):
    next(iter(batches))
  assert isinstance(InputContext(), InputContext)
