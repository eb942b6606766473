"""Any order of CPU autograd and strategies in one process (issue 34).

torch's autograd engine sizes its per-device worker queues at the first
backward of a process, from the device types registered then; a CPU
`loss.backward()` before torch_xla was imported (a notebook's sanity check)
left XLA without a queue, and every later xladist backward failed an internal
assert in engine.cpp. The process below runs a CPU backward before importing
xladist, then trains under MirroredStrategy and OneDeviceStrategy, and checks
the weights against CPU torch.
"""

import os
import subprocess
import sys
import textwrap

CHILD_TIMEOUT_S = 240
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent(
  """
  import torch
  import torch.nn.functional as F

  torch.manual_seed(0)
  sanity = torch.nn.Linear(3, 1)
  sanity(torch.randn(4, 3)).sum().backward()  # CPU autograd first: the engine starts

  import xladist as xd
  from xladist import runtime

  def train(strategy, per_replica):
    torch.manual_seed(1)
    ref = torch.nn.Linear(6, 2)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    x, y = torch.randn(8, 6), torch.randint(0, 2, (8,))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
      opt.zero_grad(); F.cross_entropy(ref(x), y).backward(); opt.step()
    with strategy.scope():
      model = torch.nn.Linear(6, 2)
      model.load_state_dict(init)
      o = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x, y):
      o.zero_grad()
      F.cross_entropy(model(x), y).backward()
      o.step()

    def part(t):
      def rows(c):
        r = c.replica_id_in_sync_group
        return t[r * per_replica:(r + 1) * per_replica]

      return strategy.experimental_distribute_values_from_function(rows)

    for _ in range(2):
      strategy.run(step, args=(part(x), part(y)))
      runtime.sync()
    for k, v in model.state_dict().items():
      torch.testing.assert_close(v.detach().cpu(), ref.state_dict()[k], rtol=1e-5, atol=1e-6)

  train(xd.MirroredStrategy(), 2)
  train(xd.OneDeviceStrategy(), 8)
  sanity(torch.randn(4, 3)).sum().backward()  # and CPU autograd after, again
  print("TRAINED-EQUAL")
  """
)


def test_cpu_backward_before_xladist_then_training():
  env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=REPO)
  proc = subprocess.Popen(
    [sys.executable, "-c", CHILD],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=30)
  assert proc.returncode == 0, out[-3000:]
  assert "TRAINED-EQUAL" in out
