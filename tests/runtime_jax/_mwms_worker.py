"""One process of tests/runtime_jax/test_multiprocess.py (the jax runtime).

    python _mwms_worker.py train OUT CKPT   # trains 3 steps, writes its results to OUT
    python _mwms_worker.py replay OUT -     # AdamW + cosine + clipping, REPLAY_STEPS steps,
                                            # writes its results and its replay counts to OUT
    python _mwms_worker.py kill OUT MARKER  # writes MARKER after step 1; then the worker
                                            # sleeps (the test kills it, or lets it stall)
                                            # and the chief goes on to step 2

With TF_CONFIG set the strategy is MultiWorkerMirroredStrategy (the cluster it
names, CommunicationOptions(timeout_seconds=XLADIST_TEST_TIMEOUT), and with
XLADIST_TEST_SHARD=<level> that level of ShardingOptions); without it
MirroredStrategy over this process's devices: the one-process reference.
Each step's input comes from `experimental_distribute_dataset` of a torch
DataLoader of the global batches (each host keeps its replicas' rows).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import _models  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import xladist as xd  # noqa: E402
import xladist.checkpoint as xc  # noqa: E402

STEPS = 3
REPLAY_STEPS = 20


def _strategy():
  if not os.environ.get("TF_CONFIG"):
    return xd.MirroredStrategy()
  timeout = float(os.environ.get("XLADIST_TEST_TIMEOUT", "60"))
  shard = os.environ.get("XLADIST_TEST_SHARD")  # a ShardingOptions level, min_shard_bytes=0
  return xd.MultiWorkerMirroredStrategy(
    communication_options=xd.experimental.CommunicationOptions(timeout_seconds=timeout),
    experimental_sharding=xd.experimental.ShardingOptions(shard, min_shard_bytes=0)
    if shard
    else None,
  )


def replay(out):
  """The loop users run (AdamW, a cosine schedule stepped every step, gradient
  clipping), REPLAY_STEPS steps: its losses, final state and replay counts."""
  strategy = _strategy()
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=REPLAY_STEPS)
  with strategy.scope():
    model = _models.MODELS["mlp"][0]()
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
  sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=REPLAY_STEPS)

  def step(x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss

  loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=xs[0].shape[0])
  losses = []
  for x, y in strategy.experimental_distribute_dataset(loader):
    losses.append(strategy.reduce("mean", strategy.run(step, args=(x, y)), axis=None))
    sched.step()
  rep = strategy.extended._engine._replayer
  result = {
    "losses": [float(v.cpu()) for v in losses],
    "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    "traces": rep.traces,
    "replays": rep.replays,
    "reasons": list(rep.reasons),
  }
  torch.save(result, out)


def main(mode, out, extra):
  if mode == "replay":
    return replay(out)
  strategy = _strategy()
  resolver = getattr(strategy, "cluster_resolver", None)
  task = (resolver.task_type, resolver.task_id) if resolver is not None else ("local", 0)
  print(f"{task}: {strategy.num_replicas_in_sync} replicas", flush=True)
  state = _models.initial_state("mlp")
  xs, ys = _models.make_data("mlp", 4, steps=STEPS)
  model, opt = _models.build_xladist(strategy, "mlp", state)
  step = _models.make_step(model, opt)
  loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=xs[0].shape[0])
  losses, local = [], []
  for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(loader)):
    per_replica = strategy.run(step, args=(x, y))
    losses.append(float(strategy.reduce("mean", per_replica, axis=None).cpu()))
    local.append([float(v.cpu()) for v in strategy.experimental_local_results(per_replica)])
    print(f"{task}: step {i} loss {losses[-1]:.6f} at {time.time():.3f}", flush=True)
    if mode == "kill" and i == 1:
      with open(extra, "w") as f:
        f.write(str(os.getpid()))
      if task[0] == "worker":
        time.sleep(600)  # killed by the test here
  final = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
  result = {"task": task, "losses": losses, "local": local, "state": final}
  result["replicas"] = strategy.num_replicas_in_sync
  if mode == "train":
    # The last step's per-replica losses of every host; this host's copies of a variable.
    rows = strategy.run(lambda v: v.reshape(1), args=(per_replica,))
    result["gathered"] = strategy.gather(rows, axis=0).cpu()
    result["local_bias"] = [v.cpu() for v in strategy.experimental_local_results(model[0].bias)]
  if mode == "train":
    ckpt = xc.Checkpoint(model=model, optimizer=opt)
    ckpt.save(extra)  # every host; only the chief writes
    # The chief's file may land after this host's save returned (no collective
    # orders a host's file write with the others' reads): wait for it, bounded.
    deadline = time.time() + 60
    while not os.path.exists(extra) and time.time() < deadline:
      time.sleep(0.05)
    with strategy.scope():
      fresh = _models.MODELS["mlp"][0]()
      xc.Checkpoint(model=fresh).restore(extra)
    result["restored"] = {k: v.detach().cpu().clone() for k, v in fresh.state_dict().items()}
    result["should_checkpoint"] = strategy.extended.should_checkpoint
  torch.save(result, out)
  print(f"{task}: done {json.dumps(losses)}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], sys.argv[3])
