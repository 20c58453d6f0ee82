"""Sections of ``docs/results.md`` on speed and the synthetic checks: kernels, the decode
benchmark, sharded decoding, the Monte Carlo of the certificate, and what is not measured."""

from __future__ import annotations

from experiments.lib.bench import decode_report
from experiments.lib.results_doc import markdown as fmt


def kernels(root: str) -> list[str]:
  d = fmt.read_json(root, "bench_cpu.json")
  rows = d["rows"]
  out = ["## Kernels: cost of the certificate statistics", ""]
  out += fmt.source(["bench_cpu.json", "bench_cpu.md"], fmt.command(root, "bench_cpu.md"))
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
  out += fmt.table(["n", "d", "plain ms", "xla_offset ms", "stored exact / offset",
                    "stored bound / offset", "recompute / offset", "stats_exact / plain"], body)
  big = [r for r in rows if r["n"] >= 4096]
  target = 1.15
  met = all(r["exact_over_offset"] <= target for r in big)
  exact = fmt.span([r["exact_over_offset"] for r in big], ".2f")
  recompute = fmt.span([r["ratio_to_plain"]["stats_exact"] for r in big], ".2f")
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


def gpu_h200(root: str) -> list[str]:
  """The first H200 runs: the kernel bench's cell and the device check's parts."""
  d = fmt.read_json(root, "gpu_h200/bench_kernels.json")
  parts = fmt.read_json(root, "gpu_h200/device_check_parts.json")
  out = ["## On an H200", ""]
  out += fmt.source(["gpu_h200/bench_kernels.json", "gpu_h200/COMMAND.md",
                     "gpu_h200/device_check_parts.json"],
                    fmt.command(root, "gpu_h200/COMMAND.md"))
  for r in d["rows"]:
    out += [f"Device {d['device']}; {r['batch']} rows x {r['n']:,} keys x d {r['d']}, GQA group "
            f"{r['groups']}, {r['dtype']}, {r['rounds']} interleaved rounds of {r['iters']} calls; "
            f"read probe {r['bandwidth_gbps']:,.0f} GB/s. ms per call (median), GB/s and the "
            "fraction of the probe:", ""]
    body = [[f"`{m}`", f"{t * 1e3:.3f}", f"{r['gbps'][m]:,.0f}",
             f"{r['fraction_of_bandwidth'][m]:.0%}"] for m, t in r["seconds"].items()]
    out += fmt.table(["method", "ms", "GB/s", "of probe"], body)
    lo, hi, level = r["stats_over_offset_interval"]
    out += ["", f"Statistics over the offset-only attention: XLA path {r['stats_over_offset']:.2f}x "
            f"[{lo:.2f}, {hi:.2f}] (median's order-statistic interval, coverage {level:.3f} "
            f"from {r['rounds']} rounds); Pallas kernel {r['pallas_stats_over_offset']:.2f}x at "
            f"{r['pallas_fraction']:.0%} of the probe (issue 42's targets: <= 1.15x at >= 50%). "
            "From this run on `implementation=\"auto\"` takes the XLA path on a GPU; on the H100 "
            "(below, values read as stored, 64-key tiles) the kernel is ahead of the XLA path, "
            "but no decode step has been timed with it yet."]
  status = {}
  for name, p in parts.items():
    if not name.startswith("_"):
      status.setdefault(p["status"], []).append(f"`{name}` ({p['seconds']} s)")
  out += ["", f"The device check ({parts['_run']['seconds']} s): "
          + "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(status.items()))
          + ". Its failures and what stopped the timings: `gpu_h200/COMMAND.md`."]
  return out


