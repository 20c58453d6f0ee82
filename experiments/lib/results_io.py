"""Result files for the experiment scripts: atomic, resumable JSONL.

Each finished row is appended by rewriting the file to a temporary name and
``os.replace``-ing it over the old one, so a killed run leaves either the old
or the new file, never a torn line. A rerun reads the rows already there and
skips their keys, so nothing is redone or lost.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time


def json_safe(x):
  """NaN/inf (not JSON) become None, recursively."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  return x


def row_key(row: dict, key_fields) -> tuple:
  return tuple(json.dumps(row.get(f), sort_keys=True) for f in key_fields)


def read_rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def atomic_write(path: str, write, binary: bool = False) -> None:
  """Calls ``write(f)`` on a temporary file in ``path``'s directory, then
  renames it over ``path`` (readers see the old file or the new one, never a
  partial one)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_", suffix=os.path.basename(path))
  try:
    with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as open() would make it (mkstemp makes 0600)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def atomic_write_text(path: str, text: str) -> None:
  atomic_write(path, lambda f: f.write(text))


class JsonlResults:
  """Rows keyed by ``key_fields``; ``add`` persists atomically at once."""

  def __init__(self, path: str, key_fields):
    self.path = path
    self.key_fields = tuple(key_fields)
    self.rows = read_rows(path)
    self._keys = {row_key(r, self.key_fields) for r in self.rows}

  def has(self, **fields) -> bool:
    return row_key(fields, self.key_fields) in self._keys

  def add(self, row: dict) -> None:
    self.add_many([row])

  def add_many(self, rows) -> None:
    """Adds ``rows`` in one atomic rewrite: a killed run leaves all of them on file or
    none (a unit's rows go together, so a rerun of the unit finds none of them)."""
    rows = [json_safe(r) for r in rows]
    keys = [row_key(r, self.key_fields) for r in rows]
    for key in keys:
      if key in self._keys or keys.count(key) > 1:
        raise ValueError(f"row {key} is already in {self.path}")
    self.rows.extend(rows)
    self._keys.update(keys)
    atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n"
                                         for r in self.rows))


def check_settings(results: "JsonlResults", settings: dict, rows=None) -> None:
  """A resume refuses rows made with other settings: ``settings`` maps each flag or
  setting to ``(row field, value)``, or ``(row field, value, assumed)`` where rows written
  before the field existed held ``assumed`` (without it such rows are not compared on it);
  a row on file whose field holds another value is a ValueError naming it. ``rows``: what
  each of ``results.rows`` was made with, where a row's fields do not say it directly."""
  for flag, (field, value, *assumed) in settings.items():
    for row in results.rows if rows is None else rows:
      if field not in row and not assumed:
        continue
      held = row[field] if field in row else assumed[0]
      if json.dumps(held) != json.dumps(value):
        raise ValueError(f"--{flag}={value} in this run, but {results.path} holds rows "
                         f"made with {field}={held}: rerun with the same settings or write "
                         "to another --out")


class Progress:
  """Counts finished units and estimates the time left from the pace so far."""

  def __init__(self, total: int, done: int = 0):
    self.total, self.done, self.start, self.done_at_start = total, done, time.time(), done

  def step(self) -> str:
    self.done += 1
    ran = self.done - self.done_at_start
    elapsed = time.time() - self.start
    eta = elapsed / ran * (self.total - self.done) if ran else float("nan")
    return f"[{self.done}/{self.total}] elapsed {elapsed:.0f}s, ETA {eta:.0f}s"


def quiet_library_logs(flag_values) -> None:
  """Silences INFO lines of JAX (backend probing) and orbax (every checkpoint
  step) on a command's console, unless ``--verbosity`` (absl's ``-v``) was
  given on the command line: a user sees the command's own progress."""
  import logging  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  if flag_values["verbosity"].present:
    return
  absl_logging.set_verbosity(absl_logging.WARNING)
  for name in ("jax", "orbax", "absl"):
    logging.getLogger(name).setLevel(logging.WARNING)


def print_summary(summary, t0: float) -> None:
  """A study's last lines: its report (or that rows are missing) and the wall time."""
  if summary is None:
    print("rows incomplete; rerun to finish (no report yet)")
  else:
    print(summary["md"])
  print(f"wall time {time.time() - t0:.0f}s")


def check_plan_lists(plan, names) -> None:
  """A ValueError naming the flag for each of ``names`` that ``plan`` holds empty (a run of
  no unit), or for a ``max_units`` that is neither None nor an int >= 1."""
  for name in names:
    if not getattr(plan, name):
      raise ValueError(f"--{name}: none given")
  m = getattr(plan, "max_units", None)
  if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
    raise ValueError(f"--max_units must be an int >= 1 (unset: every unit), got {m!r}")


def limit_units(todo, max_units, log):
  """Yields ``todo``'s units, at most ``max_units`` (None: all), and says where it stopped."""
  for n, unit in enumerate(todo):
    if max_units is not None and n >= max_units:
      log(f"stopping after {max_units} units (--max_units); rerun to resume")
      return
    yield unit
