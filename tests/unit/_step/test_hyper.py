"""Hyperparameter expressions, guards and host scalars (xladist/_step/hyper.py), alone:
plain dicts standing in for optimizers' parameter groups, CPU scalars for their state.

What a replay relies on: a `Hyper`'s arithmetic and `math.*` build an expression whose
`evaluate` on the groups *now* is what the traced Python would compute now; every host
decision the trace took on one (a comparison, `bool`, `int`, `round`, ...) is a guard
that `guards_fail` re-checks; a host scalar's in-place updates (`step += 1`,
`mu_product *= mu`) extend its expression. Every expected value below is computed with
plain floats (Python's operators and the `math` module), never by hyper.py.
"""

import copy
import math
import operator
import pickle
import types

import pytest
import torch

from xladist._step import hyper, hyper_compile
from xladist._step.hyper import LEAF, NUMBER, STATE, Hyper

SQRT = math.sqrt  # the math module's own functions (a trace swaps them while it runs)


def _optimizer(state=None, **group):
  """An object shaped as a torch optimizer (what `Swapped.swap` reads): one group."""
  return types.SimpleNamespace(param_groups=[dict(params=[], **group)], state=state or {})


def _leaf(value, key="lr", gid=1, index=None):
  return Hyper(value, (LEAF, gid, key, index))


# -- arithmetic: the expression evaluates to what the Python computes ---------------------------

BINARY = [
  ("add", lambda a, b: a + b),
  ("sub", lambda a, b: a - b),
  ("mul", lambda a, b: a * b),
  ("truediv", lambda a, b: a / b),
  ("pow", lambda a, b: a**b),
]


@pytest.mark.parametrize("name, ref", BINARY, ids=[b[0] for b in BINARY])
def test_binary_arithmetic_follows_the_hyperparameter(name, ref):
  lr = _leaf(0.3)
  for made, traced, now in (
    (ref(lr, 2.5), ref(0.3, 2.5), lambda v: ref(v, 2.5)),  # lr op 2.5
    (ref(2.5, lr), ref(2.5, 0.3), lambda v: ref(2.5, v)),  # 2.5 op lr (the reflected op)
  ):
    assert type(made) is Hyper
    assert float(made) == traced
    for value in (0.7, -1.25, 4.0):
      assert hyper.evaluate(made.expr, {1: {"lr": value}}) == now(value)


def test_int_operands_and_two_hyperparameters():
  lr, wd = _leaf(0.1), _leaf(0.01, key="weight_decay")
  made = 1 - lr * wd + 3  # Python ints as operands
  groups = {1: {"lr": 0.25, "weight_decay": 0.5}}
  assert float(made) == 1 - 0.1 * 0.01 + 3
  assert hyper.evaluate(made.expr, groups) == 1 - 0.25 * 0.5 + 3


@pytest.mark.parametrize(
  "fn, ref",
  [(operator.neg, lambda v: -v), (operator.pos, lambda v: +v), (abs, lambda v: abs(v))],
  ids=["neg", "pos", "abs"],
)
def test_unary_arithmetic_follows_the_hyperparameter(fn, ref):
  made = fn(_leaf(0.3))
  assert type(made) is Hyper and float(made) == ref(0.3)
  for value in (-0.7, 0.7):  # a negative value tells neg, pos and abs apart
    assert hyper.evaluate(made.expr, {1: {"lr": value}}) == ref(value)


