"""Which rows of each global batch a host feeds (multi-host input).

Policy (like TF's `AutoShardPolicy.DATA`): every host iterates the same
sequence of global batches (same data, same order, same shuffling seed) and
keeps only its own rows. Replicas are numbered host by host, so with
`num_hosts` hosts and `rph = num_replicas // num_hosts` replicas per host, host
`h` feeds replicas `[h*rph, (h+1)*rph)`, that is rows
`[h*B/num_hosts, (h+1)*B/num_hosts)` of each global batch of B rows, and
replica r gets rows `[r*B/num_replicas, (r+1)*B/num_replicas)`, as on one host.

Example, 2 hosts x 2 replicas, global batch of 8 rows:

  host 0 keeps rows 0..3 (replica 0: rows 0, 1; replica 1: rows 2, 3)
  host 1 keeps rows 4..7 (replica 2: rows 4, 5; replica 3: rows 6, 7)

Every host reads (and decodes) every global batch, which costs input
bandwidth but needs no coordination and keeps the global batch identical to a
single-host run. The alternative, TF's `AutoShardPolicy.FILE`-like policy, gives
each host disjoint data (every `num_hosts`-th file or batch, e.g. via
`distribute_datasets_from_function` and `InputContext.input_pipeline_id`); it
reads each example once but the global batch then depends on the host count.

These are pure functions (no devices). MultiWorkerMirroredStrategy uses them
(through `dataset.from_dataset` / `from_datasets` with `hosts=`): the host
pads a partial global batch and splits it between all replicas exactly as one
host would, then keeps its replicas' rows, so padding masks and partial-batch
errors are the same on every host. `distribute_datasets_from_function` gets
one `InputContext` per pipeline of this host (`input_contexts`):
`input_pipeline_id` is the host index (PER_WORKER) or the global replica id
(PER_REPLICA).
"""

import numpy as np
import torch

from xladist import _nest
from xladist.input.options import InputContext


def _check_int(value, name, api, minimum):
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{api}: {name} must be an int, got {type(value).__name__} {value!r}.")
  if value < minimum:
    raise ValueError(f"{api}: {name} must be >= {minimum}, got {value}.")


def host_replica_ids(num_hosts, host_index, num_replicas):
  """The global replica ids host `host_index` feeds: `range(h*rph, (h+1)*rph)`.

  Raises:
    TypeError: an argument is not an int.
    ValueError: an argument is out of range, or `num_replicas` is not a
      multiple of `num_hosts`.
  """
  api = "host_replica_ids"
  _check_int(num_hosts, "num_hosts", api, 1)
  _check_int(host_index, "host_index", api, 0)
  _check_int(num_replicas, "num_replicas", api, 1)
  if host_index >= num_hosts:
    raise ValueError(
      f"{api}: host_index {host_index} is out of range for {num_hosts} "
      f"hosts (0 .. {num_hosts - 1})."
    )
  if num_replicas % num_hosts:
    raise ValueError(
      f"{api}: {num_replicas} replicas cannot be spread evenly over {num_hosts} hosts; "
      "every host must run the same number of replicas."
    )
  per_host = num_replicas // num_hosts
  return range(host_index * per_host, (host_index + 1) * per_host)


def host_row_range(global_batch_size, num_hosts, host_index, num_replicas):
  """The rows `(start, stop)` of a global batch that host `host_index` keeps.

  Raises:
    TypeError: an argument is not an int.
    ValueError: an argument is out of range, `num_replicas` is not a multiple of
      `num_hosts`, or `global_batch_size` is not a multiple of `num_replicas`.
  """
  replicas = host_replica_ids(num_hosts, host_index, num_replicas)
  _check_int(global_batch_size, "global_batch_size", "host_row_range", 0)
  if global_batch_size % num_replicas:
    raise ValueError(
      f"host_row_range: the global batch size {global_batch_size} is not divisible by "
      f"the {num_replicas} replicas; use a multiple of {num_replicas} (drop or pad "
      "the last partial batch)."
    )
  per_replica = global_batch_size // num_replicas
  return replicas.start * per_replica, replicas.stop * per_replica


def _rows(leaf, start, stop):
  if isinstance(leaf, (torch.Tensor, np.ndarray)):
    if leaf.ndim == 0:
      raise ValueError(
        f"host_batch: a batch holds a scalar ({leaf!r}); every tensor "
        "needs a batch dimension (dim 0) to be split between hosts."
      )
    return leaf[start:stop]
  return leaf


