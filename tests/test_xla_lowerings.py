"""xladist's kernels for ops torch_xla 2.9 cannot lower (runtime/xla_lowerings.py),
op by op on the XLA device against torch's CPU kernels: values and gradients."""

import pytest
import torch
import torch.nn.functional as F

import xladist as xd
from xladist import runtime

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def device():
  xd.MirroredStrategy()  # starts the runtime, which registers the kernels
  return runtime.device()


def _value_and_grads(fn, *inputs, device=None):
  """fn(*inputs) and the gradients of sum(out * weights) for the inputs that
  require grad, computed on `device` (None: the CPU)."""
  moved = [
    (x.detach().to(device).requires_grad_(x.requires_grad) if device else x.detach().clone())
    if isinstance(x, torch.Tensor)
    else x
    for x in inputs
  ]
  for m, x in zip(moved, inputs):
    if isinstance(x, torch.Tensor) and x.requires_grad and device is None:
      m.requires_grad_(True)
  out = fn(*moved)
  weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.device)
  (out * weights).sum().backward()
  grads = [m.grad.cpu() for m in moved if isinstance(m, torch.Tensor) and m.requires_grad]
  return out.detach().cpu(), grads


def assert_matches_cpu(fn, *inputs, device):
  want, want_grads = _value_and_grads(fn, *inputs)
  got, got_grads = _value_and_grads(fn, *inputs, device=device)
  torch.testing.assert_close(got, want, **TOL)
  assert len(got_grads) == len(want_grads) > 0
  for g, w in zip(got_grads, want_grads):
    torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_weight_norm(device, dim):
  g = torch.Generator().manual_seed(0)
  v = torch.randn(4, 3, 5, generator=g, requires_grad=True)
  norm_shape = [1] * 3 if dim == -1 else [v.shape[d] if d == dim else 1 for d in range(3)]
  gain = torch.rand(norm_shape, generator=g).add(0.5).requires_grad_()
  assert_matches_cpu(lambda v, gain: torch._weight_norm(v, gain, dim), v, gain, device=device)


def test_weight_norm_parametrization_reads_no_host_value(device):
  """nn.utils.parametrizations.weight_norm on the device: no CPU fallback ran."""
  lin = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 3)).to(device)
  before = runtime.execute_count()
  out = lin(torch.ones(2, 4, device=device))
  out.sum().backward()
  runtime.sync()
  runtime.wait()
  # One program (the step above), no fallback executions for single ops.
  assert runtime.execute_count() - before == 1


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_with_offsets(device, mode, padding_idx, include_last_offset):
  g = torch.Generator().manual_seed(1)
  weight = torch.randn(12, 3, generator=g, requires_grad=True)
  indices = torch.randint(0, 12, (14,), generator=g)
  indices[[2, 9]] = 0  # padding where padding_idx is 0
  # Bags of 3, 0 (empty), 2, 2, 3, 0, 2 and 2 indices.
  offsets = torch.tensor([0, 3, 3, 5, 7, 10, 10, 12] + ([14] if include_last_offset else []))

  def fn(w):
    return F.embedding_bag(
      indices.to(w.device),
      w,
      offsets.to(w.device),
      mode=mode,
      padding_idx=padding_idx,
      include_last_offset=include_last_offset,
    )

  assert_matches_cpu(fn, weight, device=device)


def test_embedding_bag_2d_input_and_per_sample_weights(device):
  g = torch.Generator().manual_seed(2)
  weight = torch.randn(10, 4, generator=g, requires_grad=True)
  indices = torch.randint(0, 10, (5, 3), generator=g)
  per_sample = torch.rand(5, 3, generator=g, requires_grad=True)

  def fn(w, psw):
    return F.embedding_bag(indices.to(w.device), w, mode="sum", per_sample_weights=psw)

  assert_matches_cpu(fn, weight, per_sample, device=device)


def test_embedding_bag_refuses_sparse_gradients(device):
  bag = torch.nn.EmbeddingBag(10, 4, sparse=True).to(device)
  with pytest.raises(RuntimeError, match=r"EmbeddingBag\(sparse=True\).*Use sparse=False"):
    bag(torch.zeros(2, 3, dtype=torch.long, device=device))


