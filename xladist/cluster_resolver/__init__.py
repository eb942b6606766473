"""Cluster resolvers: who the hosts of a job are, and which one this process is.

As in `tf.distribute.cluster_resolver`: a `ClusterResolver` describes the
cluster as a `ClusterSpec` (job name -> task addresses) and says which task this
process is (`task_type`, `task_id`), where the master is, and how many
accelerators each task has. xladist runs one process per host, so a task is a
host ("worker").

* `ClusterSpec`: job name -> task addresses.
* `SimpleClusterResolver`: everything given explicitly.
* `TFConfigClusterResolver`: reads the `TF_CONFIG` environment variable (JSON),
  as TF does.
* `TPUClusterResolver`: reads a Cloud TPU VM's environment (the variables the
  TPU runtime and torch_xla use, or the VM's metadata) and derives hosts, chips
  and cores from the accelerator type.
* `is_chief(resolver)`: whether this task is the chief (the task of job "chief"
  if there is one, else worker 0).

Nothing here starts torch_xla except `ClusterResolver.num_accelerators` of
resolvers that were not told the count, and nothing contacts a metadata server
unless `TPUClusterResolver` is left to read the real one (tests inject `env=` and
`metadata=`).

The package, one concept per file (this `__init__` only re-exports):

* `_cluster_spec.py`: `ClusterSpec`;
* `_base.py`: `ClusterResolver`, `SimpleClusterResolver`, `is_chief`;
* `_tf_config.py`: `TFConfigClusterResolver`;
* `_tpu.py`: `TPUClusterResolver`, with `_tpu_env.py` its table of TPU
  accelerator types and the VM's metadata server;
* `_multihost.py` (not re-exported): what a multi-host strategy does with a
  resolver: joins the hosts into one torch_xla runtime and places each host's
  rows of a global batch.
"""

from xladist.cluster_resolver._base import ClusterResolver, SimpleClusterResolver, is_chief
from xladist.cluster_resolver._cluster_spec import ClusterSpec
from xladist.cluster_resolver._tf_config import TFConfigClusterResolver
from xladist.cluster_resolver._tpu import TPUClusterResolver

__all__ = [
  "ClusterResolver",
  "ClusterSpec",
  "SimpleClusterResolver",
  "TFConfigClusterResolver",
  "TPUClusterResolver",
  "is_chief",
]
