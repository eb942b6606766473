"""Which strategy is current, and whether code runs in replica or cross-replica context.

Each thread has a stack of modes. The bottom one is the default: the default
strategy with its default replica context, so that code written for a strategy
runs unchanged outside any scope. `strategy.scope()` pushes a cross-replica mode,
`strategy.run` a replica mode, `merge_call` a cross-replica mode again.
"""

import threading


class _Mode:
  __slots__ = ("strategy", "cross_replica", "replica_context", "update_device", "explicit_default")

  def __init__(self, strategy, cross_replica=None, replica_context=None, update_device=None):
    self.strategy = strategy
    self.cross_replica = cross_replica
    self.replica_context = replica_context
    self.update_device = update_device
    self.explicit_default = False  # the default strategy's scope() entered by the user


class _ThreadStack(threading.local):
  def __init__(self):
    self.modes = []
    self.base = None  # set by experimental_set_strategy


_stack = _ThreadStack()
# The bottom mode of every thread (the default strategy with its default
# replica context). Set by xladist.strategies.default when it is imported: this
# module sits below the strategies and does not import them.
_default = [None]


def set_default_mode(mode):
  _default[0] = mode


def _default_mode():
  if _default[0] is None:
    raise RuntimeError(
      "xladist.context: the default strategy is not set up; import "
      "xladist (not xladist.context alone)."
    )
  return _default[0]


def set_base(mode):
  """The mode under every scope of this thread (experimental_set_strategy)."""
  if _stack.modes:
    raise RuntimeError(
      "experimental_set_strategy must not be called inside a strategy.scope() "
      "or strategy.run; exit the scope first."
    )
  _stack.base = mode


def base():
  return _stack.base


def current_mode():
  if _stack.modes:
    return _stack.modes[-1]
  if _stack.base is not None:
    return _stack.base
  return _default_mode()


def push(mode):
  _stack.modes.append(mode)


def pop(mode):
  if not _stack.modes or _stack.modes[-1] is not mode:
    raise RuntimeError(
      "xladist contexts were exited out of order: a strategy.scope() or "
      "strategy.run was left while an inner one was still active."
    )
  _stack.modes.pop()


def in_step(strategy):
  """True inside `strategy.run` (a replica context pushed by run).

  The default replica context is not a step, also inside the default
  strategy's scope(), which keeps it (TF: `strategy.reduce` and `strategy.run`
  work in the default replica context, distribute_lib's
  _require_cross_replica_or_default_context_extended).
  """
  if not _stack.modes:
    return False
  mode = _stack.modes[-1]
  return (
    mode.strategy is strategy
    and mode.replica_context is not None
    and mode.replica_context is not _default_mode().replica_context
  )


def in_any_step():
  """True inside any strategy's `run`, also in a merge_fn or a scope entered there.

  The same rule as `in_step`: the default replica context (also inside the
  default strategy's scope()) is not a step.
  """
  default = _default_mode().replica_context
  return any(
    mode.replica_context is not None and mode.replica_context is not default
    for mode in _stack.modes
  )


def get_strategy():
  """The current strategy: the one whose scope (or run) encloses the caller.

  Outside any scope this is the default strategy: one replica, no placement.
  """
  return current_mode().strategy


def has_strategy():
  """True inside a non-default strategy's scope (or after experimental_set_strategy)."""
  return not get_strategy().extended._is_default


def in_cross_replica_context():
  """True in a strategy's scope outside `run`, and inside `merge_call`'s merge_fn."""
  return current_mode().cross_replica is not None


def get_replica_context():
  """The ReplicaContext inside `run` (or the default one outside any scope).

  Returns None in cross-replica context: inside a scope but outside `run`, and
  inside merge_fn.
  """
  return current_mode().replica_context


def get_cross_replica_context():
  """The current strategy when in cross-replica context, else None."""
  return current_mode().cross_replica


def current_device():
  """The device the current code places tensors on.

  Inside `run` this is the device of the replica being traced (all replicas are
  traced at once, so it is the SPMD device that holds them); elsewhere the
  current strategy's default device.
  """
  return get_strategy().extended._current_device()


def current_update_device():
  """Inside `extended.update`, the device being updated; None elsewhere."""
  return current_mode().update_device


# Aliases of the legacy and Scala APIs.
current_strategy = get_strategy
get_tower_context = get_replica_context