def test_adams_bias_corrections_follow_lr_and_betas():
  """torch's default Adam computes its step size on the host from lr, betas and the step."""
  opt = _optimizer(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    beta1, beta2 = group["betas"]
    step = 3
    step_size = group["lr"] / (1 - beta1**step)
    correction2_sqrt = math.sqrt(1 - beta2**step)
    denom_eps = group["eps"] * correction2_sqrt
  assert float(step_size) == 1e-3 / (1 - 0.9**3)
  now = {id(group): {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6}}
  assert hyper.evaluate(step_size.expr, now) == 3e-4 / (1 - 0.8**3)
  assert hyper.evaluate(correction2_sqrt.expr, now) == SQRT(1 - 0.99**3)
  assert hyper.evaluate(denom_eps.expr, now) == 1e-6 * SQRT(1 - 0.99**3)


def test_operands_that_are_not_numbers_are_left_to_them():
  lr = _leaf(0.3)
  out = lr + torch.tensor(1.0)  # torch's own add: a tensor, not a Hyper
  assert type(out) is torch.Tensor and out.item() == pytest.approx(1.3)
  with pytest.raises(TypeError):
    lr + "a"


def test_a_power_with_a_tensor_exponent_is_a_tensor():
  """`beta1 ** step` with a tensor step (capturable Adam): the base becomes a tensor."""
  out = _leaf(0.5) ** torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
  assert type(out) is torch.Tensor and out.dtype == torch.float64
  assert out.tolist() == [0.5, 0.25, 0.125]


def test_a_hyper_combined_with_a_bool_behaves_as_its_float():
  lr = _leaf(0.3)
  assert float(lr * True) == 0.3 * True
  assert (lr < True) == (0.3 < True)


def test_a_copy_or_a_pickle_of_a_hyper_is_the_plain_number():
  lr = _leaf(0.3)
  for out in (copy.copy(lr), copy.deepcopy(lr), pickle.loads(pickle.dumps(lr))):
    assert type(out) is float and out == 0.3


def test_evaluate_reads_leaves_indices_state_and_numbers():
  sid = 7
  groups = {1: {"lr": 0.5, "betas": (0.9, 0.99)}, sid: {"step": torch.tensor(4.0)}}
  assert hyper.evaluate((LEAF, 1, "betas", 1), groups) == 0.99
  assert hyper.evaluate((STATE, sid, "step"), groups) == 4.0
  assert hyper.evaluate((NUMBER, 2.5), groups) == 2.5
  expr = ("sub", (STATE, sid, "step"), ("mul", (LEAF, 1, "lr", None), (LEAF, 1, "betas", 0)))
  assert hyper.evaluate(expr, groups) == 4.0 - 0.5 * 0.9


def test_describe():
  lr, beta2 = _leaf(0.1), _leaf(0.999, key="betas", index=1)
  step = Hyper(3.0, (STATE, 9, "step"))
  assert hyper.describe(lr.expr) == "'lr'"
  assert hyper.describe(beta2.expr) == "'betas'[1]"
  assert hyper.describe((step + 1).expr) == "(state['step'] + 1.0)"
  assert hyper.describe((1 - beta2).expr) == "(1.0 - 'betas'[1])"
  assert hyper.describe((lr / 2).expr) == "('lr' / 2.0)"
  assert hyper.describe((lr**2).expr) == "('lr' ** 2.0)"
  assert hyper.describe((-lr).expr) == "neg('lr')"
  assert hyper.describe(("lt", lr.expr, (NUMBER, 0.05))) == "('lr' < 0.05)"
  assert hyper.describe(("round", lr.expr, 2)) == "round('lr', 2)"
  assert hyper.describe(("math", "atan2", lr.expr, beta2.expr)) == "math.atan2('lr', 'betas'[1])"


def test_places_and_reads_state():
  lr, step = _leaf(0.1), Hyper(3.0, (STATE, 9, "step"))
  beta1 = _leaf(0.9, key="betas", index=0)
  expr = (lr * (1 - beta1**step) + 2).expr
  assert sorted(hyper.places(expr), key=repr) == sorted(
    [(LEAF, 1, "lr", None), (LEAF, 1, "betas", 0), (STATE, 9, "step")], key=repr
  )
  assert list(hyper.places((NUMBER, 1.0))) == []
  assert hyper.reads_state([expr]) is True
  assert hyper.reads_state([(lr * beta1).expr, (NUMBER, 1.0)]) is False


# -- math functions follow Hypers while a trace runs ----------------------------------------------


def test_math_functions_follow_hypers_only_while_an_active_trace_runs():
  lr = _leaf(0.25)
  assert math.sqrt is SQRT
  with hyper.Swapped():
    root = math.sqrt(lr)
    angle = math.atan2(lr, 2.0)
    plain = math.sqrt(4.0)
  assert math.sqrt is SQRT  # put back
  assert type(root) is Hyper and float(root) == SQRT(0.25)
  assert hyper.evaluate(root.expr, {1: {"lr": 0.81}}) == SQRT(0.81)
  assert hyper.evaluate(angle.expr, {1: {"lr": -3.0}}) == math.atan2(-3.0, 2.0)
  assert type(plain) is float and plain == 2.0
  assert type(math.sqrt(lr)) is float  # outside a trace: the value only
  with hyper.Swapped(active=False):
    assert math.sqrt is SQRT


def test_nested_traces_put_the_math_functions_back_once():
  with hyper.Swapped():
    with hyper.Swapped():
      pass
    assert math.sqrt is not SQRT  # the outer trace still runs
    assert type(math.sqrt(_leaf(4.0))) is Hyper
  assert math.sqrt is SQRT


# -- guards: host decisions the trace takes on a Hyper -----------------------------------------

COMPARE = [
  ("lt", operator.lt),
  ("le", operator.le),
  ("gt", operator.gt),
  ("ge", operator.ge),
  ("eq", operator.eq),
  ("ne", operator.ne),
]


@pytest.mark.parametrize("name, op", COMPARE, ids=[c[0] for c in COMPARE])
@pytest.mark.parametrize("traced", [0.04, 0.05, 0.06])
def test_a_comparison_is_a_guard_that_fails_when_its_result_would_change(name, op, traced):
  """`if group['lr'] < 0.05:` (a custom optimizer), at and around the threshold."""
  opt = _optimizer(lr=traced)
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    result = op(group["lr"], 0.05)
  assert result is op(traced, 0.05)  # a plain bool steered the trace
  assert swapped.guards == {(name, (LEAF, id(group), "lr", None), (NUMBER, 0.05)): result}
  guards = list(swapped.guards.items())
  for now in (0.04, 0.05, 0.06):
    failed = hyper.guards_fail(guards, {id(group): {"lr": now}})
    if op(now, 0.05) == op(traced, 0.05):
      assert failed is None
    else:
      sign = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}[name]
      assert failed == (
        f"a host decision of the trace changed (('lr' {sign} 0.05) was {op(traced, 0.05)!r}, "
        f"now {op(now, 0.05)!r})"
      )


