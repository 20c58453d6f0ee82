"""The validity study (``python -m experiments.validity``): where the certificate holds.

:func:`run` collects every decode call of evaluation-mode runs
(:mod:`experiments.lib.validity.collect`), fits split-conformal calibrations
on natural text and on the retrieval tasks and tests each on the other
(:mod:`experiments.lib.validity.calls`), and writes ``DIR/report.md``,
``DIR/summary.json``, plots, and the default calibration artifact
(``DIR/calibration``, fitted on text, loadable with
:func:`certkv_jax.calibration.store.load`).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import numpy as np

from certkv_jax.calibration import robust
from experiments.lib.validity import calls as calls_lib
from experiments.lib.validity import collect as collect_lib
from experiments.lib.validity import report as report_lib

ARTIFACT = "calibration"


def _summary_rows(cells, design, radius, min_context):
  sel = [c for c in cells if c["design"] == design and c["radius"] == radius
         and c["held_out"] and c["context_len"] >= min_context]
  if not sel:
    return None
  cov = [c["coverage"]["0.05"] for c in sel]
  sharp = [c["sharpness"] for c in sel if c["sharpness"] is not None]
  return dict(n_cells=len(sel), mean=float(np.mean(cov)), min=float(np.min(cov)),
              n_below=int(sum(x < report_lib.TARGET for x in cov)),
              sharpness=float(np.median(sharp)) if sharp else None,
              accuracy=float(np.mean([c["accuracy"] for c in sel if c["data"] != "text"]))
              if any(c["data"] != "text" for c in sel) else None)


def _by(calls, radius, column, values):
  e = calls["true_error"]
  out = []
  for v in values:
    m = calls[column] == v
    if m.any():
      out.append((v, int(m.sum()), float(np.mean(e[m] <= radius[m])),
                  report_lib.stats.sharpness(e[m], radius[m])
                  if np.any((e[m] <= radius[m]) & (e[m] > 0)) else None))
  return out


def _breakdowns(calls, design, budgets, calib_context, min_context, lines):
  """Coverage of ``design`` (raw and default-calibrated, every call scored by the
  calibration that left its data source out) by m, layer, head, R, regime and data."""
  dcalls = calls.select(calls.where(design=design))
  sources = tuple(np.unique(dcalls["data"]).tolist())
  radii, _, _ = report_lib.scheme_radii(
      dcalls, design, sources, calib_context, budgets,
      (calls_lib.PRIMARY_DELTA,))["calibrated"]
  keep = dcalls["context_len"] >= min_context
  c = dcalls.select(keep)
  if len(c) == 0:
    return
  raw = calls_lib.raw_radii(c, calls_lib.PRIMARY_DELTA)
  cal = radii[calls_lib.PRIMARY_DELTA][keep]
  if np.isnan(cal).any():
    cal = None
  fmt = report_lib.fmt
  lines += [f"Every call of `{design}` at contexts >= {min_context}; coverage at delta 0.05, "
            "sharpness in brackets; calibrated = the default scheme, each data source scored "
            "by the calibration fitted on the other sources.", ""]
  for column, values, title in (
      ("regime", sorted(np.unique(c["regime"]).tolist()), "regime"),
      ("data", sorted(np.unique(c["data"]).tolist()), "data"),
      ("layer", list(range(calls.n_layers)), "layer"),
      ("kv_head", list(range(calls.n_kv_heads)), "KV head")):
    rows_raw = _by(c, raw, column, values)
    rows_cal = _by(c, cal, column, values) if cal is not None else [None] * len(rows_raw)
    lines += [f"By {title}:", "", f"| {title} | n calls | raw | calibrated |",
              "| --- | --- | --- | --- |"]
    for a, b in zip(rows_raw, rows_cal):
      lines.append(f"| {a[0]} | {a[1]} | {fmt(a[2])} [{fmt(a[3], '.2f')}] | "
                   + (f"{fmt(b[2])} [{fmt(b[3], '.2f')}]" if b else "-") + " |")
    lines.append("")
  for column, edges, title in (
      ("tail_m", [0, 5, 10, 20, 50, 100, 200, 500, 1e9], "tail size m"),
      ("ratio", [0, 1, 2, 4, 8, 16, 64, 1e12], "Assumption-2 ratio R")):
    tail = c[column] > 0 if column == "ratio" else np.ones(len(c), bool)
    sub = c.select(tail)
    b_raw = report_lib.binned_coverage(sub, raw[tail], column, edges)
    b_cal = (report_lib.binned_coverage(sub, cal[tail], column, edges)
             if cal is not None else [None] * len(b_raw))
    lines += [f"By {title}:", "", f"| {title} | n calls | raw | calibrated |",
              "| --- | --- | --- | --- |"]
    for a, b in zip(b_raw, b_cal):
      lines.append(f"| [{a['lo']:g}, {a['hi']:g}) | {a['n']} | {fmt(a['coverage'])} "
                   f"[{fmt(a['sharpness'], '.2f')}] | "
                   + (f"{fmt(b['coverage'])} [{fmt(b['sharpness'], '.2f')}]" if b else "-")
                   + " |")
    lines.append("")


def analyse(paths, out_dir: str, plan: collect_lib.Plan, *, default_design: str,
            calib_context: int, log: Callable[[str], None] = print,
            seconds: Optional[float] = None) -> dict:
  """Cells, signals, the default artifact and the report from the unit files ``paths``;
  ``plan.transfer``: a calibration artifact from another study, also scored on these
  calls."""
  calls = calls_lib.load_calls(paths)
  log(f"validity: {len(calls)} calls from {len(paths)} units")
  cells, alt_cells, calibrations = report_lib.all_cells(calls, calib_context=calib_context,
                                                        budgets=plan.budgets)
  sources = tuple(np.unique(calls["data"]).tolist())
  default_calib = calls_lib.fit_binned(calls, design=default_design, data=sources,
                                       context_len=calib_context, budgets=plan.budgets)
  robust.save(os.path.join(os.path.abspath(out_dir), ARTIFACT), default_calib,
                          overwrite=True)
  long_ctx = [c for c in plan.all_context_lens if c >= 1024]
  min_context = min(long_ctx) if long_ctx else min(plan.all_context_lens)
  sig_calls = calls.select(calls.where(design=default_design) &
                           (calls["context_len"] >= min_context))
  signals = report_lib.signal_aucs(sig_calls) if len(sig_calls) else []
  designs = sorted(np.unique(calls["design"]).tolist())
  everything = cells + alt_cells
  overview = {d: {r: _summary_rows(everything, d, r, min_context)
                  for r in ("raw", "smoothed") + report_lib.SCHEMES} for d in designs}
  default_rows = overview.get(default_design, {}).get("calibrated")
  summary = dict(
      default=dict(design=default_design, radius="calibrated",
                   scheme="source-robust radius-binned split conformal "
                          "(certkv_jax.calibration.robust)",
                   calibrated_on=list(default_calib.data),
                   context_range=list(default_calib.context_range), artifact=ARTIFACT,
                   held_out_estimate="leave-one-source-out"),
      target=dict(coverage=report_lib.TARGET, delta=calls_lib.PRIMARY_DELTA,
                  min_context=min_context, max_sharpness=4.0),
      default_result=default_rows, overview=overview, cells=cells,
      alternative_cells=alt_cells, signals=signals,
      plan=dict(designs=list(plan.designs), regimes=list(plan.regimes),
                budgets=list(plan.budgets), data=list(plan.data),
                context_lens=list(plan.context_lens), num_examples=plan.num_examples,
                examples_at=[list(x) for x in plan.examples_at],
                designs_at=[[c, list(v)] for c, v in plan.designs_at],
                data_at=[[c, list(v)] for c, v in plan.data_at],
                groups_at=[[c, list(d), list(g)] for c, d, g in plan.groups_at],
                n_steps=plan.n_steps,
                seed=plan.seed, model=plan.model, calib_context=calib_context),
      calibrations=[dict(design=d, scheme=sch, data=list(k),
                         scale_median=float(np.median(c.scales[np.isfinite(c.scales)]))
                         if np.isfinite(c.scales).any() else None,
                         scale_max=float(np.max(c.scales)),
                         infinite_share=float(np.mean(np.isinf(c.scales))))
                    for (d, sch, k), c in calibrations.items()],
      seconds=seconds,
      sharpness_floor=sharpness_floor(calls, default_design, calib_context, plan.budgets),
      collection_seconds=round(sum(float(collect_lib.unit_meta(p).get("seconds", 0.0))
                                   for p in paths), 1))
  summary["by_context"] = by_context(cells)
  lines = _report_lines(summary, calls, cells, alt_cells, default_design, default_calib, plan,
                        min_context, calib_context)
  lines += ["## Coverage by context length", "",
            "Held-out cells (raw cells all count), delta 0.05, sharpness = median r / ||e|| "
            "over covered calls.", ""] + by_context_lines(summary["by_context"]) + [""]
  transfer = plan.transfer
  if transfer:
    cal = robust.load(transfer)
    t_cells = transfer_cells(calls, cal, plan.budgets)
    summary["transfer"] = dict(artifact=transfer, design=cal.design, data=list(cal.data),
                               context_range=list(cal.context_range), cells=t_cells,
                               by_context=by_context(
                                   [c for c in cells if c["design"] == cal.design
                                    and c["radius"] == "raw"] + t_cells, every=True))
    lines += ["## A calibration fitted elsewhere, applied here", "",
              f"`{transfer}`: `{cal.design}`, fitted on {', '.join(cal.data)} with prompts of "
              f"{cal.context_range[0]}-{cal.context_range[1]} tokens, scores every call of "
              f"`{cal.design}` here unchanged (radius `transferred`; a cell is held out when "
              "its data source is not among those it was fitted on, but every cell here is "
              "at a context the artifact never saw).", ""]
    lines += by_context_lines(summary["transfer"]["by_context"]) + [""]
    lines += report_lib.cells_table(t_cells) + [""]
  try:
    report_lib.coverage_plot(cells, default_design, os.path.join(out_dir, "coverage.png"))
    lines += ["![coverage](coverage.png)", ""]
  except ValueError as err:  # no held-out cell to plot
    log(f"validity: no coverage plot ({err})")
  report_lib.write(out_dir, summary, lines)
  log(f"validity: wrote {os.path.join(out_dir, 'report.md')} and summary.json")
  return summary


def transfer_cells(calls: calls_lib.Calls, cal: robust.BinnedCalibration,
                   budgets) -> list[dict]:
  """Cells of ``cal.design`` scored by a calibration fitted in another study (another
  context length, text or task set): the shift a user makes who fits once and applies
  it at longer contexts. Radius name ``"transferred"``; ``held_out`` is True for data
  sources the artifact was not fitted on."""
  dcalls = calls.select(calls.where(design=cal.design))
  if len(dcalls) == 0:
    return []
  radii = {d: calls_lib.binned_radii(dcalls, cal, d, budgets) for d in calls_lib.DELTAS}
  out = []
  for key in sorted({(int(c), r, s, float(b)) for c, r, s, b in zip(
      dcalls["context_len"], dcalls["regime"], dcalls["data"], dcalls["budget"])}):
    c, r, s, b = key
    m = ((dcalls["context_len"] == c) & (dcalls["regime"] == r) & (dcalls["data"] == s)
         & (np.abs(dcalls["budget"] - b) < 1e-6))
    if np.isnan(radii[calls_lib.PRIMARY_DELTA][m]).any():
      continue  # a regime the artifact was not made for
    out.append(report_lib.cell(
        dcalls.select(m), {d: v[m] for d, v in radii.items()},
        dict(design=cal.design, budget=b, regime=r, data=s, context_len=c),
        radius="transferred", held_out=s not in cal.data, calibrated_on=cal.data))
  return out


def by_context(cells: Sequence[dict], *, every: bool = False) -> list[dict]:
  """Mean coverage at delta 0.05, cells below target and median sharpness per (design,
  radius, context length) over the held-out cells (raw cells count as held out;
  ``every``: all cells)."""
  groups = {}
  for c in cells:
    if every or c["held_out"] or c["radius"] == "raw":
      groups.setdefault((c["design"], c["radius"], c["context_len"]), []).append(c)
  out = []
  for (d, r, ctx), sel in sorted(groups.items()):
    cov = [c["coverage"]["0.05"] for c in sel]
    sharp = [c["sharpness"] for c in sel if c["sharpness"] is not None]
    out.append(dict(design=d, radius=r, context_len=ctx, n_cells=len(sel),
                    n_calls=int(sum(c["n_calls"] for c in sel)), mean=float(np.mean(cov)),
                    min=float(np.min(cov)), n_below=int(sum(x < report_lib.TARGET for x in cov)),
                    sharpness=float(np.median(sharp)) if sharp else None))
  return out


def by_context_lines(rows: Sequence[dict]) -> list[str]:
  fmt = report_lib.fmt
  lines = ["| design | radius | context | cells | calls | mean coverage | min coverage | "
           "cells below target | median sharpness |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    lines.append(f"| {r['design']} | {r['radius']} | {r['context_len']} | {r['n_cells']} | "
                 f"{r['n_calls']} | {fmt(r['mean'])} | {fmt(r['min'])} | {r['n_below']} | "
                 f"{fmt(r['sharpness'], '.2f')} |")
  return lines


def _signal_profile(calls, design, failing, min_context) -> list[str]:
  """Median warning signals of the failing cells' calls next to all calls of ``design``."""
  names = [n for n in report_lib.SIGNALS if n in calls.columns]
  if not names:
    return []
  fmt = report_lib.fmt
  base = calls.where(design=design) & (calls["context_len"] >= min_context)
  rows = [("all calls", base)]
  for c in failing:
    m = base & calls.where(regime=c["regime"], data=c["data"], context_len=c["context_len"]) & (
        np.abs(calls["budget"] - c["budget"]) < 1e-6)
    rows.append((f"{c['regime']} / {c['data']} / {c['budget']:g} / {c['context_len']}", m))
  lines = ["| calls | " + " | ".join(names) + " | raw miss rate |",
           "| --- | " + " | ".join("---" for _ in names) + " | --- |"]
  for label, m in rows:
    miss = np.mean(calls["true_error"][m] > calls_lib.raw_radii(calls.select(m),
                                                                 calls_lib.PRIMARY_DELTA))
    lines.append(f"| {label} | " + " | ".join(fmt(float(np.median(calls[n][m])), ".3g")
                                              for n in names) + f" | {fmt(float(miss))} |")
  warn = [n for n in ("tail_mass", "r_hat") if n in names]
  if warn:
    below = [all(np.median(calls[n][m]) < np.median(calls[n][base]) for n in warn)
             for _, m in rows[1:]]
    lines += ["", f"In {sum(below)} of {len(below)} of these cells the median "
              f"{' and '.join(warn)} are below those of all calls (the signals warn); in the "
              f"other {len(below) - sum(below)} they are not, so those misses are not flagged "
              "online by these signals."]
  return lines


