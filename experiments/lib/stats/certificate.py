"""Statistics of the certificate: :func:`coverage_curve` (empirical coverage vs
nominal ``1 - delta`` with Wilson intervals), :func:`coverage_by_bins` (coverage as a
function of the Assumption-2 ratio ``R``), :func:`sharpness`,
:func:`log_r_regression` (OLS of ``log R`` with standard errors) and
:func:`radius_bernstein` (numpy twin of the library's radius)."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from experiments.lib.stats import intervals
from experiments.lib.stats import validation


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
  :func:`experiments.lib.stats.intervals.cluster_bootstrap_ci` when they are not).
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
    validation.no_nan(errors=e, radii=r)
    k = int(np.sum(e <= r))
    emp.append(k / e.size)
    a, b = intervals.wilson_interval(k, e.size, alpha)
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
  """Coverage as a function of the Assumption-2 ratio ``R`` (method, section 6).

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
  validation.no_nan(errors=e, radii=r, R=rr)
  if isinstance(bins, (int, np.integer)):
    if not np.isfinite(rr).all():  # quantile edges of an infinite R are NaN
      raise ValueError("R must be finite with bins=int (pass edges to bin infinite ratios)")
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
      lo[i], hi[i] = intervals.wilson_interval(k, int(count[i]), alpha)
  return BinnedCoverage(edges, count, cov, lo, hi)


def sharpness(errors, radii) -> float:
  """Median of ``radius / error`` over covered calls with a positive error (NaN if none):
  how loose the covering radii are (1 = tight)."""
  e, r = np.asarray(errors, np.float64).ravel(), np.asarray(radii, np.float64).ravel()
  if e.shape != r.shape or e.size == 0:
    raise ValueError(f"errors and radii must be equal non-empty sizes, got {e.size}, {r.size}")
  validation.no_nan(errors=e, radii=r)
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
