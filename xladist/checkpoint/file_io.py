"""The checkpoint file: content, digest, RNG states, atomic writes (see __init__.py).

A file is `torch.save` of a dict: "format", "version", "objects" (name ->
{"kind", "value"}, CPU tensors and plain values only), "rng" and "digest", a
SHA-256 over a canonical walk of "objects" and "rng". torch's zip reader checks
no CRC (torch 2.9: a flipped byte of tensor data loads silently), hence the
digest. Files are read with `torch.load(weights_only=True)`.

Values are walked with optree (`map_tensors` through xladist's nests in
_nest.py, `check_plain`), which keeps each container's type; a module state
dict's `_metadata` is carried over too.
"""

import collections
import hashlib
import os
import re
import secrets
import shutil

import optree
import torch

from xladist import _nest
from xladist import runtime as _runtime
from xladist._step import seeds
from xladist.input.order import host_rng_state, set_host_rng_state

FORMAT = "xladist.checkpoint"
VERSION = 1
_PLAIN = (type(None), bool, int, float, str, bytes)


def api_name(name):
  return f"xladist.checkpoint.{name}"


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def local_path(path, api):
  """`path` as a str, refused when it is a URL (gs://...): saves are atomic
  through a rename and managers lock their directory, which object stores do
  not offer."""
  p = os.fsdecode(os.fspath(path))
  if _URL.match(p):
    raise ValueError(
      f"{api}: {p!r} is a URL; xladist writes checkpoints to a file system path "
      "(a save is made atomic by a rename, a CheckpointManager locks its "
      "directory, and object stores offer neither). Mount the bucket (Cloud "
      "Storage FUSE: gcsfuse) and give the path of the mount."
    )
  return p


# -- values <-> file content ----------------------------------------------------


def _is_container(value):
  # The containers a checkpoint holds (torch.load(weights_only=True) reads them
  # back); other pytree nodes of optree's (deque, namedtuple, defaultdict) are
  # leaves here, and refused by check_plain.
  return type(value) in (list, tuple, dict, collections.OrderedDict)


def _path(where, path):
  return where + "".join(f"[{k!r}]" for k in path)


def check_plain(value, where, api):
  """Raises TypeError unless `value` can be saved and loaded back safely.

  The error names the offending leaf by its path (`where[1]['k']`).
  """
  paths, leaves, _ = optree.tree_flatten_with_path(
    value, is_leaf=lambda x: not _is_container(x), none_is_leaf=True
  )
  for path, leaf in zip(paths, leaves):
    for depth, key in enumerate(path):
      bad = [k for k in optree.tree_leaves(key, none_is_leaf=True) if not _is_plain(k)]
      if bad:  # a dict key (tuples of plain values are fine)
        raise _not_plain(_path(where, path[:depth]) + f" key {key!r}", bad[0], api)
    if not _is_plain(leaf):
      raise _not_plain(_path(where, path), leaf, api)


def _is_plain(value):
  return isinstance(value, (torch.Tensor, *_PLAIN))


def _not_plain(where, value, api):
  return TypeError(
    f"{api}: {where} is a {type(value).__name__}, which a checkpoint cannot hold. "
    "A checkpoint holds modules, optimizers, DistributedIterators, objects with "
    "state_dict()/load_state_dict(), tensors, and None, bool, int, float, str, "
    "bytes and lists, tuples and dicts of these (files are read back with "
    "torch.load(weights_only=True)); convert the value to one of these."
  )


def map_tensors(fn, value, *, with_path=False):
  """`value` with every tensor `t` replaced by `fn(t)` (`fn(path, t)` with
  `with_path`: the keys and indices that lead to it). xladist's nests
  (`_nest.tree_map_with_path`, optree) keep each container's type, and a
  module state dict its `_metadata` (the modules' versions, which
  `load_state_dict` passes to `_load_from_state_dict`)."""

  def leaf(path, x):
    if not isinstance(x, torch.Tensor):
      return x
    return fn(path, x) if with_path else fn(x)

  return _nest.tree_map_with_path(leaf, value)


def tensors_by_path(value):
  """{path: tensor} of the tensors in `value` (paths as `map_tensors` gives them)."""
  found = {}

  def record(path, t):
    found[path] = t
    return t

  map_tensors(record, value, with_path=True)
  return found


