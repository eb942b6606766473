"""A character-level transformer language model, trained data-parallel with xladist.

The text is the Python standard library's own source code (found next to the
`os` module, so nothing is downloaded): the top-level `*.py` files in name
order, every tenth file held out for evaluation. Characters are the tokens
(newline, tab and printable ASCII; any other byte is one "unknown" token).

What this example shows, beyond `examples/train_digits.py`:

* A small GPT-style decoder (token and position embeddings, pre-norm blocks of
  causal self-attention and an MLP) made under `xd.MirroredStrategy().scope()`
  with AdamW and a warm-up then cosine learning-rate schedule; each step is one
  SPMD program over every replica.
* Input through `strategy.experimental_distribute_dataset(DataLoader(...))`
  with a sampler that reshuffles every epoch from (seed, epoch), so the data
  order is a function of the position alone.
* Checkpoints every `--checkpoint-every` steps with `xd.checkpoint.Checkpoint`
  and `CheckpointManager`: model, optimizer, schedule, sampler epoch, the
  distributed iterator's position in its epoch, the step counter and the random
  generators. `--resume` continues from the newest one: the same step count,
  the same next batch, and (on the same machine and versions) the same losses
  as a run that was never interrupted.
* Held-out perplexity at the end, evaluated with
  `InputOptions(experimental_partial_batch="mask")` so that every held-out
  window counts exactly once; the uniform guess over the vocabulary scores
  the vocabulary size.
* A few lines of text sampled from the trained weights on the CPU, from a
  plain `torch` copy of the model: a checkpoint's state dict needs no xladist.

Defaults finish in a few minutes on 2 CPU cores with 4 virtual XLA:CPU devices.

Run:  make charlm   (or: PYTHONPATH=. python examples/train_charlm.py [--steps 300]
                     [--resume] [--checkpoint-dir DIR] [--checkpoint-every 100])
"""

import time

T0 = time.perf_counter()  # time to first step counts from here, before the heavy imports

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import StartupClock, progress  # noqa: E402
from torch.utils.data import DataLoader, Dataset, Sampler  # noqa: E402

import xladist as xd  # noqa: E402

# Tokens: newline, tab, printable ASCII, and one token for every other byte.
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = len(CHARS)
VOCAB = len(CHARS) + 1
_TABLE = np.full(256, UNKNOWN, dtype=np.int64)
_TABLE[[ord(c) for c in CHARS]] = np.arange(len(CHARS))


def encode(text):
  """Text -> int64 token ids (one per UTF-8 byte)."""
  return torch.from_numpy(_TABLE[np.frombuffer(text.encode("utf-8"), dtype=np.uint8)])


def decode(ids):
  return "".join(CHARS[i] if i < UNKNOWN else "?" for i in ids)


def stdlib_text(max_chars, held_out):
  """(text of the kept files, number of files) from the standard library's
  top-level modules in name order: every tenth file if `held_out`, else the
  others; read until `max_chars` characters."""
  root = sysconfig.get_path("stdlib") or os.path.dirname(os.__file__)
  names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
  parts, size, used = [], 0, 0
  for i, name in enumerate(names):
    if (i % 10 == 9) != held_out:
      continue
    with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
      text = f.read()
    parts.append(text[: max_chars - size])
    size += len(parts[-1])
    used += 1
    if size >= max_chars:
      break
  if not size:
    sys.exit(f"error: found no Python sources in {root}")
  return "".join(parts), used


class Windows(Dataset):
  """Consecutive non-overlapping windows of a token stream: item i is
  (tokens[i*T : i*T+T], the same shifted by one)."""

  def __init__(self, tokens, seq_len):
    self.tokens, self.seq_len = tokens, seq_len

  def __len__(self):
    return (len(self.tokens) - 1) // self.seq_len

  def __getitem__(self, i):
    start = i * self.seq_len
    chunk = self.tokens[start : start + self.seq_len + 1]
    return chunk[:-1], chunk[1:]


class EpochShuffle(Sampler):
  """A new permutation every epoch, drawn from (seed, epoch) alone.

  The order of an epoch does not depend on how many draws came before, so a
  resumed run sees the same batches. Its epoch is checkpointed (it has
  `state_dict` / `load_state_dict`) and restored before the iterator's
  position.
  """

  def __init__(self, size, seed):
    self.size, self.seed, self.epoch = size, seed, 0

  def __len__(self):
    return self.size

  def __iter__(self):
    g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
    return iter(torch.randperm(self.size, generator=g).tolist())

  def state_dict(self):
    return {"epoch": self.epoch}

  def load_state_dict(self, state):
    self.epoch = state["epoch"]


