"""`Checkpoint` and `CheckpointOptions`: what a checkpoint holds, how it is saved
and restored, in either format (the user's guide is the package docstring,
xladist/checkpoint/__init__.py); `read` returns a checkpoint's content."""

import torch

from xladist import context, sharded_state
from xladist import runtime as _runtime
from xladist.checkpoint import sharded as _sharded
from xladist.checkpoint.file_io import (
  FORMAT,
  VERSION,
  api_name,
  check_plain,
  digest,
  load,
  local_path,
  rng_state,
  set_rng_state,
  tensors_by_path,
  to_cpu,
  write_atomic,
  xla_tensors,
)
from xladist.checkpoint.objects import (
  ITERATOR,
  MODULE,
  STATEFUL,
  TENSOR,
  VALUE,
  apply,
  check_entry,
  kind_of,
  snapshot,
)
from xladist.cluster_resolver import _multihost


def read(path):
  """Reads and verifies a checkpoint without restoring anything.

  Works on both formats: a file, or the directory of a sharded checkpoint
  (whose tensors are then read whole, into CPU memory; on several hosts every
  host must call it, as DCP plans the read across them).

  Returns:
    Its content, CPU tensors and plain values only: a dict with "format"
    ("xladist.checkpoint" or "xladist.checkpoint.sharded"), "version",
    "objects" (name -> {"kind": "module" | "stateful" | "iterator" | "tensor" |
    "value", "value": the state dict, position or value}), "rng" (the saved
    generator states) and "digest"; a sharded checkpoint adds "files" (name ->
    SHA-256 of each file in its directory).

  Raises:
    FileNotFoundError: there is nothing at `path`.
    ValueError: it is truncated, corrupt, or not an xladist checkpoint.
  """
  api = api_name("read")
  path = local_path(path, api)
  if not _sharded.is_sharded(path):
    return load(path, api)
  manifest = _sharded.load_manifest(path, api)
  targets = {
    name: _sharded.fresh_tensors(entry["value"], {}) for name, entry in manifest["objects"].items()
  }
  rng = _sharded.fresh_tensors(manifest["rng"], {})
  values, rng = _sharded.load(path, manifest, targets, rng, api)
  objects = {name: dict(entry, value=values[name]) for name, entry in manifest["objects"].items()}
  return dict(manifest, objects=objects, rng=rng)


class CheckpointOptions:
  """How a checkpoint is written (tf.train.CheckpointOptions).

  Args:
    sharded: False (the default): one `torch.save` file, written by the chief
      from CPU copies of the whole state. True: a directory written with
      torch.distributed.checkpoint and torch_xla's SPMD planners: every host
      writes only the parts it holds (its shards of a sharded tensor; one copy
      of a replicated tensor is written, by one host), streaming one tensor at
      a time through host memory. Restores read either format (a directory is
      a sharded checkpoint).

  Raises:
    TypeError: `sharded` is not a bool.

  Example::

    ckpt.save("runs/1/step-100", options=xc.CheckpointOptions(sharded=True))
    manager = xc.CheckpointManager(ckpt, "runs/1",
                                   options=xc.CheckpointOptions(sharded=True))
  """

  def __init__(self, sharded=False):
    if not isinstance(sharded, bool):
      raise TypeError(
        "xladist.checkpoint.CheckpointOptions: sharded must be True (a directory "
        "written by torch.distributed.checkpoint) or False (one file), got "
        f"{sharded!r}."
      )
    self._sharded = sharded

  @property
  def sharded(self):
    """Whether saves write the sharded format (a directory) instead of one file."""
    return self._sharded

  def __repr__(self):
    return f"CheckpointOptions(sharded={self._sharded})"


def _options(options, api):
  if options is None:
    return CheckpointOptions()
  if not isinstance(options, CheckpointOptions):
    raise TypeError(
      f"{api}: options must be an xladist.checkpoint.CheckpointOptions or None, got "
      f"{type(options).__name__}; e.g. options=CheckpointOptions(sharded=True)."
    )
  return options


# -- Checkpoint -----------------------------------------------------------------