def gpu_h100(root: str) -> list[str]:
  """The H100 runs: the kernel's tiling sweep and the 1B decode step, values copied and
  as stored."""
  d = fmt.read_json(root, "gpu_h100/bench_kernels.json")
  r = d["rows"][0]
  out = ["## On an H100", ""]
  out += fmt.source(["gpu_h100/bench_kernels.json", "gpu_h100/decode_copy_summary.json",
                     "gpu_h100/decode_stored_summary.json", "gpu_h100/COMMAND.md"],
                    "bash scripts/device_check.sh (the settings: gpu_h100/COMMAND.md)")
  ms = lambda m: f"{r['seconds'][m] * 1e3:.3f}"
  frac = lambda m: f"{r['fraction_of_bandwidth'][m]:.0%}"
  out += [f"Device {d['device']}; {r['batch']} rows x {r['n']:,} keys x d {r['d']}, GQA group "
          f"{r['groups']}, {r['dtype']}, {r['rounds']} interleaved rounds; read probe "
          f"{r['bandwidth_gbps']:,.0f} GB/s. ms per call (median) and the fraction of the "
          "probe, without and with the certificate's statistics (range bound); `v`: values "
          "multiplied as stored (`split_values`), else copied to float32:", ""]
  body = [["`jax.nn.dot_product_attention` + offset bias", ms("offset"), frac("offset"), "", ""],
          ["XLA path, values copied", ms("xla_offset"), frac("xla_offset"),
           ms("stats_stored"), frac("stats_stored")]]
  for t in sorted(r["sweep"], key=lambda t: t["stats_ms"]):
    body.append([f"kernel `{t['label']}`", f"{t['offset_ms']:.3f}",
                 f"{t['offset_fraction']:.0%}", f"{t['stats_ms']:.3f}",
                 f"{t['stats_fraction']:.0%}"])
  out += fmt.table(["method", "offset ms", "of probe", "with statistics ms", "of probe"], body)
  best = min(r["sweep"], key=lambda t: t["stats_ms"])
  fastest = min(t["offset_ms"] for t in r["sweep"])
  out += ["", f"The fastest kernel with statistics (`{best['label']}`, now the default for "
          f"bfloat16 values) reads at {best['stats_fraction']:.0%} of the probe, "
          f"{best['stats_over_offset']:.2f}x its own offset-only time and "
          f"{best['stats_ms'] / fastest:.2f}x the fastest offset-only kernel's (issue 42: "
          ">= 50% met; <= 1.15x not met). 128-key tiles with the values copied to float32 "
          "ran at 0-2% of the probe (`gpu_h100/bench_kernels_run1.md`; register pressure is "
          "the likely cause, not measured).", ""]
  rows = []
  for name, label in (("copy", "copied"), ("stored", "as stored")):
    sm = fmt.read_json(root, f"gpu_h100/decode_{name}_summary.json")
    c = next(iter(sm["full_ms"]))
    fm = sm["floor_multiple"]
    row = [label, f"{sm['full_ms'][c]:.2f}", f"{fm['full']['1.0'][c]:.2f}x"]
    for design in ("poisson_tail", "snapkv"):
      b = next(iter(fm[design]))
      ratio = sm["ratio_vs_full_by_design"][design]["with_certificate"][b][c]
      row.append(f"{ratio:.2f} / {fm[design][b][c]:.2f}x")
    row.append(f"{sm['matvec_floor_multiple'][c]:.2f}x / "
               f"{sm['attention_floor_multiple'][c]:.2f}x")
    rows.append(row)
  out += [f"The Llama-3.2-1B-like shape (random weights), {sm['dtype']}, {int(c):,} tokens, "
          f"batch {sm['batch']}, designs at {fmt.pct(b)} with the certificate evicting every "
          f"{sm['evict_every']} steps, layer loop `{sm['layer_loop']}`, XLA attention "
          "(`implementation=\"auto\"`). ms per step of the full cache and its floor multiple "
          "(weight and cache bytes over the read probe of the same round-robin); each design's "
          "time over the full step's / over its own floor; the weights' matrix-vector products "
          "and the full cache's attention alone over their floors:", ""]
  out += fmt.table(["values", "full ms", "full / floor", "`poisson_tail+cert`",
                    "`snapkv+cert`", "matvecs / attention alone"], rows)
  stored = fmt.read_json(root, "gpu_h100/decode_stored_summary.json")
  c = next(iter(stored["full_ms"]))
  scale = r["bandwidth_gbps"] / stored["bandwidth_gbps"][c]  # the looped probe's over this one's
  fm = stored["floor_multiple"]
  designs = [fm[d][next(iter(fm[d]))][c] * scale for d in ("poisson_tail", "snapkv")]
  out += ["", f"These floors use the decode run's read probe, one read per call: "
          f"{stored['bandwidth_gbps'][c]:,.0f} GB/s (values as stored), where the kernel "
          f"bench's probe, {r['bandwidth_gbps']:,.0f} GB/s, loops its reads in one call "
          "(same H100, same session). At that bandwidth the full step (values as stored) is "
          f"{fm['full']['1.0'][c] * scale:.2f}x its floor and the designs "
          f"{min(designs):.2f}-{max(designs):.2f}x theirs: the decode bench's probes loop "
          "since 8497db1, so a new run reads the floor the way the kernel bench does.",
          "", "Issue 42's decode targets (full step within 1.5x of its floor, a design at "
          "12.5% within 1.5x of its own) are not met on this H100; reading the values as "
          "stored is now the default (`AttentionConfig.split_values`)."]
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
  return fmt.table(["context", "full ms/step"]
                   + [f"{fmt.pct(b)}: k=1 [95% CI]" + (f" / k={k}" if k else "") + " (bytes)"
                      for b in budgets], body)


