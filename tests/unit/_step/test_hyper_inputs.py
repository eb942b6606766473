"""Which program scalars are hyperparameters (xladist/_step/hyper_inputs.py), alone: Hypers
made by hand stand for what a traced step made, (value, dtype) pairs for a program's
scalar constants, plain dicts for the groups a replay reads.

Matching is by value in the scalar's dtype: the rounded values below come from `struct`
(IEEE single and half precision) and bit arithmetic (bfloat16), not from the module.
"""

import struct
import types

import pytest
import torch

from xladist._step import hyper_inputs
from xladist._step.hyper import LEAF, NUMBER, Hyper

LR = (LEAF, 1, "lr", None)
LR2 = (LEAF, 2, "lr", None)  # a second group's lr
WD = (LEAF, 1, "weight_decay", None)
BETA1 = (LEAF, 1, "betas", 0)


def f32(x):
  return struct.unpack("<f", struct.pack("<f", x))[0]


def f16(x):
  return struct.unpack("<e", struct.pack("<e", x))[0]


def bf16(x):
  """float32, then the top 16 bits rounded to nearest, ties to even."""
  bits = struct.unpack("<I", struct.pack("<f", x))[0]
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
  return struct.unpack("<f", struct.pack("<I", bits))[0]


@pytest.mark.parametrize(
  "dtype, ref",
  [
    (torch.float64, lambda x: x),
    (torch.float32, f32),
    (torch.float16, f16),
    (torch.bfloat16, bf16),
    (None, lambda x: x),
  ],
  ids=["float64", "float32", "float16", "bfloat16", "no dtype"],
)
def test_cast_rounds_to_the_programs_dtype(dtype, ref):
  for x in (0.1, 1 / 3, 1e-3, 2.5):
    out = hyper_inputs._cast(x, dtype)
    assert type(out) is float and out == ref(x)
  assert f32(0.1) != 0.1 and bf16(0.1) != f32(0.1)  # (the cases do round)


def test_match_finds_the_hypers_of_equal_value_in_the_scalars_dtype():
  made = [
    Hyper(0.1, LR),
    Hyper(0.1, LR2),  # a coincidence: two groups' lr are equal
    Hyper(0.1, LR),  # the same expression made twice: one candidate
    Hyper(0.01, WD),
    Hyper(0.9, BETA1),
  ]
  scalars = [
    (f32(0.1), torch.float32),
    (0.1, torch.float64),
    (0.1, torch.float32),  # 0.1 is no float32 value: nothing rounds to it
    (f32(0.9), torch.float32),
    (f32(0.1), torch.float32),
    (0.5, torch.float32),  # no hyperparameter
    (3.0, torch.int64),  # not a float
    (0.1, None),
  ]
  out = hyper_inputs.match(scalars, made)
  assert [None if i is None else i.exprs for i in out] == [
    (LR, LR2),
    (LR, LR2),
    None,
    (BETA1,),
    (LR, LR2),
    None,
    None,
    None,
  ]
  assert out[0].dtype == torch.float32 and out[0].value == f32(0.1)
  assert out[1].dtype == torch.float64 and out[1].value == 0.1
  assert out[0].exprs is out[4].exprs  # one tuple of candidates per (dtype, value)
  assert out[0].exprs is not out[1].exprs
  assert out[0].proven is False and out[0].placed is None


def test_current_is_the_value_now_or_none_when_the_candidates_parted():
  inp = hyper_inputs.Input(((("mul", LR, (NUMBER, 2.0))), LR2), torch.float32, f32(0.2))
  assert inp.current({1: {"lr": 0.15}, 2: {"lr": 0.3}}) == f32(0.3)
  assert inp.current({1: {"lr": 0.15}, 2: {"lr": 0.4}}) is None
  # Equal once rounded to the dtype: one value.
  assert inp.current({1: {"lr": 0.15}, 2: {"lr": 0.3 + 1e-12}}) == f32(0.3)
  as64 = hyper_inputs.Input(inp.exprs, torch.float64, 0.2)
  assert as64.current({1: {"lr": 0.15}, 2: {"lr": 0.3 + 1e-12}}) is None


class _CountingGroup(dict):
  reads = 0

  def __getitem__(self, key):
    _CountingGroup.reads += 1
    return super().__getitem__(key)


def test_inputs_sharing_their_candidates_evaluate_them_once_per_memo():
  exprs = (LR, LR2)
  a = hyper_inputs.Input(exprs, torch.float32, f32(0.1))
  b = hyper_inputs.Input(exprs, torch.float32, f32(0.1))
  groups = {1: _CountingGroup(lr=0.5), 2: _CountingGroup(lr=0.5)}
  _CountingGroup.reads = 0
  memo = {}
  assert a.current(groups, memo) == b.current(groups, memo) == 0.5
  assert _CountingGroup.reads == 2  # each candidate read once, for both inputs
  assert b.current(groups) == 0.5 and _CountingGroup.reads == 4  # no memo: read again
  other = hyper_inputs.Input(exprs, torch.float16, f16(0.1))  # another dtype: not shared
  assert other.current(groups, memo) == 0.5 and _CountingGroup.reads == 6


def test_names_lists_each_hyperparameter_once():
  inp = hyper_inputs.Input((("mul", LR, ("sub", (NUMBER, 1.0), BETA1)), LR), torch.float32, 0.0)
  assert inp.names() == "'lr', 'betas'[0]"


