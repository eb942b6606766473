"""Models, data and training loops shared by the tests and the device-count worker.

The reference is plain PyTorch on the CPU trained on the global batch; xladist
trains the same initial weights with each replica on its slice of the batch.
"""

import torch
import torch.nn.functional as F

STEPS = 20
PER_REPLICA_BATCH = 3
LR = 0.1
MOMENTUM = 0.9


def make_mlp():
  return torch.nn.Sequential(
    torch.nn.Linear(12, 32),
    torch.nn.Tanh(),
    torch.nn.Linear(32, 32),
    torch.nn.Tanh(),
    torch.nn.Linear(32, 5),
  )


def make_cnn():
  return torch.nn.Sequential(
    torch.nn.Conv2d(1, 4, 3, padding=1),
    torch.nn.ReLU(),
    torch.nn.Conv2d(4, 8, 3),
    torch.nn.ReLU(),
    torch.nn.Flatten(),
    torch.nn.Linear(8 * 6 * 6, 5),
  )


def make_small_mlp():
  return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


MODELS = {
  "mlp": (make_mlp, (12,)),
  "cnn": (make_cnn, (1, 8, 8)),
  "small-mlp": (make_small_mlp, (8,)),
}


def make_data(kind, num_replicas, steps=STEPS, b=PER_REPLICA_BATCH, seed=1):
  """`steps` global batches of num_replicas * b examples."""
  _, shape = MODELS[kind]
  g = torch.Generator().manual_seed(seed)
  n = num_replicas * b
  xs = [torch.randn((n,) + shape, generator=g) for _ in range(steps)]
  ys = [torch.randint(0, 5, (n,), generator=g) for _ in range(steps)]
  return xs, ys


def initial_state(kind, seed=0):
  torch.manual_seed(seed)
  return MODELS[kind][0]().state_dict()


def train_reference(kind, state, xs, ys):
  """Plain PyTorch on the CPU, global batch; returns (losses, final state)."""
  model = MODELS[kind][0]()
  model.load_state_dict(state)
  opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
  losses = []
  for x, y in zip(xs, ys):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.detach())
  return torch.stack(losses), {k: v.detach().clone() for k, v in model.state_dict().items()}


def split(strategy, global_batch):
  """A PerReplica with rows [r*b, (r+1)*b) of the global batch on replica r."""
  n = strategy.num_replicas_in_sync
  b = global_batch.shape[0] // n
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: global_batch[
      ctx.replica_id_in_sync_group * b : (ctx.replica_id_in_sync_group + 1) * b
    ]
  )


def build_xladist(strategy, kind, state):
  with strategy.scope():
    model = MODELS[kind][0]()
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
  return model, opt


def make_step(model, opt, forward=None):
  """One SGD step; `forward(x)` (default `model(x)`) computes the logits."""
  forward = model if forward is None else forward

  def step(x, y):
    loss = F.cross_entropy(forward(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

  return step


def train_xladist(strategy, kind, state, xs, ys, on_step=None, make_forward=None):
  """Trains with strategy.run; returns (per-step mean losses, final CPU state).

  `make_forward(model)`, if given, returns the step's forward function (see make_step).
  """
  from xladist.runtime import xla as _runtime

  model, opt = build_xladist(strategy, kind, state)
  step = make_step(model, opt, make_forward(model) if make_forward else None)
  losses = []
  for i, (x, y) in enumerate(zip(xs, ys)):
    out = strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    losses.append(strategy.reduce("mean", out, axis=None))
    _runtime.sync()
    if on_step is not None:
      on_step(i)
  losses = torch.stack([l.cpu() for l in losses])
  return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_close_to_scale(actual, expected, tol, where="value"):
  """torch.testing.assert_close, each element within `tol` times the largest
  magnitude of its reference tensor: |a - e| <= tol * max|e| (rtol=0), per
  tensor of a state dict (the keys of `expected`).

  This is the tolerance of a whole training run: float32 rounding drifts by an
  amount set by a tensor's scale, so parameters near zero carry the same
  absolute error as the large ones and a purely element-wise rtol would fail on
  them. (The check these tests made before, max|a - e| / max|e| < tol, is the
  same condition.)
  """
  if isinstance(expected, dict):
    for key, value in expected.items():
      assert_close_to_scale(actual[key], value, tol, f"{where}[{key!r}]")
    return
  scale = float(expected.detach().double().abs().max().clamp_min(1e-12))
  torch.testing.assert_close(
    actual, expected, rtol=0, atol=tol * scale, msg=lambda m: f"{where}: {m}"
  )
