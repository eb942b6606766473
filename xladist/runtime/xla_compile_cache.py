"""torch_xla's persistent compilation cache: where it lives, and on which devices
xladist turns it on.

A program compiled once (same graph, shapes, shardings and devices) is read
from disk by later runs instead of compiled again. `XLADIST_COMPILE_CACHE`
chooses the place (`compile_cache_path`); the torch_xla runtime starts the
cache when it starts (runtime/xla_start.py, which hands over torch_xla's
modules: this one imports neither torch nor torch_xla).
"""

import os
import warnings

from xladist.runtime.xla_device_detection import detect_device_type

_CACHE_OFF = ("", "0", "off", "false", "no", "none")

# Device types whose PJRT client loads a compiled program back from the cache
# (torch_xla 2.9 runs its persistent-cache tests on these only). Its XLA:CPU
# client writes programs to the cache but cannot read them back ("UNIMPLEMENTED:
# Deserializing serialized executable not supported", counted as
# PersistentCacheDeserializeFailure): there a cache costs time and disk and
# saves nothing.
COMPILE_CACHE_DEVICE_TYPES = ("TPU", "NEURON")


def compile_cache_path(device_type=None, environ=None):
  """Where compiled programs are kept between runs, or None when there is no cache.

  `XLADIST_COMPILE_CACHE`: unset means `~/.cache/xladist/xla-cache` on devices
  that can read programs back (TPU) and no cache elsewhere (XLA:CPU); a path
  moves the cache there and turns it on whatever the device; "off" (or "0",
  "") turns it off. torch_xla's own `XLA_PERSISTENT_CACHE_PATH`, when set,
  wins (see `start_compile_cache`). `device_type` defaults to this process's.
  """
  environ = os.environ if environ is None else environ
  value = environ.get("XLADIST_COMPILE_CACHE")
  if value is None:
    if (device_type or detect_device_type(environ)) not in COMPILE_CACHE_DEVICE_TYPES:
      return None
    return os.path.join(os.path.expanduser("~"), ".cache", "xladist", "xla-cache")
  if value.strip().lower() in _CACHE_OFF:
    return None
  return os.path.expanduser(value)


def start_compile_cache(torch_xla, xr, device_type):
  """torch_xla's persistent compilation cache, on by default where it can be read.

  `torch_xla` and `xr` (torch_xla.runtime) are the modules the runtime imported.
  Each host keeps its own cache (the default path is on the host's local disk).
  """
  if os.environ.get("XLA_PERSISTENT_CACHE_PATH") or (
    torch_xla._XLAC._xla_computation_cache_is_initialized()
  ):
    return
  path = compile_cache_path(device_type)
  if path is None:
    return
  if device_type not in COMPILE_CACHE_DEVICE_TYPES:
    warnings.warn(
      f"XLADIST_COMPILE_CACHE={os.environ.get('XLADIST_COMPILE_CACHE')!r}: torch_xla "
      f"2.9 on {device_type} writes compiled programs to the cache but cannot load "
      "them back, so every run compiles again and pays for the writes. Unset "
      "XLADIST_COMPILE_CACHE (no cache on this device) or set it to 'off'.",
      RuntimeWarning,
    )
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return  # an unwritable cache location costs compile time, nothing else
  xr.initialize_cache(path)
