"""Training equivalence on the jax runtime: xladist's MirroredStrategy trains as
plain PyTorch on the CPU does.

An MLP, a CNN (Conv2d, BatchNorm2d made SyncBatchNorm, max-pooling,
nn.Flatten) and a small pre-norm transformer encoder (nn.TransformerEncoderLayer)
each train `STEPS` steps with a torch.optim optimizer (Adam for the MLP, SGD
with momentum for the others) under
`xd.MirroredStrategy` with 1, 2 and 4 devices, from the initial weights of
`torch.manual_seed(SEED)`, on a global batch of `GLOBAL_BATCH` examples split
evenly across the replicas by `strategy.experimental_distribute_dataset`. The
reference is the same model trained on the whole global batch by plain PyTorch
on the CPU in this (pytest) process. Parameters, buffers (BatchNorm's running
statistics) and losses (`strategy.reduce(MEAN)` of the per-replica losses) agree
to 1e-5, and after the first two steps (step 1 makes the optimizer's state)
nothing compiles.

JAX fixes its device count when it starts, so the 1- and 2-device counts each
run in one child process (this file run as a script, `--child N`) that trains
every model and prints its results as JSON; 4 devices train in this (pytest)
process, which has them (tests/runtime_jax/conftest.py), and also train the MLP
under `xd.OneDeviceStrategy`. The tests read each device count's results once
(module scope).

Plain BatchNorm under MirroredStrategy normalizes each replica's own rows (TF's
BatchNormalization does the same), which is not the global-batch reference with
more than one replica: the CNN converts its BatchNorm2d with
`xd.nn.SyncBatchNorm.convert_sync_batchnorm`, whose statistics span the global
batch.
"""

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F

DEVICE_COUNTS = (1, 2, 4)
STEPS = 4
WARMUP_STEPS = 2  # step 1 makes the optimizer's state: steps 1 and 2 may compile
GLOBAL_BATCH = 8
SEED = 0
DATA_SEED = 1
TOL = dict(rtol=1e-5, atol=1e-5)
CHILD_TIMEOUT_S = 300
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "RESULTS_JSON "


class _Encoder(torch.nn.Module):
  """Token embedding, one pre-norm encoder layer, mean pooling, a linear head."""

  def __init__(self, vocab=11, d_model=16, classes=5):
    super().__init__()
    self.embed = torch.nn.Embedding(vocab, d_model)
    self.layer = torch.nn.TransformerEncoderLayer(
      d_model, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True
    )
    self.head = torch.nn.Linear(d_model, classes)

  def forward(self, tokens):
    return self.head(self.layer(self.embed(tokens)).mean(1))


def _mlp():
  return torch.nn.Sequential(
    torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.ReLU(),
    torch.nn.Linear(16, 5),
  )  # fmt: skip


def _cnn():
  return torch.nn.Sequential(
    torch.nn.Conv2d(3, 6, 3, padding=1),
    torch.nn.BatchNorm2d(6),
    torch.nn.ReLU(),
    torch.nn.MaxPool2d(2),
    torch.nn.Flatten(),
    torch.nn.Linear(6 * 4 * 4, 5),
  )


def _sgd(params):
  return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params):
  return torch.optim.Adam(params, lr=0.01)


# name -> (model, optimizer, input of one example: ("float", shape) or ("tokens", shape))
MODELS = {
  "mlp": (_mlp, _adam, ("float", (12,))),
  "cnn": (_cnn, _sgd, ("float", (3, 8, 8))),
  "transformer": (_Encoder, _sgd, ("tokens", (6,))),
}


def _data(name):
  """STEPS global batches of the model's inputs and labels, as one dataset."""
  kind, shape = MODELS[name][2]
  g = torch.Generator().manual_seed(DATA_SEED)
  n = STEPS * GLOBAL_BATCH
  if kind == "tokens":
    x = torch.randint(0, 11, (n,) + shape, generator=g)
  else:
    x = torch.randn((n,) + shape, generator=g)
  return x, torch.randint(0, 5, (n,), generator=g)


def _make(name):
  torch.manual_seed(SEED)
  return MODELS[name][0]()


def _state(model):
  return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _encode(state):
  return {k: {"dtype": str(v.dtype), "values": v.tolist()} for k, v in state.items()}


def _decode(state):
  return {
    k: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"][6:])) for k, v in state.items()
  }


# -- the child: one device count, every model ---------------------------------------------


def _train_xladist(xd, rt, strategy, name, sync_bn):
  with strategy.scope():
    model = _make(name)
    if sync_bn:
      model = xd.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    opt = MODELS[name][1](model.parameters())
  initial = _state(model)

  def step(x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss

  loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(*_data(name)), batch_size=GLOBAL_BATCH
  )
  losses, compiles = [], []
  for x, y in strategy.experimental_distribute_dataset(loader):
    out = strategy.run(step, args=(x, y))
    losses.append(float(strategy.reduce("MEAN", out, axis=None).cpu()))
    compiles.append(rt.compile_count())
  return {
    "initial": _encode(initial),
    "final": _encode(_state(model)),
    "losses": losses,
    "compiles": compiles,
    "replicas": strategy.num_replicas_in_sync,
  }


