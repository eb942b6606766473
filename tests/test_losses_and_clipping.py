"""TF-style loss scaling and gradient clipping give single-device training (issue 26).

`xladist.nn.compute_average_loss` / `scale_regularization_loss` follow TF's
tensorflow/python/ops/nn_loss_scaling_utilities_test.py (LossUtilitiesTest:
testComputeAverageLossGlobalBatchSize, ...DefaultGlobalBatchSize,
...SampleWeights, ...InvalidSampleWeights, ...Dtype, ...InvalidRank,
...InCrossReplicaContext, testScaleRegularizationLoss and
...InCrossReplicaContext): the VALUES are TF's. What differs is the gradient:
TF's apply_gradients sums replicas' gradients, xladist's optimizer.step()
averages them by default, so the helpers scale the gradient (not the value)
to give the single-device gradient under either setting.

Gradient clipping with torch's own functions inside `strategy.run` clips the
aggregated gradients, as single-device training and DDP do.

References are plain PyTorch on the CPU trained on the global batch.
"""

import re

import _models
import pytest
import torch
import torch.nn.functional as F

import xladist as xd
from xladist.nn import compute_average_loss, scale_regularization_loss
from xladist.runtime import xla as _runtime

N = 4
STEPS = 6
B = _models.PER_REPLICA_BATCH
GLOBAL = N * B
WEIGHT_DECAY = 0.05
TOL = 2e-5
CLIP_NORM = 0.25

# Traced and left lazy (replay off for this run): its program's HLO is readable.
LAZY = xd.RunOptions(experimental_replay=False)


def _l2(model):
  return sum((p * p).sum() for p in model.parameters())


def _reference(xs, ys, loss_kind, clip=None):
  """Single-device training on the global batch: mean loss (+ L2), clipping."""
  model = _models.make_mlp()
  model.load_state_dict(_models.initial_state("mlp"))
  opt = torch.optim.SGD(model.parameters(), lr=_models.LR, momentum=_models.MOMENTUM)
  norms = []
  for x, y in zip(xs, ys):
    loss = F.cross_entropy(model(x), y)
    if loss_kind == "tf_with_l2":
      loss = loss + WEIGHT_DECAY * _l2(model)
    opt.zero_grad()
    loss.backward()
    if clip == "norm":
      norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM))
    elif clip == "value":
      torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    opt.step()
  return model.state_dict(), norms


def _train(strategy, xs, ys, loss_kind, clip=None, clip_fn=None):
  model, opt = _models.build_xladist(strategy, "mlp", _models.initial_state("mlp"))

  def step(x, y):
    logits = model(x)
    if loss_kind == "mean":
      loss = F.cross_entropy(logits, y)
    else:  # a TF port: per-example losses divided by the GLOBAL batch
      per_example = F.cross_entropy(logits, y, reduction="none")
      loss = compute_average_loss(per_example, global_batch_size=GLOBAL)
      if loss_kind == "tf_with_l2":
        loss = loss + scale_regularization_loss(WEIGHT_DECAY * _l2(model))
    opt.zero_grad()
    loss.backward()
    norm = None
    if clip == "norm":
      norm = (clip_fn or torch.nn.utils.clip_grad_norm_)(model.parameters(), CLIP_NORM)
    elif clip == "value":
      torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    opt.step()
    return loss if norm is None else (loss, norm)

  outs = []
  for x, y in zip(xs, ys):
    outs.append(strategy.run(step, args=(_models.split(strategy, x), _models.split(strategy, y))))
    _runtime.sync()
  state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
  return state, outs


@pytest.fixture(scope="module")
def data():
  return _models.make_data("mlp", N, steps=STEPS)


@pytest.mark.parametrize("aggregation", ["mean", "sum"])
@pytest.mark.parametrize("loss_kind", ["tf", "tf_with_l2"])
def test_a_tf_port_trains_to_the_single_device_result(data, loss_kind, aggregation):
  strategy = xd.MirroredStrategy()
  strategy.extended.experimental_gradient_aggregation = aggregation
  xs, ys = data
  expected, _ = _reference(xs, ys, loss_kind)
  got, outs = _train(strategy, xs, ys, loss_kind)
  _models.assert_close_to_scale(got, expected, TOL)
  # TF's values: the SUM over replicas is the global batch's mean loss.
  model = _models.make_mlp()
  model.load_state_dict(_models.initial_state("mlp"))
  first = F.cross_entropy(model(xs[0]), ys[0])
  if loss_kind == "tf_with_l2":
    first = first + WEIGHT_DECAY * _l2(model)
  total = strategy.reduce("sum", outs[0], axis=None).cpu()
  torch.testing.assert_close(total, first.detach(), rtol=1e-6, atol=1e-6)


