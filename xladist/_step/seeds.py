"""Random numbers of steps: the one seed rule, and each replica its own draw.

The seed rule (one place for it, whether a step is traced or replayed):

* torch_xla's seed follows `torch.manual_seed` (`follow_torch_seed`, before
  each step; a checkpoint restore sets both and only moves what was seen);
* a step's random ops start from torch_xla's running seed, which becomes the
  base seed at the step's start when random ops ran since the last sync, and
  a replayed step's draws are accounted for without tracing (`_Seeds`,
  `STEP_SEEDS`; replay.py asks it at each step);
* inside a step each replica draws its own rows of the global batch's draw
  (below).

Per-replica draws:

All replicas are traced into one program whose random-number seed is one
replicated value, so a plain `F.dropout` inside `strategy.run` draws the same
mask on every replica (checked on torch_xla 2.9). xladist therefore turns each
random draw of a replica-local shape S inside a step into ONE draw of the
global shape (N * S[0], *S[1:]) -- N replicas' worth, as if the step ran on
the global batch -- and each replica takes its own rows, [r * S[0], (r + 1) *
S[0]). So:

* replicas draw different numbers (independent streams, as TF's
  tf.random.Generator gives each replica under a strategy);
* a draw over the per-replica batch is the draw over the global batch: dropout
  in a step with N replicas of b rows masks exactly as dropout on the
  N * b rows of the global batch on one device, whatever N is;
* the draws follow torch_xla's seed, which follows `torch.manual_seed`
  (`follow_torch_seed`).

The cost is N times the random-number work of the step (the draws are made for
all replicas on every device), which is small next to the matrix work of a
step. Inside `merge_fn` (cross-replica context) draws are left alone: there
every replica computes the same value. Not covered (they stay the same on
every replica): `torch.randperm`, `torch.multinomial`, `F.rrelu`, draws with an
explicit `generator=`.
"""

import contextlib
import weakref

import torch
import torch.nn.functional as F

from xladist import collectives
from xladist import runtime as _runtime

# torch_xla 2.9's seed arithmetic (uint64): each random op of a traced graph
# takes the next "running" seed (XLAGraphExecutor's GetRngSeed).
_MASK = (1 << 64) - 1
_RUN_MUL, _RUN_ADD = 214013, 2531011
_MAX_DRAWS = 1 << 16  # random ops of one step that a capture accepts


_torch_seed_seen = [None]


def follow_torch_seed(reseed=True):
  """Makes torch_xla's random-number seed follow `torch.manual_seed`.

  torch_xla keeps a seed of its own (torch.manual_seed does not set it, checked
  on torch_xla 2.9), so dropout in a step would not follow the user's seed.
  Called before each traced step: when torch's seed (`torch.initial_seed()`)
  differs from the one last seen, the runtime's seed is set to it. With
  `reseed=False` (after a checkpoint restored both) only the seen value moves.
  """
  seed = torch.initial_seed()
  if seed != _torch_seed_seen[0]:
    _torch_seed_seen[0] = seed
    if reseed:
      _runtime.set_seed(seed % (2**63), running=True)


def run_n(seed, n):
  for _ in range(n):
    seed = (_RUN_ADD + _RUN_MUL * seed) & _MASK
  return seed


def draws_between(start, end):
  """How many random ops take `start` to `end` (None: not within _MAX_DRAWS)."""
  seed = start
  for n in range(_MAX_DRAWS + 1):
    if seed == end:
      return n
    seed = (_RUN_ADD + _RUN_MUL * seed) & _MASK
  return None


