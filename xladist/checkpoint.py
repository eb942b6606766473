"""Checkpoints: save training state and resume from it exactly.

`Checkpoint` is tf.train.Checkpoint for PyTorch objects, `CheckpointManager`
keeps numbered checkpoints in a directory (tf.train.CheckpointManager), and
`PreemptionCheckpointHandler` saves one when the job is told to stop
(tf.distribute.experimental.PreemptionCheckpointHandler).

Example::

  import xladist.checkpoint as xc

  with strategy.scope():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  iterator = iter(strategy.experimental_distribute_dataset(loader))
  ckpt = xc.Checkpoint(model=model, optimizer=optimizer, iterator=iterator)
  manager = xc.CheckpointManager(ckpt, "/tmp/run1", max_to_keep=3)
  handler = xc.PreemptionCheckpointHandler(manager)   # SIGTERM -> save, exit
  manager.restore_or_initialize()     # resumes model, optimizer, iterator, RNGs
  while handler.total_run_calls < num_steps:
    handler.run(train_step, next(iterator))

Two formats, chosen when saving with `CheckpointOptions(sharded=...)` (on a
`save` or for every save of a `CheckpointManager`); a restore reads either:

* a file (the default, for one host): an ordinary `torch.save` file holding
  CPU tensors. The state dict of a model saved from a strategy with any number
  of replicas is `torch.load(path)["objects"]["model"]["value"]`, and it loads
  into the same model made without xladist. The chief copies the whole state
  to host memory at once and writes it.
* sharded (`sharded=True`, for pods and large models): a directory written with PyTorch's
  distributed checkpoint (`torch.distributed.checkpoint`, DCP) and torch_xla's
  SPMD planners. Each host writes only what it holds: its shards of a tensor
  sharded over the devices, and a share of the replicated tensors (each is
  written once, by the host with the least to write so far), one tensor at a
  time through host memory. At restore each host reads only what its tensors
  need. The directory holds DCP's files (`__<rank>_<n>.distcp`, `.metadata`)
  and xladist's manifest `xladist.pt` (kinds, layouts, the SHA-256 of every
  file); `torch.distributed.checkpoint.load({"model": model.state_dict()},
  checkpoint_id=path)` reads it without xladist. On several hosts it needs
  torch.distributed's default process group, one process per host:
  `import torch_xla.distributed.xla_backend` and
  `torch.distributed.init_process_group("gloo", init_method="xla://")` on
  every host after making the strategy.

Paths are file system paths; URLs (`gs://...`) are refused: mount a bucket
(Cloud Storage FUSE) and give the mount's path.

What is saved:

* `torch.nn.Module`, `torch.optim.Optimizer` and any object with `state_dict()`
  and `load_state_dict()` (LR schedulers, GradScaler): the state dict with every
  tensor copied to the CPU. Mirrored state holds one value on every replica, so
  the saved values do not depend on the replica count. Restoring calls
  `load_state_dict`: parameters made under `strategy.scope()` keep their
  identity and stay replicated on the strategy's devices.
* `DistributedIterator`: its position, the number of elements `next()`
  returned in the current epoch (elements only prefetched are not counted).
  Restoring into an iterator of the same dataset (typically a fresh
  `iter(dist_dataset)`) restarts its epoch and skips that many elements without
  transferring them, so its next element is the one that would have come next.
* tensors: their values (restored in place, so the caller's tensor changes);
  other values (numbers, strings, None, and lists, tuples and dicts of them):
  restored as attributes of the checkpoint (`ckpt.epoch`).
* The random number generators: torch's CPU generator, numpy's and Python's
  global generators, and torch_xla's seed when an xladist strategy runs on XLA
  devices in this process. They are restored too (after the iterators are
  restarted), so random draws of the training loop and of XLA random ops
  continue as in an uninterrupted run. Draws made inside the dataset happen in
  the prefetch thread, ahead of the steps, at times that depend on thread
  scheduling: give such a dataset its own generator, seeded per epoch.

Saves are atomic: a file is written to a temporary file in the same
directory, flushed and fsynced, renamed onto the final name, then the
directory is fsynced; a sharded checkpoint is written into a hidden temporary
directory beside the target (files fsynced, the manifest last) and renamed
onto it. A crash or preemption during a save leaves the previous checkpoint
intact. Every checkpoint carries SHA-256 digests of its content: a truncated
or damaged one is refused with a ValueError naming it, before any object is
changed (a sharded checkpoint is read into new buffers, each file checked
before it is read, and applied only once all of it was read).

Exact resumption of a shuffled DataLoader needs a generator whose state does
not depend on when the epoch started: pass `generator=torch.Generator().
manual_seed(seed + epoch)` to the DataLoader of each epoch (the global
generator has moved on since the saved epoch began).

Several hosts (MultiWorkerMirroredStrategy), file format: only the chief
writes. `save`, `write` and `CheckpointManager.save` ask the current strategy's
`extended.should_checkpoint` (outside any scope: whether this process joined
its cluster as the chief). Every host still builds the checkpoint's content:
reading XLA values back may execute pending steps, which are SPMD programs
all hosts must run together, and a value a checkpoint cannot hold fails on
every host alike. A non-chief host then writes nothing: TF has non-chief
workers write to a temporary location and delete it, so that they take part
in the reads of the save; here those reads happen before any file is touched,
so a temporary file would only cost disk traffic. A non-chief
`CheckpointManager` deletes nothing either, and its `save` returns the path the
chief writes (number checkpoints explicitly, `save(checkpoint_number=step)`,
when the hosts' views of the directory may differ). Every host restores from
the chief's file, so put the directory on a file system all hosts share. With
the sharded format every host writes its part into the same directory (on the
shared file system), the chief (DCP's coordinator, rank 0) writes the index
and the manifest and renames the directory into place, and only the chief's
manager deletes old checkpoints.

`read(path)` returns a checkpoint's content without restoring it.
"""

