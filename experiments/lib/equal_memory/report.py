"""The equal-memory comparison: paired differences, coverage, the table and the plot.

Per context length and memory, over the evaluation segments:

* ``delta_nll[variant][memory]``: mean NLL increase over the full cache, 95%
  bootstrap interval over segments;
* ``best_deterministic[memory]``: the deterministic variant with uniform
  budgets and the lowest mean (picked on the same segments, which favours it);
* ``paired_vs_best_deterministic[variant][memory]``: the mean over segments of
  the variant's minus the best deterministic variant's NLL increase on the
  same segment, with a 95% cluster bootstrap over segments (a segment is one
  cluster: one row per segment and variant);
* ``paired_twin[design][memory]``: a certified twin (``<design>_cert``) minus
  its own deterministic design on the same segments, bootstrapped likewise
  (keyed by the deterministic variant, or by the twin where a design has
  several; ``"design"`` and ``"twin"`` name the pair), and
  ``paired_twin_by_quarter`` the same by quarter of the evicted chunks;
* for randomized variants, raw coverage of the per-call radius at delta 0.05
  and calibrated coverage with per-(layer, KV head) split-conformal scales
  fitted on the calibration segments (other source files), each with its
  sharpness (median radius / error over covered calls with error > 0), and
  the share of calls with radius 0 but a nonzero error (deletions the
  certificate cannot see).

Only variants with every row present are reported; the others are listed as
not run.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import matplotlib
matplotlib.use("Agg")
import numpy as np  # pylint: disable=g-import-not-at-top

from certkv_jax import calibration
from experiments.lib import plots
from experiments.lib import results_io
from experiments.lib import stats
from experiments.lib import variants
from experiments.lib.equal_memory import experiment

DELTA = 0.05
N_BOOT = 2000


def _ci(values, seed) -> dict:
  v = np.asarray(values, np.float64)
  iv = stats.bootstrap_ci(np.mean, v, n_boot=N_BOOT, seed=seed)
  return {"value": float(np.mean(v)), "ci": [float(iv.lo), float(iv.hi)], "n": int(v.size)}


def _scores(out_dir, c, variant, split, memory, plan, prefix="m", rows=()) -> Optional[list]:
  """The conformity scores ``[calls, layers, heads]`` of a split at one memory,
  one array per segment: of the raw radius (``prefix`` "m") or of the smoothed
  one ("w"; None where the calls were stored without it). With the segments'
  ``rows``, calls stored from before the first eviction (the cache still whole:
  ``experiment.first_evicted``) are left out."""
  n = plan.n_eval if split == "eval" else plan.n_calib
  by_seg = {r["segment"]: r for r in rows if r["context_len"] == c and r["variant"] == variant
            and r["split"] == split and r["memory"] == memory}
  parts = []
  for start in range(0, n, plan.group):
    path = os.path.join(out_dir, "calls", f"{c}_{variant}_{split}_{start}_seed{plan.seed}.npz")
    if not os.path.exists(path):
      return None
    with np.load(path) as z:
      for k in z.files:
        seg = int(k.rsplit("_s", 1)[1]) if k.startswith(f"{prefix}{memory}_") else n
        if seg < n:  # a group file of a run with more segments holds some beyond the plan
          parts.append(_from_first_eviction(z[k].astype(np.float64), by_seg.get(seg), c,
                                            plan))
  return parts or None


def _from_first_eviction(calls, row, c: int, plan):
  """``calls`` from the row's first eviction on (all of them without a row)."""
  if row is None:
    return calls
  want = row["n_scored"] - experiment.first_evicted(row["kept_per_chunk"], plan.chunk, c)
  if want > len(calls):
    raise ValueError(f"{len(calls)} calls stored for segment {row['segment']}, fewer than "
                     f"the {want} from its first eviction on")
  return calls[len(calls) - max(want, 0):]