def _train_every_model(n):
  """Every model's run on this process's `n` devices (a case that fails keeps
  its error), and the device count."""
  import xladist as xd
  from xladist import runtime as rt

  assert rt.BACKEND == "jax", rt.BACKEND
  runs = {name: (xd.MirroredStrategy, name, True) for name in MODELS}
  if n == 4:
    runs["mlp-one-device"] = (lambda: xd.OneDeviceStrategy("jax:0"), "mlp", False)
  results = {}
  for case, (make_strategy, name, sync_bn) in runs.items():
    try:  # a failing case leaves the others their results
      results[case] = _train_xladist(xd, rt, make_strategy(), name, sync_bn)
    except Exception as e:
      frames = "".join(traceback.format_tb(e.__traceback__)[-25:])
      results[case] = {"error": f"{frames}{type(e).__name__}: {str(e)[:1500]}"}
  results["num_devices"] = rt.num_devices()
  return results


def _child(n):
  print(MARK + json.dumps(_train_every_model(n)), flush=True)


# -- the tests -----------------------------------------------------------------------------


def _run_child(n):
  """A child process with `n` devices trains every model: its results."""
  import _xla_flags  # tests/ (on the path in pytest, not in the child)

  env = dict(os.environ)
  env.update(
    XLADIST_BACKEND="jax",
    JAX_PLATFORMS="cpu",
    CPU_NUM_DEVICES=str(n),
    JAX_DEFAULT_MATMUL_PRECISION="highest",
    XLADIST_COMPILE_CACHE="off",
    PYTHONPATH=os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p]),
  )
  env["XLA_FLAGS"] = _xla_flags.for_child()  # its device count: CPU_NUM_DEVICES
  # subprocess.run kills the child when the timeout expires.
  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "--child", str(n)],
    env=env,
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=CHILD_TIMEOUT_S,
  )
  lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
  assert proc.returncode == 0 and lines, (
    f"child with {n} devices failed (rc {proc.returncode}):\n"
    f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
  )
  return json.loads(lines[-1][len(MARK) :])


def _results_for(n):
  """The results for `n` devices: from this process where it has `n` devices (a
  child costs about 5 CPU-s to start), else from a child process."""
  from xladist import runtime as rt

  if rt.num_devices() == n:
    results = json.loads(json.dumps(_train_every_model(n)))  # as a child's arrive
  else:
    results = _run_child(n)
  assert results["num_devices"] == n
  return results


@pytest.fixture(scope="module")
def child_results():
  cache = {}

  def get(n):
    if n not in cache:
      try:
        cache[n] = _results_for(n)
      except BaseException as e:  # every case of this device count reports the failure
        cache[n] = e
    if isinstance(cache[n], BaseException):
      raise cache[n]
    return cache[n]

  return get


_references = {}


def _reference(name):
  """(initial state, losses, final state): plain PyTorch on the CPU, global batch."""
  if name not in _references:
    model = _make(name)
    initial = _state(model)
    opt = MODELS[name][1](model.parameters())
    x, y = _data(name)
    losses = []
    for xb, yb in zip(x.split(GLOBAL_BATCH), y.split(GLOBAL_BATCH)):
      opt.zero_grad()
      loss = F.cross_entropy(model(xb), yb)
      loss.backward()
      opt.step()
      losses.append(loss.item())
    _references[name] = (initial, torch.tensor(losses), _state(model))
  return _references[name]


CASES = [(n, name) for n in DEVICE_COUNTS for name in MODELS] + [(4, "mlp-one-device")]


@pytest.mark.parametrize("n,case", CASES, ids=[f"{n}dev-{case}" for n, case in CASES])
def test_training_matches_cpu_pytorch(child_results, n, case):
  got = child_results(n)[case]
  if "error" in got:
    pytest.fail(f"training {case} on {n} devices raised:\n{got['error']}", pytrace=False)
  name = case.removesuffix("-one-device")
  assert got["replicas"] == (1 if case.endswith("-one-device") else n)
  initial, ref_losses, ref_final = _reference(name)
  torch.testing.assert_close(_decode(got["initial"]), initial, rtol=0, atol=0)
  torch.testing.assert_close(
    torch.tensor(got["losses"]), ref_losses, **TOL, msg=lambda m: f"losses: {m}"
  )
  final = _decode(got["final"])
  assert final.keys() == ref_final.keys()
  if name == "cnn":
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= final.keys()
  for key in ref_final:
    torch.testing.assert_close(final[key], ref_final[key], **TOL, msg=lambda m: f"{key}: {m}")
  compiles = got["compiles"]
  assert len(compiles) == STEPS
  assert compiles[-1] == compiles[WARMUP_STEPS - 1], (
    f"steps {WARMUP_STEPS + 1}..{STEPS} compiled: compile_count() after each step {compiles}"
  )


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--child":
    _child(int(sys.argv[2]))
  else:
    sys.exit(f"usage: {sys.argv[0]} --child NUM_DEVICES")
