"""The streaming-loss table: by design x budget, the mean delta NLL against the full
cache with a 95% bootstrap interval over segments, the perplexity ratio vs full and
the mean radius-vs-loss-increase correlation (``--out/perplexity.md``)."""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

import numpy as np

from experiments.lib import design_defaults
from experiments.lib import results_io
from experiments.lib import stats
from experiments.lib.streaming_loss import core as streaming_loss_core

SUMMARY_FILE = "perplexity.md"


def _fmt(x, spec=".3f") -> str:
  return "-" if x is None or not math.isfinite(x) else format(x, spec)


def _ci(values, seed: int) -> Optional[stats.Interval]:
  v = np.asarray(values, np.float64)
  if v.size == 0:
    return None
  if v.size == 1:
    return stats.Interval(float(v[0]), float("nan"), float("nan"))
  return stats.bootstrap_ci(np.mean, v, n_boot=1000, seed=seed)


def summarize(rows: Sequence[dict], out_dir: Optional[str] = None, seed: int = 0) -> dict:
  """Design x budget table of the streaming loss; writes ``out_dir/perplexity.md``.

  Segments are the unit of the bootstrap: a randomized design's runs are
  averaged per segment first. ``delta NLL`` is against the full cache on the
  same segments; the perplexity ratio is ``exp(mean delta NLL)`` (every
  segment scores the same number of tokens); the correlation is the mean over
  rows of the per-row Spearman correlation (tokens after the first chunk)
  between the summed radius and the NLL increase.

  Returns:
    ``{"md": markdown, "table": [per design/budget dicts], "rows": n}``.
  """
  full = {r["segment"]: r for r in rows if r["design"] == "full"}
  cells = {}
  for r in rows:
    cells.setdefault((r["design"], r["budget"]), []).append(r)
  designs = design_defaults.names()
  rank = lambda d: designs.index(d) if d in designs else len(designs)
  order = sorted(cells, key=lambda k: (rank(k[0]), k[0], k[1]))  # full first
  table, body = [], []
  for d, b in order:
    rs = cells[(d, b)]
    by_seg = {}
    for r in rs:
      by_seg.setdefault(r["segment"], []).append(r)
    segs = sorted(by_seg)
    seg_mean = lambda f: np.asarray([np.mean([r[f] for r in by_seg[s]]) for s in segs])
    nll = seg_mean("mean_nll")
    paired = [s for s in segs if s in full]
    delta = np.asarray([np.mean([r["delta_nll"] for r in by_seg[s]]) for s in paired])
    late = np.asarray([np.mean([r["delta_nll_after_first_chunk"] for r in by_seg[s]])
                       for s in paired if all(r["delta_nll_after_first_chunk"] is not None
                                              for r in by_seg[s])])
    corr_seg = []
    for s in segs:
      c = [r["spearman_radius_increase"] for r in by_seg[s]
           if r.get("spearman_radius_increase") is not None]
      if c:
        corr_seg.append(float(np.mean(c)))
    ci = _ci(delta, seed)
    cci = _ci(corr_seg, seed)
    radius = [r["mean_radius"] for r in rs if r.get("mean_radius") is not None]
    entry = dict(design=d, budget=b, n_segments=len(segs), n_rows=len(rs),
                 mean_nll=float(nll.mean()), perplexity=float(np.exp(nll.mean())),
                 delta_nll=None if ci is None else list(ci),
                 delta_nll_after_first_chunk=streaming_loss_core.mean_or_none(late),
                 ppl_ratio=None if ci is None else float(np.exp(ci.estimate)),
                 spearman=None if cci is None else list(cci),
                 mean_radius=streaming_loss_core.mean_or_none(radius))
    table.append(entry)
    ci_txt = "-" if ci is None else (f"{ci.estimate:+.4f}" + (
        f" [{ci.lo:+.4f}, {ci.hi:+.4f}]" if math.isfinite(ci.lo) else ""))
    cc_txt = "-" if cci is None else (f"{cci.estimate:.3f}" + (
        f" [{cci.lo:.3f}, {cci.hi:.3f}]" if math.isfinite(cci.lo) else ""))
    body.append([d, f"{b:g}", f"{len(segs)} x {len(rs) // max(len(segs), 1)}",
                 _fmt(entry["mean_nll"]), _fmt(entry["perplexity"], ".2f"), ci_txt,
                 "-" if d == "full" else _fmt(entry["delta_nll_after_first_chunk"], "+.4f"),
                 _fmt(entry["ppl_ratio"], ".3f"), cc_txt, _fmt(entry["mean_radius"], ".3g")])
  first = rows[0] if rows else {}
  md = ["## Streaming loss under eviction", ""]
  if rows:
    md += [f"Text `{first['text']}` (sha256 {first['text_sha256'][:12]}), model "
           f"{first['model']}, segments of {first['context_len']} tokens streamed in chunks of "
           f"{first['chunk']}; budgets are fractions of the tokens seen. Delta NLL (nats/token) "
           "is against the full cache on the same segments, with a 95% bootstrap interval "
           "over segments; ppl ratio = exp(mean delta NLL). Spearman: per-token certificate "
           f"radius (delta {first.get('delta', streaming_loss_core.DELTA)}, summed over layers and "
           "heads) vs "
           "per-token NLL increase, tokens after the first chunk, mean over rows ('-': "
           "radius 0 everywhere, no certificate).", ""]
  md += ["| design | budget | segments x runs | mean NLL | ppl | delta NLL vs full [95% CI] | "
         "delta NLL after chunk 1 | ppl ratio | Spearman(radius, NLL increase) | "
         "mean radius |", "|" + "---|" * 10]
  md += ["| " + " | ".join(row) + " |" for row in body]
  out = {"md": "\n".join(md), "table": table, "rows": len(rows)}
  if out_dir:
    results_io.atomic_write_text(os.path.join(out_dir, SUMMARY_FILE), out["md"] + "\n")
    results_io.atomic_write_text(
        os.path.join(out_dir, "perplexity.json"),
        json.dumps(results_io.json_safe({"table": table, "rows": len(rows)}), indent=1))
  return out
