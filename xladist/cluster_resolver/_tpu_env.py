"""What a Cloud TPU VM says about its slice: accelerator type, workers, bounds.

Used by `cluster_resolver.TPUClusterResolver`. The names are those torch_xla 2.9
reads (`torch_xla/_internal/tpu.py`, `torch_xla/core/xla_env_vars.py`):
environment variables TPU_ACCELERATOR_TYPE, TPU_WORKER_ID (or CLOUD_TPU_TASK_ID),
TPU_WORKER_HOSTNAMES, TPU_HOST_BOUNDS / TPU_PROCESS_BOUNDS and
TPU_CHIPS_PER_HOST_BOUNDS / TPU_CHIPS_PER_PROCESS_BOUNDS, and the VM metadata
attributes 'accelerator-type', 'agent-worker-number' and
'worker-network-endpoints' ("hostname:uid:ip,..."), which the metadata server
serves under computeMetadata/v1/instance/attributes/.

Accelerator types (what the number after the dash counts, per Cloud TPU's
documentation of the slice shapes):

| type | number counts | chips per host | XLA devices per chip |
|---|---|---|---|
| v2-N, v3-N | TensorCores (N % 8 == 0) | 4 | 2 (one per TensorCore) |
| v4-N, v5p-N | TensorCores (N % 8 == 0) | 4 | 1 (megacore: both cores are one device) |
| v5litepod-N (alias v5e-N), v6e-N | chips | N when N <= 8 (one host), else 4 | 1 |

So v4-8 is 1 host x 4 chips, v4-32 is 4 hosts x 4 chips, v5litepod-16 is 4 hosts x
4 chips and v5litepod-8 / v6e-8 is one host with 8 chips. Bounds variables, when
set, override the chips per host and host count derived from the type (in SPMD
one process runs per host, so process bounds are host bounds).
"""

import dataclasses
import math
import re
import urllib.error
import urllib.request

WORKER_PORT = 8470  # the TPU worker port of TF's TPUClusterResolver addresses
_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
_TYPE_RE = re.compile(r"^(v2|v3|v4|v5p|v5e|v5litepod|v6e)-(\d+)$")


@dataclasses.dataclass(frozen=True)
class TpuTopology:
  """Hosts, chips and XLA devices of a TPU slice."""

  accelerator_type: str
  generation: str  # "v2", "v3", "v4", "v5p", "v5e" or "v6e"
  num_hosts: int
  chips_per_host: int
  devices_per_chip: int

  @property
  def devices_per_host(self):
    return self.chips_per_host * self.devices_per_chip

  @property
  def num_chips(self):
    return self.num_hosts * self.chips_per_host


def parse_accelerator_type(accelerator_type, source="TPU_ACCELERATOR_TYPE"):
  """The `TpuTopology` of an accelerator type such as "v4-8" or "v5litepod-16".

  Raises:
    ValueError: the type is not one of those in the module docstring, or its
      number does not fit the generation; the message names `source`.
  """
  match = _TYPE_RE.match(accelerator_type.strip().lower())
  if not match:
    raise ValueError(
      f"TPUClusterResolver: {source}={accelerator_type!r} is not a known accelerator "
      "type; expected v2-N, v3-N, v4-N, v5p-N, v5litepod-N (or v5e-N) or v6e-N, "
      "e.g. 'v4-8' or 'v5litepod-16'."
    )
  generation, n = match.group(1), int(match.group(2))
  if generation == "v5litepod":
    generation = "v5e"
  if generation in ("v2", "v3", "v4", "v5p"):
    if n == 0 or n % 8:
      raise ValueError(
        f"TPUClusterResolver: {source}={accelerator_type!r}: the number of a "
        f"{generation} type counts TensorCores and must be a multiple of 8 (4 chips "
        f"per host), e.g. '{generation}-8'."
      )
    chips = n // 2
    per_chip = 2 if generation in ("v2", "v3") else 1
    return TpuTopology(accelerator_type, generation, chips // 4, 4, per_chip)
  if n == 0 or (n > 8 and n % 4):
    raise ValueError(
      f"TPUClusterResolver: {source}={accelerator_type!r}: the number of a "
      f"{generation} type counts chips: 1 to 8 on one host, or a multiple of 4 "
      f"(4 chips per host), e.g. '{match.group(1)}-16'."
    )
  if n <= 8:
    return TpuTopology(accelerator_type, generation, 1, n, 1)
  return TpuTopology(accelerator_type, generation, n // 4, 4, 1)


def parse_bounds(value, source):
  """The product of "x,y,z" bounds.

  Raises:
    ValueError: `value` is not three (or, as for TPU v7, four) positive ints.
  """
  parts = value.split(",")
  try:
    dims = [int(p) for p in parts]
  except ValueError:
    dims = []
  if len(dims) not in (3, 4) or min(dims) < 1:
    raise ValueError(
      f"TPUClusterResolver: {source}={value!r} is not a bounds string of "
      "three positive ints such as '2,2,1'."
    )
  return math.prod(dims)


def gce_metadata(key, timeout=5.0):
  """A Cloud TPU VM's metadata attribute `key`, or None when the VM has none.

  Raises:
    RuntimeError: the metadata server cannot be reached (not on a Cloud VM).
  """
  request = urllib.request.Request(_METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
  try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
      return response.read().decode()
  except urllib.error.HTTPError as e:
    if e.code == 404:
      return None
    raise RuntimeError(
      f"TPUClusterResolver: the VM metadata server answered {e.code} for attribute {key!r}."
    ) from None
  except (urllib.error.URLError, OSError) as e:
    raise RuntimeError(
      f"TPUClusterResolver: the VM metadata server is not reachable ({e}) while "
      f"reading attribute {key!r}. Off a Cloud TPU VM, set TPU_ACCELERATOR_TYPE, "
      "TPU_WORKER_ID and TPU_WORKER_HOSTNAMES, or pass env= and metadata=."
    ) from None


def parse_endpoints(value):
  """IPs from 'worker-network-endpoints' ("hostname:uid:ip,hostname:uid:ip,...").

  Raises:
    ValueError: an entry does not have three ':'-separated fields.
  """
  ips = []
  for entry in value.split(","):
    fields = entry.strip().split(":")
    if len(fields) < 3 or not fields[2]:
      raise ValueError(
        f"TPUClusterResolver: metadata 'worker-network-endpoints'={value!r} has the "
        f"entry {entry!r}; expected 'hostname:uid:ip' entries separated by commas."
      )
    ips.append(fields[2])
  return ips
