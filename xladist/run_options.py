"""Small option and context records passed to user functions."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ValueContext:
  """What `value_fn` of `experimental_distribute_values_from_function` is told."""

  replica_id_in_sync_group: int = 0
  num_replicas_in_sync: int = 1


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """Options for `strategy.run` (TF's `tf.distribute.RunOptions`).

  xladist always traces the step into one XLA program with static shapes, so
  TF's TPU-specific knobs have no separate effect here:

  Attributes:
    experimental_enable_dynamic_batch_size: accepted for compatibility; a batch
      of a new size is a new XLA program (torch_xla compiles once per shape).
    experimental_bucketizing_dynamic_shape: accepted for compatibility (same).
    experimental_xla_options: accepted for compatibility; XLA flags are set with
      the XLA_FLAGS environment variable before the process starts.
    experimental_replay: xladist's own (default None: on, unless the
      environment variable `XLADIST_REPLAY=0` turns it off). True: once a
      step's program is known, `run` replays it without tracing `fn` again
      (docs/architecture.md, "Replay"); False: this step is traced.
  """

  experimental_enable_dynamic_batch_size: bool = True
  experimental_bucketizing_dynamic_shape: bool = False
  experimental_xla_options: object = None
  experimental_replay: object = None