class Checkpoint:
  """Saves and restores named objects (tf.train.Checkpoint for PyTorch).

  Args:
    **objects: what to save, by name: modules, optimizers, DistributedIterators,
      objects with `state_dict()` / `load_state_dict()`, tensors, and plain
      values (see the module docstring). Each is also an attribute
      (`ckpt.model`); assigning a new attribute adds an object.

  Example::

    ckpt = xc.Checkpoint(model=model, optimizer=opt, iterator=it, epoch=0)
    ckpt.save("/tmp/ckpt.pt")
    ...                                   # in a new process, same objects made
    ckpt.restore("/tmp/ckpt.pt")          # ckpt.epoch is the saved epoch again

  Raises:
    TypeError: an object of a kind a checkpoint cannot hold.
  """

  def __init__(self, **objects):
    object.__setattr__(self, "_objects", {})
    # Names whose objects a checkpoint saved before they were added may lack.
    object.__setattr__(self, "_optional", set())
    for name, obj in objects.items():
      setattr(self, name, obj)

  def __getattr__(self, name):
    objects = self.__dict__.get("_objects", {})
    if name in objects:
      return objects[name]
    raise AttributeError(f"{type(self).__name__} has no object named {name!r}")

  def __setattr__(self, name, obj):
    if name.startswith("__") or hasattr(type(self), name):
      raise ValueError(
        f"xladist.checkpoint.Checkpoint: {name!r} is the name of a Checkpoint "
        "attribute or method; save the object under another name."
      )
    kind_of(name, obj)
    self._objects[name] = obj
    self._optional.discard(name)

  def __delattr__(self, name):
    if name not in self._objects:
      raise AttributeError(f"{type(self).__name__} has no object named {name!r}")
    del self._objects[name]
    self._optional.discard(name)

  def _add_optional(self, name, obj):
    """Adds `obj` under `name`; a restore from a checkpoint without that name
    leaves it as it is (the preemption handler's step counter: a checkpoint
    saved before the handler existed means 0 steps run)."""
    self._objects[name] = obj
    self._optional.add(name)

  def __repr__(self):
    return f"Checkpoint({', '.join(self._objects)})"

  def _state(self, api):
    """name -> {"kind", "value" (tensors where they live), and "class"}."""
    _require_outside_step("save")
    objects = {}
    for name, obj in self._objects.items():
      kind = kind_of(name, obj)
      if kind in (MODULE, STATEFUL):
        value = _module_state(obj) if kind == MODULE else obj.state_dict()
        check_plain(value, f"{name}.state_dict()", api)
      elif kind == ITERATOR:
        try:
          value = obj.state_dict()
        except ValueError as e:
          raise ValueError(f"{api}: {name!r} cannot be saved. {e}") from None
      else:
        value = obj
      objects[name] = {"kind": kind, "value": value}
      if kind in (MODULE, STATEFUL):
        objects[name]["class"] = type(obj).__qualname__
    return objects

  def _content(self, api):
    """The file format's content: CPU copies of everything, and its digest."""
    objects = self._state(api)
    # One transfer for every XLA tensor (each .cpu() alone would run its own
    # program when the tensors are still pending).
    xla = xla_tensors([entry["value"] for entry in objects.values()])
    copies = {}
    if xla:
      _multihost.wait_for_hosts(xla, f"{api}: the steps that compute the values")
      cpu = _runtime.to_host(xla)
      copies = {id(t): c.detach().clone() for t, c in zip(xla, cpu)}
    for entry in objects.values():
      entry["value"] = to_cpu(entry["value"], copies)
    rng = rng_state()
    return {
      "format": FORMAT,
      "version": VERSION,
      "objects": objects,
      "rng": rng,
      "digest": digest({"objects": objects, "rng": rng}),
    }

  def save(self, path, options=None):
    """Writes every object and the RNG states to `path` (atomically).

    Call it outside `strategy.run` (between steps), on every host. Reads
    pending XLA values, which waits for the steps that compute them.

    The file format (the default): only a process whose strategy has
    `extended.should_checkpoint` (the chief) writes the file; the others read
    the values alike and write nothing (see the module docstring).

    The sharded format (`options=CheckpointOptions(sharded=True)`): `path`
    is a directory; every host writes the parts of the tensors it holds, the
    chief the index and xladist's manifest (see the module docstring).

    Args:
      path: the file (or, sharded, the directory) to write; an existing one
        is replaced.
      options: a `CheckpointOptions` (default: the file format).

    Returns:
      `path` (on every host: the file the chief writes).

    Raises:
      RuntimeError: called inside `strategy.run`; a sharded save on several
        hosts with no torch.distributed process group.
      TypeError: a value or state dict holds something a checkpoint cannot.
      ValueError: `path` is a URL (gs://...).
    """
    api = api_name("save")
    target = local_path(path, api)
    if _options(options, api).sharded:
      _sharded.save(target, _sharded.rows_for_saving(self._state(api)), rng_state(), api)
    else:
      content = self._content(api)
      if should_write():
        write_atomic(target, content)
    return path

  def write(self, path, options=None):
    """Same as `save` (TF's counter-less form; xladist's `save` adds no counter)."""
    return self.save(path, options)

  def restore(self, path):
    """Loads `path` into the objects, its RNG states into the generators.

    Reads either format: a file, or a sharded checkpoint's directory. The
    whole checkpoint is read and checked against the objects first; nothing
    changes unless all of it can be applied. Modules and optimizers get
    `load_state_dict` (values land where the objects live: a model made under
    `strategy.scope()` stays replicated on the devices), tensors are copied in
    place, plain values become attributes, iterators restart at the saved
    position. Saved entries with no object of that name are ignored.

    A sharded checkpoint is read into new buffers first: tensors that live on
    XLA devices get buffers with their sharding, so each host reads only the
    shards it holds, and files are checked against their digests before they
    are read.

    Returns:
      `path`.

    Raises:
      FileNotFoundError: nothing at `path`.
      ValueError: the checkpoint is truncated or corrupt; an object of this
        checkpoint is missing from it, is of another kind or has other shapes;
        an iterator of `distribute_datasets_from_function` saved with another
        replica count; `path` is a URL.
      RuntimeError: called inside `strategy.run`.
    """
    _require_outside_step("restore")
    api = api_name("restore")
    where = local_path(path, api)
    sharded = _sharded.is_sharded(where)
    content = (_sharded.load_manifest if sharded else load)(where, api)
    saved = content["objects"]
    checked = []
    for name, obj in self._objects.items():
      if name not in saved:
        if name in self._optional:
          continue
        raise ValueError(
          f"{api}: {where!r} has no object named {name!r} (it has "
          f"{sorted(saved)}); save and restore the same names, or delete the "
          f"attribute (del ckpt.{name}) before restoring."
        )
      entry = saved[name]
      kind = kind_of(name, obj)
      if entry["kind"] != kind:
        raise ValueError(
          f"{api}: {name!r} in {where!r} was saved from a {entry['kind']} "
          f"but is restored into a {kind} ({type(obj).__name__}); restore it into an "
          "object of the kind that was saved."
        )
      whole = _sharded.whole_layout(entry) if sharded else entry["value"]
      check_entry(where, name, kind, obj, whole, entry.get("class"))
      checked.append((name, kind, obj, entry["value"]))
    rng = content["rng"]
    if sharded:  # read now, into new buffers: the objects are still untouched
      targets = {
        name: _sharded.fresh_tensors(layout, _likes(kind, obj, layout))
        for name, kind, obj, layout in checked
      }
      rng = _sharded.fresh_tensors(rng, {})
      values, rng = _sharded.load(where, content, targets, rng, api)
      checked = [
        (name, kind, obj, _sharded.rows_to_whole(saved[name], values[name]))
        for name, kind, obj, _ in checked
      ]
    # Everything was checked; apply in an order where what is cheapest to undo
    # comes last, and undo what was applied if a load_state_dict still fails.
    order = {MODULE: 0, TENSOR: 0, STATEFUL: 1, ITERATOR: 2, VALUE: 3}
    checked.sort(key=lambda item: order[item[1]])
    undo = []
    try:
      for name, kind, obj, value in checked:
        undo.append(snapshot(self, name, kind, obj))
        apply(self, name, kind, obj, value)
    except BaseException:
      for restore_old in reversed(undo):
        try:
          restore_old()
        except Exception:  # an object that cannot take its own state back
          pass
      raise
    set_rng_state(rng)
    return path


