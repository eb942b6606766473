"""Outside a step, torch is plain torch: what users do after making a strategy.

A user makes the strategy first and then imports libraries (torchvision, and
transformers, which imports torchvision lazily when a model class is first
touched), registers custom ops, builds CPU models, loads data and computes metrics.
All of it must behave exactly as in a process without xladist. On the jax runtime
the runtime enables torchax's modes for the whole process, so this is not a given:
`import torchvision` after `xd.MirroredStrategy()` raised `OperatorNotFound:
torchvision::_cuda_version has no lowering` (torchax fix 14).

One child process per case pair (a fresh interpreter, so that the import really comes
after the strategy): the child prints what it computed with the strategy made first;
the test computes the same in a child without xladist and compares.
"""

import json
import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
  """
  import json, sys
  import torch
  if sys.argv[1] == "xladist":
    import xladist as xd
    strategy = xd.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 4
  out = {}

  # a custom op with no tensor argument, and one of a CPU tensor
  lib = torch.library.Library("xdtest", "DEF")
  lib.define("answer() -> int")
  lib.impl("answer", lambda: 42, "CompositeExplicitAutograd")
  lib.define("twice(Tensor x) -> Tensor")
  lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
  out["answer"] = torch.ops.xdtest.answer()
  t = torch.ops.xdtest.twice(torch.arange(3.0))
  out["twice"] = [t.tolist(), t.device.type, type(t).__name__]

  import torchvision  # runs torchvision::_cuda_version
  torch.manual_seed(0)
  net = torchvision.models.resnet18(num_classes=3).eval()
  x = torch.randn(2, 3, 32, 32)
  with torch.no_grad():
    y = net(x)
  out["resnet"] = [y.double().sum().item(), y.device.type, type(y).__name__]
  boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]])
  keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)
  out["nms"] = keep.tolist()

  import transformers  # its model classes import torchvision lazily
  torch.manual_seed(0)
  config = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2)
  lm = transformers.GPT2LMHeadModel(config)
  ids = torch.randint(0, 50, (2, 8))
  loss = lm(input_ids=ids, labels=ids).loss
  loss.backward()
  out["gpt2"] = [loss.item(), lm.transformer.wte.weight.grad.double().norm().item()]

  # data loading and a metric on the host
  data = torch.utils.data.TensorDataset(torch.arange(10.0).reshape(5, 2), torch.arange(5))
  batches = [b[0].sum().item() for b in torch.utils.data.DataLoader(data, batch_size=2)]
  out["loader"] = batches
  pred, label = torch.tensor([0, 1, 1, 2]), torch.tensor([0, 1, 2, 2])
  out["accuracy"] = (pred == label).float().mean().item()
  print("RESULT " + json.dumps(out))
  """
)


def _run(mode):
  env = dict(os.environ)
  proc = subprocess.run(
    [sys.executable, "-c", _CHILD, mode],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
  assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
  return json.loads(line[-1][len("RESULT ") :])


def test_libraries_imported_after_the_strategy_behave_as_without_xladist():
  got, want = _run("xladist"), _run("plain")
  assert got["answer"] == want["answer"] == 42
  assert got["twice"] == want["twice"] == [[0.0, 2.0, 4.0], "cpu", "Tensor"]
  assert got["resnet"][1:] == ["cpu", "Tensor"]
  assert abs(got["resnet"][0] - want["resnet"][0]) <= 1e-5 * max(1.0, abs(want["resnet"][0]))
  assert got["nms"] == want["nms"] == [0, 2]
  assert got["gpt2"] == want["gpt2"]
  assert got["loader"] == want["loader"] == [6.0, 22.0, 17.0]
  assert got["accuracy"] == want["accuracy"] == 0.75
