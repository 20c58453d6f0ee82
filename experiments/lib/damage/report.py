"""``summary.json`` and ``report.md`` of the damage study (``python -m experiments.damage``).

Every score is reported beside its baselines, with a bootstrap interval:

* per token: Spearman of each score with the per-token KL (and NLL increase),
  and the AUC for a high-damage token (KL in the top 10% of the set's tokens)
  on the held-out text segments (95% interval resampling 64-token blocks: tokens
  of one stretch of text are dependent) and on the task decode steps
  (resampling examples);
* per example (tasks, streaming): attribution within task (cache-induced vs
  inherent failures, pairs from one setting only; interval resampling examples
  within settings), pooled attribution, failure prediction, and gated
  recomputation at recompute budgets 10 / 25 / 50 %.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from certkv_jax.calibration import damage_predictor
from experiments.lib import plots
from experiments.lib import results_io
from experiments.lib.damage import analysis as an
from experiments.lib.damage import collect as collect_lib
from experiments.lib.stats import gating
from experiments.lib.stats import intervals
from experiments.lib.stats import roc

GATING_BUDGETS = (0.1, 0.25, 0.5)
GOALS = {"attribution_auc_within_task": 0.80, "gating_vs_random": 1.7,
         "gating_oracle_share": 0.5, "spearman_token_damage": 0.5}
PAPER = {"gating_vs_random": "1.7-1.8x", "gating_oracle_share": "~0.36"}
N_BOOT = 1000
BLOCK = 64
HIGH_DAMAGE = 0.1  # the share of tokens called high-damage in the per-token AUC


def spearman(x, y) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if len(x) < 3 or np.all(x == x[0]) or np.all(y == y[0]):
    return float("nan")
  rx, ry = roc.average_ranks(x), roc.average_ranks(y)
  return float(np.corrcoef(rx, ry)[0, 1])


def _ci(iv) -> list:
  return [round(iv.lo, 4), round(iv.hi, 4)]


def token_scores(table: dict, select, groups) -> dict:
  """Spearman (with interval) of every score against KL (and dnll where defined)."""
  out = {}
  kl = table["kl"][select]
  g = groups[select]
  for name in an.SCORES + an.BASELINES:
    s = table[name][select]
    ok = np.isfinite(s)
    if ok.sum() < 10:
      continue
    iv = intervals.cluster_bootstrap_ci(spearman, s[ok], kl[ok], groups=g[ok], n_boot=N_BOOT,
                                        seed=0)
    row = {"spearman_kl": round(iv.estimate, 4), "spearman_kl_ci": _ci(iv), "n": int(ok.sum())}
    # AUC for a high-damage token: KL in the top decile of this set's tokens.
    high = kl[ok] >= np.quantile(kl[ok], 1.0 - HIGH_DAMAGE)
    try:  # too few high-damage tokens or clusters for an interval: left out, not faked
      auc = intervals.cluster_bootstrap_ci(roc.roc_auc, s[ok], high, groups=g[ok],
                                           n_boot=N_BOOT, seed=0)
      row["auc_high_damage"] = round(auc.estimate, 4)
      row["auc_high_damage_ci"] = _ci(auc)
    except ValueError as err:
      row["auc_high_damage_note"] = str(err)
    d = table["dnll"][select]
    if np.all(np.isfinite(d[ok])):
      row["spearman_dnll"] = round(spearman(s[ok], d[ok]), 4)
    out[name] = row
  return out


def _attribution(ex: dict, name: str) -> dict:
  s = ex[name]
  full, ev, g = ex["full_correct"], ex["evicted_correct"], ex["setting"]
  fail = ~ev
  out = {}
  try:
    iv = intervals.bootstrap_ci(lambda a, b, c, d: roc.stratified_attribution_auc(a, b, c, d),
                                s, full, ev, g, n_boot=N_BOOT, seed=0, strata=g)
    out["within_task"] = round(iv.estimate, 4)
    out["within_task_ci"] = _ci(iv)
  except ValueError as e:
    out["within_task"] = None
    out["within_task_note"] = str(e)
  try:
    out["pooled"] = round(roc.attribution_auc(s, full, ev), 4)
  except ValueError:
    out["pooled"] = None
  try:
    out["failure_auc"] = round(roc.failure_auc(s, ev), 4)
  except ValueError:
    out["failure_auc"] = None
  out["n_failures"] = int(fail.sum())
  out["n_cache_induced"] = int((fail & full).sum())
  return out


def _gating(ex: dict, sel, name: str) -> dict:
  gain = gating.gain_from_correct(ex["full_correct"][sel], ex["evicted_correct"][sel])
  score = name if name in ("oracle", "random") else ex[name][sel]
  if not isinstance(score, str) and not np.all(np.isfinite(score)):
    return {}
  curve = gating.gating_curve(gain, score, GATING_BUDGETS)
  # The paper's "~0.36": the gain over oracle gating's at the same budget (stats.oracle_share);
  # of_recoverable: over all the recoverable gain (what the oracle reaches only at a budget
  # of every positive-gain example).
  out = {"oracle_share": {str(b): _r(gating.oracle_share(gain, score, b))
                          for b in GATING_BUDGETS},
         "of_recoverable": {str(b): _r(c) for b, c in zip(GATING_BUDGETS, curve)}}
  if name not in ("random", "oracle"):
    ratio = gating.gain_captured_ratio(gain, score, GATING_BUDGETS)
    out["vs_random"] = {str(b): _r(c) for b, c in zip(GATING_BUDGETS, ratio)}
  return out


def _r(x) -> Optional[float]:
  return None if x is None or not np.isfinite(x) else round(float(x), 4)


def summarize(table: dict, ex: dict, fit_info: dict, plan: dict) -> dict:
  text_test = (table["source"] == "text") & (table["split"] == "test")
  task = table["source"] == "task"
  blocks = np.asarray([f"{g}:{i // BLOCK}" for i, g in enumerate(table["group"])])
  per_token = {"text_held_out": token_scores(table, text_test, blocks),
               "tasks": token_scores(table, task, table["example"].astype(str))}
  names = an.SCORES + ("confidence", "two_run")
  attribution = {n: _attribution(ex, n) for n in names if np.all(np.isfinite(ex[n]))}
  task_acc = {s: float(ex["full_correct"][ex["setting"] == s].mean())
              for s in np.unique(ex["setting"])}
  ex = dict(ex, task=np.asarray([task_acc[s] for s in ex["setting"]]))
  attribution["task"] = _attribution(ex, "task")
  agent = np.isin(ex["setting"], collect_lib.AGENT_MEMORY)
  regimes = {"streaming": np.ones(len(agent), bool), "agent_memory": agent}
  gate = {reg: {n: _gating(ex, sel, n) for n in names + ("task", "random", "oracle")}
          for reg, sel in regimes.items() if sel.any()}
  best = max((n for n in an.SCORES if n in per_token["text_held_out"]),
             key=lambda n: per_token["text_held_out"][n]["spearman_kl"])
  head = "learned"

  def metrics(n):
    a = attribution.get(n, {})
    g = gate["streaming"].get(n, {})
    t = per_token["text_held_out"].get(n, {})
    return {"attribution_auc_within_task": a.get("within_task"),
            "attribution_auc_within_task_ci": a.get("within_task_ci"),
            "gating_vs_random": (g.get("vs_random") or {}).get("0.25"),
            "gating_oracle_share": (g.get("oracle_share") or {}).get("0.25"),
            "spearman_token_damage": t.get("spearman_kl"),
            "spearman_token_damage_ci": t.get("spearman_kl_ci")}

  ours = metrics(head)
  two = attribution.get("two_run", {})
  summary = {
      "score": head,
      "attribution_auc_within_task": ours["attribution_auc_within_task"],
      "attribution_auc_within_task_ci": ours["attribution_auc_within_task_ci"],
      "attribution_auc_two_run": two.get("within_task"),
      "attribution_auc_two_run_ci": two.get("within_task_ci"),
      "gating_vs_random": ours["gating_vs_random"],
      "gating_oracle_share": ours["gating_oracle_share"],
      "spearman_token_damage": per_token["text_held_out"][best]["spearman_kl"],
      "spearman_token_damage_ci": per_token["text_held_out"][best]["spearman_kl_ci"],
      "spearman_token_damage_score": best,
      "baselines": {n: metrics(n) for n in names + ("task",) if n != head},
      "goals": {k: {"target": v, "measured": (ours[k] if k != "spearman_token_damage" else
                                               per_token["text_held_out"][best]["spearman_kl"]),
                    "met": _met(ours[k] if k != "spearman_token_damage" else
                                per_token["text_held_out"][best]["spearman_kl"], v)}
                for k, v in GOALS.items()},
      "per_token": per_token, "attribution": attribution, "gating": gate,
      "full_cache_accuracy": task_acc,
      "evicted_accuracy": {s: float(ex["evicted_correct"][ex["setting"] == s].mean())
                           for s in task_acc},
      "predictor": fit_info, "plan": plan,
  }
  return summary


def headline_lines(s: dict) -> list[str]:
  """A few lines for the suite report: each goal of issue 14 with what was measured."""
  out = [f"Learned damage score vs baselines ({s['plan']['design']} at {s['plan']['budget']}, "
         f"{s['plan']['context_len']}-token streaming contexts):", "",
         "| metric | goal | learned | analytic bound | confidence | two-run |",
         "|---|---|---|---|---|---|"]
  b = s["baselines"]
  for k, g in s["goals"].items():
    ours = s["per_token"]["text_held_out"]["learned"]["spearman_kl"] if (
        k == "spearman_token_damage") else g["measured"]
    out.append(f"| {k} | {g['target']} | {_fmt(ours)} | {_fmt(b['damage_bound'].get(k))} | "
               f"{_fmt(b['confidence'].get(k))} | {_fmt(b['two_run'].get(k))} |")
  return out


def _met(x, target) -> Optional[bool]:
  return None if x is None else bool(x >= target)


def _fmt(x) -> str:
  return "n/a" if x is None else f"{x:.3f}"


def write(out: str, summary: dict, table: dict, ex: dict) -> None:
  results_io.atomic_write_text(os.path.join(out, "summary.json"),
                               json.dumps(results_io.json_safe(summary), indent=1))
  _plots(out, summary, table)
  results_io.atomic_write_text(os.path.join(out, "report.md"), render(summary))


def _plots(out: str, summary: dict, table: dict) -> None:
  curves = {}
  for n, g in summary["gating"].get("streaming", {}).items():
    if g.get("of_recoverable"):
      curves[n] = (list(GATING_BUDGETS), [np.nan if v is None else v
                                          for v in g["of_recoverable"].values()])
  if curves:
    plots.plot_gating(curves, os.path.join(out, "gating_streaming.png"),
                      title="Gated recomputation (streaming, tasks)")
  sel = (table["source"] == "text") & (table["split"] == "test")
  best = summary["spearman_token_damage_score"]
  plots.plot_error_vs_radius(np.maximum(table["kl"][sel], 1e-6),
                             np.maximum(table[best][sel], 1e-6),
                             os.path.join(out, "kl_vs_score.png"),
                             title=f"Per-token KL vs {best} (held-out text)")


def render(s: dict) -> str:
  p = s["plan"]
  lines = [
      "# From attention radius to output damage",
      "",
      f"Model {p['model']}, design `{p['design']}` at budget {p['budget']}, streaming, "
      f"{p['context_len']}-token contexts, chunk {p['chunk']}, radius at delta {p['delta']}. "
      "Made by `python -m experiments.damage` (see COMMAND.md).",
      "",
      "## Goals (issue 14) against what was measured",
      "",
      "| metric | target | measured | met |",
      "|---|---|---|---|",
  ]
  for k, g in s["goals"].items():
    lines.append(f"| {k} | {g['target']} | {_fmt(g['measured'])} | {g['met']} |")
  rand = (s["gating"].get("streaming", {}).get("random", {}).get("oracle_share") or {})
  r = rand.get("0.25")
  if r is not None:
    lines += ["", f"gating_oracle_share is the gain over oracle gating's at the same 25% "
              f"budget (the paper's \"~0.36\"); random gating reaches {r:.3f} on the same "
              "examples" + (", so meeting the goal says little here: nearly every failure is "
                            "cache-induced and recomputing any example helps" if r >= GOALS[
                                "gating_oracle_share"] else "") + "."]
  lines += ["", f"Headline score: `{s['score']}` (the learned predictor, fitted on text "
            f"segments 0-{p['train_segments'] - 1} only). Per-token Spearman is the best "
            f"certificate-based score on the held-out text (`{s['spearman_token_damage_score']}`"
            f"), interval {s['spearman_token_damage_ci']}.", "",
            "## Per-token damage (Spearman with the per-token KL, 95% interval)", "",
            "| score | held-out text | interval | AUC top-10% KL | vs NLL increase | "
            "task decode steps | interval | AUC top-10% KL |", "|---|---|---|---|---|---|---|---|"]
  for n in sorted(s["per_token"]["text_held_out"]):
    t = s["per_token"]["text_held_out"][n]
    k = s["per_token"]["tasks"].get(n, {})
    lines.append(f"| {n} | {_fmt(t['spearman_kl'])} | {t['spearman_kl_ci']} | "
                 f"{_fmt(t.get('auc_high_damage'))} {t.get('auc_high_damage_ci', '')} | "
                 f"{_fmt(t.get('spearman_dnll'))} | {_fmt(k.get('spearman_kl'))} | "
                 f"{k.get('spearman_kl_ci')} | {_fmt(k.get('auc_high_damage'))} "
                 f"{k.get('auc_high_damage_ci', '')} |")
  lines += ["", "`confidence` is the baseline: the evicted model's own predictive entropy "
            "(text) or the answer token's negative log-probability (tasks).", "",
            "## Attribution and failure prediction (tasks, per example)", "",
            "| score | within task | interval | pooled | failure AUC |", "|---|---|---|---|---|"]
  for n, a in s["attribution"].items():
    lines.append(f"| {n} | {_fmt(a.get('within_task'))} | {a.get('within_task_ci')} | "
                 f"{_fmt(a.get('pooled'))} | {_fmt(a.get('failure_auc'))} |")
  any_a = next(iter(s["attribution"].values()))
  lines += ["", f"{any_a['n_failures']} failures of the evicted run, of which "
            f"{any_a['n_cache_induced']} cache-induced (the full cache answered). `task` is the "
            "task-only baseline (the setting's full-cache accuracy, computed in-sample on "
            "these same examples: it knows each setting's failure rate, so it flatters the "
            "baseline): 0.5 within task by construction.", "",
            "Full-cache / evicted accuracy per setting: " + ", ".join(
                f"{k} {v:.2f} / {s['evicted_accuracy'][k]:.2f}"
                for k, v in s["full_cache_accuracy"].items()), "",
            "## Gated recomputation", "",
            "Gain captured at a recompute budget of 10 / 25 / 50% of the examples, over "
            "oracle gating's at the same budget (the paper's \"~0.36\"), then at 25% over "
            "all the recoverable gain and over random gating's. Random gating's own row "
            "is the level a score must beat.", ""]
  for reg, g in s["gating"].items():
    lines += [f"**{reg}**", "", "| score | 10% | 25% | 50% | of recoverable at 25% | "
              "x random at 25% |", "|---|---|---|---|---|---|"]
    for n, v in g.items():
      if not v:
        continue
      o, rec = v["oracle_share"], v.get("of_recoverable") or {}
      lines.append(f"| {n} | {_fmt(o['0.1'])} | {_fmt(o['0.25'])} | {_fmt(o['0.5'])} | "
                   f"{_fmt(rec.get('0.25'))} | "
                   f"{_fmt((v.get('vs_random') or {}).get('0.25'))} |")
    lines.append("")
  f = s["predictor"]
  lines += ["## The learned predictor", "",
            f"Fitted on {f['n_train_tokens']} tokens of the training text segments "
            f"(validation loss linear {f['val_loss']['0']:.3f}, MLP {f['val_loss']['16']:.3f}; "
            f"chosen: hidden={f['chosen_hidden']}); {f['n_nonfinite_rows']} rows had "
            "non-finite features and were left out. It never saw the held-out segments or "
            "any task.", ""]
  return "\n".join(lines) + "\n"


def analyse(out: str, plan: collect_lib.Plan, *, train: bool, log=print) -> dict:
  """Fits (``train``: on the training text segments, saved with orbax to ``out/predictor``)
  or loads the predictor, then writes ``summary.json``, ``report.md`` and the plots."""
  units, norms = an.load_units(out)
  table = an.mark_splits(an.token_table(units, norms, plan.chunk), units, plan.train_segments)
  path = os.path.join(out, "predictor")
  info_path = os.path.join(out, "predictor_fit.json")
  if train:
    predictor, info = an.fit_predictor(table, model=plan.model, design=plan.design,
                                       budget=plan.budget, seed=plan.seed)
    damage_predictor.save(predictor, path, overwrite=True)
    results_io.atomic_write_text(info_path, json.dumps(info, indent=1))
    log(f"damage: predictor (hidden={info['chosen_hidden']}) fitted on "
          f"{info['n_train_tokens']} tokens, saved to {path}")
  else:
    with open(info_path, encoding="utf-8") as f:
      info = json.load(f)
    predictor = damage_predictor.load(path, expect_features=tuple(info["features"]),
                                      model=plan.model, design=plan.design,
                                      budget=str(plan.budget))
  table = an.add_learned(table, predictor)
  ex = an.example_scores(units, norms, predictor)
  summary = summarize(table, ex, info, dict(plan.__dict__, settings=list(plan.settings)))
  write(out, summary, table, ex)
  log(f"damage: wrote {out}/report.md and summary.json")
  return summary
