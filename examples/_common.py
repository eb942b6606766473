"""What the examples share: a progress bar that degrades gracefully, and the
time-to-first-step report.

Not part of xladist: the examples import it as a sibling module (they are run
as scripts, so their own directory is on `sys.path`).
"""

import os
import sys
import time


class _PlainProgress:
  """A stand-in for tqdm when it is not installed: one line every `every` steps."""

  def __init__(self, total, desc, initial=0, every=50):
    self.total, self.desc, self.n, self.every = total, desc, initial, every
    self.postfix = ""

  def update(self, n=1):
    self.n += n
    if self.n % self.every == 0 or self.n == self.total:
      print(f"{self.desc}: {self.n}/{self.total} {self.postfix}", file=sys.stderr, flush=True)

  def set_postfix(self, **values):
    self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

  def write(self, line):
    print(line, flush=True)

  def close(self):
    pass


def progress(total, desc, initial=0):
  """A tqdm progress bar over `total` steps (from `initial`), or a plain
  stand-in when tqdm is not installed (`pip install 'xladist[examples]'`)."""
  try:
    from tqdm import tqdm
  except ImportError:
    return _PlainProgress(total, desc, initial)
  return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


def _cache_description():
  """Where the persistent compilation cache is, or that it is off."""
  # xladist's runtime chose the location (XLADIST_COMPILE_CACHE; torch_xla's own
  # XLA_PERSISTENT_CACHE_PATH wins when set).
  from xladist import runtime as _runtime

  path = os.environ.get("XLA_PERSISTENT_CACHE_PATH") or _runtime.backend.compile_cache_path()
  if path is None:
    return None
  home = os.path.expanduser("~")
  if path == home or path.startswith(home + os.sep):
    path = "~" + path[len(home) :]
  return path


def _compile_seconds():
  """Seconds spent compiling XLA programs so far (torch_xla's metrics; None on jax)."""
  from xladist import runtime as _runtime

  if _runtime.BACKEND != "torch_xla":
    return None
  import torch_xla.debug.metrics as met

  data = met.metric_data("CompileTime")
  return 0.0 if data is None else data[1] / 1e9


def _unreadable_cache_entries():
  """Programs found in the persistent cache that the runtime could not load."""
  from xladist import runtime as _runtime

  if _runtime.BACKEND != "torch_xla":
    return 0
  import torch_xla.debug.metrics as met

  return met.counter_value("PersistentCacheDeserializeFailure") or 0


class StartupClock:
  """Time from the script's first line to the end of its first training step.

  `t0` is taken by the script before its heavy imports (`time.perf_counter()`);
  `imported()` after them, `runtime_started()` once the strategy exists (the
  strategy starts torch_xla's runtime), `first_step_done()` after the first step
  was waited for on the device. `report()` is one line, e.g.

    time to first step: 12.3 s (imports 4.1 s, runtime start 2.9 s, data, model
    and first step 5.3 s; compile cache ~/.cache/xladist/xla-cache: 1 programs
    compiled in 3.8 s, 0 read from cache)
  """

  def __init__(self, t0):
    self.t0 = t0
    self.marks = {}

  def imported(self):
    self.marks["imports"] = time.perf_counter()

  def runtime_started(self):
    self.marks["runtime"] = time.perf_counter()

  def first_step_done(self):
    """Records the end of the first step (wait for the device first)."""
    from xladist import runtime as _runtime

    self.marks["first_step"] = time.perf_counter()
    self.compiled = _runtime.compile_count()
    self.compile_seconds = _compile_seconds()
    self.cache_hits = _runtime.cache_hits()
    self.cache_failures = _unreadable_cache_entries()

  @property
  def seconds(self):
    """Seconds from `t0` to the end of the first step."""
    return self.marks["first_step"] - self.t0

  def report(self):
    m = self.marks
    parts = (
      f"imports {m['imports'] - self.t0:.1f} s, "
      f"runtime start {m['runtime'] - m['imports']:.1f} s, "
      f"data, model and first step {m['first_step'] - m['runtime']:.1f} s"
    )
    cache = _cache_description()
    compiled = f"{self.compiled} programs compiled"
    if self.compile_seconds is not None:
      compiled += f" in {self.compile_seconds:.1f} s"
    if cache is None:
      state = f"compile cache off: {compiled}"
    else:
      state = f"compile cache {cache}: {compiled}, {self.cache_hits} read from cache"
      if self.cache_failures:
        # torch_xla 2.9's XLA:CPU client writes programs to the cache but
        # cannot load them back ("Deserializing serialized executable not
        # supported"); TPU's can.
        state += f", {self.cache_failures} found but not loadable on this device"
    return f"time to first step: {self.seconds:.1f} s ({parts}; {state})"
