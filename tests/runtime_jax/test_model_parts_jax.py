"""Issue 34's model parts on the jax runtime: each trains like plain CPU torch.

Each model (nn.EmbeddingBag beside nn.Embedding(padding_idx=0); weight_norm'd
linear layers; Conv2d + GroupNorm + AvgPool2d + LayerNorm) trains `STEPS` SGD
steps with `xd.MirroredStrategy` on 4 replicas (conftest.py's 4 virtual CPU
devices), a global batch of `GLOBAL_BATCH` rows split by
`strategy.experimental_distribute_dataset`, and is compared with the same model
trained by plain PyTorch on the CPU on the whole global batch: losses
(`strategy.reduce(MEAN)`), parameters and buffers to 1e-5. These failed before
torchax fixes 8-10 (xladist/runtime/torchax_fixes.py), which
tests/runtime_jax/test_torchax_fixes.py checks op by op. A step under
`torch.autocast("jax", torch.bfloat16)` (fix 12) trains like CPU torch's bf16
autocast, to bf16's precision.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xladist as xd
from xladist import runtime

pytestmark = pytest.mark.skipif(
  runtime.BACKEND != "jax", reason="tests/runtime_jax runs on the jax runtime (make test-jax)"
)

REPLICAS = 4
GLOBAL_BATCH = 8
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-5)


class _Bags(nn.Module):
  """The issue's embedding model: a mean EmbeddingBag beside a padded Embedding."""

  def __init__(self):
    super().__init__()
    self.bag = nn.EmbeddingBag(20, 8, mode="mean")
    self.emb = nn.Embedding(20, 8, padding_idx=0)
    self.out = nn.Linear(16, 5)

  def forward(self, tokens):
    return self.out(torch.cat([self.bag(tokens), self.emb(tokens).mean(1)], -1))


def _weight_norm_mlp():
  wn = nn.utils.parametrizations.weight_norm
  return nn.Sequential(wn(nn.Linear(6, 16)), nn.Tanh(), wn(nn.Linear(16, 5), dim=None))


def _conv_norms():
  return nn.Sequential(
    nn.Conv2d(1, 4, 3, padding=1),
    nn.GroupNorm(2, 4),
    nn.ReLU(),
    nn.AvgPool2d(2),
    nn.Flatten(),
    nn.LayerNorm(4 * 4 * 4),
    nn.Linear(64, 5),
  )


def _tokens(g, n):
  t = torch.randint(1, 20, (n, 7), generator=g)
  t[:, -2:] = 0  # padding at the end of every row
  return t


MODELS = {
  "embedding_bag": (_Bags, _tokens),
  "weight_norm": (_weight_norm_mlp, lambda g, n: torch.randn(n, 6, generator=g)),
  "conv_groupnorm_avgpool_layernorm": (
    _conv_norms,
    lambda g, n: torch.randn(n, 1, 8, 8, generator=g),
  ),
}


def _data(name):
  g = torch.Generator().manual_seed(1)
  n = STEPS * GLOBAL_BATCH
  return MODELS[name][1](g, n), torch.randint(0, 5, (n,), generator=g)


def _state(model):
  return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _step(model, opt, x, y, autocast=None):
  opt.zero_grad()
  if autocast:
    with torch.autocast(autocast, dtype=torch.bfloat16):
      out = model(x)
  else:
    out = model(x)
  loss = F.cross_entropy(out.float(), y)
  loss.backward()
  opt.step()
  return loss


def _reference(name, autocast=None):
  torch.manual_seed(0)
  model = MODELS[name][0]()
  initial = _state(model)
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  x, y = _data(name)
  losses = [
    _step(model, opt, xb, yb, autocast).item()
    for xb, yb in zip(x.split(GLOBAL_BATCH), y.split(GLOBAL_BATCH))
  ]
  return initial, losses, _state(model)


@pytest.fixture(scope="module")
def strategy():
  s = xd.MirroredStrategy()
  assert s.num_replicas_in_sync == REPLICAS
  return s


def _assert_trains_like(strategy, name, initial, want_losses, want, tol, autocast=None, **options):
  with strategy.scope():
    model = MODELS[name][0]()
    model.load_state_dict(initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
  loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(*_data(name)), batch_size=GLOBAL_BATCH
  )
  run_options = xd.RunOptions(**options) if options else None
  losses = []
  for x, y in strategy.experimental_distribute_dataset(loader):
    per_replica = strategy.run(
      lambda x, y: _step(model, opt, x, y, autocast), args=(x, y), options=run_options
    )
    losses.append(float(strategy.reduce("MEAN", per_replica, axis=None).cpu()))
  torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **tol)
  got = _state(model)
  assert got.keys() == want.keys()
  for key, value in want.items():
    torch.testing.assert_close(got[key], value, **tol, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trains_like_cpu_torch(strategy, name):
  initial, want_losses, want = _reference(name)
  _assert_trains_like(strategy, name, initial, want_losses, want, TOL)


BF16_TOL = dict(rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("replay", [False, True], ids=["traced", "replay_on"])
def test_bfloat16_autocast_trains_like_cpu_autocast(strategy, replay):
  name = "conv_groupnorm_avgpool_layernorm"
  initial, want_losses, want = _reference(name, autocast="cpu")
  _assert_trains_like(
    strategy,
    name,
    initial,
    want_losses,
    want,
    BF16_TOL,
    autocast=runtime.DEVICE_KIND,
    experimental_replay=replay,
  )
