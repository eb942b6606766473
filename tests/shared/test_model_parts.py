"""Models as users write them, on every runtime: each part trains like one device.

Every case builds an ordinary PyTorch model from the parts real models are
made of, trains it `STEPS` steps with `xd.MirroredStrategy` (4 replicas of
`B` rows, the default MEAN gradient aggregation) and compares its parameters
and buffers with the same model trained by plain PyTorch on the CPU on the
global batch of 4 * B rows (relative 1e-4). Run by `make test` on torch_xla and
by `make test-jax` on the jax runtime (issue 34's matrix).

The custom-training-loop cases mirror TF's
tensorflow/python/distribute/custom_training_loop_models_test.py (KerasModelsTest:
testRNNModel, testKerasModelsWithEmbeddings, testBatchNormModel), whose models
train under each strategy with `strategy.run` of a step that applies gradients.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xladist as xd
from xladist.checkpoint import Checkpoint

N = 4
B = 4
STEPS = 3
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def strategy():
  s = xd.MirroredStrategy()
  assert s.num_replicas_in_sync == N
  return s


def _split(strategy, t):
  return strategy.experimental_distribute_values_from_function(
    lambda ctx: t[ctx.replica_id_in_sync_group * B : (ctx.replica_id_in_sync_group + 1) * B]
  )


def _batches(make_x, classes=5, seed=1):
  g = torch.Generator().manual_seed(seed)
  return [(make_x(g), torch.randint(0, classes, (N * B,), generator=g)) for _ in range(STEPS)]


def _loss(model, x, y):
  return F.cross_entropy(model(x), y)


def _reference(make, data, make_optimizer, step_fn, after_step=None):
  torch.manual_seed(0)
  model = make()
  init = copy.deepcopy(model.state_dict())
  optimizer = make_optimizer(model)
  for x, y in data:
    step_fn(model, optimizer, x, y)
    if after_step is not None:
      after_step(optimizer)
  return init, model


def _sgd(model):
  return torch.optim.SGD(model.parameters(), lr=0.1)


def _plain_step(model, optimizer, x, y):
  optimizer.zero_grad()
  loss = _loss(model, x, y)
  loss.backward()
  optimizer.step()
  return loss.detach()


def _train(strategy, model, optimizer, data, step_fn=_plain_step, after_step=None):
  """`strategy.run` once per batch: no sync, each run ends the step before it."""
  for x, y in data:
    strategy.run(
      lambda x, y: step_fn(model, optimizer, x, y), args=(_split(strategy, x), _split(strategy, y))
    )
    if after_step is not None:
      after_step(optimizer)


def train_both(
  strategy,
  make,
  make_x,
  make_optimizer=_sgd,
  step_fn=_plain_step,
  classes=5,
  after_step=None,
  convert=lambda model: model,
  reference_stance="default",
):
  """(model trained by xladist, model trained by CPU torch), same initial weights;
  `convert` turns the model into what xladist trains (SyncBatchNorm);
  `reference_stance`: torch.compile's stance for the CPU reference."""
  data = _batches(make_x, classes)
  with torch.compiler.set_stance(reference_stance):
    init, want = _reference(make, data, make_optimizer, step_fn, after_step)
  with strategy.scope():
    torch.manual_seed(0)
    model = convert(make())
    model.load_state_dict(init)
    optimizer = make_optimizer(model)
  _train(strategy, model, optimizer, data, step_fn, after_step)
  return model, want


def assert_same_state(got, want, tol=TOL):
  want_state = want.state_dict()
  for name, value in got.state_dict().items():
    torch.testing.assert_close(value.detach().cpu(), want_state[name], **tol, msg=name)


def assert_trains_like_one_device(strategy, make, make_x, **kwargs):
  got, want = train_both(strategy, make, make_x, **kwargs)
  assert_same_state(got, want)
  return got


def _seq(g):
  return torch.randn(N * B, 5, 6, generator=g)


def _features(g):
  return torch.randn(N * B, 6, generator=g)