class _Seeds:
  """torch_xla's random-number seed around xladist's steps (one per process).

  torch_xla keeps a base seed, moved on by every `torch_xla.sync()` (MarkStep),
  and a running seed, moved on by every random op traced since; a traced graph
  takes the base seed as a parameter and derives each op's seed from it. So a
  step traced after random ops of earlier steps (no sync between) carries their
  seed arithmetic in its graph, and would make a new program at every step.

  xladist's rule, the same whether a step is traced or replayed (so that the
  two agree bit for bit): a step's random ops start from the running seed, and
  when random ops ran since the last sync (the running seed moved away from the
  base), that running seed becomes the base seed at the step's start
  (`start_step`). A replay does not advance torch_xla's running seed: what it
  consumed is kept here (`virtual`) for the next step, or dropped by the next
  sync, which moves the base on as it would after the traced step.

  Not covered (documented): random draws on the XLA device outside
  `strategy.run` after a replayed step and before the next sync start from the
  seed the replayed step started from.
  """

  def __init__(self):
    self.marks = None  # MarkStep count when last looked
    self.base = None  # the base seed, as far as xladist knows
    self.left = None  # the running seed xladist last left torch_xla with
    self.virtual = None  # the running seed after a replay with random ops, or None
    self.chain = None  # inside `chained()`: the seeds its steps started from

  @contextlib.contextmanager
  def chained(self):
    """Steps traced as one program (experimental_run_steps' groups): each step's
    random ops go on from the running seed as traced, without making it a new
    base (the same numbers; one seed input for the whole program). Yields the
    list of the seeds the steps start from; `settle_chain` then leaves the base
    where steps traced one after the other would have. A runtime that threads a
    random key through each program (jax: the running seed is a key, not a
    counted int) needs none of it: the list stays empty."""
    if not isinstance(_runtime.seed(running=True), int):
      yield []
      return
    self.chain = starts = []
    try:
      yield starts
    finally:
      self.chain = None

  def settle_chain(self, starts, end):
    """After k steps traced (or replayed) as one chained program, from `starts`
    (each step's first seed) to `end`: the base seed is the one k separate
    steps would have left (each made its start seed the base when random ops
    had moved the running seed), which the next sync moves on from; the next
    step starts from `end`."""
    if not starts:
      return
    base = self.base
    for seed in starts:
      if seed != base:
        base = seed
    if base != self.base:
      _runtime.set_seed(base, running=True)
      self.base = self.left = base
      self.virtual = None if end == base else end

  def start_step(self):
    """The seed the step's random ops start from (see the class docstring)."""
    if self.chain is not None:
      seed = _runtime.seed(running=True)
      self.chain.append(seed)
      return seed
    marks = _runtime.boundary_count()
    running = _runtime.seed(running=True)
    if marks != self.marks or running != self.left:
      # A sync moved the base on, or the seed was set (torch.manual_seed, a
      # checkpoint restore), or random ops ran outside a step: start afresh.
      self.marks, self.base, self.left, self.virtual = marks, running, running, None
    seed = running if self.virtual is None else self.virtual
    self.virtual = None
    if seed != self.base:
      _runtime.set_seed(seed, running=True)
      self.base = self.left = seed
    return seed

  def sync_between_steps(self):
    """Cuts the graph between two steps (`strategy.run` ending the step before
    it) and leaves the random numbers as they were: torch_xla's sync moves its
    seed on, which would make the next step's draws depend on whether this cut
    happened (and so differ between replayed and traced runs)."""
    running = _runtime.seed(running=True)
    counted = self.marks == _runtime.boundary_count()
    _runtime.sync()
    _runtime.set_seed(running, running=True)
    if counted:
      self.marks = _runtime.boundary_count()

  def after_trace(self):
    self.left = _runtime.seed(running=True)
    return self.left

  def after_replay(self, seed, draws):
    if draws:
      self.virtual = run_n(seed, draws)


STEP_SEEDS = _Seeds()  # the process's one seed rule for steps (traced or replayed)


def _global_shape(shape, n):
  shape = tuple(shape)
  return (n * shape[0],) + shape[1:] if shape else (n,)