def _likes(kind, obj, layout):
  """{path: tensor} of `obj`'s tensors whose device and sharding a restored
  tensor at that path takes (see `_sharded.fresh_tensors`). An
  optimizer's state may not exist yet: its slots take their parameter's."""
  if kind == TENSOR:
    return {(): obj}
  if kind not in (MODULE, STATEFUL):
    return {}
  likes = tensors_by_path(obj.state_dict())
  if isinstance(obj, torch.optim.Optimizer):
    saved_ids = [i for group in layout["param_groups"] for i in group["params"]]
    params = [p for group in obj.param_groups for p in group["params"]]
    for i, p in zip(saved_ids, params):
      for slot in layout["state"].get(i, {}):
        likes.setdefault(("state", i, slot), p)
  return likes


def should_write():
  """Whether this process writes checkpoint files.

  Inside a strategy's scope: its `extended.should_checkpoint`. Outside any
  scope: True unless this process joined a multi-host cluster as a non-chief.
  """
  if context.has_strategy():
    return bool(context.get_strategy().extended.should_checkpoint)
  return _multihost.process_is_chief()


def _require_outside_step(what):
  # TF: save and restore work in cross-replica context and in the default
  # replica context, also inside the default strategy's scope(); only a step
  # (strategy.run, and merge_fn inside it) is refused, by context.in_step's rule.
  if context.in_any_step():
    raise RuntimeError(
      f"{api_name(what)} was called inside strategy.run; the step is being traced "
      "and its values cannot be read or replaced. Call it between steps, after "
      "strategy.run returns."
    )


def _module_state(module):
  """`module.state_dict()` with a tensor shared by several entries (tied
  weights: `head.weight = emb.weight`) stored once: one detached tensor for all
  its names (state_dict() detaches each entry apart, so the file would hold a
  copy per name)."""
  state = module.state_dict(keep_vars=True)
  detached = {}
  for key, value in state.items():
    if isinstance(value, torch.Tensor):
      if id(value) not in detached:
        detached[id(value)] = sharded_state.detach(value)
      state[key] = detached[id(value)]
  return state