def _why_lines(calls, design, failing, default_calib, calib_context, budgets) -> tuple:
  """Why each failing cell misses: held-out vs in-sample coverage, and by how much the
  held-out calibrated radius would have to grow (its ``1 - delta`` quantile of
  ``||e|| / r``). Returns (markdown lines, per-cell dicts for the summary)."""
  fmt = report_lib.fmt
  delta = calls_lib.PRIMARY_DELTA
  sources = tuple(default_calib.data)
  lines = ["| cell | held-out coverage | in-sample coverage (this source calibrated too) | "
           "held-out radius must grow by | raw miss rate |", "| --- | --- | --- | --- | --- |"]
  out = []
  for c in failing:
    m = calls.where(design=design, regime=c["regime"], data=c["data"],
                    context_len=c["context_len"]) & (np.abs(calls["budget"] - c["budget"]) < 1e-6)
    m &= np.isfinite(calls["true_error"])
    cell_calls = calls.select(m)
    others = tuple(x for x in sources if x != c["data"])
    loso = calls_lib.fit_binned(calls, design=design, data=others, context_len=calib_context,
                                budgets=budgets)
    e = cell_calls["true_error"]
    r_out = calls_lib.binned_radii(cell_calls, loso, delta, budgets)
    r_in = calls_lib.binned_radii(cell_calls, default_calib, delta, budgets)
    with np.errstate(divide="ignore", invalid="ignore"):
      grow = float(np.quantile(e / r_out, 1 - delta))
    row = dict(regime=c["regime"], data=c["data"], budget=c["budget"],
               context_len=c["context_len"], held_out_coverage=float(np.mean(e <= r_out)),
               in_sample_coverage=float(np.mean(e <= r_in)), must_grow_by=grow,
               raw_miss_rate=float(np.mean(e > calls_lib.raw_radii(cell_calls, delta))),
               # the artifact saw this source at calib_context only: elsewhere a length shift
               in_sample=c["context_len"] == calib_context)
    out.append(row)
    shifted = "" if row["in_sample"] else f" (fitted at {calib_context}: a length shift)"
    lines.append(f"| {c['regime']} / {c['data']} / {c['budget']:g} / {c['context_len']} | "
                 f"{fmt(row['held_out_coverage'])} | {fmt(row['in_sample_coverage'])}"
                 f"{shifted} | x{fmt(grow, '.2f')} | {fmt(row['raw_miss_rate'])} |")
  return lines, out


