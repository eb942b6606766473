"""What an epoch's data order is drawn from, kept so that a restore replays it.

A shuffling `DataLoader` draws its order when an epoch starts: `iter(loader)`
takes a seed from the loader's generator (torch's global generator when it has
none), and its `RandomSampler` draws the permutation from the same generator
(or from a seed taken from the global one) when the first batch is read. A
`DistributedSampler` takes its order from its seed and `set_epoch`. Restoring
only the position would re-iterate from whatever state those generators have
in the new process: another permutation, silently.

So each `DistributedIterator` captures, at the start of its epoch and before
the dataset is iterated, the state of every random source the dataset's order
can come from:

* torch's, Python's and numpy's global generators;
* every `torch.Generator`, `random.Random` and numpy generator held by the
  DataLoader, its sampler and batch sampler, and their datasets (found by
  attribute, e.g. `sampler.generator`);
* the epoch of every sampler with `set_epoch` (DistributedSampler).

The capture goes into the iterator's checkpoint. A restore puts the sources
back as they were at the epoch's start, iterates the dataset again (the same
draws, in the caller's thread), skips to the saved position, and the checkpoint
then puts the global generators back as they were at the save.

A DataLoader with `persistent_workers=True` keeps its worker processes and
their random state across epochs, which no checkpoint can hold: it is refused
when saved (`check_checkpointable`).
"""

import random

import numpy as np
import torch

_MAX_DEPTH = 4
# Attributes that lead from a DataLoader to the objects its order comes from.
_LINKS = ("sampler", "batch_sampler", "_sampler", "dataset", "datasets", "generator")


def _from_numpy_state(state):
  """A numpy RandomState's state in checkpointable types (tensors, ints, floats)."""
  kind, keys, pos, has_gauss, gauss = state
  return kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)


def _to_numpy_state(state):
  kind, keys, pos, has_gauss, gauss = state
  return kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss


def host_rng_state():
  """torch's CPU, Python's and numpy's global generator states (checkpointable:
  tensors, ints, floats and tuples)."""
  return {
    "torch": torch.get_rng_state(),
    "random": random.getstate(),
    "numpy": _from_numpy_state(np.random.get_state()),
  }


def set_host_rng_state(state):
  torch.set_rng_state(state["torch"])
  version, internal, gauss = state["random"]
  random.setstate((version, tuple(internal), gauss))
  np.random.set_state(_to_numpy_state(state["numpy"]))


def _generator_kind(obj):
  """What kind of random generator `obj` is ("torch", "random", ...), or None."""
  if isinstance(obj, torch.Generator):
    return "torch" if obj.device.type == "cpu" else None
  if isinstance(obj, random.Random):
    return "random"
  if isinstance(obj, np.random.Generator):
    return "numpy_generator"
  if isinstance(obj, np.random.RandomState):
    return "numpy_randomstate"
  return None


def _generator_state(obj, kind):
  """The state of a generator of `kind` (see `_generator_kind`), checkpointable."""
  if kind == "torch":
    return obj.get_state()
  if kind == "random":
    return obj.getstate()
  if kind == "numpy_generator":
    return obj.bit_generator.state
  return _from_numpy_state(obj.get_state())


def _set_generator_state(obj, kind, state):
  if kind == "torch":
    obj.set_state(state)
  elif kind == "random":
    version, internal, gauss = state
    obj.setstate((version, tuple(internal), gauss))
  elif kind == "numpy_generator":
    obj.bit_generator.state = state
  else:
    obj.set_state(_to_numpy_state(state))


def _walk(obj, path, depth, seen):
  """(path, object) for `obj` and what its order attributes lead to."""
  if id(obj) in seen or depth > _MAX_DEPTH:
    return
  seen.add(id(obj))
  yield path, obj
  if isinstance(obj, torch.Tensor | np.ndarray | str | bytes | int | float):
    return
  if isinstance(obj, list | tuple) and path.endswith("datasets"):
    for i, item in enumerate(obj[:64]):
      yield from _walk(item, f"{path}[{i}]", depth + 1, seen)
    return
  attrs = getattr(obj, "__dict__", None)
  if not isinstance(attrs, dict):
    return
  for name, value in attrs.items():
    if value is None or isinstance(value, torch.Tensor | np.ndarray):
      continue
    if name in _LINKS or _generator_kind(value) is not None:
      yield from _walk(value, f"{path}.{name}", depth + 1, seen)


def _sources(datasets):
  """path -> object for every object whose state decides the datasets' order."""
  seen = set()
  found = {}
  for i, dataset in enumerate(datasets):
    root = "dataset" if len(datasets) == 1 else f"datasets[{i}]"
    for path, obj in _walk(dataset, root, 0, seen):
      found[path] = obj
  return found


def capture(datasets):
  """The state the next epoch of `datasets` draws its order from (call right
  before `iter()`): {"host": global generators, "generators": {path: (kind,
  state)}, "epochs": {path: epoch}}."""
  generators, epochs = {}, {}
  for path, obj in _sources(datasets).items():
    kind = _generator_kind(obj)
    if kind is not None:
      generators[path] = kind, _generator_state(obj, kind)
    elif callable(getattr(obj, "set_epoch", None)) and isinstance(getattr(obj, "epoch", None), int):
      epochs[path] = obj.epoch
  return {"host": host_rng_state(), "generators": generators, "epochs": epochs}


def check(datasets, state, api):
  """Raises ValueError when a source saved in `state` has no counterpart of the
  same kind in `datasets` (the checkpoint was made with another pipeline)."""
  found = _sources(datasets)
  for what, entries in (("generator", state["generators"]), ("sampler", state["epochs"])):
    missing = sorted(p for p in entries if p not in found)
    if missing:
      raise ValueError(
        f"{api}: the checkpoint's iterator drew its order from the {what} at "
        f"{', '.join(missing)}, which the dataset being restored does not have; "
        "restore into an iterator of the same dataset pipeline (same DataLoader "
        "arguments, sampler and generator) that the checkpoint was saved with."
      )
  for path, (kind, _) in state["generators"].items():
    if _generator_kind(found[path]) != kind:
      raise ValueError(
        f"{api}: {path} was a {kind} generator when the checkpoint was saved but is "
        f"a {type(found[path]).__name__} now; restore into the same dataset pipeline."
      )


def apply(datasets, state):
  """Puts the random sources of `datasets` back to `state` (from `capture`;
  checked by `check`)."""
  found = _sources(datasets)
  set_host_rng_state(state["host"])
  for path, (kind, value) in state["generators"].items():
    _set_generator_state(found[path], kind, value)
  for path, epoch in state["epochs"].items():
    found[path].set_epoch(epoch)


def check_checkpointable(datasets, api):
  """Raises ValueError for a pipeline whose order or data a restore cannot replay."""
  for path, obj in _sources(datasets).items():
    if (
      isinstance(obj, torch.utils.data.DataLoader)
      and obj.persistent_workers
      and obj.num_workers > 0
    ):
      raise ValueError(
        f"{api}: the iterator reads {path}, a DataLoader with persistent_workers=True: "
        "its worker processes keep their random state from epoch to epoch, which a "
        "checkpoint cannot hold, so a resumed run would not see the same data. Make "
        "the DataLoader with persistent_workers=False (its workers are then seeded "
        "from the loader's generator each epoch, which the checkpoint holds)."
      )
