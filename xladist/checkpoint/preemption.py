"""`PreemptionCheckpointHandler`: saves a checkpoint through a `CheckpointManager`
when the job receives SIGTERM, after the running step, and exits; on several
hosts the hosts agree first."""

import signal
import sys
import threading

import torch

from xladist import context
from xladist.checkpoint.manager import CheckpointManager
from xladist.cluster_resolver import _multihost
from xladist.reduce_util import ReduceOp


def _default_exit():
  sys.exit(0)


class PreemptionCheckpointHandler:
  """Saves a checkpoint and exits when the job receives SIGTERM between steps.

  Like tf.distribute.experimental.PreemptionCheckpointHandler: wrap each
  training step in `run`. The SIGTERM handler only records the signal; after
  the step that was running (or the next one) finishes, `run` saves a
  checkpoint through the manager, numbered by `total_run_calls`, and calls
  `exit_fn`. The number of completed steps is saved in the manager's
  checkpoint (as "_preemption_handler"), so after `restore_or_initialize()` in
  the restarted job `total_run_calls` says where training stopped.

  The default `exit_fn` is `sys.exit(0)`: a clean exit (finally blocks and
  context managers run) with status 0, so that a scheduler that restarts
  preempted jobs sees success. TF's default exits with status 42 on platforms
  that restart a job on that code; pass `exit_fn=lambda: sys.exit(42)` for
  that behaviour.

  The handler is installed for the main thread's SIGTERM; `close()` (or leaving
  a `with` block) puts the previous handler back.

  On several hosts (MultiWorkerMirroredStrategy, TPUStrategy on a pod) SIGTERM
  may reach only some of them, and a host that leaves alone would leave the
  others stuck in the next step's collectives. So every
  `check_interval_steps` calls the hosts agree (one MAX all-reduce of their
  flags, read back with the cluster's timeout) and, if any host was signalled,
  all save at that same step and call `exit_fn`. A signalled host therefore
  trains up to `check_interval_steps - 1` more steps: choose it so that they
  fit in the notice the platform gives. On one host the flag is checked after
  every step, with no collective.

  Args:
    checkpoint_manager: the `CheckpointManager` that saves.
    exit_fn: called with no argument after the save; if it returns, training
      goes on.
    strategy: the strategy whose hosts agree (default: the current strategy
      when the handler is made or run); needed on several hosts only.
    check_interval_steps: on several hosts, how many `run` calls pass between
      agreements (default 10).

  Raises:
    TypeError: `checkpoint_manager` is not a CheckpointManager, or
      `check_interval_steps` is not a positive int.
    RuntimeError: not created in the main thread (Python delivers signals
      there only).

  Example::

    manager = xc.CheckpointManager(ckpt, directory)
    handler = xc.PreemptionCheckpointHandler(manager)
    manager.restore_or_initialize()
    while handler.total_run_calls < num_steps:
      handler.run(train_step, next(iterator))
  """

  _NAME = "_preemption_handler"

  def __init__(self, checkpoint_manager, exit_fn=None, strategy=None, check_interval_steps=10):
    api = "xladist.checkpoint.PreemptionCheckpointHandler"
    if not isinstance(checkpoint_manager, CheckpointManager):
      raise TypeError(
        f"{api}: checkpoint_manager must be an xladist.checkpoint.CheckpointManager, "
        f"got {type(checkpoint_manager).__name__}."
      )
    if (
      isinstance(check_interval_steps, bool)
      or not isinstance(check_interval_steps, int)
      or check_interval_steps < 1
    ):
      raise TypeError(
        f"{api}: check_interval_steps must be a positive int, got {check_interval_steps!r}."
      )
    self._strategy = (
      strategy
      if strategy is not None
      else (context.get_strategy() if context.has_strategy() else None)
    )
    self._check_interval = check_interval_steps
    if threading.current_thread() is not threading.main_thread():
      raise RuntimeError(
        f"{api} must be created in the main thread: Python runs signal handlers only there."
      )
    self._manager = checkpoint_manager
    self._exit_fn = _default_exit if exit_fn is None else exit_fn
    self._total_run_calls = 0
    self._received = None
    self._previous = signal.signal(signal.SIGTERM, self._on_signal)
    self._closed = False
    checkpoint_manager.checkpoint._add_optional(self._NAME, self)

  def _on_signal(self, signum, frame):
    # Only record it: the step being traced or run must finish first.
    self._received = signum

  @property
  def total_run_calls(self):
    """The number of `run` calls that finished, counting those of restored runs."""
    return self._total_run_calls

  @property
  def preemption_received(self):
    """True when SIGTERM arrived and no checkpoint was saved for it yet."""
    return self._received is not None

  def state_dict(self):
    return {"total_run_calls": self._total_run_calls}

  def load_state_dict(self, state):
    self._total_run_calls = int(state["total_run_calls"])

  def run(self, fn, *args, **kwargs):
    """Runs `fn(*args, **kwargs)` (one training step) and returns its result.

    If SIGTERM arrived before or during the call, saves a checkpoint after it
    returns and calls `exit_fn`. An exception from `fn` propagates without a
    save (the step did not complete).
    """
    result = fn(*args, **kwargs)
    self._total_run_calls += 1
    self.save_checkpoint_if_preempted()
    return result

  def save_checkpoint_if_preempted(self):
    """Saves a checkpoint and calls `exit_fn` if SIGTERM arrived (on several
    hosts: at an agreement step, if it arrived at any host); else nothing."""
    if _multihost.host_timeout() is None:  # one host
      if self._received is None:
        return
    elif self._total_run_calls % self._check_interval or not self._any_host_signalled():
      return
    self._manager.save(checkpoint_number=self._total_run_calls)
    self._received = None
    self._exit_fn()

  def _any_host_signalled(self):
    """One MAX all-reduce of every host's flag (all hosts call it at the same step)."""
    strategy = self._strategy or (context.get_strategy() if context.has_strategy() else None)
    if strategy is None:
      raise RuntimeError(
        "xladist.checkpoint.PreemptionCheckpointHandler: on several hosts the "
        "hosts agree on when to save through their strategy; pass strategy= or "
        "make the handler inside strategy.scope()."
      )
    flag = int(self._received is not None)
    flags = strategy.experimental_distribute_values_from_function(
      lambda ctx: torch.tensor(flag, dtype=torch.int32)
    )
    anyone = strategy.reduce(ReduceOp.MAX, flags, axis=None)
    _multihost.wait_for_hosts(
      [anyone], "PreemptionCheckpointHandler: the hosts' agreement on a preemption save"
    )
    return bool(anyone.item())

  def close(self):
    """Puts back the SIGTERM handler that was installed before. Idempotent."""
    if not self._closed:
      self._closed = True
      if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, self._previous)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False
