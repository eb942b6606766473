"""xladist's fixes to torchax (xladist/runtime/torchax_fixes.py), op by op.

Each case runs one op (or layer) forward and backward in plain torch on the CPU
and on torchax tensors under torch autograd, and compares the outputs, the
input's gradient and the parameters' gradients (and BatchNorm's running
statistics). `test_unfixed_torchax_fails_where_the_fixes_apply` runs the same
cases in a child process WITHOUT the fixes and checks that they fail there, so
a torchax upgrade that fixes one shows up (and the fix can go).
"""

import copy
import functools
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xladist.runtime import torchax_fixes

torchax_fixes.install()

import torchax  # noqa: E402

ENV = torchax.default_env()
TOL = dict(rtol=2e-5, atol=2e-5)


def _host(t):
  return torch.from_numpy(np.array(t.jax())) if hasattr(t, "jax") else t.detach()


def _layer_cases():
  torch.manual_seed(0)
  return {
    "linear": (torch.nn.Linear(6, 4), (3, 6)),
    "conv2d": (torch.nn.Conv2d(3, 5, 3, padding=1), (2, 3, 8, 8)),
    "conv2d_strided_nobias": (torch.nn.Conv2d(3, 4, 3, stride=2, bias=False), (2, 3, 9, 9)),
    "conv2d_groups": (torch.nn.Conv2d(4, 4, 3, groups=2), (2, 4, 6, 6)),
    "max_pool2d_default_stride": (torch.nn.MaxPool2d(2), (2, 3, 8, 8)),
    "max_pool2d_stride1_pad": (torch.nn.MaxPool2d(3, stride=1, padding=1), (2, 3, 6, 6)),
    "batch_norm2d_train": (torch.nn.BatchNorm2d(3), (4, 3, 5, 5)),
    "batch_norm1d_train": (torch.nn.BatchNorm1d(6), (8, 6)),
    "layer_norm": (torch.nn.LayerNorm(6), (3, 4, 6)),
    "attention": (torch.nn.MultiheadAttention(8, 2, batch_first=True), (2, 5, 8)),
    "flatten_linear": (torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3)), (2, 3, 4)),
  }


def _run(module, x, grad_out, on_jax):
  if on_jax:
    with ENV:
      module = module.to("jax")
      x = x.to("jax").requires_grad_(True)
      out = module(x, x, x)[0] if isinstance(module, torch.nn.MultiheadAttention) else module(x)
      out.backward(grad_out.to("jax"))
      grads = {n: _host(p.grad) for n, p in module.named_parameters()}
      buffers = {n: _host(b) for n, b in module.named_buffers()}
      return _host(out), _host(x.grad), grads, buffers
  x = x.clone().requires_grad_(True)
  out = module(x, x, x)[0] if isinstance(module, torch.nn.MultiheadAttention) else module(x)
  out.backward(grad_out)
  grads = {n: p.grad.clone() for n, p in module.named_parameters()}
  buffers = {n: b.clone() for n, b in module.named_buffers()}
  return out.detach(), x.grad, grads, buffers


@pytest.mark.parametrize("name", sorted(_layer_cases()))
def test_forward_and_backward_match_cpu_torch(name):
  module, shape = _layer_cases()[name]
  module.train()
  g = torch.Generator().manual_seed(1)
  x = torch.randn(shape, generator=g)
  with torch.no_grad():
    probe = module(x, x, x)[0] if isinstance(module, torch.nn.MultiheadAttention) else module(x)
  grad_out = torch.randn(probe.shape, generator=g)
  import copy

  on_cpu = copy.deepcopy(module)
  if hasattr(on_cpu, "reset_running_stats"):
    on_cpu.reset_running_stats()
    module.reset_running_stats()
  want = _run(on_cpu, x, grad_out, on_jax=False)
  got = _run(copy.deepcopy(module), x, grad_out, on_jax=True)
  torch.testing.assert_close(got[0], want[0], **TOL)
  torch.testing.assert_close(got[1], want[1], **TOL)
  assert got[2].keys() == want[2].keys()
  for k in want[2]:
    torch.testing.assert_close(got[2][k], want[2][k], **TOL, msg=lambda m, k=k: f"grad {k}: {m}")
  for k in want[3]:  # BatchNorm: running_mean, running_var (unbiased), num_batches_tracked
    torch.testing.assert_close(
      got[3][k].to(want[3][k].dtype), want[3][k], **TOL, msg=lambda m, k=k: f"buffer {k}: {m}"
    )
  if "batch_norm" in name:
    assert not torch.equal(want[3]["running_mean"], torch.zeros_like(want[3]["running_mean"]))


