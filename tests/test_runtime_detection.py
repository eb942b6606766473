"""Which XLA device xladist picks when PJRT_DEVICE is not set (issue 17).

The rule is torch_xla 2.9's own (`torch_xla/runtime.py`, `_maybe_select_default_device`,
with the chip table of `torch_xla/_internal/tpu.py`): TPU when a PCI device of
Google's vendor id with one of the TPU device ids is attached and libtpu is
found, else XLA:CPU. Fake sysfs trees stand in for the machines: a Compute
Engine CPU or GPU VM has Google's virtual NIC (gVNIC, vendor 0x1ae0, device
0x0042), which is not a TPU.
"""

import ast
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from xladist.runtime import xla_device_detection as detection

GOOGLE = "0x1ae0"
GVNIC = "0x0042"
# torch_xla 2.9's TPU device ids, written out here (not read from xladist) so
# that a wrong table in xladist fails these tests.
TPU_IDS = {
  "0x0027": "v2/v3",
  "0x005e": "v4",
  "0x0063": "v5e",
  "0x006f": "v6e",
  "0x0076": "7x",
  "0x0056": "no public name",
  "0x0062": "v5p",
}
NVIDIA, INTEL, VIRTIO = "0x10de", "0x8086", "0x1af4"


def fake_sysfs(root, devices):
  """A sysfs tree under `root` with one PCI device per (vendor, device) pair,
  written as the kernel writes them ("0x1ae0\\n")."""
  pci = root / "bus" / "pci" / "devices"
  pci.mkdir(parents=True)
  for i, (vendor, device) in enumerate(devices):
    d = pci / f"0000:00:{i + 4:02x}.0"
    d.mkdir()
    (d / "vendor").write_text(vendor + "\n")
    if device is not None:
      (d / "device").write_text(device + "\n")
  return str(root)


def detect(root, environ=None, libtpu=True):
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning expected unless a test says so
    return detection.detect_device_type(environ or {}, root, libtpu)


def test_gvnic_only_is_cpu(tmp_path):
  """A Compute Engine CPU/GPU VM: Google's vendor id, but the virtual NIC."""
  root = fake_sysfs(tmp_path, [(INTEL, "0x0d57"), (GOOGLE, GVNIC), (VIRTIO, "0x1041")])
  assert detect(root) == "CPU"
  assert detect(root, {"TPU_LIBRARY_PATH": "/opt/libtpu.so"}, libtpu=None) == "CPU"
  assert detection.tpu_chips(root) == []


def test_gpu_vm_with_gvnic_is_cpu(tmp_path):
  root = fake_sysfs(tmp_path, [(GOOGLE, GVNIC), (NVIDIA, "0x2330"), (NVIDIA, "0x2330")])
  assert detect(root) == "CPU"


def test_no_pci_devices_is_cpu(tmp_path):
  assert detect(str(tmp_path)) == "CPU"  # no bus/pci at all (a container, macOS)
  assert detect(fake_sysfs(tmp_path / "empty", [])) == "CPU"


@pytest.mark.parametrize("device_id", sorted(TPU_IDS), ids=lambda d: f"{d}-{TPU_IDS[d]}")
def test_each_tpu_generation_with_libtpu_is_tpu(tmp_path, device_id):
  root = fake_sysfs(tmp_path, [(GOOGLE, GVNIC)] + [(GOOGLE, device_id)] * 4)
  assert detect(root) == "TPU"
  assert len(detection.tpu_chips(root)) == 4  # the NIC is not counted
  # libtpu found through TPU_LIBRARY_PATH, as torch_xla finds it
  assert detect(root, {"TPU_LIBRARY_PATH": "/opt/libtpu.so"}, libtpu=None) == "TPU"


@pytest.mark.parametrize("device_id", sorted(TPU_IDS), ids=lambda d: f"{d}-{TPU_IDS[d]}")
def test_tpu_chips_without_libtpu_run_on_cpu_with_a_warning(tmp_path, device_id):
  """torch_xla's rule needs libtpu too: without it torch_xla itself picks CPU."""
  root = fake_sysfs(tmp_path, [(GOOGLE, device_id)])
  with pytest.warns(RuntimeWarning, match=r"1 TPU chip\(s\).*libtpu.*xladist\[tpu\]"):
    assert detection.detect_device_type({}, root, libtpu=False) == "CPU"


def test_tpu_device_id_of_another_vendor_is_not_a_tpu(tmp_path):
  root = fake_sysfs(tmp_path, [(NVIDIA, "0x0027"), (VIRTIO, "0x0063")])
  assert detect(root) == "CPU"


