"""TPUStrategy on 4 XLA:CPU devices: one replica per device, and 2 replicas x 2 cores.

References: plain PyTorch on the CPU on the global batch, and the same step
with the tensor left unsplit.
"""

import re

import pytest
import torch

import xladist as xd
from tests import _models
from xladist.runtime import xla as _runtime

B = 4  # examples per replica

# Traced and left lazy (replay off for this run): its program's HLO is readable.
LAZY = xd.RunOptions(experimental_replay=False)


@pytest.fixture(scope="module")
def tpu22():
  da = xd.experimental.DeviceAssignment.build(computation_shape=[1, 1, 1, 2], num_replicas=2)
  s = xd.TPUStrategy(experimental_device_assignment=da)
  assert s.num_replicas_in_sync == 2
  assert s.extended.num_logical_devices_per_replica == 2
  return s


KIND = "small-mlp"  # Linear(8, 16), Tanh, Linear(16, 5)


def _split_forward(strategy, partition):
  """make_forward for _models: the input split by `partition` ("hidden": the
  hidden activation, which needs a gradient, split on its features instead)."""

  def make_forward(model):
    def forward(x):
      if partition == "hidden":
        h = strategy.experimental_split_to_logical_devices(model[1](model[0](x)), [1, 2])
        return model[2](h)
      if partition is not None:
        x = strategy.experimental_split_to_logical_devices(x, partition)
      return model(x)

    return forward

  return make_forward


def _split_step(strategy, model, opt, partition):
  """A training step whose input is split over the logical devices by `partition`."""
  return _models.make_step(model, opt, _split_forward(strategy, partition)(model))


def _data(num_replicas, steps=3):
  return _models.make_data(KIND, num_replicas, steps=steps, b=B)


@pytest.fixture(scope="module")
def state():
  return _models.initial_state(KIND)


@pytest.mark.parametrize(
  "partition",
  [None, [2, 1], [1, 2], "hidden"],
  ids=["unsplit", "batch-split", "feature-split", "hidden-split"],
)
def test_split_layer_equals_unsplit_and_single_device_training(tpu22, state, partition):
  xs, ys = _data(2)
  losses, final = _models.train_xladist(
    tpu22, KIND, state, xs, ys, make_forward=_split_forward(tpu22, partition)
  )
  ref_losses, ref_final = _models.train_reference(KIND, state, xs, ys)
  _models.assert_close_to_scale(losses, ref_losses, 1e-5)
  _models.assert_close_to_scale(final, ref_final, 1e-5)


def test_split_step_hlo_divides_the_layer_over_the_core_axis(tpu22, state):
  xs, ys = _data(2, steps=1)
  model, _ = _models.build_xladist(tpu22, KIND, state)

  def step(x):
    h = tpu22.experimental_split_to_logical_devices(x, [2, 1])
    return model(h).square().sum()

  out = tpu22.run(step, args=(_models.split(tpu22, xs[0]),), options=LAZY)
  hlo = _runtime.hlo_text([out._stacked])
  dots = [l for l in hlo.splitlines() if " dot(" in l]
  # Each core multiplies its half of the replica's 4 rows: [2,8] x [8,16].
  assert any(re.search(r"f32\[2,16\]\{[0-9,]*\} dot\(f32\[2,8\]", l) for l in dots), dots
  assert not any("f32[4,8]" in l for l in dots), dots
  # The per-core partial sums meet in an all-reduce over each replica's cores.
  core_reduces = [
    l for l in hlo.splitlines() if " all-reduce(" in l and "replica_groups={{0,1},{2,3}}" in l
  ]
  assert core_reduces, hlo[-3000:]
  values = [v.cpu() for v in tpu22.experimental_local_results(out)]
  ref = _models.MODELS[KIND][0]()
  ref.load_state_dict(state)
  with torch.no_grad():
    expected = [ref(xs[0][r * B : (r + 1) * B]).square().sum() for r in range(2)]
  for v, e in zip(values, expected):
    torch.testing.assert_close(v, e, rtol=1e-5, atol=1e-8)


def test_gradients_reduce_over_replicas_per_core(tpu22, state):
  """The replica all-reduce pairs core c of every replica: groups {0,2} and {1,3}."""
  xs, ys = _data(2, steps=1)
  model, opt = _models.build_xladist(tpu22, KIND, state)
  step = _split_step(tpu22, model, opt, [2, 1])
  tpu22.run(step, args=(_models.split(tpu22, xs[0]), _models.split(tpu22, ys[0])), options=LAZY)
  hlo = _runtime.hlo_text(list(model.parameters()))
  assert any(
    "replica_groups={{0,2},{1,3}}" in l for l in hlo.splitlines() if " all-reduce(" in l
  ), hlo[-3000:]
  _runtime.sync()


