"""xladist's fixes to torchax (xladist/runtime/torchax_fixes.py), op by op.

Each case runs one op (or layer) forward and backward in plain torch on the CPU
and on torchax tensors under torch autograd, and compares the outputs, the
input's gradient and the parameters' gradients (and BatchNorm's running
statistics). `test_unfixed_torchax_fails_where_the_fixes_apply` runs the same
cases in a child process WITHOUT the fixes and checks that they fail there, so
a torchax upgrade that fixes one shows up (and the fix can go).
"""

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


def test_unfixed_torchax_fails_where_the_fixes_apply():
  """Without xladist's fixes the same cases fail: what each fix is for."""
  code = textwrap.dedent(
    """
    import torch, torchax, numpy as np
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
    """
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  results = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
  assert results.keys() == {"linear", "conv2d", "max_pool2d", "layer_norm"}, out.stderr[-2000:]
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
