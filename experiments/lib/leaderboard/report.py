r"""The leaderboard's report: scores per design, task and ratio; coverage; the plot.

From the rows of :mod:`experiments.lib.leaderboard.experiment`, per (context
length, regime), a *cell*:

* ``score[design][ratio]``: RULER's task score (percent: the mean over
  examples of string_match_all), averaged over the tasks, the full cache at
  ratio 0 as the reference; ``score_by_task[design][ratio][task]``.
* for randomized designs, ``coverage[design][ratio]``: raw coverage of the
  per-call radius at delta 0.05 (every decode call up to the answer's end),
  median radius and true error; calibrated coverage with per-(layer, KV head)
  split-conformal scales fitted leave-one-task-out (for each task, on the
  other tasks' calls of the same design, ratio and regime;
  ``experiments.lib.equal_memory.report.coverage``), over the calls kept in
  ``calls/`` (:data:`experiment.CALL_STEPS` steps per row); and the shipped
  calibration's coverage (``models.text.certificate.calibrated``) where it was
  made for the cell, or the reason it was not.

Only designs with every row of a cell are reported; the others are listed as
not run. summary.json holds every cell under ``cells`` and, at the top level,
the first context length's first regime (``headline``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Optional, Sequence

import matplotlib
matplotlib.use("Agg")
import numpy as np  # pylint: disable=g-import-not-at-top

from certkv_jax import calibration
from certkv_jax.calibration import robust
from experiments.lib import design_defaults
from experiments.lib import plots
from experiments.lib import results_io
from experiments.lib import ruler
from experiments.lib import stats
from experiments.lib import variants
from experiments.lib.equal_memory import report as equal_memory_report
from experiments.lib.leaderboard import experiment
from experiments.lib.leaderboard import rows as rows_lib
from models.text import certificate as certificate_lib

SHIPPED_REGIME = {"query_aware": "question_aware", "streaming": "streaming"}


def _key(ratio) -> str:
  return str(float(ratio))


def _complete(rows, plan, c, regime, design) -> bool:
  have = {(r["task"], r["ratio"], r["example"]) for r in rows
          if r["context_len"] == c and r["regime"] == regime and r["design"] == design}
  return all((t, r, e) in have for t in plan.tasks_for(c) for r in plan.ratios_for(design)
             for e in range(plan.n_examples))


@dataclasses.dataclass(frozen=True)
class Cell:
  """One design at one ratio, context length and regime: what a coverage entry covers."""

  context_len: int
  regime: str
  design: str
  ratio: float


def _load_calls(out_dir, plan, cell: Cell, task) -> Optional[tuple]:
  """``(errors, radii)`` ``[calls, layers, heads]`` kept for one task's rows, or None.

  Each unit's file is named by its first example, which depends on the run's
  ``--group``: every name a unit can have is tried, so a report with another
  group reads every example."""
  found = {}
  for start in range(plan.n_examples):
    path = rows_lib.calls_path(out_dir, (cell.context_len, task, cell.regime, start,
                                           cell.design), plan.seed)
    if not os.path.exists(path):
      continue
    with np.load(path) as z:
      for e in range(start, plan.n_examples):
        k = f"e{e}_r{cell.ratio}_"
        if e not in found and k + "error" in z.files:
          found[e] = (z[k + "error"].astype(np.float64), z[k + "radius"].astype(np.float64))
  if not found:
    return None
  errs, rads = zip(*(found[e] for e in sorted(found)))
  return np.concatenate(errs), np.concatenate(rads)


def _scores(calls) -> np.ndarray:
  e, r = calls
  return calibration.conformity_scores(e.ravel(), r.ravel()).reshape(e.shape)


def coverage_cell(out_dir, plan, cell: Cell, rows, *, n_kv_heads: int,
                  model: Optional[str]) -> dict:
  """Raw, leave-one-task-out calibrated and shipped-calibration coverage of ``cell``
  from its ``rows`` and the calls kept in ``out_dir``."""
  sel = [r for r in rows if r.get("n_calls")]
  n = sum(r["n_calls"] for r in sel)
  out = {"n_calls": n, "n_rows": len(rows)}
  if not n:
    return out
  out["raw"] = float(sum(r["raw_coverage"] * r["n_calls"] for r in sel) / n)
  out["unseen_deletions"] = float(sum(r["unseen_deletions"] * r["n_calls"] for r in sel) / n)
  if all("smoothed_coverage" in r for r in sel):  # rows made before it have none
    out["smoothed"] = float(sum(r["smoothed_coverage"] * r["n_calls"] for r in sel) / n)
  calls = {t: _load_calls(out_dir, plan, cell, t) for t in plan.tasks_for(cell.context_len)}
  calls = {t: v for t, v in calls.items() if v is not None}
  if calls:
    e = np.concatenate([v[0].ravel() for v in calls.values()])
    r = np.concatenate([v[1].ravel() for v in calls.values()])
    raw = [(_scores(v), 1.0) for v in calls.values()]
    out.update(median_radius=float(np.median(r)), median_error=float(np.median(e)),
               n_kept_calls=int(e.size), raw_sharpness=equal_memory_report.sharpness(raw))
  if len(calls) >= 2:
    scaled = {"calibrated": [], "robust": []}
    for t, v in calls.items():
      ev = _scores(v)
      group = ev.shape[2] // n_kv_heads
      # fitted on the other tasks' calls, one part per task: pooled, and robust (the largest)
      fitted = equal_memory_report.fitted_scales(
          [_scores(w) for u, w in calls.items() if u != t], n_kv_heads)
      for k, scale in zip(scaled, fitted):
        scaled[k].append((ev, np.repeat(scale, group, axis=1)[None]))
    for k, parts in scaled.items():
      out[k] = float(sum(np.sum(ev <= s) for ev, s in parts) / sum(ev.size for ev, _ in parts))
      out[k + "_sharpness"] = equal_memory_report.sharpness(parts)
  else:
    out["calibrated_note"] = "needs the calls of >= 2 tasks (leave-one-task-out)"
  out.update(_shipped(calls, plan, cell, rows, model))
  return out


def _shipped(calls, plan, cell: Cell, rows, model) -> dict:
  """Coverage under the shipped calibration, or why it does not apply."""
  c, regime, design = cell.context_len, cell.regime, cell.design
  path = certificate_lib.DEFAULT_CALIBRATION
  if not calls:
    return {"shipped_note": "no calls kept"}
  if not os.path.isdir(path):
    return {"shipped_note": f"no calibration artifact at {path}"}
  fitted = _shipped_design(path)
  if fitted != design:
    return {"shipped_note": f"the shipped calibration is for design {fitted!r} only"}
  budgets = {row["budget"] for row in rows}  # tokens kept: 1 - ratio unless --equal_memory
  if len(budgets) != 1:
    raise ValueError(f"the rows of {cell} ran at {len(budgets)} budgets {sorted(budgets)}, "
                     "expected one")
  e = np.concatenate([v[0].ravel() for v in calls.values()])
  r = np.concatenate([v[1].ravel() for v in calls.values()])
  run = certificate_lib.Run(model_name=model, design_name=design,
                            regime=SHIPPED_REGIME[regime], budget=budgets.pop(),
                            delta=experiment.DELTA, n_sink=plan.n_sink, window=plan.window,
                            chunk=plan.chunk or c,  # chunk 0: the whole context at once
                            dtype=plan.dtype)
  lengths = [row["n_prompt_tokens"] for row in rows]
  radius, note, in_range = certificate_lib.calibrated(r, run, calibration=path,
                                                      context_tokens=int(max(lengths)))
  if radius is None:
    return {"shipped_note": note}
  _, low_note, low_in_range = certificate_lib.calibrated(r, run, calibration=path,
                                                         context_tokens=int(min(lengths)))
  if in_range and not low_in_range:  # the longest prompts fit, the shortest do not
    note, in_range = low_note, False
  return {"shipped": float(np.mean(e <= radius)), "shipped_in_range": in_range,
          "shipped_note": note}


@functools.lru_cache(maxsize=None)
def _shipped_design(path: str) -> Optional[str]:
  """The design a calibration artifact was fitted for (None: unreadable)."""
  try:
    return robust.load(path).design
  except (OSError, ValueError):
    return None


N_BOOT = 2000  # bootstrap resamples of the intervals


def _example_scores(rows, design, ratio, tasks, n_examples: int) -> dict:
  """{(task, example): score} of ``design`` at ``ratio`` (the full cache: ratio 0) on
  ``tasks``' first ``n_examples`` examples (rows of a larger earlier run left out)."""
  if design == design_defaults.FULL:
    ratio = experiment.FULL_RATIO
  return {(r["task"], r["example"]): float(r["score"]) for r in rows
          if r["design"] == design and r["ratio"] == ratio and r["task"] in tasks
          and r["example"] < n_examples}