import os
import re
import shutil
import signal
import sys
import threading
import weakref

import torch

from xladist import _checkpoint_sharded, _multihost, context
from xladist._checkpoint_io import (
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
from xladist._checkpoint_objects import (
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
from xladist.reduce_util import ReduceOp


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
  if not _checkpoint_sharded.is_sharded(path):
    return load(path, api)
  manifest = _checkpoint_sharded.load_manifest(path, api)
  targets = {
    name: _checkpoint_sharded.fresh_tensors(entry["value"], {})
    for name, entry in manifest["objects"].items()
  }
  rng = _checkpoint_sharded.fresh_tensors(manifest["rng"], {})
  values, rng = _checkpoint_sharded.load(path, manifest, targets, rng, api)
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

  def __delattr__(self, name):
    if name not in self._objects:
      raise AttributeError(f"{type(self).__name__} has no object named {name!r}")
    del self._objects[name]

  def __repr__(self):
    return f"Checkpoint({', '.join(self._objects)})"

  def _state(self, api):
    """name -> {"kind", "value" (tensors where they live), and "class"}."""
    _require_outside_step("save")
    objects = {}
    for name, obj in self._objects.items():
      kind = kind_of(name, obj)
      if kind in (MODULE, STATEFUL):
        value = obj.state_dict()
        check_plain(value, f"{name}.state_dict()", api)
      elif kind == ITERATOR:
        value = obj._checkpoint_state(api, name)
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
      import torch_xla

      _multihost.wait_for_hosts(xla, f"{api}: the steps that compute the values")
      cpu = torch_xla._XLAC._xla_get_cpu_tensors(xla)
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
      _checkpoint_sharded.save(target, self._state(api), rng_state(), api)
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
    sharded = _checkpoint_sharded.is_sharded(where)
    content = (_checkpoint_sharded.load_manifest if sharded else load)(where, api)
    saved = content["objects"]
    checked = []
    for name, obj in self._objects.items():
      if name not in saved:
        if isinstance(obj, PreemptionCheckpointHandler):
          continue  # a checkpoint saved before the handler existed: 0 steps run
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
      check_entry(where, name, kind, obj, entry["value"], entry.get("class"))
      checked.append((name, kind, obj, entry["value"]))
    rng = content["rng"]
    if sharded:  # read now, into new buffers: the objects are still untouched
      targets = {
        name: _checkpoint_sharded.fresh_tensors(layout, _likes(kind, obj, layout))
        for name, kind, obj, layout in checked
      }
      rng = _checkpoint_sharded.fresh_tensors(rng, {})
      values, rng = _checkpoint_sharded.load(where, content, targets, rng, api)
      checked = [(name, kind, obj, values[name]) for name, kind, obj, _ in checked]
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
  tensor at that path takes (see `_checkpoint_sharded.fresh_tensors`). An
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
  modes = context._stack.modes
  if modes and modes[-1].replica_context is not None:
    raise RuntimeError(
      f"{api_name(what)} was called inside strategy.run; the step is being traced "
      "and its values cannot be read or replaced. Call it between steps, after "
      "strategy.run returns."
    )


# -- CheckpointManager ------------------------------------------------------------


class CheckpointManager:
  """Keeps numbered checkpoints of one `Checkpoint` in a directory.

  Checkpoints are `<directory>/<checkpoint_name>-<number>.pt` files, or, with
  `options=CheckpointOptions(sharded=True)`, `<checkpoint_name>-<number>`
  directories; the list of checkpoints (of both formats) is read from the
  directory, so it needs no index file and a restarted job sees what an earlier
  one wrote. They are ordered as they were
  saved (by modification time, as TF's manager orders by save time): the
  newest is the last saved, whatever its number, and `max_to_keep` is a hard
  bound in that order.

  One manager of a name owns its files in a directory: a second live manager of
  the same name and directory (in this process or another) is refused, since
  its rotation would delete the first one's checkpoints. The claim is a lock
  on `<directory>/.<checkpoint_name>.lock`, released by `close()`, when the
  manager is garbage-collected, or when its process ends. A host that does not
  write checkpoints (not the chief) takes no lock.

  Args:
    checkpoint: the `Checkpoint` to save and restore.
    directory: where the files go (created when needed).
    max_to_keep: how many checkpoints to keep; after a save the oldest beyond
      this are deleted. None keeps all.
    checkpoint_name: the file name prefix.
    options: the `CheckpointOptions` of its saves (default: the file format).

  Raises:
    TypeError: `checkpoint` is not a Checkpoint, or `options` not a
      CheckpointOptions.
    ValueError: `max_to_keep` is not None or a positive int,
      `checkpoint_name` is empty or holds a path separator, or `directory` is a
      URL.
    RuntimeError: another live manager already keeps `checkpoint_name` files
      in `directory` (the error names its process).
  """

  def __init__(self, checkpoint, directory, max_to_keep=5, checkpoint_name="ckpt", options=None):
    api = "xladist.checkpoint.CheckpointManager"
    if not isinstance(checkpoint, Checkpoint):
      raise TypeError(
        f"{api}: checkpoint must be an xladist.checkpoint.Checkpoint, got "
        f"{type(checkpoint).__name__}; wrap the objects: Checkpoint(model=model, ...)."
      )
    if max_to_keep is not None and (
      isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
    ):
      raise ValueError(
        f"{api}: max_to_keep must be a positive int or None (keep all), got {max_to_keep!r}."
      )
    if (
      not isinstance(checkpoint_name, str)
      or not checkpoint_name
      or any(sep in checkpoint_name for sep in ("/", os.sep))
    ):
      raise ValueError(
        f"{api}: checkpoint_name must be a non-empty file name prefix without a "
        f"path separator, got {checkpoint_name!r}."
      )
    self._options = _options(options, api)
    self._checkpoint = checkpoint
    self._directory = local_path(directory, api)
    self._max_to_keep = max_to_keep
    self._name = checkpoint_name
    # ckpt-3.pt (a file) or ckpt-3 (a sharded checkpoint's directory)
    self._pattern = re.compile(re.escape(checkpoint_name) + r"-(\d+)(\.pt)?")
    self._lock = None
    if should_write():
      self._lock = _claim(self._directory, checkpoint_name, api)
      self._release = weakref.finalize(self, _release_claim, self._lock)

  def close(self):
    """Releases this manager's claim on its files (another manager may take them)."""
    if self._lock is not None:
      self._release()
      self._lock = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False

  @property
  def checkpoint(self):
    return self._checkpoint

  @property
  def directory(self):
    return self._directory

  def _numbered(self):
    """(number, path) of this manager's checkpoints, in save order (oldest first)."""
    try:
      names = os.listdir(self._directory)
    except FileNotFoundError:
      return []
    found = []
    for name in names:
      m = self._pattern.fullmatch(name)
      if m:
        path = os.path.join(self._directory, name)
        try:
          saved_at = os.stat(path).st_mtime_ns
        except FileNotFoundError:
          continue
        found.append((saved_at, int(m.group(1)), path))
    return [(number, path) for _, number, path in sorted(found)]

  @property
  def checkpoints(self):
    """Paths of the kept checkpoints, oldest first."""
    return [path for _, path in self._numbered()]

  @property
  def latest_checkpoint(self):
    """The path of the newest checkpoint, or None when there is none."""
    numbered = self._numbered()
    return numbered[-1][1] if numbered else None

  def save(self, checkpoint_number=None, options=None):
    """Saves a new checkpoint and deletes the oldest beyond `max_to_keep`.

    Call it on every host. Only the chief deletes checkpoints, and with the
    file format only the chief writes (see `Checkpoint.save`).

    Args:
      checkpoint_number: the number in the name; default: one more than the
        newest checkpoint's (1 for the first). Saving under an existing
        number replaces that checkpoint.
      options: a `CheckpointOptions` for this save (default: the manager's).

    Returns:
      The path written.

    Raises:
      ValueError: `checkpoint_number` is not a non-negative int.
      TypeError: `options` is not a CheckpointOptions.
    """
    api = "xladist.checkpoint.CheckpointManager.save"
    options = self._options if options is None else _options(options, api)
    numbered = self._numbered()
    if checkpoint_number is None:
      checkpoint_number = max(n for n, _ in numbered) + 1 if numbered else 1
    elif (
      isinstance(checkpoint_number, bool)
      or not isinstance(checkpoint_number, int)
      or checkpoint_number < 0
    ):
      raise ValueError(
        "xladist.checkpoint.CheckpointManager.save: checkpoint_number must be a "
        f"non-negative int or None (the next number), got {checkpoint_number!r}."
      )
    if options.sharded:  # every host writes it: the chief's number
      checkpoint_number = _checkpoint_sharded.agree(checkpoint_number, api)
    suffix = "" if options.sharded else ".pt"
    path = os.path.join(self._directory, f"{self._name}-{checkpoint_number}{suffix}")
    self._checkpoint.save(path, options)
    if self._max_to_keep is not None and should_write():
      for _, old in self._numbered()[: -self._max_to_keep]:
        _delete(old)
    return path

  def restore_or_initialize(self):
    """Restores the newest checkpoint if there is one.

    Returns:
      The path restored, or None when the directory holds no checkpoint (the
      objects keep their initial state).

    Raises:
      ValueError: the newest checkpoint is truncated or corrupt (nothing is
        restored; `checkpoints[-2]` can be restored with
        `checkpoint.restore(path)`).
    """
    latest = self.latest_checkpoint
    if latest is None:
      return None
    return self._checkpoint.restore(latest)


def _delete(path):
  """Deletes a checkpoint file, or a sharded checkpoint's directory (renamed to a
  hidden name first, so that it disappears at once)."""
  try:
    if os.path.isdir(path) and not os.path.islink(path):
      parent, base = os.path.split(path)
      hidden = os.path.join(parent, f".{base}.{os.getpid()}.deleted")
      os.rename(path, hidden)
      shutil.rmtree(hidden, ignore_errors=True)
    else:
      os.unlink(path)
  except FileNotFoundError:
    pass


def _claim(directory, name, api):
  """An exclusive lock on `directory/.name.lock` (fcntl.flock), or RuntimeError."""
  import fcntl
  import socket

  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f".{name}.lock")
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    try:
      holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
    finally:
      os.close(fd)
    raise RuntimeError(
      f"{api}: another CheckpointManager keeps the {name!r} checkpoints in "
      f"{directory!r} ({holder}); its rotation and this one's would delete each "
      "other's files. Use another directory or checkpoint_name, or close() the "
      "other manager first."
    ) from None
  os.ftruncate(fd, 0)
  os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
  return fd


def _release_claim(fd):
  import fcntl

  try:
    fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


# -- PreemptionCheckpointHandler --------------------------------------------------


def _default_exit():
  sys.exit(0)


class PreemptionCheckpointHandler:
  """Saves a checkpoint and exits when the job receives SIGTERM between steps.

  Like tf.distribute.experimental.PreemptionCheckpointHandler: wrap each
  training step in `run`. The SIGTERM handler only records the signal; after
  the step that was running (or the next one) finishes, `run` saves a
  checkpoint through the manager, numbered by `total_run_calls`, and calls
  `exit_fn`. The number of completed steps is saved in the manager's
  checkpoint (as "_preemption_handler"), so after `restore_or_initialize()` in
  the restarted job `total_run_calls` says where training stopped.

  The default `exit_fn` is `sys.exit(0)`: a clean exit (finally blocks and
  context managers run) with status 0, so that a scheduler that restarts
  preempted jobs sees success. TF's default exits with status 42 on platforms
  that restart a job on that code; pass `exit_fn=lambda: sys.exit(42)` for
  that behaviour.

  The handler is installed for the main thread's SIGTERM; `close()` (or leaving
  a `with` block) puts the previous handler back.

  On several hosts (MultiWorkerMirroredStrategy, TPUStrategy on a pod) SIGTERM
  may reach only some of them, and a host that leaves alone would leave the
  others stuck in the next step's collectives. So every
  `check_interval_steps` calls the hosts agree (one MAX all-reduce of their
  flags, read back with the cluster's timeout) and, if any host was signalled,
  all save at that same step and call `exit_fn`. A signalled host therefore
  trains up to `check_interval_steps - 1` more steps: choose it so that they
  fit in the notice the platform gives. On one host the flag is checked after
  every step, with no collective.

  Args:
    checkpoint_manager: the `CheckpointManager` that saves.
    exit_fn: called with no argument after the save; if it returns, training
      goes on.
    strategy: the strategy whose hosts agree (default: the current strategy
      when the handler is made or run); needed on several hosts only.
    check_interval_steps: on several hosts, how many `run` calls pass between
      agreements (default 10).

  Raises:
    TypeError: `checkpoint_manager` is not a CheckpointManager, or
      `check_interval_steps` is not a positive int.
    RuntimeError: not created in the main thread (Python delivers signals
      there only).

  Example::

    manager = xc.CheckpointManager(ckpt, directory)
    handler = xc.PreemptionCheckpointHandler(manager)
    manager.restore_or_initialize()
    while handler.total_run_calls < num_steps:
      handler.run(train_step, next(iterator))
  """

  _NAME = "_preemption_handler"

  def __init__(self, checkpoint_manager, exit_fn=None, strategy=None, check_interval_steps=10):
    api = "xladist.checkpoint.PreemptionCheckpointHandler"
    if not isinstance(checkpoint_manager, CheckpointManager):
      raise TypeError(
        f"{api}: checkpoint_manager must be an xladist.checkpoint.CheckpointManager, "
        f"got {type(checkpoint_manager).__name__}."
      )
    if (
      isinstance(check_interval_steps, bool)
      or not isinstance(check_interval_steps, int)
      or check_interval_steps < 1
    ):
      raise TypeError(
        f"{api}: check_interval_steps must be a positive int, got {check_interval_steps!r}."
      )
    self._strategy = (
      strategy
      if strategy is not None
      else (context.get_strategy() if context.has_strategy() else None)
    )
    self._check_interval = check_interval_steps
    if threading.current_thread() is not threading.main_thread():
      raise RuntimeError(
        f"{api} must be created in the main thread: Python runs signal handlers only there."
      )
    self._manager = checkpoint_manager
    self._exit_fn = _default_exit if exit_fn is None else exit_fn
    self._total_run_calls = 0
    self._received = None
    self._previous = signal.signal(signal.SIGTERM, self._on_signal)
    self._closed = False
    checkpoint_manager.checkpoint._objects[self._NAME] = self

  def _on_signal(self, signum, frame):
    # Only record it: the step being traced or run must finish first.
    self._received = signum

  @property
  def total_run_calls(self):
    """The number of `run` calls that finished, counting those of restored runs."""
    return self._total_run_calls

  @property
  def preemption_received(self):
    """True when SIGTERM arrived and no checkpoint was saved for it yet."""
    return self._received is not None

  def state_dict(self):
    return {"total_run_calls": self._total_run_calls}

  def load_state_dict(self, state):
    self._total_run_calls = int(state["total_run_calls"])

  def run(self, fn, *args, **kwargs):
    """Runs `fn(*args, **kwargs)` (one training step) and returns its result.

    If SIGTERM arrived before or during the call, saves a checkpoint after it
    returns and calls `exit_fn`. An exception from `fn` propagates without a
    save (the step did not complete).
    """
    result = fn(*args, **kwargs)
    self._total_run_calls += 1
    self.save_checkpoint_if_preempted()
    return result

  def save_checkpoint_if_preempted(self):
    """Saves a checkpoint and calls `exit_fn` if SIGTERM arrived (on several
    hosts: at an agreement step, if it arrived at any host); else nothing."""
    if _multihost.host_timeout() is None:  # one host
      if self._received is None:
        return
    elif self._total_run_calls % self._check_interval or not self._any_host_signalled():
      return
    self._manager.save(checkpoint_number=self._total_run_calls)
    self._received = None
    self._exit_fn()

  def _any_host_signalled(self):
    """One MAX all-reduce of every host's flag (all hosts call it at the same step)."""
    strategy = self._strategy or (context.get_strategy() if context.has_strategy() else None)
    if strategy is None:
      raise RuntimeError(
        "xladist.checkpoint.PreemptionCheckpointHandler: on several hosts the "
        "hosts agree on when to save through their strategy; pass strategy= or "
        "make the handler inside strategy.scope()."
      )
    flag = int(self._received is not None)
    flags = strategy.experimental_distribute_values_from_function(
      lambda ctx: torch.tensor(flag, dtype=torch.int32)
    )
    anyone = strategy.reduce(ReduceOp.MAX, flags, axis=None)
    _multihost.wait_for_hosts(
      [anyone], "PreemptionCheckpointHandler: the hosts' agreement on a preemption save"
    )
    return bool(anyone.item())

  def close(self):
    """Puts back the SIGTERM handler that was installed before. Idempotent."""
    if not self._closed:
      self._closed = True
      if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, self._previous)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False
