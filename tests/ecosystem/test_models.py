"""Models users bring from the ecosystem train under a strategy as in plain PyTorch.

Hugging Face transformers (GPT-2, Llama through `AutoModelForCausalLM.from_config`,
BERT for sequence classification, T5), torchvision (ResNet-18, MobileNetV3-small,
VisionTransformer) and timm (ConvNeXt-atto, ViT-tiny with drop-path 0), in tiny
configurations (no download), each trained `STEPS` steps on 4 replicas of 2 rows with
`xd.MirroredStrategy` (replay on, the default) in two loops: SGD with momentum, and
AdamW with transformers' linear warm-up/decay schedule and `clip_grad_norm_`.

The reference is DDP-style plain PyTorch on the CPU in float64: each replica's rows
are a forward and backward of their own (BatchNorm sees its replica's rows), the
gradients are averaged (the strategy's default MEAN aggregation). float32 is not
exact, and a BatchNorm network on 2 rows per replica is chaotic (float32 PyTorch
itself moves 10-35 % of a tensor's scale from float64 in a few steps), so the bound
is float32 PyTorch's own distance from float64, run the same way: each step's loss
is within `FACTOR` times float32's largest loss distance up to that step, and the
parameters' largest distance (relative to each tensor's scale) within `FACTOR` times
float32's, or `FLOOR` where float32 lands closer than that.

TF's counterpart: tensorflow/python/distribute/custom_training_loop_models_test.py
(KerasModelsTest) trains Keras models under each strategy with a custom loop; here
the models are the ones PyTorch users train. Run by `make test-ecosystem` (which
.ci/run runs after `make test`) on torch_xla and on the jax runtime (jax 0.10.2), one
process per runtime; `make test` runs this folder's other tests in every environment.
"""

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
import transformers

import xladist as xd
from xladist import runtime as _runtime

N, B, STEPS = 4, 2, 4
FACTOR, FLOOR = 4.0, 2e-5
VOCAB, SEQ, CLASSES = 64, 8, 5


def _gpt2():
  config = transformers.GPT2Config(
    vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
  )  # fmt: skip
  return transformers.GPT2LMHeadModel(config)


def _llama():
  config = transformers.LlamaConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
  )  # fmt: skip
  return transformers.AutoModelForCausalLM.from_config(config)


def _bert():
  config = transformers.BertConfig(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=64, max_position_embeddings=SEQ, num_labels=CLASSES,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
  )  # fmt: skip
  return transformers.BertForSequenceClassification(config)


def _t5():
  config = transformers.T5Config(
    vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=1,
    num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
  )  # fmt: skip
  return transformers.T5ForConditionalGeneration(config)


def _tokens(g, rows):
  ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
  return {"input_ids": ids, "labels": ids.clone()}


def _sentences(g, rows):
  ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
  return {"input_ids": ids, "labels": torch.randint(0, CLASSES, (rows,), generator=g)}


