"""Uncertainty: :func:`bootstrap_ci` (percentile bootstrap, paired over examples,
optionally stratified), :func:`cluster_bootstrap_ci` (resamples whole groups, e.g.
all decode calls of one example), :func:`wilson_interval` and
:func:`median_interval` (distribution-free, for benchmark timings)."""

from __future__ import annotations

import math
import statistics
from typing import Callable, NamedTuple

import numpy as np

from experiments.lib.stats import validation


class Interval(NamedTuple):
  estimate: float
  lo: float
  hi: float


def _check_boot(n_boot, seed, alpha):
  if not isinstance(n_boot, int) or n_boot < 10:
    raise ValueError(f"n_boot must be an int >= 10, got {n_boot!r}")
  if not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an int, got {seed!r}")
  validation.check_alpha(alpha)


def _percentile(estimate, stats, alpha) -> Interval:
  stats = np.asarray(stats, np.float64)
  ok = np.isfinite(stats)
  if ok.sum() < 0.5 * len(stats):
    raise ValueError(f"stat_fn was non-finite on {int((~ok).sum())} of {len(stats)} resamples")
  lo, hi = np.quantile(stats[ok], [alpha / 2.0, 1.0 - alpha / 2.0])
  return Interval(float(estimate), float(lo), float(hi))


def _call(stat_fn, arrays):
  try:
    return float(stat_fn(*arrays))
  except ValueError:  # e.g. an AUC on a one-class resample
    return float("nan")


def bootstrap_ci(stat_fn: Callable[..., float], *arrays, n_boot: int = 1000, seed: int = 0,
                 alpha: float = 0.05, strata=None) -> Interval:
  """Percentile bootstrap interval of ``stat_fn(*arrays)`` over examples.

  The arrays are resampled together (the same example indices for all:
  paired). With ``strata`` ([n] group labels), each stratum is resampled
  within itself, keeping its size (e.g. strata = labels keeps both classes of
  an AUC). Resamples on which ``stat_fn`` raises ``ValueError`` or returns a
  non-finite value are dropped (an error if that is over half of them).

  Args:
    stat_fn: statistic of the arrays (their first axis indexes examples).
    *arrays: one or more arrays with the same first-axis length n.
    n_boot: resamples (int >= 10).
    seed: numpy seed; the same seed gives the same interval.
    alpha: the interval is the [alpha/2, 1 - alpha/2] quantile range.
    strata: optional [n] stratum labels.

  Returns:
    ``Interval(estimate, lo, hi)``; ``estimate`` is ``stat_fn`` on the data.
  """
  _check_boot(n_boot, seed, alpha)
  if not arrays:
    raise ValueError("arrays: pass at least one array")
  arrays = [np.asarray(a) for a in arrays]
  n = len(arrays[0]) if arrays[0].ndim else 0
  if n == 0 or any(a.ndim == 0 or len(a) != n for a in arrays):
    raise ValueError(f"arrays must share a non-zero first-axis length, got "
                     f"{[a.shape for a in arrays]}")
  rng = np.random.default_rng(seed)
  if strata is None:
    groups = [np.arange(n)]
  else:
    st = np.asarray(strata)
    if st.shape != (n,):
      raise ValueError(f"strata must have shape ({n},), got {st.shape}")
    validation.finite_labels(st, "strata")
    groups = [np.flatnonzero(st == u) for u in np.unique(st)]
  stats = np.empty(n_boot)
  for b in range(n_boot):
    idx = np.concatenate([g[rng.integers(0, len(g), len(g))] for g in groups])
    stats[b] = _call(stat_fn, [a[idx] for a in arrays])
  return _percentile(stat_fn(*arrays), stats, alpha)


def cluster_bootstrap_ci(stat_fn: Callable[..., float], *arrays, groups, n_boot: int = 1000,
                         seed: int = 0, alpha: float = 0.05) -> Interval:
  """Percentile bootstrap that resamples whole groups (clusters) with replacement.

  For per-call arrays where many calls share an example (``groups`` = the
  example id of each call): calls of one example are dependent, so the
  example, not the call, is the unit resampled. A group drawn twice
  contributes its calls twice. Other arguments as :func:`bootstrap_ci`.
  """
  _check_boot(n_boot, seed, alpha)
  if not arrays:
    raise ValueError("arrays: pass at least one array")
  arrays = [np.asarray(a) for a in arrays]
  g = np.asarray(groups)
  n = len(g)
  if g.ndim != 1 or n == 0 or any(a.ndim == 0 or len(a) != n for a in arrays):
    raise ValueError(f"groups and arrays must share a non-zero first-axis length, got groups "
                     f"{g.shape}, arrays {[a.shape for a in arrays]}")
  validation.finite_labels(g, "groups")
  members = [np.flatnonzero(g == u) for u in np.unique(g)]
  if len(members) < 2:
    raise ValueError(f"groups must have >= 2 distinct values, got {len(members)}")
  rng = np.random.default_rng(seed)
  stats = np.empty(n_boot)
  for b in range(n_boot):
    pick = rng.integers(0, len(members), len(members))
    idx = np.concatenate([members[i] for i in pick])
    stats[b] = _call(stat_fn, [a[idx] for a in arrays])
  return _percentile(stat_fn(*arrays), stats, alpha)


def _z(alpha: float) -> float:
  return statistics.NormalDist().inv_cdf(1.0 - alpha / 2.0)


def wilson_interval(k, n, alpha: float = 0.05) -> tuple[float, float]:
  """Wilson score interval (no continuity correction) for ``k`` successes in ``n``."""
  validation.check_alpha(alpha)
  if not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"n must be an int >= 1, got {n!r}")
  if not isinstance(k, (int, np.integer)) or not 0 <= k <= n:
    raise ValueError(f"k must be an int in [0, n={n}], got {k!r}")
  z = _z(alpha)
  p = k / n
  denom = 1.0 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  lo = 0.0 if k == 0 else max(0.0, centre - half)
  hi = 1.0 if k == n else min(1.0, centre + half)
  return lo, hi


def median_interval(samples, level: float = 0.95) -> dict:
  """Median of ``samples`` and its order-statistic interval: ``{median, lo, hi, level}``.

  ``[x_(k), x_(n + 1 - k)]`` with the largest ``k`` whose coverage of the
  median, ``1 - 2 P(Bin(n, 1/2) <= k - 1)``, is still >= ``level``: no
  assumption on the distribution of the samples beyond independence. With
  too few samples for ``level`` it is the range, and ``level`` reports the
  coverage it has.
  """
  x = np.sort(np.asarray(samples, np.float64))
  n = len(x)
  if n < 1:
    raise ValueError("samples must not be empty")
  cdf = lambda j: sum(math.comb(n, i) for i in range(j + 1)) / 2.0 ** n  # P(Bin(n, 1/2) <= j)
  k = 1  # 1-indexed order statistic
  while k + 1 <= (n + 1) // 2 and 1.0 - 2.0 * cdf(k) >= level:
    k += 1
  return dict(median=float(np.median(x)), lo=float(x[k - 1]), hi=float(x[n - k]),
              level=round(1.0 - 2.0 * cdf(k - 1), 4))