def _interval(values, strata, seed: int) -> dict:
  """``{"value", "ci"}``: the mean with a bootstrap interval resampled within each stratum;
  no interval (NaN bounds) when a stratum has one example, whose resamples never vary."""
  iv = stats.bootstrap_ci(np.mean, values, n_boot=N_BOOT, seed=seed, strata=strata)
  lone = min(np.unique(strata, return_counts=True)[1]) < 2
  nan = float("nan")
  return {"value": float(iv.estimate),
          "ci": [nan, nan] if lone else [float(iv.lo), float(iv.hi)]}


def paired_scores(rows, plan, ran, tasks, *, seed: int = 0) -> dict:
  """Per ratio: each design's score with a 95% interval (``score``), the best
  deterministic design with uniform budgets (``best_deterministic``) and every
  design's score minus that design's on the same examples
  (``paired_vs_best_deterministic``), and each certified twin
  (``<design>_cert``) minus its own deterministic design (``paired_twin``, keyed
  by that design; ``"twin"`` names the twin), in points. Intervals: percentile
  bootstrap over examples, resampled within each task (the average weighs tasks
  alike), none (NaN) where a task has one example; ``n`` counts the examples. The best
  deterministic design is chosen on the same examples it is compared on (ties: the first
  in ``ran``; ``best_tied`` lists the others)."""
  out = {"score": {}, "best_deterministic": {}, "paired_vs_best_deterministic": {},
         "paired_twin": {}}
  uniform_det = [d for d in ran if d != design_defaults.FULL and not experiment.is_randomized(d)
                 and variants.parse_variant(d)[1] == "uniform"]
  twin_key = {}  # the first twin of a design is keyed by that design, any other by itself
  for d in ran:
    base = variants.twin_base(d)
    if base in ran:
      twin_key[d] = base if base not in twin_key.values() else d
  for ratio in plan.ratios:
    per = {d: _example_scores(rows, d, ratio, tasks, plan.n_examples) for d in ran}
    keys = sorted(per[ran[0]]) if ran else []
    strata = np.array([t for t, _ in keys])
    vec = {d: 100.0 * np.array([per[d][k] for k in keys]) for d in ran}
    for d in ran:
      out["score"].setdefault(d, {})[_key(ratio)] = dict(
          _interval(vec[d], strata, seed), n=len(keys))
    for d, key in twin_key.items():
      base = variants.twin_base(d)
      out["paired_twin"].setdefault(key, {})[_key(ratio)] = dict(
          _interval(vec[d] - vec[base], strata, seed), n=len(keys), twin=d)
    if not uniform_det:
      continue
    means = {d: float(np.mean(vec[d])) for d in uniform_det}
    best = max(uniform_det, key=means.get)
    out["best_deterministic"][_key(ratio)] = best
    tied = [d for d in uniform_det if d != best and means[d] == means[best]]
    if tied:
      out.setdefault("best_tied", {})[_key(ratio)] = tied
    for d in ran:
      out["paired_vs_best_deterministic"].setdefault(d, {})[_key(ratio)] = _interval(
          vec[d] - vec[best], strata, seed)
  return out


