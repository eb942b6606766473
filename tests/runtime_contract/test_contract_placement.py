"""The runtime contract's placement of global values and host transfers.

A host tensor placed replicated, split along dimension 0 (one block per
replica) or one row per device comes back whole from `to_host`; its blocks
are each replica's rows (`local_shards`, `replica_copies`, compared with
`torch.chunk`); the blocks rebuild it (`global_from_local_shards`); and its
placement reads as text that is equal for equal placements (`sharding_spec`).
Values are checked against the host tensors they came from.
"""

import torch

from xladist import runtime

N = 4


def _x(cols=3, offset=0.0):
  return torch.arange(N * cols, dtype=torch.float32).reshape(N, cols) + offset


def _host_copy(t):
  """A tensor as a host tensor (an operation may give either)."""
  return runtime.to_host([t])[0] if runtime.is_device_tensor(t) else t


def test_place_replicated_round_trips(host):
  """Runtime.place_replicated / to_host: one tensor, and a list in one transfer."""
  x = _x()
  t = runtime.place_replicated(x)
  assert runtime.is_device_tensor(t) and t.device.type == runtime.DEVICE_KIND
  assert torch.equal(host(t), x)
  xs = [x, x * 2 - 1, torch.tensor([1, 2, 3], dtype=torch.int32)]
  ts = runtime.place_replicated(xs)
  assert len(ts) == len(xs) and all(runtime.is_device_tensor(t) for t in ts)
  back = runtime.to_host(ts)
  assert isinstance(back, list) and len(back) == len(xs)
  for got, want in zip(back, xs):
    assert got.device.type == "cpu" and got.dtype == want.dtype
    assert torch.equal(got, want)


def test_place_split_round_trips(host):
  """Runtime.place_split / to_host: one tensor, and a list in one transfer."""
  x = _x()
  assert torch.equal(host(runtime.place_split(x)), x)
  xs = [x, _x(5, 0.5), torch.arange(N, dtype=torch.int64)]
  ts = runtime.place_split(xs)
  assert len(ts) == len(xs)
  for got, want in zip(runtime.to_host(ts), xs):
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_place_per_device_round_trips_a_vector(host):
  """Runtime.place_per_device: one element per device (what a strategy's device
  index is made of)."""
  x = torch.arange(N, dtype=torch.int32) * 10
  t = runtime.place_per_device(x, N)
  assert runtime.is_device_tensor(t)
  assert torch.equal(host(t), x)


def test_place_per_device_round_trips_rows(host):
  """Runtime.place_per_device: "a host tensor of one row per device", rows of
  any shape (torch_xla placed only vectors right before issue 33: a (4, 3)
  tensor crashed the process when read)."""
  x = torch.arange(N * 3, dtype=torch.float32).reshape(N, 3)
  t = runtime.place_per_device(x, N)
  assert torch.equal(host(t), x)
  for (block, _), want in zip(runtime.local_shards(t), torch.chunk(x, N)):
    assert torch.equal(block, want)


def test_is_device_tensor():
  """Runtime.is_device_tensor: true for placed tensors, false for host tensors."""
  x = _x()
  assert runtime.is_device_tensor(runtime.place_replicated(x))
  assert runtime.is_device_tensor(runtime.place_split(x))
  assert runtime.is_device_tensor(runtime.place_split(x) * 2)  # computed from one
  assert not runtime.is_device_tensor(x)
  assert not runtime.is_device_tensor(torch.zeros(()))


def test_local_shards_are_each_replicas_block():
  """Runtime.local_shards: [(host block, device name)] in device order; a split
  tensor's blocks are its rows (torch.chunk), a replicated one's the whole."""
  x = _x()
  names = list(runtime.process_devices()[2])
  shards = runtime.local_shards(runtime.place_split(x))
  assert [name for _, name in shards] == names
  for (block, _), want in zip(shards, torch.chunk(x, N)):
    assert block.device.type == "cpu"
    assert torch.equal(block, want)
  shards = runtime.local_shards(runtime.place_replicated(x))
  assert [name for _, name in shards] == names
  for block, _ in shards:
    assert torch.equal(block, x)


def test_global_from_local_shards_rebuilds_the_tensor(host):
  """Runtime.global_from_local_shards with Runtime.sharding: the blocks of a split
  tensor (or the copies of a replicated one) make it again, placed alike."""
  x = _x(cols=5)
  split = runtime.place_split(x)
  blocks = [b for b, _ in runtime.local_shards(split)]
  rebuilt = runtime.global_from_local_shards(blocks, runtime.sharding(2, N), x.shape)
  assert runtime.is_device_tensor(rebuilt)
  assert torch.equal(host(rebuilt), x)
  assert runtime.sharding_spec(rebuilt) == runtime.sharding_spec(split)
  replicated = runtime.place_replicated(x)
  copies = [b for b, _ in runtime.local_shards(replicated)]
  rebuilt = runtime.global_from_local_shards(copies, runtime.sharding(2, N, split=False), x.shape)
  assert torch.equal(host(rebuilt), x)
  assert runtime.sharding_spec(rebuilt) == runtime.sharding_spec(replicated)


def test_sharding_spec_names_the_placement():
  """Runtime.sharding_spec: equal texts for equal placements, different for split
  and replicated, "" for a host tensor."""
  a, b = _x(), _x(offset=7.0)
  split_a, split_b = runtime.place_split(a), runtime.place_split(b)
  rep_a, rep_b = runtime.place_replicated(a), runtime.place_replicated(b)
  for t in (split_a, rep_a):
    assert isinstance(runtime.sharding_spec(t), str) and runtime.sharding_spec(t)
  assert runtime.sharding_spec(split_a) == runtime.sharding_spec(split_b)
  assert runtime.sharding_spec(rep_a) == runtime.sharding_spec(rep_b)
  assert runtime.sharding_spec(split_a) != runtime.sharding_spec(rep_a)
  assert runtime.sharding_spec(a) == ""


def test_ensure_sharded_gives_a_computed_tensor_the_replicated_placement(host):
  """Runtime.ensure_sharded: a device tensor made without a placement gets the
  replicated one (one already placed keeps its own)."""
  made = torch.arange(6, dtype=torch.float32, device=runtime.device()) * 2
  t = runtime.ensure_sharded(made)
  assert runtime.is_device_tensor(t)
  assert runtime.sharding_spec(t) == runtime.sharding_spec(runtime.place_replicated(torch.ones(6)))
  assert torch.equal(host(t), torch.arange(6, dtype=torch.float32) * 2)
  split = runtime.place_split(_x())
  assert runtime.sharding_spec(runtime.ensure_sharded(split)) == runtime.sharding_spec(
    runtime.place_split(_x())
  )


def test_replica_copies_are_each_replicas_block():
  """Runtime.replica_copies: one per replica, holding that replica's block of a
  split tensor, or the whole of a replicated one."""
  x = _x()
  copies = runtime.replica_copies(runtime.place_split(x), N)
  assert len(copies) == N
  for got, want in zip(copies, torch.chunk(x, N)):
    assert torch.equal(_host_copy(got), want)
  copies = runtime.replica_copies(runtime.place_replicated(x), N)
  assert len(copies) == N
  for got in copies:
    assert torch.equal(_host_copy(got), x)
