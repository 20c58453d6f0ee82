"""``docs/results.md``: the measured results, rendered from the committed summaries.

:func:`render` reads the summaries under ``experiments/results/`` (``summary.json``,
``report.json``, ``perplexity.json``, rows files, and the command lines recorded in
``COMMAND.md`` / ``report.md``) and returns the document. Every number in it is read or
computed from those files at render time, so the document cannot drift from the runs it
reports; ``tests/results_doc_test.py`` checks that the committed ``docs/results.md`` equals
``render`` of the committed summaries. Verdicts are printed as stored in ``report.json``.
"""

from __future__ import annotations

import collections
import json
import os
import re
from typing import Optional, Sequence

import numpy as np

from experiments.lib import overhead as overhead_lib
from experiments.lib import results_io
from experiments.lib import suite_report

# Links are relative to the document (docs/results.md).
LINK = "../experiments/results"
DEFAULT_OUT = "docs/results.md"
DEFAULT_RESULTS = "experiments/results"
COMMAND = "python -m experiments.results_doc"
# The suite's primary certificate level (its claims are stated at delta 0.05).
DELTA = 0.05


# --- formatting ---------------------------------------------------------------------------

def _f(x, spec=".3f") -> str:
  return "-" if x is None else format(x, spec)


def _ci(t, spec=".3f") -> str:
  if t is None:
    return "n/a"
  e, lo, hi = t
  return f"{_f(e, spec)} [{_f(lo, spec)}, {_f(hi, spec)}]"


def _span(values, spec=".3f") -> str:
  """``lo-hi`` of the values as printed (one value when they print the same)."""
  vals = [v for v in values if v is not None]
  if not vals:
    return "-"
  lo, hi = _f(min(vals), spec), _f(max(vals), spec)
  if lo == hi:
    return lo
  return f"{lo} to {hi}" if min(vals) < 0 else f"{lo}-{hi}"


def _pct(b) -> str:
  return f"{float(b) * 100:g}%"


def _mib(n_bytes) -> str:
  return f"{n_bytes / 2**20:.1f}"