def _pairs(g, rows):
  ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
  return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (rows, SEQ // 2), generator=g)}


def _images(size):
  def make(g, rows):
    x = torch.randn(rows, 3, size, size, generator=g)
    return {"x": x, "y": torch.randint(0, CLASSES, (rows,), generator=g)}

  return make


def _hf_loss(model, batch):
  return model(**batch).loss


def _vision_loss(model, batch):
  return F.cross_entropy(model(batch["x"]), batch["y"])


MODELS = {
  "gpt2": (_gpt2, _tokens, _hf_loss),
  "llama": (_llama, _tokens, _hf_loss),
  "bert": (_bert, _sentences, _hf_loss),
  "t5": (_t5, _pairs, _hf_loss),
  # 64x64: at 32x32 ResNet-18's last BatchNorm normalises 2 values per channel
  "resnet18": (lambda: torchvision.models.resnet18(num_classes=CLASSES), _images(64), _vision_loss),
  "mobilenet_v3_small": (
    lambda: torchvision.models.mobilenet_v3_small(num_classes=CLASSES, dropout=0.0),
    _images(64),
    _vision_loss,
  ),
  "vit": (
    lambda: torchvision.models.VisionTransformer(
      image_size=32,
      patch_size=8,
      num_layers=2,
      num_heads=2,
      hidden_dim=32,
      mlp_dim=64,
      num_classes=CLASSES,
    ),  # fmt: skip
    _images(32),
    _vision_loss,
  ),
  "convnext_atto": (
    lambda: timm.create_model("convnext_atto", num_classes=CLASSES, drop_path_rate=0.0),
    _images(32),
    _vision_loss,
  ),
  "vit_tiny": (
    lambda: timm.create_model(
      "vit_tiny_patch16_224",
      img_size=32,
      patch_size=8,
      depth=2,
      num_classes=CLASSES,
      drop_path_rate=0.0,
    ),  # fmt: skip
    _images(32),
    _vision_loss,
  ),
}


def _sgd(model):
  return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


def _adamw(model):
  opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
  return opt, transformers.get_linear_schedule_with_warmup(opt, 1, STEPS + 2)


LOOPS = {"sgd": (_sgd, False), "adamw-warmup-clip": (_adamw, True)}


def _data(make_batch):
  g = torch.Generator().manual_seed(1)
  return [make_batch(g, N * B) for _ in range(STEPS)]


def _rows(batch, r, dtype):
  out = {}
  for k, v in batch.items():
    v = v[r * B : (r + 1) * B]
    out[k] = v.to(dtype) if v.is_floating_point() else v
  return out


def _step(model, opt, loss_fn, batch, clip):
  opt.zero_grad()
  loss = loss_fn(model, batch)
  loss.backward()
  if clip:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
  opt.step()
  return loss.detach()


def _plain(init, loss_fn, data, loop, dtype):
  """DDP-style plain PyTorch on the CPU: per-replica forward and backward, mean grads."""
  make_opt, clip = LOOPS[loop]
  model = copy.deepcopy(init).to(dtype)
  opt, sched = make_opt(model)
  losses = []
  for batch in data:
    opt.zero_grad()
    total = 0.0
    for r in range(N):
      loss = loss_fn(model, _rows(batch, r, dtype)) / N
      loss.backward()
      total += loss.detach()
    if clip:
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if sched is not None:
      sched.step()
    losses.append(float(total))
  return torch.tensor(losses, dtype=torch.float64), dict(model.named_parameters())


def _distributed(strategy, make, init, loss_fn, data, loop):
  make_opt, clip = LOOPS[loop]
  with strategy.scope():
    model = make().train()  # as users build it: under the scope
    model.load_state_dict(init.state_dict())
    opt, sched = make_opt(model)

  def step(batch):
    return _step(model, opt, loss_fn, batch, clip)

  before = strategy.extended.experimental_replay_counts
  losses = []
  for batch in data:
    split = {k: _split(strategy, v) for k, v in batch.items()}
    per_replica = strategy.run(step, args=(split,))
    losses.append(float(strategy.reduce("mean", per_replica, axis=None).cpu()))
    if sched is not None:
      sched.step()
  after = strategy.extended.experimental_replay_counts
  counts = {k: after[k] - before[k] for k in ("traced", "replayed")}
  # state_dict(): whole tensors under experimental_sharding too
  params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
  return torch.tensor(losses, dtype=torch.float64), params, counts


def _distance(losses, params, want_losses, want_params):
  """Each step's relative distance of the loss, and the largest over the parameters
  (each relative to the float64 tensor's scale)."""
  loss = (losses - want_losses).abs() / want_losses.abs().clamp(min=1e-3)
  worst = 0.0
  for name, w in want_params.items():
    w = w.detach().double()
    got = params[name].detach().double()
    scale = max(w.abs().max().item(), 1e-3)
    worst = max(worst, (got - w).abs().max().item() / scale)
  return loss.tolist(), worst


def _split(strategy, t):
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: t[ctx.replica_id_in_sync_group * B : (ctx.replica_id_in_sync_group + 1) * B]
  )