def test_a_reflected_comparison_and_min_max_are_guards():
  """`0.05 < lr` runs lr's `>`; ASGD's `max(1, step - t0)` compares too."""
  opt = _optimizer(lr=0.1, t0=4.0)
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    assert (0.05 < group["lr"]) is True
    picked = max(1.0, group["t0"] - 2)
  assert float(picked) == 2.0
  guards = list(swapped.guards.items())
  gid = id(group)
  assert hyper.guards_fail(guards, {gid: {"lr": 0.2, "t0": 10.0}}) is None
  assert hyper.guards_fail(guards, {gid: {"lr": 0.01, "t0": 10.0}}) is not None
  # t0 - 2 < 1 now: max would pick the 1, another branch of the trace.
  failed = hyper.guards_fail(guards, {gid: {"lr": 0.2, "t0": 2.5}})
  assert failed is not None and "'t0'" in failed


CONVERSIONS = [
  ("bool", bool, 0.1, [(0.5, False), (0.0, True)]),
  # int truncates: 0.118 * 30 = 3.54 is still 3 (round would make it 4)
  ("int", lambda v: int(v * 30), 0.1, [(0.11, False), (0.118, False), (0.04, True)]),
  ("floor", lambda v: math.floor(v * 25), 0.1, [(0.11, False), (0.12, True)]),
  ("ceil", lambda v: math.ceil(v * 10), 0.15, [(0.11, False), (0.21, True)]),
  ("trunc", lambda v: math.trunc(-v * 10), 0.15, [(0.19, False), (0.21, True)]),
  ("round", lambda v: round(v, 2), 0.1, [(0.1001, False), (0.106, True)]),
]


