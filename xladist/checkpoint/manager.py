"""`CheckpointManager`: numbered checkpoints of one `Checkpoint` in a directory,
rotated, with one manager per name and directory (a lock file)."""

import os
import re
import shutil
import weakref

from xladist.checkpoint import sharded as _sharded
from xladist.checkpoint.checkpoint import Checkpoint, _options, should_write
from xladist.checkpoint.file_io import local_path


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
      checkpoint_number = _sharded.agree(checkpoint_number, api)
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
