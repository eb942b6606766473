"""A Hugging Face causal language model, trained data-parallel with xladist.

The model is what a transformers user writes: `AutoConfig.for_model(...)` of a
tiny GPT-2 or Llama and `AutoModelForCausalLM.from_config` (no download), trained
with `torch.optim.AdamW`, transformers' `get_linear_schedule_with_warmup` and
`clip_grad_norm_`, its loss the model's own (`model(input_ids=..., labels=...)`).
Nothing in the step is xladist's but `strategy.run`: the same loop runs on one
device without it. The text is the Python standard library's own sources (read
from disk, as examples/train_charlm.py does), one token per character.

It prints the loss as it trains and, at the end, how many steps were traced and
how many replayed (a promoted step runs its compiled program without tracing the
model's Python again). Runs on either runtime: XLADIST_BACKEND=jax picks the jax
runtime (its own environment, `make venv-jax`).

Run:  PYTHONPATH=. python examples/train_hf_causal_lm.py [--model llama] [--steps 60]
"""

import argparse
import json
import math

import torch
import transformers
from torch.utils.data import DataLoader
from train_charlm import VOCAB, Windows, encode, stdlib_text

import xladist as xd

_CONFIGS = {
  "gpt2": lambda a: dict(
    n_positions=a.seq_len,
    n_embd=a.dim,
    n_layer=a.layers,
    n_head=a.heads,
    bos_token_id=0,
    eos_token_id=0,
  ),
  "llama": lambda a: dict(
    max_position_embeddings=a.seq_len,
    hidden_size=a.dim,
    intermediate_size=4 * a.dim,
    num_hidden_layers=a.layers,
    num_attention_heads=a.heads,
  ),
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  a = p.add_argument
  a("--model", choices=sorted(_CONFIGS), default="gpt2")
  a("--steps", type=int, default=60)
  a("--per-replica-batch", type=int, default=8)
  a("--seq-len", type=int, default=64)
  a("--dim", type=int, default=64)
  a("--layers", type=int, default=2)
  a("--heads", type=int, default=4)
  a("--lr", type=float, default=3e-3)
  a("--warmup", type=int, default=6)
  a("--chars", type=int, default=200_000, help="characters of text to train on")
  a("--log-every", type=int, default=10)
  a("--summary", help="also write the results as JSON to this file")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  torch.manual_seed(0)
  strategy = xd.MirroredStrategy()
  n = strategy.num_replicas_in_sync
  text, _ = stdlib_text(args.chars, held_out=False)
  loader = DataLoader(
    Windows(encode(text), args.seq_len),
    batch_size=n * args.per_replica_batch,
    shuffle=True,
    drop_last=True,
    generator=torch.Generator().manual_seed(0),
  )
  with strategy.scope():
    config = transformers.AutoConfig.for_model(
      args.model, vocab_size=VOCAB, **_CONFIGS[args.model](args)
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
  schedule = transformers.get_linear_schedule_with_warmup(optimizer, args.warmup, args.steps)

  def train_step(inputs, _targets):
    loss = model(input_ids=inputs, labels=inputs).loss  # the model shifts the labels
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss

  print(
    f"{args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, "
    f"{n} replicas x {args.per_replica_batch} windows of {args.seq_len} characters"
  )
  losses, step = [], 0
  while step < args.steps:
    for inputs, targets in strategy.experimental_distribute_dataset(loader):
      per_replica = strategy.run(train_step, args=(inputs, targets))
      schedule.step()
      step += 1
      if step % args.log_every == 0 or step in (1, args.steps):
        loss = strategy.reduce("mean", per_replica, axis=None).item()
        losses.append((step, loss))
        print(f"step {step:4d}  loss {loss:.3f}  lr {schedule.get_last_lr()[0]:.2e}", flush=True)
      if step == args.steps:
        break
  counts = strategy.extended.experimental_replay_counts
  print(
    f"steps traced {counts['traced']}, replayed {counts['replayed']}; "
    f"loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f} (uniform guess: {math.log(VOCAB):.3f})"
  )
  if args.summary:
    with open(args.summary, "w") as f:
      json.dump({"losses": losses, "traced": counts["traced"], "replayed": counts["replayed"]}, f)


if __name__ == "__main__":
  main()