def test_split_of_a_2d_partition_and_assign_and_replicate(tpu22):
  x = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)

  def step(v):
    s = tpu22.experimental_split_to_logical_devices(v, [1, 2])
    assert isinstance(s, torch.Tensor) and tuple(s.shape) == (4, 6) and s.dim() == 2
    t = (s * 2 + 1).t()  # blockwise, then transposed
    whole = tpu22.experimental_replicate_to_logical_devices(t)
    one = tpu22.experimental_assign_to_logical_device(s.sum(0), 1)
    reflected = (10 - s) * (1 / (s + 1)) + 2 ** (s / 8)  # __rsub__, __rdiv__, __rpow__
    return (whole, one, s.mean(), (s @ torch.ones(6, 2, device=v.device)), reflected, s.T * 3)

  whole, one, mean, prod, reflected, transposed = tpu22.run(
    step, args=(_models.split(tpu22, x.reshape(8, 6)),)
  )
  for r in range(2):
    xr = x[r]
    torch.testing.assert_close(whole.values[r].cpu(), (xr * 2 + 1).t(), rtol=0, atol=0)
    torch.testing.assert_close(one.values[r].cpu(), xr.sum(0), rtol=0, atol=0)
    torch.testing.assert_close(mean.values[r].cpu(), xr.mean(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(prod.values[r].cpu(), xr @ torch.ones(6, 2), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(
      reflected.values[r].cpu(), (10 - xr) * (1 / (xr + 1)) + 2 ** (xr / 8), rtol=1e-6, atol=1e-8
    )
    torch.testing.assert_close(transposed.values[r].cpu(), xr.T * 3, rtol=0, atol=0)


def test_default_tpu_strategy_is_one_replica_per_device_and_trains_like_mirrored(state):
  s = xd.TPUStrategy()
  assert s.num_replicas_in_sync == 4
  assert s.extended.num_logical_devices_per_replica == 1
  assert s.cluster_resolver is not None
  xs, ys = _data(4)
  losses, final = _models.train_xladist(s, KIND, state, xs, ys)
  ref_losses, ref_final = _models.train_reference(KIND, state, xs, ys)
  _models.assert_close_to_scale(final, ref_final, 1e-5)
  _models.assert_close_to_scale(losses, ref_losses, 1e-5)


def test_split_errors(tpu22):
  x = torch.zeros(2 * 4, 6)
  cases = [
    ([2], "has 1 entries but the tensor has 2 dims"),
    ([2, 2], "product of partition_dimensions [2, 2] is 4"),
    ([1, 1], "product must equal 2"),
    ("2x1", "must be a list of positive ints"),
  ]
  for partition, message in cases:

    def step(v, partition=partition):
      return tpu22.experimental_split_to_logical_devices(v, partition)

    with pytest.raises(ValueError) as e:
      tpu22.run(step, args=(_models.split(tpu22, x),))
    assert message in str(e.value)

  def odd(v):
    return tpu22.experimental_split_to_logical_devices(v[:3], [2, 1])

  with pytest.raises(ValueError, match="dim 0 of the tensor .* has size 3, which 2 logical"):
    tpu22.run(odd, args=(_models.split(tpu22, x),))

  def bad_id(v):
    return tpu22.experimental_assign_to_logical_device(v, 2)

  with pytest.raises(ValueError, match=r"logical_device_id must be an int in \[0, 2\)"):
    tpu22.run(bad_id, args=(_models.split(tpu22, x),))
  with pytest.raises(RuntimeError, match="inside the step function"):
    tpu22.experimental_split_to_logical_devices(torch.zeros(4, 6), [2, 1])


def test_device_assignment_errors():
  with pytest.raises(
    ValueError, match="3 replicas x 2 cores = 6 devices, but the SPMD mesh must cover all 4"
  ):
    xd.experimental.DeviceAssignment.build(computation_shape=[2], num_replicas=3)
  with pytest.raises(ValueError, match="topology=None"):
    xd.experimental.DeviceAssignment.build(topology="v4-8", num_replicas=4)
  with pytest.raises(TypeError, match="experimental_device_assignment"):
    xd.TPUStrategy(experimental_device_assignment=[2, 2])
  with pytest.raises(TypeError, match="tpu_cluster_resolver"):
    xd.TPUStrategy(tpu_cluster_resolver="local")
  da = xd.experimental.DeviceAssignment.build(computation_shape=[4], num_replicas=1)
  assert da.core_assignment.tolist() == [[0, 1, 2, 3]]
  assert da.tpu_ordinal(0, 3) == 3


def test_distributed_dataset_feeds_each_replica_on_all_its_cores(tpu22):
  data = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
  dist = tpu22.experimental_distribute_dataset(torch.utils.data.DataLoader(data, batch_size=8))

  def step(x):
    h = tpu22.experimental_split_to_logical_devices(x, [2, 1])
    return (h * h).sum(1)

  seen = []
  for batch in dist:
    sums = tpu22.run(step, args=(batch,))
    seen += [v.cpu() for v in tpu22.experimental_local_results(sums)]
  expected = (data * data).sum(1)
  torch.testing.assert_close(torch.cat(seen), expected, rtol=0, atol=0)


def test_pod_host_logic_with_logical_devices():
  """A simulated v4-16-like pod: 2 hosts x 4 devices, 4 replicas of 2 cores each."""
  from xladist.cluster_resolver import _multihost

  # Host 1 feeds replicas 2 and 3, i.e. devices 4..7; each replica's row goes
  # to both of its cores, in the runtime's (here shuffled) device order.
  rows = _multihost.local_shard_rows(
    ["TPU:5", "TPU:4", "TPU:7", "TPU:6"], [2, 3], "TPUStrategy", cores_per_replica=2
  )
  assert rows == [0, 0, 1, 1]
  with pytest.raises(RuntimeError, match=r"should have the XLA devices \[4, 5, 6, 7\]"):
    _multihost.local_shard_rows(
      ["TPU:2", "TPU:3", "TPU:4", "TPU:5"], [2, 3], "TPUStrategy", cores_per_replica=2
    )
  resolver = xd.cluster_resolver.TPUClusterResolver(
    env={
      "TPU_ACCELERATOR_TYPE": "v5litepod-16",
      "TPU_WORKER_ID": "2",
      "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5",
    }
  )
  cluster = _multihost.cluster_info(resolver, "TPUStrategy")
  assert (cluster.num_workers, cluster.task_index, cluster.is_chief) == (4, 2, False)
  env = _multihost.runtime_env(cluster, "TPU", "TPUStrategy", environ={})
  assert env["TPU_WORKER_ID"] == "2"
  assert env["TPU_WORKER_HOSTNAMES"].split(",") == ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]


def test_tpu_strategy_host_flags_on_one_host(tpu22):
  ext = tpu22.extended
  assert ext.should_checkpoint and ext.should_save_summary and ext.experimental_should_init
  assert tpu22.cluster_resolver.cluster_spec().as_dict() == {}
  assert ext.worker_devices == ("xla:0", "xla:0")  # devices a tensor can be put on
  assert (ext.num_hosts, ext.num_replicas_per_host) == (1, 2)


def test_batch_split_cnn_trains_like_the_global_batch_and_divides_the_convolutions(tpu22):
  state = _models.initial_state("cnn")
  xs, ys = _models.make_data("cnn", 2, steps=3, b=B)
  model, opt = _models.build_xladist(tpu22, "cnn", state)
  step = _split_step(tpu22, model, opt, [2, 1, 1, 1])
  losses = []
  for x, y in zip(xs, ys):
    out = tpu22.run(step, args=(_models.split(tpu22, x), _models.split(tpu22, y)), options=LAZY)
    losses.append(tpu22.reduce("mean", out, axis=None))
    if len(losses) == 1:
      hlo = _runtime.hlo_text(list(model.parameters()))
      convs = [l for l in hlo.splitlines() if " convolution(" in l]
      # The forward convolutions take each core's 2 of the replica's 4 images.
      assert any("convolution(f32[2,1,8,8]" in l for l in convs), convs
      assert not any("f32[4,1,8,8]" in l for l in convs), convs
  _runtime.sync()
  ref_losses, ref_state = _models.train_reference("cnn", state, xs, ys)
  final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
  _models.assert_close_to_scale(torch.stack([l.cpu() for l in losses]), ref_losses, 1e-5)
  _models.assert_close_to_scale(final, ref_state, 1e-5)


def test_split_training_compiles_once_and_runs_one_program_per_step(tpu22, state):
  xs, ys = _data(2, steps=8)
  model, opt = _models.build_xladist(tpu22, KIND, state)
  step = _split_step(tpu22, model, opt, [2, 1])
  counts = []
  for x, y in zip(xs, ys):
    tpu22.run(step, args=(_models.split(tpu22, x), _models.split(tpu22, y)))
    _runtime.sync()
    _runtime.wait()
    counts.append((_runtime.compile_count(), _runtime.execute_count()))
  assert counts[-1][0] - counts[1][0] == 0, counts  # no compilation after 2 steps
  assert counts[-1][1] - counts[1][1] == len(xs) - 2, counts  # one execution per step


def test_device_assignment_with_as_many_replicas_as_fit():
  da = xd.experimental.DeviceAssignment.build(computation_shape=[2], num_replicas=None)
  assert (da.num_replicas, da.num_cores_per_replica) == (2, 2)
  with pytest.raises(ValueError, match="3 cores per replica do not divide the 4 XLA devices"):
    xd.experimental.DeviceAssignment.build(computation_shape=[3], num_replicas=None)
