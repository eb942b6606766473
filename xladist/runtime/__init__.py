"""The runtime layer: what xladist asks of the machine that runs its programs.

Everything above this package (steps, strategies, input, checkpoints) reaches
devices, collectives and host transfers through the names bound here, never
through a runtime library directly (import-linter: only the torch_xla runtime's
modules, `xladist.runtime.xla*`, import torch_xla). The names are exactly the
operations of the runtime contract (runtime/contract.py: `Runtime`,
`ProgramReplay`, `ShardedCheckpoints`, `Diagnostics`), each with a meaning that
does not depend on how a runtime records or runs a step;
`tests/runtime_contract/` checks every runtime against it. Two runtimes exist,
chosen by `XLADIST_BACKEND` when xladist is imported:

* `xla` (runtime/xla.py and its modules xla_*.py, listed in its docstring):
  torch_xla 2.9 in SPMD mode, one process per host, XLA:CPU or TPU.
  `XLADIST_BACKEND=torch_xla` (the default where torch_xla is installed)
  selects it;
* `jax_runtime` (runtime/jax_runtime.py and its modules, with
  runtime/torchax_fixes.py): JAX through torchax, XLA:CPU or NVIDIA GPUs,
  several processes through `jax.distributed`. `XLADIST_BACKEND=jax` (the
  default where torch_xla is not installed) selects it.

Any other value is refused when a strategy starts the runtime. Besides the
contract, `call_with_timeout`, `user_frame` and `shares_storage` (runtime/host.py) are the same
on every runtime, and `backend` is the selected runtime module itself (for
tests that read one runtime's own rules). docs/architecture.md ("The runtime layer and its
contract") maps each operation to torch_xla, jax and TorchTPU.
"""

import importlib.util
import os

from xladist.runtime import contract as _contract
from xladist.runtime.host import call_with_timeout, shares_storage, user_frame  # noqa: F401

BACKENDS = ("torch_xla", "jax")


def _default_backend():
  """torch_xla where it is installed, else jax."""
  try:
    found = importlib.util.find_spec("torch_xla") is not None
  except ImportError:  # an import hook that refuses it
    found = False
  return "torch_xla" if found else "jax"


BACKEND = os.environ.get("XLADIST_BACKEND", "") or _default_backend()

if BACKEND == "jax":
  from xladist.runtime import jax_runtime as _backend
else:
  from xladist.runtime import xla as _backend
backend = _backend

INTERFACE = tuple(name for p in _contract.PROTOCOLS for name in _contract.operations(p))


def _check_backend():
  if BACKEND not in BACKENDS:
    raise RuntimeError(
      f"xladist: XLADIST_BACKEND={BACKEND!r} names no runtime of this release; the "
      f"runtimes are {', '.join(BACKENDS)}. Unset the variable (torch_xla where it is "
      "installed, else jax) or set it to one of them."
    )


def initialize():
  """Starts the selected runtime once per process (runtime/xla_start.py, runtime/jax_devices.py)."""
  _check_backend()
  return _backend.initialize()


globals().update({name: getattr(_backend, name) for name in INTERFACE if name != "initialize"})