def _tokens(g):
  return torch.randint(0, 20, (N * B, 7), generator=g)


class _Recurrent(nn.Module):
  def __init__(self, cell, **kwargs):
    super().__init__()
    self.rnn = cell(6, 8, num_layers=2, batch_first=True, **kwargs)
    self.out = nn.Linear(8 * (2 if kwargs.get("bidirectional") else 1), 5)

  def forward(self, x):
    return self.out(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize(
  "cell, kwargs",
  [("LSTM", {}), ("GRU", {}), ("LSTM", {"bidirectional": True}), ("RNN", {})],
  ids=["lstm", "gru", "bi-lstm", "rnn-tanh"],
)
def test_recurrent_layers(strategy, cell, kwargs):
  """custom_training_loop_models_test.py testRNNModel: an RNN (LSTM) model trains
  in a replica function. torch's RNN modules keep weak references to their
  weights, which a move to the strategy's devices must rebuild. The class is
  looked up after the strategy started, as a user's model is made: importing
  torch_xla replaces `nn.GRU` (with a class that fails on the CPU reference)
  until xladist's runtime starts and gives it back."""
  cell = getattr(nn, cell)
  model = assert_trains_like_one_device(strategy, lambda: _Recurrent(cell, **kwargs), _seq)
  # The module's flat weight list holds the strategy's (moved) parameters.
  assert all(a is b for a, b in zip(model.rnn._flat_weights, model.rnn.parameters()))


class _TiedLM(nn.Module):
  """A GPT-style head: the output projection is the embedding matrix."""

  def __init__(self):
    super().__init__()
    self.emb = nn.Embedding(20, 8)
    self.mid = nn.Linear(8, 8)
    self.head = nn.Linear(8, 20, bias=False)
    self.head.weight = self.emb.weight

  def forward(self, x):
    return self.head(torch.tanh(self.mid(self.emb(x)))).mean(1)


def test_tied_weights_are_one_variable(strategy, tmp_path):
  """Parameter sharing keeps one variable: one update (the sum of both uses'
  gradients, as on one device), one tensor in a checkpoint."""
  model = assert_trains_like_one_device(strategy, _TiedLM, _tokens, classes=20)
  assert model.head.weight is model.emb.weight
  path = tmp_path / "tied.pt"
  Checkpoint(model=model).write(str(path))
  state = torch.load(path, weights_only=False)
  flat = _tensors_named(state, "weight")
  emb = [t for name, t in flat if name.endswith("emb.weight")]
  head = [t for name, t in flat if name.endswith("head.weight")]
  assert len(emb) == 1 and len(head) == 1
  assert emb[0].untyped_storage().data_ptr() == head[0].untyped_storage().data_ptr()


def _tensors_named(nest, suffix, path=""):
  if isinstance(nest, torch.Tensor):
    return [(path, nest)] if path.endswith(suffix) else []
  if isinstance(nest, dict):
    return [x for k, v in nest.items() for x in _tensors_named(v, suffix, f"{path}.{k}")]
  if isinstance(nest, (list, tuple)):
    return [x for i, v in enumerate(nest) for x in _tensors_named(v, suffix, f"{path}.{i}")]
  return []


class _Twice(nn.Module):
  """One layer applied twice, and a buffer read in forward."""

  def __init__(self):
    super().__init__()
    self.layer = nn.Linear(6, 6)
    self.out = nn.Linear(6, 5)
    self.register_buffer("shift", torch.linspace(-1, 1, 6))

  def forward(self, x):
    return self.out(torch.tanh(self.layer(torch.tanh(self.layer(x) + self.shift))))


def test_module_used_twice(strategy):
  assert_trains_like_one_device(strategy, _Twice, _features)


def _weight_norm_mlp():
  m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))
  nn.utils.parametrizations.weight_norm(m[0])
  nn.utils.parametrizations.weight_norm(m[2], dim=None)
  return m