def summarize(rows: Sequence[dict], out_dir: str, plan, *, n_kv_heads: int = 3,
              model: Optional[str] = None) -> dict:
  """summary.json's dict and the markdown report (``md``)."""
  # This plan's seed and examples only (a larger earlier run's rows may share the folder).
  rows = [r for r in rows if r["seed"] == plan.seed and r["example"] < plan.n_examples]
  out = {"plan": {"tasks": list(plan.tasks), "context_lens": list(plan.context_lens),
                  "tasks_at": {str(c): list(t) for c, t in plan.tasks_at},
                  "ratios": list(plan.ratios), "regimes": list(plan.regimes),
                  "designs": list(plan.all_designs), "n_examples": plan.n_examples,
                  "chunk": plan.chunk, "seed": plan.seed, "n_sink": plan.n_sink,
                  "window": plan.window, "use_chat": plan.use_chat,
                  "equal_memory": plan.equal_memory, "coverage": plan.coverage,
                  "max_new_tokens": {t: plan.max_new_tokens or ruler.tokens_to_generate(t)
                                     for t in plan.tasks},
                  "haystack": os.path.basename(plan.haystack or ruler.DEFAULT_HAYSTACK),
                  "haystack_sha256": rows_lib.haystack_sha256(plan)},
         "metric": "string_match_all (RULER), percent", "delta": experiment.DELTA,
         "left_out": dict(ruler.LEFT_OUT), "cells": {}}
  md = []
  for c in plan.context_lens:
    tasks = plan.tasks_for(c)
    for regime in plan.regimes:
      cell_rows = [r for r in rows if r["context_len"] == c and r["regime"] == regime
                   and r["task"] in tasks]  # coverage and timings: the scored tasks only
      ran = [d for d in plan.all_designs if _complete(cell_rows, plan, c, regime, d)]
      cell = {"score": {}, "score_by_task": {}, "coverage": {},
              "not_run": [d for d in plan.all_designs if d not in ran],
              "n_examples": {t: plan.n_examples for t in tasks},
              "seconds_per_row": {}, "prefill_seconds": 0.0}
      for d in ran:
        mine = [r for r in cell_rows if r["design"] == d]
        for ratio in plan.ratios_for(d):
          at = [r for r in mine if r["ratio"] == ratio]
          by_task = {t: round(100.0 * float(np.mean([r["score"] for r in at if r["task"] == t])),
                              2) for t in tasks}
          cell["score_by_task"].setdefault(d, {})[_key(ratio)] = by_task
          if experiment.is_randomized(d) and plan.coverage:
            cell["coverage"].setdefault(d, {})[_key(ratio)] = coverage_cell(
                out_dir, plan, Cell(c, regime, d, ratio), at, n_kv_heads=n_kv_heads,
                model=model)
        cell["seconds_per_row"][d] = float(np.median([r["unit_seconds"] / r["unit_rows"]
                                                      for r in mine]))  # past compiles
        cell["prefill_seconds"] += float(sum(r["prefill_seconds"] / r["unit_rows"]
                                             for r in mine))
      cell.update(paired_scores(cell_rows, plan, ran, tasks, seed=plan.seed))
      out["cells"][f"{c}/{regime}"] = cell
      md += _markdown(cell, c, regime, tasks, plan)
  first = out["cells"][f"{plan.context_lens[0]}/{plan.regimes[0]}"]
  out["headline"] = {"context_len": plan.context_lens[0], "regime": plan.regimes[0]}
  for k in ("score", "score_by_task", "n_examples", "not_run",
            "best_deterministic", "paired_vs_best_deterministic", "paired_twin"):
    out[k] = first[k]
  if first.get("best_tied"):
    out["best_tied"] = first["best_tied"]
  out["md"] = "\n".join(md)
  return out


