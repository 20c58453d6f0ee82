"""The decode benchmark's outputs: ``summary.json``, ``report.md``, ``decode_ms.png``.

:func:`summarize` condenses the results of ``experiments.lib.bench.decode.run``
(``results.json``: every measurement) into the ratios to the full cache per
budget and context, :func:`render` writes the tables, and :func:`write_outputs`
writes all four files atomically (after every cell, so that a stopped run
leaves the cells it finished).
"""

from __future__ import annotations

import json
import os

from experiments.lib import plots
from experiments.lib import results_io

HEADLINE_DESIGN = "poisson_tail"
CERT_KEYS = {True: "with_certificate", False: "without_certificate"}


def key(x) -> str:
  """JSON key of a budget (``0.125`` -> "0.125") or a context (``1024`` -> "1024")."""
  return f"{x:g}" if isinstance(x, float) else str(x)


def every(row: dict) -> int:
  """Decode steps per eviction of a row (1 in results from before amortized eviction)."""
  return row.get("evict_every", 1)


def loop(row: dict) -> str:
  """The layer loop of a row ("scan" in results from before the unrolled loop)."""
  return row.get("layer_loop", "scan")


def label(row: dict, with_loop: bool = False) -> str:
  """``full``, ``design`` or ``design+certificate``, then `` every k`` for amortized
  eviction, and `` [loop]`` with ``with_loop``."""
  k = every(row)
  return (row["design"] + ("+certificate" if row["certificate"] else "")
          + (f" every {k}" if k > 1 else "") + (f" [{loop(row)}]" if with_loop else ""))


def loops(results: dict) -> list:
  """The layer loops of a run, in the plan's order."""
  return list(results["plan"].get("layer_loop", ["scan"]))


def headline_loop(results: dict) -> str:
  """The layer loop of the headline tables: unrolled when timed (the fast decode)."""
  return "unrolled" if "unrolled" in loops(results) else loops(results)[0]


def headline(results: dict) -> dict:
  """The design, certificate setting and batch of ``ratio_vs_full``, and why."""
  rows = results["decode"]
  batches = sorted({r["batch"] for r in rows})
  batch = 1 if 1 in batches else batches[0]
  designs = [d for d in results["plan"]["designs"]]
  design = HEADLINE_DESIGN if HEADLINE_DESIGN in designs else designs[0]
  cert = any(r["certificate"] for r in rows if r["design"] == design)
  note = (f"design {design} {'with' if cert else 'without'} the certificate at batch {batch}"
          + ("" if batch == 1 else " (batch 1 not measured: the smallest batch measured)")
          + ("" if design == HEADLINE_DESIGN else f" ({HEADLINE_DESIGN} not in --designs)"))
  return dict(design=design, certificate=cert, batch=batch, note=note)


def _table(rows, design, cert, batch, field, k=1, layer_loop=None):
  """``{budget: {context: row[field]}}`` of one design / certificate setting / batch /
  steps per eviction ``k`` / layer loop (None: any); the full cache's budget is "1.0"."""
  out = {}
  for r in rows:
    if (r["design"] == design and r["certificate"] == cert and r["batch"] == batch
        and every(r) == k and layer_loop in (None, loop(r)) and field in r):
      budget = "1.0" if r["budget"] is None else key(r["budget"])
      out.setdefault(budget, {})[key(r["context"])] = r[field]
  return out


