"""`InputContext`, `InputOptions` and `InputReplicationMode` (as in tf.distribute)."""

import dataclasses
import enum


class InputReplicationMode(enum.Enum):
  """How many input pipelines `distribute_datasets_from_function` makes.

  `PER_WORKER`: one pipeline per host (xladist runs one process per host, so
  one pipeline per process, `input_pipeline_id` = host index); its
  consecutive elements go to the host's replicas in order.
  `PER_REPLICA`: one pipeline per replica (`input_pipeline_id` = global
  replica id); replica r gets pipeline r's elements.
  """

  PER_WORKER = "PER_WORKER"
  PER_REPLICA = "PER_REPLICA"


def _check_int(value, name, api, minimum):
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{api}: {name} must be an int, got {type(value).__name__} {value!r}.")
  if value < minimum:
    raise ValueError(f"{api}: {name} must be >= {minimum}, got {value}.")


class InputContext:
  """What `dataset_fn` of `distribute_datasets_from_function` is told.

  Example, two pipelines (`InputReplicationMode.PER_REPLICA`) on 2 replicas:

    >>> def dataset_fn(ctx):
    ...   b = ctx.get_per_replica_batch_size(64)   # 32
    ...   shard = range(ctx.input_pipeline_id, 1024, ctx.num_input_pipelines)
    ...   return DataLoader(Subset(data, list(shard)), batch_size=b)

  Args:
    num_input_pipelines: how many input pipelines there are in total.
    input_pipeline_id: which of them this one is (0 .. num_input_pipelines - 1).
    num_replicas_in_sync: how many replicas take part in each step.

  Raises:
    TypeError: an argument is not an int.
    ValueError: an argument is out of range.
  """

  __slots__ = ("_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync")

  def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
    _check_int(num_input_pipelines, "num_input_pipelines", "InputContext", 1)
    _check_int(input_pipeline_id, "input_pipeline_id", "InputContext", 0)
    _check_int(num_replicas_in_sync, "num_replicas_in_sync", "InputContext", 1)
    if input_pipeline_id >= num_input_pipelines:
      raise ValueError(
        f"InputContext: input_pipeline_id {input_pipeline_id} is out of range for "
        f"{num_input_pipelines} input pipelines (0 .. {num_input_pipelines - 1})."
      )
    self._num_input_pipelines = num_input_pipelines
    self._input_pipeline_id = input_pipeline_id
    self._num_replicas_in_sync = num_replicas_in_sync

  @property
  def num_input_pipelines(self):
    """How many input pipelines there are in total."""
    return self._num_input_pipelines

  @property
  def input_pipeline_id(self):
    """This pipeline's index, 0 .. num_input_pipelines - 1."""
    return self._input_pipeline_id

  @property
  def num_replicas_in_sync(self):
    """How many replicas take part in each step."""
    return self._num_replicas_in_sync

  def get_per_replica_batch_size(self, global_batch_size):
    """`global_batch_size // num_replicas_in_sync`.

    Raises:
      TypeError: `global_batch_size` is not an int.
      ValueError: `global_batch_size` is not divisible by `num_replicas_in_sync`.
    """
    _check_int(global_batch_size, "global_batch_size", "InputContext.get_per_replica_batch_size", 0)
    n = self._num_replicas_in_sync
    if global_batch_size % n:
      raise ValueError(
        f"InputContext.get_per_replica_batch_size: the global batch size "
        f"{global_batch_size} is not divisible by num_replicas_in_sync {n}; use a "
        f"global batch size that is a multiple of {n}."
      )
    return global_batch_size // n

  def __repr__(self):
    return (
      f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
      f"input_pipeline_id={self._input_pipeline_id}, "
      f"num_replicas_in_sync={self._num_replicas_in_sync})"
    )


_PARTIAL_BATCH = (None, "mask", "drop")


