"""Helpers shared by the analyses: example-clustered intervals, claim rows, tables.

Intervals are 95% percentile bootstraps that resample whole examples
(``stats.cluster_bootstrap_ci`` with one group per (task, example)): the rows
and decode calls of one example are dependent.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from experiments.lib import stats

N_BOOT = 500
PRIMARY = "poisson_tail"
# method, section 7, as ranges for stats.verdict (a point claim "about x" is given a
# band, stated in the report).
PAPER = {
    "coverage": (0.969, 0.977),
    "attribution_cert": (0.73, 0.75),
    "attribution_disagreement": (0.62, 0.69),
    "gating_fraction": (0.31, 0.41),  # "~36%": +-5 points
    "gating_vs_random": (1.7, 1.8),
    "overhead": (1.5, 2.5),  # "about 2x"
}


def example_groups(rows):
  return np.asarray([f"{r['task']}:{r['example']}" for r in rows])


def ci(stat_fn, *arrays, groups, seed=0) -> Optional[stats.Interval]:
  """Cluster-bootstrap interval; None when the statistic cannot be computed, and no interval
  (NaN bounds: not estimable) from fewer than two examples or when the bootstrap fails."""
  try:
    est = float(stat_fn(*arrays))
  except ValueError:
    return None
  if not math.isfinite(est):
    return None
  if len(np.unique(groups)) < 2:  # one example: no spread to resample
    return stats.Interval(est, float("nan"), float("nan"))
  try:
    return stats.cluster_bootstrap_ci(stat_fn, *arrays, groups=groups, n_boot=N_BOOT,
                                      seed=seed)
  except ValueError:
    return stats.Interval(est, float("nan"), float("nan"))


def fmt_ci(ci) -> str:
  if ci is None:
    return "n/a"
  e, lo, hi = ci
  if not (math.isfinite(lo) and math.isfinite(hi)):
    return f"{e:.3f} (no CI)"
  return f"{e:.3f} [{lo:.3f}, {hi:.3f}]"


NOT_ESTIMABLE = "inconclusive (not estimable)"


def verdict_of(paper, ci, direction) -> str:
  """:func:`stats.verdict`, or :data:`NOT_ESTIMABLE` when there is no finite interval."""
  if ci is None or not all(math.isfinite(x) for x in ci):
    return NOT_ESTIMABLE
  return stats.verdict(paper, ci, direction)


def claim(claim, paper_text, ci, verdict, note="") -> dict:
  return {"claim": claim, "paper": paper_text, "ours": fmt_ci(ci),
          "ci": None if ci is None else [float(x) for x in ci], "verdict": verdict,
          "note": note}


def select(rows, **kw):
  out = []
  for r in rows:
    ok = True
    for k, v in kw.items():
      if isinstance(v, (tuple, list, set)):
        ok &= r.get(k) in v
      else:
        ok &= r.get(k) == v
    if ok:
      out.append(r)
  return out


def full_correct(rows) -> dict:
  """(task, example) -> full-cache correctness."""
  return {(r["task"], r["example"]): bool(r["correct"]) for r in rows if r["design"] == "full"}


def table(header, body) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in body]
  return lines