def summarize(results: dict) -> dict:
  """The summary (``summary.json``): ratios to the full cache, compile times, prefill."""
  rows, pre = results["decode"], results["prefill"]
  base = dict(model=results["model"], dtype=results.get("dtype", "float32"),
              device=results["device"],
              capacity_layout=results["plan"]["capacity"], complete=results["complete"],
              cells_done=results["cells_done"], cells_skipped=results["cells_skipped"])
  if not rows:
    return dict(base, ratio_vs_full={}, note="no cell finished")
  h = headline(results)
  b, hl = h["batch"], headline_loop(results)
  designs = results["plan"]["designs"]
  rows = [r for r in rows if loop(r) == hl]  # the headline loop's tables
  at_b = [r for r in rows if r["batch"] == b]
  has = lambda d, c: any(r["design"] == d and r["certificate"] == c for r in at_b)
  # The per-design tables use the most frequent eviction timed (1: after every step).
  k0 = min((every(r) for r in at_b if r["design"] != "full"), default=1)
  by_design = {d: {CERT_KEYS[c]: _table(rows, d, c, b, "ratio_vs_full", k0)
                   for c in (False, True) if has(d, c)} for d in designs}
  # Step time over its floor (bytes / this run's streaming bandwidth), and the scan loop
  # over the unrolled one (same round), both with the headline's certificate setting.
  per_design = lambda field, c=h["certificate"]: dict(
      {"full": _table(rows, "full", False, b, field)},
      **{d: _table(rows, d, c, b, field, k0) for d in designs if has(d, c)})
  floor_by_design = {d: {CERT_KEYS[c]: _table(rows, d, c, b, "floor_multiple", k0)
                         for c in (False, True) if has(d, c)} for d in designs}
  bandwidth = {key(x["context"]): x["gbps"] for x in results.get("bandwidth", [])
               if x["batch"] == b}
  matvec = {key(x["context"]): x["matvec_floor_multiple"] for x in results.get("bandwidth", [])
            if x["batch"] == b and "matvec_floor_multiple" in x}
  attention = {key(x["context"]): x["attention_floor_multiple"]
               for x in results.get("bandwidth", [])
               if x["batch"] == b and "attention_floor_multiple" in x}
  compile_s = {"full": {key(r["context"]): r["compile_s"] for r in at_b if r["design"] == "full"}}
  for r in at_b:
    if r["design"] != "full":
      compile_s.setdefault(label(r), {}).setdefault(key(r["budget"]), {})[
          key(r["context"])] = r["compile_s"]
  # with --compile_repeats: the fastest trace + lower + compile alone, of the step and of a
  # design's eviction alone
  compile_min_s, eviction_compile_min_s = {}, {}
  for field, table in (("compile_min_s", compile_min_s),
                       ("eviction_compile_min_s", eviction_compile_min_s)):
    for r in at_b:
      if field not in r:
        continue
      at = table.setdefault(label(r) if r["design"] != "full" else "full", {})
      if r["design"] != "full":
        at = at.setdefault(key(r["budget"]), {})
      at[key(r["context"])] = r[field]
  ks = sorted({every(r) for r in at_b if r["design"] == h["design"]} - {k0})
  amortized = {f"every_{k}": _table(rows, h["design"], h["certificate"], b, "ratio_vs_full", k)
               for k in ks}
  prefill = {}
  for r in pre:
    if r["batch"] == b:
      prefill.setdefault(f"{r['method']}_tokens_per_s", {})[key(r["context"])] = \
          r["tokens_per_s"]
  cached, plain = prefill.get("cached_tokens_per_s", {}), prefill.get("plain_tokens_per_s", {})
  prefill["cached_vs_plain"] = {c: cached[c] / plain[c] for c in cached if c in plain}
  return dict(
      base, headline=h, design=h["design"], certificate=h["certificate"], batch=b,
      evict_every=k0,
      ratio_vs_full=_table(rows, h["design"], h["certificate"], b, "ratio_vs_full", k0),
      ratio_vs_full_ci=_table(rows, h["design"], h["certificate"], b, "ratio_vs_full_ci", k0),
      ratio_vs_full_by_design=by_design,
      # The headline's design and certificate evicting every k decode steps (amortized).
      ratio_vs_full_amortized=amortized,
      # The bytes ratio: (weight bytes + the design's cache bytes) / (weight bytes + the full
      # cache's bytes), the ratio of a step that reads every byte once at one bandwidth.
      bytes_ratio_vs_full=_table(rows, h["design"], h["certificate"], b, "bytes_ratio_vs_full",
                                 k0)
      if all("bytes_ratio_vs_full" in r for r in at_b) else None,
      full_ms={key(r["context"]): r["median"] for r in at_b if r["design"] == "full"},
      layer_loop=hl, bandwidth_gbps=bandwidth,
      floor_multiple=per_design("floor_multiple"),
      floor_multiple_by_design=floor_by_design,
      # The weights' matrix-vector products alone over their floor (same round-robin).
      matvec_floor_multiple=matvec,
      # The full cache's attention alone over its floor (its keys and values).
      attention_floor_multiple=attention,
      layer_loop_ratio=per_design("scan_over_unrolled") if len(loops(results)) == 2 else None,
      compile_s=compile_s, compile_min_s=compile_min_s,
      eviction_compile_min_s=eviction_compile_min_s,
      executables=results.get("executables"), prefill=prefill,
      budgets_traced=("every step passes the budget as a traced argument; with "
                      f"--capacity={results['plan']['capacity']} "
                      + ("each budget's compacted caches have their own shape, so each "
                         "budget compiles its own executable"
                         if results["plan"]["capacity"] == "compact" else
                         "one executable per design serves every budget")))


