"""ZeRO-3 units (issue 60, xladist/sharded_units.py), on the runtime the suite runs:
under `ShardingOptions(shard="parameters")` a unit's parameters are gathered when
its forward begins and gathered again in its backward, so that no whole copy of
the model lives through the step. What the step computes must not change: each
loop is compared with MirroredStrategy without sharding (the reference of
tests/shared/test_sharded_state.py, which TF's own sharded variables do not
have: tf.distribute's ZeRO-like path is ParameterServerStrategy's
`variable_partitioner`, whose variables are whole when read, as here).

The model mixes what units meet in users' models: a weight tied across units
(an embedding and its output head), a module called twice in one forward, blocks
grouped as units (`units=(Block,)`, or a predicate), a frozen block, activation
checkpointing inside a unit (`torch.utils.checkpoint`, reentrant and not), and
a parameter read by the step function outside any module (an L2 term).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _sharding import B, N, assert_equal_by_scale, split, state_tensors
from torch.utils.checkpoint import checkpoint

import xladist as xd
from xladist import sharded_state
from xladist.experimental import ShardingOptions

T, V, D = 3, 13, 8  # B rows per replica, N replicas: tests/_sharding.py's


class Block(nn.Module):
  def __init__(self, ckpt=None):
    super().__init__()
    self.norm = nn.LayerNorm(D)
    self.fc1 = nn.Linear(D, 2 * D)
    self.fc2 = nn.Linear(2 * D, D)
    self.ckpt = ckpt  # None, "reentrant" or "non-reentrant"

  def mlp(self, h):
    return self.fc2(torch.tanh(self.fc1(h)))

  def forward(self, h):
    y = self.norm(h)
    if self.ckpt is None:
      y = self.mlp(y)
    else:
      y = checkpoint(self.mlp, y, use_reentrant=self.ckpt == "reentrant")
    return h + y


class Net(nn.Module):
  def __init__(self, ckpt=None):
    super().__init__()
    self.emb = nn.Embedding(V, D)
    self.shared = nn.Linear(D, D)  # called twice in one forward
    self.blocks = nn.ModuleList([Block(ckpt), Block(ckpt), Block()])
    self.blocks[2].requires_grad_(False)  # a frozen unit
    self.head = nn.Linear(D, V, bias=False)
    self.head.weight = self.emb.weight  # tied across two units

  def forward(self, tokens):
    h = self.shared(self.emb(tokens).mean(1))
    for block in self.blocks:
      h = block(h)
    return self.head(torch.tanh(self.shared(h)))


def _data(steps):
  g = torch.Generator().manual_seed(3)
  return [
    (torch.randint(0, V, (N * B, T), generator=g), torch.randint(0, V, (N * B,), generator=g))
    for _ in range(steps)
  ]


def _loop(sharding, steps=8, ckpt=None):
  """AdamW + cosine + clip_grad_norm_ and an L2 term on one weight read outside
  any module; the final tensors (whole, on the host), the losses and the counts."""
  strategy = xd.MirroredStrategy(experimental_sharding=sharding)
  assert strategy.num_replicas_in_sync == N
  with strategy.scope():
    torch.manual_seed(0)
    model = Net(ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
  sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
  l2 = model.blocks[0].fc1.weight

  def step(tokens, targets):
    loss = F.cross_entropy(model(tokens), targets) + 1e-3 * l2.square().sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return loss

  losses = []
  for x, y in _data(steps):
    out = strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    sched.step()
    losses.append(strategy.reduce("mean", out, axis=None).cpu())
  state = state_tensors(model, opt)
  return torch.stack(losses), state, dict(strategy.extended.experimental_replay_counts)


@pytest.fixture(scope="module")
def mirrored():
  return _loop(None)


def _parameters(units=None):
  return ShardingOptions(shard="parameters", min_shard_bytes=0, units=units)


@pytest.mark.parametrize(
  "units, ckpt",
  [
    (None, None),  # every module with parameters is a unit
    ((Block,), "non-reentrant"),
    (lambda m: isinstance(m, Block), "reentrant"),
  ],
  ids=["own-parameters", "block-class+checkpoint", "predicate+reentrant-checkpoint"],
)
def test_units_train_as_mirrored(units, ckpt, mirrored):
  want_losses, want, _ = mirrored
  losses, got, counts = _loop(_parameters(units), ckpt=ckpt)
  torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
  assert_equal_by_scale(got, want)
  assert counts["traced"] + counts["replayed"] == 8
  assert counts["traced"] <= 4, counts  # the unsharded loop's 3, or one more (a new key)


@pytest.fixture
def gathers(monkeypatch):
  """The gathers of sharded parameters: (in backward, number of tensors) per call."""
  calls = []
  real = sharded_state.gather

  def counting(rows, layouts, region):
    calls.append((torch._C._current_graph_task_id() != -1, len(rows)))
    return real(rows, layouts, region)

  monkeypatch.setattr(sharded_state, "gather", counting)
  return calls


@pytest.mark.parametrize("units", [None, (Block,)], ids=["own-parameters", "block-class"])
def test_each_unit_is_gathered_when_it_runs_and_again_in_backward(units, gathers):
  """One traced step: the step's start gathers every sharded parameter once (for
  the step's own code: unused values, which XLA drops), then each unit call
  gathers its parameters, and backward gathers again, once per call whose
  backward formulas saved a weight: `shared`, called twice, twice."""
  _loop(_parameters(units), steps=1)
  forward = [n for back, n in gathers if not back]
  backward = [n for back, n in gathers if back]
  assert forward[0] == 21, forward  # every parameter tensor (the tied weight once)
  if units is None:
    # emb (1 tensor), shared x2 (2), 3 blocks x (norm, fc1, fc2: 2 each), head (1).
    assert forward[1:] == [1, 2] + [2] * 9 + [2, 1], forward
    # shared's two calls and the nine block modules again (each 2 tensors).
    assert backward.count(2) == 11, backward
  else:
    # A block is one unit: one gather of its six tensors (norm, fc1, fc2).
    assert forward[1:] == [1, 2, 6, 6, 6, 2, 1], forward
    assert sorted(n for n in backward if n > 1) == [2, 2, 6, 6, 6], backward


def _penalty_loop(sharding, steps=2):
  """A gradient penalty (WGAN-GP's form): the squared norm of the loss's gradient
  with respect to a hidden activation, `create_graph=True`, added to the loss; its
  gradient reaches the weights through the first backward's use of them."""
  strategy = xd.MirroredStrategy(experimental_sharding=sharding)
  with strategy.scope():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

  def step(tokens, targets):
    h = model.shared(model.emb(tokens).mean(1))
    for block in model.blocks:
      h = block(h)
    loss = F.cross_entropy(model.head(torch.tanh(model.shared(h))), targets)
    (g,) = torch.autograd.grad(loss, [h], create_graph=True)
    (loss + 10.0 * g.square().sum()).backward()
    opt.step()
    opt.zero_grad()

  for x, y in _data(steps):
    strategy.run(step, args=(split(strategy, x), split(strategy, y)))
  return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_a_gradient_penalty_differentiates_through_the_weights():
  """backward(create_graph=True) through weights gathered again: autograd gives
  the unpacked whole value the parameter's own place in the graph (a saved
  tensor hook's result is attached to the saved tensor's gradient accumulator),
  so the penalty's gradient with respect to the weights is as without sharding."""
  assert_equal_by_scale(_penalty_loop(_parameters((Block,))), _penalty_loop(None))
