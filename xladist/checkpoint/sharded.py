"""The sharded checkpoint: a directory written by torch.distributed.checkpoint (see __init__.py).

PyTorch's distributed checkpoint (DCP) plans which process writes which part of
every tensor; each process writes its parts to its own files
(`__<rank>_<n>.distcp`, here one per tensor part) and the coordinator (rank 0,
the chief) the plan's index, `.metadata`. torch_xla's SPMD planners
(`torch_xla.experimental.distributed_checkpoint`) teach it XLA tensors: a tensor
sharded over the devices is written and read as the shards this host holds
(`XLAShardedTensor.local_shards`), a replicated one as one whole tensor, written
by one host. xladist adds, in this module:

* atomic saves: everything is written into `.<name>.<token>.tmp` beside the
  target and renamed onto it last;
* a manifest, `xladist.pt` (read with `torch.load(weights_only=True)`): the
  format, each object's kind and class, the layout of its state (every tensor
  a meta tensor: shapes and dtypes, no data), and the SHA-256 of every file
  (DCP checks none). It is written last: a directory without one is no
  checkpoint;
* checks before anything is read: the manifest's digest, then `.metadata`'s
  (which DCP unpickles; here only DCP's metadata classes may be in it), then,
  before DCP reads a data file, that file's;
* restores into fresh buffers, so that the caller applies the values only once
  all of them were read: XLA tensors with the sharding of the object's own
  tensor where that one is sharded (each host reads only its shards), host
  tensors elsewhere (see `fresh_tensors`).

Iterator positions, RNG states, plain values and the preemption handler's step
counter are DCP `Stateful` entries beside the tensors.
"""

import contextlib
import functools
import hashlib
import io
import os
import pickle
import secrets
import shutil
import warnings

import torch

from xladist import runtime as _runtime
from xladist import sharded_state
from xladist.checkpoint.file_io import (
  VERSION,
  digest,
  fsync_dir,
  invalid,
  map_tensors,
  tensors,
  to_meta,
  write_atomic,
)
from xladist.cluster_resolver import _multihost

FORMAT = "xladist.checkpoint.sharded"
MANIFEST = "xladist.pt"
_DCP_METADATA = ".metadata"
# Object names may not start with "__" (Checkpoint refuses them): no clash.
RNG_KEY = "__rng__"


def is_sharded(path):
  """Whether `path` names a sharded checkpoint (a directory) rather than a file."""
  return os.path.isdir(path)


class _Entry:
  """A DCP `Stateful`: gives DCP a value at save and receives it at load (the
  caller applies it later, after every check)."""

  def __init__(self, value):
    self.value = value

  def state_dict(self):
    return self.value

  def load_state_dict(self, state):
    self.value = state


# -- DCP parts, subclassed where xladist needs more ------------------------------


@functools.cache
def _dcp():
  """torch.distributed.checkpoint and the subclasses of its parts (imported on
  first use: DCP and torch_xla's planners cost a second to import)."""
  import dataclasses
  from collections import ChainMap

  import torch.distributed.checkpoint as dcp
  from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
  from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

  SPMDSavePlanner, SPMDLoadPlanner, set_element = _runtime.checkpoint_planners()

  class SavePlanner(SPMDSavePlanner):
    """torch_xla's planner, but a tensor that several hosts hold (replicated)
    is written by the host with the least to write so far, not always by the
    first: on a pod the chief would otherwise write the whole replicated model."""

    def create_global_plan(self, all_plans):
      plans = dedup_save_plans(all_plans)
      plans, metadata = create_default_global_save_plan(plans, rewrite_index_hints=False)
      mappings = dict(ChainMap(*[p.planner_data for p in plans]))
      return plans, dataclasses.replace(metadata, planner_data=mappings)

  class LoadPlanner(SPMDLoadPlanner):
    def load_bytes(self, read_item, value):
      # Non-tensor values as plain values only (torch_xla's planner relies on
      # torch.load's default, which was not always weights_only).
      path = self.mappings[read_item.dest_index.fqn]
      set_element(self.original_state_dict, path, torch.load(value, weights_only=True))

  class Writer(dcp.FileSystemWriter):
    """Remembers the files this process wrote (their digests go in the manifest)."""

    written = ()

    def write_data(self, plan, planner):
      future = super().write_data(plan, planner)
      self.written = sorted({r.storage_data.relative_path for r in future.wait()})
      return future

  class Reader(dcp.FileSystemReader):
    """Checks each file against the manifest before DCP reads it."""

    def __init__(self, path, files, api):
      super().__init__(path)
      self._files = files
      self._api = api
      # Read (and checked) before dcp.load, which takes an error of
      # read_metadata for "no global metadata" and looks for other files.
      self._metadata = self._read_metadata()

    def read_metadata(self, *args, **kwargs):
      return self._metadata

    def _read_metadata(self):
      data = _verified_bytes(self.path, _DCP_METADATA, self._files, self._api)
      try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
      except Exception as e:
        raise invalid(self.path, self._api, f"{_DCP_METADATA}: {type(e).__name__}: {e}") from None
      if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp.metadata.StorageMeta()
      metadata.storage_meta.load_id = self.load_id
      return metadata

    def read_data(self, plan, planner):
      for name in sorted({self.storage_data[i.storage_index].relative_path for i in plan.items}):
        _verify_file(self.path, name, self._files, self._api)
      return super().read_data(plan, planner)

  return dcp, SavePlanner, LoadPlanner, Writer, Reader