def sharpness_floor(calls, design, calib_context, budgets) -> Optional[dict]:
  """What the best scale on this radius can reach: per (regime, budget, data source)
  at ``calib_context``, the default scheme fitted on that source's own calls and
  scored on the same calls (in-sample, no shift). Its median sharpness is a floor
  for any held-out calibration that rescales the raw radius by radius bin."""
  delta = calls_lib.PRIMARY_DELTA
  base = calls.where(design=design, context_len=calib_context) & np.isfinite(calls["true_error"])
  cov, sharp = [], []
  for source in np.unique(calls["data"][base]).tolist():
    src = calls.select(base & (calls["data"] == source))
    cal = calls_lib.fit_binned(src, design=design, data=(source,), context_len=calib_context,
                               budgets=budgets)
    rad = calls_lib.binned_radii(src, cal, delta, budgets)
    for regime in np.unique(src["regime"]).tolist():
      for b in budgets:
        m = (src["regime"] == regime) & (np.abs(src["budget"] - b) < 1e-6)
        if not m.any():
          continue
        e, r = src["true_error"][m], rad[m]
        hit = e <= r
        cov.append(float(np.mean(hit)))
        pos = hit & (e > 0)  # sharpness over covered calls with an error, as stats.sharpness
        if pos.any():
          sharp.append(float(np.median(r[pos] / e[pos])))
  if not cov:
    return None
  sharp = sharp or [float("nan")]  # no covered call with an error in any cell
  return dict(cells=len(cov), coverage_mean=float(np.mean(cov)),
              sharpness_median=float(np.median(sharp)), sharpness_min=float(np.min(sharp)),
              sharpness_max=float(np.max(sharp)), context_len=calib_context)