def tensors(value):
  """The tensors in `value`, in a fixed order."""
  return [x for x in optree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def xla_tensors(value):
  """The XLA tensors in `value`, in a fixed order."""
  return [t for t in tensors(value) if _runtime.is_device_tensor(t)]


def to_cpu(value, copies):
  """`value` with every tensor replaced by a CPU copy (`copies`: id -> CPU tensor)."""

  def cpu(t):
    c = copies.get(id(t))
    return c if c is not None else t.detach().cpu().clone()

  return map_tensors(cpu, value)


def to_meta(value):
  """`value` with every tensor replaced by a tensor of its shape and dtype on the
  meta device (no data): the layout of a state that is stored elsewhere."""
  return map_tensors(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), value)


def digest(value, h=None):
  """SHA-256 over a canonical walk of `value` (tensor bytes, reprs of the rest)."""
  if h is None:
    h = hashlib.sha256()
  if isinstance(value, torch.Tensor):
    t = value.detach().contiguous().reshape(-1)
    h.update(f"T{t.dtype}{tuple(value.shape)}".encode())
    if t.numel() and not t.is_meta:
      h.update(t.view(torch.uint8).numpy().tobytes())
  elif isinstance(value, (list, tuple)):
    h.update(f"{type(value).__name__}{len(value)}(".encode())
    for v in value:
      digest(v, h)
    h.update(b")")
  elif isinstance(value, dict):
    h.update(f"dict{len(value)}{{".encode())
    for k, v in value.items():
      h.update(repr(k).encode())
      digest(v, h)
    h.update(b"}")
  else:
    h.update(f"{type(value).__name__}:{value!r};".encode())
  return h.hexdigest()


def rng_state():
  state = host_rng_state()
  # The XLA seed belongs to the runtime's default device; it is read only once
  # a strategy started the runtime (starting it here would choose a device,
  # and in the wrong mode).
  seed = _runtime.seed()
  if seed is not None:
    state["xla"] = seed
  return state


def set_rng_state(state):
  set_host_rng_state(state)
  if _runtime.is_initialized():
    if "xla" in state:
      _runtime.set_seed(state["xla"])
    seeds.follow_torch_seed(reseed=False)  # the restored XLA state stands


def fsync_dir(directory):
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:  # e.g. Windows: directories cannot be opened; nothing to sync
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def write_atomic(path, content):
  """torch.save(content) to `path` via a fsynced temporary file and a rename."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  # Not tempfile.mkstemp: its files are private (0600); this one gets the
  # permissions of any new file (0666 less the umask).
  tmp = os.path.join(
    directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
  )
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
  try:
    with os.fdopen(fd, "wb") as f:
      torch.save(content, f)
      f.flush()
      os.fsync(f.fileno())
    if os.path.isdir(path) and not os.path.islink(path):
      # A sharded checkpoint of that name: moved aside, replaced, deleted.
      old = f"{tmp}.old"
      os.rename(path, old)
      os.replace(tmp, path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise
  fsync_dir(directory)


def invalid(path, api, reason):
  return ValueError(
    f"{api}: {str(path)!r} is not a valid xladist checkpoint "
    f"(truncated or corrupt): {reason}. Nothing was restored; restore an "
    "earlier checkpoint (CheckpointManager.checkpoints lists them)."
  )


def load(path, api):
  """Reads and verifies a checkpoint file; returns its content (see `checkpoint.read`)."""
  if not os.path.exists(path):
    raise FileNotFoundError(
      f"{api}: no checkpoint file at {str(path)!r}; check the path "
      "(CheckpointManager.latest_checkpoint gives the newest one)."
    )
  try:
    content = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # zip, unpickling and decoding errors of a damaged file
    raise invalid(path, api, f"{type(e).__name__}: {e}") from None
  if not isinstance(content, dict) or content.get("format") != FORMAT:
    raise invalid(path, api, "it holds no xladist checkpoint header")
  if content.get("version") != VERSION:
    raise invalid(path, api, f"format version {content.get('version')!r}, expected {VERSION}")
  try:
    actual = digest({"objects": content["objects"], "rng": content["rng"]})
  except Exception as e:
    raise invalid(path, api, f"{type(e).__name__}: {e}") from None
  if actual != content.get("digest"):
    raise invalid(path, api, "its SHA-256 digest does not match its content")
  return content
