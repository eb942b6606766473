"""docs/architecture.md's picture of the layers lists exactly the layers of the
import-linter contract in pyproject.toml (which `make lint` enforces); the design stays
under 900 lines (measurements live in docs/performance.md, studies and decisions in
docs/decisions/, history in CHANGELOG.md); and every relative link of docs/*.md and
docs/decisions/*.md leads to a file and heading that exist."""

import pathlib
import re

import pytest
from test_readme import _anchors, _links  # README's link checker: GitHub's anchor spelling

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "decisions").glob("*.md"))


def _contract_layers():
  # The `layers = [...]` list of the layers contract (tomllib is Python 3.11+).
  text = (ROOT / "pyproject.toml").read_text()
  (body,) = re.findall(r'type = "layers"\s*\nlayers = \[(.*?)\]', text, re.S)
  layers = re.findall(r'"([^"]+)"', body)
  assert layers
  return [{m.strip().removeprefix("xladist.") for m in line.split(":")} for line in layers]


def _doc_layers():
  text = (ROOT / "docs" / "architecture.md").read_text()
  block = re.search(r"<!-- layers .*?-->\s*```text\n(.*?)```\s*<!-- end layers -->", text, re.S)
  assert block, "docs/architecture.md has lost its layers block"
  lines = block.group(1).splitlines()
  out = []
  for i, line in enumerate(lines):
    label, names = line.split(" ", 1)
    assert label == f"L{len(lines) - i}", f"layers are numbered from the top down: {line!r}"
    out.append({n.strip() for n in names.split(",")})
  return out


def test_the_picture_lists_the_contract_layers_highest_first():
  doc, contract = _doc_layers(), _contract_layers()
  assert len(doc) == len(contract)
  for i, (d, c) in enumerate(zip(doc, contract)):
    assert d == c, f"layer {i + 1} from the top: doc has {sorted(d)}, pyproject {sorted(c)}"


def test_every_module_of_the_package_is_in_a_layer():
  placed = set().union(*_contract_layers())
  package = ROOT / "xladist"
  top = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
  top |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
  assert top - placed == set(), "modules outside the layers contract"


def test_the_design_stays_under_900_lines():
  lines = (ROOT / "docs" / "architecture.md").read_text().splitlines()
  assert len(lines) < 900, (
    f"docs/architecture.md has {len(lines)} lines: move measurements to docs/performance.md, "
    "studies and decisions to docs/decisions/, history to CHANGELOG.md"
  )


def test_no_module_of_the_step_engine_is_over_600_lines():
  """Issue 59: the step engine's modules stay small enough to read (split by what
  they hold: the recorder, its tables, the host objects it knows, the guards)."""
  long = {
    p.name: n
    for p in sorted((ROOT / "xladist" / "_step").glob("*.py"))
    if (n := len(p.read_text().splitlines())) > 600
  }
  assert not long, f"xladist/_step modules over 600 lines: {long}"


def test_the_docs_and_the_decisions_are_checked():
  names = {p.relative_to(ROOT).as_posix() for p in DOCS}
  assert {"docs/architecture.md", "docs/performance.md", "docs/decisions/README.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_of_the_docs_resolve(doc):
  broken = []
  for target in _links(doc):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
      continue
    file_part, _, anchor = target.partition("#")
    where = (doc.parent / file_part).resolve() if file_part else doc
    if not where.exists():
      broken.append(f"{target}: no file {where}")
    elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
      broken.append(f"{target}: no heading with anchor #{anchor} in {where.name}")
  assert not broken, f"{doc.name} has broken links:\n" + "\n".join(broken)