def _own(draw_global, shape, region):
  """Replica r's rows of the global draw `draw_global()` makes, shaped `shape`.

  While a recomputation repeats the step's draws (`_DrawLog`), the numbers
  drawn at that point before are returned and nothing is drawn.
  """
  log = _DRAW_LOGS.get(region)
  if log is not None:
    repeated = log.repeat(shape)
    if repeated is not None:
      return repeated
  n = region.num_replicas
  stacked = draw_global().reshape((n,) + tuple(shape))
  own = collectives.select_own(stacked, region.replica_id)
  if log is not None:
    log.record(shape, own)
  return own


def _rand(func, args, kwargs, region):
  """torch.rand / torch.randn: the size as ints, one sequence, or size=."""
  kwargs = dict(kwargs)
  if "size" in kwargs:
    shape = tuple(kwargs.pop("size"))
  elif len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
    shape = tuple(args[0])
  else:
    shape = tuple(args)
  return _own(lambda: func(_global_shape(shape, region.num_replicas), **kwargs), shape, region)


def _randint(func, args, kwargs, region):
  """torch.randint(high, size) / randint(low, high, size)."""
  kwargs = dict(kwargs)
  if "size" in kwargs:
    shape, bounds = tuple(kwargs.pop("size")), args
  else:
    shape, bounds = tuple(args[-1]), args[:-1]
  return _own(
    lambda: func(*bounds, _global_shape(shape, region.num_replicas), **kwargs), shape, region
  )


def _like(factory, extra_args):
  """torch.rand_like / randn_like / randint_like."""

  def draw(func, args, kwargs, region):
    t = args[0]
    kwargs = dict(kwargs)
    kwargs.setdefault("dtype", t.dtype)
    kwargs.setdefault("device", t.device)
    kwargs.pop("memory_format", None)
    shape = _global_shape(t.shape, region.num_replicas)
    return _own(lambda: factory(*args[1 : 1 + extra_args], shape, **kwargs), t.shape, region)

  return draw


def _in_place(method):
  """t.uniform_(...), t.normal_(...), t.random_(...), t.bernoulli_(p), ..."""

  def draw(func, args, kwargs, region):
    t = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p")
    if method == "bernoulli_" and isinstance(p, torch.Tensor):
      shape = _global_shape(t.shape, region.num_replicas)
      u = _own(
        lambda: torch.empty(shape, dtype=torch.float32, device=t.device).uniform_(),
        t.shape,
        region,
      )
      value = (u < p).to(t.dtype)
    else:

      def draw_global():
        g = torch.empty(_global_shape(t.shape, region.num_replicas), dtype=t.dtype, device=t.device)
        return getattr(g, method)(*args[1:], **kwargs)

      value = _own(draw_global, t.shape, region)
    with torch.no_grad():
      return t.copy_(value)

  return draw


def _bernoulli(func, args, kwargs, region):
  probs = args[0]
  p = args[1] if len(args) > 1 else kwargs.get("p")
  shape = _global_shape(probs.shape, region.num_replicas)
  if p is not None:
    return _own(
      lambda: torch.empty(shape, dtype=probs.dtype, device=probs.device).bernoulli_(p),
      probs.shape,
      region,
    )
  u = _own(
    lambda: torch.empty(shape, dtype=torch.float32, device=probs.device).uniform_(),
    probs.shape,
    region,
  )
  return (u < probs).to(probs.dtype)


def _normal(func, args, kwargs, region):
  kwargs = dict(kwargs)
  mean = args[0] if args else kwargs.pop("mean", 0.0)
  std = args[1] if len(args) > 1 else kwargs.pop("std", 1.0)
  if isinstance(mean, torch.Tensor) or isinstance(std, torch.Tensor):
    ref = mean if isinstance(mean, torch.Tensor) else std
    shape = torch.broadcast_shapes(*[x.shape for x in (mean, std) if isinstance(x, torch.Tensor)])
    global_shape = _global_shape(shape, region.num_replicas)
    z = _own(lambda: torch.randn(global_shape, dtype=ref.dtype, device=ref.device), shape, region)
    return mean + std * z
  shape = tuple(args[2]) if len(args) > 2 else tuple(kwargs.pop("size"))
  global_shape = _global_shape(shape, region.num_replicas)
  return _own(lambda: torch.normal(mean, std, global_shape, **kwargs), shape, region)


