"""Analysis of the validity study: cells, warning signals, summary.json, report.md.

A *cell* is one (design, radius, budget, regime, data, context length):
coverage of the true error by the radius at every delta, a cluster-bootstrap
interval at the primary delta (examples resampled: the calls of one example
are dependent), the sharpness (median ``r / ||e||`` over covered calls with a
positive error, method, section 5), the median tail size ``m`` and the median
Assumption-2 ratio ``R`` (method, section 6). ``radius`` is "raw" (the
Bernstein certificate) or "calibrated" (split-conformal scales, method,
section 10), or "smoothed" (the raw radius with ``V_hat`` smoothed over each
head's last 6 decode steps, method, section 5; uncalibrated); a calibrated
cell is ``held_out`` when its data source was not among those its calibration
was fitted on.

Warning signals (method, section 10) are scored as predictors of a raw miss
at the primary delta: AUC with a cluster-bootstrap interval, oriented before
looking at the data (a small effective sample size, a large single tail
weight, a large range ratio, a low entropy, a large observed ratio, a large
sampled tail mass all point to a miss), next to the tail size ``m`` as the
baseline every signal must beat.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import numpy as np

from experiments.lib import plots
from experiments.lib import results_io
from experiments.lib import stats
from experiments.lib.validity import calls as calls_lib

N_BOOT = 400
TARGET = 0.95  # coverage the default certified setting must reach at delta 0.05
# signal -> sign that makes "larger = more likely a miss" (fixed a priori).
SIGNALS = {"ess": -1.0, "max_tail_weight": 1.0, "range_ratio": 1.0, "entropy": -1.0,
           "r_hat": 1.0, "tail_mass": 1.0}
BASELINE_SIGNAL = ("tail size m (smaller = miss)", "tail_m", -1.0)


def cluster_ratio_ci(hits, clusters, *, n_boot: int = N_BOOT, seed: int = 0,
                     alpha: float = 0.05) -> list:
  """Percentile interval of ``mean(hits)`` resampling whole clusters (vectorised)."""
  hits = np.asarray(hits, np.float64)
  _, inv = np.unique(clusters, return_inverse=True)
  k = inv.max() + 1
  s = np.bincount(inv, weights=hits, minlength=k)
  n = np.bincount(inv, minlength=k).astype(np.float64)
  if k < 2:
    return [float("nan"), float("nan")]
  rng = np.random.default_rng(seed)
  pick = rng.integers(0, k, size=(n_boot, k))
  boot = s[pick].sum(axis=1) / n[pick].sum(axis=1)
  return [float(np.quantile(boot, alpha / 2)), float(np.quantile(boot, 1 - alpha / 2))]


def _median(x) -> Optional[float]:
  x = np.asarray(x, np.float64)
  x = x[np.isfinite(x)]
  return float(np.median(x)) if x.size else None


def cell(calls: calls_lib.Calls, radii_by_delta: dict, where: dict, *, radius, held_out,
         calibrated_on=None) -> dict:
  """One cell's figures (``radii_by_delta``: delta -> radius of every call of ``calls``;
  ``where``: the cell's design, budget, regime, data and context_len)."""
  design, budget, regime, data, context_len = (
      where[k] for k in ("design", "budget", "regime", "data", "context_len"))
  e = calls["true_error"]
  r05 = radii_by_delta[calls_lib.PRIMARY_DELTA]
  covered = e <= r05
  tail = calls["ratio"] > 0
  out = dict(design=design, radius=radius, budget=float(budget), regime=regime, data=data,
             held_out=bool(held_out), context_len=int(context_len), n_calls=int(len(e)),
             n_examples=int(len(np.unique(calls["cluster"]))),
             coverage={str(d): float(np.mean(e <= r)) for d, r in radii_by_delta.items()},
             coverage_ci={str(calls_lib.PRIMARY_DELTA): cluster_ratio_ci(covered,
                                                                         calls["cluster"])},
             sharpness=stats.sharpness(e, r05) if np.any(covered & (e > 0)) else None,
             m_median=_median(calls["tail_m"][tail]), R_median=_median(calls["ratio"][tail]),
             accuracy=float(np.mean(calls["correct"])))
  if calibrated_on is not None:
    out["calibrated_on"] = list(calibrated_on)
  return out


def _folds(data_sources: Sequence[str]) -> list[tuple[tuple, tuple]]:
  """(calibration data, held-out data): text vs the tasks, both ways."""
  text = tuple(x for x in data_sources if x == "text")
  tasks = tuple(x for x in data_sources if x != "text")
  return [(text, tasks), (tasks, text)] if text and tasks else []