def _fmt(x, spec=".3f") -> str:
  return "-" if x is None else f"{x:{spec}}"


def _sharp(v: dict, k: str) -> str:
  """Coverage ``v[k]`` with its sharpness in parentheses where there is one."""
  sharp = v.get(k + "_sharpness")
  return _fmt(v.get(k)) + ("" if sharp is None else f" ({sharp:.2f})")


def _fmt_ci(v, spec=".1f") -> str:
  """``{value, ci}`` as ``value [lo, hi]``; "-" for None; no interval where its bounds are
  None or NaN (a task of one example)."""
  if v is None:
    return "-"
  lo, hi = v["ci"]
  if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
    return f"{v['value']:{spec}} (no CI: a task of one example)"
  return f"{v['value']:{spec}} [{lo:{spec}}, {hi:{spec}}]"


_RATIO_TEXT = {
    False: "Compression ratio = the share of the cache removed (kvpress's convention; budget "
           "= 1 - ratio of the tokens seen).",
    True: "Compression ratio = the share of the full cache's key/value bytes removed, at "
          "equal memory: a design's kept keys, values and per-slot metadata "
          "(`certkv_jax.kv.memory`) hold 1 - ratio of the full cache's key/value bytes. "
          "Designs are `design[+allocation]` variants (`experiments/lib/variants.py`)."}
_REGIME_TEXT = {"streaming": "question after the compressed context (kvpress's default)",
                "query_aware": "question inside the compressed context (query_aware)"}


