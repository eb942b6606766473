"""The model, data and loops of the sharded-state tests (tests/shared/test_sharded_state.py,
tests/test_checkpoint_sharded.py): MirroredStrategy over 4 replicas, with or
without `experimental_sharding`, on the runtime the suite runs."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import xladist as xd
from xladist.experimental import ShardingOptions

N, B, T, VOCAB = 4, 4, 5, 11
LEVELS = ("optimizer_state", "gradients", "parameters")


class Model(nn.Module):
  """Tokens -> embedding (tied to the output head) -> Linear 6->33 (uneven),
  BatchNorm, a frozen Linear 33->33, Linear 33->6 -> head (the embedding's weight)."""

  def __init__(self, bn=True):
    super().__init__()
    self.emb = nn.Embedding(VOCAB, 6)
    self.body = nn.Linear(6, 33, bias=not bn)  # a bias before batch norm has no gradient
    self.bn = nn.BatchNorm1d(33) if bn else nn.Identity()
    self.frozen = nn.Linear(33, 33)
    self.frozen.requires_grad_(False)
    self.out = nn.Linear(33, 6)
    self.head = nn.Linear(6, VOCAB, bias=False)
    self.head.weight = self.emb.weight

  def forward(self, tokens):
    x = self.emb(tokens).mean(1)
    h = torch.tanh(self.bn(self.body(x)))
    h = h + 0.1 * self.frozen(h)
    return self.head(self.out(h))


def make_model(bn=True):
  torch.manual_seed(0)
  return Model(bn)


def make_adamw(model):
  decay = [model.body.weight, model.out.weight, model.emb.weight]
  rest = [model.out.bias, model.bn.weight, model.bn.bias]
  return torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3, "weight_decay": 0.0}],
    lr=1e-2,
  )


def make_data(steps):
  g = torch.Generator().manual_seed(1)
  return [
    (
      torch.randint(0, VOCAB, (N * B, T), generator=g),
      torch.randint(0, VOCAB, (N * B,), generator=g),
    )
    for _ in range(steps)
  ]


def split(strategy, t):
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: t[ctx.replica_id_in_sync_group * B : (ctx.replica_id_in_sync_group + 1) * B]
  )


def make_strategy(level):
  sharding = None if level is None else ShardingOptions(shard=level, min_shard_bytes=0)
  strategy = xd.MirroredStrategy(experimental_sharding=sharding)
  assert strategy.num_replicas_in_sync == N
  return strategy


def state_tensors(model, opt):
  """The model's and the optimizer's state dicts, whole tensors on the host."""
  out = {f"model.{k}": v.detach().cpu() for k, v in model.state_dict().items()}
  for i, state in opt.state_dict()["state"].items():
    for k, v in state.items():
      if torch.is_tensor(v):
        out[f"opt.{i}.{k}"] = v.detach().cpu()
  return out


def assert_equal_by_scale(got, want, tol=1e-5):
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
    scale = max(want[k].double().abs().max().item(), 1e-6)
    diff = (got[k].double() - want[k].double()).abs().max().item()
    assert diff <= tol * scale, f"{k}: {diff:.3g} > {tol} x {scale:.3g}"


def adamw_loop(level, steps=20):
  """AdamW (two groups) + cosine schedule + clip_grad_norm_, `steps` steps.
  Returns the losses, the final tensors, the replay counts (with "compiles_after_8":
  the compilations after step 8) and (model, optimizer, scheduler, strategy)."""
  strategy = make_strategy(level)
  with strategy.scope():
    model = make_model()
    opt = make_adamw(model)
  sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
  step = adamw_step(model, opt)
  losses, compiled = [], None
  for i, (x, y) in enumerate(make_data(steps)):
    out = strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    sched.step()
    losses.append(strategy.reduce("mean", out, axis=None).cpu())
    if i + 1 == 8:
      compiled = strategy.extended.experimental_compile_count
  counts = dict(strategy.extended.experimental_replay_counts)
  if compiled is not None:
    counts["compiles_after_8"] = strategy.extended.experimental_compile_count - compiled
  return torch.stack(losses), state_tensors(model, opt), counts, (model, opt, sched, strategy)


def adamw_step(model, opt):
  """The step function of the AdamW loop (clipping at 0.5)."""

  def step(tokens, targets):
    loss = F.cross_entropy(model(tokens), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return loss

  return step


def continue_adamw(strategy, model, opt, sched, data):
  step = adamw_step(model, opt)

  losses = []
  for x, y in data:
    out = strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    sched.step()
    losses.append(strategy.reduce("mean", out, axis=None).cpu())
  return torch.stack(losses)