# Calibration schemes scored side by side (method, section 10). "calibrated" is the
# default: the source-robust radius-binned scales, each data source scored by the
# calibration fitted on all the OTHER sources (leave-one-source-out).
SCHEMES = ("calibrated", "binned_text_fold", "per_head_text_fold")


def _with_calls(dcalls, sources, calib_context) -> tuple:
  """The ``sources`` that have calls at ``calib_context``: what a fit on them was fitted on
  (a label naming the others would claim sources the fit never had)."""
  return tuple(x for x in sources if np.any(dcalls.where(data=x, context_len=calib_context)))


def scheme_radii(dcalls, design, sources, calib_context, budgets, deltas):
  """scheme -> (delta -> radius of every call (NaN where the scheme has no held-out
  calibration for it), calibrated_on label per call, fitted calibrations)."""
  out = {}
  n = len(dcalls)
  # Default: leave one source out.
  radii = {d: np.full(n, np.nan) for d in deltas}
  label = np.full(n, "", dtype=object)
  fitted = {}
  if len(sources) > 1:
    for src in sources:
      others = tuple(x for x in sources if x != src)
      if not np.any(dcalls.where(data=others, context_len=calib_context)):
        continue
      cal = calls_lib.fit_binned(dcalls, design=design, data=others, context_len=calib_context,
                                 budgets=budgets, deltas=deltas)
      used = _with_calls(dcalls, others, calib_context)
      fitted[used] = cal
      m = dcalls.where(data=src)
      sub = dcalls.select(m)
      for d in deltas:
        radii[d][m] = calls_lib.binned_radii(sub, cal, d, budgets)
      label[m] = "+".join(used)
  out["calibrated"] = (radii, label, fitted)
  for scheme in ("binned_text_fold", "per_head_text_fold"):
    radii = {d: np.full(n, np.nan) for d in deltas}
    label = np.full(n, "", dtype=object)
    fitted = {}
    for fit_on, held in _folds(sources):
      if not np.any(dcalls.where(data=fit_on, context_len=calib_context)):
        continue
      m = dcalls.where(data=held)
      sub = dcalls.select(m)
      if scheme == "binned_text_fold":
        cal = calls_lib.fit_binned(dcalls, design=design, data=fit_on,
                                   context_len=calib_context, budgets=budgets, deltas=deltas)
        for d in deltas:
          radii[d][m] = calls_lib.binned_radii(sub, cal, d, budgets)
      else:
        cal = calls_lib.fit_fold(dcalls, design=design, data=fit_on, context_len=calib_context,
                                 budgets=budgets, deltas=deltas)
        for d in deltas:
          radii[d][m] = calls_lib.calibrated_radii(sub, cal, d, budgets)
      used = _with_calls(dcalls, fit_on, calib_context)
      fitted[used] = cal
      label[m] = "+".join(used)
    out[scheme] = (radii, label, fitted)
  return out


def all_cells(calls: calls_lib.Calls, *, calib_context: int, budgets: Sequence[float],
              deltas: Sequence[float] = calls_lib.DELTAS) -> tuple[list, list, dict]:
  """Raw, smoothed and calibrated cells of every design.

  Returns ``(cells, alternative_cells, calibrations)``: ``cells`` hold the raw
  and the smoothed radius and the default calibration (:data:`SCHEMES`'
  first), each calibrated cell scored by a calibration that did not see its
  data source;
  ``alternative_cells`` the text-vs-tasks folds of the binned and the
  per-(layer, KV head) calibrations; ``calibrations[(design, scheme, data)]``
  every fitted artifact.
  """
  cells, alt, calibrations = [], [], {}
  sources = tuple(np.unique(calls["data"]).tolist())
  for design in np.unique(calls["design"]).tolist():
    dcalls = calls.select(calls.where(design=design))
    schemes = scheme_radii(dcalls, design, sources, calib_context, budgets, deltas)
    for scheme, (_, _, fitted) in schemes.items():
      for data, cal in fitted.items():
        calibrations[(design, scheme, data)] = cal
    raw_all = {d: calls_lib.raw_radii(dcalls, d) for d in deltas}
    smoothed_all = {d: calls_lib.smoothed_radii(dcalls, d) for d in deltas}
    keys = sorted({(float(b), str(r), str(x), int(c)) for b, r, x, c in zip(
        dcalls["budget"], dcalls["regime"], dcalls["data"], dcalls["context_len"])})
    for b, regime, data, c in keys:
      m = dcalls.where(regime=regime, data=data, context_len=c) & (
          np.abs(dcalls["budget"] - b) < 1e-6)
      sub = dcalls.select(m)
      kw = dict(design=design, budget=b, regime=regime, data=data, context_len=c)
      cells.append(cell(sub, {d: r[m] for d, r in raw_all.items()}, kw, radius="raw",
                        held_out=True))
      cells.append(cell(sub, {d: r[m] for d, r in smoothed_all.items()}, kw,
                        radius="smoothed", held_out=True))
      for scheme, (radii, label, _) in schemes.items():
        if np.isnan(radii[deltas[0]][m]).any():
          continue
        made = cell(sub, {d: r[m] for d, r in radii.items()}, kw, radius=scheme, held_out=True,
                    calibrated_on=label[m][0].split("+"))
        if scheme == "calibrated":
          cells.append(made)
        else:
          alt.append(made)
  return cells, alt, calibrations