@pytest.mark.parametrize("name, fn, traced, nows", CONVERSIONS, ids=[c[0] for c in CONVERSIONS])
def test_a_conversion_to_a_plain_value_is_a_guard(name, fn, traced, nows):
  opt = _optimizer(lr=traced)
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    result = fn(group["lr"])
  assert type(result) is not Hyper and result == fn(traced)
  ((expr, recorded),) = swapped.guards.items()
  assert expr[0] == name and recorded == fn(traced)
  for now, fails in nows:
    assert fn(now) != fn(traced) if fails else fn(now) == fn(traced)  # (the cases themselves)
    failed = hyper.guards_fail([(expr, recorded)], {id(group): {"lr": now}})
    assert (failed is not None) is fails, (now, failed)


def test_no_guard_is_recorded_outside_an_active_trace():
  lr = _leaf(0.1)
  assert (lr < 0.5) is True and int(lr * 20) == 2  # plain answers, nothing recorded
  with hyper.Swapped(active=False) as swapped:
    assert (lr < 0.5) is True
  assert swapped.guards == {}


def test_a_guard_that_cannot_be_evaluated_now_fails():
  """A math domain error or a division by zero now: the decision cannot be the same."""
  opt = _optimizer(lr=0.5)
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    assert (math.log(group["lr"]) < 0) is True
  guards = list(swapped.guards.items())
  assert hyper.guards_fail(guards, {id(group): {"lr": 0.25}}) is None
  assert hyper.guards_fail(guards, {id(group): {"lr": -1.0}}) == (
    "a host decision of the trace changed ((math.log('lr') < 0.0) was True, now None)"
  )
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    assert (1 / group["lr"] > 1) is True
  failed = hyper.guards_fail(list(swapped.guards.items()), {id(group): {"lr": 0.0}})
  assert failed is not None and failed.endswith("was True, now None)")


def test_guards_fail_names_the_first_guard_that_changed():
  opt = _optimizer(lr=0.1, momentum=0.9)
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    assert group["lr"] > 0.05
    assert group["momentum"] > 0.5
  guards = list(swapped.guards.items())
  gid = id(group)
  assert hyper.guards_fail(guards, {gid: {"lr": 0.2, "momentum": 0.0}}) == (
    "a host decision of the trace changed (('momentum' > 0.5) was True, now False)"
  )
  assert "('lr' > 0.05)" in hyper.guards_fail(guards, {gid: {"lr": 0.0, "momentum": 0.0}})


# -- Swapped: the groups' floats swapped in, and back ------------------------------------------


def test_swap_makes_the_groups_floats_hypers_and_puts_the_originals_back():
  params = [torch.zeros(1)]
  opt = types.SimpleNamespace(
    param_groups=[
      dict(
        params=params,
        lr=0.1,
        betas=(0.9, 0.999),
        momentum=0,
        nesterov=False,
        foreach=None,
        weight_decay=0.0,
      )
    ],
    state={},
  )
  group = opt.param_groups[0]
  lr = group["lr"]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    swapped.swap(opt)  # once per group
    gid = id(group)
    assert type(group["lr"]) is Hyper and group["lr"].expr == (LEAF, gid, "lr", None)
    assert [h.expr for h in group["betas"]] == [(LEAF, gid, "betas", 0), (LEAF, gid, "betas", 1)]
    assert type(group["weight_decay"]) is Hyper
    assert group["momentum"] == 0 and type(group["momentum"]) is int  # ints stay
    assert group["nesterov"] is False and group["foreach"] is None
    assert group["params"] is params
    assert len(swapped.saved) == 3
  assert group["lr"] is lr and type(group["betas"][0]) is float
  assert group["betas"] == (0.9, 0.999) and type(group["weight_decay"]) is float


def test_a_value_set_during_the_step_is_kept_as_a_plain_float():
  """A scheduler stepped inside the step: its value stays (as a float)."""
  opt = _optimizer(lr=0.1, betas=(0.9, 0.999))
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    group["lr"] = group["lr"] * 0.5
    group["betas"] = (group["betas"][0], 0.5)
  assert type(group["lr"]) is float and group["lr"] == 0.1 * 0.5
  assert [type(b) for b in group["betas"]] == [float, float] and group["betas"] == (0.9, 0.5)


