"""Optimizer state an optimizer made on the host before its parameters were placed.

An optimizer made under `strategy.scope()` before the model's first step has
CPU parameters to look at when its constructor makes state (Adagrad's `sum`,
made in `__init__` with `full_like(p)`); xladist places the model's variables
later (at the first `strategy.run`), so that state would stay on the host and
the step would mix devices. When an optimizer first steps inside `run`, each
such tensor (a parameter's shape, on the host) is placed where the parameter
is (replicated).

A parameter's host step counter (`state[p]['step']`, a float CPU scalar, as
torch's default Adam, AdamW and Adagrad keep it) stays where torch keeps it: a
replayed step adds to it as the step would and feeds the bias corrections
computed from it as inputs (hyper.py), so the numbers are torch's default ones
and checkpoints keep torch's format.
"""

import torch

from xladist import runtime as _runtime
from xladist._step import adafactor

# Optimizers a strategy's step cannot run, and why (raised at their first step).
_REFUSED = {
  "LBFGS": (
    "torch.optim.LBFGS calls its closure several times per step and decides on the "
    "host from the loss (`.item()` of device values) how often: a strategy's step is "
    "one traced program. Use another optimizer, or run LBFGS outside strategy.run "
    "on a model that is not the strategy's"
  ),
  "SparseAdam": (
    "torch.optim.SparseAdam needs sparse gradients (nn.Embedding(sparse=True)); "
    "xladist's collectives aggregate dense gradients only. Use Adam or AdamW with "
    "a dense embedding"
  ),
}


def prepare_optimizer(optimizer):
  """Refuses an optimizer a strategy's step cannot run, saying why."""
  torch_classes = [
    k.__name__ for k in type(optimizer).__mro__ if k.__module__.startswith("torch.optim")
  ]
  for name in torch_classes:
    if name in _REFUSED:
      raise TypeError(f"optimizer.step() in strategy.run: {_REFUSED[name]}.")
  if "ASGD" in torch_classes:
    _asgd_host_scalars(optimizer)
  if "Adafactor" in torch_classes:
    _adafactor_in_tensor_ops(optimizer)
  if "Rprop" in torch_classes:
    # Its default path writes through boolean masks (`sign[sign.gt(0)] = etaplus`),
    # whose shapes depend on the values (a host read); its capturable path is the
    # same update with `torch.where`.
    for group in optimizer.param_groups:
      if group.get("capturable") is False:
        group["capturable"] = True


def _adafactor_in_tensor_ops(optimizer):
  """torch's Adafactor reads two RMS values on the host at every update; xladist
  runs the same arithmetic in tensor operations (adafactor.py) on the device.
  Its `foreach` variant makes the same reads: the single-tensor update runs."""
  if not adafactor.supported():
    raise TypeError(
      "optimizer.step() in strategy.run: torch.optim.Adafactor reads a device value on "
      "the host at every step (`param.norm(2).item()`), and this torch has no "
      f"`{adafactor._MODULE}.{adafactor._NAME}` for xladist to run in tensor "
      "operations. Use AdamW (or Adam)"
    )
  adafactor.install()
  for group in optimizer.param_groups:
    if group.get("foreach"):
      group["foreach"] = False


def _asgd_host_scalars(optimizer):
  """torch's ASGD makes `step`, `eta` and `mu` on the parameter's device, then (its
  default, capturable=False path) reads them with `.item()` and computes their new
  values in Python: a host read in a step. xladist makes them where torch's own CPU
  run has them, on the host, before ASGD's first step (ASGD's `ax` stays on the
  device), so the step computes them as on the CPU and a replay follows them
  (hyper.py's host scalars)."""
  dtype = torch.get_default_dtype()
  for group in optimizer.param_groups:
    if group.get("capturable"):
      continue
    for p in group["params"]:
      state = optimizer.state[p]
      if len(state) == 0 and p.grad is not None:
        state["step"] = torch.zeros((), dtype=dtype)
        state["eta"] = torch.tensor(float(group["lr"]), dtype=dtype)
        state["mu"] = torch.ones((), dtype=dtype)
        state["ax"] = torch.zeros_like(p, memory_format=torch.preserve_format)
      for key in _ASGD_HOST:
        v = state.get(key)
        if isinstance(v, torch.Tensor) and _runtime.is_device_tensor(v) and v.dim() == 0:
          raise TypeError(
            f"optimizer.step() in strategy.run: this ASGD's state[...][{key!r}] is on "
            "the device (torch's load_state_dict puts `eta` and `mu` where the "
            "parameter is) and its step reads it on the host. Load the state after "
            "the optimizer's first step in strategy.run (xladist then keeps them on "
            "the host), or move them yourself: for s in opt.state.values(): "
            "s['eta'], s['mu'] = s['eta'].cpu(), s['mu'].cpu()"
          )
  if not getattr(optimizer, "_xladist_asgd_hook", False):
    optimizer.register_load_state_dict_post_hook(_asgd_state_to_host)
    optimizer._xladist_asgd_hook = True


_ASGD_HOST = ("step", "eta", "mu")


def _asgd_state_to_host(optimizer):
  """After `load_state_dict` (outside a step): ASGD's host scalars back on the host."""
  for state in optimizer.state.values():
    for key in _ASGD_HOST:
      v = state.get(key)
      if isinstance(v, torch.Tensor) and _runtime.is_device_tensor(v) and v.dim() == 0:
        state[key] = v.cpu()


def place_host_state(optimizer):
  """Places `optimizer`'s per-parameter state made on the host (see above)."""
  for p, state in optimizer.state.items():
    if not isinstance(p, torch.Tensor) or not _runtime.is_device_tensor(p):
      continue
    for key, v in state.items():
      if (
        isinstance(v, torch.Tensor)
        and not _runtime.is_device_tensor(v)
        and v.shape == p.shape
        and v.dim() > 0
      ):
        state[key] = _runtime.place_replicated(v)
