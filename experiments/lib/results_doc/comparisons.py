"""Sections of ``docs/results.md`` that compare designs: quality at equal memory and the
RULER-style leaderboard."""

from __future__ import annotations

from experiments.lib import variants
from experiments.lib.leaderboard import pooled
from experiments.lib.results_doc import markdown as fmt


def equal_memory(root: str) -> list[str]:
  """Designs at equal kept bytes, paired against the best deterministic design."""
  s = fmt.read_json(root, "equal_memory/summary.json")
  out = ["## Designs at equal memory", ""]
  out += fmt.run_source(root, "equal_memory")
  plan = s["plan"]
  for c, ctx in s["contexts"].items():
    out += [f"{plan['n_eval']} natural-text segments of {int(c):,} tokens, chunks of "
            f"{plan['chunk']}; memory = kept key/value bytes plus per-slot metadata as a "
            "fraction of the full cache's key/value bytes; delta NLL in nats/token against "
            "the full cache with a 95% bootstrap over segments; 'paired' = minus the best "
            "deterministic design with uniform budgets on the same segments; coverage per "
            f"call at delta {s['delta']} (raw / calibrated on {plan['n_calib']} other "
            "sources with per-head scales, pooled / robust (largest per-source scale) / "
            "smoothed (raw with V_hat smoothed over each head's last 6 calls, method, "
            "section 5), sharpness in parentheses):", ""]
    body = []
    for m in plan["memories"]:
      best = ctx["best_deterministic"].get(str(m))
      for v, per in ctx["delta_nll"].items():
        d, p = per[str(m)], ctx["paired_vs_best_deterministic"][v][str(m)]
        cov = ctx["coverage"].get(v, {}).get(str(m))
        cov_s = "-" if cov is None else (
            f"{cov['raw']:.3f} ({fmt.num(cov['raw_sharpness'], '.2f')}) / "
            f"{cov['calibrated']:.3f} ({fmt.num(cov['calibrated_sharpness'], '.2f')}) / "
            + ("-" if "robust" not in cov else
               f"{cov['robust']:.3f} ({fmt.num(cov['robust_sharpness'], '.2f')})")
            + ("" if "smoothed" not in cov else
               f" / {cov['smoothed']:.3f} ({fmt.num(cov['smoothed_sharpness'], '.2f')})"))
        body.append([fmt.pct(m), f"**{v}**" if v == best else v,
                     f"{ctx['held_memory'][v][str(m)]:.3f}",
                     fmt.ci((d["value"], *d["ci"]), "+.3f"),
                     fmt.ci((p["value"], *p["ci"]), "+.3f") + f" ({p['wins']}/{p['n']})",
                     cov_s])
    out += fmt.table(["memory", "design", "held memory", "delta NLL", "paired vs best",
                      "coverage raw / pooled / robust / smoothed"], body)
    if ctx["not_run"]:
      out += ["", f"Not run: {', '.join(ctx['not_run'])}."]
  return out


# (run, the twins' weight floor eps it used): 0.05 was the default until f09151b.
_EPS_EVAL = "equal_memory_twin_eps_eval/"
TWIN_RUNS = (("equal_memory_twins_by_quarter", 0.05),
             ("equal_memory_twins_by_quarter_2048", 0.05),
             ("equal_memory_fixed", 0.05), ("equal_memory_fixed_segments", 0.05),
             ("equal_memory_fixed_2048", 0.05), ("equal_memory_fixed_segments_2048", 0.05),
             (_EPS_EVAL + "files_1024", 1.0), (_EPS_EVAL + "segments_1024", 1.0),
             (_EPS_EVAL + "files_2048", 1.0), (_EPS_EVAL + "segments_2048", 1.0))
TWIN_COVERAGE_RUNS = (("equal_memory_fixed_coverage", 0.05), (_EPS_EVAL + "coverage_1024", 1.0))