def _dropout(func, args, kwargs, region):
  """F.dropout and the channel-wise variants: the global draw's mask, this
  replica's rows (bitwise the global batch's dropout on one device)."""
  names = ("input", "p", "training", "inplace")
  bound = dict(zip(names, args))
  bound.update(kwargs)
  x = bound["input"]
  p = bound.get("p", 0.5)
  training = bound.get("training", True)
  inplace = bound.get("inplace", False)
  if not training or p == 0:
    return func(*args, **kwargs)
  if func is F.dropout:
    mask_shape = tuple(x.shape)
  else:  # one value per (example, channel): the spatial dims are 1
    keep = 2 if x.dim() > {F.dropout1d: 2, F.dropout2d: 3, F.dropout3d: 4}[func] else 1
    mask_shape = tuple(x.shape[:keep]) + (1,) * (x.dim() - keep)
  global_shape = _global_shape(mask_shape, region.num_replicas)
  mask = _own(
    lambda: func(torch.ones(global_shape, dtype=x.dtype, device=x.device), p, True),
    mask_shape,
    region,
  )
  return x.mul_(mask) if inplace else x * mask


def _alpha_dropout(func, args, kwargs, region):
  """F.alpha_dropout / feature_alpha_dropout (SELU's dropout) with the global
  draw's keep mask; the affine correction is torch's formula."""
  names = ("input", "p", "training", "inplace")
  bound = dict(zip(names, args))
  bound.update(kwargs)
  x, p = bound["input"], bound.get("p", 0.5)
  if not bound.get("training", False) or p == 0:
    return func(*args, **kwargs)
  if p == 1:
    return x.mul(0)
  if func is F.alpha_dropout:
    mask_shape = tuple(x.shape)
  else:
    mask_shape = tuple(x.shape[:2]) + (1,) * (x.dim() - 2)
  global_shape = _global_shape(mask_shape, region.num_replicas)
  keep = _own(
    lambda: torch.empty(global_shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p),
    mask_shape,
    region,
  )
  alpha = 1.7580993408473766
  a = ((1 - p) * (1 + p * alpha**2)) ** -0.5
  b = (keep - 1) * (alpha * a) + alpha * a * p
  out = x * (keep * a) + b
  return x.copy_(out) if bound.get("inplace", False) else out


DRAWS = {
  torch.rand: _rand,
  torch.randn: _rand,
  torch.randint: _randint,
  torch.rand_like: _like(torch.rand, 0),
  torch.randn_like: _like(torch.randn, 0),
  torch.bernoulli: _bernoulli,
  torch.Tensor.bernoulli: _bernoulli,
  torch.normal: _normal,
  F.dropout: _dropout,
  F.dropout1d: _dropout,
  F.dropout2d: _dropout,
  F.dropout3d: _dropout,
  F.alpha_dropout: _alpha_dropout,
  F.feature_alpha_dropout: _alpha_dropout,
}
for _method in (
  "uniform_",
  "normal_",
  "random_",
  "exponential_",
  "cauchy_",
  "log_normal_",
  "geometric_",
  "bernoulli_",
):
  DRAWS[getattr(torch.Tensor, _method)] = _in_place(_method)


def _randint_like(func, args, kwargs, region):
  t = args[0]
  kwargs = dict(kwargs)
  kwargs.setdefault("dtype", t.dtype)
  kwargs.setdefault("device", t.device)
  kwargs.pop("memory_format", None)
  bounds = args[1:]
  shape = _global_shape(t.shape, region.num_replicas)
  return _own(lambda: torch.randint(*bounds, shape, **kwargs), t.shape, region)