class _MetadataUnpickler(pickle.Unpickler):
  """DCP's `.metadata` is a pickle; only DCP's metadata classes, torch's sizes,
  dtypes and layouts and paths may be named in it (as torch.load(weights_only=True)
  allows only tensors and plain values)."""

  _ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
  }

  def find_class(self, module, name):
    obj = None
    if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._ALLOWED:
      obj = super().find_class(module, name)
      if module.endswith(".metadata") and getattr(obj, "__module__", None) != module:
        obj = None  # a name that module imported, not one of its classes
    elif module == "torch":
      found = getattr(torch, name, None)
      if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
        obj = found
    elif module.startswith("pathlib") and name in ("PosixPath", "WindowsPath", "PurePosixPath"):
      obj = super().find_class(module, name)
    if obj is None:
      raise pickle.UnpicklingError(f"{module}.{name} may not be named in DCP metadata")
    return obj


# -- digests ----------------------------------------------------------------------


def _sha256(path):
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      h.update(chunk)
  return h.hexdigest()


def _verify_file(directory, name, files, api):
  expected = files.get(name)
  if expected is None:
    raise invalid(directory, api, f"its manifest lists no file {name!r}")
  try:
    actual = _sha256(os.path.join(directory, name))
  except OSError as e:
    raise invalid(directory, api, f"{name}: {type(e).__name__}: {e}") from None
  if actual != expected:
    raise invalid(directory, api, f"the SHA-256 digest of {name} does not match its manifest")


def _verified_bytes(directory, name, files, api):
  _verify_file(directory, name, files, api)
  with open(os.path.join(directory, name), "rb") as f:
    return f.read()


# -- hosts --------------------------------------------------------------------------


def _hosts(api):
  """True when the hosts of a cluster save together through torch.distributed's
  default process group; False for one process (DCP's no_dist mode).

  Raises:
    RuntimeError: several hosts and no process group of as many processes.
  """
  import torch.distributed as dist

  cluster = _multihost.process_cluster()
  hosts = 1 if cluster is None else cluster.num_workers
  world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
  if hosts == 1 and world == 1:
    return False
  if world != hosts:
    raise RuntimeError(
      f"{api}: a sharded checkpoint of {hosts} host(s) is planned by "
      "torch.distributed.checkpoint over a process group of one process per host, "
      f"but torch.distributed's default group has {world} process(es). On every host, "
      "after making the strategy: import torch_xla.distributed.xla_backend; "
      'torch.distributed.init_process_group("gloo", init_method="xla://"). Or save '
      "with CheckpointOptions(sharded=False) (the chief writes one file)."
    )
  if (dist.get_rank() == 0) != _multihost.process_is_chief():
    raise RuntimeError(
      f"{api}: torch.distributed's rank 0 (DCP's coordinator) must be the chief; "
      f"this process is rank {dist.get_rank()}. Initialise the process group with "
      'init_method="xla://", which numbers the processes as torch_xla does.'
    )
  return True


def agree(value, api):
  """The chief's `value` on every host (a sharded save's name, chosen by each
  host from its own view of the directory)."""
  return _agree(value, _hosts(api))


def _agree(value, distributed):
  """Rank 0's `value` on every process."""
  if not distributed:
    return value
  import torch.distributed as dist

  box = [value]
  dist.broadcast_object_list(box, src=0)
  return box[0]


def _gather_digests(digests, distributed):
  if not distributed:
    return digests
  import torch.distributed as dist

  everyone = [None] * dist.get_world_size()
  dist.all_gather_object(everyone, digests)
  return {k: v for part in everyone for k, v in part.items()}


def _unwrap(error):
  """The first error of a DCP CheckpointException (which wraps each rank's)."""
  failures = getattr(error, "failures", None) or {}
  for wrapped in failures.values():
    if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
      return wrapped[0]
  return error


