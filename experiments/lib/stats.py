"""Statistics for the experiment suite (numpy only; SPEC sections 6-8).

* ROC: :func:`roc_auc` (Mann-Whitney, ties count 1/2), :func:`roc_curve`,
  and the failure-prediction / attribution wrappers :func:`failure_auc`,
  :func:`attribution_auc`.
* Uncertainty: :func:`bootstrap_ci` (percentile bootstrap, paired over
  examples, optionally stratified), :func:`cluster_bootstrap_ci` (resamples
  whole groups, e.g. all decode calls of one example), :func:`wilson_interval`.
* Certificate: :func:`coverage_curve` (empirical coverage vs nominal
  ``1 - delta`` with Wilson intervals), :func:`coverage_by_bins` (coverage as
  a function of the Assumption-2 ratio ``R``), :func:`sharpness`,
  :func:`log_r_regression` (OLS of ``log R`` with standard errors).
* Gating: :func:`gating_curve`, :func:`gain_captured_ratio`.
* :func:`verdict`: a paper's claimed range against our interval.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, NamedTuple, Optional, Sequence, Union

import numpy as np


def _vec(x, name: str, dtype=np.float64) -> np.ndarray:
  a = np.asarray(x, dtype)
  if a.ndim != 1 or a.size == 0:
    raise ValueError(f"{name} must be a non-empty 1-D array, got shape {a.shape}")
  return a


def _same_len(**arrays):
  sizes = {k: len(v) for k, v in arrays.items()}
  if len(set(sizes.values())) != 1:
    raise ValueError(f"arrays must have equal lengths, got {sizes}")


def _check_alpha(alpha):
  if not (isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0):
    raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


def _labels(labels, name: str = "labels") -> np.ndarray:
  lab = np.asarray(labels)
  if lab.ndim != 1 or lab.size == 0:
    raise ValueError(f"{name} must be a non-empty 1-D array, got shape {lab.shape}")
  if lab.dtype != bool:
    if not np.all((lab == 0) | (lab == 1)):
      raise ValueError(f"{name} must be boolean or 0/1")
    lab = lab.astype(bool)
  return lab


# ----------------------------------------------------------------------------- ROC


def _average_ranks(x: np.ndarray) -> np.ndarray:
  """Ranks 1..n, tied values getting their average rank."""
  order = np.argsort(x, kind="mergesort")
  xs = x[order]
  ranks = np.empty(len(x), np.float64)
  starts = np.r_[0, np.flatnonzero(np.diff(xs)) + 1]
  ends = np.r_[starts[1:], len(x)]
  for s, e in zip(starts, ends):
    ranks[order[s:e]] = 0.5 * (s + 1 + e)
  return ranks


def roc_auc(scores, labels) -> float:
  """Area under the ROC curve: P(score of a positive > score of a negative), ties 1/2.

  Args:
    scores: [n] real scores (higher = more likely positive); finite.
    labels: [n] booleans (or 0/1).

  Raises:
    ValueError: shapes differ, non-finite scores, or only one class present.
  """
  s = _vec(scores, "scores")
  lab = _labels(labels)
  _same_len(scores=s, labels=lab)
  if not np.all(np.isfinite(s)):
    raise ValueError("scores must be finite")
  n1 = int(lab.sum())
  n0 = len(lab) - n1
  if n1 == 0 or n0 == 0:
    raise ValueError(f"labels must contain both classes, got {n1} positives and {n0} negatives")
  ranks = _average_ranks(s)
  return float((ranks[lab].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


class RocCurve(NamedTuple):
  fpr: np.ndarray
  tpr: np.ndarray
  thresholds: np.ndarray  # predict positive when score >= threshold; first is +inf


def roc_curve(scores, labels) -> RocCurve:
  """ROC points at every distinct score, from (0, 0) to (1, 1); errors as :func:`roc_auc`.

  The trapezoid area under ``(fpr, tpr)`` equals :func:`roc_auc`.
  """
  s = _vec(scores, "scores")
  lab = _labels(labels)
  _same_len(scores=s, labels=lab)
  if not np.all(np.isfinite(s)):
    raise ValueError("scores must be finite")
  n1 = int(lab.sum())
  n0 = len(lab) - n1
  if n1 == 0 or n0 == 0:
    raise ValueError(f"labels must contain both classes, got {n1} positives and {n0} negatives")
  order = np.argsort(-s, kind="mergesort")
  ss, ll = s[order], lab[order]
  last = np.r_[np.flatnonzero(np.diff(ss)), len(ss) - 1]  # last index of each tie group
  tp = np.cumsum(ll)[last]
  fp = np.cumsum(~ll)[last]
  return RocCurve(np.r_[0.0, fp / n0], np.r_[0.0, tp / n1], np.r_[np.inf, ss[last]])


def failure_auc(score, evicted_correct) -> float:
  """AUC of ``score`` (higher = more suspicious) for predicting that the evicted run is
  wrong (label = ``not evicted_correct``)."""
  return roc_auc(score, ~_labels(evicted_correct, "evicted_correct"))


def attribution_auc(score, full_correct, evicted_correct) -> float:
  """AUC of ``score`` for separating cache-induced from inherent failures.

  Only the evicted run's failures count (``evicted_correct`` false). Positive:
  cache-induced (the full cache is correct); negative: inherent (the full
  cache is wrong too). Examples the evicted run gets right are left out.
  """
  s = _vec(score, "score")
  full = _labels(full_correct, "full_correct")
  ev = _labels(evicted_correct, "evicted_correct")
  _same_len(score=s, full_correct=full, evicted_correct=ev)
  fail = ~ev
  return roc_auc(s[fail], full[fail])


def stratified_auc(scores, labels, strata) -> float:
  """AUC over (positive, negative) pairs drawn from the same stratum only, ties 1/2.

  Equals the mean of the per-stratum AUCs weighted by each stratum's
  ``n_pos * n_neg``; strata with one class contribute no pair. Use it where
  the pooled AUC could be earned by telling strata apart (e.g. one task whose
  failures are all inherent, another whose failures are all cache-induced).

  Raises:
    ValueError: as :func:`roc_auc`, or when no stratum holds both classes.
  """
  s = _vec(scores, "scores")
  lab = _labels(labels)
  g = np.asarray(strata)
  _same_len(scores=s, labels=lab, strata=g)
  if not np.all(np.isfinite(s)):
    raise ValueError("scores must be finite")
  total, pairs = 0.0, 0
  for u in np.unique(g):
    idx = g == u
    n1 = int(lab[idx].sum())
    n0 = int(idx.sum()) - n1
    if n1 and n0:
      total += roc_auc(s[idx], lab[idx]) * n1 * n0
      pairs += n1 * n0
  if not pairs:
    raise ValueError("strata: no stratum contains both classes")
  return total / pairs


def stratified_attribution_auc(score, full_correct, evicted_correct, strata) -> float:
  """:func:`attribution_auc` over pairs of failures from the same stratum."""
  s = _vec(score, "score")
  full = _labels(full_correct, "full_correct")
  ev = _labels(evicted_correct, "evicted_correct")
  g = np.asarray(strata)
  _same_len(score=s, full_correct=full, evicted_correct=ev, strata=g)
  fail = ~ev
  return stratified_auc(s[fail], full[fail], g[fail])


# ----------------------------------------------------------------------------- intervals


class Interval(NamedTuple):
  estimate: float
  lo: float
  hi: float


def _check_boot(n_boot, seed, alpha):
  if not isinstance(n_boot, int) or n_boot < 10:
    raise ValueError(f"n_boot must be an int >= 10, got {n_boot!r}")
  if not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed must be an int, got {seed!r}")
  _check_alpha(alpha)


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
  _check_alpha(alpha)
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


# ----------------------------------------------------------------------------- certificate


def radius_bernstein(var_hat, range_hat, delta, form: str = "bernstein") -> np.ndarray:
  """numpy twin of ``certkv_jax.certificate.radius_from_stats``:
  ``sqrt(2 V L) + (2/3) b L``, ``L = log(2/delta)``; ``form="chebyshev"``:
  ``sqrt(V/delta)``."""
  if not 0.0 < delta < 1.0:
    raise ValueError(f"delta must be in (0, 1), got {delta!r}")
  v = np.asarray(var_hat, np.float64)
  if form == "chebyshev":
    return np.sqrt(v / delta)
  if form != "bernstein":
    raise ValueError(f"form must be 'bernstein' or 'chebyshev', got {form!r}")
  log_term = math.log(2.0 / delta)
  return np.sqrt(2.0 * v * log_term) + (2.0 / 3.0) * np.asarray(range_hat, np.float64) * log_term


class CoverageCurve(NamedTuple):
  nominal: np.ndarray  # 1 - delta
  empirical: np.ndarray
  lo: np.ndarray  # Wilson interval of the empirical coverage
  hi: np.ndarray
  n: int


def coverage_curve(errors, deltas: Sequence[float], *,
                   radii_fn: Optional[Callable[[float], np.ndarray]] = None,
                   var_hat=None, range_hat=None, form: str = "bernstein",
                   alpha: float = 0.05) -> CoverageCurve:
  """Empirical coverage ``mean(error <= radius(delta))`` against nominal ``1 - delta``.

  Give either ``radii_fn(delta) -> radii`` (shape of ``errors``) or the
  certificate statistics ``var_hat`` and ``range_hat`` (then the radius is
  :func:`radius_bernstein`). Each point carries a Wilson interval at
  ``alpha``; calls are treated as independent (use
  :func:`cluster_bootstrap_ci` when they are not).
  """
  e = np.asarray(errors, np.float64).ravel()
  if e.size == 0:
    raise ValueError("errors must be non-empty")
  ds = np.asarray(deltas, np.float64).ravel()
  if ds.size == 0 or np.any(~(ds > 0)) or np.any(~(ds < 1)):
    raise ValueError(f"deltas must be non-empty, each in (0, 1), got {list(ds)}")
  if (radii_fn is None) == (var_hat is None):
    raise ValueError("pass exactly one of radii_fn or var_hat (with range_hat)")
  if var_hat is not None and range_hat is None and form == "bernstein":
    raise ValueError("range_hat is required with var_hat for form='bernstein'")
  emp, lo, hi = [], [], []
  for d in ds:
    if radii_fn is not None:
      r = np.asarray(radii_fn(float(d)), np.float64).ravel()
    else:
      r = radius_bernstein(var_hat, 0.0 if range_hat is None else range_hat, float(d),
                           form).ravel()
    if r.shape != e.shape:
      raise ValueError(f"radii have {r.size} entries for {e.size} errors")
    k = int(np.sum(e <= r))
    emp.append(k / e.size)
    a, b = wilson_interval(k, e.size, alpha)
    lo.append(a)
    hi.append(b)
  return CoverageCurve(1.0 - ds, np.array(emp), np.array(lo), np.array(hi), int(e.size))


class BinnedCoverage(NamedTuple):
  edges: np.ndarray  # [n_bins + 1]
  count: np.ndarray  # [n_bins]
  coverage: np.ndarray  # NaN for an empty bin
  lo: np.ndarray  # Wilson interval (NaN for an empty bin)
  hi: np.ndarray


def coverage_by_bins(errors, radii, R, bins: Union[int, Sequence[float]] = 5, *,
                     alpha: float = 0.05) -> BinnedCoverage:
  """Coverage as a function of the Assumption-2 ratio ``R`` (SPEC section 6).

  Args:
    errors, radii, R: [n] per-call true errors, radii and ratios.
    bins: an int >= 1 (bins with equal counts, at quantiles of ``R``) or
      increasing edges (values outside them are left out). A bin is
      ``[lo, hi)``, the last one ``[lo, hi]``.
    alpha: Wilson interval level.
  """
  e, r, rr = (np.asarray(x, np.float64).ravel() for x in (errors, radii, R))
  if e.size == 0 or not e.shape == r.shape == rr.shape:
    raise ValueError(f"errors, radii, R must be equal non-empty sizes, got {e.size}, {r.size}, "
                     f"{rr.size}")
  if isinstance(bins, (int, np.integer)):
    if bins < 1:
      raise ValueError(f"bins must be an int >= 1 or increasing edges, got {bins!r}")
    edges = np.quantile(rr, np.linspace(0.0, 1.0, int(bins) + 1))
  else:
    edges = np.asarray(bins, np.float64)
    if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
      raise ValueError(f"bins must be an int >= 1 or >= 2 increasing edges, got {bins!r}")
  nb = len(edges) - 1
  which = np.searchsorted(edges, rr, side="right") - 1
  which[rr == edges[-1]] = nb - 1
  count = np.zeros(nb, np.int64)
  cov, lo, hi = (np.full(nb, np.nan) for _ in range(3))
  for i in range(nb):
    sel = which == i
    count[i] = int(sel.sum())
    if count[i]:
      k = int(np.sum(e[sel] <= r[sel]))
      cov[i] = k / count[i]
      lo[i], hi[i] = wilson_interval(k, int(count[i]), alpha)
  return BinnedCoverage(edges, count, cov, lo, hi)


def sharpness(errors, radii) -> float:
  """Median of ``radius / error`` over covered calls with a positive error (NaN if none):
  how loose the covering radii are (1 = tight)."""
  e, r = np.asarray(errors, np.float64).ravel(), np.asarray(radii, np.float64).ravel()
  if e.shape != r.shape or e.size == 0:
    raise ValueError(f"errors and radii must be equal non-empty sizes, got {e.size}, {r.size}")
  sel = (e <= r) & (e > 0)
  return float(np.median(r[sel] / e[sel])) if sel.any() else float("nan")


class LogRRegression(NamedTuple):
  coef: np.ndarray  # [intercept, slope on log m, slope on n_tail]
  se: np.ndarray  # their OLS standard errors
  r_squared: float
  sigma: float  # residual standard deviation (n - 3 degrees of freedom)
  n: int

  @property
  def names(self) -> tuple[str, str, str]:
    return ("intercept", "log_m", "n_tail")


def log_r_regression(R, m, n_tail) -> LogRRegression:
  """OLS of ``log R`` on ``[1, log m, n_tail]`` with classical standard errors.

  Calls with ``R <= 0``, non-finite ``R`` or ``m <= 0`` are left out.
  ``se = sqrt(diag(sigma^2 (X'X)^-1))``, ``sigma^2 = RSS / (n - 3)``.

  Raises:
    ValueError: unequal sizes, fewer than 4 usable calls, or a rank-deficient
      design (``log m`` or ``n_tail`` constant or collinear).
  """
  r, mm, nt = (np.asarray(x, np.float64).ravel() for x in (R, m, n_tail))
  if not r.shape == mm.shape == nt.shape:
    raise ValueError(f"R, m, n_tail must have equal sizes, got {r.size}, {mm.size}, {nt.size}")
  ok = np.isfinite(r) & (r > 0) & (mm > 0) & np.isfinite(nt)
  n = int(ok.sum())
  if n < 4:
    raise ValueError(f"need >= 4 calls with finite R > 0 and m > 0, got {n}")
  y = np.log(r[ok])
  x = np.stack([np.ones(n), np.log(mm[ok]), nt[ok]], axis=1)
  coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
  if rank < 3:
    raise ValueError("the design [1, log m, n_tail] is rank-deficient (is log m or n_tail "
                     "constant, or are they collinear?)")
  resid = y - x @ coef
  rss = float(resid @ resid)
  sigma2 = rss / (n - 3)
  se = np.sqrt(np.diag(sigma2 * np.linalg.inv(x.T @ x)))
  ss_tot = float(np.sum((y - y.mean()) ** 2))
  r2 = 1.0 - rss / ss_tot if ss_tot > 0 else float("nan")
  return LogRRegression(coef, se, r2, math.sqrt(sigma2), n)


# ----------------------------------------------------------------------------- gating


def gain_from_correct(full_correct, evicted_correct) -> np.ndarray:
  """``gain_i = correct_full_i - correct_evicted_i`` in {-1, 0, 1}: what recomputing example
  ``i`` with the full cache changes. -1 (evicted right, full wrong) is a loss."""
  full = _labels(full_correct, "full_correct")
  ev = _labels(evicted_correct, "evicted_correct")
  _same_len(full_correct=full, evicted_correct=ev)
  return full.astype(np.float64) - ev.astype(np.float64)


def _n_recompute(budget: float, n: int) -> int:
  return int(math.floor(budget * n + 1e-9))


def _check_budgets(budgets) -> np.ndarray:
  b = np.asarray(budgets, np.float64).ravel()
  if b.size == 0 or np.any(~(b >= 0)) or np.any(~(b <= 1)):
    raise ValueError(f"budgets must be non-empty, each in [0, 1], got {list(b)}")
  return b


def _topk_gain(gain: np.ndarray, score: np.ndarray, k: int) -> float:
  """Expected gain of recomputing the top-``k`` by score, ties broken uniformly at random."""
  if k == 0:
    return 0.0
  order = np.argsort(-score, kind="mergesort")
  threshold = score[order[k - 1]]
  above = score > threshold
  tied = score == threshold
  slots = k - int(above.sum())
  return float(gain[above].sum() + slots * gain[tied].mean())


def gating_curve(gain, score, budgets, *, seed: int = 0, n_draws: int = 0) -> np.ndarray:
  """Fraction of the oracle's recoverable gain captured at each recompute budget.

  A budget ``b`` in [0, 1] recomputes ``k = floor(b n)`` examples with the
  full cache. The oracle's recoverable gain is ``sum(max(gain, 0))`` (the
  gain of recomputing exactly the positive-gain examples); the result is
  ``captured / recoverable`` (NaN if nothing is recoverable).

  Args:
    gain: [n] per-example gain, e.g. :func:`gain_from_correct` (may be
      negative: recomputing such an example loses a correct answer).
    score: how the ``k`` examples are chosen:
      * an [n] array: the ``k`` highest scores (certificate radius, or
        confidence = negative mean log-probability, ...); ties at the cut are
        broken uniformly at random, in expectation (exact, deterministic);
      * ``"oracle"``: the best choice of at most ``k`` (the positive gains,
        largest first; it never recomputes a harmful example), reaching 1.0
        at ``b = (number of positive gains) / n``;
      * ``"random"``: ``k`` uniformly random examples: the exact expectation
        ``k/n * sum(gain)`` when ``n_draws == 0``, else the mean over
        ``n_draws`` seeded draws.
    budgets: recompute fractions in [0, 1].
    seed: seed of the random draws (``score="random"``, ``n_draws > 0``).
    n_draws: see ``"random"``.

  Returns:
    [len(budgets)] fractions of the recoverable gain.
  """
  g = _vec(gain, "gain")
  if not np.all(np.isfinite(g)):
    raise ValueError("gain must be finite")
  b = _check_budgets(budgets)
  n = len(g)
  if not isinstance(n_draws, int) or n_draws < 0:
    raise ValueError(f"n_draws must be an int >= 0, got {n_draws!r}")
  recoverable = float(np.maximum(g, 0.0).sum())
  ks = [_n_recompute(x, n) for x in b]
  if isinstance(score, str):
    if score == "oracle":
      pos = np.sort(g[g > 0])[::-1]
      captured = [float(pos[:k].sum()) for k in ks]
    elif score == "random":
      if n_draws == 0:
        captured = [k / n * float(g.sum()) for k in ks]
      else:
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(n) for _ in range(n_draws)]
        captured = [float(np.mean([g[p[:k]].sum() for p in perms])) for k in ks]
    else:
      raise ValueError(f"score must be an array, 'oracle' or 'random', got {score!r}")
  else:
    s = _vec(score, "score")
    _same_len(gain=g, score=s)
    if not np.all(np.isfinite(s)):
      raise ValueError("score must be finite")
    captured = [_topk_gain(g, s, k) for k in ks]
  if recoverable == 0:
    return np.full(len(b), np.nan)
  return np.asarray(captured) / recoverable


def gain_captured_ratio(gain, score, budgets) -> np.ndarray:
  """Gain captured by ``score`` gating over that of random gating (exact expectation) at
  each budget: the paper's "1.7-1.8x random". NaN where random captures <= 0 (a ratio to a
  non-positive gain is meaningless) or nothing is recoverable."""
  ours = gating_curve(gain, score, budgets)
  rand = gating_curve(gain, "random", budgets)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(rand > 0, ours / np.where(rand > 0, rand, 1.0), np.nan)


# ----------------------------------------------------------------------------- verdict

VERDICTS = ("reproduced", "not reproduced", "refuted")
DIRECTIONS = ("higher", "lower", "two_sided")


def verdict(paper_range: Sequence[float], ours_ci: Sequence[float],
            direction: str = "two_sided") -> str:
  """Our interval against a paper's claimed range.

  Rule: ``"reproduced"`` if the intervals overlap. Otherwise ``"refuted"``
  if ours lies entirely on the side that contradicts the claim, else ``"not
  reproduced"`` (ours is disjoint on the side the claim does not rule out,
  e.g. better than claimed). ``direction`` says which side contradicts:
  ``"higher"`` (the claim is "at least about this", e.g. coverage or AUC:
  below refutes), ``"lower"`` (e.g. an overhead: above refutes),
  ``"two_sided"`` (either side refutes, so "not reproduced" never occurs).

  Args:
    paper_range: ``(lo, hi)`` (a point claim: ``(x, x)``).
    ours_ci: ``(lo, hi)`` or ``(estimate, lo, hi)`` (e.g. an :class:`Interval`).
    direction: one of :data:`DIRECTIONS`.
  """
  if direction not in DIRECTIONS:
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
  p = [float(x) for x in paper_range]
  c = [float(x) for x in ours_ci]
  if len(p) != 2 or not p[0] <= p[1]:
    raise ValueError(f"paper_range must be (lo, hi) with lo <= hi, got {paper_range!r}")
  if len(c) == 3:
    c = c[1:]
  if len(c) != 2 or not c[0] <= c[1] or not all(map(math.isfinite, c + p)):
    raise ValueError(f"ours_ci must be finite (lo, hi) or (estimate, lo, hi) with lo <= hi, "
                     f"got {ours_ci!r}")
  if c[1] >= p[0] and c[0] <= p[1]:
    return "reproduced"
  below = c[1] < p[0]
  if direction == "two_sided" or (direction == "higher") == below:
    return "refuted"
  return "not reproduced"
