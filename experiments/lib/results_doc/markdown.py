"""Formatting and reading helpers of ``docs/results.md`` (paths relative to the
results folder; links relative to the document)."""

from __future__ import annotations

import json
import os
import re
from typing import Optional, Sequence

from experiments.lib import results_io

# Links are relative to the document (docs/results.md).
LINK = "../experiments/results"
# The suite's primary certificate level (its claims are stated at delta 0.05).
DELTA = 0.05


# --- formatting ---------------------------------------------------------------------------

def num(x, spec=".3f") -> str:
  return "-" if x is None else format(x, spec)


def ci(t, spec=".3f") -> str:
  if t is None:
    return "n/a"
  e, lo, hi = t
  if lo is None and hi is None:  # no interval (e.g. a leaderboard task of one example)
    return f"{num(e, spec)} (no CI)"
  return f"{num(e, spec)} [{num(lo, spec)}, {num(hi, spec)}]"


def span(values, spec=".3f") -> str:
  """``lo-hi`` of the values as printed (one value when they print the same)."""
  vals = [v for v in values if v is not None]
  if not vals:
    return "-"
  lo, hi = num(min(vals), spec), num(max(vals), spec)
  if lo == hi:
    return lo
  return f"{lo} to {hi}" if min(vals) < 0 else f"{lo}-{hi}"


def pct(b) -> str:
  return f"{float(b) * 100:g}%"


def mib(n_bytes) -> str:
  return f"{n_bytes / 2**20:.1f}"


def table(header: Sequence[str], body) -> list[str]:
  return (["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
          + ["| " + " | ".join(str(x) for x in row) + " |" for row in body])


def link(rel: str, label: Optional[str] = None) -> str:
  return f"[`{label or rel}`]({LINK}/{rel})"


def source(files: Sequence[str], command: str) -> list[str]:
  return [f"Source: {', '.join(link(f) for f in files)}. Command: `{command}`.", ""]


# --- reading ------------------------------------------------------------------------------

def run_source(root: str, rel: str) -> list[str]:
  """:func:`source` of a study run's ``summary.json``, ``report.md`` and ``COMMAND.md``."""
  return source([f"{rel}/summary.json", f"{rel}/report.md", f"{rel}/COMMAND.md"],
                command(root, f"{rel}/COMMAND.md"))


def read_json(root: str, rel: str):
  with open(os.path.join(root, rel), encoding="utf-8") as f:
    return json.load(f)


def read_rows(root: str, rel: str) -> list[dict]:
  return results_io.read_rows(os.path.join(root, rel))


def read_text(root: str, rel: str) -> str:
  with open(os.path.join(root, rel), encoding="utf-8") as f:
    return f.read()


def command(root: str, rel: str) -> str:
  """The command recorded in ``rel``: its first indented ``python -m`` block (COMMAND.md;
  where it holds more, a shell comment says how many), else its first ``python -m`` in
  backquotes (report.md, summary.md)."""
  text = read_text(root, rel)
  lines = text.splitlines()
  blocks = [i for i, line in enumerate(lines) if line.startswith("    python -m ")]
  if blocks:
    parts, j = [lines[blocks[0]].strip()], blocks[0]
    while parts[-1].endswith("\\") and j + 1 < len(lines):
      j += 1
      parts[-1] = parts[-1][:-1].rstrip()
      parts.append(lines[j].strip())
    more = (f" # the first of {len(blocks)} commands, all in {os.path.basename(rel)}"
            if len(blocks) > 1 else "")
    return " ".join(parts) + more
  inline = re.search(r"`(python -m [^`]+)`", text)
  if inline:
    return inline.group(1)
  raise ValueError(f"{rel}: no recorded command")


def settings_line(root: str, rel: str) -> str:
  m = re.search(r"^Settings: (.*?)\s*$", read_text(root, rel), re.M)
  if not m:
    raise ValueError(f"{rel}: no Settings line")
  return m.group(1)