def test_an_inactive_trace_swaps_nothing():
  opt = _optimizer(lr=0.1, state={"p": {"step": torch.tensor(1.0)}})
  with hyper.Swapped(active=False) as swapped:
    swapped.swap(opt)
    assert type(opt.param_groups[0]["lr"]) is float
    assert type(opt.state["p"]["step"]) is torch.Tensor
  assert swapped.saved == [] and swapped.scalars == {}


def test_swap_value_swaps_a_float_a_step_reads():
  namespace = {"beta": 0.5, "count": 3, "flag": True}
  with hyper.Swapped() as swapped:
    for key in namespace.copy():
      swapped.swap_value(namespace, key)
    beta = namespace["beta"]
    assert type(beta) is Hyper and beta.expr == (LEAF, id(namespace), "beta", None)
    assert type(namespace["count"]) is int and namespace["flag"] is True
    scaled = beta * 4
  assert namespace == {"beta": 0.5, "count": 3, "flag": True}
  assert type(namespace["beta"]) is float
  assert hyper.evaluate(scaled.expr, swapped.groups | {id(namespace): {"beta": 0.125}}) == 0.5


def test_the_trace_records_the_hypers_it_makes():
  outside = _leaf(0.1) * 2
  with hyper.Swapped() as swapped:
    a = outside + 1
    b = -a
  assert [id(h) for h in swapped.made] == [id(a), id(b)]
  assert swapped.candidates() == [a, b]  # no torch function took one: all it made


def test_recording_notes_the_hypers_torch_functions_take():
  """`weight_decay` used only inside `1 - lr * weight_decay` is no candidate."""
  opt = _optimizer(lr=0.1, weight_decay=0.01)
  group = opt.param_groups[0]
  p = torch.ones(3)
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    with swapped.recording():
      decay = 1 - group["lr"] * group["weight_decay"]
      p.mul_(decay)
      p.add_(torch.ones(3), alpha=-group["lr"])
  assert p.tolist() == pytest.approx([(1 - 0.1 * 0.01) - 0.1] * 3)
  used = {hyper.describe(h.expr) for h in swapped.candidates()}
  assert used == {"(1.0 - ('lr' * 'weight_decay'))", "neg('lr')"}


def test_merged_joins_the_records_of_several_steps():
  a, b = _optimizer(lr=0.1), _optimizer(lr=0.2)
  with hyper.Swapped() as first:
    first.swap(a)
    assert a.param_groups[0]["lr"] < 1
  with hyper.Swapped() as second:
    second.swap(b)
    assert not b.param_groups[0]["lr"] > 1
  both = hyper.Swapped.merged([first, second])
  assert set(both.groups) == {id(a.param_groups[0]), id(b.param_groups[0])}
  assert list(both.guards.values()) == [True, False]
  assert len(both.made) == len(first.made) + len(second.made) == 2


def test_plain_turns_every_hyper_of_a_result_into_its_float():
  lr = _leaf(0.25)
  out = hyper.plain({"loss": torch.ones(1), "lr": lr, "pair": (lr * 2, 3)})
  assert type(out["lr"]) is float and out["lr"] == 0.25
  assert type(out["pair"][0]) is float and out["pair"] == (0.5, 3)
  result = {"a": 1.5, "b": [2]}
  assert hyper.plain(result) is result  # nothing to change: the same object


# -- host scalars (_HostScalar): the optimizers' state on the host -------------------------------


def _state_optimizer(**scalars):
  state = {name: torch.tensor(value) for name, value in scalars.items()}
  return _optimizer(state={"p": state}, lr=0.1, momentum_decay=0.004), state


def test_swap_makes_cpu_float_scalars_of_the_state_host_scalars():
  state = {
    "step": torch.tensor(3.0),
    "count": torch.tensor(3),  # an int tensor: not a host scalar
    "exp_avg": torch.zeros(2),  # not a scalar
    "mu_product": torch.tensor(1.0, dtype=torch.float64),
    "note": 2.0,  # not a tensor
  }
  step = state["step"]
  opt = _optimizer(state={"p": state}, lr=0.1)
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    sid = id(state)
    assert {k for k, v in state.items() if isinstance(v, hyper._HostScalar)} == {
      "step",
      "mu_product",
    }
    assert state["step"].expr == (STATE, sid, "step")
    assert set(swapped.scalars) == {(sid, "step"), (sid, "mu_product")}
    item = state["step"].item()
    assert type(item) is Hyper and float(item) == 3.0 and item.expr == (STATE, sid, "step")
    state["step"] += 1
  assert state["step"] is step and type(step) is torch.Tensor  # the original tensor, back
  assert step.item() == 4.0  # which the update wrote (it shares the scalar's storage)


