"""How much XLA's C++ log prints: from errors on, unless the user chose a level.

Imports nothing from torch or xladist: the torch_xla runtime (runtime/xla.py)
applies the rule when xladist is imported, before torch_xla's runtime starts.
"""

import os
import sys

_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
_TORCH_XLA_LOG_LEVEL = "1"  # what torch_xla's import sets when the variable is unset


def _launch_environment():
  """The variables this process was started with (Linux), or None where unknown.

  /proc/self/environ keeps the environment the process was launched with;
  assignments to os.environ since then do not show there.
  """
  try:
    with open("/proc/self/environ", "rb") as f:
      entries = f.read().split(b"\0")
  except OSError:
    return None
  return {e.partition(b"=")[0].decode(errors="replace") for e in entries if e}


def quiet_xla_logs(environ=None, modules=None, launched_with=None):
  """Shows XLA's C++ log from errors on (level 2) unless the user chose a level.

  XLA's C++ logging prints warnings at every compilation (GSPMD's deprecation
  notice, once per program compiled). The level is read when the C++
  library logs for the first time (at the first compilation or runtime start),
  so setting it here is in time even when torch_xla was imported (not yet used)
  before xladist. torch_xla's
  import sets level 1 where none was set: that value, with torch_xla imported
  before xladist and the variable not in the launch environment, is taken as
  torch_xla's default, not the user's choice. The arguments are for tests.
  """
  environ = os.environ if environ is None else environ
  modules = sys.modules if modules is None else modules
  value = environ.get(_LOG_LEVEL)
  if value is None:
    environ[_LOG_LEVEL] = "2"
  elif value == _TORCH_XLA_LOG_LEVEL and "torch_xla" in modules:
    launched_with = _launch_environment() if launched_with is None else launched_with
    if launched_with is not None and _LOG_LEVEL not in launched_with:
      environ[_LOG_LEVEL] = "2"
