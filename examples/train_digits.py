"""Data-parallel training of a small CNN on scikit-learn's 8x8 digits with xladist.

What this demo shows:

* `xd.MirroredStrategy()` over every local XLA device (XLA:CPU virtual devices
  when no TPU is attached): the model and optimizer made under
  `strategy.scope()` are mirrored on every replica.
* `strategy.run(train_step, ...)` traces the per-replica step once into ONE
  SPMD XLA program; `optimizer.step()` mean-all-reduces the gradients across
  replicas before updating, so the replicas stay identical.
* Input as `PerReplica` values with static shapes: each training epoch drops the
  last partial global batch; evaluation pads it and carries a 0/1 mask, so the
  held-out accuracy is exactly correct / total over the real examples.
* Cross-replica results with `strategy.reduce(...)`, kept on the device and read
  back to the host rarely (once per epoch for the loss, once for the accuracy).
* How few XLA compilations the whole run needs (torch_xla compiles once per
  distinct graph, not once per step).
* With `--cores-per-replica K`: `xd.TPUStrategy` with K devices (logical
  devices) per replica; each replica's batch is split over its K devices with
  `experimental_split_to_logical_devices`, so every device convolves K times
  fewer images, and the results are those of the unsplit run.

The data set is `sklearn.datasets.load_digits` (1797 images, bundled with
scikit-learn, nothing is downloaded); 20% is held out, stratified.

Run:  make demo   (or: PYTHONPATH=. python examples/train_digits.py --epochs 20
                  [--cores-per-replica 2])
"""

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import xladist as xd

SEED = 0
TARGET_ACCURACY = 0.95


class Net(nn.Module):
  """Two 3x3 conv layers, a 2x2 max-pool and a linear head: (B, 1, 8, 8) -> (B, 10)."""

  def __init__(self):
    super().__init__()
    self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
    self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
    self.head = nn.Linear(32 * 4 * 4, 10)

  def forward(self, x):
    x = F.relu(self.conv1(x))
    x = F.max_pool2d(F.relu(self.conv2(x)), 2)
    return self.head(x.flatten(1))


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
  p.add_argument("--per-replica-batch", type=int, default=16,
                 help="examples per replica per step (default 16)")
  p.add_argument("--lr", type=float, default=0.05,
                 help="SGD learning rate, momentum 0.9 (default 0.05)")
  p.add_argument("--cores-per-replica", type=int, default=1,
                 help="devices per replica: 1 = MirroredStrategy (default); K > 1 = "
                      "TPUStrategy with K logical devices, the batch split over them")
  args = p.parse_args()
  if args.epochs < 1 or args.per_replica_batch < 1 or args.lr <= 0:
    p.error("--epochs and --per-replica-batch must be >= 1 and --lr > 0")
  if args.cores_per_replica < 1 or args.per_replica_batch % args.cores_per_replica:
    p.error("--cores-per-replica must be >= 1 and divide --per-replica-batch")
  return args


def make_strategy(cores_per_replica):
  """MirroredStrategy, or TPUStrategy with `cores_per_replica` devices per replica."""
  if cores_per_replica == 1:
    return xd.MirroredStrategy()  # all local XLA devices
  try:  # num_replicas=None: as many replicas as the devices hold
    assignment = xd.experimental.DeviceAssignment.build(
        computation_shape=[cores_per_replica], num_replicas=None)
  except ValueError as e:
    sys.exit(f"error: {e}")
  return xd.TPUStrategy(experimental_device_assignment=assignment)


def load_data():
  """Train/test tensors: images (n, 1, 8, 8) float32 in [0, 1], labels int64."""
  digits = load_digits()
  x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
  y = digits.target.astype(np.int64)
  x_tr, x_te, y_tr, y_te = train_test_split(
      x, y, test_size=0.2, stratify=y, random_state=SEED)
  return (torch.from_numpy(x_tr), torch.from_numpy(y_tr),
          torch.from_numpy(x_te), torch.from_numpy(y_te))


def distribute(strategy, b, *tensors):
  """One global batch (each tensor with num_replicas * b rows) -> PerReplica slices."""
  def value_fn(ctx):
    r = ctx.replica_id_in_sync_group
    return tuple(t[r * b:(r + 1) * b] for t in tensors)
  return strategy.experimental_distribute_values_from_function(value_fn)


def compile_count():
  """XLA compilations so far (torch_xla's metrics)."""
  import torch_xla.debug.metrics as met
  data = met.metric_data("CompileTime")
  return 0 if data is None else data[0]


