"""Which rows of each global batch a host feeds (xladist/input/sharding.py): pure arithmetic
on host and replica counts, and the slicing of batches on the CPU.

Replicas are numbered host by host: with H hosts and R replicas, host h feeds replicas
[h*R/H, (h+1)*R/H) and keeps rows [h*B/H, (h+1)*B/H) of a global batch of B rows. The
references are the rows each replica gets on one host (`torch.chunk` of the global
batch into R parts), gathered per host.
"""

import dataclasses

import numpy as np
import pytest
import torch

from xladist.input import sharding as S
from xladist.input.options import InputContext

LAYOUTS = [(1, 1), (1, 4), (2, 2), (2, 4), (3, 6), (4, 4), (4, 8)]  # (hosts, replicas)


def test_the_docstrings_example():
  """2 hosts x 2 replicas, a global batch of 8 rows."""
  assert S.host_replica_ids(2, 0, 4) == range(0, 2)
  assert S.host_replica_ids(2, 1, 4) == range(2, 4)
  assert S.host_row_range(8, 2, 0, 4) == (0, 4)
  assert S.host_row_range(8, 2, 1, 4) == (4, 8)
  assert S.host_row_range(12, 3, 1, 6) == (4, 8)


@pytest.mark.parametrize("hosts, replicas", LAYOUTS)
def test_hosts_keep_their_replicas_rows_as_on_one_host(hosts, replicas):
  for per_replica in (1, 3):
    batch = torch.arange(replicas * per_replica * 2).reshape(replicas * per_replica, 2)
    one_host = torch.chunk(batch, replicas)  # replica r's rows on a single host
    kept = []
    for h in range(hosts):
      ids = list(S.host_replica_ids(hosts, h, replicas))
      assert len(ids) == replicas // hosts
      start, stop = S.host_row_range(len(batch), hosts, h, replicas)
      assert torch.equal(batch[start:stop], torch.cat([one_host[r] for r in ids]))
      local = S.host_batch(batch, hosts, h, replicas)
      assert torch.equal(local, batch[start:stop])
      kept.append(local)
    assert torch.equal(torch.cat(kept), batch)  # every row kept once, in order


def test_an_empty_batch_has_empty_ranges():
  assert S.host_row_range(0, 2, 1, 4) == (0, 0)


def test_host_batch_slices_every_tensor_and_array_of_a_nest():
  @dataclasses.dataclass
  class Batch:
    x: torch.Tensor
    y: np.ndarray
    name: str

  batch = {
    "batch": Batch(torch.arange(8.0), np.arange(16).reshape(8, 2), "train"),
    "ids": [torch.arange(8) * 10],
    "step": 3,
  }
  local = S.host_batch(batch, 2, 1, 4)
  assert local["batch"].x.tolist() == [4.0, 5.0, 6.0, 7.0]
  assert local["batch"].y.tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
  assert local["batch"].name == "train" and local["step"] == 3  # kept whole
  assert local["ids"][0].tolist() == [40, 50, 60, 70]
  assert isinstance(local["batch"], Batch) and isinstance(local["ids"], list)


@pytest.mark.parametrize(
  "call, error, message",
  [
    (lambda: S.host_replica_ids(0, 0, 4), ValueError, "num_hosts must be >= 1, got 0"),
    (lambda: S.host_replica_ids(2, -1, 4), ValueError, "host_index must be >= 0, got -1"),
    (lambda: S.host_replica_ids(2, 0, 0), ValueError, "num_replicas must be >= 1, got 0"),
    (
      lambda: S.host_replica_ids(2, 2, 4),
      ValueError,
      "host_replica_ids: host_index 2 is out of range for 2 hosts (0 .. 1).",
    ),
    (
      lambda: S.host_replica_ids(3, 0, 4),
      ValueError,
      "host_replica_ids: 4 replicas cannot be spread evenly over 3 hosts; every host must "
      "run the same number of replicas.",
    ),
    (
      lambda: S.host_replica_ids(2.0, 0, 4),
      TypeError,
      "host_replica_ids: num_hosts must be an int, got float 2.0.",
    ),
    (lambda: S.host_replica_ids(2, True, 4), TypeError, "host_index must be an int, got bool"),
    (
      lambda: S.host_row_range(10, 2, 0, 4),
      ValueError,
      "host_row_range: the global batch size 10 is not divisible by the 4 replicas; use a "
      "multiple of 4 (drop or pad the last partial batch).",
    ),
    (
      lambda: S.host_row_range(-4, 2, 0, 4),
      ValueError,
      "host_row_range: global_batch_size must be >= 0, got -4.",
    ),
    (lambda: S.host_row_range(8, 2, 2, 4), ValueError, "host_index 2 is out of range"),
  ],
)
def test_arguments_out_of_range(call, error, message):
  with pytest.raises(error) as info:
    call()
  assert message in str(info.value)


def test_batches_that_cannot_be_split():
  with pytest.raises(ValueError, match=r"a batch holds a scalar .* needs a batch dimension"):
    S.host_batch({"x": torch.zeros(4), "w": torch.tensor(1.0)}, 2, 0, 2)
  with pytest.raises(ValueError, match="holds no tensor or array; there is nothing to split"):
    S.host_batch({"name": "x", "n": 3}, 2, 0, 2)
  with pytest.raises(ValueError) as info:
    S.host_batch((torch.zeros(4), np.zeros((6, 2))), 2, 0, 2)
  assert str(info.value) == (
    "host_batch: the tensors of one batch have different sizes in dim 0 ([4, 6]); all must "
    "have the batch size there."
  )
  with pytest.raises(ValueError, match="global batch size 6 is not divisible by the 4"):
    S.host_batch(torch.zeros(6), 2, 0, 4)


def test_host_sharded_dataset_is_re_iterable():
  loader = [torch.arange(8) + 100 * i for i in range(3)]
  local = S.HostShardedDataset(loader, num_hosts=2, host_index=1, num_replicas=4)
  for _ in range(2):
    assert [b.tolist() for b in local] == [[4, 5, 6, 7], [104, 105, 106, 107], [204, 205, 206, 207]]
  with pytest.raises(TypeError, match="dataset must be an iterable of global batches, got int"):
    S.HostShardedDataset(3, 2, 0, 4)
  with pytest.raises(ValueError, match="host_index 2 is out of range"):
    S.HostShardedDataset(loader, 2, 2, 4)  # checked at once, not per batch


def test_input_contexts():
  ctx = S.input_context_for_host(2, 1, 4)
  assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 4)
  (worker,) = S.input_contexts(2, 1, 4)
  assert (worker.num_input_pipelines, worker.input_pipeline_id) == (2, 1)
  per_replica = S.input_contexts(2, 1, 4, per_replica=True)
  assert [
    (c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in per_replica
  ] == [
    (4, 2, 4),
    (4, 3, 4),
  ]
  with pytest.raises(ValueError, match="cannot be spread evenly"):
    S.input_contexts(3, 0, 4)


def test_shard_for_input_context():
  batch = torch.arange(12)
  for h in range(3):
    ctx = InputContext(num_input_pipelines=3, input_pipeline_id=h, num_replicas_in_sync=6)
    assert S.shard_for_input_context(batch, ctx).tolist() == list(range(4 * h, 4 * h + 4))
  with pytest.raises(TypeError, match="input_context must be an InputContext, got tuple"):
    S.shard_for_input_context(batch, (3, 0, 6))