@contextlib.contextmanager
def _quiet():
  """DCP warns about no_dist on every call, torch_xla 2.9's planner about its
  planner signature and its shards about tensor indexing: none is the user's."""
  with warnings.catch_warnings():
    for message in (
      r"torch\.distributed is disabled",
      r"The function definition for SavePlanner",
      r"Using a non-tuple sequence for multidimensional",
      r"TypedStorage is deprecated",
    ):
      warnings.filterwarnings("ignore", message=message)
    yield


# -- save -------------------------------------------------------------------------------


def save(path, objects, rng, api):
  """Writes a sharded checkpoint directory at `path` (atomically).

  Args:
    objects: name -> {"kind", "value" (tensors where they live, XLA or CPU),
      and "class" for modules and stateful objects}.
    rng: the generator states (`file_io.rng_state()`).
  """
  dcp, SavePlanner, _, Writer, _ = _dcp()
  distributed = _hosts(api)
  # The chief's path and temporary name, on every host.
  path, token = _agree((os.path.abspath(os.fspath(path)), secrets.token_hex(4)), distributed)
  parent, base = os.path.split(path)
  tmp = os.path.join(parent, f".{base}.{token}.tmp")
  coordinator = not distributed or _rank() == 0
  state = {name: _Entry(entry["value"]) for name, entry in objects.items()}
  state[RNG_KEY] = _Entry(rng)
  is_dev = _runtime.is_device_tensor
  xla = [t for t in tensors([e["value"] for e in objects.values()]) if is_dev(t)]
  if xla:
    # One execution for whatever is still pending; DCP then copies each
    # tensor it writes from its device, one at a time.
    _multihost.wait_for_hosts(xla, f"{api}: the steps that compute the values")
    _runtime.sync(xla)
  try:
    os.makedirs(tmp, exist_ok=True)
    # A file per tensor: torch 2.9's writer keeps every tensor of a file in
    # memory until the file is closed (for its safetensors variant), so one
    # file per host would hold the host's whole share at once.
    writer = Writer(tmp, single_file_per_rank=False, thread_count=1, sync_files=True)
    with _quiet():
      try:
        dcp.save(state, storage_writer=writer, planner=SavePlanner(), no_dist=not distributed)
      except dcp.api.CheckpointException as e:
        raise _unwrap(e) from None
    files = _gather_digests({n: _sha256(os.path.join(tmp, n)) for n in writer.written}, distributed)
    if coordinator:
      files[_DCP_METADATA] = _sha256(os.path.join(tmp, _DCP_METADATA))
      manifest = {
        "format": FORMAT,
        "version": VERSION,
        "objects": {
          name: dict(entry, value=to_meta(entry["value"])) for name, entry in objects.items()
        },
        "rng": to_meta(rng),
        "files": files,
      }
      manifest["digest"] = _manifest_digest(manifest)
      write_atomic(os.path.join(tmp, MANIFEST), manifest)
      _commit(tmp, path, token)
  except BaseException:
    if coordinator:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    if distributed:
      import torch.distributed as dist

      dist.barrier()  # the directory is in place (or the save failed) on every host


def _rank():
  import torch.distributed as dist

  return dist.get_rank()


def _manifest_digest(manifest):
  return digest({k: manifest[k] for k in ("objects", "rng", "files")})


def _commit(tmp, path, token):
  """Renames the finished `tmp` onto `path`; an existing checkpoint of that name
  is moved aside first and deleted after (a crash between the two renames leaves
  it under a hidden name, and `path` missing, never half-written)."""
  parent = os.path.dirname(path)
  old = None
  if os.path.lexists(path):
    old = os.path.join(parent, f".{os.path.basename(path)}.{token}.old")
    os.rename(path, old)
  os.rename(tmp, path)
  fsync_dir(parent)
  if old is not None:
    if os.path.isdir(old) and not os.path.islink(old):
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.unlink(old)


# -- restore ---------------------------------------------------------------------------


def load_manifest(path, api):
  """Reads and checks the manifest of the sharded checkpoint at `path`: its
  content with every tensor a meta tensor (see `checkpoint.read`)."""
  manifest_path = os.path.join(path, MANIFEST)
  if not os.path.exists(manifest_path):
    raise invalid(
      path,
      api,
      f"the directory has no {MANIFEST} (a save that did not finish, or not an xladist checkpoint)",
    )
  try:
    manifest = torch.load(manifest_path, map_location="cpu", weights_only=True)
  except Exception as e:
    raise invalid(path, api, f"{MANIFEST}: {type(e).__name__}: {e}") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise invalid(path, api, f"{MANIFEST} holds no xladist sharded checkpoint header")
  if manifest.get("version") != VERSION:
    raise invalid(path, api, f"format version {manifest.get('version')!r}, expected {VERSION}")
  try:
    actual = _manifest_digest(manifest)
  except Exception as e:
    raise invalid(path, api, f"{MANIFEST}: {type(e).__name__}: {e}") from None
  if actual != manifest.get("digest"):
    raise invalid(path, api, f"the SHA-256 digest of {MANIFEST} does not match its content")
  return manifest