def signal_aucs(calls: calls_lib.Calls, *, seed: int = 0) -> list[dict]:
  """AUC of each warning signal for a raw miss at the primary delta (calls with a tail)."""
  tail = calls["ratio"] > 0
  c = calls.select(tail & np.isfinite(calls["true_error"]))
  miss = (c["true_error"] > calls_lib.raw_radii(c, calls_lib.PRIMARY_DELTA)).astype(int)
  out = []
  entries = [(name, name, sign) for name, sign in SIGNALS.items() if name in c.columns]
  entries.append(BASELINE_SIGNAL)
  if miss.min() == miss.max():
    return out
  for label, col, sign in entries:
    score = sign * c[col]
    ok = np.isfinite(score)
    auc = stats.roc_auc(score[ok], miss[ok])
    ci = stats.cluster_bootstrap_ci(stats.roc_auc, score[ok], miss[ok], groups=c["cluster"][ok],
                                    n_boot=100, seed=seed)
    out.append(dict(signal=label, auc=float(auc), ci=[float(ci.lo), float(ci.hi)],
                    n_calls=int(ok.sum()), miss_rate=float(miss[ok].mean())))
  return out


def binned_coverage(calls: calls_lib.Calls, radius: np.ndarray, column: str,
                    edges: Sequence[float]) -> list[dict]:
  """Coverage at the primary delta by bins of ``column`` (tail calls only)."""
  x = calls[column]
  e = calls["true_error"]
  out = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    m = (x >= lo) & (x < hi)
    if m.any():
      out.append(dict(lo=float(lo), hi=float(hi), n=int(m.sum()),
                      coverage=float(np.mean(e[m] <= radius[m])),
                      sharpness=stats.sharpness(e[m], radius[m]) if np.any(
                          (e[m] <= radius[m]) & (e[m] > 0)) else None))
  return out


def fmt(x, spec=".3f"):
  """``x`` formatted with ``spec`` for a table; "-" when it is None or not finite."""
  return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def cells_table(cells: Sequence[dict]) -> list[str]:
  lines = ["| design | radius | ctx | regime | data | budget | n calls | cov@0.01 | cov@0.05 "
           "[95% CI] | cov@0.1 | sharpness | m med | R med |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for c in cells:
    ci = c["coverage_ci"]["0.05"]
    radius = c["radius"] + (f" ({'+'.join(c['calibrated_on'])})" if "calibrated_on" in c else "")
    lines.append(
        f"| {c['design']} | {radius} | {c['context_len']} | {c['regime']} | {c['data']} | "
        f"{c['budget']:g} | {c['n_calls']} | {fmt(c['coverage']['0.01'])} | "
        f"{fmt(c['coverage']['0.05'])} [{fmt(ci[0])}, {fmt(ci[1])}] | "
        f"{fmt(c['coverage']['0.1'])} | {fmt(c['sharpness'], '.2f')} | "
        f"{fmt(c['m_median'], '.1f')} | {fmt(c['R_median'], '.2f')} |")
  return lines


def write(out_dir: str, summary: dict, report_lines: Sequence[str]) -> None:
  results_io.atomic_write_text(os.path.join(out_dir, "summary.json"),
                               json.dumps(results_io.json_safe(summary), indent=1,
                                          sort_keys=True, allow_nan=False) + "\n")
  results_io.atomic_write_text(os.path.join(out_dir, "report.md"), "\n".join(report_lines) + "\n")


def coverage_plot(cells: Sequence[dict], design: str, path: str) -> str:
  """Nominal vs empirical coverage (mean over held-out cells) of raw and calibrated."""
  deltas = sorted(float(d) for d in cells[0]["coverage"])
  nominal = [1 - d for d in deltas]
  curves = {}
  for radius in ("raw", "calibrated"):
    sel = [c for c in cells if c["design"] == design and c["radius"] == radius and c["held_out"]]
    if sel:
      curves[f"{design} {radius}"] = [float(np.mean([c["coverage"][str(d)] for c in sel]))
                                      for d in deltas]
  return plots.plot_coverage(nominal, curves, path,
                             title=f"Coverage of the true attention error ({design})")
