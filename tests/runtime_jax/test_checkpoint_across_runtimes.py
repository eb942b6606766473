"""A checkpoint written on the jax runtime is read by the torch_xla runtime, and
one written on torch_xla by jax: the files are the same (xladist.checkpoint
writes host tensors). `make test-jax` sets XLADIST_XLA_PYTHON to the torch_xla
environment's Python; the torch_xla side runs there, in a child process.
"""

import os
import subprocess
import textwrap

import pytest
import torch

import xladist as xd
from xladist import runtime

pytestmark = pytest.mark.skipif(
  runtime.BACKEND != "jax", reason="tests/runtime_jax runs on the jax runtime (make test-jax)"
)

_XLA_SIDE = textwrap.dedent(
  """
  import sys, torch
  import xladist as xd
  from xladist import runtime
  assert runtime.BACKEND == "torch_xla", runtime.BACKEND
  path, out, mode = sys.argv[1:4]
  s = xd.MirroredStrategy()
  torch.manual_seed(7)
  with s.scope():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
  ckpt = xd.checkpoint.Checkpoint(model=model)
  if mode == "read":
    ckpt.restore(path)
  else:
    with torch.no_grad():
      for p in model.parameters():
        p.add_(1.5)
    ckpt.write(path)
  torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out)
  """
)


def _xla_python():
  python = os.environ.get("XLADIST_XLA_PYTHON")
  assert python and os.path.exists(python), (
    "XLADIST_XLA_PYTHON must name the torch_xla environment's Python (make test-jax sets it)"
  )
  return python


def _xla_side(path, out, mode):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLADIST_BACKEND", "XLA_"))}
  env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
  proc = subprocess.run(
    [_xla_python(), "-c", _XLA_SIDE, str(path), str(out), mode],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return torch.load(out)


def _model(strategy):
  torch.manual_seed(7)
  with strategy.scope():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_jax_writes_torch_xla_reads(tmp_path):
  strategy = xd.MirroredStrategy()
  model = _model(strategy)
  with torch.no_grad():
    model[0].weight.mul_(3.0)
    model[1].running_mean.add_(0.25)
  xd.checkpoint.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
  mine = {k: v.detach().cpu() for k, v in model.state_dict().items()}
  theirs = _xla_side(tmp_path / "ckpt", tmp_path / "read.pt", "read")
  assert mine.keys() == theirs.keys()
  for k in mine:
    torch.testing.assert_close(theirs[k], mine[k], atol=0, rtol=0)


def test_torch_xla_writes_jax_reads(tmp_path):
  theirs = _xla_side(tmp_path / "ckpt", tmp_path / "written.pt", "write")
  strategy = xd.MirroredStrategy()
  model = _model(strategy)
  xd.checkpoint.Checkpoint(model=model).restore(str(tmp_path / "ckpt"))
  for k, v in model.state_dict().items():
    torch.testing.assert_close(v.detach().cpu(), theirs[k], atol=0, rtol=0)
