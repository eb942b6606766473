"""`TFConfigClusterResolver`: the cluster read from the `TF_CONFIG` variable, as TF does."""

import json
import os

from xladist.cluster_resolver._base import ClusterResolver
from xladist.cluster_resolver._cluster_spec import ClusterSpec


class TFConfigClusterResolver(ClusterResolver):
  """Reads the cluster from the `TF_CONFIG` environment variable, as TF does.

  `TF_CONFIG` is JSON such as

    {"cluster": {"worker": ["host0:2222", "host1:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "grpc", "environment": "cloud"}

  ("rpc_layer" and "environment" optional). An unset or empty `TF_CONFIG` is an
  empty cluster with no task (one process on its own).

  Args:
    task_type, task_id, rpc_layer, environment: override what TF_CONFIG says.
    env: the environment mapping to read (default `os.environ`).

  Raises:
    ValueError: TF_CONFIG is not JSON, or lacks or has malformed
      "cluster"/"task" entries (a cluster needs a task and a task a cluster),
      or names a task that is not in the cluster.
  """

  def __init__(self, task_type=None, task_id=None, rpc_layer=None, environment=None, env=None):
    config = self._load(os.environ if env is None else env)
    task = config.get("task", {})
    super().__init__(
      task_type if task_type is not None else task.get("type"),
      task_id if task_id is not None else task.get("index"),
      rpc_layer if rpc_layer is not None else config.get("rpc_layer"),
      environment if environment is not None else config.get("environment", ""),
    )
    self._cluster_spec = config["cluster"]
    if self._cluster_spec and (self.task_type is None or self.task_id is None):
      raise ValueError(
        'TF_CONFIG has a "cluster" but no "task" saying which task this process '
        'is; add "task": {"type": "worker", "index": i} (or pass task_type '
        "and task_id)."
      )
    if self.task_type is not None and self._cluster_spec:
      tasks = self._cluster_spec.as_dict().get(self.task_type)
      if tasks is None:
        raise ValueError(
          f"TF_CONFIG: task type {self.task_type!r} is not a job of the cluster "
          f'(jobs: {self._cluster_spec.jobs}); fix "task": {{"type": ...}}.'
        )
      if self.task_id is not None and self.task_id not in self._cluster_spec.task_indices(
        self.task_type
      ):
        raise ValueError(
          f"TF_CONFIG: task index {self.task_id} is out of range for job "
          f"{self.task_type!r} with {self._cluster_spec.num_tasks(self.task_type)} "
          'tasks; fix "task": {"index": ...}.'
        )

  @staticmethod
  def _load(env):
    raw = env.get("TF_CONFIG", "")
    if not raw.strip():
      return {"cluster": ClusterSpec()}
    try:
      config = json.loads(raw)
    except json.JSONDecodeError as e:
      raise ValueError(
        f"TF_CONFIG is not valid JSON ({e.msg} at character {e.pos}): {raw!r}."
      ) from None
    if not isinstance(config, dict):
      raise ValueError(f'TF_CONFIG must be a JSON object with "cluster" and "task", got {raw!r}.')
    cluster = config.get("cluster", {})
    try:
      config["cluster"] = ClusterSpec(cluster)
    except TypeError as e:
      raise ValueError(f'TF_CONFIG: "cluster" is malformed: {e}') from None
    task = config.get("task", {})
    if not isinstance(task, dict):
      raise ValueError(
        f'TF_CONFIG: "task" must be an object like {{"type": "worker", "index": 0}}, got {task!r}.'
      )
    if config["cluster"] and task:
      for key, kind, what in (("type", str, "a string"), ("index", int, "an int")):
        if key not in task:
          raise ValueError(
            f'TF_CONFIG: "task" has no "{key}" key ({task!r}); it needs both "type" and "index".'
          )
        value = task[key]
        if isinstance(value, bool) or not isinstance(value, kind):
          raise ValueError(f'TF_CONFIG: "task": "{key}" must be {what}, got {value!r}.')
      if task["index"] < 0:
        raise ValueError(f'TF_CONFIG: "task": "index" must be >= 0, got {task["index"]}.')
    if task and not config["cluster"]:
      raise ValueError(
        f'TF_CONFIG has a "task" ({task!r}) but no "cluster"; add '
        '"cluster": {"worker": ["host0:port", ...]}.'
      )
    for key in ("rpc_layer", "environment"):
      if key in config and not isinstance(config[key], str):
        raise ValueError(f'TF_CONFIG: "{key}" must be a string, got {config[key]!r}.')
    config["task"] = task
    return config

  def cluster_spec(self):
    return self._cluster_spec

  def master(self, task_type=None, task_id=None, rpc_layer=None):
    """The address of the named task, else of this task; "" with no cluster."""
    if not self._cluster_spec:
      return ""
    return self._task_master(task_type, task_id, rpc_layer)
