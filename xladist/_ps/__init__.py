"""The plumbing of parameter-server clusters (private; `xd.Server` is its public face).

Every task of a chief / worker / ps cluster is a member of one
torch.distributed.rpc group; the files, lowest first:

* `bind.py`: where each task listens (its address in the cluster spec, not
  every interface) and the `xladist://` rendezvous that binds the chief's store;
* `rpc.py`: the group (rendezvous at the chief, task names such as
  "worker:1"), remote calls with timeouts, and the error records that remote
  functions return instead of raising;
* `task.py`: what a ps task runs: it holds variables (CPU tensors) and applies
  the updates and optimizer steps sent to it;
* `server.py`: `Server` (exported as `xladist.Server`), which starts a worker
  or ps task in its process and serves until the chief ends the cluster.

What a worker runs for the chief's `ClusterCoordinator` lives with the
coordinator (`xladist/coordinator/_worker.py`): it needs the strategy, and the
strategy needs this package, so it cannot sit here without an import cycle.
"""