def _batch_size(leaves):
  sizes = {
    leaf.shape[0] for leaf in leaves if isinstance(leaf, (torch.Tensor, np.ndarray)) and leaf.ndim
  }
  if not sizes:
    raise ValueError(
      "host_batch: a batch holds no tensor or array; there is nothing to split between hosts."
    )
  if len(sizes) > 1:
    raise ValueError(
      f"host_batch: the tensors of one batch have different sizes in "
      f"dim 0 ({sorted(sizes)}); all must have the batch size there."
    )
  return sizes.pop()


def host_batch(global_batch, num_hosts, host_index, num_replicas):
  """This host's rows of one global batch (any nest of tensors / arrays, dataclasses too).

  Non-tensor leaves (strings, ints) are kept whole.

  Raises:
    TypeError, ValueError: as `host_row_range`, or the batch's tensors have no
      common batch size.
  """
  leaves, spec = _nest.flatten(global_batch)
  start, stop = host_row_range(_batch_size(leaves), num_hosts, host_index, num_replicas)
  return _nest.unflatten(spec, [_rows(leaf, start, stop) for leaf in leaves])


class HostShardedDataset:
  """A re-iterable view of `dataset` (global batches) that yields this host's rows.

  Example (host 1 of 2, 4 replicas in all, DataLoader of global batches of 8):

    >>> local = HostShardedDataset(loader, num_hosts=2, host_index=1, num_replicas=4)
    >>> next(iter(local))[0].shape[0]     # rows 4..7 of the first global batch
    4

  Raises:
    TypeError: `dataset` is not iterable, or an argument is not an int.
    ValueError: as `host_replica_ids` (checked now) and `host_row_range`
      (checked per batch).
  """

  def __init__(self, dataset, num_hosts, host_index, num_replicas):
    if not hasattr(dataset, "__iter__"):
      raise TypeError(
        f"HostShardedDataset: dataset must be an iterable of global "
        f"batches, got {type(dataset).__name__}."
      )
    host_replica_ids(num_hosts, host_index, num_replicas)
    self.dataset = dataset
    self.num_hosts = num_hosts
    self.host_index = host_index
    self.num_replicas = num_replicas

  def __iter__(self):
    for batch in self.dataset:
      yield host_batch(batch, self.num_hosts, self.host_index, self.num_replicas)


def input_context_for_host(num_hosts, host_index, num_replicas):
  """The `InputContext` of host `host_index`'s input pipeline (one per host).

  Raises:
    TypeError, ValueError: as `host_replica_ids`.
  """
  host_replica_ids(num_hosts, host_index, num_replicas)
  return InputContext(
    num_input_pipelines=num_hosts, input_pipeline_id=host_index, num_replicas_in_sync=num_replicas
  )


def shard_for_input_context(global_batch, input_context):
  """`host_batch` for the pipeline an `InputContext` describes.

  Raises:
    TypeError: `input_context` is not an `InputContext`.
    ValueError: as `host_batch`.
  """
  if not isinstance(input_context, InputContext):
    raise TypeError(
      f"shard_for_input_context: input_context must be an InputContext, "
      f"got {type(input_context).__name__} {input_context!r}."
    )
  return host_batch(
    global_batch,
    input_context.num_input_pipelines,
    input_context.input_pipeline_id,
    input_context.num_replicas_in_sync,
  )


def input_contexts(num_hosts, host_index, num_replicas, per_replica=False):
  """The `InputContext`s of host `host_index`'s input pipelines, in replica order.

  PER_WORKER (`per_replica=False`): one pipeline, `input_pipeline_id` = host
  index, `num_input_pipelines` = number of hosts. PER_REPLICA: one pipeline
  per local replica, `input_pipeline_id` = its global replica id,
  `num_input_pipelines` = `num_replicas`. With one host these are the
  contexts of a single-host strategy.

  Raises:
    TypeError, ValueError: as `host_replica_ids`.
  """
  replicas = host_replica_ids(num_hosts, host_index, num_replicas)
  if per_replica:
    return [InputContext(num_replicas, r, num_replicas) for r in replicas]
  return [InputContext(num_hosts, host_index, num_replicas)]
