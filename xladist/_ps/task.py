"""What a ps task does: it holds variables (CPU tensors) and applies updates to them.

These functions run inside ps processes, called over RPC by the chief (create,
read, assign, checkpoint state) and by workers (read at the start of a
closure; gradients and variable writes at its end). A variable, or each shard
of a partitioned one, is keyed `(var_id, shard)`.

The optimizer runs here, next to the variables, as in TF (its slot variables
live with their variable): the first gradient for a variable under an
optimizer makes an instance of the optimizer's class for that variable (its
state, e.g. Adam's moments, stays on this task), and each update sets the
hyperparameters the worker sent (so a learning-rate schedule on the chief
reaches the ps tasks). Updates of one task are serialised by a lock; updates
from different workers interleave (asynchronous training, as TF's).

Functions return `("ok", value)` or an `_rpc.error_record`, never raise.
"""

import threading

import torch

from xladist._ps import rpc as _rpc

_lock = threading.Lock()
_vars = {}  # (var_id, shard) -> tensor
_optimizers = {}  # (opt_id, (var_id, shard)) -> torch optimizer over that tensor


def _guard(fn, name):
  """`fn` as a remote function named `name` (RPC pickles functions by name)."""

  def run(*args):
    try:
      with _lock, torch.no_grad():
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - returned to the caller as data
      return _rpc.error_record(e, _rpc.current_task() or "ps:?")

  run.__name__ = run.__qualname__ = name
  return run


def _get(key):
  try:
    return _vars[key]
  except KeyError:
    raise KeyError(
      f"{_rpc.current_task()} holds no variable {key}: the task was restarted "
      "(its variables are lost) or the variable was created by another cluster."
    ) from None


def _create(keys, values):
  for key, value in zip(keys, values):
    _vars[key] = value.detach().clone().contiguous()
  return None


def _read(keys):
  return [_get(k).clone() for k in keys]


def _assign(keys, values):
  for key, value in zip(keys, values):
    _get(key).copy_(value)
  return None


def _add(keys, deltas):
  for key, delta in zip(keys, deltas):
    _get(key).add_(delta)
  return None


def _optimizer(opt_id, key, cls, defaults, hyper):
  opt = _optimizers.get((opt_id, key))
  if opt is None:
    opt = cls([_get(key)], **defaults)
    _optimizers[(opt_id, key)] = opt
  opt.param_groups[0].update(hyper)
  return opt


def _apply(opt_id, cls, defaults, entries, deltas):
  """One closure's update: gradients through the optimizer, then variable writes.

  Args:
    entries: [(key, hyperparameters of its param group, gradient)].
    deltas: [(key, delta)]: changes the closure made to variables by writing
      them (Variable.assign_add, BatchNorm statistics), added here.

  Returns:
    The new values of the keys in `entries` (the worker continues with them).
  """
  out = []
  for key, hyper, grad in entries:
    opt = _optimizer(opt_id, key, cls, defaults, hyper)
    t = _get(key)
    t.grad = grad
    with torch.enable_grad():
      opt.step()
    t.grad = None
    out.append(t.clone())
  for key, delta in deltas:
    _get(key).add_(delta)
  return out


def _optimizer_state(opt_id, keys):
  """Each key's optimizer state (a dict of tensors and numbers), or None."""
  states = []
  for key in keys:
    opt = _optimizers.get((opt_id, key))
    state = None if opt is None else opt.state.get(_get(key))
    states.append(None if not state else {k: _copy(v) for k, v in state.items()})
  return states


def _load_optimizer_state(opt_id, cls, defaults, entries):
  """Restores each key's optimizer state: [(key, hyperparameters, state or None)]."""
  for key, hyper, state in entries:
    opt = _optimizer(opt_id, key, cls, defaults, hyper)
    opt.state.pop(_get(key), None)
    if state:
      opt.state[_get(key)] = {k: _copy(v) for k, v in state.items()}
  return None


def _copy(v):
  return v.clone() if isinstance(v, torch.Tensor) else v


create = _guard(_create, "create")
read = _guard(_read, "read")
assign = _guard(_assign, "assign")
add = _guard(_add, "add")
apply = _guard(_apply, "apply")
optimizer_state = _guard(_optimizer_state, "optimizer_state")
load_optimizer_state = _guard(_load_optimizer_state, "load_optimizer_state")