def _markdown(cell, c, regime, tasks, plan) -> list[str]:
  what = _REGIME_TEXT[regime]
  removed = "full cache's key/value bytes" if plan.equal_memory else "cache"
  if regime == "streaming" and plan.chunk:
    what = f"question after the context, evicted every {plan.chunk} tokens"
  lines = [f"## {c} tokens, {regime}: {what}", "",
           f"Average RULER score (%) over {len(tasks)} task{'s' * (len(tasks) > 1)}, "
           f"{plan.n_examples} examples each, "
           f"by compression ratio (the share of the {removed} removed):", "",
           "| design | " + " | ".join(str(r) for r in plan.ratios) + " | s/row |",
           "|---" * (len(plan.ratios) + 2) + "|"]
  for d, per in cell["score"].items():
    vals = [_fmt_ci(per.get(_key(r))) for r in plan.ratios]
    name = "full (reference)" if d == design_defaults.FULL else d
    lines.append(f"| {name} | " + " | ".join(vals) +
                 f" | {cell['seconds_per_row'][d]:.2f} |")
  if cell.get("best_deterministic"):
    tied = cell.get("best_tied", {})
    lines += ["", "Paired against the best deterministic design with uniform budgets at each "
              "ratio (bold; chosen on these same examples, so a design compared against it "
              "is judged against the luckiest of the candidates): score difference in points "
              "on the same examples, 95% bootstrap over examples within tasks"
              + ("" if not tied else "; tied for best, the bold one taken: " + "; ".join(
                  f"{r}: {', '.join([cell['best_deterministic'][r]] + v)}"
                  for r, v in tied.items())) + ":", "",
              "| design | " + " | ".join(str(r) for r in plan.ratios) + " |",
              "|---" * (len(plan.ratios) + 1) + "|"]
    for d, per in cell["paired_vs_best_deterministic"].items():
      if d == design_defaults.FULL:
        continue
      vals = []
      for r in plan.ratios:
        v = per.get(_key(r))
        bold = "**" if cell["best_deterministic"].get(_key(r)) == d else ""
        vals.append("-" if v is None else f"{bold}{_fmt_ci(v, '+.1f')}{bold}")
      lines.append(f"| {d} | " + " | ".join(vals) + " |")
  if cell.get("paired_twin"):
    lines += ["", "Certified twins against their own deterministic design: twin minus design "
              "in points on the same examples, 95% bootstrap over examples within tasks:", "",
              "| design | twin | " + " | ".join(str(r) for r in plan.ratios) + " |",
              "|---" * (len(plan.ratios) + 2) + "|"]
    for d, per in cell["paired_twin"].items():
      twin = next(iter(per.values()))["twin"]
      vals = [_fmt_ci(per.get(_key(r)), "+.1f") for r in plan.ratios]
      lines.append(f"| {d} | {twin} | " + " | ".join(vals) + " |")
  for ratio in plan.ratios:
    lines += ["", f"Per task at ratio {ratio} (full cache: no compression):", "",
              "| design | " + " | ".join(tasks) + " | average |", "|---" * (len(tasks) + 2) + "|"]
    for d, per in cell["score_by_task"].items():
      k = _key(experiment.FULL_RATIO if d == design_defaults.FULL else ratio)
      if k not in per:
        continue
      lines.append(f"| {d} | " + " | ".join(_fmt(per[k][t], ".1f") for t in tasks) +
                   f" | {_fmt(float(np.mean([per[k][t] for t in tasks])), '.1f')} |")
  if cell["coverage"]:
    lines += ["", f"Certificate of the randomized designs (delta {experiment.DELTA}; calls of "
              "every decode step up to the answer's end; in parentheses the sharpness, median "
              "radius / error over the covered kept calls):", "",
              "| design | ratio | calls | raw coverage | smoothed (method, section 5) | "
              "calibrated (leave-one-task-out) | robust calibrated | shipped calibration | "
              "median radius | median error | unseen deletions |", "|---" * 11 + "|"]
    for d, per in cell["coverage"].items():
      for ratio in plan.ratios:
        v = per.get(_key(ratio), {})
        shipped = _fmt(v.get("shipped")) if "shipped" in v else "-"
        if "shipped" in v and v.get("shipped_in_range") is False:
          shipped += " (outside its context range)"
        lines.append(f"| {d} | {ratio} | {v.get('n_calls', 0)} | {_sharp(v, 'raw')} | "
                     f"{_fmt(v.get('smoothed'))} | {_sharp(v, 'calibrated')} | "
                     f"{_sharp(v, 'robust')} | {shipped} | "
                     f"{_fmt(v.get('median_radius'), '.3g')} | "
                     f"{_fmt(v.get('median_error'), '.3g')} | "
                     f"{_fmt(v.get('unseen_deletions'))} |")
    notes = sorted({f"{d}: {v['shipped_note']}" for d, per in cell["coverage"].items()
                    for v in per.values() if "shipped_note" in v and "shipped" not in v})
    if notes:
      lines += ["", "Shipped calibration not applied:", ""] + [f"* {n}" for n in notes]
  if cell["not_run"]:
    lines += ["", f"Not run (no complete rows): {', '.join(cell['not_run'])}."]
  return lines + [""]


