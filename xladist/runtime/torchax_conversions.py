"""torchax's conversions of an op's operands, without torch's pytree.

Every op the jax runtime lowers goes through torchax's `Environment.dispatch`,
which converts its operands and results with three methods: `v2t_iso` (torchax
views to tensors), `t2j_iso` (torchax tensors to jax arrays) and `j2t_iso` (jax
arrays to torchax tensors). torchax 0.0.13 writes each as a
`torch.utils._pytree.tree_map_only` over `(args, kwargs)`; torch's pytree builds a
spec object per node and per leaf. Measured on XLA:CPU, jax 0.10.2 (2026-12-04, the
15-model cases of tests/shared/test_optimizers_and_schedulers.py, two runs each):
RAdam 14.4 / 13.8 s with torchax's conversions, 12.9 / 12.8 s with these; AdamW
9.0 / 8.4 s against 7.5 / 7.6 s (about 10 % of a trace-bound test).

`install()` gives the three methods a walk of their own over what op operands
are: tuples, lists and dicts (exactly those types) of leaves. Any other type
that torch's pytree opens or might (their subclasses: a named tuple, a
structseq, an OrderedDict, `torch.Size`; a registered type: a deque, a
dataclass), and any operand the walk does not convert as torchax would (a host
tensor given to `t2j_iso`), goes to torchax's own method: the result is always
torchax's. tests/runtime_jax/test_torchax_conversions.py compares the two on
every kind of structure.

`dispatch` itself also maps `(args, kwargs)` of every op with
`torch_pytree.tree_map_only` (waiting on any AsyncCollectiveTensor operand): about
11 % of the same AdamW case in cProfile. torchax.tensor's name `torch_pytree` becomes
`_PytreeForTorchax`: torch's pytree module with `tree_map_only` walked the same way
(types only, no `is_leaf`; the structure is checked before `func` runs, so an
unusual structure goes to torch's function with no call made twice); every other
name is torch's own.
"""

_installed = []


class _Unusual(Exception):
  """A structure or leaf the fast walk leaves to torchax's own method."""


def _walk(tree, convert, opened):
  """`tree` with `convert` applied to its leaves, through exact tuples, lists and
  dicts; raises _Unusual at any other type torch's pytree opens (`opened`)."""
  kind = type(tree)
  if kind is tuple:
    return tuple([_walk(x, convert, opened) for x in tree])
  if kind is list:
    return [_walk(x, convert, opened) for x in tree]
  if kind is dict:
    return {k: _walk(v, convert, opened) for k, v in tree.items()}
  if kind in opened or isinstance(tree, (tuple, list, dict)):
    raise _Unusual  # a named tuple, structseq, OrderedDict, deque, dataclass, torch.Size
  return convert(tree)


def _plain(tree, opened):
  """Whether `tree` is exact tuples, lists and dicts down to leaves torch's pytree
  does not open."""
  kind = type(tree)
  if kind is tuple or kind is list:
    return all([_plain(x, opened) for x in tree])
  if kind is dict:
    return all([_plain(v, opened) for v in tree.values()])
  return not (kind in opened or isinstance(tree, (tuple, list, dict)))


class _PytreeForTorchax:
  """torch's pytree module as torchax.tensor sees it: `tree_map_only` over a type
  (or a tuple of types) walks exact tuples, lists and dicts directly, as torch's
  does (leaves in the same order, new containers); anything else is torch's."""

  def __init__(self, real):
    self._real = real
    self._opened = real.SUPPORTED_NODES  # a live dict: registrations show at once

  def __getattr__(self, name):
    return getattr(self._real, name)

  def tree_map_only(self, kind, func, tree, is_leaf=None):
    if is_leaf is not None or not isinstance(kind, (type, tuple)) or not _plain(tree, self._opened):
      return self._real.tree_map_only(kind, func, tree, is_leaf=is_leaf)
    return _walk(tree, lambda x: func(x) if isinstance(x, kind) else x, self._opened)


def install():
  """Replaces the three conversions of torchax's Environment (idempotent;
  torchax is imported by the caller, torchax_fixes.install)."""
  if _installed:
    return
  import jax
  import torch
  import torch.utils._pytree as pytree
  from torchax import tensor as txt
  from torchax import view

  env_class = txt.Environment
  own = {name: getattr(env_class, name) for name in ("t2j_iso", "v2t_iso", "j2t_iso")}
  opened = pytree.SUPPORTED_NODES  # the types torch's pytree opens (a live dict)
  on_jax = (txt.Tensor, view.View)

  def fast(name, convert):
    fallback = own[name]

    def method(self, tree):
      try:
        return _walk(tree, lambda x: convert(self, x), opened)
      except _Unusual:
        return fallback(self, tree)

    method.__name__ = name
    method.__doc__ = fallback.__doc__
    return method

  def to_jax(self, x):
    if isinstance(x, on_jax):
      return x.jax()
    if isinstance(x, torch.Tensor):
      raise _Unusual  # a host tensor: torchax's rules (scalars, its assertion)
    return x

  def view_to_tensor(self, x):
    return x.torch() if isinstance(x, view.View) else x

  def to_torchax(self, x):
    return txt.Tensor(x, self) if isinstance(x, jax.Array) else x

  if not isinstance(txt.torch_pytree, _PytreeForTorchax):
    txt.torch_pytree = _PytreeForTorchax(txt.torch_pytree)
  env_class.t2j_iso = fast("t2j_iso", to_jax)
  env_class.v2t_iso = fast("v2t_iso", view_to_tensor)
  env_class.j2t_iso = fast("j2t_iso", to_torchax)
  _installed.append(own)