def main():
  args = parse_args()
  torch.manual_seed(SEED)
  rng = np.random.default_rng(SEED)
  t_start = time.perf_counter()

  strategy = make_strategy(args.cores_per_replica)
  k = args.cores_per_replica

  def on_cores(x):
    # Each of the replica's k devices takes b / k of its images (k = 1: as is).
    if k == 1:
      return x
    return strategy.experimental_split_to_logical_devices(x, [k] + [1] * (x.dim() - 1))
  # Imported after the strategy exists: xladist chooses PJRT_DEVICE first.
  import torch_xla
  import torch_xla.runtime as xr
  n = strategy.num_replicas_in_sync
  b = args.per_replica_batch
  global_batch = n * b

  x_train, y_train, x_test, y_test = load_data()
  steps_per_epoch = len(x_train) // global_batch  # the last partial batch is dropped
  if steps_per_epoch == 0:
    sys.exit(f"error: global batch {global_batch} exceeds the {len(x_train)} "
             "training examples; lower --per-replica-batch")
  print(f"replicas: {n} ({xr.device_type()}, {k} device(s) each), batch: {b} per "
        f"replica, {global_batch} global")
  print(f"data: {len(x_train)} train / {len(x_test)} held-out examples; "
        f"{steps_per_epoch} steps per epoch x {args.epochs} epochs")

  with strategy.scope():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

  def train_step(x, y):
    loss = F.cross_entropy(model(on_cores(x)), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # gradients are mean-all-reduced across replicas first
    return loss

  def eval_step(x, y, mask):
    with torch.no_grad():
      pred = model(on_cores(x)).argmax(dim=1)
    correct = ((pred == y).float() * mask).sum()
    return correct, mask.sum()

  def zeros():
    # An accumulator already on the device, so that every step's graph (step +
    # reduce + accumulate) is the same and compiles once.
    return strategy.extended.broadcast_to(torch.zeros(()), "xla:0")

  # -- training ---------------------------------------------------------------------
  total_steps = steps_per_epoch * args.epochs
  bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
  for epoch in range(args.epochs):
    perm = torch.from_numpy(rng.permutation(len(x_train)))
    epoch_loss = zeros()  # summed on the device, read once per epoch
    for step in range(steps_per_epoch):
      idx = perm[step * global_batch:(step + 1) * global_batch]
      x, y = distribute(strategy, b, x_train[idx], y_train[idx])
      per_replica_loss = strategy.run(train_step, args=(x, y))
      loss = strategy.reduce("mean", per_replica_loss, axis=None)
      epoch_loss = epoch_loss + loss
      torch_xla.sync()
      bar.update(1)
    bar.set_postfix(epoch=epoch + 1, loss=f"{epoch_loss.item() / steps_per_epoch:.4f}")
  bar.close()

  # -- evaluation: pad the last batch, mask the padding out -------------------------
  num_test = len(x_test)
  padded = -(-num_test // global_batch) * global_batch
  pad = padded - num_test
  x_eval = torch.cat([x_test, x_test.new_zeros((pad,) + tuple(x_test.shape[1:]))])
  y_eval = torch.cat([y_test, y_test.new_zeros(pad)])
  m_eval = torch.cat([torch.ones(num_test), torch.zeros(pad)])
  correct_total, count_total = zeros(), zeros()
  for start in range(0, padded, global_batch):
    sl = slice(start, start + global_batch)
    x, y, mask = distribute(strategy, b, x_eval[sl], y_eval[sl], m_eval[sl])
    correct, count = strategy.run(eval_step, args=(x, y, mask))
    correct = strategy.reduce("sum", correct, axis=None)
    count = strategy.reduce("sum", count, axis=None)
    correct_total, count_total = correct_total + correct, count_total + count
    torch_xla.sync()
  correct_total, count_total = int(correct_total.item()), int(count_total.item())
  if count_total != num_test:
    sys.exit(f"error: evaluated {count_total} examples, expected {num_test}")
  accuracy = correct_total / count_total

  print(f"held-out accuracy: {accuracy:.4f} ({correct_total}/{count_total})")
  print(f"XLA compilations: {compile_count()}")
  print(f"time (setup, training, evaluation): {time.perf_counter() - t_start:.1f} s")
  if accuracy < TARGET_ACCURACY:
    print(f"FAILED: held-out accuracy {accuracy:.4f} is below {TARGET_ACCURACY}",
          file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  main()
