"""`TPUClusterResolver`: the Cloud TPU slice this process runs on, from the VM's environment."""

import os

from xladist.cluster_resolver import _tpu_env
from xladist.cluster_resolver._base import ClusterResolver
from xladist.cluster_resolver._cluster_spec import ClusterSpec


class TPUClusterResolver(ClusterResolver):
  """The Cloud TPU slice this process runs on (TF's `TPUClusterResolver`).

  xladist runs one process per TPU VM host ("worker"); this resolver reads the
  VM's environment and derives the slice from its accelerator type (see
  `xladist/cluster_resolver/_tpu_env.py` for the table; e.g. v4-8: 1 host x 4 chips, v5litepod-16:
  4 hosts x 4 chips). Each value comes from the first of:

  * accelerator type: TPU_ACCELERATOR_TYPE, metadata 'accelerator-type';
  * worker id: TPU_WORKER_ID, CLOUD_TPU_TASK_ID, metadata 'agent-worker-number'
    (0 on a single host);
  * worker addresses: TPU_WORKER_HOSTNAMES ("host0,host1,..."), metadata
    'worker-network-endpoints' ("hostname:uid:ip,...": the IPs), "localhost" on
    a single host;
  * hosts / chips per host: TPU_HOST_BOUNDS or TPU_PROCESS_BOUNDS, and
    TPU_CHIPS_PER_HOST_BOUNDS or TPU_CHIPS_PER_PROCESS_BOUNDS ("x,y,z"), else the
    accelerator type.

  Metadata is read only for values the environment lacks, and not at all when
  TPU_SKIP_MDS_QUERY is set (as in torch_xla). Addresses use port 8470, the TPU
  worker port of TF's resolver; xladist itself does not listen on it (torch_xla's
  runtime picks its own ports), so `cluster_spec()` and `master()` describe the
  hosts for code that expects TF's format.

  Example, worker 2 of a v5litepod-16 (4 hosts x 4 chips):

    >>> r = TPUClusterResolver(env={"TPU_ACCELERATOR_TYPE": "v5litepod-16",
    ...     "TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5"})
    >>> r.task_type, r.task_id, r.master(), r.num_accelerators()
    ('worker', 2, 'grpc://10.0.0.2:8470', {'TPU': 4})

  Args:
    tpu: None, "" or "local": this VM. Another string is taken as this TPU's
      name (`tpu_name`); the cluster is still read from this VM, since xladist
      runs on the TPU VM itself. "grpc://..." addresses of remote TPU nodes are
      not supported.
    zone, project: recorded (for scripts that name the TPU); no Cloud API call
      is made.
    job_name: the job name of the workers ("worker").
    coordinator_name, coordinator_address, credentials, service,
      discovery_url: accepted for TF compatibility and ignored (there is no
      coordinator job and no Cloud TPU API call).
    env: the environment mapping to read (default `os.environ`).
    metadata: a callable from metadata attribute name to its value (str) or
      None; default: the VM's metadata server. Pass one in tests.

  Raises:
    NotImplementedError: `tpu` is a "grpc://" address.
    RuntimeError: a value missing from `env` had to be read from the VM
      metadata server, which cannot be reached (not on a Cloud TPU VM).
    ValueError: the environment is malformed: an unknown accelerator type, a
      non-numeric worker id, a worker id outside the worker list, a worker list
      whose length does not match the slice, bad bounds. The message names the
      variable or metadata attribute and its value.
  """

  def __init__(
    self,
    tpu=None,
    zone=None,
    project=None,
    job_name="worker",
    coordinator_name=None,
    coordinator_address=None,
    credentials="default",
    service=None,
    discovery_url=None,
    env=None,
    metadata=None,
  ):
    del coordinator_name, coordinator_address, credentials, service, discovery_url
    if tpu is not None and not isinstance(tpu, str):
      raise TypeError(
        f"TPUClusterResolver: tpu must be a string or None, got {type(tpu).__name__} {tpu!r}."
      )
    if tpu and tpu.startswith("grpc://"):
      raise NotImplementedError(
        f"TPUClusterResolver: tpu={tpu!r} is the address of a remote TPU node; xladist "
        "runs on the TPU VM itself. Run the program on the TPU VM (see tpu_scripts/) "
        "and pass tpu=None or the TPU's name."
      )
    super().__init__(job_name, None, "grpc", "")
    self.tpu_name = None if tpu in (None, "", "local") else tpu
    self.zone = zone
    self.project = project
    self._env = os.environ if env is None else env
    if metadata is None and not self._env.get("TPU_SKIP_MDS_QUERY"):
      metadata = _tpu_env.gce_metadata
    self._metadata = metadata
    self._resolve()

  def _lookup(self, names, metadata_key):
    """(value, source) from the first set variable of `names`, else metadata."""
    for name in names:
      value = self._env.get(name)
      if value not in (None, ""):
        return value.strip(), name
    if metadata_key and self._metadata is not None:
      value = self._metadata(metadata_key)
      if value not in (None, ""):
        return value.strip(), f"metadata '{metadata_key}'"
    return None, None

  def _resolve(self):
    accelerator, source = self._lookup(["TPU_ACCELERATOR_TYPE"], "accelerator-type")
    if accelerator is None:
      raise ValueError(
        "TPUClusterResolver: no accelerator type: TPU_ACCELERATOR_TYPE is unset and "
        "the VM metadata has no 'accelerator-type'. Run on a Cloud TPU VM or set "
        "TPU_ACCELERATOR_TYPE (e.g. 'v4-8')."
      )
    topology = _tpu_env.parse_accelerator_type(accelerator, source)
    hosts, chips = topology.num_hosts, topology.chips_per_host
    for names, what in (
      (["TPU_HOST_BOUNDS", "TPU_PROCESS_BOUNDS"], "hosts"),
      (["TPU_CHIPS_PER_HOST_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS"], "chips"),
    ):
      value, name = self._lookup(names, None)
      if value is not None:
        if what == "hosts":
          hosts = _tpu_env.parse_bounds(value, name)
        else:
          chips = _tpu_env.parse_bounds(value, name)
    self._topology = _tpu_env.TpuTopology(
      accelerator, topology.generation, hosts, chips, topology.devices_per_chip
    )

    names, source = self._lookup(["TPU_WORKER_HOSTNAMES"], None)
    if names is not None:
      hostnames = [h.strip() for h in names.split(",")]
      if not all(hostnames):
        raise ValueError(
          f"TPUClusterResolver: TPU_WORKER_HOSTNAMES={names!r} has an "
          "empty entry; expected 'host0,host1,...'."
        )
      source, shown = "TPU_WORKER_HOSTNAMES", names
    else:
      endpoints, source = self._lookup([], "worker-network-endpoints")
      hostnames = _tpu_env.parse_endpoints(endpoints) if endpoints else None
      shown = endpoints
    if hostnames is None:
      if hosts > 1:
        raise ValueError(
          f"TPUClusterResolver: the slice {accelerator!r} has {hosts} hosts, but "
          "TPU_WORKER_HOSTNAMES is unset and the VM metadata has no "
          "'worker-network-endpoints'; set TPU_WORKER_HOSTNAMES to 'host0,host1,...'."
        )
      hostnames = ["localhost"]
    elif len(hostnames) != hosts:
      raise ValueError(
        f"TPUClusterResolver: {source}={shown!r} lists {len(hostnames)} workers, but "
        f"the slice {accelerator!r} has {hosts} hosts; list one address per host."
      )
    self._hostnames = hostnames

    worker, source = self._lookup(["TPU_WORKER_ID", "CLOUD_TPU_TASK_ID"], "agent-worker-number")
    if worker is None:
      if hosts > 1:
        raise ValueError(
          f"TPUClusterResolver: the slice {accelerator!r} has {hosts} hosts, but "
          "TPU_WORKER_ID is unset and the VM metadata has no 'agent-worker-number'; "
          "set TPU_WORKER_ID to this host's index."
        )
      worker, source = "0", None
    try:
      worker_id = int(worker)
    except ValueError:
      raise ValueError(
        f"TPUClusterResolver: {source}={worker!r} is not a worker "
        "index; expected an int such as '0'."
      ) from None
    if not 0 <= worker_id < len(hostnames):
      raise ValueError(
        f"TPUClusterResolver: {source}={worker!r} is outside the {len(hostnames)} "
        f"workers {hostnames}; expected 0 .. {len(hostnames) - 1}."
      )
    self.task_id = worker_id

  @property
  def topology(self):
    """The slice's hosts, chips per host and XLA devices per chip."""
    return self._topology

  @property
  def accelerator_type(self):
    """The accelerator type, e.g. "v4-8"."""
    return self._topology.accelerator_type

  @property
  def worker_hostnames(self):
    """The workers' host names or IPs, in worker order ("localhost" on one host)."""
    return list(self._hostnames)

  def cluster_spec(self):
    """{job_name: ["host0:8470", "host1:8470", ...]}."""
    return ClusterSpec({self.task_type: [f"{h}:{_tpu_env.WORKER_PORT}" for h in self._hostnames]})

  def master(self, task_type=None, task_id=None, rpc_layer=None):
    """A worker's address: the named one, else worker 0 ("grpc://host:8470").

    "" on a single host when no task is named (as TF's resolver for a local TPU).
    """
    if task_type is not None and task_id is not None:
      return self._task_master(task_type, task_id, rpc_layer)
    if len(self._hostnames) == 1:
      return ""
    return self._task_master(self.task_type, 0, rpc_layer)

  def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
    """{"TPU": XLA devices on one host} (every host of a slice has the same)."""
    del task_type, task_id, config_proto
    return {"TPU": self._topology.devices_per_host}
