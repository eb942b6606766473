"""1, 2 and 8 replicas, each in one subprocess (the device count is fixed per process)."""

import functools
import os
import pathlib
import subprocess
import sys
import tempfile

import _models
import pytest
import torch

HERE = pathlib.Path(__file__).parent


def _env(num_devices):
  env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(num_devices))
  env.pop("XLA_USE_SPMD", None)  # set by this process's xr.use_spmd(); not inherited
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
  return env


@functools.cache
def _worker_result(num_devices):
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "result.pt")
    proc = subprocess.run(
      [sys.executable, str(HERE / "_device_count_worker.py"), out],
      env=_env(num_devices),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_tf_merge_call_example(n):
  result = _worker_result(n)
  assert result["num_replicas"] == n
  total = sum(3.0 + r for r in range(n))
  assert result["merge"] == [total + 3.0 + r for r in range(n)]
  # With one replica run returns plain values, as TF's regroup does.
  assert result["merge_type"] == ("Tensor" if n == 1 else "PerReplica")


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("n", [1, 2, 8])
def test_training_matches_single_device(n, kind):
  r = _worker_result(n)[kind]
  assert r["xs"][0].shape[0] == n * _models.PER_REPLICA_BATCH
  ref_losses, ref_state = _models.train_reference(kind, r["state"], r["xs"], r["ys"])
  _models.assert_close_to_scale(r["losses"], ref_losses, 1e-5)
  _models.assert_close_to_scale(r["final"], ref_state, 1e-5)


@pytest.mark.parametrize("n", [2, 8])
def test_logical_devices_train_like_the_global_batch(n):
  """1 replica x 2 devices (n = 2) and 2 replicas x 4 devices (n = 8)."""
  results = _worker_result(n)["logical"]
  k = 2 if n == 2 else 4
  assert set(results) == {(k, 1), (1, 2) if k == 2 else (2, 2)}
  for r in results.values():
    assert r["xs"][0].shape[0] == (n // k) * 4
    ref_losses, ref_state = _models.train_reference("mlp", r["state"], r["xs"], r["ys"])
    _models.assert_close_to_scale(r["losses"], ref_losses, 1e-5)
    _models.assert_close_to_scale(r["final"], ref_state, 1e-5)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_elements_without_a_batch_dim(n):
  """tests/test_tf_input.py's cases on 1, 2 and 8 replicas (MirroredStrategy
  over n devices): mirrored_strategy_test.py testReplicateDataset and
  input_lib_test.py testTwoDevicesOneGPUOneCPU / testOneDeviceCPU (Dataset.range(10)
  per worker: n consecutive scalars a step; with 8 the last 2 end the epoch, as
  in TF), testTupleDataset, testIterableIterator (one replica:
  experimental_distribute_dataset of scalars), testUnevenDatasetBatches
  (Dataset.range(9).batch(2) per worker; TF's [[8], []] last step is refused by
  default, masked with "mask", left out with "drop")."""
  r = _worker_result(n)["input"]
  assert r["spec"] == (torch.Size([]), torch.int64)
  steps = 10 // n
  assert r["scalars"] == [[s * n + i for i in range(n)] for s in range(steps)]
  assert r["tuples"] == [
    ([s * n + i for i in range(n)], [(s * n + i) ** 2 for i in range(n)]) for s in range(steps)
  ]
  assert r["run"] == [101 * i for i in range(n)]
  assert r["local_type"] == "Tensor"
  if n == 1:
    assert r["distribute_dataset_error"] is None
    assert r["distribute_dataset"] == [[i] for i in range(10)]
  else:
    assert "a batch holds a scalar tensor (tensor(0))" in r["distribute_dataset_error"]
    assert f"to be split between the {n} replicas" in r["distribute_dataset_error"]
  assert "last per-replica batch will have 1 examples, the others 2" in r["uneven_error"]
  batches = [[2 * i, 2 * i + 1] for i in range(4)] + [[8, 0]]
  masks = [[1.0, 1.0]] * 4 + [[1.0, 0.0]]
  batches += [[0, 0]] * (-len(batches) % n)  # replicas after the data's end
  masks += [[0.0, 0.0]] * (len(batches) - len(masks))
  assert r["uneven_mask"] == [
    (batches[s : s + n], masks[s : s + n]) for s in range(0, len(batches), n)
  ]
  full = 4 // n * n
  assert r["uneven_drop"] == [batches[s : s + n] for s in range(0, full, n)]


@pytest.mark.parametrize("n", [1, 2, 8])
def test_tf_semantics_of_issue_23(n):
  """The TF tests of issue 23 on 1, 2 and 8 replicas (MirroredStrategy over n
  devices; 4 replicas, OneDeviceStrategy and the default strategy:
  tests/test_tf_strategy.py, tests/test_tf_variables.py):
  strategy_common_test.py ReduceTest.testBasic / StrategyTest.testMergeCallInitScope
  with the default strategy in its scope and with n replicas,
  StrategyLocalResultTest.testLocalResultForNestedStructWithoutTensor, tf.contrib
  mirrored_strategy_multigpu_test.py testTowerLocalVariable,
  mirrored_variable_test.py testAssignMirroredVarReplicaContextWithSum and
  v1/cross_device_ops_test.py testReduceDistributedVariable."""
  r = _worker_result(n)["tf_semantics"]
  assert r["default_reduce"] == 1.0 and r["default_merge"] == [12]
  assert r["merge"] == [12] * n
  assert r["nest"] == ({"a": 1.0, "b": 2.0},) * n
  assert r["tower_local"] == [[i + 3.0 for i in range(n)], [i * 6.0 for i in range(n)]]
  assert r["fetch"] == [sum(i + 3.0 for i in range(n)), sum(i * 6.0 for i in range(n)) / n]
  if n == 1:
    assert r["assign_sum"] == 5.0
  else:
    assert "a non-DistributedValues value (float 5.0) cannot be reduced" in r["assign_sum"]
  assert r["reduce_variable"] == ("Tensor" if n == 1 else "Mirrored", [True] * n)


def test_torch_xla_used_without_spmd_first_is_a_clear_error():
  code = (
    "import torch, torch_xla\n"
    "t = torch.ones(2, device=torch_xla.device())\n"
    "import xladist as xd\n"
    "try:\n"
    "  xd.MirroredStrategy()\n"
    "except RuntimeError as e:\n"
    "  print('ERROR:', e)\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code], env=_env(2), capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (
    "ERROR: xladist runs every strategy as one SPMD program, but torch_xla was already "
    "used in its non-SPMD mode" in proc.stdout
  )
  assert "Create the xladist strategy before touching any XLA device" in proc.stdout


def test_an_error_in_a_step_shown_by_pytest_does_not_abort_the_process(tmp_path):
  # pytest's long tracebacks print every frame's arguments; those of the step
  # function are replica-local views, which torch_xla cannot read after the step.
  (tmp_path / "test_boom.py").write_text(
    "import torch, xladist as xd\n"
    "def test_step_raises():\n"
    "  s = xd.MirroredStrategy()\n"
    "  x = s.experimental_distribute_values_from_function(lambda c: torch.ones(3))\n"
    "  def step(v, scale=2):\n"
    "    w = v * scale\n"
    "    raise KeyError('boom in the step')\n"
    "  s.run(step, args=(x,))\n"
  )
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      "--tb=long",
      str(tmp_path / "test_boom.py"),
    ],
    env=_env(4),
    capture_output=True,
    text=True,
    timeout=120,
    cwd=tmp_path,
  )
  out = proc.stdout + proc.stderr
  assert proc.returncode == 1, out[-3000:]  # a failed test, not a crash
  assert "KeyError: 'boom in the step'" in out
  assert "1 failed" in out and "IsManual" not in out
