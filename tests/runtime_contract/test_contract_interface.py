"""The runtime contract's interface: the selected runtime has every operation.

`xladist/runtime/contract.py` lists the operations (the protocols `Runtime`,
`ProgramReplay`, `ShardedCheckpoints`, `Diagnostics`); the facade
`xladist.runtime` binds exactly those names from the runtime chosen by
`XLADIST_BACKEND`. These tests check the binding and each operation's
parameters (those the contract gives a default must be optional, under the
contract's name), on every runtime.
"""

import inspect
import re
import types

import pytest

from xladist import runtime
from xladist.runtime import contract

# What the facade binds besides the contract (its docstring): the runtime's
# choice, and the host helpers that are the same on every runtime.
FACADE_EXTRAS = {
  "BACKEND",
  "BACKENDS",
  "INTERFACE",
  "backend",
  "call_with_timeout",
  "user_frame",
  "shares_storage",
}


def test_the_runtime_module_has_every_operation_of_the_contract():
  """contract.missing / PROTOCOLS: the module satisfies all four protocols."""
  assert contract.missing(runtime.backend) == []
  for protocol in contract.PROTOCOLS:
    assert isinstance(runtime.backend, protocol), protocol.__name__


def test_the_facade_binds_exactly_the_contract_from_the_runtime():
  """runtime/__init__.py: `INTERFACE` is the contract's names; each is the runtime's
  own (`initialize` is the facade's, which checks XLADIST_BACKEND first)."""
  names = [n for p in contract.PROTOCOLS for n in contract.operations(p)]
  assert runtime.INTERFACE == tuple(names)
  assert len(set(names)) == len(names)  # no name in two protocols
  for name in runtime.INTERFACE:
    if name != "initialize":
      assert getattr(runtime, name) is getattr(runtime.backend, name), name
  public = {
    n
    for n, v in vars(runtime).items()
    if not n.startswith("_") and not isinstance(v, types.ModuleType)
  }
  assert public - FACADE_EXTRAS == set(runtime.INTERFACE)
  assert runtime.BACKEND in runtime.BACKENDS


def test_the_protocols_docstrings_count_their_operations():
  """contract.py: each protocol says how many operations and attributes it has."""
  for protocol in contract.PROTOCOLS:
    names = contract.operations(protocol)
    attributes = [n for n in names if n in getattr(protocol, "__annotations__", {})]
    doc = " ".join(protocol.__doc__.split())
    m = re.search(r"(\d+) operations(?: and (\d+) attributes)?\)", doc)
    assert m, protocol.__name__
    assert int(m.group(1)) == len(names) - len(attributes), protocol.__name__
    assert int(m.group(2) or 0) == len(attributes), protocol.__name__


def _operations():
  for protocol in contract.PROTOCOLS:
    for name in contract.operations(protocol):
      if callable(getattr(protocol, name, None)):
        yield name, protocol


@pytest.mark.parametrize(
  "name,protocol", list(_operations()), ids=lambda v: getattr(v, "__name__", v)
)
def test_each_operation_takes_the_contracts_parameters(name, protocol):
  """Every operation: the contract's required parameters are positional, each
  parameter with a default there is optional here under the same name, and the
  runtime adds no required parameter of its own."""
  want = list(inspect.signature(getattr(protocol, name)).parameters.values())[1:]  # no self
  have = inspect.signature(getattr(runtime.backend, name)).parameters
  params = list(have.values())
  var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
  var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
  positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  for i, p in enumerate(want):
    if p.default is inspect.Parameter.empty:
      assert i < len(positional) or var_pos, f"{name}: no parameter for {p.name!r}"
      continue
    got = have.get(p.name)
    if got is None:
      assert var_kw, f"{name}: no optional parameter {p.name!r} (the contract's {p})"
      continue
    assert got.default is not inspect.Parameter.empty, f"{name}: {p.name!r} must be optional"
    if not isinstance(p.default, str):  # a message's default text is the runtime's
      assert got.default == p.default, f"{name}: {p.name!r} defaults to {got.default!r}, not {p}"
  extra = [
    p.name
    for p in positional[len(want) :]
    if p.default is inspect.Parameter.empty and p.name not in {w.name for w in want}
  ]
  assert not extra, f"{name}: required parameters the contract does not have: {extra}"


def test_the_attributes():
  """Runtime.DEVICE_KIND / HostReadInStep, ProgramReplay.REPLAY_KIND / PendingInput."""
  assert isinstance(runtime.DEVICE_KIND, str) and runtime.DEVICE_KIND
  assert runtime.device().type == runtime.DEVICE_KIND
  assert isinstance(runtime.HostReadInStep, type)
  assert issubclass(runtime.HostReadInStep, Exception)
  assert isinstance(runtime.PendingInput, type)
  assert issubclass(runtime.PendingInput, Exception)
  assert runtime.REPLAY_KIND in ("graph", "program")


def test_require_returns_for_what_every_runtime_runs():
  """Runtime.require: None for APIs the runtime runs."""
  for api in ("MirroredStrategy", "MultiWorkerMirroredStrategy", "OneDeviceStrategy"):
    assert runtime.require(api) is None


@pytest.mark.skipif(runtime.BACKEND != "jax", reason="the jax runtime's refusals")
def test_require_refuses_what_the_jax_runtime_cannot_run():
  """Runtime.require: NotImplementedError naming the API and what to use instead."""
  for api in ("CentralStorageStrategy", "ParameterServerStrategy"):
    with pytest.raises(NotImplementedError, match=api) as e:
      runtime.require(api)
    assert "MirroredStrategy" in str(e.value) and "torch_xla" in str(e.value)


@pytest.mark.skipif(runtime.BACKEND != "torch_xla", reason="torch_xla runs every API")
def test_require_refuses_nothing_on_torch_xla():
  """Runtime.require: torch_xla runs every xladist API."""
  for api in ("CentralStorageStrategy", "ParameterServerStrategy", "TPUStrategy"):
    assert runtime.require(api) is None