def _orthogonal_mlp():
  m = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5))
  nn.utils.parametrizations.orthogonal(m[0])  # square: the matrix-exponential map
  return m


@pytest.mark.parametrize(
  "make", [_weight_norm_mlp, _orthogonal_mlp], ids=["weight_norm", "orthogonal"]
)
def test_parametrizations(strategy, make):
  """A parametrization's `original` tensors are the variables: one update each."""
  model = assert_trains_like_one_device(strategy, make, _features)
  originals = [n for n, _ in model.named_parameters() if "original" in n]
  assert originals, "the parametrized weights are the model's parameters"


class _Checkpointed(nn.Module):
  def __init__(self, p=0.0, checkpointed=True):
    super().__init__()
    self.block = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(p), nn.Linear(16, 16))
    self.out = nn.Linear(16, 5)
    self.checkpointed = checkpointed

  def forward(self, x):
    if self.checkpointed:
      h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
    else:
      h = self.block(x)
    return self.out(torch.tanh(h))


def test_activation_checkpointing(strategy):
  assert_trains_like_one_device(strategy, _Checkpointed, _features)


def test_activation_checkpointing_recomputes_the_same_dropout(strategy):
  """With dropout inside the checkpointed block, backward's recomputation must
  drop the elements forward dropped: the checkpointed model trains exactly as
  the same model without checkpointing, from the same device RNG state
  (`torch.<device>.get_rng_state`, which xladist provides for the runtime's
  device, as torch.utils.checkpoint needs)."""
  torch.manual_seed(0)
  init = _Checkpointed().state_dict()
  device_type = torch.device(strategy.extended.worker_devices[0]).type  # "xla" or "jax"
  rng = getattr(torch, device_type)
  strategy.run(lambda: None)  # the device seed follows torch.manual_seed from here
  state = rng.get_rng_state()

  def train(checkpointed):
    rng.set_rng_state(state)
    with strategy.scope():
      model = _Checkpointed(p=0.5, checkpointed=checkpointed)
      model.load_state_dict(init)
      optimizer = _sgd(model)
    _train(strategy, model, optimizer, _batches(_features))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}

  plain = train(False)
  checkpointed = train(True)
  assert any((plain[k] != init[k]).any() for k in init)
  for name, value in plain.items():
    torch.testing.assert_close(checkpointed[name], value, rtol=1e-5, atol=1e-6, msg=name)


class _Bags(nn.Module):
  def __init__(self, mode, **kwargs):
    super().__init__()
    self.bag = nn.EmbeddingBag(20, 8, mode=mode, **kwargs)
    self.emb = nn.Embedding(20, 8, padding_idx=0)
    self.out = nn.Linear(16, 5)

  def forward(self, x):
    return self.out(torch.cat([self.bag(x), self.emb(x).mean(1)], -1))


@pytest.mark.parametrize("mode", ["mean", "sum", "max"])
def test_embedding_bag(strategy, mode):
  """custom_training_loop_models_test.py testKerasModelsWithEmbeddings: embedding
  lookups train in a replica function; here nn.EmbeddingBag (each mode, with a
  padding index) beside nn.Embedding(padding_idx=0)."""

  def tokens(g):
    t = torch.randint(0, 20, (N * B, 7), generator=g)
    t[:, -2:] = 0  # padding at the end of every row
    return t

  assert_trains_like_one_device(strategy, lambda: _Bags(mode, padding_idx=0), tokens)


class _WeightedBags(nn.Module):
  """F.embedding_bag on 1-D indices with offsets and per-sample weights."""

  def __init__(self):
    super().__init__()
    self.bag = nn.EmbeddingBag(20, 8, mode="sum", include_last_offset=True)
    self.out = nn.Linear(8, 5)
    # Bags of lengths 3, 0 (empty), 2 and 2 per row of 7 indices.
    self.register_buffer("row_offsets", torch.tensor([0, 3, 3, 5, 7]))

  def forward(self, x):
    rows = x.shape[0]
    indices = x.reshape(-1)
    offsets = torch.cat(
      [self.row_offsets[:-1] + 7 * r for r in range(rows)]
      + [self.row_offsets[-1:] + 7 * (rows - 1)]
    )
    weights = 0.5 + indices.float() / 20  # a weight per index, whatever the batch
    bags = self.bag(indices, offsets, per_sample_weights=weights).reshape(rows, 4, 8)
    return self.out(bags.sum(1))


