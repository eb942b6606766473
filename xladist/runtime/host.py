"""What every runtime does the same way on the host: bounded waits, user frames."""

import os
import threading
import traceback

_SKIP_FRAMES = tuple(
  os.sep + name + os.sep for name in ("torch", "torch_xla", "torchax", "jax", "jaxlib", "xladist")
) + (os.sep + "contextlib.py",)


class HostReadInStep(RuntimeError):
  """A step's traced value was read on the host while the step was traced
  (every runtime raises this one class: runtime/contract.py `no_execution`)."""


def frame_outside(frames):
  """'at file:line: code' of the innermost frame outside torch, the runtime
  libraries and xladist."""
  for frame in reversed(frames):
    if not any(s in frame.filename for s in _SKIP_FRAMES):
      return f"at {frame.filename}:{frame.lineno}: {frame.line}"
  return "in a torch operation"


def user_frame():
  """`frame_outside` of the current call stack."""
  return frame_outside(traceback.extract_stack()[:-1])


def call_with_timeout(fn, timeout_seconds, message):
  """Runs `fn()` in a daemon thread and returns its result within `timeout_seconds`.

  The one way xladist bounds a host-side wait that the runtime offers no
  timeout for (a device wait, a collective whose peer died, the start of a
  multi-host runtime).

  Raises:
    TimeoutError: `fn` did not return in time, with `message`. The thread is
      left behind, still blocked in `fn` (a daemon: it does not keep the
      process alive).
    BaseException: whatever `fn` raised, re-raised in the caller's thread.
  """
  done = threading.Event()
  outcome = []

  def target():
    try:
      outcome.append((True, fn()))
    except BaseException as e:  # re-raised in the caller's thread
      outcome.append((False, e))
    finally:
      done.set()

  threading.Thread(target=target, name="xladist-bounded-wait", daemon=True).start()
  if not done.wait(timeout_seconds):
    raise TimeoutError(message)
  ok, value = outcome[0]
  if not ok:
    raise value
  return value


def shares_storage(tensor):
  """Whether another tensor shares `tensor`'s storage (a `detach()`, `.data` or a
  view someone keeps): its buffer must not be given up to a program's results."""
  import torch

  return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) > 1
