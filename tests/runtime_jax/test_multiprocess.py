"""MultiWorkerMirroredStrategy on the jax runtime across real processes.

Each test starts its processes (`_mwms_worker.py`) on this machine: a chief
and a worker, each with 2 XLA:CPU devices (`CPU_NUM_DEVICES=2`,
`XLADIST_BACKEND=jax`, `JAX_PLATFORMS=cpu`), whose TF_CONFIG puts both on
127.0.0.1 at free ports; xladist joins them with `jax.distributed` (the
coordinator at the chief's address, bound to 127.0.0.1 only through
`JAX_COORDINATOR_BIND_ADDRESS`; gloo collectives). Every process has a
timeout and is killed by pid at the end of its test, also when it fails.
The one-process reference (MirroredStrategy over 4 devices) is the same
worker code run in this test process (4 XLA:CPU devices, tests/runtime_jax/
conftest.py) while the two processes train: a process start costs about 5
CPU-s, and this one already has what the reference needs.

What TF checks for its MultiWorkerMirroredStrategy, on a cluster of real
servers (`multi_worker_test_base.create_in_process_cluster`), in
tensorflow/python/distribute/collective_all_reduce_strategy_test.py
(DistributedCollectiveAllReduceStrategyTest): `test_num_replicas_in_sync`
counts every worker's devices; `testMinimizeLossGraph` trains across the
workers; `testVariableInitialization` compares a worker's
`experimental_local_results` with the cross-worker reduction;
`testMakeInputFnIterator` gives each worker its own input pipeline. Here the
training is compared with one process over the same global batches and with
plain torch. For a lost peer,
tensorflow/python/kernel_tests/collective_ops_multi_worker_test.py
(`testCheckHealthPeerDown`, `AbortCollectiveOpsTest`): a collective whose
peer is down ends in an error ("peer down"), never a hang; here within
`CommunicationOptions(timeout_seconds=...)`.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from xladist import runtime

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/: the shared models

import _models  # noqa: E402
import _mwms_worker  # noqa: E402  (tests/runtime_jax/: the same code as the processes')
import _xla_flags  # noqa: E402

WORKER = HERE / "_mwms_worker.py"
HOSTS = ("chief", "worker")  # the two processes of every test
TOL = 1e-6
PROCESS_TIMEOUT = 300  # seconds any process of a test may run
LOST_PEER_TIMEOUT = 20  # CommunicationOptions.timeout_seconds with a killed peer
STALLED_PEER_TIMEOUT = 10  # ... and with a stalled one (the test waits it out)


def _free_ports(n):
  sockets = [socket.socket() for _ in range(n)]
  try:
    for s in sockets:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def _env(devices, tf_config=None, **extra):
  env = dict(os.environ)
  for name in list(env):
    if name.startswith(("XLADIST_JAX_", "JAX_COORDINATOR")) or name == "TF_CONFIG":
      del env[name]
  env.update(
    XLADIST_BACKEND="jax",
    JAX_PLATFORMS="cpu",
    JAX_DEFAULT_MATMUL_PRECISION="highest",
    CPU_NUM_DEVICES=str(devices),
    XLADIST_COMPILE_CACHE="off",
    XLA_FLAGS=_xla_flags.for_child(),  # its device count: CPU_NUM_DEVICES
    PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent.parent), env.get("PYTHONPATH")])),
    **extra,
  )
  if tf_config is not None:
    env["TF_CONFIG"] = json.dumps(tf_config)
  return env


def _cluster():
  """TF_CONFIG's cluster: a chief and a worker on 127.0.0.1."""
  chief, worker = _free_ports(2)
  return {"chief": [f"127.0.0.1:{chief}"], "worker": [f"127.0.0.1:{worker}"]}


def _task_env(cluster, task_type, **extra):
  coordinator = cluster["chief"][0]
  return _env(
    2,
    {"cluster": cluster, "task": {"type": task_type, "index": 0}},
    JAX_COORDINATOR_BIND_ADDRESS=coordinator,  # loopback only, not every interface
    **extra,
  )


class _Processes:
  """Started processes, each logging to its own files; all killed by pid at the end."""

  def __init__(self, tmp_path):
    self.tmp_path = tmp_path
    self.procs = {}

  def start(self, name, args, env):
    out = open(self.tmp_path / f"{name}.out", "w")
    err = open(self.tmp_path / f"{name}.err", "w")
    cmd = [sys.executable, str(WORKER)] + [str(a) for a in args]
    self.procs[name] = (subprocess.Popen(cmd, env=env, stdout=out, stderr=err), out, err)
    return self.procs[name][0]

  def wait(self, name, timeout):
    return self.procs[name][0].wait(timeout=timeout)

  def log(self, name):
    self.procs[name][1].flush()
    self.procs[name][2].flush()
    out = (self.tmp_path / f"{name}.out").read_text()
    err = (self.tmp_path / f"{name}.err").read_text()
    lines = [line for line in err.splitlines() if "registered at" not in line]
    return f"--- {name} stdout\n{out[-3000:]}\n--- {name} stderr\n" + "\n".join(lines)[-6000:]

  def kill_all(self):
    for proc, _, _ in self.procs.values():
      if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    for proc, out, err in self.procs.values():
      proc.wait(timeout=30)
      out.close()
      err.close()


