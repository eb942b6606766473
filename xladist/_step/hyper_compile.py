"""Hyperparameter expressions (hyper.py) as generated Python: a replay evaluates its
hyperparameter inputs, step counters and guards at every step (issue 61)."""

from xladist._step.hyper import (
  _BINARY,
  _COMPARE,
  _MATH_FNS,
  _TO_PLAIN,
  _UNARY,
  LEAF,
  NUMBER,
  STATE,
)


def compiled(exprs):
  """`fn(groups) -> tuple` of the values of `exprs` (what `evaluate` gives each),
  as one generated Python function: a replay evaluates its hyperparameters and
  counters at every step, and walking the expression trees cost more than the
  arithmetic (issue 61). Each node is the same call `evaluate` makes, in the same
  order; a sub-expression shared by identity is evaluated once."""
  env = {"float": float, "round": round}
  lines, names, kept = [], {}, []

  def const(value):
    name = f"c{len(env)}"
    env[name] = value
    return name

  def emit(e):
    known = names.get(id(e))
    if known is not None:
      return known
    kept.append(e)  # ids stay unique while compiling
    kind = e[0]
    if kind == NUMBER:
      names[id(e)] = const(e[1])
      return names[id(e)]
    if kind in (STATE, LEAF):
      src = f"G[{const(e[1])}][{const(e[2])}]"
      if kind == LEAF and e[3] is not None:
        src += f"[{const(e[3])}]"
      src = f"float({src})"
    elif kind in _UNARY:
      src = f"{const(_UNARY[kind])}({emit(e[1])})"
    elif kind == "math":
      src = f"{const(_MATH_FNS[e[1]])}({', '.join(emit(a) for a in e[2:])})"
    elif kind in _COMPARE:
      src = f"{const(_COMPARE[kind][0])}({emit(e[1])}, {emit(e[2])})"
    elif kind in _TO_PLAIN:
      src = f"{const(_TO_PLAIN[kind])}({emit(e[1])})"
    elif kind == "round":
      src = f"round({emit(e[1])}, {const(e[2])})"
    else:
      src = f"{const(_BINARY[kind][0])}({emit(e[1])}, {emit(e[2])})"
    name = names[id(e)] = f"v{len(lines)}"
    lines.append(f"  {name} = {src}")
    return name

  out = [emit(e) for e in exprs]
  source = (
    "def _values(G):\n" + "\n".join(lines) + f"\n  return ({', '.join(out)}{',' if out else ''})\n"
  )
  exec(compile(source, "<xladist hyperparameters>", "exec"), env)  # noqa: S102
  return env["_values"]