def test_cross_entropy_embedding_and_sdpa_backward():
  torch.manual_seed(0)
  emb = torch.nn.Embedding(10, 8)
  idx = torch.randint(0, 10, (3, 5))
  target = torch.randint(0, 8, (3,))

  def loss_of(e, ids, y):
    h = e(ids)
    a = F.scaled_dot_product_attention(h, h, h)
    return F.cross_entropy(a.mean(1), y)

  import copy

  cpu = copy.deepcopy(emb)
  loss_of(cpu, idx, target).backward()
  with ENV:
    jemb = copy.deepcopy(emb).to("jax")
    loss = loss_of(jemb, idx.to("jax"), target.to("jax"))
    loss.backward()
    got = _host(jemb.weight.grad)
  torch.testing.assert_close(got, cpu.weight.grad, **TOL)


# -- issue 34's model parts, op by op: eager and inside one jax.jit -------------------------


class _Bags(torch.nn.Module):
  """nn.EmbeddingBag on 1-D indices with offsets (and per-sample weights)."""

  def __init__(self, offsets, **kwargs):
    super().__init__()
    self.bag = torch.nn.EmbeddingBag(10, 4, **kwargs)
    self.register_buffer("offsets", torch.tensor(offsets))

  def forward(self, indices, weights=None):
    return self.bag(indices, self.offsets, per_sample_weights=weights)


_INDICES = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])


def _ids(shape=(3, 4)):
  return torch.randint(0, 10, shape, generator=torch.Generator().manual_seed(2))


def _part_cases():
  """name -> (make module, inputs, forward(module, *inputs)); float inputs get gradients."""
  nn = torch.nn
  wn = nn.utils.parametrizations.weight_norm
  x4 = torch.randn(2, 3, 7, 7, generator=torch.Generator().manual_seed(3))
  cases = {
    "weight_norm_linear": (lambda: wn(nn.Linear(5, 4)), [torch.randn(3, 5)], None),
    "weight_norm_conv_dim1": (lambda: wn(nn.Conv2d(3, 4, 3), dim=1), [x4], None),
    "weight_norm_dim_none": (lambda: wn(nn.Linear(5, 4), dim=None), [torch.randn(3, 5)], None),
    "group_norm": (lambda: nn.GroupNorm(2, 4), [torch.randn(2, 4, 5, 5)], None),
    "group_norm_no_affine_1d": (
      lambda: nn.GroupNorm(4, 4, affine=False),
      [torch.randn(2, 4, 3)],
      None,
    ),
    "adaptive_avg_pool2d": (lambda: nn.AdaptiveAvgPool2d((3, 2)), [x4], None),
    "adaptive_avg_pool2d_divisible": (lambda: nn.AdaptiveAvgPool2d((7, 1)), [x4], None),
    "adaptive_avg_pool1d": (lambda: nn.AdaptiveAvgPool1d(3), [x4[:, :, 0]], None),
    "adaptive_avg_pool3d": (lambda: nn.AdaptiveAvgPool3d((2, 3, 2)), [x4[:, :, :5]], None),
    "lstm_cell": (lambda: nn.LSTMCell(4, 5), [torch.randn(2, 4)], lambda m, x: m(x)[1]),
    "gru_cell": (lambda: nn.GRUCell(4, 5), [torch.randn(2, 4)], None),
    "lstm_last_cell_state": (
      lambda: nn.LSTM(4, 5),
      [torch.randn(2, 3, 4)],
      lambda m, x: m(x)[1][1],
    ),
    "lstm_proj": (lambda: nn.LSTM(4, 5, proj_size=3), [torch.randn(2, 3, 4)], None),
    "rnn_tanh_batch_first": (lambda: nn.RNN(4, 5, batch_first=True), [torch.randn(2, 3, 4)], None),
    "checkpoint_non_reentrant": (
      lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
      [torch.randn(2, 4)],
      lambda m, x: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False),
    ),
    "inplace_transpose_unsqueeze_squeeze_t": (
      lambda: nn.Linear(4, 5),
      [torch.randn(2, 4)],
      lambda m, x: m(x).transpose_(0, 1).unsqueeze_(0).squeeze_(0).t_().unsqueeze_(2).squeeze_([2]),
    ),
    "inplace_swapdims": (
      lambda: nn.Linear(4, 5),
      [torch.randn(2, 4)],
      lambda m, x: m(x).swapdims_(0, 1).swapaxes_(1, 0).swapdims_(0, 1) * 3,
    ),
  }
  for cell in ("LSTM", "GRU"):
    for kwargs in ({"num_layers": 2}, {"bidirectional": True}):
      for batch_first in (False, True):
        name = f"{cell.lower()}_{next(iter(kwargs))}{'_batch_first' * batch_first}"
        make = functools.partial(getattr(nn, cell), 4, 5, batch_first=batch_first, **kwargs)
        cases[name] = (make, [torch.randn(2, 3, 4)], None)
  pools = {
    "k2": dict(kernel_size=2),
    "pad_ceil": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    "ceil_no_pad": dict(kernel_size=2, ceil_mode=True),
    "exclude_pad": dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
    "ceil_exclude_pad": dict(
      kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False
    ),
  }
  for variant, kw in pools.items():
    cases[f"avg_pool1d_{variant}"] = (nn.Identity, [x4[:, :, 0]], _pool(F.avg_pool1d, kw))
    cases[f"avg_pool2d_{variant}"] = (nn.Identity, [x4], _pool(F.avg_pool2d, kw))
    cases[f"avg_pool3d_{variant}"] = (nn.Identity, [x4[:, :, :5]], _pool(F.avg_pool3d, kw))
  cases["avg_pool2d_divisor_override"] = (
    nn.Identity,
    [x4],
    _pool(F.avg_pool2d, dict(kernel_size=3, padding=1, divisor_override=5)),
  )
  cases["avg_pool2d_one_value_lists"] = (
    nn.Identity,
    [x4],
    _pool(F.avg_pool2d, dict(kernel_size=[3], stride=[2], padding=[1], ceil_mode=True)),
  )
  cases["avg_pool2d_unbatched"] = (nn.Identity, [x4[0]], _pool(F.avg_pool2d, pools["pad_ceil"]))
  for mode in ("sum", "mean", "max"):
    bag = functools.partial(_Bags, mode=mode)
    cases[f"embedding_bag_{mode}"] = (lambda b=bag: b([0, 3, 5]), [_INDICES], None)
    cases[f"embedding_bag_{mode}_padding_empty_bags"] = (
      lambda b=bag: b([0, 3, 3, 5, 8], padding_idx=4),
      [_INDICES],
      None,
    )
    cases[f"embedding_bag_{mode}_include_last_offset"] = (
      lambda b=bag: b([0, 3, 5, 8], include_last_offset=True),
      [_INDICES],
      None,
    )
    cases[f"embedding_bag_{mode}_2d"] = (
      lambda mode=mode: nn.EmbeddingBag(10, 4, mode=mode),
      [_ids()],
      None,
    )
  weights = torch.rand(8, generator=torch.Generator().manual_seed(4))
  cases["embedding_bag_per_sample_weights"] = (
    lambda: _Bags([0, 3, 3, 5], mode="sum", padding_idx=2),
    [_INDICES, weights],
    None,
  )
  cases["embedding_bag_per_sample_weights_last_offset"] = (
    lambda: _Bags([0, 3, 5, 8], mode="sum", include_last_offset=True),
    [_INDICES, weights],
    None,
  )
  return cases