def _score_panels(cells: dict, plan) -> dict:
  """Score against ratio: one panel per cell, or where twins ran one per (cell, design)
  with the design, its twin and the full cache, each with its 95% interval."""
  panels = {}
  for name, cell in cells.items():
    where, score = name.replace("/", " tokens, "), cell["score"]

    def curve(d, band=True):
      per = [score[d][_key(r)] for r in plan.ratios]
      ys = [p["value"] for p in per]
      bands = ([p["ci"][0] for p in per], [p["ci"][1] for p in per])
      return (list(plan.ratios), ys, bands) if band else (list(plan.ratios), ys)

    twins = [next(iter(per.values()))["twin"] for per in cell.get("paired_twin", {}).values()]
    for twin in twins:  # the full cache's curve where it ran (a stopped run may lack it)
      full = ({design_defaults.FULL: curve(design_defaults.FULL, band=False)}
              if design_defaults.FULL in score else {})
      panels[f"{where}: {variants.twin_base(twin)}"] = dict(
          full, design=curve(variants.twin_base(twin)), **{"certified twin": curve(twin)})
    if not twins and score:
      panels[where] = {d: curve(d, band=False) for d in score}
  return panels


def write(rows, out_dir: str, plan, *, n_kv_heads: int = 3,
          model: Optional[str] = None) -> Optional[dict]:
  """Writes report.md, summary.json and score.png; None if no design is complete."""
  s = summarize(rows, out_dir, plan, n_kv_heads=n_kv_heads, model=model)
  if not any(cell["score"] for cell in s["cells"].values()):
    return None
  body = {k: v for k, v in s.items() if k != "md"}
  results_io.atomic_write_text(os.path.join(out_dir, "summary.json"),
                               json.dumps(results_io.json_safe(body), indent=1, sort_keys=True))
  results_io.atomic_write_text(os.path.join(out_dir, "report.md"), _header(plan) + s["md"])
  plots.plot_panels(_score_panels(s["cells"], plan), os.path.join(out_dir, "score.png"),
                    xlabel="compression ratio (share of the cache removed)",
                    ylabel="RULER score (%, mean over tasks)",
                    title="RULER tasks: score against compression ratio")
  return s


def _header(plan) -> str:
  left = "; ".join(f"{k} ({v})" for k, v in ruler.LEFT_OUT.items())
  return f"""# RULER-style leaderboard of the eviction designs

Generated by `python -m experiments.leaderboard` (`experiments/lib/leaderboard`),
weights and KV caches in {plan.dtype} (`--dtype`).
Tasks: RULER's synthetic tasks generated with no outside data
(`experiments/lib/ruler.py`; the essay haystack and the word lists come from
the built-in text {os.path.basename(plan.haystack or ruler.DEFAULT_HAYSTACK)}), scored as RULER scores them
(string_match_all, percent) with RULER's maximum generation lengths, greedy.
Left out: {left}. {_RATIO_TEXT[plan.equal_memory]} Streaming:
the context is {"evicted after every " + str(plan.chunk) + " tokens" if plan.chunk else "prefilled and evicted once"} before the question is seen;
query_aware: context and question are prefilled and evicted together.
Coverage: the raw radius (Bernstein, delta {experiment.DELTA}) against the true error of
every decode call (a shadow full cache); calibrated = per-(layer, KV head)
split-conformal scales fitted on the other tasks' calls (leave-one-task-out)
over {experiment.CALL_STEPS} decode steps kept per row, pooled (one quantile of their
calls) or robust (the largest of the other tasks' own quantiles); shipped = the validity study's
calibration where it was made for the cell. s/row = the median decode seconds
per row (the shared prefill not included).

"""
