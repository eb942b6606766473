"""`xladist.experimental.ShardingOptions`: which training state a strategy shards.

Every SPMD strategy keeps a full copy of the parameters, the gradients and the
optimizer state on every device unless it is given
`experimental_sharding=ShardingOptions(...)`; then the state named by `shard`
(DeepSpeed's ZeRO stages) is split over the replicas, each holding 1/N of it
(docs/architecture.md, "Sharded state").
"""

# `shard` -> what is split over the replicas (ZeRO 1, 2, 3).
LEVELS = {
  "optimizer_state": ("optimizer_state",),
  "gradients": ("optimizer_state", "gradients"),
  "parameters": ("optimizer_state", "gradients", "parameters"),
}


class ShardingOptions:
  """Which of a strategy's training state is sharded over its replicas.

  Args:
    shard: "optimizer_state" (ZeRO-1: the optimizer's state), "gradients"
      (ZeRO-2: the gradients are reduce-scattered and the optimizer state is
      sharded), or "parameters" (ZeRO-3: parameters too; each step gathers them
      when it begins and frees the full copies when it ends).
    min_shard_bytes: a tensor of at least this many bytes (its own size) is
      sharded; a smaller one stays mirrored, and a scalar never shards. 0
      shards every tensor that is not a scalar.

  Raises:
    ValueError: `shard` is not one of the three names, or `min_shard_bytes` is
      not a whole number at least 0.
  """

  __slots__ = ("shard", "min_shard_bytes")

  def __init__(self, shard="optimizer_state", min_shard_bytes=65536):
    if shard not in LEVELS:
      raise ValueError(
        f"ShardingOptions(shard={shard!r}): expected one of "
        f"{', '.join(repr(k) for k in LEVELS)} (ZeRO stages 1, 2 and 3)."
      )
    if (
      isinstance(min_shard_bytes, bool)
      or not isinstance(min_shard_bytes, int)
      or min_shard_bytes < 0
    ):
      raise ValueError(
        f"ShardingOptions(min_shard_bytes={min_shard_bytes!r}): expected a whole "
        "number of bytes, at least 0 (0 shards every tensor that is not a scalar)."
      )
    self.shard = shard
    self.min_shard_bytes = min_shard_bytes

  def shards(self, kind):
    """True when state of `kind` ("parameters", "gradients", "optimizer_state") is sharded."""
    return kind in LEVELS[self.shard]

  def splits(self, tensor):
    """True when `tensor` is big enough to be split (its own size; never a scalar)."""
    return tensor.dim() > 0 and tensor.numel() * tensor.element_size() >= self.min_shard_bytes

  def __eq__(self, other):
    return isinstance(other, ShardingOptions) and (self.shard, self.min_shard_bytes) == (
      other.shard,
      other.min_shard_bytes,
    )

  def __hash__(self):
    return hash((self.shard, self.min_shard_bytes))

  def __repr__(self):
    return f"ShardingOptions(shard={self.shard!r}, min_shard_bytes={self.min_shard_bytes})"


def check(value, api):
  """`experimental_sharding=` of a strategy's constructor: None or ShardingOptions."""
  if value is None or isinstance(value, ShardingOptions):
    return value
  raise TypeError(
    f"{api}(experimental_sharding=...): expected an xladist.experimental.ShardingOptions "
    f"or None, got {type(value).__name__}. E.g. "
    "experimental_sharding=xd.experimental.ShardingOptions(shard='parameters')."
  )