def test_google_device_without_device_file_is_not_a_tpu(tmp_path):
  root = fake_sysfs(tmp_path, [(GOOGLE, None)])
  assert detect(root) == "CPU"


@pytest.mark.parametrize(
  "pjrt_device, devices, expected",
  [
    ("CPU", [(GOOGLE, "0x005e")] * 4, "CPU"),  # a TPU host told to use XLA:CPU
    ("cpu", [(GOOGLE, "0x006f")], "CPU"),
    ("TPU", [(GOOGLE, GVNIC)], "TPU"),  # the user's word, even with no chip seen
    ("CUDA", [(GOOGLE, GVNIC), (NVIDIA, "0x2330")], "CUDA"),
  ],
)
def test_explicit_pjrt_device_wins(tmp_path, pjrt_device, devices, expected):
  root = fake_sysfs(tmp_path, devices)
  for libtpu in (True, False):
    assert detect(root, {"PJRT_DEVICE": pjrt_device}, libtpu) == expected


def test_table_is_torch_xlas(tmp_path):
  """xladist's chip table is the installed torch_xla's (read from its source, not
  imported): an upgrade of torch_xla that adds a chip fails here."""
  spec = importlib.util.find_spec("torch_xla")
  source = os.path.join(spec.submodule_search_locations[0], "_internal", "tpu.py")
  with open(source) as f:
    tree = ast.parse(f.read())
  tables = {
    node.targets[0].id: ast.literal_eval(node.value)
    for node in tree.body
    if isinstance(node, ast.Assign)
    and isinstance(node.targets[0], ast.Name)
    and node.targets[0].id in ("_TPU_PCI_DEVICE_IDS", "_GOOGLE_PCI_VENDOR_ID")
  }
  assert sorted(tables["_TPU_PCI_DEVICE_IDS"]) == sorted(detection.TPU_PCI_DEVICE_IDS)
  assert sorted(TPU_IDS) == sorted(detection.TPU_PCI_DEVICE_IDS)
  assert tables["_GOOGLE_PCI_VENDOR_ID"] == detection.GOOGLE_PCI_VENDOR == GOOGLE


def _spec(name, folder=None):
  spec = importlib.machinery.ModuleSpec(name, None, is_package=folder is not None)
  if folder is not None:
    spec.submodule_search_locations = [str(folder)]
  return spec


def test_libtpu_found_as_torch_xla_finds_it(tmp_path):
  """torch_xla's `_setup_tpu_vm_library_path`: TPU_LIBRARY_PATH, a libtpu.so
  bundled in torch_xla/lib, or the libtpu package."""
  plain_xla = tmp_path / "plain" / "torch_xla"
  plain_xla.mkdir(parents=True)
  bundled_xla = tmp_path / "bundled" / "torch_xla"
  (bundled_xla / "lib").mkdir(parents=True)
  (bundled_xla / "lib" / "libtpu.so").write_bytes(b"")

  def finder(**specs):
    return lambda name: specs.get(name)

  nothing = finder(torch_xla=_spec("torch_xla", plain_xla))
  assert not detection.libtpu_found({}, nothing)
  assert not detection.libtpu_found({}, finder())  # no torch_xla either
  assert detection.libtpu_found({"TPU_LIBRARY_PATH": ""}, nothing)  # set at all, as torch_xla
  assert detection.libtpu_found({}, finder(torch_xla=_spec("torch_xla", bundled_xla)))
  assert detection.libtpu_found(
    {}, finder(torch_xla=_spec("torch_xla", plain_xla), libtpu=_spec("libtpu", tmp_path))
  )


_CHILD = textwrap.dedent(
  """
  import importlib.util, json, sys
  spec = importlib.util.spec_from_file_location("xladist_detection", sys.argv[1])
  detection = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(detection)
  found = detection.detect_device_type(None, sys.argv[2])
  print(json.dumps({
    "device": found,
    "imported": sorted(m for m in ("torch", "torch_xla", "libtpu") if m in sys.modules),
  }))
  """
)


def test_detection_imports_neither_torch_xla_nor_libtpu(tmp_path):
  """Detection runs before torch_xla is imported (its import picks a device of its
  own), in a fresh process that loads only the detection module's file."""
  root = fake_sysfs(tmp_path / "sys", [(GOOGLE, GVNIC), (GOOGLE, "0x005e")])
  env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
  env["TPU_LIBRARY_PATH"] = str(tmp_path / "libtpu.so")  # libtpu "found"
  proc = subprocess.run(
    [sys.executable, "-c", _CHILD, detection.__file__, root],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  assert json.loads(proc.stdout.splitlines()[-1]) == {"device": "TPU", "imported": []}
