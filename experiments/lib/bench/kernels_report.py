"""The kernel benchmark's report: a progress line per row and the markdown tables.

The rows are ``experiments.lib.bench.kernels``' cells; only their fields are read here.
"""

TARGETS = {"stats_over_offset": 1.15, "fraction_of_bandwidth": 0.5}  # issue 42, on a GPU


def row_text(r):
  """One row's line of progress: every method's time and bandwidth, the ratios."""
  parts = [f"n={r['n']:6d} d={r['d']:3d} read probe {r['bandwidth_gbps']:.1f} GB/s"]
  parts += [f"{m} {t * 1e3:.3f}ms {r['gbps'][m]:.1f}GB/s "
            f"({r['fraction_of_bandwidth'][m]:.0%})" for m, t in r["seconds"].items()]
  lo, hi, _ = r["stats_over_offset_interval"]
  parts.append(f"stats/offset {r['stats_over_offset']:.2f}x [{lo:.2f}, {hi:.2f}] "
               f"(exact range {r['exact_over_offset']:.2f}x; recomputing the norms "
               f"{r['recompute_over_offset']:.2f}x)")
  if "split_offset" in r:
    parts.append(f"values as stored: offset {r['split_offset']:.2f}x, stats "
                 f"{r['split_stats']:.2f}x of the float32 copy's time")
  if "pallas_gbps" in r:
    parts.append(f"pallas stats/offset {r['pallas_stats_over_offset']:.2f}x "
                 f"{r['pallas_gbps']:.0f} GB/s ({r['pallas_fraction']:.0%} of the probe)")
  return " | ".join(parts)


def _met(ok: bool) -> str:
  return "met" if ok else "**not met**"


def render(rows, device: str, plan) -> str:
  """The markdown report: a summary per cell, every method, the split sweep."""
  r0 = rows[0]
  pallas = "pallas_gbps" in r0
  levels = ", ".join(f"{x:.3f}" for x in sorted({r["stats_over_offset_interval"][2] for r in rows}))
  lines = ["# Decode attention: bandwidth and the cost of the certificate statistics", "",
           f"Device: {device}. Rows {r0['batch']} (sequence, KV head), GQA group "
           f"{r0['groups']}, dtype {r0['dtype']}; {plan.repeats} interleaved rounds after "
           "warm-up (every method and the probe once per round). A timed call is a jitted "
           "loop of `iters` attention calls (each one's queries depending on the previous "
           "output); times are ms per attention call (median over rounds). GB/s: the "
           "bytes a call must read (keys, values, float32 offsets, queries) over its time; "
           "`of probe`: as a fraction of the streaming-read bandwidth of a read-reduce of "
           f"a {r0['probe_bytes'] / 2**20:.0f} MiB buffer in the same rounds. "
           "`stats/offset`: median over rounds of the per-round ratio `stats_stored / "
           f"xla_offset` [order-statistic interval of the median, coverage {levels} with "
           f"{plan.repeats} rounds; >= 0.95 from 6 rounds on]; `exact` and "
           "`recompute`: the same for `stats_stored_exact` and `stats_bound`.", "",
           "## Summary", "",
           "| n | d | MB/call | iters | probe GB/s | stats/offset | exact | recompute |"
           + (" pallas stats/offset | pallas GB/s (of probe) | default splits |"
              if pallas else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if pallas else "")]
  for r in rows:
    lo, hi, _ = r["stats_over_offset_interval"]
    line = (f"| {r['n']} | {r['d']} | {r['bytes'] / 1e6:.1f} | {r['iters']} | "
            f"{r['bandwidth_gbps']:.1f} | {r['stats_over_offset']:.2f}x [{lo:.2f}, {hi:.2f}] | "
            f"{r['exact_over_offset']:.2f}x | {r['recompute_over_offset']:.2f}x |")
    if pallas:
      plo, phi, _ = r["pallas_stats_over_offset_interval"]
      line += (f" {r['pallas_stats_over_offset']:.2f}x [{plo:.2f}, {phi:.2f}] | "
               f"{r['pallas_gbps']:.1f} ({r['pallas_fraction']:.0%}) | "
               f"{r['default_block_sizes']['num_splits']} |")
    lines.append(line)
  if "split_offset" in r0:
    lines += ["", "Values read as stored (`AttentionConfig.split_values`, bfloat16): time "
              "over the same method with a float32 copy of the values (median of per-round "
              "ratios [interval]):", ""]
    for r in rows:
      (olo, ohi, _), (slo, shi, _) = r["split_offset_interval"], r["split_stats_interval"]
      lines.append(f"- n={r['n']}, d={r['d']}: `xla_offset_split / xla_offset` "
                   f"{r['split_offset']:.2f}x [{olo:.2f}, {ohi:.2f}]; "
                   f"`stats_stored_exact_split / stats_stored_exact` {r['split_stats']:.2f}x "
                   f"[{slo:.2f}, {shi:.2f}].")
  if pallas:
    lines += ["", "Targets of issue 42 (GPU), kernel with statistics (`pallas_stats_bound`) at "
              "the default tiling:"]
    for r in rows:
      lines.append(
          f"- n={r['n']}, d={r['d']}: stats/offset {r['pallas_stats_over_offset']:.2f}x <= "
          f"{TARGETS['stats_over_offset']}x "
          f"{_met(r['pallas_stats_over_offset'] <= TARGETS['stats_over_offset'])}; "
          f"{r['pallas_fraction']:.0%} of the probe >= "
          f"{TARGETS['fraction_of_bandwidth']:.0%} "
          f"{_met(r['pallas_fraction'] >= TARGETS['fraction_of_bandwidth'])}.")
  lines += ["", "## Every method", "",
            "| n | d | method | ms/call | GB/s | of probe | ratio to plain |",
            "|---|---|---|---|---|---|---|"]
  for r in rows:
    for m, t in r["seconds"].items():
      lines.append(f"| {r['n']} | {r['d']} | {m} | {t * 1e3:.4f} | {r['gbps'][m]:.1f} | "
                   f"{r['fraction_of_bandwidth'][m]:.0%} | {r['ratio_to_plain'][m]:.2f}x |")
  if pallas and any(r["sweep"] for r in rows):
    lines += ["", "## Pallas kernel: tiling sweep", "",
              "Label `k{block_k}s{splits}w{warps}`, `n{stages}` where Triton's pipeline "
              "stages are not 2; `v`: bfloat16 values multiplied as stored (two bfloat16 "
              "products per tile) instead of as a float32 copy.", "",
              "| n | d | tiling | padded slots | offset ms | stats ms | stats/offset "
              "| offset GB/s (of probe) | stats GB/s (of probe) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      for s in r["sweep"]:
        mark = " (default)" if s["default"] else ""
        lines.append(f"| {r['n']} | {r['d']} | {s['label']}{mark} | {s['padded_slots']} | "
                     f"{s['offset_ms']:.4f} | {s['stats_ms']:.4f} | "
                     f"{s['stats_over_offset']:.2f}x | {s['offset_gbps']:.1f} "
                     f"({s['offset_fraction']:.0%}) | {s['stats_gbps']:.1f} "
                     f"({s['stats_fraction']:.0%}) |")
  return "\n".join(lines) + "\n"