DRAWS[torch.randint_like] = _randint_like


def _on_xla(args, kwargs):
  """Whether a draw makes an XLA tensor (host draws are left alone: they are
  made once, on the host, while the step is traced)."""
  for a in args:
    if isinstance(a, torch.Tensor):
      return _runtime.is_device_tensor(a)
  device = kwargs.get("device")
  if device is None:
    return False
  return torch.device(device).type == _runtime.DEVICE_KIND


def draw(func, args, kwargs, region):
  """The replica's share of a global draw, or None when `func` draws nothing on
  the XLA device (or takes an explicit generator, which the user controls).

  While a recomputation repeats the step's earlier draws (`_DrawLog`), their
  random numbers are used again (`_own`).
  """
  handler = DRAWS.get(func)
  if handler is None or kwargs.get("generator") is not None or not _on_xla(args, kwargs):
    return None
  return handler(func, args, kwargs or {}, region)


class _DrawLog:
  """The random draws of one traced step, in order, for recomputations.

  `torch.utils.checkpoint` saves the device's RNG state before a block's
  forward and sets it back before recomputing the block in backward, so that
  dropout masks the same elements twice. A step's draws come from one seed
  chain that a set seed cannot rewind without a second seed input to the
  program (which a replayed program would not refresh). So inside a step the
  RNG state of the device is a position in this log: setting it back makes the
  next draws return the values drawn from that position on, the same tensors
  of the same program; reaching the end of the log draws anew.
  """

  def __init__(self, mode):
    self.draws = []  # (replica-local shape, the replica's random numbers)
    self.position = 0
    self.mode = mode  # the step's TorchFunctionMode (StepTensors), which draws
    self.pushed = False  # whether a recomputation entered `mode` (see `seek`)

  def seek(self, position):
    """Sets the position; before it: a recomputation starts, at the end: it ended.

    torch's autograd engine runs backward without the Python function modes of
    the thread that called it, so a block recomputed in backward would draw
    through torch directly (the same mask on every replica, from the seed
    chain's next numbers). The step's mode is entered for the recomputation,
    between the two `set_rng_state` calls that torch.utils.checkpoint makes
    around it, and left at the second.
    """
    self.position = position
    if position < len(self.draws):
      if not self.pushed and not _mode_active(self.mode):
        self.mode.__enter__()
        self.pushed = True
    elif self.pushed:
      self.pushed = False
      self.mode.__exit__(None, None, None)

  def repeat(self, shape):
    if self.position >= len(self.draws):
      return None
    drawn, numbers = self.draws[self.position]
    if drawn != tuple(shape):
      raise RuntimeError(
        f"torch.utils.checkpoint in strategy.run: the recomputed block drew random "
        f"numbers of shape {tuple(shape)} where its forward drew {drawn}; the block "
        "must draw the same random numbers in the same order both times (no Python "
        "branches that change its random ops between forward and backward)."
      )
    self.position += 1
    return numbers

  def record(self, shape, numbers):
    self.draws.append((tuple(shape), numbers))
    self.position = len(self.draws)


_DRAW_LOGS = weakref.WeakKeyDictionary()  # Region -> _DrawLog


def watch_draws(region, mode):
  """Starts the draw log of a step traced under `mode` (its StepTensors)."""
  _DRAW_LOGS[region] = _DrawLog(mode)


def forget_draws(region):
  """Drops a finished step's draws (they are tensors of its region)."""
  log = _DRAW_LOGS.pop(region, None)
  if log is not None and log.pushed:
    log.seek(len(log.draws))


def _mode_active(mode):
  return any(m is mode for m in torch.overrides._get_current_function_mode_stack())


def _active_log():
  from xladist import context

  ctx = context.get_replica_context()
  region = getattr(ctx, "_region", None) if ctx is not None else None
  if region is None or not region.active:
    return None
  return _DRAW_LOGS.get(region)  # the engine starts one per traced step (`watch_draws`)
