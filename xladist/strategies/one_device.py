"""OneDeviceStrategy, and the single-replica machinery it shares with the default strategy."""

import torch
from torch.optim import optimizer as torch_optimizer

from xladist import context
from xladist import runtime as _runtime
from xladist._nest import leaf_name, tree_map_with_path
from xladist._step import rng_state, seeds
from xladist._step.engine import single_threaded_autograd
from xladist.extended import StrategyExtended
from xladist.replica_context import ReplicaContext
from xladist.strategy import Strategy
from xladist.values import Mirrored, PerReplica
from xladist.variable_store import VariableStore


class SingleReplicaExtended(StrategyExtended):
  """One replica: `run` calls the function directly, nothing is traced specially."""

  def __init__(self, strategy, device):
    super().__init__(strategy)
    self._device = device  # None: leave tensors where they are (default strategy)
    self._device_names = (str(device) if device is not None else "cpu",)
    # The default strategy (device None) places nothing but still tracks what
    # its scope makes (variable_created_in_scope, tower_local_var_scope).
    self._store = VariableStore(self._place_variable if device is not None else lambda tensor: None)
    if device is not None and device.type == _runtime.DEVICE_KIND:
      rng_state.register_device_module()

  def _place_variable(self, tensor):
    return None if tensor.device == self._device else self._place(tensor)

  def _place(self, tensor):
    if tensor.device == self._device:
      return tensor
    if self._device.type == _runtime.DEVICE_KIND:
      # The runtime's own transfer (a `.to(device)` needs torchax's mode, which
      # is per thread, and input is placed in a prefetch thread).
      return _runtime.place_replicated(tensor.detach())
    return tensor.detach().to(self._device)

  def _enter_scope(self):
    self._store.enter_scope()

  def _exit_scope(self):
    self._store.exit_scope()

  def _current_device(self):
    return self._device if self._device is not None else torch.device("cpu")

  def _broadcast(self, tensor):
    return self._place(tensor) if self._device is not None else tensor

  def _enter_value(self, value, where):
    """One leaf of run's arguments as the replica sees it; `where()` names it."""
    if isinstance(value, PerReplica):
      if value.num_replicas != 1:
        name = type(self._strategy_ref).__name__
        raise ValueError(
          f"{name}.run: {where()} is a PerReplica with {value.num_replicas} components "
          f"(made for a strategy with {value.num_replicas} replicas), passed to "
          f"{name}, which has 1 replica. Make the value with this strategy "
          "(its experimental_distribute_values_from_function or distributed "
          "datasets), or run the step with the strategy that made it."
        )
      (value,) = value.values
    elif isinstance(value, Mirrored):
      value = value.primary
    if isinstance(value, torch.Tensor) and self._device is not None:
      return self._place(value)
    return value

  def _call_for_each_replica(self, fn, args, kwargs, options=None):
    self._store.place_pending()
    if self._device is not None and self._device.type == _runtime.DEVICE_KIND:
      seeds.follow_torch_seed()

    def enter(nest, root):
      return tree_map_with_path(
        lambda path, x: self._enter_value(x, lambda: leaf_name(nest, path, root)), nest
      )

    args, kwargs = enter(args, "args"), enter(kwargs, "kwargs")
    strategy = self._strategy_ref
    mode = context._Mode(strategy, replica_context=ReplicaContext(strategy))
    context.push(mode)
    # The optimizers a step runs are the strategy's (experimental_state_bytes).
    track = torch_optimizer.register_optimizer_step_post_hook(
      lambda optimizer, a, k: self._store.track_optimizer(optimizer)
    )
    try:
      with single_threaded_autograd():
        return fn(*args, **kwargs)
    finally:
      track.remove()
      context.pop(mode)


class OneDeviceStrategy(Strategy):
  """Runs one replica on one device.

  Args:
    device: "xla" / "xla:0" / a torch.device of type xla (the default, None) or
      "cpu" (plain PyTorch on the host). In a process with several XLA devices
      the SPMD program is the same on all of them (its work is replicated).

  Raises:
    TypeError / ValueError: `device` is not an XLA or CPU device.
  """

  def __init__(self, device=None):
    super().__init__(SingleReplicaExtended(self, _parse_device(device)))


def _parse_device(device):
  if device is None:
    return _runtime.device()
  if not isinstance(device, (str, torch.device)):
    raise TypeError(
      "OneDeviceStrategy(device): device must be a string or torch.device, got "
      f"{type(device).__name__}."
    )
  try:
    d = torch.device(device)
  except RuntimeError:
    d = None
  if d is not None and d.type == "cpu":
    return torch.device("cpu")
  if d is not None and d.type == _runtime.DEVICE_KIND:
    n = _runtime.num_devices()
    if d.index is not None and not 0 <= d.index < n:
      raise ValueError(
        f"OneDeviceStrategy(device={device!r}): this process has {n} XLA "
        f"devices, xla:0 .. xla:{n - 1}."
      )
    return _runtime.device()
  raise ValueError(
    f"OneDeviceStrategy(device={device!r}): xladist runs on XLA devices; pass "
    "None or 'xla:0' for the XLA device, or 'cpu' for plain PyTorch on the host."
  )