def test_without_the_helper_a_tf_port_would_train_with_a_quarter_of_the_gradient(data):
  """The failure the helpers prevent (issue 26): loss.sum() / GLOBAL under
  MEAN aggregation is 1/N of the gradient, far from the reference."""
  strategy = xd.MirroredStrategy()
  model, opt = _models.build_xladist(strategy, "mlp", _models.initial_state("mlp"))

  def step(x, y):
    loss = F.cross_entropy(model(x), y, reduction="none").sum() / GLOBAL
    opt.zero_grad()
    loss.backward()
    opt.step()

  xs, ys = data
  for x, y in zip(xs, ys):
    strategy.run(step, args=(_models.split(strategy, x), _models.split(strategy, y)))
    _runtime.sync()
  expected, _ = _reference(xs, ys, "tf")
  got = {k: v.detach().cpu() for k, v in model.state_dict().items()}
  with pytest.raises(AssertionError):
    _models.assert_close_to_scale(got, expected, TOL)


# -- TF's LossUtilitiesTest cases ----------------------------------------------------------


def test_compute_average_loss_values_follow_tf(strategy):
  assert compute_average_loss([1, 2, 3, 4, 5], global_batch_size=10).item() == 1.5
  per_example = torch.tensor([2.5, 6.2, 5.0])
  want = (2.5 + 6.2 + 5.0) / 3
  assert compute_average_loss(per_example).item() == pytest.approx(want)  # no strategy: 1 replica
  with strategy.scope():
    out = strategy.run(compute_average_loss, args=(per_example,))
    assert strategy.reduce("sum", out, axis=None).item() == pytest.approx(want)
    # sample weights: a scalar, one per example, one per time step
    cases = [
      (([2.0, 4.0, 6.0],), {"sample_weight": 2}, (2 + 4 + 6) * 2 / 3),
      (([2.0, 4.0, 6.0],), {"sample_weight": [0.3, 0.5, 0.2]}, (0.6 + 2.0 + 1.2) / 3),
      (
        ([[2.0, 0.5], [4.0, 1.0]],),
        {"sample_weight": [[0.3, 0.7], [0.2, 0.8]]},
        (0.6 + 0.35 + 0.8 + 0.8) / 2,
      ),
      (([[2.0, 0.5], [4.0, 1.0]],), {"sample_weight": [1.0, 0.5]}, (2.5 + 2.5) / 2),
    ]
    for args, kwargs, expected in cases:
      args = (torch.tensor(args[0]),)
      kwargs = {"sample_weight": torch.tensor(kwargs["sample_weight"])}
      out = strategy.run(compute_average_loss, args=args, kwargs=kwargs)
      assert strategy.reduce("sum", out, axis=None).item() == pytest.approx(expected)
    out = strategy.run(
      compute_average_loss, args=(torch.tensor([2.0, 4.0, 6.0], dtype=torch.float64),)
    )
    assert strategy.reduce("sum", out, axis=None).dtype == torch.float64


def test_compute_average_loss_errors(strategy):
  with pytest.raises(ValueError, match=re.escape("Incompatible shapes: [3] vs. [2]")):
    compute_average_loss([2.5, 6.2, 5.0], sample_weight=[0.2, 0.8], global_batch_size=10)
  with pytest.raises(ValueError, match="Expected a tensor with at least rank 1"):
    compute_average_loss(torch.tensor(2.0))
  with pytest.raises(ValueError, match="global_batch_size must be positive"):
    compute_average_loss([1.0], global_batch_size=0)
  with pytest.raises(ValueError, match="global_batch_size must be a Python int"):
    compute_average_loss([1.0], global_batch_size=2.0)
  with strategy.scope():
    with pytest.raises(RuntimeError, match="calling `compute_average_loss` in cross replica"):
      compute_average_loss([2.0, 3.0])
    with pytest.raises(RuntimeError, match="calling `scale_regularization_loss` in cross"):
      scale_regularization_loss([2.0, 3.0])


