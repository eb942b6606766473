"""The runtime contract's devices and mesh: starting the runtime, its devices,
their names and the groups of a collective.

The test process has 4 CPU devices (tests/conftest.py: PJRT_DEVICE=CPU and
CPU_NUM_DEVICES=4 for torch_xla; the jax runtime reads CPU_NUM_DEVICES too),
one process, one device per replica. A fresh process (a child) shows what
holds before the runtime starts.
"""

import json
import os
import subprocess
import sys

from xladist import runtime

N = 4

_BEFORE_START = """
import json
from xladist import runtime
before = {"initialized": runtime.is_initialized(), "seed": runtime.seed(),
          "device_type": runtime.device_type()}
before["started_by_device_type"] = runtime.is_initialized()
first = runtime.initialize()
second = runtime.initialize()
print(json.dumps({"before": before, "after": runtime.is_initialized(),
                  "same": first is second, "num_devices": runtime.num_devices(),
                  "seed": runtime.seed() is not None}))
"""


def test_before_and_after_initialize_in_a_fresh_process():
  """Runtime.initialize / is_initialized / device_type / seed: not started until
  `initialize` (the seed is None until then); `initialize` starts it once (a
  second call does nothing). device_type answers without starting torch_xla;
  the jax runtime starts to answer (its platform is known once jax.distributed
  has joined the processes), as the contract allows."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  child = subprocess.run(
    [sys.executable, "-c", _BEFORE_START], env=env, capture_output=True, text=True, timeout=300
  )
  assert child.returncode == 0, child.stderr[-3000:]
  got = json.loads(child.stdout.strip().splitlines()[-1])
  assert got["before"] == {
    "initialized": False,
    "seed": None,
    "device_type": "CPU",
    "started_by_device_type": runtime.BACKEND == "jax",
  }
  assert got["after"] is True
  assert got["num_devices"] == N
  assert got["seed"] is True


def test_initialize_is_idempotent():
  """Runtime.initialize: later calls do nothing (same devices, still started)."""
  runtime.initialize()
  devices = runtime.process_devices()
  runtime.initialize()
  assert runtime.is_initialized()
  assert runtime.process_devices() == devices


def test_devices_of_the_test_process():
  """Runtime.num_devices / device_type / device / process_devices: 4 CPU devices
  in one process, named "<PLATFORM>:<global index>"."""
  assert runtime.num_devices() == N
  assert runtime.device_type() == "CPU"
  assert runtime.device().type == runtime.DEVICE_KIND
  count, index, names = runtime.process_devices()
  assert (count, index) == (1, 0)
  assert list(names) == [f"CPU:{i}" for i in range(N)]


def test_one_device_per_replica():
  """Runtime.cores_per_replica: 1 for one replica per device (the default)."""
  assert runtime.cores_per_replica() == 1
  assert runtime.cores_per_replica(N) == 1


def test_replica_groups():
  """Runtime.replica_groups: across replicas one group of every replica's device;
  `within` one group per replica, of its own device."""
  assert runtime.replica_groups() == [list(range(N))]
  assert runtime.replica_groups(N) == [list(range(N))]
  assert runtime.replica_groups(within=True) == [[d] for d in range(N)]
  assert runtime.replica_groups(N, within=True) == [[d] for d in range(N)]
