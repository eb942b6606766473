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

The package's files:

* `checkpoint.py`: `Checkpoint` (save, restore, the all-or-nothing apply) and
  `CheckpointOptions`; `read`; `should_write` (whether this process writes).
* `manager.py`: `CheckpointManager` (numbering, rotation, the directory lock).
* `preemption.py`: `PreemptionCheckpointHandler` (SIGTERM, the hosts'
  agreement, the save before exit).
* `objects.py`: what a checkpoint holds of each kind of object, the checks a
  saved value passes before anything changes, the undo snapshots.
* `file_io.py`: the file format (content, digest, RNG states, atomic writes,
  the path rule).
* `sharded.py`: the sharded format (DCP with torch_xla's SPMD planners, the
  manifest, digests of every file).

Iterators are saved through `DistributedIterator.state_dict()` and restored
with its `load_state_dict` (xladist/input/dataset.py).
"""

from xladist.checkpoint.checkpoint import (
  Checkpoint,
  CheckpointOptions,
  read,
  should_write,
)
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
from xladist.checkpoint.manager import CheckpointManager
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
from xladist.checkpoint.preemption import PreemptionCheckpointHandler
from xladist.reduce_util import ReduceOp

__all__ = [
  # the API
  "Checkpoint",
  "CheckpointManager",
  "CheckpointOptions",
  "PreemptionCheckpointHandler",
  "read",
  "should_write",
  # helpers the single-module checkpoint.py had at its top level, kept so that
  # no name of xladist.checkpoint disappears
  "FORMAT",
  "ITERATOR",
  "MODULE",
  "STATEFUL",
  "TENSOR",
  "VALUE",
  "VERSION",
  "ReduceOp",
  "api_name",
  "apply",
  "check_entry",
  "check_plain",
  "digest",
  "kind_of",
  "load",
  "local_path",
  "rng_state",
  "set_rng_state",
  "snapshot",
  "tensors_by_path",
  "to_cpu",
  "write_atomic",
  "xla_tensors",
]
