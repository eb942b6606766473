"""What a user gets without asking (issue 11): quiet XLA logs and the compile cache.

Each case is a fresh process (the log level and the cache are fixed when
torch_xla's runtime starts) that runs one small SPMD step; the processes start
together and are waited for with a timeout. Their environment is this one's
without the variables under test, with HOME in a temporary folder so that the
default cache location (`~/.cache/xladist/xla-cache`) is the test's.
"""

import collections
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from xladist.runtime import xla as _runtime
from xladist.runtime import xla_logs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Printed by XLA at every compilation of a program with shardings, at log level <= 1.
GSPMD_WARNING = "GSPMD sharding propagation is going to be deprecated"
CHILD_TIMEOUT_S = 300

_CHILD = textwrap.dedent(
  """
  import json, os, sys
  if sys.argv[1] == "torch_xla_first":
    import torch_xla  # as the README's example does, before xladist
  import torch
  import xladist as xd
  from xladist.runtime import xla as _runtime
  import torch_xla.debug.metrics as met

  strategy = xd.MirroredStrategy()
  x = strategy.experimental_distribute_values_from_function(
    lambda ctx: torch.arange(3.0) + 10 * ctx.replica_id_in_sync_group
  )
  out = strategy.run(
    lambda v: xd.get_replica_context().all_reduce(xd.ReduceOp.SUM, v * 2), args=(x,)
  )
  print(json.dumps({
    "values": [v.cpu().tolist() for v in strategy.experimental_local_results(out)],
    "device": _runtime.initialize().device_type,
    "log_level": os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
    "cache_path": os.environ.get("XLA_PERSISTENT_CACHE_PATH"),
    "compiles": _runtime.compile_count(),
    "hits": _runtime.cache_hits(),
    "unloadable": met.counter_value("PersistentCacheDeserializeFailure") or 0,
  }))
  """
)

_UNDER_TEST = (
  "TF_CPP_MIN_LOG_LEVEL",
  "XLADIST_COMPILE_CACHE",
  "XLA_PERSISTENT_CACHE_PATH",
  "XLA_PERSISTENT_CACHE_READ_ONLY",
)

Child = collections.namedtuple("Child", "report stderr folder")


def _expected_values(num_replicas):
  """The step's result on every replica, computed with numpy."""
  rows = [2 * (np.arange(3.0) + 10 * r) for r in range(num_replicas)]
  return np.sum(rows, axis=0).tolist()


def _run_children(tmp, cases):
  """Runs the cases {name: (import order, extra environment)} at once, each in
  tmp/name with HOME=tmp/name/home; returns {name: Child}."""
  procs, logs = {}, tmp / "logs"
  logs.mkdir(exist_ok=True)
  try:
    for name, (order, extra) in cases.items():
      folder = tmp / name
      (folder / "home").mkdir(parents=True)
      env = {k: v for k, v in os.environ.items() if k not in _UNDER_TEST}
      env.update(extra, HOME=str(folder / "home"))
      env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
      with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
        procs[name] = subprocess.Popen(
          [sys.executable, "-c", _CHILD, order], cwd=folder, env=env, stdout=out, stderr=err
        )
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    for p in procs.values():
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
  children = {}
  for name, p in procs.items():
    stdout = (logs / f"{name}.out").read_text()
    stderr = (logs / f"{name}.err").read_text()
    assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{stderr[-3000:]}"
    children[name] = Child(json.loads(stdout.splitlines()[-1]), stderr, tmp / name)
  return children


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("runtime_defaults")
  cache = tmp / "moved-cache"
  children = _run_children(
    tmp,
    {
      "default": ("xladist_first", {}),
      "torch_xla_first": ("torch_xla_first", {"XLADIST_COMPILE_CACHE": str(cache)}),
      "level_0": ("xladist_first", {"TF_CPP_MIN_LOG_LEVEL": "0", "XLADIST_COMPILE_CACHE": "off"}),
    },
  )
  written = sorted(os.listdir(cache)) if cache.exists() else None
  # A second process with the same program and the same cache folder; it also
  # gives torch_xla's own default log level at launch, torch_xla imported first.
  reader_env = {"XLADIST_COMPILE_CACHE": str(cache), "TF_CPP_MIN_LOG_LEVEL": "1"}
  children.update(_run_children(tmp, {"cache_reader": ("torch_xla_first", reader_env)}))
  for child in children.values():
    n = len(child.report["values"])
    assert n == 4
    assert child.report["values"] == [_expected_values(n)] * n
  return children, cache, written


def _files(folder):
  return sorted(
    os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
  )