# Found on 2026-12-04 with the environments built that day (timm 1.0.31, jax 0.10.2):
# weights 0.000452 of their scale from float64 PyTorch after 4 steps against a bound
# of 0.000251 (float32 PyTorch's own 6.27e-05), on the commit before that day's work
# (c66e9be) as on the day's: a change of the environment, not of xladist; reported
# as an expected failure until it is understood (the other 35 cases hold).
KNOWN_OVER_BOUND = {
  ("convnext_atto", "adamw-warmup-clip", "jax"): (
    "convnext_atto + AdamW on jax 0.10.2 with timm 1.0.31 ends 1.8x over its bound "
    "(at c66e9be too): under investigation"
  ),
}


@pytest.fixture(scope="module")
def strategy():
  s = xd.MirroredStrategy()
  assert s.num_replicas_in_sync == N
  return s


@pytest.mark.ecosystem_matrix
@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_plain_pytorch_within_float32s_own_rounding(
  strategy, name, loop, request
):
  known = KNOWN_OVER_BOUND.get((name, loop, _runtime.BACKEND))
  if known is not None:
    request.applymarker(pytest.mark.xfail(strict=False, reason=known))
  _check_against_plain_pytorch(strategy, name, loop)


def _block_of(name):
  if name == "gpt2":
    return transformers.models.gpt2.modeling_gpt2.GPT2Block
  return transformers.models.llama.modeling_llama.LlamaDecoderLayer


@pytest.mark.ecosystem_matrix
@pytest.mark.parametrize(
  "name, units", [("gpt2", None), ("gpt2", "block"), ("llama", "block")], ids=str
)
def test_hf_models_train_with_parameters_gradients_and_optimizer_state_sharded(name, units):
  """Issues 51 and 60: Hugging Face's GPT-2 and Llama under
  ShardingOptions(shard="parameters") (ZeRO-3, every tensor sharded:
  min_shard_bytes=0; GPT-2's tied embedding and head are one variable), each
  module its own unit or each decoder block one unit (`units=(GPT2Block,)`,
  FSDP's transformer auto-wrap policy), AdamW + warm-up + clip_grad_norm_, held
  to the same bound against float64 PyTorch, replayed as without sharding."""
  sharding = xd.experimental.ShardingOptions(
    "parameters", min_shard_bytes=0, units=None if units is None else (_block_of(name),)
  )
  strategy = xd.MirroredStrategy(experimental_sharding=sharding)
  # Held to float32's own distance from float64 PyTorch, as every model here: AdamW's
  # first steps on near-zero gradients (GPT-2's c_attn.bias) put two float32 programs
  # 7e-5 of the tensor's scale apart (sharded against MirroredStrategy, 4 steps).
  _check_against_plain_pytorch(strategy, name, "adamw-warmup-clip")


def _check_against_plain_pytorch(strategy, name, loop):
  make, make_batch, loss_fn = MODELS[name]
  torch.manual_seed(0)
  init = make().train()
  data = _data(make_batch)
  want = _plain(init, loss_fn, data, loop, torch.float64)
  own = _distance(*_plain(init, loss_fn, data, loop, torch.float32), *want)
  losses, params, counts = _distributed(strategy, make, init, loss_fn, data, loop)
  (got_losses, got), (own_losses, own_w) = _distance(losses, params, *want), own
  where = f"{name} ({loop}, {_runtime.BACKEND})"
  for step, g in enumerate(got_losses, 1):
    # float32's largest distance so far: once rounding has moved a chaotic network
    # (BatchNorm over a few values) it may move it anywhere that far
    bound = max(FACTOR * max(own_losses[:step]), FLOOR)
    assert g <= bound, (
      f"{where}: step {step}'s loss is {g:.3g} from float64 PyTorch's (bound {bound:.3g}); "
      f"every step: {got_losses}, float32 PyTorch's: {own_losses}"
    )
  bound = max(FACTOR * own_w, FLOOR)
  assert got <= bound, (
    f"{where}: weights {got:.3g} of their scale from float64 PyTorch's after {STEPS} "
    f"steps, float32 PyTorch's {own_w:.3g} (bound {bound:.3g})"
  )
  # The model's step replays once promoted (step 1 makes the optimizer's state,
  # steps 2 and 3 are captured and compared).
  assert counts == {"traced": 3, "replayed": STEPS - 3}, counts
