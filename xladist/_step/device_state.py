"""Optimizer state kept on the device, so that a step changes nothing on the host.

torch's Adam and AdamW (and Adamax, NAdam, RAdam, ASGD, Adadelta, RMSprop:
every optimizer with a `capturable` option) keep each parameter's `step`
counter as a CPU tensor unless made with `capturable=True`. Each step then
increments it on the host and passes the bias corrections to the program as
Python numbers: the step changes host state (it can never be replayed) and the
corrections, computed in float64 on the host, are baked into every program.

The first time such an optimizer steps inside `strategy.run`, xladist turns
`capturable` on for its groups (what torch does for CUDA graphs): the counter
lives on the device and the corrections are computed in the program, in
float32 (equal to torch's default within float32 rounding). It does so whether
or not replay is on, so a run gives the same numbers either way.

Checkpoints keep torch's default format: `optimizer.state_dict()` says
`capturable` as the user made it and holds each `step` as a CPU float32 tensor;
`optimizer.load_state_dict` of such a dict puts the counters back on the device
(hooks registered on the optimizer, `Optimizer.register_state_dict_post_hook`
and `register_load_state_dict_post_hook`).
"""

import torch

from xladist import runtime as _runtime

_FLIPPED = "_xladist_capturable_groups"  # the optimizer's attribute: ids of the groups flipped


def keep_state_on_device(optimizer):
  """Turns `capturable` on in `optimizer`'s groups that have it off (the first
  time, and for groups added since), and places per-parameter state that an
  optimizer made on the host before its parameters were placed (Adagrad's
  'sum', made by its constructor); returns how many groups it turned."""
  _place_host_state(optimizer)
  groups = [
    g
    for g in optimizer.param_groups
    if g.get("capturable") is False and not g.get("fused") and not g.get("differentiable")
  ]
  if not groups:
    return 0
  flipped = getattr(optimizer, _FLIPPED, None)
  if flipped is None:
    flipped = set()
    setattr(optimizer, _FLIPPED, flipped)
    optimizer.register_state_dict_post_hook(_default_format)
    optimizer.register_load_state_dict_post_hook(_after_load)
  _turn_on(optimizer, groups, flipped)
  return len(groups)


def _place_host_state(optimizer):
  """A host tensor of a parameter's state with the parameter's shape (made by
  the optimizer's constructor while the model was still on the CPU) goes where
  the parameter is (replicated): the step would mix devices otherwise."""
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


def _turn_on(optimizer, groups, flipped):
  """`capturable` on in `groups`, their counters on the devices."""
  for group in groups:
    group["capturable"] = True
    flipped.add(id(group))
    for p in group["params"]:
      state = optimizer.state.get(p)
      step = None if state is None else state.get("step")
      if isinstance(step, torch.Tensor) and not _runtime.is_device_tensor(step):
        state["step"] = _runtime.place_replicated(step.to(torch.float32))


def _default_format(optimizer, state_dict):
  """state_dict post hook: the format of torch's default (non-capturable) state."""
  flipped = getattr(optimizer, _FLIPPED, ())
  indices = set()
  for group, packed in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
    if id(group) in flipped and packed.get("capturable"):
      packed["capturable"] = False
      indices.update(packed["params"])
  steps = []
  for index in indices:
    state = state_dict["state"].get(index)
    step = None if state is None else state.get("step")
    if isinstance(step, torch.Tensor) and _runtime.is_device_tensor(step):
      steps.append((index, step))
  if steps:
    hosts = _runtime.to_host([s for _, s in steps])
    for (index, _), host in zip(steps, hosts, strict=True):
      # a copy of the entry: the packed state shares the live per-parameter dicts
      state_dict["state"][index] = {**state_dict["state"][index], "step": host.reshape(())}
  return state_dict


def _after_load(optimizer):
  """load_state_dict post hook: the groups loaded with `capturable` off are
  turned on again, their counters placed on the devices."""
  flipped = set()
  setattr(optimizer, _FLIPPED, flipped)
  groups = [g for g in optimizer.param_groups if g.get("capturable") is False]
  _turn_on(optimizer, groups, flipped)
