"""Data-parallel training of a small CNN on scikit-learn's 8x8 digits with xladist.

What this demo shows:

* `xd.MirroredStrategy()` over every local XLA device (XLA:CPU virtual devices
  when no TPU is attached): the model and optimizer made under
  `strategy.scope()` are mirrored on every replica.
* `strategy.run(train_step, ...)` traces the per-replica step once into ONE
  SPMD XLA program; `optimizer.step()` mean-all-reduces the gradients across
  replicas before updating, so the replicas stay identical.
* Input through `strategy.experimental_distribute_dataset(DataLoader(...))`:
  the DataLoader shuffles and batches global batches (the last partial batch
  of an epoch is dropped, `drop_last=True`), xladist splits each one between
  the replicas and a background thread transfers the next batch to the devices
  while the current step runs. Evaluation passes
  `xd.InputOptions(experimental_partial_batch="mask")`: the last, partial batch
  is padded to the full size (the compiled program stays the same) and every
  element comes with a 0/1 mask of its real rows, so the held-out accuracy is
  exactly correct / total over the real examples.
* Metrics as TF's custom loops keep them: sync-on-read variables
  (`xd.Variable(..., synchronization="ON_READ", aggregation="SUM")`) that each
  replica adds to inside the step, read (summed over the replicas) back to the
  host rarely: once per epoch for the loss, once for the accuracy. Being
  part of the step, they add nothing to its program count: a value computed
  after `strategy.run` returned (`total + strategy.reduce(...)`) is a program
  of its own.
* Replay: from its third step `strategy.run` runs the step's compiled program
  again without tracing `train_step` (README, "Replay").
* How few XLA compilations the whole run needs (torch_xla compiles once per
  distinct graph, not once per step), and the time from the script's start to
  the end of its first training step, with the state of the persistent
  compilation cache (`XLADIST_COMPILE_CACHE`). On TPU the cache is on by
  default (`~/.cache/xladist/xla-cache`), but torch_xla 2.9 cannot load cached
  executables there (pytorch/xla#9094; not measured: nothing has run on a TPU);
  torch_xla 2.9's XLA:CPU cannot load programs back either (checked), so on
  CPU there is no cache unless asked for.
* With `--cores-per-replica K`: `xd.TPUStrategy` with K devices (logical
  devices) per replica; each replica's batch is split over its K devices with
  `experimental_split_to_logical_devices`, so every device convolves K times
  fewer images, and the results are those of the unsplit run.

The data set is `sklearn.datasets.load_digits` (1797 images, bundled with
scikit-learn, nothing is downloaded); 20% is held out, stratified.

Run:  make demo   (or: PYTHONPATH=. python examples/train_digits.py --epochs 20
                  [--cores-per-replica 2] [--first-step-only])
"""

import time

T0 = time.perf_counter()  # time to first step counts from here, before the heavy imports

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import StartupClock, progress  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import xladist as xd  # noqa: E402

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
  p.add_argument(
    "--per-replica-batch", type=int, default=16, help="examples per replica per step (default 16)"
  )
  p.add_argument(
    "--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)"
  )
  p.add_argument(
    "--cores-per-replica",
    type=int,
    default=1,
    help="devices per replica: 1 = MirroredStrategy (default); K > 1 = "
    "TPUStrategy with K logical devices, the batch split over them",
  )
  p.add_argument(
    "--first-step-only",
    action="store_true",
    help="stop after the first training step and print the time to reach it "
    "(what bench/first_step.py measures)",
  )
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
      computation_shape=[cores_per_replica], num_replicas=None
    )
  except ValueError as e:
    sys.exit(f"error: {e}")
  return xd.TPUStrategy(experimental_device_assignment=assignment)


def load_data():
  """Train/test datasets: images (n, 1, 8, 8) float32 in [0, 1], labels int64."""
  digits = load_digits()
  x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
  y = digits.target.astype(np.int64)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=SEED)
  return (
    TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr)),
    TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te)),
  )


def compile_count():
  """XLA compilations so far (the runtime's count)."""
  from xladist import runtime

  return runtime.compile_count()


