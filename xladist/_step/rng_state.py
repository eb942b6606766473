"""The device module's RNG state (`torch.xla.get_rng_state`, `torch.jax.set_rng_state`),
which torch.utils.checkpoint saves and restores around a recomputed block: inside a
step a position in the step's draws (seeds.py's `_DrawLog`), elsewhere the
runtime's running seed."""

import collections
import contextlib
import types

import torch

from xladist import runtime as _runtime
from xladist._step.seeds import _active_log

# The RNG-state bytes of the device module below: a tag, then 8 bytes: a seed
# (torch_xla's running seed), a position in a step's draws, or the number of a
# runtime key kept in `_KEYS` (the jax runtime's seed is a key, not an int).
_SEED, _POSITION, _KEY = 0, 1, 2
_KEYS = collections.OrderedDict()  # number -> key, the newest _MAX_KEYS
_MAX_KEYS = 256


def _pack(tag, value):
  return torch.tensor([tag, *value.to_bytes(8, "little")], dtype=torch.uint8)


def _unpack(state):
  raw = bytes(torch.as_tensor(state, dtype=torch.uint8).tolist())
  if len(raw) != 9 or raw[0] not in (_SEED, _POSITION, _KEY):
    raise ValueError(
      f"torch.{_runtime.DEVICE_KIND}.set_rng_state: expected a state returned by "
      f"torch.{_runtime.DEVICE_KIND}.get_rng_state() (9 bytes), got {len(raw)} bytes."
    )
  return raw[0], int.from_bytes(raw[1:], "little")


def get_rng_state(device=None):
  """The XLA device's RNG state (a uint8 tensor): inside a step, a position in
  its draws (`_DrawLog`); elsewhere torch_xla's running seed."""
  log = _active_log()
  if log is not None:
    return _pack(_POSITION, log.position)
  seed = _runtime.seed(running=True)
  if isinstance(seed, int):
    return _pack(_SEED, seed)
  number = next(reversed(_KEYS), -1) + 1
  _KEYS[number] = seed
  while len(_KEYS) > _MAX_KEYS:
    _KEYS.popitem(last=False)
  return _pack(_KEY, number)


def set_rng_state(new_state, device=None):
  tag, value = _unpack(new_state)
  log = _active_log()
  if tag == _POSITION:
    if log is None or value > len(log.draws):
      raise RuntimeError(
        f"torch.{_runtime.DEVICE_KIND}.set_rng_state: this state was taken inside "
        "a step of strategy.run and holds only there (in the same step)."
      )
    log.seek(value)
  elif log is not None:
    raise RuntimeError(
      f"torch.{_runtime.DEVICE_KIND}.set_rng_state inside strategy.run: a state "
      "taken outside the step cannot be set inside it (the step's random numbers "
      "follow torch.manual_seed, set before strategy.run)."
    )
  elif tag == _KEY:
    if value not in _KEYS:
      raise RuntimeError(
        f"torch.{_runtime.DEVICE_KIND}.set_rng_state: this state is older than the "
        f"last {_MAX_KEYS} states taken; take it again with get_rng_state()."
      )
    _runtime.set_seed(_KEYS[value], running=True)
  else:
    _runtime.set_seed(value, running=True)


def register_device_module():
  """Gives torch's device module for the runtime's device type (`torch.xla`,
  `torch.jax`) the RNG-state functions above.

  torch.utils.checkpoint saves and restores a device's RNG state through
  `getattr(torch, device_type)`: torch_xla 2.9 registers no such module
  ("module 'torch' has no attribute 'xla'"), so xladist registers one; torchax
  registers one whose RNG functions do nothing (a recomputed block would draw
  new dropout masks), so xladist's replace them.
  """
  kind = _runtime.DEVICE_KIND
  module = getattr(torch, kind, None)
  if module is None:
    module = types.ModuleType(f"torch.{kind}", "xladist: the RNG state of the device.")
    torch._register_device_module(kind, module)
  for name, value in (
    ("device", lambda device: contextlib.nullcontext()),
    ("device_count", _runtime.num_devices),
    ("is_available", lambda: True),
  ):
    if not hasattr(module, name):
      setattr(module, name, value)
  module.get_rng_state = get_rng_state
  module.set_rng_state = set_rng_state
  module._initialized = True  # torch.utils.checkpoint saves the state only then