@pytest.fixture
def processes(tmp_path):
  p = _Processes(tmp_path)
  try:
    yield p
  finally:
    p.kill_all()
    assert all(proc.poll() is not None for proc, _, _ in p.procs.values())


def _one_process(mode, out, extra):
  """The worker's `mode` run in this process (no TF_CONFIG here: MirroredStrategy
  over this process's 4 devices), as the one-process reference; its result."""
  assert not os.environ.get("TF_CONFIG") and runtime.num_devices() == 4
  _mwms_worker.main(mode, str(out), str(extra))
  return torch.load(out, weights_only=False)


def _results(processes, tmp_path, start):
  """Waits for the chief and the worker (bounded from `start`), each exiting 0;
  their results."""
  for name in HOSTS:
    left = max(1.0, PROCESS_TIMEOUT - (time.monotonic() - start))
    try:
      rc = processes.wait(name, left)
    except subprocess.TimeoutExpired:
      pytest.fail(f"{name} did not finish within {PROCESS_TIMEOUT} s\n{processes.log(name)}")
    assert rc == 0, processes.log(name)
  return [torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in HOSTS]


_ONE_PROCESS_REPLAY = []  # the one unsharded process's run, the same for every `shard`


@pytest.mark.parametrize("shard", [None, "parameters"])
def test_two_processes_replay_adamw_with_a_schedule_like_one_process(processes, tmp_path, shard):
  """Replay on several hosts (issue 32): 2 processes x 2 devices train the loop
  users run (AdamW, CosineAnnealingLR stepped every step, gradient clipping)
  for 20 steps; each process traces fn at most 3 times and replays the rest,
  and both train like 1 process x 4 devices (1e-6 of each tensor's scale).
  With `shard` (issue 51) the two processes shard parameters, gradients and
  optimizer state over the 4 replicas (reduce-scatters and all-gathers across
  the processes) and still train like the one unsharded process."""
  cluster = _cluster()
  start = time.monotonic()
  extra = {"XLADIST_TEST_SHARD": shard} if shard else {}
  for name in HOSTS:
    processes.start(
      name, ["replay", tmp_path / f"{name}.pt", "-"], _task_env(cluster, name, **extra)
    )
  if not _ONE_PROCESS_REPLAY:  # (run once for both cases, while the two processes run)
    _ONE_PROCESS_REPLAY.append(_one_process("replay", tmp_path / "single.pt", "-"))
  (chief, worker), single = _results(processes, tmp_path, start), _ONE_PROCESS_REPLAY[0]
  for result in (chief, worker, single):
    assert result["traces"] <= 3 and result["replays"] == 20 - result["traces"], result["reasons"]
  assert chief["losses"] == worker["losses"]
  _models.assert_close_to_scale(
    torch.tensor(chief["losses"], dtype=torch.float64),
    torch.tensor(single["losses"], dtype=torch.float64),
    TOL,
  )
  _models.assert_close_to_scale(chief["state"], single["state"], TOL)
  with pytest.raises(AssertionError):  # it did train
    _models.assert_close_to_scale(chief["state"], _models.initial_state("mlp"), 1e-2)