UPDATES = [
  ("iadd", lambda t: operator.iadd(t, 1.0), lambda v: v + 1.0),
  ("add_", lambda t: t.add_(2.0), lambda v: v + 2.0),
  ("add_ alpha", lambda t: t.add_(3.0, alpha=-2), lambda v: v + 3.0 * -2),
  ("isub", lambda t: operator.isub(t, 0.5), lambda v: v - 0.5),
  ("sub_", lambda t: t.sub_(1.5), lambda v: v - 1.5),
  ("imul", lambda t: operator.imul(t, 3.0), lambda v: v * 3.0),
  ("mul_", lambda t: t.mul_(0.5), lambda v: v * 0.5),
  ("itruediv", lambda t: operator.itruediv(t, 4.0), lambda v: v / 4.0),
  ("div_", lambda t: t.div_(8.0), lambda v: v / 8.0),
  ("copy_", lambda t: t.copy_(torch.tensor(7.0)), lambda v: 7.0),
  ("fill_", lambda t: t.fill_(2.5), lambda v: 2.5),
  ("zero_", lambda t: t.zero_(), lambda v: 0.0),
]


@pytest.mark.parametrize("name, update, ref", UPDATES, ids=[u[0] for u in UPDATES])
def test_an_in_place_update_of_a_host_scalar_extends_its_expression(name, update, ref):
  opt, state = _state_optimizer(step=6.0)
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    out = update(state["step"])
    assert out is state["step"]
  assert state["step"].item() == ref(6.0)  # torch ran the update on the host
  ((place, expr),) = swapped.updates().items()
  assert place == (id(state), "step")
  for before in (6.0, 11.0, -3.0):  # a replay: the new value from the value before it
    assert hyper.evaluate(expr, {id(state): {"step": torch.tensor(before)}}) == ref(before)


def test_updates_chain_and_take_hyperparameters():
  """NAdam's `mu_product *= mu`, with mu from `momentum_decay` and the step counter."""
  opt, state = _state_optimizer(step=1.0, mu_product=1.0)
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    state["step"] += 1
    step = state["step"].item()
    mu = 0.9 * (1.0 - 0.5 * 0.96 ** (step * group["momentum_decay"]))
    state["mu_product"] *= mu
  sid = id(state)
  updates = swapped.updates()
  assert set(updates) == {(sid, "step"), (sid, "mu_product")}

  def nadam(step_before, mu_product_before, momentum_decay):
    step = step_before + 1
    return step, mu_product_before * (0.9 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay)))

  assert state["mu_product"].item() == pytest.approx(nadam(1.0, 1.0, 0.004)[1], rel=1e-6)
  groups = {
    sid: {"step": torch.tensor(9.0), "mu_product": torch.tensor(0.5, dtype=torch.float64)},
    id(group): {"momentum_decay": 0.01},
  }
  expected = nadam(9.0, 0.5, 0.01)
  assert hyper.evaluate(updates[(sid, "step")], groups) == expected[0]
  assert hyper.evaluate(updates[(sid, "mu_product")], groups) == expected[1]


def test_an_update_hyper_py_does_not_follow_is_untracked():
  opt, state = _state_optimizer(step=2.0, eta=0.1, mu=1.0)
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    state["step"].pow_(2)  # not an update an expression follows
    state["eta"].add_(torch.tensor(2))  # an int tensor: no expression of it
    state["mu"] * 3  # not in place: no update
  updates = swapped.updates()
  sid = id(state)
  assert updates[(sid, "step")] is None and updates[(sid, "eta")] is None
  assert (sid, "mu") not in updates
  assert state["step"].item() == 4.0 and state["eta"].item() == pytest.approx(2.1)


