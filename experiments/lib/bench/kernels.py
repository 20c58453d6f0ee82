r"""Decode-attention benchmark: what do the certificate statistics cost?

Side by side in one run (the machine is shared and noisy: compare ratios, not
absolute times), for each cache length and head dim:

* ``plain``: ``jax.nn.dot_product_attention`` with the validity mask;
* ``offset``: the same with the Hajek offsets as a bias (no statistics);
* ``xla_offset``: our XLA path (``reference.grouped_reference``) with the
  statistics switched off: offset attention alone, same code;
* ``stats_stored``: ``certkv_jax.offset_attention`` with the fused
  statistics and the one-pass range bound, reading each slot's stored
  ``||v_i||^2`` (``value_sqnorm``, as the model's caches keep them:
  ``KVCache.v_sq``);
* ``stats_stored_exact``: the same with the exact range term, which then
  takes its distances from the stored norms and one matmul (the model's
  decode path: ``certkv_jax.certified_attention`` uses the exact range);
* ``stats_bound`` / ``stats_exact``: the same statistics recomputing the
  norms from the values (one more pass over them), with the one-pass range
  bound / the exact range term;
* on a GPU or TPU also the Pallas kernel: ``pallas_offset`` (kernel without
  statistics), ``pallas_stats_bound``, ``pallas_stats_exact``, with the
  achieved memory bandwidth (bytes of K, V and offsets read per second).

The methods are timed in interleaved rounds (round r times every method once,
in turn), so that a slow spell of the shared machine hits all of them; the
reported time is the median over rounds. Ratios are to ``plain``. The
statistics' own cost is the median over rounds of the per-round ratio
``stats_stored / xla_offset`` (target <= 1.15 on the XLA path), with its
order-statistic interval (``intervals.median_interval``: coverage >= 0.95
from 6 rounds on; the level it has is stored beside it), and ``pallas_stats_bound / pallas_offset`` (target
<= 1.05 on a GPU).

The command: ``python -m experiments.bench_kernels --out=experiments/results/bench_cpu.md``.
"""

import dataclasses
import json
import os
import platform
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp

import certkv_jax
from experiments.lib import results_io
from experiments.lib.stats import intervals
from pallas_kernels import offset_decode
from pallas_kernels import reference


def _time_rounds(methods, args, repeats):
  """{name: [seconds per round]}: every method once per round, in turn."""
  for fn in methods.values():
    jax.block_until_ready(fn(*args))  # compile + warm up
  times = {name: [] for name in methods}
  for _ in range(repeats):
    for name, fn in methods.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
  return times


def _inputs(n, d, batch, groups, dtype):
  ks = jax.random.split(jax.random.PRNGKey(n + d), 5)
  q = jax.random.normal(ks[0], (batch, groups, d), dtype)
  k = jax.random.normal(ks[1], (batch, n, d), dtype)
  v = jax.random.normal(ks[2], (batch, n, d), dtype)
  log_pi = jnp.where(jax.random.bernoulli(ks[3], 0.5, (batch, n)), 0.0,
                     jnp.log(jax.random.uniform(ks[4], (batch, n), minval=1e-3)))
  mask = jnp.arange(n)[None, :] < n - 17  # a few empty slots
  mask = jnp.broadcast_to(mask, (batch, n))
  # What the cache stores beside the values: each slot's squared norm.
  sq = jnp.sum(v.astype(jnp.float32) ** 2, axis=-1)
  return q, k, v, log_pi, mask, jnp.where(mask, sq, 0.0)


