"""The jax runtime's version layer: jax_compat.py (what it takes from jax beyond
the public API) and torchax_load.py (torchax on torch 2.13+). `make test-jax`
runs this file in both jax environments, the oldest supported versions (torch
2.9.0, jax 0.10.2) and the newest (torch 2.14.1, jax 0.12.0.1)."""

import types

import jax
import numpy as np
import pytest
import torch

from xladist.runtime import jax_compat, torchax_load


@pytest.mark.parametrize(
  "text, want",
  [
    ("0.10.2", (0, 10, 2)),
    ("0.12.0.1", (0, 12, 0, 1)),
    ("0.13.0rc1", (0, 13, 0)),
    ("0.11.0+cu", (0, 11, 0)),
  ],
)
def test_version_parses_jax_version_strings(text, want):
  assert jax_compat.version(types.SimpleNamespace(__version__=text)) == want


def test_this_jax_is_supported():
  jax_compat.check_version(jax)


@pytest.mark.parametrize("text", ["0.10.1", "0.13.0", "1.0"])
def test_unsupported_jax_is_refused_by_name(text):
  with pytest.raises(RuntimeError, match=r"supports jax>=0.10.2,<0.13; this environment has jax"):
    jax_compat.check_version(types.SimpleNamespace(__version__=text))


def test_unsupported_torch_is_refused_by_name(monkeypatch):
  torchax_load.check_torch()  # this environment's
  monkeypatch.setattr(torch, "__version__", "2.15.0")
  with pytest.raises(RuntimeError, match=r"supports torch>=2.9,<2.15; this environment has"):
    torchax_load.check_torch()


def test_a_step_trace_closes_into_a_jaxpr_that_evaluates():
  """The private pieces (jax's dynamic trace, the bound replica axis, closing
  the trace) in this jax: a psum over the bound axis traces; the jaxpr evaluates."""
  trace = jax_compat.new_trace(jax_compat.step_trace_base())
  src = jax_compat.source_info()
  with jax_compat.bind_axis("r", 1), jax_compat.current_trace(trace):
    x = trace.new_arg(jax_compat.shaped_array((3,), np.float32), src)
    y = x * 2.0 + 1.0
    z = jax.lax.psum(y, "r")
    jaxpr, consts = jax_compat.close_trace(trace, [y, z])
  assert isinstance(jaxpr, jax_compat.closed_jaxpr_types()[0])
  assert "psum" in str(jaxpr)
  body = jaxpr.replace(outvars=jaxpr.outvars[:1], eqns=jaxpr.eqns[:2])
  (out,) = jax_compat.eval_jaxpr(body, *consts, np.arange(3, dtype=np.float32))
  np.testing.assert_allclose(out, [1.0, 3.0, 5.0])


def test_a_closed_trace_has_its_constants_first_among_its_inputs():
  """jax 0.10 gives a closed trace's constants as constvars, jax 0.12 as the
  first invars: `close_trace` gives the second form in both (a step's
  closed-over arrays are its constants)."""
  trace = jax_compat.new_trace(jax_compat.step_trace_base())
  src = jax_compat.source_info()
  table = np.arange(3, dtype=np.float32)
  with jax_compat.current_trace(trace):
    x = trace.new_arg(jax_compat.shaped_array((3,), np.float32), src)
    jaxpr, consts = jax_compat.close_trace(trace, [x * 2.5 + table])
  assert (len(jaxpr.constvars), len(consts), len(jaxpr.invars)) == (0, 1, 2)
  np.testing.assert_array_equal(consts[0], table)
  (out,) = jax_compat.eval_jaxpr(jaxpr, *consts, np.ones(3, np.float32))
  np.testing.assert_allclose(out, [2.5, 3.5, 4.5])
  # jax 0.10's form, constvars, becomes the same
  constvars, invars = jaxpr.invars[:1], jaxpr.invars[1:]
  closed = jaxpr.replace(constvars=constvars, invars=invars)
  if len(closed.constvars) == 1:  # a jax whose Jaxpr keeps constvars without values
    again = jax_compat._consts_first_among_invars(closed, consts)
    assert again.constvars == [] and again.invars == jaxpr.invars
  with pytest.raises(NotImplementedError, match="a form jax_compat.py does not know"):
    jax_compat._consts_first_among_invars(jaxpr, consts + [table, table])


def test_literals_variables_and_sub_programs_have_the_public_types():
  closed = jax.make_jaxpr(lambda x: jax.jit(lambda y: y + 1.5)(x))(np.float32(1))
  (eqn,) = closed.jaxpr.eqns
  assert any(isinstance(v, jax_compat.closed_jaxpr_types()) for v in eqn.params.values())
  inner = next(v for v in eqn.params.values() if isinstance(v, jax_compat.closed_jaxpr_types()))
  atoms = [a for e in inner.jaxpr.eqns for a in e.invars]
  assert any(isinstance(a, jax_compat.literal_type()) for a in atoms)
  var = jax_compat.new_var(jax_compat.shaped_array((), np.float32))
  assert var.aval.shape == ()


def test_torchax_imports_with_the_ops_this_torch_lacks_as_placeholders():
  torchax = torchax_load.load()
  assert torchax.default_env() is not None
  missing = torchax_load.missing_ops()
  newer = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
  assert ("aten.cholesky" in missing) == newer
  assert all(name.startswith("aten.") for name in missing)
  if newer:  # only during torchax's import: torch.ops is torch's own afterwards
    with pytest.raises(AttributeError):
      torch.ops.aten.cholesky  # noqa: B018


def test_a_placeholder_op_refuses_a_call_by_name():
  op = torchax_load.MissingOp("aten.qr")
  assert op.default == torchax_load.MissingOp("aten.qr.default")
  assert op.default.__name__ == "qr.default"
  assert op.overloads() == []
  with pytest.raises(NotImplementedError, match=r"aten.qr.default does not exist in torch"):
    op.default(torch.zeros(2, 2))