def test_a_host_scalar_as_an_operand_enters_the_op_as_its_hyper():
  """ASGD's `param.mul_(1 - lambd * eta)`, `mul_(mu)` of a device tensor by a host scalar."""
  opt, state = _state_optimizer(mu=0.5)
  x = torch.full((2,), 3.0)
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    with swapped.recording():
      x.mul_(state["mu"])
  assert x.tolist() == [1.5, 1.5]
  assert swapped.updates() == {}
  assert [h.expr for h in swapped.candidates()] == [(STATE, id(state), "mu")]


def test_a_host_scalar_made_from_a_hyper_and_copied_into_the_state_is_followed():
  """ASGD's `eta.copy_(torch.as_tensor(lr / (1 + lambd * lr * step) ** alpha))`."""
  opt, state = _state_optimizer(eta=0.1)
  group = opt.param_groups[0]
  with hyper.Swapped() as swapped:
    swapped.swap(opt)
    with swapped.recording():
      new = torch.as_tensor(group["lr"] / 2)
      assert isinstance(new, hyper._HostScalar)
      state["eta"].copy_(new)
  ((_, expr),) = swapped.updates().items()
  assert state["eta"].item() == pytest.approx(0.05)
  assert hyper.evaluate(expr, {id(group): {"lr": 0.3}}) == 0.3 / 2


def test_carried_expressions_continue_from_the_step_before():
  """experimental_run_steps' steps traced as one program: the second starts from the first's."""
  opt, state = _state_optimizer(step=1.0)
  sid = id(state)
  with hyper.Swapped() as first:
    first.swap(opt)
    state["step"] += 1
  carried = first.updates()
  with hyper.Swapped(carried=carried) as second:
    second.swap(opt)
    assert state["step"].expr == carried[(sid, "step")]
    assert hyper.describe(state["step"].item().expr) == "(state['step'] + 1.0)"
    state["step"] *= 3
  assert first.updates() == carried
  (expr,) = second.updates().values()
  assert hyper.evaluate(expr, {sid: {"step": torch.tensor(5.0)}}) == (5.0 + 1.0) * 3
  with hyper.Swapped(carried=carried) as third:
    third.swap(opt)
  assert third.updates() == {}  # nothing changed after what was carried


def test_compiled_gives_what_evaluate_gives_for_every_kind_of_node():
  # issue 61: a replay evaluates its hyperparameters through hyper_compile.compiled;
  # each value must be evaluate's, bit for bit (ints stay ints, bools bools).
  group, state = {"lr": 0.1, "betas": (0.9, 0.999)}, {"step": torch.tensor(3.0)}
  groups = {1: group, 2: state}
  lr, beta2, step = (LEAF, 1, "lr", None), (LEAF, 1, "betas", 1), (STATE, 2, "step")
  shared = ("sub", (NUMBER, 1), ("pow", beta2, step))  # the same node in two expressions
  exprs = [
    lr,
    (NUMBER, 7),
    ("neg", lr),
    ("truediv", ("mul", lr, ("math", "sqrt", shared)), ("sub", (NUMBER, 1.0), shared)),
    ("lt", lr, (NUMBER, 0.05)),
    ("int", ("mul", step, (NUMBER, 2.5))),
    ("floor", ("add", step, (NUMBER, 0.5))),
    ("round", ("truediv", (NUMBER, 1), step), 3),
    ("math", "pow", lr, (NUMBER, 2)),
  ]
  got = hyper_compile.compiled(exprs)(groups)
  want = tuple(hyper.evaluate(e, groups) for e in exprs)
  assert [(type(v), v) for v in got] == [(type(v), v) for v in want]
  assert got[3] == 0.1 * math.sqrt(1 - 0.999**3.0) / (1.0 - (1 - 0.999**3.0))
  group["lr"], state["step"] = 0.01, torch.tensor(4.0)  # read afresh at every call
  assert hyper_compile.compiled(exprs)(groups) == tuple(hyper.evaluate(e, groups) for e in exprs)
  assert hyper_compile.compiled([])(groups) == ()
  with pytest.raises(ZeroDivisionError):  # as evaluate: the caller decides
    hyper_compile.compiled([("truediv", lr, (NUMBER, 0.0))])(groups)
