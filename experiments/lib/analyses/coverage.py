"""Certificate coverage by design, budget, regime, task, delta, layer and head
(method, section 5; experiment 2)."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from experiments.lib import plots
from experiments.lib.analyses import common


def coverage_analysis(rows, plot_dir: Optional[str] = None) -> dict:
  """Coverage by design, budget, regime, task, delta, layer and head (method, section 5, 8.2)."""
  rand = [r for r in rows if r["randomized"] and r["run"] == 0]
  designs = sorted({r["design"] for r in rand})
  deltas = sorted({float(d) for r in rand for d in r["coverage"]})
  md = ["## Certificate coverage (method, section 5; experiment 2)", "",
        "Coverage = fraction of decode calls (step x layer x head) with true error <= "
        "radius; mean over rows, CI over examples. Sharpness = median radius/error over "
        "covered calls.", ""]
  out = {"by": [], "claims": [], "plots": []}
  body = []
  for d in designs:
    for regime in sorted({r["regime"] for r in rand}):
      for b in sorted({r["budget"] for r in rand}):
        sel = common.select(rand, design=d, regime=regime, budget=b)
        if not sel:
          continue
        g = common.example_groups(sel)
        cells = []
        for delta in deltas:
          cov = np.asarray([r["coverage"][str(delta)] for r in sel])
          ci = common.ci(np.mean, cov, groups=g)
          cells.append(common.fmt_ci(ci))
          out["by"].append({"design": d, "regime": regime, "budget": b, "delta": delta,
                            "coverage": None if ci is None else list(ci), "n_rows": len(sel)})
        sharp = [r["sharpness"] for r in sel if r["sharpness"] is not None]
        body.append([d, regime, b] + cells + [
            f"{np.median(sharp):.2f}" if sharp else "n/a",
            f"{np.mean([r['mean_err'] for r in sel]):.4f}",
            f"{np.mean([r['mean_radius'] for r in sel]):.4f}", len(sel)])
  md += common.table(["design", "regime", "budget"] + [f"cov@{d}" for d in deltas]
                    + ["sharpness", "mean err", "mean radius", "rows"], body)
  # by task
  md += ["", "By task (delta = 0.05):", ""]
  body = []
  for d in designs:
    for t in sorted({r["task"] for r in rand}):
      sel = common.select(rand, design=d, task=t)
      cov = np.asarray([r["coverage"]["0.05"] for r in sel])
      ci = common.ci(np.mean, cov, groups=common.example_groups(sel))
      body.append([d, t, common.fmt_ci(ci), len(sel)])
  md += common.table(["design", "task", "cov@0.05", "rows"], body)
  # per layer / head
  for what in ("layer", "head"):
    md += ["", f"Coverage at delta = 0.05 by {what} (mean over rows):", ""]
    body = []
    for d in designs:
      sel = common.select(rand, design=d)
      vec = np.mean([r[f"cov_{what}"] for r in sel], axis=0)
      body.append([d, " ".join(f"{x:.2f}" for x in vec), f"{vec.min():.3f}"])
    md += common.table(["design", f"per {what}", "min"], body)
  # headline claim: primary design, every budget, delta 0.05
  prim = common.select(rand, design=common.PRIMARY)
  for b in sorted({r["budget"] for r in prim}):
    sel = common.select(prim, budget=b)
    cov = np.asarray([r["coverage"]["0.05"] for r in sel])
    ci = common.ci(np.mean, cov, groups=common.example_groups(sel))
    out["claims"].append(common.claim(
        f"coverage of realised error ({common.PRIMARY}, budget {b}, delta 0.05, both regimes)",
        "0.969-0.977", ci, common.verdict_of(common.PAPER["coverage"], ci, "higher")))
  if prim:
    cov = np.asarray([r["coverage"]["0.05"] for r in prim])
    ci = common.ci(np.mean, cov, groups=common.example_groups(prim))
    out["claims"].insert(0, common.claim(
        f"coverage of realised error ({common.PRIMARY}, all budgets, delta 0.05)", "0.969-0.977",
        ci, common.verdict_of(common.PAPER["coverage"], ci, "higher")))
  if plot_dir and rand:
    nominal = [1.0 - d for d in deltas]
    emp = {d: [float(np.mean([r["coverage"][str(x)] for r in common.select(rand, design=d)]))
               for x in deltas] for d in designs}
    out["plots"].append(plots.plot_coverage(nominal, emp, os.path.join(
        plot_dir, "coverage.png"), title="Certificate coverage vs nominal"))
    samp = [r["sample"] for r in common.select(rand, design=common.PRIMARY)]
    if samp:
      err = np.concatenate([s["err"] for s in samp])
      rad = np.concatenate([s["radius"] for s in samp])
      if np.any((err > 0) & (rad > 0)):
        out["plots"].append(plots.plot_error_vs_radius(
            err, rad, os.path.join(plot_dir, "error_vs_radius.png"),
            title=f"{common.PRIMARY}: true error vs radius (delta 0.05)"))
  md += [""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in out["plots"]]
  out["md"] = "\n".join(md)
  return out