def main():
  clock = StartupClock(T0)
  clock.imported()
  args = parse_args()
  torch.manual_seed(SEED)

  strategy = make_strategy(args.cores_per_replica)
  clock.runtime_started()
  k = args.cores_per_replica

  def on_cores(x):
    # Each of the replica's k devices takes b / k of its images (k = 1: as is).
    if k == 1:
      return x
    return strategy.experimental_split_to_logical_devices(x, [k] + [1] * (x.dim() - 1))

  # The runtime the strategy started (torch_xla, or jax with XLADIST_BACKEND=jax),
  # for the summary line only: the training loop imports no runtime library.
  from xladist import runtime

  n = strategy.num_replicas_in_sync
  b = args.per_replica_batch
  global_batch = n * b

  train_data, test_data = load_data()
  # Global batches, reshuffled every epoch; the last partial batch is dropped.
  train_loader = DataLoader(
    train_data,
    batch_size=global_batch,
    shuffle=True,
    drop_last=True,
    generator=torch.Generator().manual_seed(SEED),
  )
  steps_per_epoch = len(train_loader)
  if steps_per_epoch == 0:
    sys.exit(
      f"error: global batch {global_batch} exceeds the {len(train_data)} "
      "training examples; lower --per-replica-batch"
    )
  train_dist = strategy.experimental_distribute_dataset(train_loader)
  # Every held-out example once: the last batch is padded, the mask says which
  # rows are real.
  test_dist = strategy.experimental_distribute_dataset(
    DataLoader(test_data, batch_size=global_batch),
    xd.InputOptions(experimental_partial_batch="mask"),
  )
  print(
    f"replicas: {n} ({runtime.BACKEND} on {runtime.device_type()}, {k} device(s) each), "
    f"batch: {b} per replica, {global_batch} global"
  )
  print(
    f"data: {len(train_data)} train / {len(test_data)} held-out examples; "
    f"{steps_per_epoch} steps per epoch x {args.epochs} epochs"
  )

  with strategy.scope():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Each replica adds its own part inside the step; read outside, they are summed.
    loss_sum = xd.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="loss_sum")
    correct_sum = xd.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="correct")
    count_sum = xd.Variable(0.0, synchronization="ON_READ", aggregation="SUM", name="count")

  def train_step(x, y):
    loss = F.cross_entropy(model(on_cores(x)), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # gradients are mean-all-reduced across replicas first
    loss_sum.assign_add(loss.detach() / n)  # summed over the replicas: the mean loss
    return loss

  def eval_step(inputs, mask):
    x, y = inputs
    with torch.no_grad():
      pred = model(on_cores(x)).argmax(dim=1)
    correct_sum.assign_add(((pred == y).float() * mask).sum())
    count_sum.assign_add(mask.sum())

  # -- training ---------------------------------------------------------------------
  bar = progress(steps_per_epoch * args.epochs, "train")
  for epoch in range(args.epochs):
    before = float(loss_sum.value)  # the running sum, read once per epoch
    for x, y in train_dist:  # a new epoch: the DataLoader reshuffles
      strategy.run(train_step, args=(x, y))
      if "first_step" not in clock.marks:
        float(loss_sum.value)  # a read: waits until the first step has finished
        clock.first_step_done()
        if args.first_step_only:
          bar.close()
          print(clock.report())
          return
      bar.update(1)
    epoch_loss = (float(loss_sum.value) - before) / steps_per_epoch
    bar.set_postfix(epoch=epoch + 1, loss=f"{epoch_loss:.4f}")
  bar.close()

  # -- evaluation: the padding of the last batch is masked out ----------------------
  for inputs, mask in test_dist:
    strategy.run(eval_step, args=(inputs, mask))
  correct_total, count_total = int(correct_sum.value), int(count_sum.value)
  if count_total != len(test_data):
    sys.exit(f"error: evaluated {count_total} examples, expected {len(test_data)}")
  accuracy = correct_total / count_total

  print(f"held-out accuracy: {accuracy:.4f} ({correct_total}/{count_total})")
  counts = strategy.extended.experimental_replay_counts
  print(f"XLA compilations: {compile_count()}")
  print(f"steps: {counts['traced']} traced, {counts['replayed']} replayed")
  print(clock.report())
  print(f"time (start to end): {time.perf_counter() - T0:.1f} s")
  if accuracy < TARGET_ACCURACY:
    print(f"FAILED: held-out accuracy {accuracy:.4f} is below {TARGET_ACCURACY}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  main()
