"""Which device torch_xla runs on: TPU chips found in sysfs and libtpu, else
XLA:CPU; an explicit PJRT_DEVICE wins.

torch_xla 2.9's own rule for its default device, written here because it must
be known before torch_xla is imported (its import picks, and logs, a default
device of its own when PJRT_DEVICE is unset). This module imports neither torch,
torch_xla, libtpu nor the rest of xladist: tests load its file alone in a fresh
process (tests/test_runtime_detection.py).
"""

import glob
import importlib.util
import os
import warnings

# TPU chips are PCI devices of Google's vendor id with one of these device ids:
# the table of torch_xla 2.9 (`_TPU_PCI_DEVICE_IDS` in torch_xla/_internal/tpu.py,
# which torch_xla also uses to pick its own default device and libtpu's flags).
# Google's vendor id alone is not a TPU: gVNIC, the virtual NIC of ordinary
# Compute Engine CPU and GPU VMs, is vendor 0x1ae0, device 0x0042.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICE_IDS = {
  "0x0027": "TPU v2 / v3",
  "0x005e": "TPU v4",
  "0x0063": "TPU v5e",
  "0x006f": "TPU v6e",
  "0x0076": "TPU7x",
  # torch_xla lists these two as "testing only" (JAX's table names 0x0062 v5p).
  "0x0056": "TPU (no public name)",
  "0x0062": "TPU v5p",
}


def _read_id(path):
  try:
    with open(path) as f:
      return f.read().strip().lower()
  except OSError:
    return None


def tpu_chips(sysfs_root="/sys"):
  """The PCI addresses of the TPU chips attached to this host (read from sysfs).

  `sysfs_root` is where sysfs is mounted (tests pass a fake tree).
  """
  chips = []
  for vendor in sorted(glob.glob(os.path.join(sysfs_root, "bus", "pci", "devices", "*", "vendor"))):
    if _read_id(vendor) != GOOGLE_PCI_VENDOR:
      continue
    if _read_id(os.path.join(os.path.dirname(vendor), "device")) in TPU_PCI_DEVICE_IDS:
      chips.append(os.path.basename(os.path.dirname(vendor)))
  return chips


def libtpu_found(environ=None, find_spec=importlib.util.find_spec):
  """Whether torch_xla 2.9 would find libtpu, TPU's PJRT runtime.

  As torch_xla decides it at import (`_setup_tpu_vm_library_path`): the
  variable `TPU_LIBRARY_PATH` is set, or torch_xla ships `lib/libtpu.so`, or the
  `libtpu` package is installed. Looked up without importing either package.
  """
  environ = os.environ if environ is None else environ
  if "TPU_LIBRARY_PATH" in environ:
    return True
  try:
    torch_xla_spec = find_spec("torch_xla")
    if torch_xla_spec is not None:
      for folder in torch_xla_spec.submodule_search_locations or ():
        if os.path.isfile(os.path.join(folder, "lib", "libtpu.so")):
          return True
    return find_spec("libtpu") is not None
  except (ImportError, ValueError):
    return False


def detect_device_type(environ=None, sysfs_root="/sys", libtpu=None):
  """TPU when TPU chips and libtpu are there, else XLA:CPU; an explicit PJRT_DEVICE wins.

  `environ`, `sysfs_root` and `libtpu` (default: `libtpu_found(environ)`) are
  for tests.
  """
  environ = os.environ if environ is None else environ
  if environ.get("PJRT_DEVICE"):
    return environ["PJRT_DEVICE"].upper()
  chips = tpu_chips(sysfs_root)
  if not chips:
    return "CPU"
  if libtpu_found(environ) if libtpu is None else libtpu:
    return "TPU"
  warnings.warn(
    f"xladist: {len(chips)} TPU chip(s) are attached, but libtpu (the TPU runtime) "
    "is not installed, so xladist runs on XLA:CPU. Install it with "
    "`pip install 'xladist[tpu]'` (torch_xla[tpu]), or point TPU_LIBRARY_PATH "
    "at libtpu.so; set PJRT_DEVICE=CPU to choose XLA:CPU and silence this.",
    RuntimeWarning,
  )
  return "CPU"