def test_two_processes_train_like_one_process_and_plain_torch(processes, tmp_path):
  """2 processes x 2 devices (MultiWorkerMirroredStrategy from TF_CONFIG) train
  an MLP for 3 steps from a distributed DataLoader exactly like 1 process x 4
  devices (MirroredStrategy) and like plain torch on the CPU (1e-6 of each
  tensor's scale): the same per-step mean losses and final parameters on both
  hosts, each host's local results are its replicas', and the chief alone
  writes the checkpoint, which both hosts restore; strategy.gather and a
  variable's local results (its copies on this host's replicas) read across
  hosts."""
  cluster = _cluster()
  ckpt = tmp_path / "ckpt.pt"
  start = time.monotonic()
  for name in HOSTS:
    processes.start(name, ["train", tmp_path / f"{name}.pt", ckpt], _task_env(cluster, name))
  single = _one_process("train", tmp_path / "single.pt", tmp_path / "single-ckpt.pt")
  chief, worker = _results(processes, tmp_path, start)

  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=3)
  ref_losses, ref_state = _models.train_reference("mlp", state, xs, ys)

  assert chief["replicas"] == worker["replicas"] == single["replicas"] == 4
  assert (chief["task"], worker["task"]) == (("chief", 0), ("worker", 0))
  # Both hosts read the same (replicated) values.
  assert chief["losses"] == worker["losses"]
  for k in chief["state"]:
    torch.testing.assert_close(chief["state"][k], worker["state"][k], rtol=0, atol=0)
  # Two processes x 2 devices == one process x 4 devices == plain torch.
  for result in (chief, single):
    _models.assert_close_to_scale(
      torch.tensor(result["losses"], dtype=torch.float64), ref_losses.double(), TOL
    )
    _models.assert_close_to_scale(result["state"], ref_state, TOL)
  _models.assert_close_to_scale(chief["state"], single["state"], TOL)
  with pytest.raises(AssertionError):  # it did train
    _models.assert_close_to_scale(chief["state"], state, 1e-2)
  # experimental_local_results: each host's own replicas (0, 1 | 2, 3).
  local = torch.tensor(chief["local"] + worker["local"])
  whole = torch.tensor(single["local"])
  assert local.shape == (6, 2) and whole.shape == (3, 4)
  torch.testing.assert_close(
    torch.cat([local[:3], local[3:]], dim=1), whole, rtol=0, atol=TOL * float(whole.abs().max())
  )
  # strategy.gather: every replica's value on every host; a variable's local
  # results: this host's replicas' copies.
  for result in (chief, worker):
    torch.testing.assert_close(result["gathered"], single["gathered"], rtol=0, atol=TOL * 2)
    assert len(result["local_bias"]) == 2
    for copy in result["local_bias"]:
      torch.testing.assert_close(copy, chief["state"]["0.bias"], rtol=0, atol=0)
  # Checkpoints: the chief writes, both restore the trained values.
  assert chief["should_checkpoint"] and not worker["should_checkpoint"]
  assert ckpt.exists()
  for result in (chief, worker):
    for k, v in result["restored"].items():
      torch.testing.assert_close(v, chief["state"][k], rtol=0, atol=0)


@pytest.mark.parametrize("peer", ["killed", "stalled"])
def test_a_lost_worker_makes_the_chief_fail_with_a_clear_error(processes, tmp_path, peer):
  """After step 1 the worker is killed (SIGKILL), or stalls (it sleeps and
  never joins step 2's collectives): the chief fails in step 2 with an error
  that names the lost host, and exits non-zero within a bounded time; it
  never hangs. Killed: gloo reports the broken connection at once (a
  RuntimeError naming the worker's address). Stalled: nothing breaks, so the
  chief's bounded wait ends it (a TimeoutError after
  CommunicationOptions.timeout_seconds)."""
  cluster = _cluster()
  timeout = LOST_PEER_TIMEOUT if peer == "killed" else STALLED_PEER_TIMEOUT
  extra = {"XLADIST_TEST_TIMEOUT": str(timeout)}
  for name in HOSTS:
    processes.start(
      name,
      ["kill", tmp_path / f"{name}.pt", tmp_path / f"{name}.step1"],
      _task_env(cluster, name, **extra),
    )
  deadline = time.monotonic() + PROCESS_TIMEOUT
  while not (tmp_path / "worker.step1").exists():
    for name in HOSTS:
      assert processes.procs[name][0].poll() is None, processes.log(name)
    assert time.monotonic() < deadline, processes.log("worker")
    time.sleep(0.1)
  lost = time.monotonic()
  if peer == "killed":
    victim = processes.procs["worker"][0]
    os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
  bound = timeout + 60  # the collective's timeout, then the exit
  try:
    rc = processes.wait("chief", bound)
  except subprocess.TimeoutExpired:
    pytest.fail(f"the chief hung after its peer was {peer}\n{processes.log('chief')}")
  elapsed = time.monotonic() - lost
  log = processes.log("chief")
  assert rc != 0, log
  assert elapsed < bound, log
  assert "step 1 loss" in log and "step 2 loss" not in log, log
  lost_peer = (
    "RuntimeError: MultiWorkerMirroredStrategy.run: the step failed on host 0 of 2" in log
    and f"lost another host of the cluster ['{cluster['worker'][0]}']" in log
  )
  timed_out = (
    "TimeoutError: MultiWorkerMirroredStrategy.run: the step (on the hosts "
    f"{[cluster['chief'][0], cluster['worker'][0]]}"
    in log
    and f"did not finish within {float(timeout)} s" in log
  )
  # A killed peer may also be slow to break the connection: then the timeout.
  assert timed_out if peer == "stalled" else (lost_peer or timed_out), log
  assert not (tmp_path / "chief.pt").exists()
  print(f"the chief failed (rc {rc}) {elapsed:.1f} s after its peer was {peer}")
