"""What the memory benches share (bench/memory.py, bench/sharding.py): the
process's resident set, its peak, the MLP and batch both train, and the
options naming the interpreters of each runtime."""

import resource
import time

WIDTH = 1024


def rss():
  """This process's resident set now, in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status")


def peak():
  """This process's peak resident set, in bytes."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def mlp(layers):
  """`layers` x Linear(WIDTH, WIDTH) + tanh, torch's initialization from seed 0."""
  import torch
  import torch.nn as nn

  torch.manual_seed(0)
  parts = []
  for _ in range(layers):
    parts += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
  return nn.Sequential(*parts)


def batch(rows):
  """The global batch of 4 replicas x `rows` rows (seed 1)."""
  import torch

  return torch.randn(4 * rows, WIDTH, generator=torch.Generator().manual_seed(1))


def add_interpreter_arguments(parser):
  """--xla-python and --jax-python: the interpreters the children of each runtime run in."""
  parser.add_argument(
    "--xla-python",
    default=None,
    help="an interpreter with torch_xla (default: this one, unless XLADIST_BACKEND=jax)",
  )
  parser.add_argument(
    "--jax-python",
    default=None,
    help="an interpreter with jax, optax and torchax (default: this one when XLADIST_BACKEND=jax)",
  )


def timed(steps, one_step):
  """Runs `one_step()` `steps` times (each returns once the devices have finished
  it); returns the wall time of each step in seconds."""
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    one_step()
    times.append(time.perf_counter() - start)
  return times


def timed_jax_steps(steps, jitted, params, state, x):
  """`steps` calls of a donating `jitted(params, state, x) -> (params, state, loss)`,
  each until its results are ready: (the wall times, the last loss)."""
  import jax

  carry = [params, state, None]

  def one_step():
    carry[:] = jitted(carry[0], carry[1], x)
    jax.block_until_ready(carry)

  return timed(steps, one_step), float(carry[2])