def _inputs(*candidates, values=None):
  values = values or [0.1] * len(candidates)
  return [
    None if c is None else hyper_inputs.Input(tuple(c), torch.float32, v)
    for c, v in zip(candidates, values)
  ]


def test_compatible_needs_a_common_candidate_for_each_input():
  old = _inputs([LR, LR2], None, [WD])
  assert hyper_inputs.compatible(old, _inputs([LR2], None, [WD, BETA1])) is True
  assert hyper_inputs.compatible(old, _inputs([BETA1], None, [WD])) is False  # disjoint
  assert hyper_inputs.compatible(old, _inputs([LR], [WD], [WD])) is False  # None vs an input
  assert hyper_inputs.compatible(old, _inputs(None, None, [WD])) is False
  assert hyper_inputs.compatible([], []) is True


def test_agree_narrows_to_the_common_candidates_and_proves_a_changed_value():
  old = _inputs([LR, LR2, WD], [BETA1], [LR], values=[0.1, 0.9, 0.1])
  new = _inputs([WD, LR2, BETA1], [BETA1], [LR], values=[0.2, 0.9, 0.1])
  old[2].proven = True
  hyper_inputs.agree(old, new)
  assert new[0].exprs == (WD, LR2)  # in the new capture's order
  assert new[0].proven is True  # 0.1 -> 0.2: its value followed the candidates
  assert new[1].proven is False  # the same value at both captures: maybe a coincidence
  assert new[2].proven is True  # proven before
  lone = _inputs([LR])
  hyper_inputs.agree(_inputs([WD]), lone)
  assert lone[0].exprs == (LR,)  # nothing in common: its own candidates stay


def test_agree_shares_one_narrowed_tuple_between_inputs_that_shared_theirs():
  shared_old, shared_new = (LR, LR2), (LR2, WD)
  old = [hyper_inputs.Input(shared_old, torch.float32, 0.1) for _ in range(2)]
  new = [hyper_inputs.Input(shared_new, torch.float32, 0.1) for _ in range(2)]
  hyper_inputs.agree(old, new)
  assert new[0].exprs == (LR2,) and new[0].exprs is new[1].exprs


def _sgd(**group):
  return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], **group)


def test_group_values_and_group_change():
  opt = _sgd(lr=0.1, momentum=0.9)
  other = _sgd(lr=0.5)
  before = hyper_inputs.group_values([opt, other])
  values = {(i, g, key): value for i, g, key, value in before}
  assert values[(0, 0, "lr")] == 0.1 and values[(0, 0, "momentum")] == 0.9
  assert values[(1, 0, "lr")] == 0.5
  assert not any(key == "params" for _, _, key, _ in before)
  assert all(isinstance(v, (int, float, tuple)) for *_, v in before)  # no None, no strings
  assert (
    hyper_inputs.group_change([opt, other], before, hyper_inputs.group_values([opt, other])) is None
  )
  other.param_groups[0]["lr"] = 0.25
  after = hyper_inputs.group_values([opt, other])
  assert hyper_inputs.group_change([opt, other], before, after) == (
    "the step changed SGD.param_groups[0]['lr'] (0.5 -> 0.25): a replayed step runs no "
    "Python, so a learning-rate scheduler stepped inside fn would stop; call "
    "scheduler.step() after strategy.run"
  )


def test_group_change_of_a_new_group_value_is_named_in_general_words():
  opt = _sgd(lr=0.1)
  before = hyper_inputs.group_values([opt])
  opt.param_groups[0]["initial_lr"] = 0.1  # a scheduler made inside the step
  after = hyper_inputs.group_values([opt])
  assert hyper_inputs.group_change([opt], before, after) == (
    "the step changed an optimizer's parameter groups"
  )


def test_group_values_reads_plain_values_only():
  opt = types.SimpleNamespace(
    param_groups=[{"params": [], "lr": 0.1, "betas": (0.9, 0.99), "name": "x", "fused": None}]
  )
  assert hyper_inputs.group_values([opt]) == [(0, 0, "lr", 0.1), (0, 0, "betas", (0.9, 0.99))]


def test_the_evaluator_gives_each_inputs_current_value():
  """issue 61: a replay evaluates all its inputs by one generated function;
  it must give what `Input.current` gives, None where candidates disagree."""
  LR2 = (LEAF, 2, "lr", None)
  shared = ((("mul", LR, (NUMBER, 2.0))), LR2)
  inputs = [
    hyper_inputs.Input(shared, torch.float32, f32(0.2)),
    hyper_inputs.Input(shared, torch.float32, f32(0.2)),  # the same candidates
    hyper_inputs.Input(shared, torch.float64, 0.2),  # another dtype
    hyper_inputs.Input((LR,), torch.float32, f32(0.1)),
  ]
  values = hyper_inputs.evaluator(inputs)
  for groups in (
    {1: {"lr": 0.1}, 2: {"lr": 0.2}},
    {1: {"lr": 0.15}, 2: {"lr": 0.3}},
    {1: {"lr": 0.15}, 2: {"lr": 0.3 + 1e-12}},  # equal in float32 only
    {1: {"lr": 0.15}, 2: {"lr": 0.4}},
  ):
    assert values(groups) == [h.current(groups) for h in inputs]
  assert values({1: {"lr": 0.15}, 2: {"lr": 0.3 + 1e-12}})[1:3] == [f32(0.3), None]
