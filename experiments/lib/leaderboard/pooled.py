"""Task scores pooled over leaderboard runs drawn with different seeds.

One run of 8 examples per task scores a design in steps of 3 points, so two
designs that differ by one needle look apart. Runs with other seeds draw
other needles, keys and haystack windows; pooling their rows gives one paired
comparison on every example any two runs share a design and ratio on. Each
(seed, task) is a stratum of the bootstrap, resampled within itself, so a
run with more examples weighs more, as its examples do. The rows must share one
context length and regime: a seed draws the same needles at every length, so
its examples at two lengths are not independent draws.

    summary = pooled.summarize([rows_seed0, rows_seed2], against="snapkv")
    summary["paired"]["priority_focus+cert"]["0.75"]  # {"value", "ci", "n", ...}
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from experiments.lib import stats
from experiments.lib.leaderboard import rows as rows_lib

N_BOOT = 2000  # bootstrap resamples of each interval


def _key(ratio) -> str:
  return str(float(ratio))


def example_scores(rows: Sequence[dict], design: str, ratio: float) -> dict:
  """{(seed, context_len, regime, task, example): score in points} of ``design`` at
  ``ratio``; a key seen twice with different scores is an error (two runs
  that disagree)."""
  out = {}
  for r in rows:
    if r["design"] != design or float(r["ratio"]) != float(ratio):
      continue
    k = (r["seed"], r["context_len"], r["regime"], r["task"], r["example"])
    s = 100.0 * float(r["score"])
    if k in out and out[k] != s:
      raise ValueError(f"rows disagree on {design!r} at ratio {ratio} for {k}: "
                       f"{out[k]} vs {s}")
    out[k] = s
  return out


# Settings every pooled run must share: row field -> value of rows written before it
# was recorded (None: such rows are not compared on it).
SHARED = {"model": None, "chunk": None, "haystack_sha256": None, **rows_lib.OLDER_ROWS}


def check_one_setting(rows: Sequence[dict]) -> None:
  """Raises ValueError unless every row has the same context length and regime, the
  same :data:`SHARED` settings, and one answer length per task."""
  settings = sorted({(r["context_len"], r["regime"]) for r in rows}, key=str)
  if len(settings) > 1:
    raise ValueError(f"rows hold {len(settings)} (context_len, regime) settings {settings}: "
                     "pool one at a time (a seed's examples at two settings share their "
                     "needles, so they are not independent)")
  for field, assumed in SHARED.items():
    held = {json.dumps(r.get(field, assumed)) for r in rows
            if field in r or assumed is not None}
    if len(held) > 1:
      raise ValueError(f"rows were made with {len(held)} values of {field} "
                       f"({', '.join(sorted(held))}): pool runs of one setting only")
  lengths = {}
  for r in rows:
    lengths.setdefault(r["task"], set()).add(r.get("max_new_tokens"))
  mixed = {t: sorted(v, key=str) for t, v in lengths.items() if len(v) > 1}
  if mixed:
    raise ValueError(f"rows answer a task with more than one max_new_tokens: {mixed}")


def paired(rows: Sequence[dict], design: str, against: str, ratio: float, *,
           seed: int = 0) -> dict:
  """``design`` minus ``against`` on the examples both were run on at ``ratio``,
  in points, with a 95% percentile bootstrap stratified by (seed, task).

  Raises:
    ValueError naming the designs if they share no example at ``ratio``, or
    if the rows mix settings (:func:`check_one_setting`).
  """
  check_one_setting(rows)
  a, b = example_scores(rows, design, ratio), example_scores(rows, against, ratio)
  if not set(a) & set(b):
    raise ValueError(f"designs {design!r} and {against!r} share no example at ratio {ratio}")
  return _paired(a, b, seed)


def _paired(a: dict, b: dict, seed: int) -> dict:
  """:func:`paired` of two :func:`example_scores` dicts that share an example."""
  keys = sorted(set(a) & set(b))
  x = np.array([a[k] for k in keys])
  y = np.array([b[k] for k in keys])
  strata = np.array([f"{k[0]}/{k[3]}" for k in keys])
  diff = stats.bootstrap_ci(np.mean, x - y, n_boot=N_BOOT, seed=seed, strata=strata)
  own = stats.bootstrap_ci(np.mean, x, n_boot=N_BOOT, seed=seed, strata=strata)
  ref = stats.bootstrap_ci(np.mean, y, n_boot=N_BOOT, seed=seed, strata=strata)
  return {"value": float(diff.estimate), "ci": [float(diff.lo), float(diff.hi)],
          "n": len(keys), "seeds": sorted({int(k[0]) for k in keys}),
          "wins": int(np.sum(x > y)), "losses": int(np.sum(x < y)),
          "score": {"value": float(own.estimate), "ci": [float(own.lo), float(own.hi)]},
          "against_score": {"value": float(ref.estimate), "ci": [float(ref.lo), float(ref.hi)]}}


def summarize(rows: Sequence[dict], *, against: str, designs: Sequence[str] = (),
              ratios: Sequence[float] = ()) -> dict:
  """``paired[design][ratio]`` (see :func:`paired`) for every design other than
  ``against`` (default: every design in the rows except the full cache) at
  every ratio where the two share an example (default: every ratio in the rows but 0);
  the rows share one setting (:func:`check_one_setting`)."""
  check_one_setting(rows)
  designs = list(designs) or sorted({r["design"] for r in rows} - {against, "full"})
  ratios = list(ratios) or sorted({float(r["ratio"]) for r in rows} - {0.0})
  out = {"against": against, "paired": {}}
  ref = {ratio: example_scores(rows, against, ratio) for ratio in ratios}
  for d in designs:
    for ratio in ratios:
      own = example_scores(rows, d, ratio)
      if set(own) & set(ref[ratio]):
        out["paired"].setdefault(d, {})[_key(ratio)] = _paired(own, ref[ratio], seed=0)
  return out


def markdown(summary: dict) -> str:
  """The pooled comparison as a table: one row per design and ratio."""
  lines = [f"Paired against `{summary['against']}` on the same examples, in points "
           "(95% bootstrap over examples, stratified by seed and task):", "",
           "| design | ratio | seeds | examples | score | against | difference [95% CI] "
           "| better / worse |", "|---|---|---|---|---|---|---|---|"]
  for d, per in summary["paired"].items():
    for ratio, p in per.items():
      lines.append(
          f"| {d} | {ratio} | {', '.join(map(str, p['seeds']))} | {p['n']} "
          f"| {p['score']['value']:.1f} | {p['against_score']['value']:.1f} "
          f"| {p['value']:+.1f} [{p['ci'][0]:+.1f}, {p['ci'][1]:+.1f}] "
          f"| {p['wins']} / {p['losses']} |")
  return "\n".join(lines) + "\n"
