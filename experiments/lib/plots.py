"""Figures of the experiment suite (matplotlib, Agg backend), written atomically as PNG.

Every function draws one figure and writes it to ``path`` through a
temporary file in the same directory and ``os.replace``, so a killed run
leaves the old figure or the new one, never a torn file. Each returns
``path``.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from experiments.lib import results_io  # pylint: disable=g-import-not-at-top,wrong-import-position

DPI = 110


def _save(fig, path: str) -> str:
  try:
    if not str(path).endswith(".png"):
      raise ValueError(f"path must end with .png, got {path!r}")
    results_io.atomic_write(
        path, lambda f: fig.savefig(f, format="png", dpi=DPI, bbox_inches="tight"),
        binary=True)
  finally:
    plt.close(fig)
  return path


def _nonempty(mapping: Mapping, name: str):
  if not mapping:
    raise ValueError(f"{name} must be a non-empty dict")


def plot_coverage(nominal: Sequence[float], empirical: Mapping[str, Sequence[float]], path: str,
                  *, intervals: Optional[Mapping[str, tuple]] = None,
                  title: str = "Certificate coverage") -> str:
  """Empirical vs nominal coverage, one line per design, with the diagonal.

  Args:
    nominal: [k] nominal coverages ``1 - delta``.
    empirical: design name -> [k] empirical coverages.
    path: the PNG to write.
    intervals: optional design name -> ``(lo [k], hi [k])`` band (e.g. Wilson).
    title: figure title.
  """
  _nonempty(empirical, "empirical")
  x = np.asarray(nominal, np.float64)
  fig, ax = plt.subplots(figsize=(5, 4))
  lo_lim = min(float(x.min()), min(float(np.nanmin(v)) for v in empirical.values()))
  ax.plot([lo_lim, 1], [lo_lim, 1], "k--", lw=1, label="nominal")
  for name, y in empirical.items():
    y = np.asarray(y, np.float64)
    if y.shape != x.shape:
      raise ValueError(f"empirical[{name!r}] has shape {y.shape}, nominal {x.shape}")
    ax.plot(x, y, "o-", label=name)
    if intervals and name in intervals:
      ax.fill_between(x, intervals[name][0], intervals[name][1], alpha=0.2)
  ax.set_xlabel("nominal coverage 1 - delta")
  ax.set_ylabel("empirical coverage")
  ax.set_title(title)
  ax.legend(fontsize=8)
  return _save(fig, path)


def plot_error_vs_radius(err, radius, path: str, *, title: str = "True error vs radius") -> str:
  """Log-log scatter of per-call true error against the certificate radius, with y = x
  (points below the line are covered). Non-positive values are left out."""
  e, r = np.asarray(err, np.float64).ravel(), np.asarray(radius, np.float64).ravel()
  if e.shape != r.shape or e.size == 0:
    raise ValueError(f"err and radius must be equal non-empty sizes, got {e.size}, {r.size}")
  ok = (e > 0) & (r > 0) & np.isfinite(e) & np.isfinite(r)
  fig, ax = plt.subplots(figsize=(5, 4))
  if ok.any():
    covered = e[ok] <= r[ok]
    ax.scatter(r[ok][covered], e[ok][covered], s=6, alpha=0.5, label="covered")
    ax.scatter(r[ok][~covered], e[ok][~covered], s=6, alpha=0.7, c="C3", label="missed")
    lo, hi = min(e[ok].min(), r[ok].min()), max(e[ok].max(), r[ok].max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="error = radius")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
  ax.set_xlabel("radius")
  ax.set_ylabel("true error ||o_hat - o||")
  ax.set_title(f"{title} ({int(ok.sum())} calls)")
  return _save(fig, path)


def plot_r_audit(R, covered, path: str, *, bins: int = 10,
                 title: str = "Assumption-2 audit") -> str:
  """Histogram of ``log10 R`` (left) and coverage in equal-count ``R`` bins (right)."""
  rr = np.asarray(R, np.float64).ravel()
  cov = np.asarray(covered, bool).ravel()
  if rr.shape != cov.shape or rr.size == 0:
    raise ValueError(f"R and covered must be equal non-empty sizes, got {rr.size}, {cov.size}")
  if not isinstance(bins, int) or bins < 1:
    raise ValueError(f"bins must be an int >= 1, got {bins!r}")
  ok = np.isfinite(rr) & (rr > 0)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
  if ok.any():
    lr = np.log10(rr[ok])
    ax1.hist(lr, bins=30)
    edges = np.unique(np.quantile(lr, np.linspace(0, 1, bins + 1)))
    if len(edges) >= 2:
      which = np.clip(np.searchsorted(edges, lr, side="right") - 1, 0, len(edges) - 2)
      centres, vals = [], []
      for i in range(len(edges) - 1):
        sel = which == i
        if sel.any():
          centres.append(np.median(lr[sel]))
          vals.append(cov[ok][sel].mean())
      ax2.plot(centres, vals, "o-")
  ax1.set_xlabel("log10 R")
  ax1.set_ylabel("calls")
  ax2.set_xlabel("log10 R (bin median)")
  ax2.set_ylabel("coverage")
  ax2.set_ylim(-0.02, 1.02)
  fig.suptitle(title)
  return _save(fig, path)


def plot_roc(curves: Mapping[str, tuple], path: str, *, title: str = "ROC") -> str:
  """ROC curves: name -> ``(fpr, tpr)`` or ``(fpr, tpr, auc)`` (the AUC goes in the legend;
  ``stats.RocCurve`` works, its thresholds are ignored unless passed as a third value)."""
  _nonempty(curves, "curves")
  fig, ax = plt.subplots(figsize=(4.5, 4.5))
  ax.plot([0, 1], [0, 1], "k:", lw=1)
  for name, c in curves.items():
    fpr, tpr = np.asarray(c[0]), np.asarray(c[1])
    label = name
    if len(c) > 2 and np.ndim(c[2]) == 0:
      label = f"{name} (AUC {float(c[2]):.3f})"
    ax.plot(fpr, tpr, label=label)
  ax.set_xlabel("false positive rate")
  ax.set_ylabel("true positive rate")
  ax.set_title(title)
  ax.legend(fontsize=8, loc="lower right")
  return _save(fig, path)


def plot_gating(curves: Mapping[str, tuple], path: str, *,
                title: str = "Gated recomputation") -> str:
  """Fraction of the oracle's gain vs recompute budget: name -> ``(budgets, fractions)``."""
  _nonempty(curves, "curves")
  fig, ax = plt.subplots(figsize=(5, 4))
  for name, (b, f) in curves.items():
    ax.plot(np.asarray(b), np.asarray(f), "o-", label=name)
  ax.set_xlabel("recompute budget (fraction of examples)")
  ax.set_ylabel("fraction of the oracle's gain")
  ax.set_title(title)
  ax.legend(fontsize=8)
  return _save(fig, path)