def test_scale_regularization_loss_values_follow_tf(strategy):
  reg = torch.tensor([2.5, 6.2, 5.0])
  assert scale_regularization_loss(reg).item() == pytest.approx(13.7)
  with strategy.scope():
    out = strategy.run(scale_regularization_loss, args=(reg,))
    assert strategy.reduce("sum", out, axis=None).item() == pytest.approx(13.7)


# -- gradient clipping --------------------------------------------------------------------


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_clipping_inside_run_gives_the_single_device_result(data, clip):
  strategy = xd.MirroredStrategy()
  xs, ys = data
  expected, norms = _reference(xs, ys, "mean", clip)
  got, outs = _train(strategy, xs, ys, "mean", clip)
  _models.assert_close_to_scale(got, expected, TOL)
  if clip == "norm":
    assert min(float(n) for n in norms) > CLIP_NORM  # the clip was active at every step
    # The norm each replica returns is the global one, on every replica.
    for (_, norm), want in zip(outs, norms):
      for value in strategy.experimental_local_results(norm):
        assert float(value.cpu()) == pytest.approx(float(want), rel=1e-4)


def test_torchs_own_clip_grad_norm_bound_before_xladist_clips_aggregated_gradients(data):
  """torch_xla replaces torch.nn.utils.clip_grad_norm_ with its own when
  imported (xladist wraps that one); torch's own function, as a module that
  imported it early holds it, goes through the helper xladist intercepts."""
  from torch.nn.utils.clip_grad import clip_grad_norm_ as bound_early

  strategy = xd.MirroredStrategy()
  xs, ys = data
  expected, _ = _reference(xs, ys, "mean", "norm")
  got, _ = _train(strategy, xs, ys, "mean", "norm", clip_fn=bound_early)
  _models.assert_close_to_scale(got, expected, TOL)
  assert bound_early is not torch.nn.utils.clip_grad_norm_  # torch_xla's, wrapped
  assert torch.nn.utils.clip_grad_norm_._xladist_aggregates


def test_get_total_norm_in_a_step_is_the_global_batchs_gradient_norm(data):
  strategy = xd.MirroredStrategy()
  model, opt = _models.build_xladist(strategy, "mlp", _models.initial_state("mlp"))
  reference = _models.make_mlp()
  reference.load_state_dict(_models.initial_state("mlp"))
  xs, ys = data
  F.cross_entropy(reference(xs[0]), ys[0]).backward()
  want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])

  def step(x, y):
    F.cross_entropy(model(x), y).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])

  out = strategy.run(step, args=(_models.split(strategy, xs[0]), _models.split(strategy, ys[0])))
  for value in strategy.experimental_local_results(out):
    assert float(value.cpu()) == pytest.approx(float(want), rel=1e-5)


def test_clipping_adds_no_collective_to_the_step():
  """Clipping aggregates what optimizer.step() would have: the step keeps its
  one all-reduce of the gradients (plus none for the norm)."""
  counts = {}
  for clip in (False, True):
    strategy = xd.MirroredStrategy()
    model, opt = _models.build_xladist(strategy, "mlp", _models.initial_state("mlp"))

    def step(x, y):
      loss = F.cross_entropy(model(x), y)
      opt.zero_grad()
      loss.backward()
      if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
      opt.step()
      return loss

    x = torch.randn(GLOBAL, 12)
    y = torch.randint(0, 5, (GLOBAL,))
    strategy.run(step, args=(_models.split(strategy, x), _models.split(strategy, y)), options=LAZY)
    hlo = _runtime.hlo_text(list(model.parameters()))
    counts[clip] = len(re.findall(r" all-reduce\(", hlo))
    _runtime.sync()
  assert counts[True] == counts[False] == 1


def test_a_gradient_replaced_after_clipping_is_an_error():
  strategy = xd.MirroredStrategy()
  model, opt = _models.build_xladist(strategy, "mlp", _models.initial_state("mlp"))

  def step(x, y):
    F.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    model[0].weight.grad = model[0].weight.grad * 2
    opt.step()

  x = torch.randn(GLOBAL, 12)
  y = torch.randint(0, 5, (GLOBAL,))
  with pytest.raises(RuntimeError, match=r"replaced after gradient clipping.*Clip right before"):
    strategy.run(step, args=(_models.split(strategy, x), _models.split(strategy, y)))
