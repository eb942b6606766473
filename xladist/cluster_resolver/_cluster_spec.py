"""`ClusterSpec`: job name -> task addresses (re-exported by `xladist.cluster_resolver`)."""


class ClusterSpec:
  """Job name -> task addresses ("host:port"), as TF's `tf.train.ClusterSpec`.

  Example:

    >>> spec = ClusterSpec({"worker": ["w0:8470", "w1:8470"], "chief": ["c:2222"]})
    >>> spec.jobs
    ['chief', 'worker']
    >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
    (2, 'w1:8470')

  Args:
    cluster: a dict from job name to a list of addresses (task i is item i) or
      to a dict {task index: address} (sparse jobs, as TF allows); or another
      `ClusterSpec`; or None / {} for an empty cluster.

  Raises:
    TypeError: `cluster` or one of its parts has the wrong type.
  """

  def __init__(self, cluster=None):
    if isinstance(cluster, ClusterSpec):
      cluster = cluster.as_dict()
    if cluster is None:
      cluster = {}
    if not isinstance(cluster, dict):
      raise TypeError(
        "ClusterSpec: cluster must be a dict from job name to a list of task "
        f"addresses (or a ClusterSpec), got {type(cluster).__name__} {cluster!r}."
      )
    self._jobs = {}
    for job, tasks in cluster.items():
      if not isinstance(job, str):
        raise TypeError(
          f"ClusterSpec: job names must be strings, got {type(job).__name__} {job!r}."
        )
      if isinstance(tasks, (list, tuple)):
        tasks = dict(enumerate(tasks))
        sparse = False
      elif isinstance(tasks, dict):
        sparse = True
      else:
        raise TypeError(
          f"ClusterSpec: the tasks of job {job!r} must be a list of addresses or a "
          f"dict {{task index: address}}, got {type(tasks).__name__} {tasks!r}."
        )
      for index, address in tasks.items():
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
          raise TypeError(
            f"ClusterSpec: job {job!r} has a task index {index!r}; task indices must be ints >= 0."
          )
        if not isinstance(address, str):
          raise TypeError(
            f"ClusterSpec: task {index} of job {job!r} has the address {address!r} "
            f"({type(address).__name__}); addresses must be strings like 'host:port'."
          )
      self._jobs[job] = (dict(sorted(tasks.items())), sparse)

  @property
  def jobs(self):
    """The job names, sorted."""
    return sorted(self._jobs)

  def as_dict(self):
    """Job name -> list of addresses (or {index: address} for sparse jobs)."""
    out = {}
    for job in self.jobs:
      tasks, sparse = self._jobs[job]
      out[job] = dict(tasks) if sparse else list(tasks.values())
    return out

  def _tasks(self, job, api):
    if job not in self._jobs:
      raise ValueError(
        f"ClusterSpec.{api}: no job {job!r} in the cluster; its jobs are {self.jobs}."
      )
    return self._jobs[job][0]

  def num_tasks(self, job):
    """How many tasks job `job` has.

    Raises:
      ValueError: there is no such job.
    """
    return len(self._tasks(job, "num_tasks"))

  def task_indices(self, job):
    """The task indices of job `job`, sorted.

    Raises:
      ValueError: there is no such job.
    """
    return list(self._tasks(job, "task_indices"))

  def task_address(self, job, task_index):
    """The address of task `task_index` of job `job`.

    Raises:
      ValueError: there is no such job or task.
    """
    tasks = self._tasks(job, "task_address")
    if task_index not in tasks:
      raise ValueError(
        f"ClusterSpec.task_address: job {job!r} has no task "
        f"{task_index!r}; its tasks are {list(tasks)}."
      )
    return tasks[task_index]

  def job_tasks(self, job):
    """The addresses of job `job`, a list indexed by task (None for gaps).

    Raises:
      ValueError: there is no such job.
    """
    tasks = self._tasks(job, "job_tasks")
    if not tasks:
      return []
    return [tasks.get(i) for i in range(max(tasks) + 1)]

  def __bool__(self):
    return bool(self._jobs)

  def __eq__(self, other):
    return isinstance(other, ClusterSpec) and self.as_dict() == other.as_dict()

  def __repr__(self):
    return f"ClusterSpec({self.as_dict()!r})"
