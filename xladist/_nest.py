"""Nests: the containers xladist walks to find the tensors of arguments, results and batches.

`strategy.run`'s arguments and results, merge_call's and all_reduce's values,
the batches of a distributed dataset: all are nests of tuples, lists, dicts,
namedtuples and dataclasses (made nodes here, their fields the children, the
first time one is met), with `DistributedValues`, tensors and None as leaves.
A module's `state_dict()` keeps its `_metadata` through a walk (see below).
Built on optree, in xladist's own namespace so that registering a dataclass
here changes nothing for other optree users.

* `flatten` / `unflatten`, `leaves`, `tree_map`: the walk;
* `flatten_with_path`, `tree_map_with_path`, `leaf_name`, `error_at`: the
  same with each leaf's path, and the words that name a leaf in an error
  message (`value['loss'][1]`, `args[0].logits`).
"""

import collections
import dataclasses

import optree
import torch

from xladist.values import DistributedValues

_NAMESPACE = "xladist"


def _is_leaf(x):
  if isinstance(x, DistributedValues):
    return True
  if isinstance(x, torch.Tensor):
    return False  # (is_dataclass costs several times more on a tensor)
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    _register_dataclass(type(x))
  return False


def _register_dataclass(cls):
  """Makes a dataclass a node of xladist's nests (its fields are the children),
  so a step may return one: its tensors come back as PerReplica values."""
  if cls in _DATACLASSES:
    return
  names = tuple(f.name for f in dataclasses.fields(cls))
  by_init = all(f.init for f in dataclasses.fields(cls))

  def flatten_fn(obj):
    return [getattr(obj, n) for n in names], None, names

  def unflatten_fn(_, children):
    if by_init:
      return cls(**dict(zip(names, children)))
    obj = cls.__new__(cls)
    for n, c in zip(names, children):
      object.__setattr__(obj, n, c)
    return obj

  optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=_NAMESPACE)
  _DATACLASSES.add(cls)


_DATACLASSES = set()


def flatten(structure):
  """Leaves of a nested structure (tuples, lists, dicts, namedtuples and
  dataclasses); distributed values and None are leaves. The spec rebuilds the
  containers, a module's `state_dict()` with its `_metadata`."""
  return _nested(_flatten, structure)


def _flatten(structure):
  return optree.tree_flatten(
    structure, is_leaf=_is_leaf_checked, none_is_leaf=True, namespace=_NAMESPACE
  )


def unflatten(treespec, leaves):
  return optree.tree_unflatten(treespec, leaves)


def flatten_with_path(structure):
  """(paths, leaves, spec) of a nest; `leaf_name` turns a path into words."""
  return _nested(
    lambda s: optree.tree_flatten_with_path(
      s, is_leaf=_is_leaf_checked, none_is_leaf=True, namespace=_NAMESPACE
    ),
    structure,
  )


def leaves(structure):
  """The leaves of a nest (see `flatten`)."""
  return optree.tree_leaves(structure, is_leaf=_is_leaf, none_is_leaf=True, namespace=_NAMESPACE)


def tree_map(fn, structure, *rests):
  """`fn` applied to the leaves of `structure` (and the matching leaves of
  `rests`, which have its structure), in the same containers (see `flatten`)."""
  return _nested(
    lambda *s: optree.tree_map(
      fn, *s, is_leaf=_is_leaf_checked, none_is_leaf=True, namespace=_NAMESPACE
    ),
    structure,
    *rests,
  )


def tree_map_with_path(fn, structure, *rests):
  """`tree_map` calling `fn(path, leaf, *rest_leaves)`; `leaf_name(structure,
  path)` names the leaf in an error message."""
  return _nested(
    lambda *s: optree.tree_map_with_path(
      fn, *s, is_leaf=_is_leaf_checked, none_is_leaf=True, namespace=_NAMESPACE
    ),
    structure,
    *rests,
  )


def leaf_name(structure, path, root="value"):
  """How a leaf of `structure` is reached, for messages: `value['loss'][1]`,
  `args[0].logits` (namedtuple and dataclass fields as attributes).

  Computed from the path `tree_map_with_path` / `flatten_with_path` gave, only
  when an error is raised (the accessors cost more than the walk itself).
  """
  path = tuple(path)
  accessors = _nested(
    lambda s: optree.tree_flatten_with_accessor(
      s, is_leaf=_is_leaf_checked, none_is_leaf=True, namespace=_NAMESPACE
    )[0],
    structure,
  )
  for accessor in accessors:
    if accessor.path == path:
      return accessor.codify(root)
  return root + "".join(f"[{key!r}]" for key in path)


def error_at(error, structure, path, root="value"):
  """`error` (a TypeError or ValueError raised for one leaf) with a message
  that names the leaf after the API's name: "api: value['x'][1]: ...". A lone
  value (an empty path) keeps its message."""
  if not path:
    return error
  name = leaf_name(structure, path, root)
  message = str(error)
  api, sep, rest = message.partition(": ")
  text = f"{api}: {name}: {rest}" if sep else f"{message} (at {name})"
  try:
    return type(error)(text)
  except TypeError:  # an exception class with other constructor arguments
    return error


# -- a module's state_dict() in a nest ---------------------------------------------
# Module.state_dict() returns an OrderedDict carrying `_metadata` (the version
# of each submodule's layout, which load_state_dict reads). optree rebuilds an
# OrderedDict without it, and refuses to re-register the built-in type; so such
# a dict is walked as a _StateDict, whose node data keeps the metadata.


class _StateDict(collections.OrderedDict):
  """An OrderedDict with `_metadata` while a nest is walked (see above)."""


class _StateDictFound(Exception):
  """Raised by `_is_leaf_checked`: the nest holds a state_dict(); walk it again marked."""


def _state_dict_children(d):
  keys = tuple(d.keys())
  return list(d.values()), (keys, d._metadata), keys


def _state_dict_from(data, children):
  keys, metadata = data
  out = collections.OrderedDict(zip(keys, children))
  out._metadata = metadata
  return out


optree.register_pytree_node(
  _StateDict,
  _state_dict_children,
  _state_dict_from,
  path_entry_type=optree.MappingEntry,
  namespace=_NAMESPACE,
)


def _has_metadata(x):
  return type(x) is collections.OrderedDict and hasattr(x, "_metadata")


def _is_leaf_checked(x):
  """`_is_leaf` (inlined: it runs for every node), raising at a state_dict()."""
  if isinstance(x, DistributedValues):
    return True
  if isinstance(x, torch.Tensor):
    return False
  if type(x) is collections.OrderedDict and hasattr(x, "_metadata"):
    raise _StateDictFound
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    _register_dataclass(type(x))
  return False


def _mark(x):
  if not _has_metadata(x):
    return x
  out = _StateDict(
    (k, v if isinstance(v, torch.Tensor) else _mark_state_dicts(v)) for k, v in x.items()
  )
  out._metadata = x._metadata
  return out


def _mark_state_dicts(structure):
  return optree.tree_map(
    _mark,
    structure,
    is_leaf=lambda x: _has_metadata(x) or _is_leaf(x),
    none_is_leaf=True,
    namespace=_NAMESPACE,
  )


def _nested(op, *structures):
  """op(*structures); walked a second time, marked, when they hold a state_dict()
  (the first walk stops at it, before `op` calls anything on a leaf)."""
  try:
    return op(*structures)
  except _StateDictFound:
    return op(*[_mark_state_dicts(s) for s in structures])