def twins(root: str) -> list[str]:
  """Each certified twin against its own design, overall and by quarter of the stream, in
  the runs of :data:`TWIN_RUNS` (losses only), then their coverage."""
  out = ["## Certified twins against their own designs", ""]
  for rel, eps in TWIN_RUNS:
    s = fmt.read_json(root, f"{rel}/summary.json")
    plan = s["plan"]
    c, ctx = next(iter(s["contexts"].items()))
    mems = [str(m) for m in plan["memories"]]
    cache = ("a fixed cache of each memory's share of the segment's tokens (filled, then "
             "held)" if plan.get("cache") == "fixed" else
             "the memory's share of the tokens seen so far")
    out += [f"### {int(c):,} tokens, {cache}, twins' floor eps = {eps:g}", ""]
    out += fmt.run_source(root, rel)
    used = sorted({r["source"] for r in fmt.read_rows(root, f"{rel}/rows.jsonl")
                   if r["split"] == "eval"})
    out += [f"{plan['n_eval']} segments ({', '.join(used)}), chunks of "
            f"{plan['chunk']}; twin minus design in nats/token, paired over segments (95% "
            "bootstrap; segments where the twin is better):", ""]
    out += fmt.table(["design", "twin"] + [fmt.pct(float(m)) for m in mems], [
        [variants.twin_base(per[mems[0]]["twin"]), per[mems[0]]["twin"]]
        + [fmt.ci((per[m]["value"], *per[m]["ci"]), "+.3f")
           + f" ({per[m]['wins']}/{per[m]['n']})" for m in mems]
        for per in ctx["paired_twin"].values()])
    quarters = ctx.get("paired_twin_by_quarter", {})
    if quarters:
      m = mems[0]
      first = next(iter(quarters.values()))[m]
      out += ["", f"By quarter of the evicted chunks at {fmt.pct(float(m))} (chunks; the "
              "design's kept tokens that the quarter's last chunk read):", ""]
      out += fmt.table(["design"] + [f"chunks {a}-{b} ({k:.0f})" for (a, b), k in
                                     zip(first["chunks"], first["design_kept"])], [
          [d] + [fmt.ci((q["value"], *q["ci"]), "+.3f") for q in per[m]["delta"]]
          for d, per in quarters.items()])
    out += [""]
  for rel, eps in TWIN_COVERAGE_RUNS:
    out += _twin_coverage(root, rel, eps) + [""]
  return out[:-1]


def _twin_coverage(root: str, rel: str, eps: float) -> list[str]:
  """The twins' coverage at delta 0.05 in one evaluation-mode run."""
  s = fmt.read_json(root, f"{rel}/summary.json")
  plan = s["plan"]
  c, ctx = next(iter(s["contexts"].items()))
  out = [f"### Coverage, {int(c):,} tokens, a fixed cache, twins' floor eps = {eps:g}", ""]
  out += fmt.run_source(root, rel)
  out += [f"{plan['n_eval']} evaluation segments, calibrated on {plan['n_calib']} other "
          "files; coverage of each call from the first eviction on at delta "
          f"{s['delta']}, sharpness (median radius / error over covered calls) in "
          "parentheses:", ""]
  body = []
  for v, per in ctx["coverage"].items():
    for m, cov in per.items():
      body.append([v, fmt.pct(float(m))] + [
          f"{cov[k]:.3f} ({fmt.num(cov[k + '_sharpness'], '.2f')})"
          for k in ("raw", "calibrated", "robust")] + [f"{cov['unseen_deletions']:.3f}"])
  return out + fmt.table(["twin", "memory", "raw", "calibrated, pooled", "calibrated, robust",
                          "radius 0, error > 0"], body)


def leaderboard(root: str) -> list[str]:
  """The RULER-style leaderboard of the certified twins beside their designs, at equal
  kept bytes (``--equal_memory``)."""
  return _ruler(root, "leaderboard", "## RULER-style leaderboard: certified twins at equal memory")


def leaderboard_eps005(root: str) -> list[str]:
  """The same leaderboard with the twins' earlier weight floor, ``eps = 0.05``."""
  return _ruler(root, "leaderboard_eps005",
                "## RULER-style leaderboard: certified twins at equal memory, floor 0.05")


def leaderboard_tokens(root: str) -> list[str]:
  """The same leaderboard at equal tokens (no ``--equal_memory``): a twin holds about
  1.5% more bytes than its design."""
  return _ruler(root, "leaderboard_tokens",
                "## RULER-style leaderboard: certified twins at equal tokens, floor 0.05")


def leaderboard_coverage(root: str) -> list[str]:
  """The twins' coverage on a subset of the leaderboard, in evaluation mode."""
  return _ruler(root, "leaderboard_coverage",
                "## RULER-style leaderboard: the twins' coverage, floor 0.05")


def leaderboard_coverage_bytes(root: str) -> list[str]:
  """The same coverage subset at equal kept bytes (``--equal_memory``), the leaderboard's."""
  return _ruler(root, "leaderboard_coverage_bytes",
                "## RULER-style leaderboard: the twins' coverage at equal memory, floor 0.05")


def leaderboard_keydiff_bytes(root: str) -> list[str]:
  """KeyDiff and its twin at equal kept bytes (``--equal_memory``), a leaderboard subset."""
  return _ruler(root, "leaderboard_keydiff_bytes",
                "## RULER-style leaderboard: KeyDiff's twin at equal bytes, floor 0.05")


def leaderboard_smoke(root: str) -> list[str]:
  """Every design on the leaderboard, one example per task (``leaderboard_smoke``)."""
  return _ruler(root, "leaderboard_smoke", "## RULER-style leaderboard of every design (smoke scale)")


