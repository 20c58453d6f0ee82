"""Streaming vs question-aware eviction: accuracy and damage (experiment 8)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from experiments.lib.analyses import common


def regimes_analysis(rows, plot_dir: Optional[str] = None) -> dict:
  """Accuracy by regime, design and budget; damage = full accuracy - evicted (experiment 8)."""
  del plot_dir
  full = common.full_correct(rows)
  ev = [r for r in rows if r["design"] != "full" and r["run"] == 0
        and (r["task"], r["example"]) in full]
  md = ["## Streaming vs question-aware (experiment 8)", "",
        "Damage = full-cache accuracy - evicted accuracy on the same examples (CI over "
        "examples).", ""]
  out = {"claims": [], "table": []}
  body = []
  for regime in sorted({r["regime"] for r in ev}):
    for d in sorted({r["design"] for r in ev}):
      for t in sorted({r["task"] for r in ev}):
        for b in sorted({r["budget"] for r in ev}):
          sel = common.select(ev, regime=regime, design=d, task=t, budget=b)
          if not sel:
            continue
          dmg = np.asarray([float(full[(r["task"], r["example"])]) - float(r["correct"])
                            for r in sel])
          ci = common.ci(np.mean, dmg, groups=common.example_groups(sel))
          acc = float(np.mean([r["correct"] for r in sel]))
          out["table"].append({"regime": regime, "design": d, "task": t, "budget": b,
                               "accuracy": acc, "damage": None if ci is None else list(ci)})
          body.append([regime, d, t, b, f"{acc:.2f}", common.fmt_ci(ci), len(sel)])
  md += common.table(["regime", "design", "task", "budget", "accuracy", "damage", "n"], body)
  fa = {}
  for t in sorted({k[0] for k in full}):
    fa[t] = float(np.mean([v for k, v in full.items() if k[0] == t]))
  md += ["", "Full-cache accuracy: " + ", ".join(f"{t} {v:.2f}" for t, v in fa.items())]

  def damage(sel):
    return np.asarray([float(full[(r["task"], r["example"])]) - float(r["correct"])
                       for r in sel])
  qa = [r for r in ev if r["regime"] == "question_aware" and r["budget"] >= 0.25]
  if qa:
    ci = common.ci(np.mean, damage(qa), groups=common.example_groups(qa))
    out["claims"].append(common.claim(
        "question-aware eviction at 25-50% budgets is nearly free (accuracy damage)",
        "~0 (band -0.05-0.05)", ci, common.verdict_of((-0.05, 0.05), ci, "lower"),
        "pooled over designs and tasks"))
  st = [r for r in ev if r["regime"] == "streaming" and r["budget"] >= 0.25]
  both = {(r["design"], r["task"], r["example"], r["budget"]) for r in st} & {
      (r["design"], r["task"], r["example"], r["budget"]) for r in qa}
  if both:
    keyf = lambda r: (r["design"], r["task"], r["example"], r["budget"])
    st_d = {keyf(r): r for r in st if keyf(r) in both}
    qa_d = {keyf(r): r for r in qa if keyf(r) in both}
    ks = sorted(both)
    diff = damage([st_d[k] for k in ks]) - damage([qa_d[k] for k in ks])
    grp = np.asarray([f"{k[1]}:{k[2]}" for k in ks])
    ci = common.ci(np.mean, diff, groups=grp)
    out["claims"].append(common.claim(
        "the damage is in streaming: damage(streaming) - damage(question-aware), 25-50%",
        "> 0", ci, common.verdict_of((1e-9, 1.0), ci, "higher"), "paired over (design, example)"))
  out["md"] = "\n".join(md)
  return out
