"""What the parameter-server tests run on workers: top-level functions, which
travel by reference (the workers import this module); the tests' closures
travel by value."""

import itertools
import os
import time

import torch
import torch.nn.functional as F

import xladist as xd

REGRESSION_SEED = 7
EXAMPLES = 64
BATCH = 4


def add_and_read(v1, v2):
  """TF's RemoteValue example: 0.1 / 0.8 == 0.125 on fresh variables."""
  v1.assign_add(0.1)
  v2.assign_sub(0.2)
  return v1.value / v2.value


def regression_data():
  """The same least-squares problem on every worker (made there, kept there)."""
  g = torch.Generator().manual_seed(REGRESSION_SEED)
  x = torch.randn(256, 4, generator=g)
  y = x @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.7 + 0.3 * torch.randn(256, 1, generator=g)
  device = xd.get_strategy().extended.worker_devices[0]
  return x.to(device), y.to(device)


class Regression(torch.nn.Module):
  """y = x @ w + b, with w of shape (4, 1): two shards under FixedShardsPartitioner(2)."""

  def __init__(self):
    super().__init__()
    self.w = torch.nn.Parameter(torch.zeros(4, 1))
    self.b = torch.nn.Parameter(torch.zeros(1))

  def forward(self, x):
    return x @ self.w + self.b


def regression_step(model, optimizer, data):
  """One full-batch gradient step, inside strategy.run on the worker."""

  def replica_fn(x, y):
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()

  x, y = data
  return xd.get_strategy().run(replica_fn, args=(x, y))


def id_dataset(input_context):
  """Examples 0..63; worker w keeps those with id % workers == w, in batches of 4."""
  ids = torch.arange(EXAMPLES, dtype=torch.float32)
  mine = ids[input_context.input_pipeline_id :: input_context.num_input_pipelines]
  return [mine[i : i + BATCH] for i in range(0, len(mine), BATCH)]


def take_batch(iterator):
  """(worker index, the ids of the next batch; none when the worker's epoch ended)."""
  worker = xd.get_strategy().extended._worker_index
  try:
    batch = next(iterator)
  except StopIteration:
    return worker, torch.zeros(0)
  return worker, batch


def failing(x):
  if x > 2:
    raise ValueError(f"bad closure input {x}")
  return torch.tensor(float(x))


def count_slowly(counter, index, seconds):
  """Sleeps, then counts one run on the ps task (assign_add) and returns its index."""
  time.sleep(seconds)
  counter.assign_add(1.0)
  return index


def read_value(v):
  return v.value * 1.0


def repeat_batch(x, y):
  """A dataset_fn (with functools.partial): the same batch, endlessly."""
  return itertools.repeat((x, y))


def tutorial_step(model, optimizer, steps, iterator):
  """TF's tutorial step as a top-level function: everything comes as arguments."""
  strategy = xd.get_strategy()

  def replica_fn(x, y):
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()

  x, y = next(iterator)
  loss = strategy.run(replica_fn, args=(x, y))
  steps.assign_add(1.0)
  return loss


def make_counter():
  """A per-worker value: a list holding one count."""
  return [0]


class PidDataset:
  """Endless elements [pid of the process that made the dataset, position]."""

  def __init__(self):
    self.pid = os.getpid()

  def __iter__(self):
    return (torch.tensor([self.pid, i]) for i in itertools.count())


def pid_dataset():
  return PidDataset()


def take_and_count(iterator, counter, seconds):
  """(worker index, this process's pid, the next element); counts the run on the ps."""
  element = next(iterator)
  time.sleep(seconds)
  counter.assign_add(1.0)
  return xd.get_strategy().extended._worker_index, os.getpid(), element
