"""xladist: TensorFlow's tf.distribute programming model for PyTorch on XLA devices.

Glossary (as in tf.distribute):

replica
  One copy of the model working on its own slice of each global batch. In
  xladist a replica is a coordinate of the mesh's replica axis, not a thread:
  all replicas are traced together into one SPMD XLA program.
replica context
  Where the step function passed to `strategy.run` executes: code there sees one
  replica's values. `get_replica_context()` returns its `ReplicaContext`.
cross-replica context
  Inside `strategy.scope()` outside `run`, and inside `merge_fn` of
  `ReplicaContext.merge_call`: code there sees all replicas' values at once.
PerReplica
  A distributed value with a (possibly different) component per replica, e.g.
  what `strategy.run` returns.
Mirrored
  A distributed value that is identical on every replica, e.g. a model
  parameter created under `strategy.scope()`.
logical devices
  The devices (TPU cores) of one replica when a TPUStrategy gives each replica
  several: `experimental_split_to_logical_devices` divides a replica's tensor
  over them, the math unchanged.
host / worker
  One process of a multi-host job (MultiWorkerMirroredStrategy, TPUStrategy on
  a pod); every host runs the same program and feeds its own replicas.
SyncOnRead
  State that each replica updates on its own and that is reduced (summed or
  averaged) when read in cross-replica context.

Typical use::

  import xladist as xd
  strategy = xd.MirroredStrategy()
  with strategy.scope():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

  def step(x, y):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()          # gradients are all-reduced across replicas first
    return loss

  for x, y in batches:        # x, y: PerReplica values
    losses = strategy.run(step, args=(x, y))
"""

from xladist import checkpoint, cluster_resolver, coordinator, experimental, nn
from xladist._ps.server import Server
from xladist.context import (
  current_device,
  current_strategy,
  current_update_device,
  get_cross_replica_context,
  get_replica_context,
  get_strategy,
  get_tower_context,
  has_strategy,
  in_cross_replica_context,
)
from xladist.cross_device_ops import (
  CrossDeviceOps,
  HierarchicalCopyAllReduce,
  NcclAllReduce,
  ReductionToOneDevice,
)
from xladist.extended import StrategyExtended
from xladist.input.dataset import DistributedDataset, DistributedIterator
from xladist.input.options import InputContext, InputOptions, InputReplicationMode
from xladist.reduce_util import MeanReduction, ReduceOp, SumReduction
from xladist.replica_context import ReplicaContext, TowerContext
from xladist.run_options import RunOptions
from xladist.strategies import default as _default  # noqa: F401 (sets up the default strategy)
from xladist.strategies.mirrored import MirroredStrategy
from xladist.strategies.multi_worker import MultiWorkerMirroredStrategy
from xladist.strategies.one_device import OneDeviceStrategy
from xladist.strategies.parameter_server import ParameterServerStrategy
from xladist.strategies.tpu import TPUStrategy
from xladist.strategy import Strategy, experimental_set_strategy
from xladist.values import DistributedValues, Mirrored, PerReplica
from xladist.variable import Variable
from xladist.variable_policy import VariableAggregation, VariableSynchronization

# The one place of the version: pyproject.toml reads it statically (without
# importing xladist), so it stays a plain string literal.
__version__ = "0.1.0"

__all__ = [
  "CrossDeviceOps",
  "HierarchicalCopyAllReduce",
  "NcclAllReduce",
  "ReductionToOneDevice",
  "DistributedDataset",
  "DistributedIterator",
  "DistributedValues",
  "InputContext",
  "InputOptions",
  "InputReplicationMode",
  "MeanReduction",
  "Mirrored",
  "MirroredStrategy",
  "MultiWorkerMirroredStrategy",
  "OneDeviceStrategy",
  "ParameterServerStrategy",
  "TPUStrategy",
  "PerReplica",
  "ReduceOp",
  "ReplicaContext",
  "RunOptions",
  "Server",
  "Strategy",
  "StrategyExtended",
  "SumReduction",
  "TowerContext",
  "current_device",
  "current_strategy",
  "current_update_device",
  "experimental",
  "experimental_set_strategy",
  "get_cross_replica_context",
  "get_replica_context",
  "get_strategy",
  "get_tower_context",
  "has_strategy",
  "in_cross_replica_context",
  "Variable",
  "VariableAggregation",
  "VariableSynchronization",
  "checkpoint",
  "cluster_resolver",
  "coordinator",
  "nn",
]
