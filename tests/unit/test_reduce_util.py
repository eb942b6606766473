"""Reduce rules (xladist/reduce_util.py): `ReduceOp`, its names, and the aggregations that
have one (tf.distribute's ReduceOp and VariableAggregation)."""

import enum

import pytest

import xladist as xd
from xladist import reduce_util
from xladist.reduce_util import ReduceOp, as_reduce_op
from xladist.variable_policy import VariableAggregation


def test_the_four_reductions():
  assert [op.name for op in ReduceOp] == ["SUM", "MEAN", "MIN", "MAX"]
  assert [op.value for op in ReduceOp] == ["SUM", "MEAN", "MIN", "MAX"]
  assert reduce_util.SumReduction is ReduceOp.SUM
  assert reduce_util.MeanReduction is ReduceOp.MEAN
  assert xd.ReduceOp is ReduceOp


@pytest.mark.parametrize(
  "name, op",
  [
    ("sum", ReduceOp.SUM),
    ("SUM", ReduceOp.SUM),
    ("Mean", ReduceOp.MEAN),
    ("min", ReduceOp.MIN),
    ("mAx", ReduceOp.MAX),
  ],
)
def test_names_in_any_case(name, op):
  assert as_reduce_op(name) is op
  assert ReduceOp.from_string(name) is op


def test_a_reduce_op_is_itself():
  for op in ReduceOp:
    assert as_reduce_op(op) is op


@pytest.mark.parametrize("name", ["avg", "mean ", "", "PROD", "ReduceOp.SUM"])
def test_an_unknown_name(name):
  with pytest.raises(ValueError) as info:
    as_reduce_op(name, api="strategy.reduce")
  assert str(info.value) == (
    f"strategy.reduce: {name!r} is not a reduction; use one of ReduceOp.SUM, "
    "ReduceOp.MEAN, ReduceOp.MIN, ReduceOp.MAX or their names."
  )
  assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize("value", [None, 1, ["sum"], VariableAggregation.SUM])
def test_a_value_that_is_no_name(value):
  with pytest.raises(TypeError) as info:
    as_reduce_op(value)
  assert str(info.value) == (
    f"reduce_op: expected a ReduceOp or its name, got {type(value).__name__} {value!r}."
  )


@pytest.mark.parametrize(
  "aggregation, op",
  [
    (VariableAggregation.SUM, ReduceOp.SUM),
    (VariableAggregation.MEAN, ReduceOp.MEAN),
    ("sum", ReduceOp.SUM),
    ("MEAN", ReduceOp.MEAN),
  ],
)
def test_from_variable_aggregation(aggregation, op):
  assert ReduceOp.from_variable_aggregation(aggregation) is op


def test_another_enum_named_like_an_aggregation():
  class Aggregation(enum.Enum):
    SUM = "sum"
    ONLY_FIRST_REPLICA = "only_first_replica"

  assert ReduceOp.from_variable_aggregation(Aggregation.SUM) is ReduceOp.SUM
  with pytest.raises(ValueError):
    ReduceOp.from_variable_aggregation(Aggregation.ONLY_FIRST_REPLICA)


@pytest.mark.parametrize(
  "aggregation",
  [VariableAggregation.NONE, VariableAggregation.ONLY_FIRST_REPLICA, "min", "max", None],
)
def test_aggregations_without_a_reduction(aggregation):
  with pytest.raises(ValueError) as info:
    ReduceOp.from_variable_aggregation(aggregation)
  assert str(info.value) == (
    f"ReduceOp.from_variable_aggregation: {aggregation!r} has no ReduceOp; "
    "only VariableAggregation.SUM and VariableAggregation.MEAN do."
  )
