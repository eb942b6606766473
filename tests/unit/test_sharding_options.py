"""ShardingOptions (xladist/sharding_options.py) and the rows of a sharded tensor
(sharded_state.Layout), alone: no strategy, no XLA compile.

A tensor of n elements sharded over N replicas is kept as its rows: flattened,
zero-padded to N * ceil(n / N), viewed (N, k). The expected rows below are built
with numpy (`np.pad` + `reshape`), not with the code under test.
"""

import numpy as np
import pytest
import torch

from xladist import sharded_state
from xladist.sharding_options import ShardingOptions, check


def test_levels_name_what_they_shard():
  assert [
    ShardingOptions(s).shards("optimizer_state")
    for s in ("optimizer_state", "gradients", "parameters")
  ] == [True] * 3
  assert [
    ShardingOptions(s).shards("gradients") for s in ("optimizer_state", "gradients", "parameters")
  ] == [False, True, True]
  assert [
    ShardingOptions(s).shards("parameters") for s in ("optimizer_state", "gradients", "parameters")
  ] == [False, False, True]
  assert ShardingOptions().shard == "optimizer_state" and ShardingOptions().min_shard_bytes == 65536


@pytest.mark.parametrize(
  "shape, dtype, threshold, splits",
  [
    ((16384,), torch.float32, 65536, True),  # exactly 65536 bytes: at the threshold
    ((16383,), torch.float32, 65536, False),
    ((16384,), torch.bfloat16, 65536, False),  # 32768 bytes
    ((), torch.float32, 0, False),  # a scalar never shards
    ((1,), torch.float32, 0, True),
  ],
)
def test_min_shard_bytes_is_compared_with_each_tensors_own_bytes(shape, dtype, threshold, splits):
  assert (
    ShardingOptions("parameters", min_shard_bytes=threshold).splits(torch.empty(shape, dtype=dtype))
    is splits
  )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (
      {"shard": "zero3"},
      r"ShardingOptions\(shard='zero3'\).*'optimizer_state', 'gradients', 'parameters'",
    ),
    ({"shard": None}, r"shard=None"),
    ({"min_shard_bytes": -1}, r"min_shard_bytes=-1.*at least 0"),
    ({"min_shard_bytes": 1.5}, r"min_shard_bytes=1.5.*whole number"),
    ({"min_shard_bytes": True}, r"min_shard_bytes=True"),
  ],
)
def test_bad_values_raise_value_errors_naming_the_argument(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ShardingOptions(**kwargs)


@pytest.mark.parametrize("units", ["Block", (int,), (), [torch.nn.Linear, "x"], 3])
def test_units_that_name_no_modules_raise_a_type_error(units):
  with pytest.raises(TypeError, match=r"ShardingOptions\(units=.*tuple of torch.nn.Module classes"):
    ShardingOptions("parameters", units=units)


def test_units_are_part_of_the_options_identity():
  def rule(m):
    return isinstance(m, torch.nn.Linear)

  by_class = ShardingOptions("parameters", units=torch.nn.Linear)  # one class: a tuple of it
  assert by_class.units == (torch.nn.Linear,)
  assert by_class == ShardingOptions("parameters", units=[torch.nn.Linear])
  assert by_class != ShardingOptions("parameters")
  assert ShardingOptions("parameters", units=rule).units is rule
  assert hash(by_class) == hash(ShardingOptions("parameters", units=(torch.nn.Linear,)))
  assert "units=(<class 'torch.nn.modules.linear.Linear'>,)" in repr(by_class)
  assert "units" not in repr(ShardingOptions("parameters"))


class _Block(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.a = torch.nn.Linear(2, 2)
    self.inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))


def test_a_named_unit_holds_the_parameters_below_it_except_nested_units():
  from xladist.sharded_units import UnitGathers, unit_rule

  outer = torch.nn.Sequential(_Block(), _Block())
  outer.extra = torch.nn.Linear(2, 2)
  gathers = UnitGathers(sharded=None, units=(_Block,))
  block = outer[0]
  want = [block.a.weight, block.a.bias] + list(block.inner.parameters())
  assert [id(p) for p in gathers._unit_members(block)] == [id(p) for p in want]
  # The outer module's unit: its own parameters and those of modules no rule names.
  assert [id(p) for p in gathers._unit_members(outer)] == [id(p) for p in outer.extra.parameters()]
  assert unit_rule(None)(block) is False
  assert unit_rule(lambda m: m is block)(block) is True
  assert unit_rule((_Block,))(outer) is False


def test_a_strategy_refuses_what_is_not_sharding_options():
  with pytest.raises(TypeError, match=r"MirroredStrategy\(experimental_sharding=...\).*got str"):
    check("parameters", "MirroredStrategy")
  assert check(None, "X") is None


@pytest.mark.parametrize(
  "shape, n", [((33, 6), 4), ((5,), 4), ((8,), 4), ((4, 3), 4), ((2, 3, 5), 8), ((1,), 2)]
)
def test_rows_pad_and_come_back(shape, n):
  numel = int(np.prod(shape))
  full = torch.arange(numel, dtype=torch.float32).reshape(shape) + 1
  layout = sharded_state.Layout(shape, n, params=True)
  k = -(-numel // n)
  want = np.pad(full.numpy().reshape(-1), (0, n * k - numel)).reshape(n, k)
  rows = layout.to_rows(full)
  np.testing.assert_array_equal(rows.numpy(), want)
  assert torch.equal(layout.from_rows(rows), full)
  for r in range(n):  # each replica's own row of a whole tensor it holds
    np.testing.assert_array_equal(layout.own_rows(full, torch.tensor(r)).numpy(), want[r])
  # An entered view: rows arrive (1, k) and are squeezed; a whole tensor is cut.
  assert torch.equal(layout.local_row(rows[1:2], torch.tensor(1)), rows[1])
  assert torch.equal(layout.local_row(full, torch.tensor(n - 1)), rows[n - 1])
  assert layout.is_rows(rows) is (tuple(shape) != (n, k))
  assert layout.is_row(rows[n - 1]) is (tuple(shape) != (k,))  # a row, unless it is the whole