def _pool(fn, kwargs):
  return lambda m, x: fn(x, **kwargs)


def _forward(fn, module, xs):
  if fn is not None:
    return fn(module, *xs)
  out = module(*xs)
  return out[0] if isinstance(out, tuple) else out


def _parts_on_cpu(fn, module, inputs, grad_out):
  xs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
  out = _forward(fn, module, xs)
  out.backward(grad_out)
  grads = [x.grad for x in xs if x.requires_grad] + [p.grad for p in module.parameters()]
  return [out.detach()] + grads


def _parts_on_jax(fn, module, inputs, grad_out, jit):
  """The same on torchax tensors; with jit, all of it traced inside one jax.jit
  (as a strategy's step is): an op that reads a traced value on the host fails."""
  from torchax import interop

  with ENV:
    module = module.to("jax")
    params = list(module.parameters())

    def run(values, xs, g):
      saved = [p._elem for p in params]
      for p, v in zip(params, values):
        p._elem, p.grad = v._elem, None
      xs = [x.requires_grad_(True) if x.is_floating_point() else x for x in xs]
      out = _forward(fn, module, xs)
      out.backward(g)
      grads = [x.grad for x in xs if x.is_floating_point()] + [p.grad for p in params]
      for p, e in zip(params, saved):
        p._elem, p.grad = e, None
      return [out.detach()] + grads

    values = [p.detach() for p in params]
    got = (interop.jax_jit(run) if jit else run)(
      values, [x.to("jax") for x in inputs], grad_out.to("jax")
    )
    return [_host(t) for t in got]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(_part_cases()))