def plot_overhead(bars: Mapping[str, float], path: str, *, ylabel: str = "ms per decode step",
                  errors: Optional[Mapping[str, float]] = None,
                  title: str = "Overhead") -> str:
  """Bar chart: name -> value (e.g. time per decode step), optional error bars."""
  _nonempty(bars, "bars")
  names = list(bars)
  vals = [float(bars[k]) for k in names]
  err = [float(errors.get(k, 0.0)) for k in names] if errors else None
  fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(names) + 1.5), 3.8))
  ax.bar(range(len(names)), vals, yerr=err, capsize=3)
  ax.set_xticks(range(len(names)))
  ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  return _save(fig, path)


def plot_panels(panels: Mapping[str, Mapping[str, tuple]], path: str, *, xlabel: str,
                ylabel: str, title: str = "", logx: bool = False, logy: bool = False) -> str:
  """Side-by-side panels of lines sharing the y axis (e.g. time vs context per budget).

  Args:
    panels: panel title -> {line name -> ``(xs, ys)`` or ``(xs, ys, (lo, hi))``}, the
      optional ``lo``/``hi`` drawn as a band.
    path: the PNG to write.
    xlabel, ylabel, title: labels; ``title`` above the figure.
    logx, logy: logarithmic axes (base 2 for x).
  """
  _nonempty(panels, "panels")
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), sharey=True,
                           squeeze=False)
  for ax, (name, lines) in zip(axes[0], panels.items()):
    _nonempty(lines, f"panels[{name!r}]")
    for label, (xs, ys, *band) in lines.items():
      style = "ks--" if label == "full" else "o-"
      line, = ax.plot(xs, ys, style, label=label, lw=1.2, ms=3)
      if band:
        ax.fill_between(xs, band[0][0], band[0][1], color=line.get_color(), alpha=0.15)
    if logx:
      ax.set_xscale("log", base=2)
    if logy:
      ax.set_yscale("log")
    ax.set_title(name)
    ax.set_xlabel(xlabel)
  axes[0][0].set_ylabel(ylabel)
  axes[0][-1].legend(fontsize=7)
  if title:
    fig.suptitle(title, y=1.02, fontsize=9)
  return _save(fig, path)
