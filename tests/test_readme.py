"""README.md as a reader meets it: its runnable code blocks run, and its links lead somewhere.

A ```python block that follows the line `<!-- runs-in-tests -->` is meant to run as
written. All of them run in order, in one namespace, in ONE subprocess with 4
XLA:CPU devices (what a reader pasting them into one session would see), so
importing torch_xla is paid once. The porting block's TF-style loss must equal
its sync-on-read metric. The checkpoint block trains, is "stopped", resumes from
its checkpoint, and trains an uninterrupted run beside it: the resumed run must
say where it resumed and end with the same loss.

Relative links (and their #anchors, in GitHub's spelling) of README.md and the
docs it points to must name files and headings that exist.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARK = "<!-- runs-in-tests -->"
LINKED_DOCS = [README, ROOT / "docs" / "performance.md", ROOT / "docs" / "porting.md"]

# Executes the blocks given in a JSON file in one namespace. Each block is compiled
# with its README line numbers, so a traceback points at the README's line.
DRIVER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for first_line, code in blocks:
  exec(compile("\\n" * (first_line - 1) + code, "README.md", "exec"), namespace)
  print(f"README block at line {first_line}: ok", flush=True)
"""


def _marked_blocks(text):
  """[(section title, first code line number, code)] of the blocks after MARK."""
  lines = text.splitlines()
  blocks, section = [], None
  for i, line in enumerate(lines):
    if line.startswith("## "):
      section = line[3:].strip()
    if line.strip() != MARK:
      continue
    fence = i + 1
    assert lines[fence].strip() == "```python", (
      f"README.md line {i + 1}: {MARK} must be followed directly by a ```python block"
    )
    end = next(j for j in range(fence + 1, len(lines)) if lines[j].strip() == "```")
    blocks.append((section, fence + 2, "\n".join(lines[fence + 1 : end])))
  return blocks


def test_the_example_and_the_checkpoint_blocks_are_marked():
  sections = [section for section, _, _ in _marked_blocks(README.read_text())]
  assert "Example" in sections
  assert "Checkpoints and exact resume" in sections
  assert "Porting from tf.distribute" in sections


def run_marked_blocks(tmp_path, env_extra):
  """Runs README.md's marked blocks in one child interpreter (this one's Python, with
  `env_extra` added) and checks what they print: the TF-style loss equals its metric,
  the resumed run says where it resumed and ends with the uninterrupted run's loss."""
  blocks = [(line, code) for _, line, code in _marked_blocks(README.read_text())]
  (tmp_path / "blocks.json").write_text(json.dumps(blocks))
  env = dict(
    os.environ,
    XLADIST_COMPILE_CACHE="off",
    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    **env_extra,
  )
  proc = subprocess.Popen(
    [sys.executable, "-c", DRIVER, str(tmp_path / "blocks.json")],
    cwd=tmp_path,  # anything a block writes lands here
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    out, err = proc.communicate(timeout=240)
  except subprocess.TimeoutExpired:
    proc.kill()  # by its pid: the child started here, nothing else
    out, err = proc.communicate()
    pytest.fail(f"README blocks still running after 240 s:\n{out}\n{err[-3000:]}")
  assert proc.returncode == 0, f"a README block failed:\n{out}\n{err[-3000:]}"
  for line, _ in blocks:
    assert f"README block at line {line}: ok" in out
  # The TF-style step: compute_average_loss summed over the replicas is the global
  # mean loss, and the sync-on-read metric read outside the step agrees with it.
  ported = re.search(r"global mean loss (\S+), metric (\S+)", out)
  assert ported, out
  loss, metric = (float(v) for v in ported.groups())
  assert 0 < loss and abs(loss - metric) <= 1e-5, out
  assert "resumed at step 13 (epoch 4)" in out, out
  final = re.search(r"final loss: resumed (\S+), uninterrupted (\S+)", out)
  assert final, out
  resumed, uninterrupted = (float(v) for v in final.groups())
  # The same process, the same programs: an exact resume gives the same bits.
  assert resumed == uninterrupted, out


def test_marked_blocks_run_and_resume_exactly(tmp_path):
  """On torch_xla (this suite's runtime); tests/runtime_jax/test_readme_on_jax.py runs
  the same blocks unchanged on the jax runtime."""
  run_marked_blocks(tmp_path, {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})


def test_no_marked_block_imports_a_runtime_library():
  """User code imports no runtime library: the same script runs on every runtime."""
  for section, line, code in _marked_blocks(README.read_text()):
    assert not re.search(r"\btorch_xla\b|\bjax\b|\btorchax\b", code), (section, line)


def _strip_fences(text):
  """`text` without its fenced code blocks."""
  return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _strip_code(text):
  """`text` without fenced blocks and inline code spans (links there are not links)."""
  return re.sub(r"`[^`\n]*`", "", _strip_fences(text))


def _anchors(path):
  """GitHub's anchors of the headings of a markdown file."""
  seen, anchors = {}, set()
  for line in _strip_fences(path.read_text()).splitlines():
    m = re.match(r"#{1,6}\s+(.*)", line)
    if not m:
      continue
    heading = re.sub(r"`", "", m.group(1)).strip().lower()
    slug = re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


def _links(path):
  """Targets of the markdown links and images of `path`, code excluded."""
  return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", _strip_code(path.read_text()))


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(doc):
  checked, broken = 0, []
  for target in _links(doc):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
      continue
    file_part, _, anchor = target.partition("#")
    where = (doc.parent / file_part).resolve() if file_part else doc
    checked += 1
    if not where.exists():
      broken.append(f"{target}: no file {where}")
    elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
      broken.append(f"{target}: no heading with anchor #{anchor} in {where.name}")
  assert checked, f"found no relative links in {doc}"
  assert not broken, f"{doc.name} has broken links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_link(tmp_path):
  doc = tmp_path / "doc.md"
  doc.write_text("# Title\n[ok](#title) [gone](missing.md) `[code](nowhere.md)`\n")
  assert _links(doc) == ["#title", "missing.md"]
  assert _anchors(doc) == {"title"}