def test_xla_warnings_hidden_by_default(runs):
  children, _, _ = runs
  for name in ("default", "torch_xla_first"):
    child = children[name]
    assert child.report["log_level"] == "2", name
    assert child.report["compiles"] > 0, name  # the step compiled: the warning had its chance
    assert GSPMD_WARNING not in child.stderr, name


def test_users_log_level_wins(runs):
  """Level 0 (xladist imported first), and level 1, torch_xla's own default,
  given at launch with torch_xla imported first: XLA's warning is printed at
  each compilation (the cache reader compiles unless every program was read
  from the cache)."""
  children, _, _ = runs
  for name, level in (("level_0", "0"), ("cache_reader", "1")):
    child = children[name]
    assert child.report["log_level"] == level, name
    compiled = child.report["compiles"]
    assert (GSPMD_WARNING in child.stderr) == (compiled > 0), name
  assert children["level_0"].report["compiles"] > 0


def test_compile_cache_default_location(runs):
  """On by default where the device loads programs back (TPU): under
  ~/.cache/xladist/xla-cache. torch_xla 2.9's XLA:CPU client cannot load them
  (see test_compile_cache_moved_and_reused), so no cache is made there."""
  children, _, _ = runs
  child = children["default"]
  default = child.folder / "home" / ".cache" / "xladist" / "xla-cache"
  if child.report["device"] in _runtime.COMPILE_CACHE_DEVICE_TYPES:
    assert child.report["cache_path"] == str(default)
    assert os.listdir(default)
  else:
    assert child.report["cache_path"] is None
    assert not default.parent.exists()


def test_compile_cache_off_writes_nothing(runs):
  child = runs[0]["level_0"]
  assert child.report["cache_path"] is None
  assert child.report["hits"] == 0 and child.report["unloadable"] == 0
  assert _files(child.folder) == []  # nothing in ~ nor in the working folder


def test_compile_cache_moved_and_reused(runs):
  """XLADIST_COMPILE_CACHE=<folder>: the first process writes its programs there,
  a second one running the same program reads them instead of compiling."""
  children, cache, written = runs
  writer, reader = children["torch_xla_first"], children["cache_reader"]
  assert writer.report["cache_path"] == reader.report["cache_path"] == str(cache)
  assert written and len(written) <= writer.report["compiles"]
  assert writer.report["hits"] == 0
  assert _files(writer.folder) == [] and _files(reader.folder) == []  # nothing in ~
  if reader.report["device"] in _runtime.COMPILE_CACHE_DEVICE_TYPES:
    assert reader.report["hits"] >= len(written)
    assert reader.report["compiles"] == writer.report["compiles"] - reader.report["hits"]
  else:
    # torch_xla 2.9 on XLA:CPU: every program is found and fails to load
    # ("Deserializing serialized executable not supported"). If this fails,
    # torch_xla learnt to load them: add the device to COMPILE_CACHE_DEVICE_TYPES.
    assert reader.report["hits"] == 0
    assert reader.report["unloadable"] >= len(written)
    assert reader.report["compiles"] == writer.report["compiles"]
    assert "cannot load them back" in writer.stderr  # xladist said so


@pytest.mark.parametrize(
  "value, device, expected",
  [
    (None, "CPU", None),
    (None, "TPU", "~/.cache/xladist/xla-cache"),
    ("~/elsewhere", "CPU", "~/elsewhere"),
    ("/tmp/xla-cache", "TPU", "/tmp/xla-cache"),
    ("off", "TPU", None),
    ("OFF", "CPU", None),
    ("0", "TPU", None),
    ("", "TPU", None),
  ],
)
def test_compile_cache_path(value, device, expected):
  environ = {} if value is None else {"XLADIST_COMPILE_CACHE": value}
  expected = None if expected is None else os.path.expanduser(expected)
  assert _runtime.compile_cache_path(device, environ) == expected


@pytest.mark.parametrize(
  "value, torch_xla_imported, launched_with, expected",
  [
    (None, False, set(), "2"),  # nothing chosen
    (None, True, set(), "2"),
    ("0", True, set(), "0"),  # the user's, whatever the import order
    ("3", False, set(), "3"),
    ("1", False, set(), "1"),  # set before torch_xla was imported: the user's
    ("1", True, set(), "2"),  # torch_xla's default (not in the launch environment)
    ("1", True, {"TF_CPP_MIN_LOG_LEVEL"}, "1"),  # given at launch: the user's
  ],
)
def test_quiet_xla_logs_rule(value, torch_xla_imported, launched_with, expected):
  environ = {} if value is None else {"TF_CPP_MIN_LOG_LEVEL": value}
  modules = {"torch_xla": object()} if torch_xla_imported else {}
  xla_logs.quiet_xla_logs(environ, modules, launched_with)
  assert environ["TF_CPP_MIN_LOG_LEVEL"] == expected