def _methods(use_pallas):
  def plain(q, k, v, log_pi, mask, *norms):
    del log_pi, norms
    return jax.nn.dot_product_attention(q[:, None], k[:, :, None], v[:, :, None],
                                        mask=mask[:, None, None, :])

  def offset(q, k, v, log_pi, mask, *norms):
    del norms
    bias = jnp.where(mask, -log_pi, 0.0).astype(q.dtype)[:, None, None, :]
    return jax.nn.dot_product_attention(q[:, None], k[:, :, None], v[:, :, None],
                                        bias=bias, mask=mask[:, None, None, :])

  def stats(range_mode, stored=False):
    def f(q, k, v, log_pi, mask, sq):
      kw = {"value_sqnorm": sq[:, None]} if stored else {}
      return certkv_jax.offset_attention(
          q, k[:, None], v[:, None], log_pi[:, None], mask[:, None],
          config=certkv_jax.attention.AttentionConfig(range_mode=range_mode), **kw)
    return f

  def xla_offset(q, k, v, log_pi, mask, *norms):
    del norms
    return reference.grouped_reference(q, k, v, log_pi, mask, config=reference.ReferenceConfig(
        range_mode="bound", with_stats=False))

  methods = {"plain": plain, "offset": offset, "xla_offset": xla_offset,
             "stats_stored": stats("bound", stored=True),
             "stats_stored_exact": stats("exact", stored=True), "stats_bound": stats("bound"),
             "stats_exact": stats("exact")}
  if use_pallas:
    def kernel(with_stats, range_mode):
      def f(q, k, v, log_pi, mask, *norms):
        del norms
        off = jnp.where(mask, -log_pi, -jnp.inf)
        return offset_decode.offset_decode_attention(
            q, k, v, off, with_stats=with_stats,
            config=offset_decode.KernelConfig(range_mode=range_mode))
      return f
    methods.update({"pallas_offset": kernel(False, "bound"),
                    "pallas_stats_bound": kernel(True, "bound"),
                    "pallas_stats_exact": kernel(True, "exact")})
  return {name: jax.jit(fn) for name, fn in methods.items()}


def run(lengths, head_dims, batch, groups, dtype, repeats, use_pallas):
  rows = []
  methods = _methods(use_pallas)
  for d in head_dims:
    for n in lengths:
      args = _inputs(n, d, batch, groups, dtype)
      rounds = _time_rounds(methods, args, repeats)
      times = {name: statistics.median(ts) for name, ts in rounds.items()}
      kv_bytes = 2 * batch * n * d * jnp.dtype(dtype).itemsize + batch * n * 4
      row = {"n": n, "d": d, "batch": batch, "groups": groups, "dtype": jnp.dtype(dtype).name,
             "seconds": times, "rounds": repeats}
      row["ratio_to_plain"] = {m: t / times["plain"] for m, t in times.items()}
      per_round = lambda a, b: [x / y for x, y in zip(rounds[a], rounds[b])]
      ratio = intervals.median_interval(per_round("stats_stored", "xla_offset"))
      row["stats_over_offset"] = ratio["median"]
      row["stats_over_offset_interval"] = [ratio["lo"], ratio["hi"], ratio["level"]]
      row["recompute_over_offset"] = intervals.median_interval(
          per_round("stats_bound", "xla_offset"))["median"]
      row["exact_over_offset"] = intervals.median_interval(
          per_round("stats_stored_exact", "xla_offset"))["median"]
      if use_pallas:
        row["pallas_stats_over_offset"] = (times["pallas_stats_bound"]
                                           / times["pallas_offset"])
        row["pallas_gbps"] = kv_bytes / times["pallas_stats_bound"] / 1e9
      rows.append(row)
      print(_row_text(row), flush=True)
  return rows


def _row_text(r):
  parts = [f"n={r['n']:6d} d={r['d']:3d}"]
  parts += [f"{m} {t * 1e3:8.3f}ms ({r['ratio_to_plain'][m]:.2f}x)"
            for m, t in r["seconds"].items()]
  lo, hi, _ = r["stats_over_offset_interval"]
  parts.append(f"stats/offset {r['stats_over_offset']:.2f}x [{lo:.2f}, {hi:.2f}] "
               f"(exact range {r['exact_over_offset']:.2f}x; recomputing the norms "
               f"{r['recompute_over_offset']:.2f}x)")
  if "pallas_gbps" in r:
    parts.append(f"pallas stats/offset {r['pallas_stats_over_offset']:.2f}x "
                 f"{r['pallas_gbps']:.0f} GB/s")
  return " | ".join(parts)