def test_embedding_bag_refuses_scale_grad_by_freq(device):
  bag = torch.nn.EmbeddingBag(10, 4, scale_grad_by_freq=True).to(device)
  with pytest.raises(RuntimeError, match=r"scale_grad_by_freq=True.*Use scale_grad_by_freq=False"):
    bag(torch.zeros(2, 3, dtype=torch.long, device=device))


@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_matrix_exp(device, scale):
  """Small and large norms (the squarings are chosen on the device), batched."""
  g = torch.Generator().manual_seed(3)
  a = (torch.randn(2, 4, 4, generator=g) * scale / 4).requires_grad_()
  want, _ = _value_and_grads(torch.linalg.matrix_exp, a)
  got, _ = _value_and_grads(torch.linalg.matrix_exp, a, device=device)
  torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
  if scale <= 1:  # gradients of a large exponential are large: compared where moderate
    assert_matches_cpu(torch.linalg.matrix_exp, a, device=device)


def test_orthogonal_parametrization_is_orthogonal(device):
  lin = torch.nn.utils.parametrizations.orthogonal(torch.nn.Linear(5, 5)).to(device)
  w = lin.weight.detach().cpu()
  torch.testing.assert_close(w @ w.T, torch.eye(5), rtol=0, atol=1e-5)


def test_a_gru_made_after_the_runtime_started_runs_on_the_cpu(device):
  """torch_xla replaces torch.nn.GRU with a scan-based class that fails on CPU
  tensors; once xladist started the runtime, nn.GRU is torch's again."""
  gru = torch.nn.GRU(3, 4, num_layers=2, batch_first=True)
  assert type(gru) is torch.nn.modules.rnn.GRU
  ref = torch.nn.modules.rnn.GRU(3, 4, num_layers=2, batch_first=True)
  ref.load_state_dict(gru.state_dict())
  x = torch.randn(2, 5, 3)
  torch.testing.assert_close(gru(x)[0], ref(x)[0])


_POOL_CASES = {
  "ceil": dict(ceil_mode=True),
  "ceil-pad": dict(ceil_mode=True, padding=1),
  "ceil-pad-exclude": dict(ceil_mode=True, padding=1, count_include_pad=False),
  "ceil-stride3": dict(ceil_mode=True, stride=3),
  "floor": dict(),
  "floor-pad-exclude": dict(padding=1, count_include_pad=False),
}


@pytest.mark.parametrize("kwargs", list(_POOL_CASES.values()), ids=list(_POOL_CASES))
@pytest.mark.parametrize("dims", [1, 2])
def test_avg_pool(device, kwargs, dims):
  """avg_pool2d (also behind avg_pool1d), whose backward torch_xla 2.9 runs on the
  host with ceil_mode=True: values and gradients, and no host fallback."""
  g = torch.Generator().manual_seed(4)
  shape = (2, 3, 7) if dims == 1 else (2, 3, 7, 6)
  x = torch.randn(shape, generator=g, requires_grad=True)
  pool = F.avg_pool1d if dims == 1 else F.avg_pool2d
  assert_matches_cpu(lambda t: pool(t, 3 if dims == 1 else (3, 2), **kwargs), x, device=device)
  before = runtime.execute_count()
  y = x.detach().to(device).requires_grad_()
  pool(y, 3 if dims == 1 else (3, 2), **kwargs).sum().backward()
  runtime.sync()
  runtime.wait()
  assert runtime.execute_count() - before == 1  # one program: nothing ran on the host


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_avg_pool_with_a_divisor_override(device, ceil_mode):
  g = torch.Generator().manual_seed(5)
  x = torch.randn(2, 3, 7, 6, generator=g, requires_grad=True)
  fn = lambda t: F.avg_pool2d(t, 3, ceil_mode=ceil_mode, padding=1, divisor_override=4)  # noqa: E731
  assert_matches_cpu(fn, x, device=device)