def test_embedding_bag_offsets_and_weights(strategy):
  assert_trains_like_one_device(strategy, _WeightedBags, _tokens)


class _ConvNorms(nn.Module):
  def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(1, 4, 3, padding=1)
    self.gn = nn.GroupNorm(2, 4)
    self.pool = nn.AvgPool2d(2)
    self.ln = nn.LayerNorm(4 * 4 * 4)
    self.out = nn.Linear(64, 5)

  def forward(self, x):
    return self.out(self.ln(self.pool(F.relu(self.gn(self.conv(x)))).flatten(1)))


def _images(g):
  return torch.randn(N * B, 1, 8, 8, generator=g)


def test_conv_groupnorm_avgpool_layernorm(strategy):
  assert_trains_like_one_device(strategy, _ConvNorms, _images)


class _CeilPooling(nn.Module):
  """ResNet-D's downsampling: AvgPool2d(2, ceil_mode=True, count_include_pad=False)
  on an odd size, then a 1x1 conv; an AvgPool1d with ceil_mode beside it."""

  def __init__(self):
    super().__init__()
    self.conv = nn.Conv2d(1, 4, 3, padding=1)
    self.down = nn.Sequential(
      nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False), nn.Conv2d(4, 4, 1)
    )
    self.pool1d = nn.AvgPool1d(3, stride=2, ceil_mode=True, padding=1)
    self.out = nn.Linear(4 * 4 * 4 + 4 * 5, 5)  # 7 -> 4 (ceil), 9 -> 5 (ceil)

  def forward(self, x):
    h = F.relu(self.conv(x[..., :7, :7]))  # 7 x 7: the last window is a partial one
    seq = self.pool1d(h.flatten(2)[..., :9])
    return self.out(torch.cat([self.down(h).flatten(1), seq.flatten(1)], 1))


def test_average_pooling_in_ceil_mode(strategy):
  assert_trains_like_one_device(strategy, _CeilPooling, _images)


class _BasicBlock(nn.Module):
  """torchvision's ResNet BasicBlock shape: conv-bn-relu-conv-bn, a projected skip."""

  def __init__(self, cin=3, cout=8, stride=2):
    super().__init__()
    self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(cout)
    self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
    self.bn2 = nn.BatchNorm2d(cout)
    self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

  def forward(self, x):
    h = F.relu(self.bn1(self.conv1(x)))
    return F.relu(self.bn2(self.conv2(h)) + self.down(x))


class _ResNetish(nn.Module):
  def __init__(self):
    super().__init__()
    self.stem = nn.Sequential(
      nn.Conv2d(1, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU()
    )
    self.block = _BasicBlock()
    self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))

  def forward(self, x):
    return self.head(self.block(self.stem(x)))


def test_resnet_block_with_sync_batchnorm(strategy):
  """custom_training_loop_models_test.py testBatchNormModel: BatchNorm in a
  replica function. With SyncBatchNorm the statistics span the global batch,
  so parameters and running statistics equal one device's on the global batch."""

  assert_trains_like_one_device(
    strategy, _ResNetish, _images, convert=xd.nn.SyncBatchNorm.convert_sync_batchnorm
  )