def load(path, manifest, targets, rng_target, api):
  """Reads the checkpoint's values into `targets` (name -> the layout of the
  saved value with fresh tensors, see `fresh_tensors`) and `rng_target`.

  Each process reads only what its own tensors need (the shards of sharded
  ones), each file checked against the manifest before it is read.

  Returns:
    (name -> value read, rng states read).
  """
  dcp, _, LoadPlanner, _, Reader = _dcp()
  distributed = _hosts(api)
  state = {name: _Entry(value) for name, value in targets.items()}
  state[RNG_KEY] = _Entry(rng_target)
  reader = Reader(os.fspath(path), manifest["files"], api)
  with _quiet():
    try:
      dcp.load(state, storage_reader=reader, planner=LoadPlanner(), no_dist=not distributed)
    except dcp.api.CheckpointException as e:
      raise _unwrap(e) from None
  values = {name: state[name].value for name in targets}
  xla = [t for t in tensors(list(values.values())) if _runtime.is_device_tensor(t)]
  if xla:
    _runtime.sync(xla)  # the copies into the fresh XLA tensors, in one execution
  return values, state[RNG_KEY].value


# -- state kept as rows (sharded_state.py) -----------------------------------------------


def rows_for_saving(objects):
  """Each device writes its own rows of a sharded tensor: a whole tensor that a
  state dict made from rows (`sharded_state.rows_of`) is saved as the rows, (n,
  k) split over the replicas, its whole shape recorded in the entry's "rows"
  ({path: shape}); `whole_layout` and `rows_to_whole` undo it at a restore."""
  for entry in objects.values():
    shapes = {}

    def to_rows(path, t, shapes=shapes):
      found = sharded_state.rows_of(t)
      if found is None:
        return t
      rows, layout = found
      shapes[path] = tuple(layout.shape)
      return rows

    entry["value"] = map_tensors(to_rows, entry["value"], with_path=True)
    if shapes:
      entry["rows"] = shapes
  return objects


def whole_layout(entry):
  """A manifest entry's layout with the whole shapes of the tensors saved as rows."""
  shapes = entry.get("rows") or {}
  return map_tensors(
    lambda path, t: (
      torch.empty(shapes[path], dtype=t.dtype, device="meta") if path in shapes else t
    ),
    entry["value"],
    with_path=True,
  )


def rows_to_whole(entry, value):
  """A value read from the checkpoint with its rows made whole again."""
  shapes = entry.get("rows") or {}

  def whole(path, t):
    if path not in shapes:
      return t
    n, k = t.shape
    # On the host: the object's load_state_dict cuts it into its own rows (any
    # replica count), as it does with a whole tensor of the file format.
    host = t.cpu() if _runtime.is_device_tensor(t) else t
    return sharded_state.Layout(shapes[path], n, True).from_rows(host)

  return map_tensors(whole, value, with_path=True)


def fresh_tensors(layout, likes):
  """`layout` (a saved value, every tensor a meta tensor) with fresh tensors to
  read into. Where `likes` ({path: tensor}) has an XLA tensor sharded over the
  devices (not replicated) of the same shape and dtype at the same path: an
  XLA tensor with its sharding, so that each host reads only its shards.
  Elsewhere a CPU tensor: a replicated tensor is whole on every host anyway,
  and staging it in host memory keeps device memory at one copy of the model
  (`load_state_dict` then copies one tensor at a time to the devices), as the
  file format does."""

  def fresh(path, meta):
    like = likes.get(path)
    if sharded_state.rows_of(like) is not None:
      like = None  # a whole view computed from rows: no buffer of its own to read into
    if (
      isinstance(like, torch.Tensor)
      and _runtime.is_device_tensor(like)
      and like.shape == meta.shape
      and like.dtype == meta.dtype
      and _is_sharded(like)
    ):
      return _runtime.empty_sharded_like(meta.shape, meta.dtype, like)
    return torch.empty(meta.shape, dtype=meta.dtype)

  return map_tensors(fresh, layout, with_path=True)


_is_sharded = _runtime.is_sharded