def _floor_lines(s) -> list[str]:
  """The step times over their floors (issue 24's targets), when the run measured them."""
  fm, ratio = s.get("floor_multiple") or {}, s.get("layer_loop_ratio") or {}
  if not fm:
    return []
  ctxs = sorted({c for per_b in fm.values() for per_c in per_b.values() for c in per_c}, key=int)
  body = []
  for design, per_b in fm.items():
    for b in sorted(per_b, key=float):
      cells = []
      for c in ctxs:
        v = per_b[b].get(c)
        r = ratio.get(design, {}).get(b, {}).get(c)
        cells.append("" if v is None else f"{v:.2f}x" + ("" if r is None else f" ({r:.2f})"))
      body.append([f"`{design}`", "" if design == "full" else fmt.pct(b)] + cells)
  bw = s.get("bandwidth_gbps", {})
  mv = s.get("matvec_floor_multiple", {})
  att = s.get("attention_floor_multiple", {})
  full = fm["full"]["1.0"]
  designs = [(d, b, c, v) for d, per_b in fm.items() if d != "full"
             for b, per_c in per_b.items() for c, v in per_c.items()]
  long = [c for c in ctxs if int(c) >= 2048]
  return ["", f"Step time over its floor, batch {s['batch']}, layer loop `{s['layer_loop']}` "
          "(the floor: the step's weight and cache bytes, slots at the design's bytes per slot "
          "with its metadata, over this machine's streaming-read bandwidth measured in the same "
          "round-robin: " + ", ".join(f"{float(bw[c]):.1f} GB/s at {int(c):,}" for c in ctxs
                                       if c in bw)
          + "); in parentheses the scan loop's time over the unrolled one's, same rounds:", ""] \
      + fmt.table(["design", "budget"] + [f"n={int(c):,}" for c in ctxs], body) \
      + ["", "Issue 24's targets: the full cache at <= 1.5x of its floor at 2k and 4k "
         f"({' / '.join(f'{full[c]:.2f}x' for c in long if c in full)}: "
         f"{'met' if all(full[c] <= 1.5 for c in long if c in full) else 'not met'}), every "
         f"design at <= 1.3x of its own ({fmt.span([v for *_, v in designs], '.2f')}x: "
         f"{'met' if designs and all(v <= 1.3 for *_, v in designs) else 'not met'}). "
         "The weights' matrix-vector products alone (every weight matrix times the step's "
         "vector, nothing else, timed in the same round-robin) take "
         + " / ".join(f"{mv[c]:.2f}x" for c in ctxs if c in mv)
         + " of their own floor" + (
             ": this backend's matrix-vector product does not stream the weights at the "
             "bandwidth a reduction reaches, and the weights are most of a step's bytes at "
             "batch 1, so a whole step cannot come near 1.5x of its floor here."
             if mv and min(mv.values()) >= 1.45 else ".")
         + ("" if not att else " The full cache's attention alone (one query per head over "
            "every layer's caches, same round-robin) takes "
            + " / ".join(f"{att[c]:.2f}x" for c in ctxs if c in att)
            + " of its floor (the caches' key and value bytes).")]