class Block(nn.Module):
  """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

  def __init__(self, dim, heads):
    super().__init__()
    self.heads = heads
    self.ln1 = nn.LayerNorm(dim)
    self.qkv = nn.Linear(dim, 3 * dim)
    self.proj = nn.Linear(dim, dim)
    self.ln2 = nn.LayerNorm(dim)
    self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

  def forward(self, x):
    b, t, d = x.shape
    q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (b, heads, t, d / heads)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
    return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
  """(B, T) token ids -> (B, T, VOCAB) logits of the next token."""

  def __init__(self, seq_len, dim, layers, heads):
    super().__init__()
    self.embed = nn.Embedding(VOCAB, dim)
    self.position = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
    self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
    self.ln = nn.LayerNorm(dim)
    self.head = nn.Linear(dim, VOCAB)

  def forward(self, ids):
    x = self.embed(ids) + self.position[: ids.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  a = p.add_argument
  a("--steps", type=int, default=300, help="training steps in all (default 300)")
  a("--per-replica-batch", type=int, default=8, help="windows per replica per step (default 8)")
  a("--seq-len", type=int, default=64, help="characters per window (default 64)")
  a("--dim", type=int, default=128, help="model width (default 128)")
  a("--layers", type=int, default=2, help="transformer blocks (default 2)")
  a("--heads", type=int, default=4, help="attention heads (default 4)")
  a("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
  a("--warmup", type=int, default=30, help="linear warm-up steps (default 30)")
  a("--train-chars", type=int, default=1_000_000, help="training text (default 1e6 chars)")
  a("--eval-chars", type=int, default=100_000, help="held-out text (default 1e5 chars)")
  a(
    "--checkpoint-dir",
    default=os.path.join("~", ".cache", "xladist", "charlm"),
    help="where checkpoints go (default ~/.cache/xladist/charlm)",
  )
  a("--checkpoint-every", type=int, default=100, help="save every N steps (default 100)")
  a("--keep", type=int, default=3, help="checkpoints kept (default 3)")
  a("--resume", action="store_true", help="continue from the newest checkpoint, if any")
  a("--log-every", type=int, default=10, help="read the loss back every N steps (default 10)")
  a("--sample", type=int, default=300, help="characters to sample at the end (0: none)")
  a("--seed", type=int, default=0, help="seed of the weights and the data order")
  a("--summary", help="also write the results as JSON to this file")
  args = p.parse_args()
  for name in ("steps", "per_replica_batch", "seq_len", "dim", "layers", "heads", "warmup"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  for name in ("checkpoint_every", "keep", "log_every"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  if args.dim % args.heads:
    p.error("--heads must divide --dim")
  if args.lr <= 0 or args.sample < 0:
    p.error("--lr must be > 0 and --sample >= 0")
  args.checkpoint_dir = os.path.expanduser(args.checkpoint_dir)
  return args


def schedule(args):
  """Learning-rate factor of step s: linear warm-up, then cosine down to 10%."""

  def factor(s):
    if s < args.warmup:
      return (s + 1) / args.warmup
    done = min(1.0, (s - args.warmup) / max(1, args.steps - args.warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

  return factor


def sample(model, args, prompt="def ", length=300, temperature=0.8):
  """Text continued from `prompt` by a CPU copy of the model (no xladist)."""
  cpu = CharLM(args.seq_len, args.dim, args.layers, args.heads)
  cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
  cpu.eval()
  g = torch.Generator().manual_seed(args.seed)
  ids = encode(prompt).tolist()
  with torch.no_grad():
    for _ in range(length):
      logits = cpu(torch.tensor([ids[-args.seq_len :]]))[0, -1] / temperature
      ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=g)))
  return decode(ids)


def main():
  clock = StartupClock(T0)
  clock.imported()
  args = parse_args()

  strategy = xd.MirroredStrategy()  # every local XLA device
  clock.runtime_started()

  n = strategy.num_replicas_in_sync
  global_batch = n * args.per_replica_batch

  train_text, train_files = stdlib_text(args.train_chars, held_out=False)
  eval_text, eval_files = stdlib_text(args.eval_chars, held_out=True)
  train = Windows(encode(train_text), args.seq_len)
  held_out = Windows(encode(eval_text), args.seq_len)
  sampler = EpochShuffle(len(train), args.seed)
  loader = DataLoader(train, batch_size=global_batch, sampler=sampler, drop_last=True)
  if len(loader) == 0:
    sys.exit(f"error: global batch {global_batch} exceeds the {len(train)} training windows")
  train_dist = strategy.experimental_distribute_dataset(loader)
  eval_dist = strategy.experimental_distribute_dataset(
    DataLoader(held_out, batch_size=global_batch),
    xd.InputOptions(experimental_partial_batch="mask"),
  )
  print(
    f"data: {len(train_text):,} training characters from {train_files} files of the standard "
    f"library, {len(eval_text):,} held out from {eval_files} others; vocabulary {VOCAB}"
  )
  print(
    f"replicas: {n}, batch: {args.per_replica_batch} x {args.seq_len} characters per replica; "
    f"{len(loader)} steps per epoch"
  )

  with strategy.scope():
    torch.manual_seed(args.seed)
    model = CharLM(args.seq_len, args.dim, args.layers, args.heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
  scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args))
  params = sum(p.numel() for p in model.parameters())
  print(f"model: {args.layers} blocks, width {args.dim}, {args.heads} heads, {params:,} parameters")

  iterator = iter(train_dist)
  ckpt = xd.checkpoint.Checkpoint(
    model=model,
    optimizer=optimizer,
    scheduler=scheduler,
    sampler=sampler,
    iterator=iterator,
    step=0,
  )
  manager = xd.checkpoint.CheckpointManager(ckpt, args.checkpoint_dir, max_to_keep=args.keep)
  resumed_from = None
  if args.resume:
    if manager.restore_or_initialize() is not None:
      resumed_from = ckpt.step
      print(f"resumed from {manager.latest_checkpoint} at step {ckpt.step}")
    else:
      print(f"no checkpoint in {args.checkpoint_dir}: starting at step 0")
  elif manager.latest_checkpoint is not None:
    sys.exit(
      f"error: {args.checkpoint_dir} holds checkpoints of an earlier run (newest: "
      f"{manager.latest_checkpoint}); pass --resume to continue it, or choose another "
      "--checkpoint-dir (or delete that one) to start again"
    )
  step = ckpt.step

  def train_step(x, y):
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # gradients are mean-all-reduced across replicas first
    return loss

  def eval_step(inputs, mask):
    x, y = inputs
    with torch.no_grad():
      logits = model(x)
    nll = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
    per_window = nll.reshape(y.shape).sum(dim=1)
    return (per_window * mask).sum(), mask.sum() * y.shape[1]

  def zeros():
    # Accumulators already on the device: every step's graph is the same.
    return strategy.extended.broadcast_to(torch.zeros(()), strategy.extended.worker_devices[0])

  # -- training ---------------------------------------------------------------------
  bar = progress(args.steps, "train", initial=step)
  window, window_steps, loss = zeros(), 0, None
  saved = []
  while step < args.steps:
    try:
      x, y = next(iterator)
    except StopIteration:  # a new epoch, in a new order
      sampler.epoch += 1
      iterator = ckpt.iterator = iter(train_dist)
      continue
    loss = strategy.reduce("mean", strategy.run(train_step, args=(x, y)), axis=None)
    scheduler.step()
    window = window + loss  # the next strategy.run ends this step
    step += 1
    window_steps += 1
    if "first_step" not in clock.marks:
      loss.item()  # a read: waits until the first step has finished
      clock.first_step_done()
    if step % args.log_every == 0 or step == args.steps:
      bar.set_postfix(loss=f"{window.item() / window_steps:.3f}")
      window, window_steps = zeros(), 0
    if step % args.checkpoint_every == 0 or step == args.steps:
      ckpt.step = step
      saved.append(manager.save(checkpoint_number=step))
    bar.update(1)
  bar.close()
  counts = strategy.extended.experimental_replay_counts  # the training steps'
  if "first_step" in clock.marks:
    print(clock.report())
  for path in saved:
    print(f"checkpoint: {path}")

  # -- held-out perplexity: every window once, the last batch's padding masked out --
  total_nll, total_tokens = zeros(), zeros()
  for inputs, mask in eval_dist:
    nll, tokens = strategy.run(eval_step, args=(inputs, mask))
    total_nll = total_nll + strategy.reduce("sum", nll, axis=None)
    total_tokens = total_tokens + strategy.reduce("sum", tokens, axis=None)
  tokens = int(total_tokens.item())
  perplexity = math.exp(total_nll.item() / tokens)
  final_loss = loss.item() if loss is not None else None
  if final_loss is not None:
    print(f"step {step}: training loss {final_loss:.4f}")
  print(
    f"held-out perplexity: {perplexity:.2f} over {tokens:,} characters "
    f"(uniform over the vocabulary: {VOCAB})"
  )
  if args.sample:
    print("sample:")
    print(sample(model, args, length=args.sample))
  print(
    f"training steps: {counts['traced']} traced, {counts['replayed']} replayed "
    "(a replayed step runs its compiled program without tracing train_step)"
  )
  print(f"time (start to end): {time.perf_counter() - T0:.1f} s")
  if args.summary:
    with open(args.summary, "w") as f:
      json.dump(
        {
          "step": step,
          "resumed_from": resumed_from,
          "final_loss": final_loss,
          "perplexity": perplexity,
          "eval_tokens": tokens,
          "vocab": VOCAB,
          "checkpoints_saved": saved,
          "checkpoints_kept": manager.checkpoints,
          "steps_traced": counts["traced"],
          "steps_replayed": counts["replayed"],
        },
        f,
        indent=2,
      )
  manager.close()


if __name__ == "__main__":
  main()
