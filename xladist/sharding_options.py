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
      sharded), or "parameters" (ZeRO-3: parameters too; a step gathers a
      unit's parameters when it runs and again in its backward, see `units`).
    min_shard_bytes: a tensor of at least this many bytes (its own size) is
      sharded; a smaller one stays mirrored, and a scalar never shards. 0
      shards every tensor that is not a scalar.
    units: under "parameters", which modules' parameters are gathered together
      (FSDP's auto-wrap policy). None (the default): every module that owns
      sharded parameters is a unit of its own parameters. A tuple of module
      classes, or a function module -> bool: a module it names is one unit
      with every parameter below it (a nested module it names is a unit of its
      own), e.g. `units=(GPT2Block,)`. A unit's parameters are whole only
      while its forward and its backward run.

  Raises:
    ValueError: `shard` is not one of the three names, or `min_shard_bytes` is
      not a whole number at least 0.
    TypeError: `units` is not None, a tuple of `torch.nn.Module` classes or a
      function.
  """

  __slots__ = ("shard", "min_shard_bytes", "units")

  def __init__(self, shard="optimizer_state", min_shard_bytes=65536, units=None):
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
    self.units = _check_units(units)

  def shards(self, kind):
    """True when state of `kind` ("parameters", "gradients", "optimizer_state") is sharded."""
    return kind in LEVELS[self.shard]

  def splits(self, tensor):
    """True when `tensor` is big enough to be split (its own size; never a scalar)."""
    return tensor.dim() > 0 and tensor.numel() * tensor.element_size() >= self.min_shard_bytes

  def __eq__(self, other):
    return isinstance(other, ShardingOptions) and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def _key(self):
    return (self.shard, self.min_shard_bytes, self.units)

  def __repr__(self):
    units = "" if self.units is None else f", units={self.units!r}"
    return f"ShardingOptions(shard={self.shard!r}, min_shard_bytes={self.min_shard_bytes}{units})"


def _check_units(units):
  import torch

  if units is None or (callable(units) and not isinstance(units, type)):
    return units
  if isinstance(units, type):
    units = (units,)
  if (
    isinstance(units, (tuple, list))
    and units
    and all(isinstance(u, type) and issubclass(u, torch.nn.Module) for u in units)
  ):
    return tuple(units)
  raise TypeError(
    f"ShardingOptions(units={units!r}): expected None, a tuple of torch.nn.Module "
    "classes (e.g. units=(GPT2Block,)), or a function module -> bool."
  )


def check(value, api):
  """`experimental_sharding=` of a strategy's constructor: None or ShardingOptions."""
  if value is None or isinstance(value, ShardingOptions):
    return value
  raise TypeError(
    f"{api}(experimental_sharding=...): expected an xladist.experimental.ShardingOptions "
    f"or None, got {type(value).__name__}. E.g. "
    "experimental_sharding=xd.experimental.ShardingOptions(shard='parameters')."
  )
