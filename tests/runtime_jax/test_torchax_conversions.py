"""torchax's operand conversions without torch's pytree (xladist/runtime/torchax_conversions.py)
give what torchax's own give, on every kind of structure an op's operands come in."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from xladist.runtime import torchax_conversions, torchax_fixes

torchax_fixes.install()
from torchax import tensor as txt  # noqa: E402

OWN = torchax_conversions._installed[0]
Pair = collections.namedtuple("Pair", "a b")


def _env():
  import torchax

  return torchax.default_env()


def _same(a, b):
  """Structure, types and leaves equal (tensors and arrays by value)."""
  assert type(a) is type(b), (type(a), type(b))
  if isinstance(a, (tuple, list)):
    assert len(a) == len(b)
    for x, y in zip(a, b):
      _same(x, y)
  elif isinstance(a, dict):
    assert list(a) == list(b)
    for k in a:
      _same(a[k], b[k])
  elif isinstance(a, (txt.Tensor, txt.View)):  # torchax tensors and views
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a.jax()), np.asarray(b.jax()))
  elif isinstance(a, torch.Tensor):  # a host tensor
    assert torch.equal(a, b)
  elif hasattr(a, "shape"):  # a jax array
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  else:
    assert a == b


def _structures(leaf):
  return [
    ((leaf, 2), {}),
    ([leaf, [leaf, 3.0], (None, "x")], {"alpha": 0.5, "out": leaf}),
    ((Pair(leaf, 1),), {}),  # a named tuple: torchax's own method
    ((collections.OrderedDict(k=leaf),), {}),
    ((torch.Size([2, 3]), leaf), {"dims": [0, 1]}),
    ((), {}),
  ]


@pytest.mark.parametrize("case", range(6))
def test_tensors_to_arrays_and_back_as_torchax_converts_them(case):
  env = _env()
  with env:
    t = torch.arange(6.0).reshape(2, 3).to("jax")
  tree = _structures(t)[case]
  fast_arrays = env.t2j_iso(tree)
  _same(fast_arrays, OWN["t2j_iso"](env, tree))
  _same(env.j2t_iso(fast_arrays), OWN["j2t_iso"](env, fast_arrays))
  _same(env.v2t_iso(tree), OWN["v2t_iso"](env, tree))
  assert isinstance(env.j2t_iso((jnp.ones(2),))[0], txt.Tensor)


def test_a_host_tensor_goes_to_torchaxs_own_rules():
  """torchax asserts on a host tensor among a jax op's operands (mixed math): the
  same error, not a silent pass-through."""
  env = _env()
  with pytest.raises(AssertionError, match="Expect a Tensor or a View"):
    env.t2j_iso(((torch.ones(2, 2),), {}))
  with pytest.raises(AssertionError, match="Expect a Tensor or a View"):
    OWN["t2j_iso"](env, ((torch.ones(2, 2),), {}))


def test_views_become_tensors():
  env = _env()
  with env:
    base = torch.zeros(4, 4).to("jax")
    v = base[1:3]
  tree = ((v, 1), {"k": [v]})
  _same(env.v2t_iso(tree), OWN["v2t_iso"](env, tree))


@pytest.mark.parametrize("case", range(6))
def test_dispatchs_tree_map_only_maps_as_torchs(case):
  """torchax.tensor's `torch_pytree.tree_map_only` (dispatch's wait on collective
  operands) gives what torch's gives: same structure, types and leaves, the
  function called once per matching leaf in the same order."""
  import torch.utils._pytree as pytree

  assert isinstance(txt.torch_pytree, torchax_conversions._PytreeForTorchax)
  tree = _structures(torch.arange(6.0).reshape(2, 3))[case]
  for kind in (torch.Tensor, (torch.Tensor, float), int):
    seen = {"fast": [], "torch": []}

    def mark(into):
      return lambda x: into.append(x) or ("mapped", len(into))

    fast = txt.torch_pytree.tree_map_only(kind, mark(seen["fast"]), tree)
    ref = pytree.tree_map_only(kind, mark(seen["torch"]), tree)
    _same(fast, ref)
    assert len(seen["fast"]) == len(seen["torch"])
    for a, b in zip(seen["fast"], seen["torch"]):
      assert a is b
  # New containers, as torch's: a caller may write into the kwargs it gets back.
  args, kwargs = ((1,), {"a": 2})
  out_args, out_kwargs = txt.torch_pytree.tree_map_only(torch.Tensor, lambda x: x, (args, kwargs))
  assert out_kwargs == kwargs and out_kwargs is not kwargs


def test_dispatchs_tree_map_only_leaves_the_rest_to_torch():
  """A predicate, `is_leaf`, and a registered container go to torch's own function;
  every other name of the module is torch's."""
  import torch.utils._pytree as pytree

  fast = txt.torch_pytree
  tree = ([1, 2.0], collections.deque([3]))
  assert fast.tree_map_only(int, lambda x: -x, tree) == ([-1, 2.0], collections.deque([-3]))
  assert fast.tree_map_only(lambda x: x == 2.0, lambda x: 0, [1, 2.0]) == [1, 0]
  assert fast.tree_map_only(int, str, [[1], 2], is_leaf=lambda x: x == [1]) == [[1], "2"]
  assert fast.tree_flatten is pytree.tree_flatten and fast.TreeSpec is pytree.TreeSpec