class _MaskedAttention(nn.Module):
  """Hugging Face-style self-attention: a padding mask (1 = token, 0 = pad) made
  additive (large negative where masked), plus a causal mask."""

  def __init__(self, d=8, heads=2):
    super().__init__()
    self.emb = nn.Embedding(20, d)
    self.qkv = nn.Linear(d, 3 * d)
    self.proj = nn.Linear(d, d)
    self.out = nn.Linear(d, 5)
    self.heads = heads

  def forward(self, tokens):
    attention_mask = (tokens != 0).long()
    x = self.emb(tokens)
    b, length, d = x.shape
    q, k, v = self.qkv(x).split(d, dim=-1)
    q, k, v = (t.reshape(b, length, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
    extended = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, torch.finfo(x.dtype).min) + extended
    h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, d)
    pooled = (self.proj(h) * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
    return self.out(pooled)


def test_attention_with_padding_and_causal_masks(strategy):
  def tokens(g):
    t = torch.randint(1, 20, (N * B, 7), generator=g)
    t[::2, -3:] = 0  # every other row padded
    return t

  assert_trains_like_one_device(strategy, _MaskedAttention, tokens)


class _Encoder(nn.Module):
  def __init__(self):
    super().__init__()
    self.emb = nn.Embedding(20, 16)
    self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    self.out = nn.Linear(16, 5)

  def forward(self, tokens):
    mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
    return self.out(self.layer(self.emb(tokens), src_mask=mask, is_causal=True).mean(1))


def test_causal_transformer_encoder_layer(strategy):
  assert_trains_like_one_device(strategy, _Encoder, _tokens)


def _mlp():
  return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))


def test_frozen_parameters_and_parameter_groups(strategy):
  """A frozen first layer, and parameter groups with their own lr and weight decay."""

  def make():
    m = _mlp()
    m[0].requires_grad_(False)
    return m

  def optimizer(model):
    return torch.optim.SGD(
      [
        {"params": model[2].parameters(), "lr": 0.05, "weight_decay": 0.1},
        {"params": model[4].parameters()},
      ],
      lr=0.2,
      momentum=0.9,
    )

  model = assert_trains_like_one_device(strategy, make, _features, make_optimizer=optimizer)
  assert not model[0].weight.requires_grad


def test_gradient_accumulation(strategy):
  """Two backward passes (half the batch each), one optimizer step."""

  def step(model, optimizer, x, y):
    optimizer.zero_grad()
    half = x.shape[0] // 2
    for sl in (slice(0, half), slice(half, None)):
      (_loss(model, x[sl], y[sl]) / 2).backward()
    optimizer.step()

  assert_trains_like_one_device(strategy, _mlp, _features, step_fn=step)


class _CompiledInside(nn.Module):
  def __init__(self):
    super().__init__()
    self.body = torch.compile(_mlp())

  def forward(self, x):
    return self.body(x)


def test_torch_compiled_submodule_runs_as_its_python(strategy):
  """A torch.compile'd submodule inside a step: the step is one XLA program
  already, so xladist runs the module's own Python (torch.compile's
  "force_eager" stance) and it trains as the uncompiled model does: the CPU
  reference runs the module uncompiled too (that stance; compiling it with
  inductor on the CPU took 11 of the test's 14 s)."""
  assert_trains_like_one_device(
    strategy, _CompiledInside, _features, reference_stance="force_eager"
  )


def test_adamw_clipping_and_a_schedule(strategy):
  """The loop users run: AdamW, gradient clipping and a per-step schedule."""

  def make_optimizer(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return optimizer

  def step(model, optimizer, x, y):
    optimizer.zero_grad()
    _loss(model, x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()

  assert_trains_like_one_device(
    strategy,
    _mlp,
    _features,
    make_optimizer=make_optimizer,
    step_fn=step,
    after_step=lambda optimizer: optimizer.schedule.step(),
  )


class _Autocast(nn.Module):
  def __init__(self):
    super().__init__()
    self.body = _mlp()

  def forward(self, x):
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
      return self.body(x).float()


def test_autocast_to_bfloat16(strategy):
  """torch.autocast on the step's device (its type: "xla" or "jax"): bf16 matmuls,
  compared with CPU torch's bf16 autocast, to bf16's precision."""
  got, want = train_both(strategy, _Autocast, _features)
  assert_same_state(got, want, dict(rtol=1e-2, atol=1e-3))