def test_model_parts_match_cpu_torch(name, jit):
  """Fixes 8-11: the output, the inputs' and the parameters' gradients equal CPU
  torch's (weight_norm, GroupNorm, average pooling, EmbeddingBag, RNNs,
  activation checkpointing, in-place view ops)."""
  make, inputs, fn = _part_cases()[name]
  torch.manual_seed(0)
  module = make()
  with torch.no_grad():
    probe = _forward(fn, copy.deepcopy(module), inputs)
  grad_out = torch.randn(probe.shape, generator=torch.Generator().manual_seed(1))
  want = _parts_on_cpu(fn, copy.deepcopy(module), inputs, grad_out)
  got = _parts_on_jax(fn, copy.deepcopy(module), inputs, grad_out, jit)
  assert len(got) == len(want)
  for i, (a, b) in enumerate(zip(got, want)):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"result {i}: {m}")


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_scale_grad_by_freq_divides_by_each_index_count(mode):
  """scale_grad_by_freq as documented (and as nn.Embedding, CUDA and torch's fix
  pytorch/pytorch#190264 do it): each row's gradient divided by its index's
  count in the batch. torch 2.9's CPU kernel divides some rows by another
  index's count (pytorch/pytorch#190063), so the reference is nn.Embedding's."""
  torch.manual_seed(0)
  weight = torch.randn(10, 4)
  ids = torch.tensor([[1, 1, 3, 4], [4, 4, 4, 3]])
  grad_out = torch.randn(2, 4)
  w = weight.clone().requires_grad_(True)
  pooled = F.embedding(ids, w, scale_grad_by_freq=True)
  (pooled.sum(1) if mode == "sum" else pooled.mean(1)).backward(grad_out)
  with ENV:
    wj = weight.to("jax").requires_grad_(True)
    out = F.embedding_bag(ids.to("jax"), wj, mode=mode, scale_grad_by_freq=True)
    out.backward(grad_out.to("jax"))
    got = _host(wj.grad)
  torch.testing.assert_close(got, w.grad, **TOL)


def test_embedding_bag_sparse_gradient_is_refused_by_name():
  with ENV:
    bag = torch.nn.EmbeddingBag(10, 4, sparse=True).to("jax")
    out = bag(_ids().to("jax"))
    with pytest.raises(NotImplementedError, match="sparse=True: JAX has no sparse gradients"):
      out.sum().backward()


@pytest.mark.parametrize("modes", ["once", "twice"])
def test_torch_autocast_on_jax_runs_matmuls_in_bfloat16(modes):
  """Fix 12: `torch.autocast("jax", torch.bfloat16)` casts as CPU torch's
  autocast does (bfloat16 results, gradients equal to bfloat16's precision: the
  casts are recorded, so backward runs in bfloat16 too), with and without
  autograd. "twice": torchax's modes already on, as the jax runtime leaves them
  once started (any strategy starts it), under a user's own `with env:`."""
  if modes == "twice":
    torchax.enable_globally()
    try:
      _autocast_trains_like_cpu_autocast()
    finally:
      torchax.disable_globally()
  else:
    _autocast_trains_like_cpu_autocast()


def _autocast_trains_like_cpu_autocast():
  torch.manual_seed(0)
  nn = torch.nn
  model = nn.Sequential(
    nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 5), nn.LayerNorm(5), nn.Linear(5, 3)
  )
  x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 3)
  cpu = copy.deepcopy(model)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    want = cpu(x)
  F.mse_loss(want.float(), y).backward()
  with ENV:
    jm = copy.deepcopy(model).to("jax")
    with torch.autocast("jax", dtype=torch.bfloat16):
      got = jm(x.to("jax"))
      with torch.no_grad():
        inference = jm(x.to("jax"))
    F.mse_loss(got.float(), y.to("jax")).backward()
    grads = {n: _host(p.grad) for n, p in jm.named_parameters()}
    assert got.dtype == inference.dtype == want.dtype == torch.bfloat16
    got = _host(got.float())
  bf16 = dict(rtol=2e-2, atol=2e-2)
  torch.testing.assert_close(got, want.float(), **bf16)
  for n, p in cpu.named_parameters():
    torch.testing.assert_close(grads[n], p.grad, **bf16, msg=lambda m, n=n: f"grad {n}: {m}")