def bench_decode(root: str) -> list[str]:
  s1 = fmt.read_json(root, "bench_decode/summary.json")
  s8 = fmt.read_json(root, "bench_decode_batch8/summary.json")
  out = ["## Decode benchmark", ""]
  out += fmt.source(["bench_decode/summary.json", "bench_decode/COMMAND.md"],
                    fmt.command(root, "bench_decode/COMMAND.md"))
  out += [f"One jitted decode step of `{s1['design']}` "
          f"{'with' if s1['certificate'] else 'without'} the certificate against the full "
          f"cache ({s1['device']}; caches {s1['capacity_layout']}): ratio of ms per step to the "
          "full cache's, evicting after every step (k=1) or amortized, and in parentheses the "
          "bytes ratio (weights + the step's cache over weights + the full cache). "
          f"Batch {s1['batch']}:", ""]
  out += _decode_table(s1)
  out += ["", f"Batch {s8['batch']} ({fmt.link('bench_decode_batch8/summary.json')}, command "
          f"`{fmt.command(root, 'bench_decode_batch8/COMMAND.md')}`):", ""]
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
                    for c in sorted(pre.get("plain_tokens_per_s", {}), key=int))
  out += ["", f"The (b + 0.1) target of issue 15 at >= 2k tokens is "
          f"{'met in ' + str(len(hit)) + ' cells' if hit else 'not met'}: at "
          f"{int(c_max):,} tokens the ratios are {at_max} (target {targets}), and a step "
          f"that read every byte once would still cost {bytes_max} of the full one: the "
          f"weights outweigh the cache at batch 1. Cached prefill: {cached} tokens/s"
          + (f" against the plain forward's {plain} (dense [seq, seq] softmax)." if plain
             else " (the plain forward was not timed in this run).")]
  out += _floor_lines(s1)
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


def bench_decode_parts(root: str) -> list[str]:
  """The full cache's decode step split into the weights' products, the attention and
  the rest, each part timed alone beside the step (``bench_decode_parts``)."""
  rel = "bench_decode_parts"
  s = fmt.read_json(root, f"{rel}/summary.json")
  res = fmt.read_json(root, f"{rel}/results.json")
  out = ["## Decode step and its parts", ""]
  out += fmt.run_source(root, rel)
  body = []
  for bw in res["bandwidth"]:
    c = str(bw["context"])
    full, _, _, rest = decode_report.step_parts(res, bw)
    body.append([f"{int(c):,}", f"{bw['gbps']:.1f}", f"{full:.1f}",
                 f"{s['floor_multiple']['full']['1.0'][c]:.2f}x",
                 f"{bw['matvec_ms']:.1f} ({bw['matvec_floor_multiple']:.2f}x)",
                 f"{bw['attention_ms']:.1f} ({bw['attention_floor_multiple']:.2f}x)",
                 f"{rest:.1f}"])
  out += [f"Batch {s['batch']}, layer loop `{s['layer_loop']}`: the full cache's step, its "
          "floor multiple, and its parts timed alone in the same round-robin (the weights' "
          "matrix-vector products, and the attention over every layer's caches; COMMAND.md "
          "says whether the probes ran chained, as a step does, or could overlap), each with "
          "its own floor multiple; the rest is the step less the two parts (embedding, norms, "
          "rotary, appends, argmax), negative where the chained probes, with their chaining "
          "ops (a norm between products, a sum per layer), take longer than the same "
          "work in the step:", ""]
  out += fmt.table(["context", "GB/s", "full ms", "full / floor", "matvecs ms (/ floor)",
                    "attention ms (/ floor)", "rest ms"], body)
  return out + _floor_lines(s)