def _table(header: Sequence[str], body) -> list[str]:
  return (["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
          + ["| " + " | ".join(str(x) for x in row) + " |" for row in body])


def _link(rel: str, label: Optional[str] = None) -> str:
  return f"[`{label or rel}`]({LINK}/{rel})"


def _source(files: Sequence[str], command: str) -> list[str]:
  return [f"Source: {', '.join(_link(f) for f in files)}. Command: `{command}`.", ""]


# --- reading ------------------------------------------------------------------------------

def _json(root: str, rel: str):
  with open(os.path.join(root, rel), encoding="utf-8") as f:
    return json.load(f)


def _rows(root: str, rel: str) -> list[dict]:
  return results_io.read_rows(os.path.join(root, rel))


def _text(root: str, rel: str) -> str:
  with open(os.path.join(root, rel), encoding="utf-8") as f:
    return f.read()


def _command(root: str, rel: str) -> str:
  """The command recorded in ``rel``: its first indented ``python -m`` block (COMMAND.md),
  else its first ``python -m`` in backquotes (report.md, summary.md)."""
  text = _text(root, rel)
  lines = text.splitlines()
  for i, line in enumerate(lines):
    if line.startswith("    python -m "):
      parts, j = [line.strip()], i
      while parts[-1].endswith("\\") and j + 1 < len(lines):
        j += 1
        parts[-1] = parts[-1][:-1].rstrip()
        parts.append(lines[j].strip())
      return " ".join(parts)
  inline = re.search(r"`(python -m [^`]+)`", text)
  if inline:
    return inline.group(1)
  raise ValueError(f"{rel}: no recorded command")


def _settings_line(root: str, rel: str) -> str:
  m = re.search(r"^Settings: (.*?)\s*$", _text(root, rel), re.M)
  if not m:
    raise ValueError(f"{rel}: no Settings line")
  return m.group(1)


# --- the validity study -------------------------------------------------------------------

def _cells(cells, **kw):
  return [c for c in cells if all(c[k] == v for k, v in kw.items())]


def _cov(c):
  return c["coverage"]["0.05"]


def _agg(cells, target):
  cov = [_cov(c) for c in cells]
  sharp = [c["sharpness"] for c in cells if c["sharpness"] is not None]
  return dict(mean=float(np.mean(cov)), min=float(np.min(cov)), n=len(cov),
              below=int(sum(x < target for x in cov)),
              sharpness=float(np.median(sharp)) if sharp else None)


def _failing_signal_cells(root: str) -> Optional[tuple[int, int]]:
  """From the validity report's table of signal medians in the failing cells: in how many
  of them the median tail_mass and r_hat are below those of all calls (low warns)."""
  lines = _text(root, "validity/report.md").splitlines()
  for i, line in enumerate(lines):
    if line.startswith("| calls |") and "tail_mass" in line and "r_hat" in line:
      head = [h.strip() for h in line.strip("|").split("|")]
      body = []
      for row in lines[i + 2:]:
        if not row.startswith("|"):
          break
        body.append([x.strip() for x in row.strip("|").split("|")])
      tm, rh = head.index("tail_mass"), head.index("r_hat")
      ref = [r for r in body if r[0] == "all calls"]
      cells = [r for r in body if r[0] != "all calls"]
      if not ref or not cells:
        return None
      warn = sum(float(r[tm]) < float(ref[0][tm]) and float(r[rh]) < float(ref[0][rh])
                 for r in cells)
      return warn, len(cells)
  return None


def _validity(root: str) -> list[str]:
  d = _json(root, "validity/summary.json")
  tgt = d["target"]
  cov_t, delta, min_ctx, max_sharp = (tgt["coverage"], tgt["delta"], tgt["min_context"],
                                      tgt["max_sharpness"])
  default = d["default"]["design"]
  cells, plan = d["cells"], d["plan"]
  n_calls = sum(c["n_calls"] for c in cells if c["radius"] == "raw")
  sources = sorted({c["data"] for c in cells})
  out = ["## Does the certificate hold? (the validity study)", ""]
  out += _source(["validity/summary.json", "validity/report.md", "validity/COMMAND.md"],
                 _command(root, "validity/COMMAND.md"))
  out += [f"Every decode call (step x layer x query head) of evaluation-mode {plan['model']}: "
          f"{n_calls:,} calls; designs {', '.join(f'`{x}`' for x in plan['designs'])}; data "
          f"sources {', '.join(sources)}; both regimes; budgets "
          f"{' / '.join(_pct(b) for b in plan['budgets'])}; contexts "
          f"{' / '.join(f'{c:,}' for c in plan['context_lens'])} tokens; {plan['n_steps']} "
          f"decode steps; collection {d['collection_seconds']:,.0f} s. Coverage of the true "
          f"attention error at delta {delta}; sharpness = median r / ||e|| over covered calls. "
          "Calibrated = the shipped scheme (`certkv_jax.robust_calibration`: per regime, "
          "budget and delta, radius bins, the largest per-source split-conformal scale), "
          "each source scored by the calibration fitted on the other sources "
          f"(leave-one-source-out). `{default}`, by context:", ""]
  body = []
  for ctx in plan["context_lens"]:
    raw = _agg(_cells(cells, design=default, radius="raw", context_len=ctx), cov_t)
    cal = _agg(_cells(cells, design=default, radius="calibrated", context_len=ctx), cov_t)
    body.append([f"{ctx:,}",
                 f"{raw['mean']:.3f} / {raw['min']:.3f} / {_f(raw['sharpness'], '.2f')}",
                 f"{cal['mean']:.3f} / {cal['min']:.3f} / {_f(cal['sharpness'], '.2f')}",
                 f"{raw['below']} of {raw['n']} -> {cal['below']} of {cal['n']}"])
  out += _table(["context", "raw: mean / worst cell / sharpness",
                 "calibrated (held out): mean / worst cell / sharpness",
                 f"cells below {cov_t}, raw -> calibrated"], body)
  out += ["", f"Every design and scheme at contexts >= {min_ctx:,} (held-out cells; "
          "`binned_text_fold` / `per_head_text_fold`: fitted on text and scored on the tasks "
          "and the reverse, binned or one scale per (layer, KV head)):", ""]
  body = []
  for design in sorted(d["overview"]):
    for scheme, s in d["overview"][design].items():
      if s is not None:
        body.append([f"`{design}`", scheme, s["n_cells"], f"{s['mean']:.3f}", f"{s['min']:.3f}",
                     s["n_below"], _f(s["sharpness"], ".2f"), _f(s["accuracy"])])
  out += _table(["design", "radius", "cells", "mean coverage", "worst cell",
                 f"cells below {cov_t}", "median sharpness", "task accuracy"], body)

  why = d["why"]
  def r_median(w):
    c = _cells(cells, design=default, radius="calibrated", context_len=w["context_len"],
               regime=w["regime"], data=w["data"], budget=w["budget"])
    return c[0]["R_median"] if c else None
  out += ["", f"Held-out cells of the default setting (`{default}` + calibration) below "
          f"{cov_t} at >= {min_ctx:,} tokens:", ""]
  out += _table(["regime", "data", "budget", "context", "held-out coverage",
                 "in-sample coverage", "radius must grow by", "raw miss rate", "median R"],
                [[w["regime"], w["data"], _pct(w["budget"]), f"{w['context_len']:,}",
                  f"{w['held_out_coverage']:.3f}", f"{w['in_sample_coverage']:.3f}",
                  f"x{w['must_grow_by']:.2f}", f"{w['raw_miss_rate']:.3f}",
                  _f(r_median(w), ".2f")] for w in why])
  sig = d["signals"]
  out += ["", f"Online warning signals: AUC for a raw miss (calls of `{default}` at >= "
          f"{min_ctx:,} tokens, 95% cluster-bootstrap intervals), in the direction fixed "
          "before looking (low warns, except the tail size m: small = miss) and reversed:", ""]
  out += _table(["signal", "AUC as fixed [95% CI]", "1 - AUC [95% CI]", "calls", "miss rate"],
                [[s["signal"], _ci([s["auc"]] + s["ci"]),
                  _ci([1 - s["auc"], 1 - s["ci"][1], 1 - s["ci"][0]]), f"{s['n_calls']:,}",
                  f"{s['miss_rate']:.3f}"] for s in sig])

  # Reading.
  res = d["default_result"]
  met = res["n_below"] == 0 and res["sharpness"] is not None and res["sharpness"] <= max_sharp
  by_data = collections.Counter(w["data"] for w in why)
  covered_in = sum(w["in_sample_coverage"] >= cov_t for w in why)
  grow = _span([w["must_grow_by"] for w in why], ".2f")
  out += ["", "Reading:", ""]
  if why:
    out += [f"* **The target (>= {cov_t} in every held-out cell at >= {min_ctx:,} tokens, "
            f"median sharpness <= {max_sharp:g}) is {'met' if met else 'not met'}.** "
            f"{res['n_below']} of {res['n_cells']} cells stay below, at "
            f"{_span([w['held_out_coverage'] for w in why])} ("
            + ", ".join(f"{k} in {v}" for k, v in by_data.most_common())
            + f"); the radius would have to grow by x{grow} there. Once the same source is "
            f"among the calibration sources, {covered_in} of {len(why)} of these cells reach "
            f"{cov_t} (in-sample {_span([w['in_sample_coverage'] for w in why])})"
            + (": the misses are a shift between task families, which no scale fitted on "
               "other families can promise to cover." if 2 * covered_in > len(why) else ".")]
  else:
    out += [f"* **The target (>= {cov_t} in every held-out cell at >= {min_ctx:,} tokens, "
            f"median sharpness <= {max_sharp:g}) is {'met' if met else 'not met'}** "
            f"(median sharpness {_f(res['sharpness'], '.2f')})."]
  sf = d["sharpness_floor"]
  long_ctx = [c for c in plan["context_lens"] if c >= min_ctx]
  sharp_ctx = [(c, _agg(_cells(cells, design=default, radius="calibrated", context_len=c),
                        cov_t)["sharpness"]) for c in long_ctx]
  out += ["* **Robust costs sharpness.** The calibrated median sharpness is "
          + " and ".join(f"{_f(s, '.2f')} at {c:,}" for c, s in sharp_ctx)
          + f" tokens: the max over sources is set by the hardest source in each bin. Fitted "
          f"on each source's own calls (no shift), the scheme covers {sf['coverage_mean']:.3f} "
          f"at median sharpness {sf['sharpness_median']:.2f} "
          f"({sf['sharpness_min']:.2f}-{sf['sharpness_max']:.2f} over the {sf['cells']} "
          f"regime x budget x source cells at {sf['context_len']:,} tokens): the spread of "
          "||e|| / r within one source sets how sharp a rescaled radius can be."]
  rs = [r_median(w) for w in why]
  out += ["* **What the guarantee is.** The raw radius is design-based and holds where "
          "Assumption 2 holds"
          + (f"; in the failing cells the median R is {_span(rs, '.1f')}" if why else "")
          + ". The calibrated radius holds marginally, per bin, for calls exchangeable with "
          "some mixture of the calibration sources; a source outside that family is not "
          "covered by the argument."]
  by_sig = {s["signal"]: s for s in sig}
  strong = sorted(sig, key=lambda s: -abs(s["auc"] - 0.5))[:3]
  warn = _failing_signal_cells(root)
  out += ["* **Warning signals.** Strongest: "
          + "; ".join(f"{s['signal']} {s['auc']:.3f} as fixed"
                      + (f" ({1 - s['auc']:.3f} reversed)" if s["auc"] < 0.5 else "")
                      for s in strong)
          + (f"; the baseline, the tail size m alone, "
             f"{by_sig['tail size m (smaller = miss)']['auc']:.3f}"
             if "tail size m (smaller = miss)" in by_sig else "")
          + ". An AUC below 0.5 means the warning points the other way from the one fixed "
          "before looking."
          + (f" In the failing calibrated cells the median tail mass and r_hat are below those "
             f"of all calls in only {warn[0]} of {warn[1]} (from `validity/report.md`)."
             if warn else "")]
  # Designs on the data sources every design ran on, at the calibration context.
  calib_ctx = plan["calib_context"]
  designs_at = [x for x in d["overview"]
                if _cells(cells, design=x, radius="raw", context_len=calib_ctx)
                and d["overview"][x].get("raw")]
  common = set.intersection(*[{c["data"] for c in _cells(cells, design=x, radius="raw",
                                                           context_len=calib_ctx)}
                              for x in designs_at])
  parts = []
  for x in sorted(designs_at):
    raw = _agg([c for c in _cells(cells, design=x, radius="raw", context_len=calib_ctx)
                if c["data"] in common], cov_t)
    parts.append(f"`{x}` raw {raw['mean']:.3f} / {raw['min']:.3f}")
  accs = [s["accuracy"] for x in d["overview"].values() for s in x.values()
          if s is not None and s["accuracy"] is not None]
  out += [f"* **Designs** (at {calib_ctx:,} tokens on the {len(common)} sources all ran on: "
          f"{', '.join(sorted(common))}; mean / worst cell): " + "; ".join(parts)
          + f". Task accuracy is {_span(accs)} with every design"
          + (", so the quality at equal memory is measured as the streaming loss instead "
             "(below)." if max(accs) < 0.1 else ".")]
  return out


def _min_tail(root: str) -> list[str]:
  d = _json(root, "validity_min_tail/summary.json")
  v = _json(root, "validity/summary.json")
  cov_t = d["target"]["coverage"]
  plan = d["plan"]
  (design,) = plan["designs"]
  (ctx,) = plan["context_lens"]
  base = v["default"]["design"]
  out = ["## Early deterministic deletions, and the tail floor (`min_tail`)", ""]
  out += _source(["validity_min_tail/summary.json", "validity_min_tail/COMMAND.md",
                  "validity/summary.json"], _command(root, "validity_min_tail/COMMAND.md"))
  out += [f"A fraction budget is a fraction of the tokens seen so far: in the first streaming "
          f"chunks it is at or below the certainty set, so `{base}` evicts the whole tail with "
          f"`pi = eps`, deletions its radius cannot see. `{design}` is `{base}` with a floor of "
          "sampled tail slots (`min_tail`). Raw coverage at delta "
          f"{d['target']['delta']} / sharpness, {', '.join(plan['regimes'])}, {ctx:,} tokens, "
          f"{plan['num_examples']} examples per cell, the same examples for both designs:", ""]
  body, pairs = [], []
  for data in plan["data"]:
    for b in plan["budgets"]:
      new = _cells(d["cells"], design=design, radius="raw", data=data, budget=b,
                   context_len=ctx)
      old = [c for c in _cells(v["cells"], design=base, radius="raw", data=data, budget=b,
                               context_len=ctx) if c["regime"] in plan["regimes"]]
      if not new or not old:
        continue
      pairs.append((data, b, old[0], new[0]))
      body.append([data, _pct(b), f"{_cov(old[0]):.3f} / {_f(old[0]['sharpness'], '.2f')}",
                   f"{_cov(new[0]):.3f} / {_f(new[0]['sharpness'], '.2f')}"])
  out += _table(["data", "budget", f"`{base}`", f"`{design}`"], body)
  low = [p for p in pairs if p[1] < max(plan["budgets"])]
  top = [p for p in pairs if p[1] == max(plan["budgets"])]
  raw = d["overview"][design]["raw"]
  cal = d["overview"][design].get("calibrated")
  out += ["", "Reading:", ""]
  if low:
    worst = min(low, key=lambda p: _cov(p[2]))
    out += [f"* Below {_pct(max(plan['budgets']))}, the floor lifts raw coverage from "
            f"{_span([_cov(p[2]) for p in low])} to {_span([_cov(p[3]) for p in low])} (the "
            f"worst `{base}` cell, {worst[0]} at {_pct(worst[1])}: {_cov(worst[2]):.3f} -> "
            f"{_cov(worst[3]):.3f}) for sharpness {_span([p[2]['sharpness'] for p in low], '.1f')}"
            f" -> {_span([p[3]['sharpness'] for p in low], '.1f')}; at "
            f"{_pct(max(plan['budgets']))} coverage moves by at most "
            f"{max(abs(_cov(p[3]) - _cov(p[2])) for p in top):.3f}."
            + (" Most low-budget streaming misses were early deterministic deletions, not a "
               "failure of the variance estimator."
               if np.mean([_cov(p[3]) - _cov(p[2]) for p in low]) > 0.02 else "")]
  out += [f"* {raw['n_below']} of {raw['n_cells']} raw cells are still below {cov_t}."
          + (f" Calibrated (leave-one-source-out over its {len(plan['data'])} sources): mean "
             f"{cal['mean']:.3f}, worst {cal['min']:.3f}, {cal['n_below']} of {cal['n_cells']} "
             f"below, median sharpness {_f(cal['sharpness'], '.2f')}." if cal else ""),
          "* Not measured: the question-aware regime and the quality at equal memory; the "
          f"floor costs tokens above the budget while the budget is that small. `{base}` keeps "
          "no floor so that the committed runs stay reproducible."]
  return out


def _loss_table(table, budgets, designs) -> list[list]:
  by = {(r["design"], r["budget"]): r for r in table}
  body = []
  for x in designs:
    cells = [by.get((x, b)) for b in budgets]
    sp = [c["spearman"][0] for c in cells if c and c["spearman"]]
    body.append([f"`{x}`"] + [_ci(c["delta_nll"], "+.3f") if c else "-" for c in cells]
                + [" / ".join(_f(s, ".2f") for s in sp) if sp else "- (no certificate)"])
  return body


def _loss_setup(rows) -> str:
  r = rows[0]
  return (f"`{r['text']}`, {len({x['segment'] for x in rows})} segments of "
          f"{r['context_len']:,} tokens streamed in {r['chunk']}-token chunks")


def _design_quality(root: str) -> list[str]:
  t = _json(root, "design_quality/perplexity.json")["table"]
  rows = _rows(root, "design_quality/perplexity_rows.jsonl")
  full = [r for r in t if r["design"] == "full"][0]
  designs = [x for x in dict.fromkeys(r["design"] for r in t) if x != "full"]
  budgets = sorted({r["budget"] for r in t if r["design"] != "full"})
  out = ["## Quality of the randomized designs at equal memory (streaming loss)", ""]
  out += _source(["design_quality/perplexity.json", "design_quality/COMMAND.md"],
                 _command(root, "design_quality/COMMAND.md"))
  out += [f"{_loss_setup(rows)}; full-cache NLL {full['mean_nll']:.3f} nats/token. Delta NLL "
          "vs the full cache [95% bootstrap interval over segments], and the Spearman "
          "correlation of the per-token radius with the per-token NLL increase:", ""]
  out += _table(["design"] + [_pct(b) for b in budgets] + ["Spearman(radius, NLL increase)"],
                _loss_table(t, budgets, designs))
  by = {(r["design"], r["budget"]): r for r in t}
  pairs = [(b, x, y) for b in budgets for x in designs for y in designs if x != y]
  outside = [(b, x, y) for b, x, y in pairs
             if not by[(y, b)]["delta_nll"][1] <= by[(x, b)]["delta_nll"][0]
             <= by[(y, b)]["delta_nll"][2]]
  overlap = all(by[(x, b)]["delta_nll"][1] <= by[(y, b)]["delta_nll"][2]
                for b, x, y in pairs)
  if not outside:
    reading = ("At every budget each design's delta NLL lies inside every other design's 95% "
               "interval: no design buys validity or loses quality measurably here.")
  elif overlap:
    reading = ("At every budget the designs' 95% intervals overlap pairwise, though not every "
               "estimate lies inside the others' intervals ("
               + "; ".join(f"`{x}` at {_pct(b)}: {by[(x, b)]['delta_nll'][0]:+.3f} outside "
                           f"`{y}`'s interval" for b, x, y in outside)
               + "): no design's quality cost is clearly different from another's.")
  else:
    reading = "Some designs' 95% intervals do not overlap: their quality costs differ."
  out += ["", reading]
  return out


# --- the experiment suite -----------------------------------------------------------------

def _section(report: dict, key: str) -> Optional[dict]:
  for s in report["sections"]:
    if key in s and (key != "table" or (s[key] and "damage" in s[key][0])):
      return s
  return None


def _claims(report: dict) -> list[dict]:
  claims = [c for s in report["sections"] for c in s.get("claims", [])]
  ov = report.get("overhead") or {}
  claims += ov["claims"] if "claims" in ov else suite_report.overhead_claims(ov)
  return claims


def _claims_table(report: dict) -> list[str]:
  return _table(["claim (method, section 7)", "paper", "ours (95% CI)", "verdict", "note"],
                [[c["claim"], c["paper"], c["ours"], c["verdict"], c["note"]]
                 for c in _claims(report)])


def _coverage_table(report: dict) -> tuple[list[str], list[dict]]:
  by = [b for b in _section(report, "by")["by"] if b["delta"] == DELTA]
  budgets = sorted({b["budget"] for b in by})
  keys = list(dict.fromkeys((b["design"], b["regime"]) for b in by))
  idx = {(b["design"], b["regime"], b["budget"]): b for b in by}
  body = [[f"`{x}`", r] + [_ci(idx[(x, r, bu)]["coverage"]) if (x, r, bu) in idx else "-"
                           for bu in budgets] for x, r in keys]
  return _table(["design", "regime"] + [_pct(b) for b in budgets], body), by


def _full_cache_accuracy(rows) -> dict:
  acc = collections.defaultdict(list)
  for r in rows:
    if r["design"] == "full":
      acc[r["task"]].append(float(bool(r["correct"])))
  return {k: (float(np.mean(v)), len(v)) for k, v in sorted(acc.items())}


def _r_audit(section: dict) -> list[str]:
  out = []
  for x, a in section["designs"].items():
    cov = a["coverage_by_R"]["coverage"]
    if not any(cov):
      continue
    lo = int(np.argmin(cov))
    where = ("the lowest-R" if lo == 0 else "the highest-R" if lo == len(cov) - 1
             else f"R bin {lo + 1} of {len(cov)}")
    out.append(f"`{x}`: median R {a['R_quantiles']['0.5']:.2f}, max {a['R_max']:.2g}; "
               f"coverage by R quartile (low to high) {' / '.join(f'{c:.2f}' for c in cov)}, "
               f"lowest in {where} bin")
  return out


def _overhead_table(rows, ratios) -> list[str]:
  def ratio(name, vs):
    key = f"ratio_{'cert' if name == 'randomized+certificate' else name}_vs_{vs}"
    return _ci(ratios[key], ".2f") if ratios.get(key) else "-"
  body = [[r["config"], f"`{r['design']}`", f"{r.get('certificate_fraction', 0.0):.3f}",
           r["capacity"], f"{r['median_ms']:.1f}", _mib(r["cache_bytes"]["kv"]),
           ratio(r["config"], "randomized"), ratio(r["config"], "deterministic")]
          for r in rows]
  return _table(["config", "design", "certified calls", "capacity", "ms/step (median)",
                 "K/V MiB", "x randomized [95% CI]", "x deterministic [95% CI]"], body)


def _overhead_setup(rows) -> str:
  r = rows[0]
  return (f"batch {r['batch']}, {r['prompt_len']:,}-token prompt, {r['n_steps']} decode steps, "
          f"budget {_pct(r['budget'])}")


def _suite_quick(root: str) -> list[str]:
  rel = "suite_quick"
  rep = _json(root, f"{rel}/report.json")
  out = ["## The quick suite: the paper's claims on SmolLM2", ""]
  out += _source([f"{rel}/report.json", f"{rel}/report.md", f"{rel}/perplexity.json",
                  f"{rel}/rows.jsonl"], _command(root, f"{rel}/report.md"))
  out += [f"Settings: {_settings_line(root, f'{rel}/report.md')}. Suite time "
          f"{rep['wall_s']:.0f} s. Small samples: wide intervals, weak verdicts.", ""]
  out += _claims_table(rep)
  cov_lines, by = _coverage_table(rep)
  out += ["", f"Coverage of the realised error at delta {DELTA} (mean over rows [95% CI over "
          "examples]):", ""] + cov_lines
  fail = _section(rep, "failure_auc")
  fa, at = fail["failure_auc"], fail["attribution_auc"]
  worst = min(by, key=lambda b: b["coverage"][0])
  n_low = sum(b["coverage"][0] < 1 - DELTA for b in by)
  full_acc = _full_cache_accuracy(_rows(root, f"{rel}/rows.jsonl"))
  within = fail.get("attribution_within_task") or {}
  base = fail.get("attribution_task_baseline")
  out += ["", "Reading:", "",
          f"* Coverage is below the nominal {1 - DELTA:g} in {n_low} of {len(by)} cells; worst "
          f"`{worst['design']}` {worst['regime']} at {_pct(worst['budget'])}: "
          f"{worst['coverage'][0]:.3f}.",
          f"* As a failure predictor the certificate scores AUC {_ci(fa['certificate'])} against "
          f"{_ci(fa['-mean log-prob'])} for the mean output log-probability; for attribution "
          f"{_ci(at['certificate'])} against {_ci(at['-mean log-prob'])}."
          + (f" Attribution is confounded with the task: the full cache answers "
             + ", ".join(f"{k} {a:.2f}" for k, (a, _) in full_acc.items())
             + f", so a score that knows only the task reaches attribution AUC {base[0]:.3f}"
             + (" and no within-task AUC can be computed" if not any(within.values()) else "")
             + "." if base else ""),
          "* Assumption 2: " + "; ".join(_r_audit(_section(rep, "designs"))) + "."]
  # Streaming loss.
  t = _json(root, f"{rel}/perplexity.json")["table"]
  prow = _rows(root, f"{rel}/perplexity_rows.jsonl")
  full = [r for r in t if r["design"] == "full"][0]
  designs = [x for x in dict.fromkeys(r["design"] for r in t) if x != "full"]
  budgets = sorted({r["budget"] for r in t if r["design"] != "full"})
  out += ["", f"Streaming loss ({_loss_setup(prow)}; full-cache NLL {full['mean_nll']:.3f} "
          "nats/token), delta NLL vs the full cache [95% CI over segments]:", ""]
  out += _table(["design"] + [_pct(b) for b in budgets] + ["Spearman(radius, NLL increase)"],
                _loss_table(t, budgets, designs))
  out += ["", "At equal budget the randomized design keeps fewer tokens (capacity rule)."]
  # Overhead.
  orows = _rows(root, f"{rel}/overhead_rows.jsonl")
  ov = rep["overhead"]
  out += ["", f"Overhead per decode step ({_overhead_setup(orows)}; ratios of ms/step with "
          f"95% intervals as stored in `report.json`; rows in "
          f"{_link(f'{rel}/overhead_rows.jsonl')}):", ""] + _overhead_table(orows, ov)
  return out


def _suite_full(root: str) -> list[str]:
  rel = "suite_full_n8_c256"
  rep = _json(root, f"{rel}/report.json")
  out = ["## The larger run: the `--full` plan at reduced size", ""]
  out += _source([f"{rel}/report.json", f"{rel}/report.md", f"{rel}/perplexity.json",
                  f"{rel}/rows.jsonl"], _command(root, f"{rel}/report.md"))
  out += [f"Settings: {_settings_line(root, f'{rel}/report.md')}. The recorded command is the "
          "last invocation (with `--novalidity`), which reran only the streaming SnapKV rows "
          "after the streaming observation-window fix (issue 13) and the analysis, in "
          f"{rep['wall_s']:.0f} s; the other rows were collected before that fix. The "
          "documented `--full` size has not been run.", ""]
  out += _claims_table(rep)
  cov_lines, by = _coverage_table(rep)
  out += ["", f"Coverage of the realised error at delta {DELTA}:", ""] + cov_lines
  reg = _section(rep, "table")["table"]
  acc = collections.defaultdict(list)
  for r in reg:
    acc[(r["design"], r["regime"])].append(r["accuracy"])
  designs = sorted({k[0] for k in acc})
  regimes = sorted({k[1] for k in acc})
  full_acc = _full_cache_accuracy(_rows(root, f"{rel}/rows.jsonl"))
  out += ["", "Task accuracy, mean over task x budget (full cache: "
          + ", ".join(f"{k} {a:.2f} of {n}" for k, (a, n) in full_acc.items()) + "):", ""]
  out += _table(["regime"] + [f"`{x}`" for x in designs],
                [[r] + [_f(np.mean(acc[(x, r)]), ".3f") if (x, r) in acc else "-"
                        for x in designs] for r in regimes])
  rand = [b for b in by if b["coverage"][2] >= 0.01]
  best, worst = (max(rand, key=lambda b: b["coverage"][0]),
                 min(rand, key=lambda b: b["coverage"][0]))
  zero = sorted({b["design"] for b in by if b["coverage"][2] < 0.01})
  out += ["", "Reading:", "",
          (f"* Coverage stays below the nominal {1 - DELTA:g} in every cell: "
           if best["coverage"][0] < 1 - DELTA else "* ")
          + f"best `{best['design']}` "
          f"{best['regime']} at {_pct(best['budget'])} ({best['coverage'][0]:.3f}), worst "
          f"`{worst['design']}` {worst['regime']} at {_pct(worst['budget'])} "
          f"({worst['coverage'][0]:.3f})."
          + (f" {', '.join(f'`{x}`' for x in zero)} (no offset) and the deterministic designs "
             "have radius 0 and cover (almost) nothing." if zero else ""),
          "* Assumption 2: " + "; ".join(_r_audit(_section(rep, "designs"))) + "."]
  # Streaming loss, every design.
  t = _json(root, f"{rel}/perplexity.json")["table"]
  prow = _rows(root, f"{rel}/perplexity_rows.jsonl")
  full = [r for r in t if r["design"] == "full"][0]
  budgets = sorted({r["budget"] for r in t if r["design"] != "full"})
  mid = budgets[len(budgets) // 2]
  ldesigns = sorted({r["design"] for r in t if r["design"] != "full"},
                    key=lambda x: [r["delta_nll"][0] for r in t
                                   if r["design"] == x and r["budget"] == mid][0])
  out += ["", f"Streaming loss ({_loss_setup(prow)}; full-cache NLL {full['mean_nll']:.3f}), "
          f"delta NLL vs the full cache, sorted by the {_pct(mid)} column:", ""]
  out += _table(["design"] + [_pct(b) for b in budgets] + ["Spearman(radius, NLL increase)"],
                _loss_table(t, budgets, ldesigns))
  sp = [r["spearman"][0] for r in t if r["spearman"]]
  out += ["", f"The randomized designs keep fewer tokens (capacity rule); their per-token "
          f"radius has Spearman {_span(sp, '.2f')} with the per-token loss increase."]
  # Theorem 1.
  th = rep["theorem1"]["designs"]
  out += ["", "Theorem 1 (rotating the values of the evicted set): fractions of (example, "
          "draw) pairs with a bit-identical kept set / kept state / decoded tokens / "
          "certificate, the mean true error before and after, and the coverage of the "
          f"unchanged radius against both (source {_link(f'{rel}/theorem1_rows.jsonl')}):", ""]
  out += _table(["design", "n", "kept set", "kept state", "tokens", "radius", "err before",
                 "err after", "cov before", "cov after"],
                [[f"`{x}`", a["n"], f"{a['kept_set_identical']:.2f}",
                  f"{a['retained_identical']:.2f}", f"{a['tokens_identical']:.2f}",
                  f"{a['radius_identical']:.2f}", f"{a['err_orig']:.4f}", f"{a['err_pert']:.4f}",
                  f"{a['coverage_orig']:.3f}", f"{a['coverage_pert']:.3f}"]
                 for x, a in sorted(th.items())])
  det = [a for a in th.values() if a["mean_radius"] == 0]
  rnd = [a for a in th.values() if a["mean_radius"] > 0]
  if det and all(a["retained_identical"] == 1 for a in det) and all(
      a["retained_identical"] < 1 for a in rnd):
    out += ["", "Every deterministic design's kept state is identical whatever the evicted "
            "values were, while its true error changes: it cannot see its own error "
            "(Theorem 1). The randomized design's kept state (the offsets) changes with them."]
  return out


def _overhead_long(root: str) -> list[str]:
  rel = "overhead_long"
  rows = _rows(root, f"{rel}/overhead_rows.jsonl")
  s = overhead_lib.summarize(rows)
  by = {r["config"]: r for r in rows}
  out = ["## Overhead at 2k-token prompts", ""]
  out += _source([f"{rel}/overhead_rows.jsonl", f"{rel}/summary.md"],
                 _command(root, f"{rel}/summary.md"))
  out += [f"{_overhead_setup(rows)}; ratios recomputed from the rows "
          "(`experiments.lib.overhead.summarize`):", ""]
  out += _overhead_table(rows, s)
  full, cert = by["full"], by["randomized+certificate"]
  vs_rand = s["ratio_cert_vs_randomized"]
  out += ["", ("The certificate costs no measurable time here" if vs_rand[1] <= 1 <= vs_rand[2]
               else "The certificate's cost") + f" (x randomized {_ci(vs_rand, '.2f')}); "
          "the evicted cache is "
          f"{full['median_ms'] / cert['median_ms']:.1f}x faster per step than the full one "
          f"(K/V {_mib(cert['cache_bytes']['kv'])} vs {_mib(full['cache_bytes']['kv'])} MiB). "
          "Timings are on a shared VM: compare ratios within a run."]
  return out


def _demo(root: str) -> list[str]:
  rel = "demo_all"
  rows = _rows(root, f"{rel}/rows.jsonl")
  out = ["## Every design on the pass-key demo", ""]
  out += _source([f"{rel}/rows.jsonl", f"{rel}/summary.md"], _command(root, f"{rel}/summary.md"))
  n_ex = sorted({r["num_examples"] for r in rows})
  out += [f"{', '.join(map(str, n_ex))} pass-key examples, prompts of "
          f"{_span([r['prompt_tokens_mean'] for r in rows], '.0f')} tokens on average, delta "
          f"{rows[0]['delta']}. Accuracy / mean ‖e‖ / coverage / median R / kept K/V per "
          "budget; deterministic designs have radius 0, so their coverage is "
          "the share of calls without error:"]
  for regime in sorted({r["regime"] for r in rows}):
    sel = [r for r in rows if r["regime"] == regime]
    designs = list(dict.fromkeys(r["design"] for r in sorted(
        sel, key=lambda r: (r["design"] == "full", r["randomized"], r["design"]))))
    body = []
    for x in designs:
      rs = sorted([r for r in sel if r["design"] == x], key=lambda r: r["budget"])
      body.append([f"`{x}`", " / ".join(f"{r['budget']:g}" for r in rs),
                   " / ".join(f"{r['accuracy']:.2f}" for r in rs),
                   " / ".join(f"{r['mean_true_error']:.2f}" for r in rs),
                   " / ".join(f"{r['coverage']:.3f}" for r in rs),
                   " / ".join(_f(r["median_ratio"], ".1f") for r in rs),
                   " / ".join(_mib(r["kept_kv_bytes"]) for r in rs)])
    out += ["", f"{regime}:", ""]
    out += _table(["design", "budget", "accuracy", "mean ‖e‖", "coverage@0.05", "median R",
                   "kept K/V (MiB)"], body)
  ur = [r["median_ratio"] for r in rows if r["design"] == "uniform_random"]
  out += ["", "`uniform_random` (no offset) has no certificate either"
          + (f" and median R {_span(ur, '.1f')}" if ur else "") + "."]
  return out


def _damage(root: str) -> list[str]:
  rel = "damage"
  d = _json(root, f"{rel}/summary.json")
  norms = np.load(os.path.join(root, rel, "norms.npz"))
  spectral = norms["spectral"]
  plan = d["plan"]
  pt, ptt = d["per_token"]["text_held_out"], d["per_token"]["tasks"]
  att, gat, goals = d["attribution"], d["gating"]["streaming"], d["goals"]
  scores = list(pt) + [k for k in att if k not in pt and k not in ("task",)]
  # The recompute budget the goals are stated at (the report's "at 25%").
  keys = sorted(gat[scores[0]]["vs_random"], key=float)
  gkey = "0.25" if "0.25" in keys else keys[len(keys) // 2]
  out = ["## Does the radius predict output damage? (the damage study)", ""]
  out += _source([f"{rel}/summary.json", f"{rel}/report.md", f"{rel}/COMMAND.md"],
                 _command(root, f"{rel}/COMMAND.md"))
  acc_full = d["full_cache_accuracy"]
  out += [f"{plan['model']}, `{plan['design']}` at {_pct(plan['budget'])}, streaming "
          f"({plan['chunk']}-token chunks), {plan['context_len']:,}-token contexts; the radius "
          "is carried to the residual stream through each head's slice of the output "
          "projection (`certkv_jax.damage`) and a small learned predictor maps it to log KL; "
          f"fitted on {plan['train_segments']} of {plan['text_segments']} text segments, tested "
          f"on the others and on every task ({plan['num_examples']} examples each of "
          f"{', '.join(plan['settings'])}; full-cache accuracy "
          f"{' / '.join(f'{acc_full[k]:.2f}' for k in plan['settings'])}). Truth: the KL "
          "between the full-cache and the evicted next-token distributions.", ""]

  def cell(m, s, key, ci_key):
    return _ci([m[s][key]] + m[s][ci_key]) if s in m and m[s].get(key) is not None else "-"
  g = {k: v["target"] for k, v in goals.items()}
  body = [
      [f"per-token Spearman with KL, held-out text (>= {g['spearman_token_damage']})"]
      + [cell(pt, s, "spearman_kl", "spearman_kl_ci") for s in scores],
      ["per-token AUC for a top-10% KL token, held-out text"]
      + [cell(pt, s, "auc_high_damage", "auc_high_damage_ci") for s in scores],
      ["per-token Spearman with KL, task decode steps"]
      + [cell(ptt, s, "spearman_kl", "spearman_kl_ci") for s in scores],
      [f"attribution AUC within task (>= {g['attribution_auc_within_task']})"]
      + [cell(att, s, "within_task", "within_task_ci") for s in scores],
      [f"gating at {_pct(gkey)}, x random (>= {g['gating_vs_random']})"]
      + [_f(gat[s]["vs_random"][gkey], ".2f") if s in gat else "-" for s in scores],
      [f"gating at {_pct(gkey)}, share of the oracle's gain (>= {g['gating_oracle_share']})"]
      + [_f(gat[s]["oracle_share"][gkey]) if s in gat else "-" for s in scores]]
  out += _table(["metric (goal)"] + [f"`{s}`" for s in scores], body)
  cert = [s for s in scores if s not in ("confidence", "two_run")]
  n_met = sum(v["met"] for v in goals.values())
  quick = _json(root, "suite_quick/perplexity.json")["table"]
  quick_sp = [r["spearman"][0] for r in quick if r["spearman"]]
  a = att[cert[0]]
  cert_sp = _span([pt[s]["spearman_kl"] for s in cert])
  cert_auc = _span([pt[s]["auc_high_damage"] for s in cert])
  evicted = " / ".join(f"{d['evicted_accuracy'][k]:.2f}" for k in plan["settings"])
  all_chance = all(att[s]["within_task_ci"][0] <= 0.5 <= att[s]["within_task_ci"][1]
                   for s in scores if s in att)
  out += ["", "`damage_bound`: the analytic bound (||W_o^h||_2 r_h summed over heads and "
          "layers); `damage_rms`: the same with the RMS gain; `radius`: the raw radii summed; "
          "`confidence`: the evicted model's own predictive entropy (text) or the answer's "
          "negative log-probability (tasks); `two_run`: disagreement of two evicted runs.", "",
          "Reading:", "",
          f"* **{n_met} of {len(goals)} goals met.** Per token on held-out text, the "
          f"certificate-based scores rank the damage at {cert_sp} against "
          f"{pt['confidence']['spearman_kl']:.3f} for confidence, and flag the worst "
          f"10% of tokens at AUC {cert_auc} against "
          f"{pt['confidence']['auc_high_damage']:.3f} (the quick suite's `poisson_tail` "
          f"streaming-loss Spearman was {_span(quick_sp, '.2f')}).",
          f"* The projection through `W_o` adds nothing: per-head spectral gains range over "
          f"{spectral.min():.1f}-{spectral.max():.1f}, yet `damage_bound` ranks at "
          f"{pt['damage_bound']['spearman_kl']:.3f} against {pt['radius']['spearman_kl']:.3f} "
          f"for the raw radius; the learned predictor adds "
          f"{pt['learned']['spearman_kl'] - pt['radius']['spearman_kl']:+.3f} and does not "
          "transfer: at the tasks' decode steps every certificate score correlates "
          f"{_span([ptt[s]['spearman_kl'] for s in cert], '.2f')} with the KL, confidence "
          f"{ptt['confidence']['spearman_kl']:.2f}.",
          f"* The evicted model's accuracy per setting is {evicted}; "
          f"{a['n_cache_induced']} of its {a['n_failures']} failures are cache-induced"
          + (", and no score separates them from the inherent ones (every within-task "
             "interval includes 0.5)" if all_chance else "")]
  out[-1] += (f"; the oracle reaches {gat['oracle']['oracle_share'][gkey]:.3f} of its gain at "
              f"{_pct(gkey)}. On a retrieval answer the output is decided by whether one needle "
              "token survived, which a per-call variance bound over the kept tail does not see.")
  out += ["* Not tried: 50% budgets, scores combining radius and confidence, predictors "
          "trained on task steps."]
  return out


# --- benchmarks ---------------------------------------------------------------------------

def _kernels(root: str) -> list[str]:
  d = _json(root, "bench_cpu.json")
  rows = d["rows"]
  out = ["## Kernels: cost of the certificate statistics", ""]
  out += _source(["bench_cpu.json", "bench_cpu.md"], _command(root, "bench_cpu.md"))
  r0 = rows[0]
  out += [f"Device {d['device']}; batch {r0['batch']}, GQA group {r0['groups']}, "
          f"{r0['dtype']}, {r0['rounds']} interleaved rounds. ms per call (median), and ratios "
          "to `xla_offset` (the same offset attention without statistics): `stats_stored_exact` "
          "(the models' path: stored ||v||^2, exact range term), `stats_stored` (range bound) "
          "[order-statistic interval], `stats_bound` (recomputed from the values); "
          "`stats_exact` against plain attention:", ""]
  body = [[r["n"], r["d"], f"{r['seconds']['plain'] * 1e3:.3f}",
           f"{r['seconds']['xla_offset'] * 1e3:.3f}", f"{r['exact_over_offset']:.2f}x",
           f"{r['stats_over_offset']:.2f}x [{r['stats_over_offset_interval'][0]:.2f}, "
           f"{r['stats_over_offset_interval'][1]:.2f}]", f"{r['recompute_over_offset']:.2f}x",
           f"{r['ratio_to_plain']['stats_exact']:.2f}x"] for r in rows]
  out += _table(["n", "d", "plain ms", "xla_offset ms", "stored exact / offset",
                 "stored bound / offset", "recompute / offset", "stats_exact / plain"], body)
  big = [r for r in rows if r["n"] >= 4096]
  target = 1.15
  met = all(r["exact_over_offset"] <= target for r in big)
  exact = _span([r["exact_over_offset"] for r in big], ".2f")
  recompute = _span([r["ratio_to_plain"]["stats_exact"] for r in big], ".2f")
  out += ["", f"At n >= 4k the models' path costs {exact}x of the offset attention without "
          f"statistics; recomputed from the values, the statistics cost {recompute}x "
          f"of plain attention. The {target}x target of issue 15 is "
          f"{'met' if met else 'not met'} on this device. Methods timed: "
          f"{', '.join(f'`{m}`' for m in r0['seconds'])}."]
  odd = [r for r in rows if r["ratio_to_plain"]["xla_offset"] > 1.5]
  if odd:
    out[-1] += (" In the " + ", ".join(f"n = {r['n']}, d = {r['d']}" for r in odd)
                + " row XLA's own offset path takes "
                + ", ".join(f"{r['ratio_to_plain']['xla_offset']:.2f}x" for r in odd)
                + " of plain, so its ratios are not comparable.")
  return out


def _decode_table(s) -> list[str]:
  budgets = sorted(s["ratio_vs_full"], key=float)
  ctxs = sorted(s["full_ms"], key=int)
  amort = next(iter(s.get("ratio_vs_full_amortized", {}).items()), (None, None))
  k = amort[0].replace("every_", "") if amort[0] else None
  body = []
  for c in ctxs:
    row = [f"{int(c):,}", f"{s['full_ms'][c]:.1f}"]
    for b in budgets:
      lo, hi = s["ratio_vs_full_ci"][b][c]
      row.append(f"{s['ratio_vs_full'][b][c]:.2f} [{lo:.2f}, {hi:.2f}]"
                 + (f" / {amort[1][b][c]:.2f}" if k else "")
                 + f" ({s['bytes_ratio_vs_full'][b][c]:.2f})")
    body.append(row)
  return _table(["context", "full ms/step"]
                + [f"{_pct(b)}: k=1 [95% CI]" + (f" / k={k}" if k else "") + " (bytes)"
                   for b in budgets], body)


def _bench_decode(root: str) -> list[str]:
  s1 = _json(root, "bench_decode/summary.json")
  s8 = _json(root, "bench_decode_batch8/summary.json")
  out = ["## Decode benchmark", ""]
  out += _source(["bench_decode/summary.json", "bench_decode/COMMAND.md"],
                 _command(root, "bench_decode/COMMAND.md"))
  out += [f"One jitted decode step of `{s1['design']}` "
          f"{'with' if s1['certificate'] else 'without'} the certificate against the full "
          f"cache ({s1['device']}; caches {s1['capacity_layout']}): ratio of ms per step to the "
          "full cache's, evicting after every step (k=1) or amortized, and in parentheses the "
          "bytes ratio (weights + the step's cache over weights + the full cache). "
          f"Batch {s1['batch']}:", ""]
  out += _decode_table(s1)
  out += ["", f"Batch {s8['batch']} ({_link('bench_decode_batch8/summary.json')}, command "
          f"`{_command(root, 'bench_decode_batch8/COMMAND.md')}`):", ""]
  out += _decode_table(s8)
  c_max = max(s1["full_ms"], key=int)
  budgets = sorted(s1["ratio_vs_full"], key=float)
  hit = [(b, c) for b in budgets for c in s1["full_ms"] if int(c) >= 2048
         and s1["ratio_vs_full"][b][c] <= float(b) + 0.1]
  pre = s1["prefill"]
  at_max = " / ".join(f"{s1['ratio_vs_full'][b][c_max]:.2f}" for b in budgets)
  bytes_max = " / ".join(f"{s1['bytes_ratio_vs_full'][b][c_max]:.2f}" for b in budgets)
  targets = " / ".join(f"{float(b) + 0.1:.3g}" for b in budgets)
  cached = ", ".join(f"{pre['cached_tokens_per_s'][c]:,.0f}"
                     for c in sorted(pre["cached_tokens_per_s"], key=int))
  plain = ", ".join(f"{pre['plain_tokens_per_s'][c]:,.0f}"
                    for c in sorted(pre["plain_tokens_per_s"], key=int))
  out += ["", f"The (b + 0.1) target of issue 15 at >= 2k tokens is "
          f"{'met in ' + str(len(hit)) + ' cells' if hit else 'not met'}: at "
          f"{int(c_max):,} tokens the ratios are {at_max} (target {targets}), and a step "
          f"that read every byte once would still cost {bytes_max} of the full one: the "
          f"weights outweigh the cache at batch 1. Cached prefill: {cached} tokens/s against "
          f"the plain forward's {plain} (dense [seq, seq] softmax)."]
  for key, a in list(s8.get("ratio_vs_full_amortized", {}).items())[:1]:
    b8 = sorted(s8["ratio_vs_full"], key=float)
    for c in sorted(s8["full_ms"], key=int):
      amortized = " / ".join(f"{a[b][c]:.2f}" for b in b8)
      per_step = " / ".join(f"{s8['ratio_vs_full'][b][c]:.2f}" for b in b8)
      nbytes = " / ".join(f"{s8['bytes_ratio_vs_full'][b][c]:.2f}" for b in b8)
      out += ["", f"At batch {s8['batch']}, {int(c):,} tokens, evicting "
              f"{key.replace('_', ' ')} steps instead of every step gives {amortized} against "
              f"{per_step} (bytes ratios {nbytes})."]
  return out


def _sharding(root: str) -> list[str]:
  rows = _rows(root, "bench_sharding_cpu.jsonl")
  out = ["## Sharded decoding (fake CPU devices)", ""]
  n_dev = max(r["devices"] for r in rows)
  out += [f"Source: {_link('bench_sharding_cpu.jsonl')}, {_link('bench_sharding_cpu.md')}. "
          f"Command: `python -m experiments.bench_sharding --fake_devices={n_dev} "
          "--out=experiments/results/bench_sharding_cpu.md` with the model flags of the setup "
          "below (the exact flag values were not recorded with the run).", ""]
  out += [f"{rows[0]['setup']}", ""]
  body = [[r["mesh"], r["devices"], f"{_mib(r['cache_bytes_per_device'])} of "
           f"{_mib(r['cache_bytes_total'])}", f"{r['cache_fraction_per_device']:.4f}",
           f"{_mib(r['param_bytes_per_device'])}", f"{_mib(r['xla_temp_bytes'])}",
           f"{r['ms_per_token']:.1f}", r["same_tokens"], f"{r['max_logit_diff']:.2e}"]
          for r in rows]
  out += _table(["mesh (data x model x seq)", "devices", "cache MiB / device", "fraction",
                 "params MiB / device", "XLA temp MiB / device", "ms / token",
                 "same tokens as 1 device", "max logit diff"], body)
  multi = [r for r in rows if r["devices"] > 1]
  frac = _span([r["cache_fraction_per_device"] for r in multi], ".4f")
  same = sum(bool(r["same_tokens"]) for r in multi)
  out += ["", f"On {n_dev} devices each holds {frac} of the cache for every mesh shape; "
          f"tokens equal one device's in {same} of {len(multi)} sharded runs, logits to "
          f"{max(r['max_logit_diff'] for r in multi):.1e}. Fake devices share the host's cores: "
          "the times measure the partitioned program's overhead, not a speed-up."]
  return out


def _montecarlo(root: str) -> list[str]:
  rows = _rows(root, "montecarlo/rows.jsonl")
  out = ["## Synthetic Monte Carlo of the certificate", ""]
  out += [f"Source: {_link('montecarlo/rows.jsonl')} (full table: "
          f"{_link('montecarlo/summary.md')}). Command: "
          "`python -m experiments.montecarlo_certificate --out=DIR` (defaults).", ""]
  rand = [r for r in rows if r["randomized"]]
  problems = sorted({r["problem"] for r in rows})
  out += [f"Problems {', '.join(problems)}; {rows[0]['context_len']} tokens, d = "
          f"{rows[0]['head_dim']}; {', '.join(sorted({str(r['n_trials']) for r in rand}))} draws "
          f"per randomized design; {sum(r['seconds'] for r in rows):.0f} s summed over rows. "
          "The spike problem, streaming, at the smallest budget:", ""]
  b0 = min(r["budget"] for r in rows)
  sel = sorted([r for r in rows if r["problem"] == "spike" and r["regime"] == "streaming"
                and r["budget"] == b0], key=lambda r: (r["randomized"], r["mse"]))
  out += _table(["design", "kept (of budget)", "MSE", "E[V_hat]/MSE", "cov@0.01", "cov@0.05",
                 "sharp@0.05", "median R"],
                [[f"`{r['design']}`", f"{r['mean_kept']:.1f} of {r['budget_tokens']}",
                  f"{r['mse']:.3g}", f"{r['var_ratio']:.3f}", f"{r['coverage']['0.01']:.3f}",
                  f"{r['coverage']['0.05']:.3f}", _f(r["sharpness"]["0.05"], ".2f"),
                  f"{r['median_R']:.3g}" if r["randomized"] or r["median_R"] else "-"]
                 for r in sel])
  rs = [r for r in sel if r["randomized"] and r["var_ratio"] > 0]
  hi = max(rs, key=lambda r: r["median_R"]) if rs else None
  lo = min(rs, key=lambda r: r["median_R"]) if rs else None
  zero = [r["design"] for r in sel if r["var_ratio"] == 0]
  out += ["", f"{', '.join(f'`{x}`' for x in zero)} have V_hat = 0, a zero radius, and cover "
          "no non-zero error (Theorem 1)."]
  if hi and lo:
    out[-1] += (f" Where R is large the certificate under-covers (`{hi['design']}`: R "
                f"{hi['median_R']:.3g}, coverage {hi['coverage']['0.05']:.3f} at delta 0.05); "
                f"where it is small it covers (`{lo['design']}`: R {lo['median_R']:.3g}, "
                f"{lo['coverage']['0.05']:.3f}). At equal memory the randomized designs keep "
                f"fewer tokens ({_span([r['mean_kept'] for r in rs], '.0f')} of "
                f"{rs[0]['budget_tokens']} slots), the cost of the capacity rule.")
  return out


def _not_measured(root: str) -> list[str]:
  devices = sorted({_json(root, "bench_cpu.json")["device"],
                    _json(root, "bench_decode/summary.json")["device"]})
  return ["## What is not measured", "",
          f"* Every committed benchmark ran on {' and '.join(devices)}: the compiled Pallas "
          "kernels (Triton, Mosaic), GPU/TPU speed-ups and the suggested mesh layouts have not "
          "been measured on hardware.",
          "* The documented `--full` suite size has not been run as one command; the committed "
          "larger run is the reduced one above.",
          "* The tail floor (`min_tail`): its question-aware regime and its quality at equal "
          "memory. The damage study: 50% budgets and predictors trained on task steps."]


def render(results_dir: str) -> str:
  """The markdown of ``docs/results.md`` from the summaries under ``results_dir``."""
  root = os.path.abspath(results_dir)
  sections = [_validity, _min_tail, _design_quality, _suite_quick, _suite_full,
              _overhead_long, _demo, _damage, _kernels, _bench_decode, _sharding, _montecarlo,
              _not_measured]
  lines = ["# Measured results", "",
           f"Generated by `{COMMAND}` from the committed summaries under "
           f"[`experiments/results/`]({LINK}/); do not edit by hand (`{COMMAND} --check` "
           "fails when this file differs from what the summaries give). Every run is on the "
           "project's shared CPU VM unless its section says otherwise; each section names its "
           "source files and the command that produced them.", ""]
  titles = []
  body = []
  for fn in sections:
    part = fn(root)
    titles.append(part[0][3:])
    body += [""] + part
  lines += ["Sections:", ""] + [
      f"* [{t}](#{_anchor(t)})" for t in titles]
  lines += body
  return "\n".join(lines).rstrip("\n") + "\n"


def _anchor(title: str) -> str:
  """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
  s = re.sub(r"[^\w\- ]", "", title.lower())
  return s.replace(" ", "-")


def write(out: str, results_dir: str) -> str:
  """Renders and writes ``out`` atomically; returns the text."""
  text = render(results_dir)
  results_io.atomic_write_text(out, text)
  return text


def check(out: str, results_dir: str) -> Optional[str]:
  """None when ``out`` equals the rendering, else a one-line reason."""
  text = render(results_dir)
  if not os.path.exists(out):
    return f"{out} does not exist; run `{COMMAND} --out={out}`"
  with open(out, encoding="utf-8") as f:
    on_disk = f.read()
  if on_disk == text:
    return None
  a, b = on_disk.splitlines(), text.splitlines()
  line = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
  return (f"{out} differs from the committed summaries (first at line {line + 1}); "
          f"run `{COMMAND} --out={out}`")