def test_unfixed_torchax_fails_where_the_fixes_apply():
  """Without xladist's fixes the same cases fail: what each fix is for."""
  code = textwrap.dedent(
    """
    import torch, numpy as np
    from xladist.runtime import torchax_load
    torchax = torchax_load.load()  # torch 2.13+ lacks ops torchax names
    env = torchax.default_env()
    def attempt(make, shape):
      torch.manual_seed(0)
      m = make(); x = torch.randn(shape)
      try:
        with env:
          m = m.to("jax"); xj = x.to("jax").requires_grad_(True)
          m(xj).sum().backward()
          return "ok"
      except Exception as e:
        return type(e).__name__
    print("linear", attempt(lambda: torch.nn.Linear(4, 3), (2, 4)))
    print("conv2d", attempt(lambda: torch.nn.Conv2d(3, 4, 3), (2, 3, 6, 6)))
    pool = lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.MaxPool2d(2))
    print("max_pool2d", attempt(pool, (2, 3, 6, 6)))
    print("layer_norm", attempt(lambda: torch.nn.LayerNorm(4), (2, 4)))
    wn = torch.nn.utils.parametrizations.weight_norm
    print("weight_norm", attempt(lambda: wn(torch.nn.Linear(4, 3)), (2, 4)))
    print("avg_pool2d", attempt(lambda: torch.nn.AvgPool2d(2), (2, 3, 6, 6)))
    class Gru(torch.nn.GRU):
      def forward(self, x):
        return super().forward(x)[0]
    print("gru_batch_first", attempt(lambda: Gru(4, 3, batch_first=True), (2, 5, 4)))
    try:
      with env:
        w = torch.randn(10, 4).to("jax").requires_grad_(True)
        ids = torch.tensor([[1, 2], [3, 4]]).to("jax")
        torch.nn.functional.embedding_bag(ids, w, mode="mean").sum().backward()
        print("embedding_bag ok")
    except Exception as e:
      print("embedding_bag", type(e).__name__)
    """
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  results = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
  assert results.keys() == {
    "linear", "conv2d", "max_pool2d", "layer_norm", "weight_norm", "avg_pool2d",
    "gru_batch_first", "embedding_bag",
  }, out.stderr[-2000:]  # fmt: skip
  assert all(v != "ok" for v in results.values()), results


class _CNN(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
    self.c2, self.b2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
    self.fc = torch.nn.Linear(8 * 2 * 2, 5)

  def forward(self, x):
    x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
    x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
    return self.fc(torch.flatten(x, 1))


def _encoder():
  layer = torch.nn.TransformerEncoderLayer(
    16, 2, 32, dropout=0.0, batch_first=True, norm_first=True
  )
  return torch.nn.Sequential(
    torch.nn.Embedding(20, 16), torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
  )


@pytest.mark.parametrize("kind", ["cnn_batchnorm_maxpool", "encoder"])
def test_the_users_step_inside_one_jax_jit_trains_like_cpu_torch(kind):
  """The step as a user writes it (zero_grad, forward, backward, SGD momentum
  step), parameters, buffers and momentum buffers bound as the jitted
  function's inputs and returned as outputs: 4 steps equal CPU torch."""
  from torchax import interop
  from torchax import tensor as txt

  g = torch.Generator().manual_seed(1)
  if kind == "encoder":
    make, x, y = _encoder, torch.randint(0, 20, (4, 6), generator=g), None
    loss_fn = lambda out, _: out.square().mean()  # noqa: E731
  else:
    make = _CNN
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    loss_fn = F.cross_entropy
  torch.manual_seed(0)
  reference = make()
  init = {k: v.clone() for k, v in reference.state_dict().items()}
  opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
  for _ in range(4):
    opt.zero_grad()
    loss_fn(reference(x), y).backward()
    opt.step()
  want = reference.state_dict()

  with ENV:
    model = make()
    model.load_state_dict(init)
    model.to("jax").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xj = x.to("jax")
    yj = None if y is None else y.to("jax")

    def step(a, b):
      opt.zero_grad()
      loss = loss_fn(model(a), b)
      loss.backward()
      opt.step()
      return loss

    step(xj, yj)  # the first step makes the momentum buffers
    params = list(model.parameters())
    slots = params + list(model.buffers()) + [opt.state[p]["momentum_buffer"] for p in params]

    def pure(values, a, b):
      saved = [t._elem for t in slots]
      for t, v in zip(slots, values):
        t._elem = v._elem
      loss = step(a, b)
      out = [txt.Tensor(t._elem, ENV) for t in slots]
      for t, e in zip(slots, saved):
        t._elem = e
      for p in params:
        p.grad = None
      return out, loss.detach()

    jitted = interop.jax_jit(pure)
    values = [txt.Tensor(t._elem, ENV) for t in slots]
    for _ in range(3):
      values, _ = jitted(values, xj, yj)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    got = {n: _host(v) for n, v in zip(names, values)}
  for k, v in want.items():
    torch.testing.assert_close(got[k].to(v.dtype), v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