def bench_decode_compile(root: str) -> list[str]:
  """Compile seconds of the design steps against the full step's (``bench_decode_compile``)."""
  rel = "bench_decode_compile"
  res = fmt.read_json(root, f"{rel}/results.json")
  out = ["## Decode step compile time", ""]
  out += fmt.source([f"{rel}/results.json", f"{rel}/report.md", f"{rel}/COMMAND.md"],
                    fmt.command(root, f"{rel}/COMMAND.md"))
  rows = res["decode"]
  alone = all("compile_min_s" in r for r in rows)  # --compile_repeats
  eviction = alone and any("eviction_compile_min_s" in r for r in rows)
  body = []
  for loop in sorted({r["layer_loop"] for r in rows}):
    at = [r for r in rows if r["layer_loop"] == loop]
    full = next(r for r in at if r["design"] == "full")
    for r in at:
      label = r["design"] + ("+certificate" if r["certificate"] else "")
      body.append([loop, label, "" if r["budget"] is None else f"{r['budget']:g}",
                   f"{int(r['context']):,}", f"{r['compile_s']:.2f}",
                   f"{r['compile_s'] / full['compile_s']:.2f}x"])
      if alone:
        body[-1] += [f"{r['compile_min_s']:.2f}",
                     f"{r['compile_min_s'] / full['compile_min_s']:.2f}x"]
      if eviction:
        ev = r.get("eviction_compile_min_s")
        body[-1] += ["", ""] if ev is None else [
            f"{ev:.2f}", f"{ev / full['compile_min_s']:.2f}x"]
  head = ["layer loop", "step", "budget", "context", "compile s", "/ full"]
  out += ["Compile seconds of one jitted decode step (first call minus steady state), and "
          "over the full cache's step in the same layer loop (issue 42's CPU target: at "
          "most 2x)" + (f"; then trace, lowering and compilation alone, the fastest of "
                        f"{len(rows[0]['compile_samples_s'])} tries "
                        f"({decode_report.fresh_compiles(rows)}), and its ratio"
                        if alone else "") + ":", ""]
  if alone:
    head += ["alone, fastest s", "/ full"]
  if eviction:
    head += ["its eviction alone s", "/ full"]
  out += fmt.table(head, body)
  return out


def sharding(root: str) -> list[str]:
  rows = fmt.read_rows(root, "bench_sharding_cpu.jsonl")
  out = ["## Sharded decoding (fake CPU devices)", ""]
  n_dev = max(r["devices"] for r in rows)
  out += [f"Source: {fmt.link('bench_sharding_cpu.jsonl')}, {fmt.link('bench_sharding_cpu.md')}. "
          f"Command: `python -m experiments.bench_sharding --fake_devices={n_dev} "
          "--out=experiments/results/bench_sharding_cpu.md` with the model flags of the setup "
          "below (the exact flag values were not recorded with the run).", ""]
  out += [f"{rows[0]['setup']}", ""]
  body = [[r["mesh"], r["devices"], f"{fmt.mib(r['cache_bytes_per_device'])} of "
           f"{fmt.mib(r['cache_bytes_total'])}", f"{r['cache_fraction_per_device']:.4f}",
           f"{fmt.mib(r['param_bytes_per_device'])}", f"{fmt.mib(r['xla_temp_bytes'])}",
           f"{r['ms_per_token']:.1f}", r["same_tokens"], f"{r['max_logit_diff']:.2e}"]
          for r in rows]
  out += fmt.table(["mesh (data x model x seq)", "devices", "cache MiB / device", "fraction",
                    "params MiB / device", "XLA temp MiB / device", "ms / token",
                    "same tokens as 1 device", "max logit diff"], body)
  multi = [r for r in rows if r["devices"] > 1]
  frac = fmt.span([r["cache_fraction_per_device"] for r in multi], ".4f")
  same = sum(bool(r["same_tokens"]) for r in multi)
  out += ["", f"On {n_dev} devices each holds {frac} of the cache for every mesh shape; "
          f"tokens equal one device's in {same} of {len(multi)} sharded runs, logits to "
          f"{max(r['max_logit_diff'] for r in multi):.1e}. Fake devices share the host's cores: "
          "the times measure the partitioned program's overhead, not a speed-up."]
  return out