def headline_lines(summary: dict) -> list[str]:
  """The headline table of a validity summary: raw vs calibrated per design."""
  fmt = report_lib.fmt
  t = summary["target"]
  lines = [f"Held-out cells at contexts >= {t['min_context']} tokens, delta {t['delta']} "
           f"(target: coverage >= {t['coverage']} in every cell, median sharpness <= "
           f"{t['max_sharpness']:g}; sharpness = median r / ||e|| over covered calls):", "",
           "| design | radius | cells | mean coverage | min coverage | cells below target | "
           "median sharpness | task accuracy |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for d, by_r in summary["overview"].items():
    for r, s in by_r.items():
      if s:
        lines.append(f"| {d} | {r} | {s['n_cells']} | {fmt(s['mean'])} | {fmt(s['min'])} | "
                     f"{s['n_below']} | {fmt(s['sharpness'], '.2f')} | {fmt(s['accuracy'])} |")
  return lines + [""]


def _report_lines(summary, calls, cells, alt_cells, default_design, default_calib, plan,
                  min_context, calib_context):
  fmt = report_lib.fmt
  lines = ["# Validity of the certificate", "",
           f"Model {plan.model}; designs {', '.join(plan.designs)}; regimes "
           f"{', '.join(plan.regimes)}; budgets {', '.join(f'{b:g}' for b in plan.budgets)}; "
           f"data {', '.join(plan.data)}; contexts {', '.join(map(str, plan.context_lens))} "
           f"tokens; {plan.num_examples} examples per data source "
           f"({', '.join(f'{n} at {c}' for c, n in plan.examples_at) or 'at every context'}); "
           f"{plan.n_steps} decode steps; every decode call (step x layer x query head) of "
           f"every row counted ({len(calls)} calls)."
           + (f" Pad groups added to that plan (padded among themselves): "
              + "; ".join(f"{', '.join(d)} with {', '.join(g)} at {c}"
                          for c, d, g in plan.groups_at) + "." if plan.groups_at else "")
           + f" Collection {summary['collection_seconds']:.0f} s (the units' own timings, "
           "compile included, summed)"
           + (f"; this invocation {summary['seconds']:.0f} s." if summary.get("seconds")
              else "."), "",
           "Guarantees (method, sections 5 and 10): the raw radius is design-based and holds "
           "only where Assumption 2 holds; the calibrated radius holds marginally (averaged "
           "over calls), under exchangeability of the calibration calls and the calls it is "
           "applied to; a shift between the two (another task, text or context length) "
           "breaks it, which is why every calibrated cell below is on data NOT used to fit it.",
           ""]
  lines += ["## Headline", ""] + headline_lines(summary)
  lines += [f"Default certified setting: `{default_design}` + the calibration in "
            f"`{ARTIFACT}/` (`certkv_jax.calibration.robust.load`): per regime, budget and "
            f"delta, {default_calib.n_bins} bins of the raw radius, and in each bin the "
            "largest of the per-source split-conformal scales, fitted at context "
            f"{calib_context} on every data source ({', '.join(default_calib.data)}; prompts of "
            f"{default_calib.context_range[0]}-{default_calib.context_range[1]} tokens, the "
            "range the artifact records: outside it, it refuses or warns). Its "
            "held-out coverage is estimated by refitting it without each source in turn and "
            "scoring that source (leave-one-source-out): every calibrated cell below is on a "
            "source its calibration never saw. Alternatives (the issue's literal folds: fitted "
            "on text and scored on the tasks, and the reverse; binned, and one scale per "
            "(layer, KV head)) are in the headline and in `summary.json` "
            "(`alternative_cells`).", ""]
  floor = summary.get("sharpness_floor")
  if floor:
    lines += [f"How sharp can a calibrated radius be? Fitted on each data source's own calls "
              f"and scored on the same calls (no shift; context {floor['context_len']}; "
              f"{floor['cells']} regime x budget x source cells), the default scheme covers "
              f"{fmt(floor['coverage_mean'])} on average with median sharpness "
              f"{fmt(floor['sharpness_median'], '.2f')} (from "
              f"{fmt(floor['sharpness_min'], '.2f')} to {fmt(floor['sharpness_max'], '.2f')}). "
              "That is the spread of ||e|| / r within one source: a rescaled radius that covers "
              "95% of the calls cannot be much sharper than this, and one that must also cover "
              "sources it has not seen (the max over sources) is looser.", ""]
  failing = [c for c in cells if c["design"] == default_design and c["radius"] == "calibrated"
             and c["context_len"] >= min_context and c["coverage"]["0.05"] < report_lib.TARGET]
  lines += ["## Cells where the default setting misses the target", ""]
  if failing:
    lines += report_lib.cells_table(failing)
    lines += ["", "What the warning signals say in those cells (medians over their calls, next "
              f"to the medians over every call of `{default_design}` at contexts >= "
              f"{min_context}; tail mass and r_hat are the strongest predictors of a raw miss, "
              "low values warn):", ""] + _signal_profile(calls, default_design, failing,
                                                         min_context)
    why, summary["why"] = _why_lines(calls, default_design, failing, default_calib,
                                     calib_context, plan.budgets)
    at_fit = [w for w in summary["why"] if w["in_sample"]]
    n_in = sum(w["in_sample_coverage"] >= report_lib.TARGET for w in at_fit)
    lines += ["", f"Why: in {n_in} of the {len(at_fit)} of these cells at the calibration's "
              f"own context ({calib_context} tokens; {len(failing) - len(at_fit)} are at "
              "others) the same data source is "
              "covered once it is among the calibration sources (in-sample: the shipped "
              "artifact); held out, its ratio ||e|| / r is heavier than that of every "
              "calibration source in the same radius bins, so the max over sources falls "
              "short. That is a shift between data sources, which no split-conformal scale "
              "fitted on other sources can promise to cover. The warning signals above show "
              "where it happens online.", ""] + why
  else:
    lines.append("None.")
  lines += ["", "## Online warning signals", "",
            f"AUC for a raw miss at delta 0.05 (calls of `{default_design}` with a tail, "
            f"contexts >= {min_context}); 95% cluster-bootstrap intervals over examples; the "
            "tail size m is the baseline; 0.5 is chance.", "",
            "| signal | AUC [95% CI] | n calls | miss rate |", "| --- | --- | --- | --- |"]
  for s in summary["signals"]:
    lines.append(f"| {s['signal']} | {fmt(s['auc'])} [{fmt(s['ci'][0])}, {fmt(s['ci'][1])}] | "
                 f"{s['n_calls']} | {fmt(s['miss_rate'])} |")
  lines += ["", "## Breakdowns", ""]
  _breakdowns(calls, default_design, plan.budgets, calib_context, min_context, lines)
  lines += ["## Every cell", ""] + report_lib.cells_table(cells) + [""]
  lines += ["## Alternative calibrations (text <-> tasks folds)", ""]
  lines += report_lib.cells_table(alt_cells) + [""]
  return lines


def run(params, config, tok, plan: collect_lib.Plan, out_dir: str, *, text: str,
        text_source: str = collect_lib.DEFAULT_TEXT,
        log: Callable[[str], None] = print) -> Optional[dict]:
  """Collects what is missing, then analyses (None when stopped early by
  ``plan.max_units``); the default radius is ``plan.default_design``'s, calibrated at
  ``plan.calib_context``; ``plan.transfer``: an artifact from another study to score
  too."""
  plan.check()
  default_design = plan.default_design
  if default_design not in plan.designs:
    raise ValueError(f"--default_design must be one of --designs {list(plan.designs)}, got "
                     f"{default_design!r}")
  calib_context = plan.calib_context or max(c for c in plan.context_lens
                                            if c <= 1024 or c == min(plan.context_lens))
  if calib_context not in plan.context_lens:
    raise ValueError(f"--calib_context must be one of --context_lens {list(plan.context_lens)}")
  t0 = time.time()
  paths = collect_lib.collect(params, config, tok, plan, out_dir, text=text,
                              text_source=text_source, log=log)
  if len(paths) < len(plan.units()):
    log(f"validity: {len(paths)} of {len(plan.units())} units present; rerun to finish")
    return None
  return analyse(paths, out_dir, plan, default_design=default_design,
                 calib_context=calib_context, log=log, seconds=time.time() - t0)