def step_parts(results: dict, bw: dict) -> tuple:
  """``(step, matvecs, attention, rest)`` ms of the full cache's step in the headline
  loop of the cell ``bw`` (a ``results["bandwidth"]`` entry with the two probes)."""
  loop = headline_loop(results)
  step = next(r["median"] for r in results["decode"]
              if r["design"] == "full" and r["layer_loop"] == loop
              and r["context"] == bw["context"] and r["batch"] == bw["batch"])
  return step, bw["matvec_ms"], bw["attention_ms"], step - bw["matvec_ms"] - bw["attention_ms"]


def _parts(results: dict, bw: dict) -> str:
  """``batch b n=c: step S = matvecs M + attention A + rest R`` (:func:`step_parts`)."""
  return (f"batch {bw['batch']} n={bw['context']}: "
          + "{:.1f} = {:.1f} + {:.1f} + {:.1f}".format(*step_parts(results, bw)))


def _cell(median, ci, digits=3) -> str:
  return f"{median:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def render(results: dict, summary: dict) -> str:
  """``report.md``: the tables of every batch, the notes on method and attention."""
  plan = results["plan"]
  rows, pre = results["decode"], results["prefill"]
  levels = sorted({r["ci_level"] for r in rows + pre})
  multi = len(loops(results)) > 1
  md = ["# Decode benchmark", "",
        f"Model {results['model']} (weights and caches in {results.get('dtype', 'float32')}"
        f"); device {results['device']}. Designs {plan['designs']}, "
        f"budgets {plan['budgets']}, certificate {plan['certificate']}, cache layout "
        f"--capacity={plan['capacity']}, layer loops {loops(results)}, {plan['repeats']} "
        f"timed calls per configuration after {results['warmup_calls']} warm-up calls, "
        "interleaved round-robin within each (batch, context) cell.",
        "",
        "- Layer loop: `scan` is a `lax.scan` over the stacked weights and caches (each "
        "layer's slices copied out); `unrolled` a Python loop over per-layer weights and "
        "caches read in place (`forward_chunk(layer_loop=...)`). Headline tables: "
        f"{headline_loop(results)}.",
        "- Floor: a step's bytes (every weight; per cache, its capacity in slots of "
        "`certkv_jax.kv.memory.slot_bytes(design, head_dim)`: key, value and the design's "
        "metadata; not what this implementation also reads: `pos` and `valid` (5 bytes a "
        "slot) for every cache's mask, and `log_pi` (4, all 0) for the full cache and "
        "deterministic designs) over this machine's streaming-read bandwidth, measured in "
        "the same round-robin (a jitted loop of `jnp.sum`s of a float32 buffer of the full "
        "cache's step bytes, as many per call as a timed call makes steps). Floor multiple: median of the per-round ratios of step time to floor; "
        "bandwidth (GB/s, median) per cell: "
        + ", ".join(f"batch {x['batch']} n={x['context']}: {x['gbps']:.1f}"
                    for x in results.get("bandwidth", [])) + ".",
        "- Matrix-vector floor: the weights' matrix-vector products alone (every weight "
        "matrix times a `[batch, in]` vector, nothing else, each product's input the latest "
        "output of its width so that they run one after another as in a step), timed in the "
        "same round-robin, "
        "over their own floor (weight bytes over the bandwidth); what a step whose weights "
        "dominate its bytes can reach on this backend. Per cell: "
        + ", ".join(f"batch {x['batch']} n={x['context']}: {x['matvec_floor_multiple']:.2f}x "
                    f"({x['matvec_ms']:.1f} ms)"
                    for x in results.get("bandwidth", []) if "matvec_floor_multiple" in x)
        + ".",
        "- Attention floor: the full cache's attention alone (one query per head over every "
        "layer's caches, `certkv_jax.attention.certified.attend` without the certificate, as "
        "the full cache's step attends; each layer's output the next one's query, so the layers "
        "run "
        "one after another), timed in the same round-robin, over its own floor (the "
        "caches' key and value bytes over the bandwidth). Per cell: "
        + ", ".join(f"batch {x['batch']} n={x['context']}: "
                    f"{x['attention_floor_multiple']:.2f}x ({x['attention_ms']:.1f} ms)"
                    for x in results.get("bandwidth", []) if "attention_floor_multiple" in x)
        + ". The full cache's step beside its parts (ms; the rest: embedding, norms, "
        "rotary, appends, argmax; negative where the parts alone take longer than in "
        "the step, since each probe chains its pieces with ops of its own, a norm between "
        "products and a sum per layer, and overlaps nothing): "
        + ", ".join(_parts(results, x) for x in results.get("bandwidth", [])
                    if "attention_floor_multiple" in x)
        + ".",
        "",
        "- A step: the argmax token through `forward_chunk` plus `evict` with the traced "
        "budget, on caches prefilled with the design from a random prompt of `context` "
        "tokens and evicted once to the budget; the carry is donated (updated in place). "
        f"A timed call is {max(plan.get('evict_every', [1]))} decode steps for every "
        "configuration (the largest `--evict_every`: the same horizon for all), its time "
        "divided by that; `every k`: amortized eviction, the design evicts after every k-th "
        "step (`models.decode.generate(evict_every=k)`), otherwise after each.",
        "- Attention in a step: `forward_chunk` calls `certkv_jax.offset_attention` with its "
        "default `implementation='auto'` with the certificate (the compiled Pallas kernel on "
        "a TPU, the jnp reference elsewhere; this run: "
        + ("the Pallas kernel" if "(tpu)" in results.get("device", "") else "the jnp reference")
        + "), `certkv_jax.attention_probs` (jnp) without it.",
        f"- Cells: [median, interval] over the timed calls; interval levels {levels} "
        "(order statistics; >= 0.95 from 6 repeats on). Ratios: median of the per-round "
        "ratios to `full` (same round of the round-robin).",
        f"- Budgets: {summary.get('budgets_traced', '')}.",
        "- Prefill: `cached` is `forward_chunk` into empty caches of `context` + the timed "
        "calls' slots (as `generate` prefills, without the certificate"
        + (f"; {plan['prefill_chunk']} tokens per call, scanned" if plan.get("prefill_chunk")
           else "; the whole prompt in one call") + "); `plain` is "
        "`LlamaModel(config).apply(params, tokens)`, whose attention is "
        "`models.llama.grouped_attention`: a dense float32 "
        "einsum softmax materializing the [batch, heads, seq, seq] logits under a causal "
        "mask (no flash attention, no Pallas kernel).",
        "- Headline (`summary.json` `ratio_vs_full`): "
        f"{summary.get('headline', {}).get('note')}.",
        ""]
  if not results["complete"]:
    md += [f"**Incomplete**: cells done {results['cells_done']}, skipped "
           f"{results['cells_skipped']}.", ""]
  contexts = sorted({r["context"] for r in rows})
  for batch in sorted({r["batch"] for r in rows}):
    at = [r for r in rows if r["batch"] == batch]
    name = lambda r: label(r, multi)
    configs = list(dict.fromkeys((name(r), r["budget"]) for r in at))
    head = "| config | budget | " + " | ".join(f"n={c}" for c in contexts) + " |"
    rule = "|---|---|" + "---|" * len(contexts)

    def lines(fmt):
      out = [head, rule]
      for lab, bud in configs:
        cells = []
        for c in contexts:
          r = [x for x in at if name(x) == lab and x["budget"] == bud and x["context"] == c]
          cells.append(fmt(r[0]) if r else "")
        out.append(f"| {lab} | {'' if bud is None else key(bud)} | " + " | ".join(cells) + " |")
      return out
    md += [f"## Batch {batch}", "", "ms per decode step:", ""]
    md += lines(lambda r: _cell(r["median"], r["ci"]))
    md += ["", "Ratio to the full cache (same layer loop) and, after the slash, the "
           "step time over its floor:", ""]
    md += lines(lambda r: _cell(r["ratio_vs_full"], r["ratio_vs_full_ci"], 2)
                + (f" / {r['floor_multiple']:.2f}x" if "floor_multiple" in r else ""))
    if all("scan_over_unrolled" in r for r in at):
      md += ["", "Scan over unrolled step time (median of the per-round ratios; the same on "
             "both rows of a configuration):", ""]
      md += lines(lambda r: _cell(r["scan_over_unrolled"], r["scan_over_unrolled_ci"], 2))
    if all("bytes_ratio_vs_full" in r for r in at):
      md += ["", "Bytes ratio: (weight bytes + the step's cache bytes) / (weight bytes + the "
             "full cache's bytes), the ratio of a decode step that reads every weight and "
             "cache byte once at one bandwidth. Where the weights dominate it stays far above "
             "the budget b; a measured ratio below it means the full cache's step spends more "
             "time per cache byte than per weight byte (slicing, write-back and layout copies "
             "of the cache around the attention einsums), i.e. part of the measured gain is "
             "that overhead, which an attention kernel reading the cache once would remove:",
             ""]
      md += lines(lambda r: f"{r['bytes_ratio_vs_full']:.2f}")
    md += ["", "Compile seconds (first call minus steady state; * marks a new executable) "
           "and kept tokens after the first eviction / cache capacity:", ""]
    md += lines(lambda r: f"{r['compile_s']:.2f}{'*' if r['new_executable'] else ''} "
                f"({r['kept_tokens']}/{r['capacity']})")
    if any("compile_min_s" in r for r in at):
      n = max(len(r.get("compile_samples_s", [])) for r in at)
      md += ["", f"Compile seconds, trace + lowering + compilation alone, the fastest of {n} "
             f"({fresh_compiles(at)}), and over the full step's:", ""]
      full_min = {(r["context"], r["layer_loop"]): r["compile_min_s"] for r in at
                  if r["design"] == "full" and "compile_min_s" in r}
      def over_full(r, field):  # seconds, and over the full step's in the same loop
        if field not in r:
          return "-"
        return f"{r[field]:.2f} ({r[field] / full_min[(r['context'], r['layer_loop'])]:.2f}x)"
      md += lines(lambda r: over_full(r, "compile_min_s"))
      if any("eviction_compile_min_s" in r for r in at):
        md += ["", "Of a design's step, its eviction alone, compiled the same way (and over "
               "the full step's):", ""]
        md += lines(lambda r: over_full(r, "eviction_compile_min_s"))
    md += [""]
    p_at = [r for r in pre if r["batch"] == batch]
    if p_at:
      md += ["Prefill tokens/s (plain: not timed with --noplain_prefill):", "",
             "| context | cached | plain | cached/plain |", "|---|---|---|---|"]
      for c in contexts:
        got = {r["method"]: r for r in p_at if r["context"] == c}
        if "cached" not in got:
          continue
        cr, pr = got["cached"], got.get("plain")
        md.append(f"| {c} | {_cell(cr['tokens_per_s'], cr['tokens_per_s_ci'], 0)} | "
                  + ("| |" if pr is None else
                     f"{_cell(pr['tokens_per_s'], pr['tokens_per_s_ci'], 0)} | "
                     f"{cr['tokens_per_s'] / pr['tokens_per_s']:.2f} |"))
      md.append("")
  if rows:
    md += ["![decode_ms.png](decode_ms.png)", ""]
  return "\n".join(md)