def montecarlo(root: str) -> list[str]:
  rows = fmt.read_rows(root, "montecarlo/rows.jsonl")
  out = ["## Synthetic Monte Carlo of the certificate", ""]
  out += [f"Source: {fmt.link('montecarlo/rows.jsonl')} (full table: "
          f"{fmt.link('montecarlo/summary.md')}). Command: "
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
  out += fmt.table(["design", "kept (of budget)", "MSE", "bias/MC", "E[V_hat]/MSE", "cov@0.01",
                    "cov@0.05", "sharp@0.05", "median R"],
                [[f"`{r['design']}`", f"{r['mean_kept']:.1f} of {r['budget_tokens']}",
                  f"{r['mse']:.3g}", _bias_ratio(r), f"{r['var_ratio']:.3f}",
                  f"{r['coverage']['0.01']:.3f}",
                  f"{r['coverage']['0.05']:.3f}", fmt.num(r["sharpness"]["0.05"], ".2f"),
                  f"{r['median_R']:.3g}" if r["randomized"] or r["median_R"] else "-"]
                 for r in sel])
  rs = [r for r in sel if r["randomized"] and r["var_ratio"] > 0]
  hi = max(rs, key=lambda r: r["median_R"]) if rs else None
  lo = min(rs, key=lambda r: r["median_R"]) if rs else None
  zero = [r["design"] for r in sel if r["var_ratio"] == 0]
  out += ["", "bias/MC: `||mean(o_hat) - o||` over its Monte Carlo scale (the root of the "
          "summed squared standard errors of the mean), about 1 for an unbiased estimator "
          "(`chi_d / sqrt(d)`), `-` for one trial; the Hajek ratio is unbiased to first order "
          "only (method, section 3).",
          "", f"{', '.join(f'`{x}`' for x in zero)} have V_hat = 0, a zero radius, and cover "
          "no non-zero error (Theorem 1)."]
  if hi and lo:
    out[-1] += (f" Where R is large the certificate under-covers (`{hi['design']}`: R "
                f"{hi['median_R']:.3g}, coverage {hi['coverage']['0.05']:.3f} at delta 0.05); "
                f"where it is small it covers (`{lo['design']}`: R {lo['median_R']:.3g}, "
                f"{lo['coverage']['0.05']:.3f}). At equal memory the randomized designs keep "
                f"fewer tokens ({fmt.span([r['mean_kept'] for r in rs], '.0f')} of "
                f"{rs[0]['budget_tokens']} slots), the cost of the capacity rule.")
  return out


def _bias_ratio(row) -> str:
  se = row.get("bias_se")
  return f"{row['bias_norm'] / se:.2f}" if se else "-"


def not_measured(root: str) -> list[str]:
  devices = sorted({fmt.read_json(root, "bench_cpu.json")["device"],
                    fmt.read_json(root, "bench_decode/summary.json")["device"]})
  return ["## What is not measured", "",
          f"* Every committed benchmark but the H200 and H100 sections ran on "
          f"{' and '.join(devices)}. On a GPU the 135M model's decode step, batches other "
          "than 4, the Pallas kernel inside the model's step, the compiled Mosaic (TPU) "
          "kernel and the suggested mesh layouts have not been measured.",
          "* The documented `--full` suite size has not been run as one command; the committed "
          "larger run is the reduced one above.",
          "* The tail floor (`min_tail`): its question-aware regime and its quality at equal "
          "memory. The damage study: 50% budgets and predictors trained on task steps."]
