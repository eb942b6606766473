"""Starting torch_xla: once per process, in SPMD mode, on the device
runtime/xla_device_detection.py chooses; the runtime's state once started.

Facts this module relies on (torch 2.9.0 + torch_xla 2.9.0, checked by spikes
recorded in docs/architecture.md): `xr.use_spmd()` is process-wide and must come
before any tensor touches an XLA device; once torch_xla has placed a tensor in
its non-SPMD mode the "SPMD config" is locked.
"""

import os
import threading

from xladist.runtime.xla_compile_cache import start_compile_cache
from xladist.runtime.xla_device_detection import detect_device_type
from xladist.runtime.xla_gru import restore_torch_gru

DEFAULT_CPU_DEVICES = 4

_lock = threading.Lock()
_state = None  # the _Runtime once initialised


class _Runtime:
  """What xladist learnt about the process when it initialised torch_xla."""

  def __init__(self, device_type, num_devices):
    import torch_xla

    self.device_type = device_type
    self.num_devices = num_devices
    self.device = torch_xla.device()  # the one SPMD virtual device, "xla:0"
    self.device_name = str(self.device)  # as torch_xla's bindings name it (read per replay)


def initialize():
  """Initialises torch_xla in SPMD mode once per process and returns the runtime.

  Idempotent. Chooses TPU when TPU chips are attached and libtpu is installed,
  else XLA:CPU with `CPU_NUM_DEVICES` virtual devices (default 4); `PJRT_DEVICE`
  set by the user is respected (see `detect_device_type`).

  Raises:
    RuntimeError: torch_xla was already used in its non-SPMD mode in this process.
  """
  global _state
  if _state is not None:
    return _state
  with _lock:
    if _state is not None:
      return _state
    device_type = detect_device_type()
    os.environ["PJRT_DEVICE"] = device_type
    if device_type == "CPU":
      os.environ.setdefault("CPU_NUM_DEVICES", str(DEFAULT_CPU_DEVICES))
    try:
      import torch_xla
      import torch_xla.runtime as xr
    except ImportError as e:
      raise RuntimeError(
        "xladist: the torch_xla runtime (XLADIST_BACKEND=torch_xla, the default) "
        f"needs torch_xla, which cannot be imported here ({e}). Install the "
        "versions xladist pins (torch==2.9.0 torch_xla==2.9.0; `make venv` builds "
        "such an environment; on a TPU VM pip install 'xladist[tpu]')."
      ) from e

    if not xr.is_spmd() and torch_xla._XLAC._xla_get_spmd_config_is_locked():
      raise RuntimeError(
        "xladist runs every strategy as one SPMD program, but torch_xla was "
        "already used in its non-SPMD mode in this process (a tensor was placed "
        "on an XLA device, or xmp.spawn started per-device threads, before the "
        "first xladist strategy was created). Create the xladist strategy before "
        "touching any XLA device, or call torch_xla.runtime.use_spmd() at the "
        "start of the program."
      )
    xr.use_spmd()
    from xladist.runtime import xla_lowerings

    xla_lowerings.register()
    restore_torch_gru()
    start_compile_cache(torch_xla, xr, device_type)
    _state = _Runtime(device_type, xr.global_runtime_device_count())
    return _state


def is_initialized():
  """True once a strategy started the runtime in this process."""
  return _state is not None


def num_devices():
  return initialize().num_devices


def device():
  """The torch device all SPMD tensors live on (torch_xla's virtual device)."""
  return initialize().device
