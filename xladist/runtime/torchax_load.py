"""Imports torchax on every torch the jax runtime supports.

torchax 0.0.13 names aten ops in tables built at import (its autocast
policies, `torchax/amp.py`) and when its first environment is made (its
lowerings' registrations, `torchax.ops`): on torch 2.13 and
later some of them are gone (`aten.cholesky`, `aten.qr`, the `dim_Dimname`
overload of `aten.prod`, ...), and `import torchax` fails with an
AttributeError. `load()` imports torchax with such names resolved to
placeholders (`MissingOp`): a table entry for an op this torch lacks is never
looked up, since no program can call that op; calling a placeholder raises
NotImplementedError that names it. Only during that import: afterwards
`torch.ops` is torch's own again. The names resolved are kept
(`missing_ops()`).

Supported: torch 2.9.0 to 2.14.1 (`check_torch` refuses others by name when
the runtime starts).
"""

import contextlib
import sys

SUPPORTED_TORCH = ((2, 9), (2, 15))  # [lowest, first unsupported)
SUPPORTED_TORCH_TEXT = "torch>=2.9,<2.15"

_missing = []


class MissingOp:
  """An aten op (or one overload of it) that this torch does not have."""

  def __init__(self, qualified_name):
    self._name = qualified_name
    self.__name__ = qualified_name.split(".", 1)[-1]  # as torch's: "prod.dim_Dimname"

  def __getattr__(self, overload):
    if overload.startswith("__"):
      raise AttributeError(overload)
    return MissingOp(f"{self._name}.{overload}")

  def __call__(self, *args, **kwargs):
    import torch

    raise NotImplementedError(
      f"xladist: {self._name} does not exist in torch {torch.__version__} (torchax "
      "names it in its tables; no lowering runs for it)."
    )

  def name(self):
    return self._name

  def overloads(self):
    return []

  def __eq__(self, other):
    return isinstance(other, MissingOp) and other._name == self._name

  def __hash__(self):
    return hash(("MissingOp", self._name))

  def __repr__(self):
    return f"MissingOp({self._name!r})"


def _torch_version(torch):
  return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def check_torch():
  """Raises RuntimeError, naming the supported range, for a torch outside it."""
  import torch

  low, high = SUPPORTED_TORCH
  if not low <= _torch_version(torch) < high:
    raise RuntimeError(
      f"xladist: the jax runtime (torchax 0.0.13) supports {SUPPORTED_TORCH_TEXT}; this "
      f"environment has torch {torch.__version__}. Install a supported torch, or use the "
      "torch_xla runtime (XLADIST_BACKEND=torch_xla)."
    )


def _asked_by_torchax():
  """Whether the attribute lookup comes from torchax's own code (torch's
  modules, imported meanwhile, probe for ops with hasattr: they keep their
  AttributeError)."""
  caller = sys._getframe(2).f_globals.get("__name__", "")
  return caller == "torchax" or caller.startswith("torchax.")


@contextlib.contextmanager
def _missing_ops_resolve():
  """Within it, `torch.ops.aten.<name>` and `<op>.<overload>` of names this
  torch lacks give a MissingOp instead of raising AttributeError."""
  from torch import _ops

  namespace_getattr = _ops._OpNamespace.__getattr__
  packet_getattr = _ops.OpOverloadPacket.__getattr__

  def op(self, name):
    try:
      return namespace_getattr(self, name)
    except AttributeError:
      if self.name != "aten" or name.startswith("__") or not _asked_by_torchax():
        raise  # torchax catches the others itself (torch.ops.xla, torchvision)
      qualified = f"{self.name}.{name}"
      _missing.append(qualified)
      return MissingOp(qualified)

  def overload(self, name):
    try:
      return packet_getattr(self, name)
    except AttributeError:
      aten = self._qualified_op_name.startswith("aten::")
      if not aten or name.startswith("__") or not _asked_by_torchax():
        raise
      qualified = f"{self._qualified_op_name.replace('::', '.')}.{name}"
      _missing.append(qualified)
      return MissingOp(qualified)

  _ops._OpNamespace.__getattr__ = op
  _ops.OpOverloadPacket.__getattr__ = overload
  try:
    yield
  finally:
    _ops._OpNamespace.__getattr__ = namespace_getattr
    _ops.OpOverloadPacket.__getattr__ = packet_getattr


def load():
  """torchax, imported (once) with the ops this torch lacks as placeholders."""
  module = sys.modules.get("torchax")
  if module is not None:
    return module
  with _missing_ops_resolve():
    import torchax

    torchax.default_env()  # its lowerings' tables are built by the first environment
  return torchax


def missing_ops():
  """The qualified names ("aten.prod.dim_Dimname") torchax named that this torch lacks."""
  return sorted(set(_missing))