@dataclasses.dataclass(frozen=True)
class InputOptions:
  """Options for `experimental_distribute_dataset` and `distribute_datasets_from_function`.

  Attributes:
    experimental_fetch_to_device: True (default): each replica's shard is
      transferred to its device by the prefetch thread. False: elements stay on
      the host; with several replicas each tensor is a `PerReplica` of host
      tensors (`strategy.run` transfers them when the step starts).
    experimental_replication_mode: an `InputReplicationMode`; `PER_REPLICA` is
      only for `distribute_datasets_from_function`.
    experimental_place_dataset_on_device: as in TF it requires
      `experimental_fetch_to_device=False`. xladist's pipelines always run on
      the host, so with it the elements are transferred to the replicas'
      devices as with `experimental_fetch_to_device=True`.
    experimental_per_replica_buffer_size: the prefetch depth (>= 1): how many
      finished elements (already on the devices) may wait for the step; the
      thread builds at most one more while they wait.
    experimental_partial_batch: xladist's own. What happens to a batch smaller
      than the first one (the last batch of a data set whose size is not a
      multiple of the batch size). Every step must have the same shapes, or XLA
      compiles a new program:
        None (default): such a batch raises a ValueError at the `next()` that
          would return it (nothing is padded or dropped silently);
        "mask": every element becomes `(element, mask)`: `mask` holds one
          float32 vector of shape (per_replica_batch,) per replica, 1.0 for real
          rows and 0.0 for padding. A partial batch is padded with zero rows to
          the full size, so shapes (and the compiled program) stay the same.
          Weight per-example results with the mask (sum(loss * mask) /
          sum of all masks) so that padding counts for nothing;
        "drop": a partial batch is skipped.
      Per-replica elements without a batch dimension (scalars; see
      `distribute_datasets_from_function`) have no partial batch, only
      replicas whose datasets ended first: None ends the epoch at the first
      step some replica has no element for, as TF does (a warning on the
      "xladist" logger names the elements left unused); "drop" ends it there
      without the warning; "mask" goes on until every dataset has ended, with
      zeros for a replica without an element and a 0-d float32 mask per
      replica (1.0 real, 0.0 padding). With one replica, an element without a
      batch dimension is `(element, 1.0)` under "mask".

  Raises:
    TypeError: a field has the wrong type.
    ValueError: a field has a bad value, or `experimental_place_dataset_on_device`
      is combined with `experimental_fetch_to_device=True`.
  """

  experimental_fetch_to_device: bool = True
  experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
  experimental_place_dataset_on_device: bool = False
  experimental_per_replica_buffer_size: int = 1
  experimental_partial_batch: object = None

  def __post_init__(self):
    for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
      value = getattr(self, name)
      if not isinstance(value, bool):
        raise TypeError(
          f"InputOptions: {name} must be a bool, got {type(value).__name__} {value!r}."
        )
    mode = self.experimental_replication_mode
    if not isinstance(mode, InputReplicationMode):
      raise TypeError(
        "InputOptions: experimental_replication_mode must be an "
        f"InputReplicationMode, got {type(mode).__name__} {mode!r}; use "
        "InputReplicationMode.PER_WORKER or InputReplicationMode.PER_REPLICA."
      )
    _check_int(
      self.experimental_per_replica_buffer_size,
      "experimental_per_replica_buffer_size",
      "InputOptions",
      1,
    )
    partial = self.experimental_partial_batch
    if partial is not None and not isinstance(partial, str):
      raise TypeError(
        "InputOptions: experimental_partial_batch must be None or a string ('mask' "
        f"or 'drop'), got {type(partial).__name__} {partial!r}."
      )
    if partial not in _PARTIAL_BATCH:
      raise ValueError(
        "InputOptions: experimental_partial_batch must be None, 'mask' or 'drop', "
        f"got {self.experimental_partial_batch!r}."
      )
    if self.experimental_place_dataset_on_device and self.experimental_fetch_to_device:
      raise ValueError(
        "InputOptions: experimental_place_dataset_on_device=True requires "
        "experimental_fetch_to_device=False (as in TF); pass both."
      )