def coverage(calib, evals, n_kv_heads: int, seed: int = 0, smoothed=None) -> dict:
  """Raw and calibrated coverage of the evaluation calls (scores ``e / r``).

  ``calib`` and ``evals`` are lists of per-segment score arrays. Two
  calibrations, both per (layer, KV head): ``calibrated`` pools the
  calibration segments' calls into one conformal quantile; ``robust`` takes
  the largest of the segments' own quantiles (method, section 12). Calls
  within a segment are dependent, so each coverage's 95% interval
  (``raw_ci``, ...) is a bootstrap over evaluation segments, the scales held
  fixed. ``smoothed``: the same calls' scores against the smoothed radius
  (method, section 5), reported uncalibrated as ``smoothed``. ``calib`` None:
  no calibration segments, raw (and smoothed) coverage only."""
  per_segment, calib_parts = list(evals), list(calib or [])
  for name, parts in (("calib", calib_parts), ("evals", per_segment)):
    if any(np.ndim(p) != 3 for p in parts):
      raise ValueError(f"{name} must be a list of [calls, layers, heads] arrays, "
                       f"got ndims {[np.ndim(p) for p in parts]}")
  evals = np.concatenate(per_segment)
  L, H = evals.shape[1:]
  group = H // n_kv_heads
  per_call, scale_fields = {"raw": np.ones((1, L, H))}, {}
  if calib_parts:
    scales, robust = fitted_scales(calib_parts, n_kv_heads)
    per_call["calibrated"] = np.repeat(scales, group, axis=1)[None]  # [1, L, H]
    per_call["robust"] = np.repeat(robust, group, axis=1)[None]
    scale_fields = {"median_scale": float(np.median(scales)),
                    "median_robust_scale": float(np.median(robust)),
                    "infinite_scales": float(np.mean(np.isinf(scales))),
                    "n_calib_calls": int(sum(p.size for p in calib_parts))}
  n_seg = np.asarray([e.size for e in per_segment], np.float64)
  out = {}

  def covered_share(k, s, parts):
    """``out[k]``, its interval and sharpness: calls with score <= the scale ``s``."""
    whole = np.concatenate(parts)
    hits = np.asarray([np.sum(e <= s) for e in parts], np.float64)
    out[k] = float(np.mean(whole <= s))
    # the pooled share of calls covered, segments resampled
    iv = stats.bootstrap_ci(lambda a, b: np.sum(a) / np.sum(b), hits, n_seg, n_boot=N_BOOT,
                            seed=seed)
    out[k + "_ci"] = [float(iv.lo), float(iv.hi)]
    out[k + "_sharpness"] = sharpness([(whole, s)])

  by_head = lambda x: (x <= 1.0).reshape(-1, L, n_kv_heads, group).mean(axis=(0, 3))  # [L, kv]
  for k, s in per_call.items():
    covered_share(k, s, per_segment)
  if smoothed is not None:
    smoothed = list(smoothed)
    if [np.shape(p) for p in smoothed] != [np.shape(p) for p in per_segment]:
      raise ValueError("smoothed must hold one array per evaluation segment, shaped as evals")
    covered_share("smoothed", per_call["raw"], smoothed)
    out["smoothed_heads_below"] = float(np.mean(by_head(np.concatenate(smoothed))
                                                < 1.0 - DELTA))
  per_head = by_head(evals)
  worst = np.argsort(per_head, axis=None, kind="stable")[:5]
  return {**out,
          # where the raw radius misses: the (layer, KV head)s that cover least
          "raw_worst_heads": [[int(i // n_kv_heads), int(i % n_kv_heads),
                               float(per_head.flat[i])] for i in worst],
          "raw_heads_below": float(np.mean(per_head < 1.0 - DELTA)), **scale_fields,
          "unseen_deletions": float(np.mean(np.isinf(evals))),
          "n_calls": int(evals.size), "n_segments": len(per_segment)}


def sharpness(parts) -> Optional[float]:
  """Median radius / error over the covered calls, pooled over ``parts`` of (scores
  ``e / r``, scale): calls with an error > 0 and a finite scale (an infinite scale is no
  guarantee, and its calls are covered trivially); None if there are none."""
  ratios = []
  for ev, s in parts:
    s = np.broadcast_to(s, np.shape(ev))
    covered = (ev > 0) & (ev <= s) & np.isfinite(s)
    ratios.append(s[covered] / ev[covered])
  ratios = np.concatenate(ratios)
  return float(np.median(ratios)) if ratios.size else None


def fitted_scales(calib_parts, n_kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
  """``(pooled, robust)`` [L, n_kv_heads] scales fitted on the calibration parts' scores:
  each head's quantile of all their calls (the quantile of every call where a head has too
  few), and the largest of the parts' own quantiles."""
  calib = np.concatenate(calib_parts)
  scales = _head_quantiles(calib, n_kv_heads)
  scales[np.isnan(scales)] = calibration.conformal_quantile(calib.ravel(), DELTA)
  return scales, _robust_scales(calib_parts, n_kv_heads)


def _head_quantiles(scores, n_kv_heads: int) -> np.ndarray:
  """[L, n_kv_heads]: the conformal quantile of each (layer, KV head)'s calls in
  ``scores`` [calls, L, H]; NaN where a head has too few calls for a finite one."""
  n, L, H = scores.shape
  by_head = scores.reshape(n, L, n_kv_heads, H // n_kv_heads).transpose(1, 2, 0, 3)
  by_head = by_head.reshape(L, n_kv_heads, -1)
  if by_head.shape[-1] < calibration.min_finite_calls(DELTA):
    return np.full((L, n_kv_heads), np.nan)
  return np.asarray([[calibration.conformal_quantile(s, DELTA) for s in row]
                     for row in by_head])


def _robust_scales(parts, n_kv_heads: int) -> np.ndarray:
  """[L, n_kv_heads]: per (layer, KV head) the largest of the calibration
  segments' own conformal quantiles, the shipped calibration's max over
  sources (``certkv_jax.calibration.robust``) per head. A segment with too
  few calls of a head has no say there; a head no segment has enough calls
  of takes the largest of the segments' quantiles over all their calls (as
  the pooled scale falls back to the pooled quantile), +inf if none has
  enough calls at all."""
  need = calibration.min_finite_calls(DELTA)
  scales = np.fmax.reduce([_head_quantiles(p, n_kv_heads) for p in parts], axis=0)
  whole = [calibration.conformal_quantile(p.ravel(), DELTA) for p in parts if p.size >= need]
  scales[np.isnan(scales)] = max(whole) if whole else np.inf
  return scales


COVERAGE_FILE = "coverage.json"  # coverage cells, kept when calls/ (not committed) is gone


def _coverage_key(plan) -> str:
  """What a stored coverage cell depends on besides (context, variant, memory)."""
  return f"seed{plan.seed}_eval{plan.n_eval}_calib{plan.n_calib}_group{plan.group}"


def load_coverage(out_dir: str, plan) -> dict:
  """``{context: {variant: {memory: cell}}}`` stored for ``plan`` ({} if none)."""
  path = os.path.join(out_dir, COVERAGE_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f).get(_coverage_key(plan), {})


def save_coverage(out_dir: str, plan, cells: dict) -> None:
  """Stores ``cells`` for ``plan`` beside the other plans' cells (atomically)."""
  path = os.path.join(out_dir, COVERAGE_FILE)
  store = {}
  if os.path.exists(path):
    with open(path) as f:
      store = json.load(f)
  store[_coverage_key(plan)] = cells
  results_io.atomic_write_text(path, json.dumps(results_io.json_safe(store), indent=1,
                                                sort_keys=True))


def _complete(rows, c, variant, plan) -> bool:
  mems = (1.0,) if variant == "full" else plan.memories
  have = {(r["memory"], r["segment"]) for r in rows
          if r["context_len"] == c and r["variant"] == variant and r["split"] == "eval"}
  return all((m, s) in have for m in mems for s in range(plan.n_eval))


def summarize(rows: Sequence[dict], out_dir: str, plan, n_kv_heads: int = 3) -> dict:
  """summary.json's dict (one entry per context length) and the markdown report.

  A coverage cell is computed from the per-call scores in ``calls/`` when they
  are there, else read from :data:`COVERAGE_FILE`, where every computed cell is
  kept (``out["coverage_cells"]``, written by :func:`write`)."""
  rows = [r for r in rows if r["seed"] == plan.seed]
  stored = load_coverage(out_dir, plan)
  out = {"plan": {"context_lens": list(plan.context_lens), "memories": list(plan.memories),
                  "n_eval": plan.n_eval, "n_calib": plan.n_calib, "chunk": plan.chunk,
                  "cache": plan.cache,
                  "seed": plan.seed, "sources": [os.path.basename(p) for p in plan.sources],
                  "sources_sha256": experiment.sources_sha256(plan.sources)},
         "delta": DELTA, "contexts": {}}
  md = []
  for c in plan.context_lens:
    ran = [v for v in plan.variants if _complete(rows, c, v, plan)]
    missing = [v for v in plan.variants if v not in ran]
    ev = [r for r in rows if r["context_len"] == c and r["split"] == "eval"]
    by = lambda v, m: {r["segment"]: r for r in ev if r["variant"] == v and r["memory"] == m}
    ctx = {"delta_nll": {}, "held_memory": {}, "best_deterministic": {},
           "paired_vs_best_deterministic": {}, "paired_twin": {}, "paired_twin_by_quarter": {},
           "coverage": {},
           "not_run": missing,
           "seconds": float(sum(r["unit_seconds"] / max(1, _unit_rows(r, plan))
                                for r in rows if r["context_len"] == c))}
    for v in ran:
      for m in plan.memories:
        seg = by(v, m)
        vals = [seg[s]["delta_nll"] for s in range(plan.n_eval)]
        ctx["delta_nll"].setdefault(v, {})[str(m)] = _ci(vals, seed=plan.seed)
        ctx["held_memory"].setdefault(v, {})[str(m)] = float(
            np.mean([seg[s]["held_memory"] for s in range(plan.n_eval)]))
    uniform_det = [v for v in ran if experiment.parse_variant(v)[1] == "uniform"
                   and not experiment.is_randomized(v)]
    for m in plan.memories:
      if not uniform_det:
        break
      best = min(uniform_det, key=lambda v: ctx["delta_nll"][v][str(m)]["value"])
      ctx["best_deterministic"][str(m)] = best
      ref = by(best, m)
      for v in ran:
        seg = by(v, m)
        diffs = [seg[s]["delta_nll"] - ref[s]["delta_nll"] for s in range(plan.n_eval)]
        entry = _ci(diffs, seed=plan.seed + 1)
        entry["wins"] = int(np.sum(np.asarray(diffs) < 0))
        ctx["paired_vs_best_deterministic"].setdefault(v, {})[str(m)] = entry
    for v in ran:
      base = variants.twin_base(v)
      if base not in ran:
        continue
      key = base if base not in ctx["paired_twin"] else v
      for m in plan.memories:
        seg, ref = by(v, m), by(base, m)
        diffs = [seg[s]["delta_nll"] - ref[s]["delta_nll"] for s in range(plan.n_eval)]
        entry = dict(_ci(diffs, seed=plan.seed + 2), design=base, twin=v)
        entry["wins"] = int(np.sum(np.asarray(diffs) < 0))
        ctx["paired_twin"].setdefault(key, {})[str(m)] = entry
        parts = _by_quarter(seg, ref, plan)
        if parts is not None:
          ctx["paired_twin_by_quarter"].setdefault(key, {})[str(m)] = parts
    for v in ran:
      if not experiment.is_randomized(v):
        continue
      for m in plan.memories:
        cal = _scores(out_dir, c, v, "calib", m, plan, rows=rows)
        evs = _scores(out_dir, c, v, "eval", m, plan, rows=rows)
        if evs is not None and (cal is not None or plan.n_calib == 0):
          cell = coverage(cal, evs, n_kv_heads, seed=plan.seed,
                          smoothed=_scores(out_dir, c, v, "eval", m, plan, prefix="w",
                                           rows=rows))
          stored.setdefault(str(c), {}).setdefault(v, {})[str(m)] = cell
        else:
          cell = stored.get(str(c), {}).get(v, {}).get(str(m))
        if cell is not None:
          ctx["coverage"].setdefault(v, {})[str(m)] = cell
    out["contexts"][str(c)] = ctx
    md += _markdown(ctx, c, plan)
  first = out["contexts"][str(plan.context_lens[0])]
  for k in ("delta_nll", "best_deterministic", "paired_vs_best_deterministic", "paired_twin",
            "paired_twin_by_quarter"):
    out[k] = first[k]  # the first context length at the top level
  out["md"] = "\n".join(md)
  out["coverage_cells"] = stored
  return out


def _by_quarter(seg: dict, ref: dict, plan) -> Optional[dict]:
  """Twin minus design per quarter of the stream (the mean of its chunks' mean NLL;
  the first chunk, never evicted, and a last chunk with no scored token left out),
  bootstrapped over segments, with the design's kept tokens that the quarter's last chunk
  read; None for rows stored without ``chunk_nll`` or streams of fewer than 4 such chunks."""
  if any("chunk_nll" not in seg[s] or "chunk_nll" not in ref[s] for s in range(plan.n_eval)):
    return None
  nll = lambda row: np.asarray([np.nan if x is None else x for x in row["chunk_nll"]],
                               np.float64)
  diff = np.asarray([nll(seg[s]) - nll(ref[s]) for s in range(plan.n_eval)])[:, 1:]
  scored = ~np.all(np.isnan(diff), axis=0)  # a chunk of one last token predicts nothing
  chunks = np.arange(diff.shape[1])[scored]  # [evicted chunks], 0 = the stream's chunk 1
  if len(chunks) < 4:
    return None
  diff = diff[:, scored]  # a NaN left is a failed loss: the bootstrap refuses it
  quarters = np.array_split(np.arange(len(chunks)), 4)
  kept = np.mean([ref[s]["kept_per_chunk"] for s in range(plan.n_eval)], axis=0)
  return {"chunks": [[int(chunks[q[0]]) + 1, int(chunks[q[-1]]) + 1] for q in quarters],
          "delta": [_ci(diff[:, q].mean(axis=1), seed=plan.seed + 3) for q in quarters],
          "design_kept": [float(kept[chunks[q[-1]]]) for q in quarters]}


def _unit_rows(row, plan) -> int:
  n = plan.n_eval if row["split"] == "eval" else plan.n_calib
  segs = min(plan.group, n - (row["segment"] // plan.group) * plan.group)
  return segs * (1 if row["variant"] == "full" else len(plan.memories))


def _fmt_ci(e, spec="+.3f") -> str:
  return f"{e['value']:{spec}} [{e['ci'][0]:{spec}}, {e['ci'][1]:{spec}}]"


def _cov(cell, k) -> str:
  """A coverage with its segment-bootstrap interval (cells stored before the
  interval existed have none)."""
  ci = cell.get(k + "_ci")
  return f"{cell[k]:.3f}" + ("" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]")


def _markdown(ctx, c, plan) -> list[str]:
  cache = ("" if plan.cache == "seen" else
           f", a fixed cache of each memory's share of {c} tokens (filled, then held)")
  lines = [f"## {c} tokens: {plan.n_eval} evaluation segments, chunks of {plan.chunk}{cache}",
           "",
           "| variant | memory | held memory | delta NLL [95% CI] | vs best deterministic "
           "(paired) [95% CI] | segments better | raw coverage (sharpness) | calibrated, "
           "pooled (sharpness) | calibrated, robust (sharpness) | raw, smoothed V (sharpness) "
           "| unseen deletions |",
           "|---" * 11 + "|"]
  for m in plan.memories:
    best = ctx["best_deterministic"].get(str(m))
    for v in ctx["delta_nll"]:
      d = ctx["delta_nll"][v][str(m)]
      p = ctx["paired_vs_best_deterministic"].get(v, {}).get(str(m))
      cov = ctx["coverage"].get(v, {}).get(str(m))
      f = lambda x: "-" if x is None else f"{x:.2f}"
      raw = "-" if cov is None else f"{_cov(cov, 'raw')} ({f(cov['raw_sharpness'])})"
      cal = "-" if cov is None or "calibrated" not in cov else (
          f"{_cov(cov, 'calibrated')} ({f(cov['calibrated_sharpness'])})")
      rob = "-" if cov is None or "robust" not in cov else (
          f"{_cov(cov, 'robust')} ({f(cov['robust_sharpness'])})")
      smooth = "-" if cov is None or "smoothed" not in cov else (
          f"{_cov(cov, 'smoothed')} ({f(cov['smoothed_sharpness'])})")
      unseen = "-" if cov is None else f"{cov['unseen_deletions']:.3f}"
      name = f"**{v}**" if v == best else v
      lines.append(f"| {name} | {m} | {ctx['held_memory'][v][str(m)]:.3f} | {_fmt_ci(d)} | "
                   f"{'-' if p is None else _fmt_ci(p)} | "
                   f"{'-' if p is None else str(p['wins']) + '/' + str(p['n'])} | {raw} | {cal} "
                   f"| {rob} | {smooth} | {unseen} |")
  if ctx["paired_twin"]:
    lines += ["", "Certified twins against their own deterministic design, paired on the same "
              "segments (twin minus design, nats/token; negative: the twin loses less):", "",
              "| design | twin | " + " | ".join(f"memory {m}" for m in plan.memories) + " |",
              "|---" * (2 + len(plan.memories)) + "|"]
    for key, per in ctx["paired_twin"].items():
      first = next(iter(per.values()))
      lines.append(f"| {first.get('design', key)} | {first['twin']} | " + " | ".join(
          f"{_fmt_ci(per[str(m)])} ({per[str(m)]['wins']}/{per[str(m)]['n']})"
          for m in plan.memories) + " |")
  if ctx["paired_twin_by_quarter"]:
    lines += ["", "Where in the stream the twins lose: twin minus design by quarter of the "
              "chunks after chunk 0 (chunk 0 is never evicted"
              + ("; a fixed cache is evicted only once full, so the first chunks read "
                 "identical caches and differ by 0" if plan.cache == "fixed" else "")
              + "), paired over segments, nats/token [95% CI], with the chunks and the "
              "design's kept tokens that the quarter's last chunk read:",
              "", "| design | memory | " + " | ".join(f"quarter {i + 1}" for i in range(4))
              + " |", "|---" * 6 + "|"]
    for base, per in ctx["paired_twin_by_quarter"].items():
      for m, q in per.items():
        lines.append(f"| {base} | {m} | " + " | ".join(
            f"{_fmt_ci(d)} (chunks {a}-{b}; {k:.0f})" for d, (a, b), k in
            zip(q["delta"], q["chunks"], q["design_kept"])) + " |")
  worst = [(v, m, cell) for v, per in ctx["coverage"].items() for m, cell in per.items()
           if "raw_worst_heads" in cell]
  if worst:
    lines += ["", "Where the raw radius misses: the (layer, KV head)s that cover least, and "
              "the share of all (layer, KV head)s below 0.95:", ""]
    for v, m, cell in worst:
      heads = ", ".join(f"layer {l} head {h} {c:.2f}" for l, h, c in cell["raw_worst_heads"][:3])
      smooth = ("" if "smoothed_heads_below" not in cell else
                f" ({cell['smoothed_heads_below']:.0%} with the smoothed radius)")
      lines.append(f"- {v} at {m}: {heads}; {cell['raw_heads_below']:.0%} below{smooth}")
  if ctx["not_run"]:
    lines += ["", f"Not run (no complete rows): {', '.join(ctx['not_run'])}."]
  return lines + [""]


def write(rows, out_dir: str, plan, n_kv_heads: int = 3) -> Optional[dict]:
  """Writes report.md, summary.json and delta_nll.png; None if no variant is complete."""
  s = summarize(rows, out_dir, plan, n_kv_heads)
  if not any(ctx["delta_nll"] for ctx in s["contexts"].values()):
    return None
  if s["coverage_cells"]:
    save_coverage(out_dir, plan, s["coverage_cells"])
  body = {k: v for k, v in s.items() if k not in ("md", "coverage_cells")}
  results_io.atomic_write_text(os.path.join(out_dir, "summary.json"),
                               json.dumps(results_io.json_safe(body), indent=1, sort_keys=True))
  results_io.atomic_write_text(os.path.join(out_dir, "report.md"), HEADER + s["md"])
  panels = {}
  for c, ctx in s["contexts"].items():
    lines = {}
    for v, per in ctx["delta_nll"].items():
      ms = sorted(per, key=float)
      lines[v] = ([ctx["held_memory"][v][m] for m in ms], [per[m]["value"] for m in ms])
    if lines:
      panels[f"{c} tokens"] = lines
  plots.plot_panels(panels, os.path.join(out_dir, "delta_nll.png"),
                    xlabel="held memory (fraction of the full cache's K/V bytes)",
                    ylabel="delta NLL vs full (nats/token)",
                    title="Streaming NLL increase at equal memory")
  return s


HEADER = """# Eviction designs at equal memory

Generated by `python -m experiments.equal_memory` (`experiments/lib/equal_memory`).
Memory = kept key/value bytes plus the per-slot metadata each design needs
(`certkv_jax.kv.memory`), as a fraction of the full cache's key/value bytes;
*held memory* is the time-averaged bytes the kept slots actually held over
the stream (above the nominal memory where the certainty set or a tail floor
exceeds an early chunk's budget; below it for the Poisson tail, whose slots
stay partly empty). Delta NLL is per token against the full cache on the same
segment. The paired column is the variant minus the best deterministic
variant with uniform budgets (bold) on the same segments, with a 95%
bootstrap over segments. Coverage: the per-call radius at delta 0.05 over
every attention call from each row's first eviction on; calibrated with per-(layer, KV
head) conformal scales fitted on the calibration segments (other source
files), pooled (one quantile of all their calls) or robust (the largest of
the segments' own quantiles; cells computed before it existed have none;
method, section 12); raw, smoothed V: the radius with each head's V_hat
replaced by the larger of itself and its mean over the head's last 6 calls
(method, section 5, "Smoothed variance"; uncalibrated; cells computed before
it existed have none); sharpness = median radius / error over covered calls; unseen
deletions = calls with radius 0 and a nonzero error. Coverage is computed
from the per-call scores in `calls/` and kept in `coverage.json`, which a
report rewritten without them reads.

"""