def plot(results: dict, summary: dict, path: str) -> str:
  """ms per step vs context, one panel per budget, at the headline batch and layer loop."""
  b, hl = summary["batch"], summary.get("layer_loop")
  at = [r for r in results["decode"] if r["batch"] == b and hl in (None, loop(r))]
  full = sorted((r for r in at if r["design"] == "full"), key=lambda r: r["context"])

  def line(rs):
    rs = sorted(rs, key=lambda r: r["context"])
    return ([r["context"] for r in rs], [r["median"] for r in rs],
            ([r["ci"][0] for r in rs], [r["ci"][1] for r in rs]))
  panels = {}
  for bud in results["plan"]["budgets"]:
    lines = {"full": line(full)}
    for lab in dict.fromkeys(label(r) for r in at if r["design"] != "full"):
      rs = [r for r in at if label(r) == lab and r["budget"] == bud]
      if rs:
        lines[lab] = line(rs)
    panels[f"budget {key(bud)}"] = lines
  return plots.plot_panels(panels, path, xlabel="context (tokens)", ylabel="ms per decode step",
                           title=f"{results['model']}, batch {b}, {hl or 'scan'} layer loop, "
                           f"{results['device']}",
                           logx=True)


def write_outputs(results: dict, out: str) -> dict:
  """Writes ``results.json``, ``summary.json``, ``report.md`` and (with at least one cell)
  ``decode_ms.png`` under ``out``, each atomically; returns the summary."""
  summary = summarize(results)
  results_io.atomic_write_text(os.path.join(out, "results.json"),
                               json.dumps(results_io.json_safe(results), indent=1))
  results_io.atomic_write_text(os.path.join(out, "summary.json"),
                               json.dumps(results_io.json_safe(summary), indent=1))
  results_io.atomic_write_text(os.path.join(out, "report.md"), render(results, summary))
  if results["decode"]:
    plot(results, summary, os.path.join(out, "decode_ms.png"))
  return summary


def fresh_compiles(rows) -> str:
  """How the compile-alone tries of ``rows`` were made: runs before the traces were cleared
  (no ``compile_traces_cleared``) traced only the outer jit afresh."""
  if all(r.get("compile_traces_cleared") for r in rows if "compile_min_s" in r):
    return ("interleaved, each from a fresh jit with JAX's caches cleared: every jitted "
            "function traced again")
  return ("interleaved, each from a fresh outer jit; the jitted functions it calls kept "
          "their traces from the timed calls, so most of the tracing is not counted")