def leaderboard_8k(root: str) -> list[str]:
  """The leaderboard's subset at 8,192 tokens (``leaderboard_8k``)."""
  return _ruler(root, "leaderboard_8k", "## RULER-style leaderboard at 8k tokens (a subset)")


def equal_memory_tasks(root: str) -> list[str]:
  """Retrieval-task accuracy at equal memory (the leaderboard's code, ``--equal_memory``)."""
  return _ruler(root, "equal_memory_tasks", "## Task accuracy at equal memory")


def equal_memory_tasks_pooled(root: str) -> list[str]:
  """Task accuracy of several seeds' runs, paired against one design (``pool_tasks``)."""
  rel = "equal_memory_tasks_pooled"
  s = fmt.read_json(root, f"{rel}/summary.json")
  out = ["## Task accuracy pooled over seeds", ""]
  out += fmt.run_source(root, rel)
  out += ["The task runs " + ", ".join(f"`{r}`" for r in s["runs"]) + " pooled.", ""]
  return out + pooled.markdown(s).rstrip("\n").split("\n")


def _ruler(root: str, rel: str, title: str) -> list[str]:
  s = fmt.read_json(root, f"{rel}/summary.json")
  plan = s["plan"]
  out = [title, ""]
  out += fmt.run_source(root, rel)
  ratios = [str(r) for r in plan["ratios"]]
  removed = ("the share of the full cache's key/value bytes removed, at equal memory"
             if plan.get("equal_memory") else "the share of the cache removed")
  for name, cell in s["cells"].items():
    counts = ", ".join(f"{t} {n}" for t, n in cell["n_examples"].items())
    out += [f"{name.replace('/', ' tokens, ')}: average score ({s['metric']}) over the tasks "
            f"(examples: {counts}) by compression ratio ({removed}); "
            "the full cache is the reference row:", ""]
    body = []
    for d, per in cell["score"].items():
      body.append([d] + [fmt.ci((v["value"], *v["ci"]), ".1f") if (v := per.get(r)) else "-"
                         for r in ratios])
    out += fmt.table(["design"] + ratios, body)
    paired = cell.get("paired_vs_best_deterministic", {})
    if cell.get("best_deterministic"):
      out += ["", "Paired against the best deterministic design with uniform budgets (bold), "
              "in points on the same examples, 95% bootstrap over examples within tasks:", ""]
      body = []
      for d, per in paired.items():
        if d == "full":
          continue
        cells = []
        for r in ratios:
          p = per.get(r)
          text = "-" if p is None else fmt.ci((p["value"], *p["ci"]), "+.1f")
          cells.append(f"**{text}**" if cell["best_deterministic"].get(r) == d else text)
        body.append([d] + cells)
      out += fmt.table(["design"] + ratios, body)
    if cell.get("paired_twin"):
      out += ["", "Certified twins against their own deterministic design: twin minus design "
              "in points on the same examples, 95% bootstrap over examples within tasks "
              "(bold: a detectable loss, the interval below 0):", ""]
      body = []
      for d, per in cell["paired_twin"].items():
        cells = []
        for r in ratios:
          p = per.get(r)
          text = "-" if p is None else fmt.ci((p["value"], *p["ci"]), "+.1f")
          cells.append(f"**{text}**" if p is not None and p["ci"][1] is not None
                       and p["ci"][1] < 0 else text)
        body.append([d, next(iter(per.values()))["twin"]] + cells)
      out += fmt.table(["design", "twin"] + ratios, body)
    cov = cell.get("coverage", {})
    if cov:
      out += ["", "Certificate of the randomized designs on every decode call up to the "
              f"answer's end (delta {s['delta']}): raw / leave-one-task-out calibrated "
              "coverage (pooled and robust per-head scales), each with its sharpness (median "
              "radius / error over the covered kept calls) where the run recorded it, median "
              "radius / median true error:", ""]
      body, no_calls = [], []
      for d, per in cov.items():
        for r in ratios:
          c = per.get(r)
          if c is None:
            continue
          if not c["n_calls"]:  # run without evaluation mode (--nocoverage)
            if d not in no_calls:
              no_calls.append(d)
            continue
          sharp = {k: c.get(k + "_sharpness") for k in ("raw", "calibrated", "robust")}
          body.append([d, r, str(c["n_calls"])] + [
              fmt.num(c.get(k)) + ("" if v is None else f" ({v:.2f})") for k, v in sharp.items()]
              + [f"{fmt.num(c['median_radius'], '.4f')} / {fmt.num(c['median_error'], '.4f')}"])
      out += fmt.table(["design", "ratio", "calls", "raw", "calibrated", "robust",
                        "radius / error"],
                       body)
      if no_calls:
        out += ["", "No decode calls recorded (run without evaluation mode): "
                f"{', '.join(no_calls)}."]
    if cell["not_run"]:
      out += ["", f"Not run: {', '.join(cell['not_run'])}."]
  return out