def render(rows, device: str, repeats: int) -> str:
  methods = list(rows[0]["seconds"])
  lines = ["# Decode attention: cost of the certificate statistics", "",
           f"Device: {device}. Batch rows {rows[0]['batch']}, GQA group {rows[0]['groups']}, "
           f"dtype {rows[0]['dtype']}; {repeats} interleaved rounds after warm-up (every "
           "method once per round); times in ms (median over rounds), ratio to `plain` in "
           "parentheses. `stats/offset`: median over rounds of the per-round ratio "
           "`stats_stored / xla_offset` [order-statistic interval, >= 95% from 6 rounds]; "
           "`exact` and `recompute`: the same for `stats_stored_exact / xla_offset` and "
           "`stats_bound / xla_offset`.", "",
           "| n | d | " + " | ".join(methods) + " | stats/offset | exact | recompute |"
           + (" pallas stats/offset | pallas GB/s |" if "pallas_gbps" in rows[0] else ""),
           "|---|---|" + "---|" * (len(methods) + 3)
           + ("---|---|" if "pallas_gbps" in rows[0] else "")]
  for r in rows:
    cells = " | ".join(f"{r['seconds'][m] * 1e3:.3f} ({r['ratio_to_plain'][m]:.2f}x)"
                       for m in methods)
    extra = ""
    if "pallas_gbps" in r:
      extra = f" {r['pallas_stats_over_offset']:.2f}x | {r['pallas_gbps']:.0f} |"
    lo, hi, _ = r["stats_over_offset_interval"]
    lines.append(f"| {r['n']} | {r['d']} | {cells} | {r['stats_over_offset']:.2f}x "
                 f"[{lo:.2f}, {hi:.2f}] | {r['exact_over_offset']:.2f}x | "
                 f"{r['recompute_over_offset']:.2f}x |{extra}")
  return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run_and_report` times (the flags of ``experiments/bench_kernels.py``)."""

  lengths: tuple = (1024, 4096, 16384, 32768)  # cache lengths
  head_dims: tuple = (64, 128)
  batch: int = 8  # rows of (sequence, KV head)
  groups: int = 4  # query heads per KV head (GQA group)
  dtype: str = "bfloat16"  # K/V/Q dtype
  repeats: int = 7  # interleaved timed rounds
  pallas: Optional[bool] = None  # the Pallas kernel too (None: on a GPU or TPU only)


def run_and_report(plan: Plan, *, out=None, profile_dir=None) -> list[dict]:
  """The command: checks the sizes, times every method of ``plan``, optionally under a
  profiler trace (``profile_dir``), and writes the markdown table to ``out`` (JSON rows
  beside it); returns the rows."""
  lengths = [int(x) for x in plan.lengths]
  head_dims = [int(x) for x in plan.head_dims]
  for name, vals in (("lengths", lengths), ("head_dims", head_dims)):
    if any(x < 1 for x in vals):
      raise ValueError(f"--{name} must be positive ints, got {vals}")
  use_pallas = plan.pallas
  if use_pallas is None:
    use_pallas = jax.default_backend() in ("gpu", "tpu")
  device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {platform.machine()}, " \
           f"jax {jax.__version__}"
  print(device, flush=True)
  dtype = jnp.dtype(plan.dtype)
  repeats = plan.repeats
  if profile_dir:
    jax.profiler.start_trace(profile_dir)
  try:
    rows = run(lengths, head_dims, plan.batch, plan.groups, dtype, repeats, use_pallas)
  finally:
    if profile_dir:
      jax.profiler.stop_trace()
  if out:
    results_io.atomic_write_text(out, render(rows, device, repeats))
    results_io.atomic_write_text(os.path.splitext(out)[0] + ".json",
                                 json.dumps({"device": device, "rows": rows}, indent=1))
  return rows
