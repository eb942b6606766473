"""What a checkpoint holds of each object, and how a saved value is checked and
applied (see __init__.py; shared by its file and sharded formats)."""

import copy

import torch

from xladist.checkpoint.file_io import api_name, check_plain
from xladist.input import order
from xladist.input.dataset import DistributedDataset, DistributedIterator
from xladist.replica_copies import copies_of
from xladist.sharded_state import full_shape

MODULE, STATEFUL, ITERATOR, TENSOR, VALUE = (
  "module",
  "stateful",
  "iterator",
  "tensor",
  "value",
)


def kind_of(name, obj):
  if isinstance(obj, torch.nn.Module):
    return MODULE
  if isinstance(obj, DistributedIterator):
    return ITERATOR
  if isinstance(obj, torch.Tensor):
    return TENSOR
  if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
    return STATEFUL
  if isinstance(obj, DistributedDataset):
    raise TypeError(
      f"xladist.checkpoint.Checkpoint: {name}= is a DistributedDataset, which has "
      "no position; pass the iterator instead: it = iter(dist_dataset); "
      f"Checkpoint({name}=it)."
    )
  check_plain(obj, f"{name}=", "xladist.checkpoint.Checkpoint")
  return VALUE


def apply(ckpt, name, kind, obj, value):
  if kind in (MODULE, STATEFUL, ITERATOR):
    obj.load_state_dict(value)
  elif kind == TENSOR:
    with torch.no_grad():
      obj.copy_(value)
  else:
    ckpt._objects[name] = value


def snapshot(ckpt, name, kind, obj):
  """A function that puts `obj` back as it is now (lazy copies: on XLA nothing
  is computed unless it is called)."""
  if kind == MODULE:
    state = {
      k: v.detach().clone() if isinstance(v, torch.Tensor) else v
      for k, v in obj.state_dict().items()
    }
    copies = [(t, c.stacked) for t in obj.buffers() if (c := copies_of(t)) is not None]

    def undo():
      obj.load_state_dict(state)
      for t, stacked in copies:
        c = copies_of(t)
        c.stacked = stacked
        c.restamp(t)

    return undo
  if kind == STATEFUL:
    state = copy.deepcopy(obj.state_dict())
    return lambda: obj.load_state_dict(state)
  if kind == TENSOR:
    old = obj.detach().clone()

    def undo_tensor():
      with torch.no_grad():
        obj.copy_(old)

    return undo_tensor
  if kind == ITERATOR:
    # Not state_dict(): it refuses persistent workers, which a restore allows.
    state, host = obj._state(), order.host_rng_state()

    def undo_iterator():
      obj.load_state_dict(state)
      order.set_host_rng_state(host)

    return undo_iterator
  old_value = ckpt._objects[name]

  def undo_value():
    ckpt._objects[name] = old_value

  return undo_value


def check_entry(path, name, kind, obj, value, saved_class=None):
  """Raises ValueError when `value` cannot be applied to `obj` (before any change)."""
  where = f"{api_name('restore')}: {name!r} in {str(path)!r}"
  if (
    saved_class is not None
    and kind in (MODULE, STATEFUL)
    and (saved_class != type(obj).__qualname__)
  ):
    raise ValueError(
      f"{where} was saved from a {saved_class} and is restored into a "
      f"{type(obj).__qualname__}; the state of one class does not fit another. "
      f"Restore it into a {saved_class}, or leave {name!r} out of the checkpoint "
      "you restore."
    )
  if isinstance(obj, torch.optim.Optimizer):
    check_optimizer(where, obj, value)
  if kind == MODULE:
    current = obj.state_dict()
    missing = sorted(set(current) - set(value))
    unexpected = sorted(set(value) - set(current))
    if missing or unexpected:
      raise ValueError(
        f"{where} does not fit {type(obj).__name__}: missing keys {missing}, "
        f"unexpected keys {unexpected}; restore into the model that was saved."
      )
    for key, t in current.items():
      if isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(value[key].shape):
        raise ValueError(
          f"{where} does not fit {type(obj).__name__}: {key} has shape "
          f"{tuple(value[key].shape)} in the file and {tuple(t.shape)} in the "
          "model; restore into the model that was saved."
        )
  elif kind == TENSOR:
    if tuple(obj.shape) != tuple(value.shape):
      raise ValueError(
        f"{where} has shape {tuple(value.shape)} but the tensor has shape "
        f"{tuple(obj.shape)}; restore into a tensor of the saved shape."
      )
  elif kind == ITERATOR:
    obj._check_state(value, where)


def check_optimizer(where, optimizer, value):
  """The checks torch's Optimizer.load_state_dict does, and more, before any change:
  the param groups, their hyperparameters, and each state tensor's shape."""
  name = type(optimizer).__name__
  groups = value.get("param_groups") if isinstance(value, dict) else None
  if not isinstance(groups, list) or "state" not in value:
    raise ValueError(
      f"{where} is not an optimizer's state dict (no param_groups / "
      f"state); restore it into the object that was saved."
    )
  current = optimizer.param_groups
  if len(groups) != len(current):
    raise ValueError(
      f"{where} has {len(groups)} parameter groups, the {name} has {len(current)}; "
      "restore into an optimizer made with the same parameter groups."
    )
  params = []
  for i, (saved, group) in enumerate(zip(groups, current)):
    if len(saved["params"]) != len(group["params"]):
      raise ValueError(
        f"{where}: parameter group {i} has {len(saved['params'])} parameters in the "
        f"file and {len(group['params'])} in the {name}; restore into an optimizer "
        "of the same model."
      )
    missing = sorted(set(group) - set(saved) - {"params"})
    if missing:
      raise ValueError(
        f"{where}: parameter group {i} lacks the {name} hyperparameters {missing}; "
        "it was saved from another optimizer class. Restore into the optimizer "
        "class that was saved."
      )
    params.extend(zip(saved["params"], group["params"]))
  for key, p in params:
    state = value["state"].get(key, {})
    for slot, t in state.items():
      if isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) != full_shape(p):
        raise ValueError(
          f"{where}: the state {slot!r} of a parameter has shape {tuple(t.shape)} in "
          f"the file, but the {name}'s parameter has shape {full_shape(p)}; "
          "restore into an optimizer of the model that was saved."
        )
