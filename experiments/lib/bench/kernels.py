r"""Decode-attention benchmark: bandwidth, and what the certificate statistics cost.

Side by side in one run (the machine may be shared and noisy: compare ratios and
fractions, not absolute times), for each cache length and head dim:

* ``plain``: ``jax.nn.dot_product_attention`` with the validity mask;
* ``offset``: the same with the Hajek offsets as a bias (no statistics);
* ``xla_offset``: our XLA path (``reference.grouped_reference``) with the
  statistics switched off: offset attention alone, same code;
* ``stats_stored``: ``certkv_jax.offset_attention`` (implementation "xla") with
  the fused statistics and the one-pass range bound, reading each slot's stored
  ``||v_i||^2`` (``value_sqnorm``, as the model's caches keep them:
  ``KVCache.v_sq``);
* ``stats_stored_exact``: the same with the exact range term, which then
  takes its distances from the stored norms and one matmul (the model's
  decode path: ``certkv_jax.attention.certified`` uses the exact range);
* ``stats_bound`` / ``stats_exact``: the same statistics recomputing the
  norms from the values (one more pass over them), with the one-pass range
  bound / the exact range term;
* with bfloat16 inputs, ``xla_offset_split`` and ``stats_stored_exact_split``:
  ``xla_offset`` and ``stats_stored_exact`` reading the values as stored
  (``AttentionConfig.split_values``: no float32 copy of them), reported as
  ``split / unsplit`` ratios beside the others;
* with the Pallas kernel (default on a GPU or TPU; interpreted on CPU, only on
  request): ``pallas_offset`` (kernel without statistics), ``pallas_stats_bound``,
  ``pallas_stats_exact`` at the default tiling, and ``pallas_offset_{label}`` /
  ``pallas_stats_{label}`` for each tiling of the sweep (``Plan.splits`` at the
  default tiles, then ``Plan.tilings``; label ``k{block_k}s{splits}w{warps}``, then
  ``n{stages}`` unless 2, and ``v`` where bfloat16 values multiply as stored).

Launch overhead is amortized: each timed call is one jitted ``fori_loop`` of
``iters`` attention calls, each call's queries perturbed by ``eps`` (a runtime
zero) times the previous output, and every input passed through
``lax.optimization_barrier`` with them, so that XLA can neither hoist work out
of the loop nor drop any output; a call's time is the loop's over ``iters``.
Its achieved bandwidth is the bytes a call must read (keys, values, float32
offsets and queries) over that time, reported beside the device's streaming-read
bandwidth measured in the same rounds by the same kind of loop (a read-reduce of
a large float32 buffer, the ``probe``), and as a fraction of it.

The methods and the probe are timed in interleaved rounds (round r times every
one once, in turn), so that a slow spell of a shared machine hits all of them;
the reported time is the median over rounds. Ratios are to ``plain``. The
statistics' own cost is the median over rounds of the per-round ratio
``stats_stored / xla_offset`` (XLA path) and ``pallas_stats_bound /
pallas_offset`` (the kernel; issue 42's GPU targets: <= 1.15x, and the kernel at
>= 50% of the probe's bandwidth), with order-statistic intervals
(``intervals.median_interval``: coverage >= 0.95 from 6 rounds on; the level it
has is stored beside it).

The command: ``python -m experiments.bench_kernels --out=experiments/results/bench_cpu.md``.
"""

import dataclasses
import json
import math
import os
import platform
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp

import certkv_jax
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib.bench import floor
from experiments.lib.bench.kernels_report import TARGETS, render, row_text
from experiments.lib.stats import intervals
from pallas_kernels import offset_decode
from pallas_kernels import reference

# The default plan by backend: on an accelerator, sizes where bytes dominate
# (64 rows x 32k keys x d 128 in bfloat16 read about 1 GB a call); on CPU the
# sizes of experiments/results/bench_cpu.md. ``loop_bytes``: an ``iters`` of 0
# loops enough calls to read this many bytes per timed call.
DEFAULTS = {
    "accelerator": dict(lengths=(4096, 32768), head_dims=(64, 128), batch=64, probe_mb=1024,
                        loop_bytes=8e9),
    "cpu": dict(lengths=(1024, 4096, 16384, 32768), head_dims=(64, 128), batch=8, probe_mb=64,
                loop_bytes=2.5e8),
}
MAX_ITERS = 1000


def on_accelerator() -> bool:
  return jax.default_backend() in ("gpu", "tpu")


def _time_rounds(calls, repeats):
  """{name: [seconds per attention call, one per round]}: every loop once per round, in
  turn (the first of a round rotating). ``calls``: {name: (fn, args, iters)}. Says each
  first call's seconds (compile and warm-up) as it ends."""
  for name, (fn, args, _) in calls.items():
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))  # compile + warm up
    print(f"  first call {time.perf_counter() - t0:.1f} s: {name}", flush=True)
  names = list(calls)
  times = {name: [] for name in names}
  for r in range(repeats):
    for i in range(len(names)):
      name = names[(i + r) % len(names)]
      fn, args, iters = calls[name]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append((time.perf_counter() - t0) / iters)
  return times


def _looped(fn, iters):
  """A jitted ``(eps, q, *cache) -> q``: ``iters`` calls of ``fn(q, *cache)``, each
  one's queries ``q + eps * (the previous output)``. With ``eps`` a runtime zero
  the numbers do not change, but every call depends on the one before, and the
  optimization barrier makes every input depend on the loop's carry: XLA can
  neither hoist a query-independent part (value norms, padding) out of the loop
  nor drop a statistic nobody reads."""

  def run(eps, q, *cache):
    def body(_, q_i):
      q_b, *cache_b = jax.lax.optimization_barrier((q_i, *cache))
      out, *stats = jax.tree_util.tree_leaves(fn(q_b, *cache_b))
      upd = out.reshape(q.shape).astype(jnp.float32)
      upd += sum(jnp.sum(s.astype(jnp.float32)) for s in stats)
      return q_i + (eps * upd).astype(q.dtype)
    return jax.lax.fori_loop(0, iters, body, q)
  return jax.jit(run)


def _probe(iters):
  """A jitted ``(eps, buf) -> float32``: ``iters`` read-reduces of ``buf`` (the
  streaming-read bandwidth probe, the decode bench's ``floor._read_fn``), taking the
  methods' arguments."""
  read = floor._read_fn(iters)
  return lambda eps, buf: read(buf)


def _inputs(n, d, batch, groups, dtype):
  """``(q, k, v, log_pi, mask, sq, off)``: random queries and cache, inclusion
  probabilities, validity (a few empty slots), each slot's stored ``||v||^2`` and
  the kernel's offsets (``-log pi``, ``-inf`` on empty slots)."""
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
  off = jnp.where(mask, -log_pi, -jnp.inf)
  return q, k, v, log_pi, mask, jnp.where(mask, sq, 0.0), off


def _call_bytes(args) -> int:
  """Bytes one call must read: keys, values, float32 offsets and queries."""
  q, k, v, _, _, _, off = args
  return int(q.nbytes + k.nbytes + v.nbytes + off.nbytes)


def _xla_methods(split: bool):
  def plain(q, k, v, log_pi, mask, sq, off):
    del log_pi, sq, off
    return jax.nn.dot_product_attention(q[:, None], k[:, :, None], v[:, :, None],
                                        mask=mask[:, None, None, :])

  def offset(q, k, v, log_pi, mask, sq, off):
    del log_pi, mask, sq  # the bias is -inf on empty slots: it masks them too
    bias = (-off).astype(q.dtype)[:, None, None, :]
    return jax.nn.dot_product_attention(q[:, None], k[:, :, None], v[:, :, None], bias=bias)

  def stats(range_mode, stored=False, split_values=False):
    def f(q, k, v, log_pi, mask, sq, off):
      del off
      kw = {"value_sqnorm": sq[:, None]} if stored else {}
      return certkv_jax.offset_attention(
          q, k[:, None], v[:, None], log_pi[:, None], mask[:, None],
          config=certkv_jax.attention.AttentionConfig(
              implementation="xla", range_mode=range_mode, split_values=split_values), **kw)
    return f

  def xla_offset(split_values=False):
    def f(q, k, v, log_pi, mask, sq, off):
      del sq, off
      return reference.grouped_reference(q, k, v, log_pi, mask, config=reference.ReferenceConfig(
          range_mode="bound", with_stats=False, split_values=split_values))
    return f

  methods = {"plain": plain, "offset": offset, "xla_offset": xla_offset(),
             "stats_stored": stats("bound", stored=True),
             "stats_stored_exact": stats("exact", stored=True), "stats_bound": stats("bound"),
             "stats_exact": stats("exact")}
  if split:
    methods.update({"xla_offset_split": xla_offset(True),
                    "stats_stored_exact_split": stats("exact", stored=True, split_values=True)})
  return methods


@dataclasses.dataclass(frozen=True)
class Tiling:
  """One point of the kernel's sweep: its tiles, split-K count, Triton warps and
  whether bfloat16 values multiply as stored (``KernelConfig.split_values``)."""

  block_k: int
  num_splits: int
  num_warps: int = 4
  num_stages: int = 2
  split_values: bool = False

  @property
  def label(self) -> str:
    return (f"k{self.block_k}s{self.num_splits}w{self.num_warps}"
            + (f"n{self.num_stages}" if self.num_stages != 2 else "")
            + ("v" if self.split_values else ""))


def parse_tiling(text: str) -> Tiling:
  """``block_k:num_splits:num_warps[:num_stages][:split]`` (e.g. ``64:16:4:3:split``) as a
  :class:`Tiling` (2 stages unless given)."""
  parts = str(text).split(":")
  split = parts[-1] == "split"
  nums = parts[:-1] if split else parts
  try:
    nums = [int(x) for x in nums]
  except ValueError:
    nums = []
  if len(nums) not in (3, 4) or min(nums) < 1:
    raise ValueError(f"--tilings entries must be block_k:num_splits:num_warps[:num_stages]"
                     f"[:split] with positive ints, got {text!r}")
  return Tiling(*nums, split_values=split)


def _kernel(with_stats, range_mode, tiling=None):
  """The Pallas kernel (interpreted off an accelerator) on the precomputed offsets."""
  kw = {}
  if tiling is not None:
    kw = dict(block_sizes=offset_decode.BlockSizes(tiling.block_k, tiling.num_splits),
              num_warps=tiling.num_warps, num_stages=tiling.num_stages,
              split_values=tiling.split_values)
  config = offset_decode.KernelConfig(range_mode=range_mode, interpret=not on_accelerator(),
                                      **kw)

  def f(q, k, v, log_pi, mask, sq, off):
    del log_pi, mask, sq
    return offset_decode.offset_decode_attention(q, k, v, off, with_stats=with_stats,
                                                 config=config)
  return f


def _default_block_sizes(n, batch):
  return offset_decode.BlockSizes.get_default(n, batch, offset_decode.default_backend())


def _default_tiling(n, plan, splits=None) -> Tiling:
  """The kernel's default tiling for ``plan``'s dtype (``splits``: another split count)."""
  bs = _default_block_sizes(n, plan.batch)
  stored = jnp.dtype(plan.dtype) == jnp.bfloat16  # KernelConfig's defaults
  probe = offset_decode.KernelConfig()
  return Tiling(bs.block_k, splits or bs.num_splits, probe.num_warps,
                offset_decode.num_stages(probe, jnp.dtype(plan.dtype)),
                bool(probe.split_values and stored))


def _sweep(n, plan):
  """The sweep's tilings that fit ``n`` (a split of >= one tile): each ``plan.splits``
  value at the default tiling, then ``plan.tilings``."""
  wanted = [_default_tiling(n, plan, s) for s in plan.splits] + list(plan.tilings)
  fit = [t for t in dict.fromkeys(wanted) if t.num_splits * t.block_k <= n]
  for t in dict.fromkeys(wanted):
    if t not in fit:
      print(f"n={n}: skipping tiling {t.label} (more splits than {t.block_k}-key tiles)",
            flush=True)
  return fit


def _methods(use_pallas, n, batch, plan, split_values=False):
  methods = _xla_methods(split_values)
  if use_pallas:
    methods.update({"pallas_offset": _kernel(False, "bound"),
                    "pallas_stats_bound": _kernel(True, "bound"),
                    "pallas_stats_exact": _kernel(True, "exact")})
    for t in _sweep(n, plan):
      methods[f"pallas_offset_{t.label}"] = _kernel(False, "bound", t)
      methods[f"pallas_stats_{t.label}"] = _kernel(True, "bound", t)
  return methods


def _ratio(rounds, a, b):
  """Median over rounds of the per-round ratio ``a / b``, with its interval."""
  return intervals.median_interval([x / y for x, y in zip(rounds[a], rounds[b])])


def _pallas_fields(row, rounds, n, plan):
  """The kernel's fields of ``row``: its statistics' cost, bandwidth, the sweep."""
  r = _ratio(rounds, "pallas_stats_bound", "pallas_offset")
  row["pallas_stats_over_offset"] = r["median"]
  row["pallas_stats_over_offset_interval"] = [r["lo"], r["hi"], r["level"]]
  row["pallas_gbps"] = row["gbps"]["pallas_stats_bound"]
  row["pallas_fraction"] = row["fraction_of_bandwidth"]["pallas_stats_bound"]
  batch = plan.batch
  default = _default_block_sizes(n, batch)
  row["default_block_sizes"] = {"block_k": default.block_k, "num_splits": default.num_splits}
  row["sweep"] = []
  default_tiling = _default_tiling(n, plan)
  row["default_tiling"] = default_tiling.label
  for t in _sweep(n, plan):
    off, st = f"pallas_offset_{t.label}", f"pallas_stats_{t.label}"
    row["sweep"].append({
        **dataclasses.asdict(t), "label": t.label,
        "default": t == default_tiling,
        "padded_slots": offset_decode.pad_slots(
            n, offset_decode.BlockSizes(block_k=t.block_k, num_splits=t.num_splits)),
        "offset_ms": row["seconds"][off] * 1e3, "stats_ms": row["seconds"][st] * 1e3,
        "stats_over_offset": _ratio(rounds, st, off)["median"],
        "offset_gbps": row["gbps"][off], "stats_gbps": row["gbps"][st],
        "offset_fraction": row["fraction_of_bandwidth"][off],
        "stats_fraction": row["fraction_of_bandwidth"][st]})


def _cell(n, d, plan, use_pallas, probe):
  """One row: every method and the probe timed in interleaved rounds."""
  args = _inputs(n, d, plan.batch, plan.groups, jnp.dtype(plan.dtype))
  nbytes = _call_bytes(args)
  iters = plan.iters or _auto_iters(nbytes, plan.loop_bytes)
  eps = jnp.zeros((), jnp.float32)
  methods = _methods(use_pallas, n, plan.batch, plan,
                     split_values=jnp.dtype(plan.dtype) == jnp.bfloat16)
  calls = {name: (_looped(fn, iters), (eps, *args), iters) for name, fn in methods.items()}
  probe_iters = plan.iters or _auto_iters(probe.nbytes, plan.loop_bytes)
  calls["probe"] = (_probe(probe_iters), (eps, probe), probe_iters)
  rounds = _time_rounds(calls, plan.repeats)
  probe_rounds = rounds.pop("probe")
  times = {name: statistics.median(ts) for name, ts in rounds.items()}
  bandwidth = int(probe.nbytes) / statistics.median(probe_rounds) / 1e9
  gbps = {m: nbytes / t / 1e9 for m, t in times.items()}
  row = {"n": n, "d": d, "batch": plan.batch, "groups": plan.groups,
         "dtype": jnp.dtype(plan.dtype).name, "seconds": times, "rounds": plan.repeats,
         "iters": iters, "bytes": nbytes, "gbps": gbps, "bandwidth_gbps": bandwidth,
         "probe_bytes": int(probe.nbytes), "probe_iters": probe_iters,
         "fraction_of_bandwidth": {m: g / bandwidth for m, g in gbps.items()}}
  row["ratio_to_plain"] = {m: t / times["plain"] for m, t in times.items()}
  ratio = _ratio(rounds, "stats_stored", "xla_offset")
  row["stats_over_offset"] = ratio["median"]
  row["stats_over_offset_interval"] = [ratio["lo"], ratio["hi"], ratio["level"]]
  row["recompute_over_offset"] = _ratio(rounds, "stats_bound", "xla_offset")["median"]
  row["exact_over_offset"] = _ratio(rounds, "stats_stored_exact", "xla_offset")["median"]
  if "xla_offset_split" in rounds:  # values read as stored, over the float32 copy
    for name, (a, b) in SPLIT_RATIOS.items():
      r = _ratio(rounds, a, b)
      row[name] = r["median"]
      row[f"{name}_interval"] = [r["lo"], r["hi"], r["level"]]
  if use_pallas:
    _pallas_fields(row, rounds, n, plan)
  return row


SPLIT_RATIOS = {"split_offset": ("xla_offset_split", "xla_offset"),
                "split_stats": ("stats_stored_exact_split", "stats_stored_exact")}


def _auto_iters(nbytes, loop_bytes):
  return max(1, min(MAX_ITERS, math.ceil(loop_bytes / nbytes)))


def run(plan, use_pallas, write=None):
  """The rows of ``plan`` (a resolved :class:`Plan`), one per (head dim, length);
  ``write(rows)`` after each. No new cell starts after ``plan.max_seconds``."""
  rows = []
  probe = jnp.ones((int(plan.probe_mb * 2**20) // 4,), jnp.float32)
  t0 = time.perf_counter()
  for d in plan.head_dims:
    for n in plan.lengths:
      if rows and plan.max_seconds and time.perf_counter() - t0 > plan.max_seconds:
        print(f"--max_seconds={plan.max_seconds} reached: no new cell", flush=True)
        return rows
      rows.append(_cell(n, d, plan, use_pallas, probe))
      print(row_text(rows[-1]), flush=True)
      if write:
        write(rows)
  return rows


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run_and_report` times (each setting a flag of ``experiments/bench_kernels.py``).

  Fields left None take the backend's value in ``DEFAULTS`` (:meth:`resolve`).
  """

  lengths: Optional[tuple[int, ...]] = plan_flags.setting(
      None, "Cache lengths (default: 4096,32768 on a GPU/TPU; 1024,4096,16384,32768 on CPU).")
  head_dims: Optional[tuple[int, ...]] = plan_flags.setting(None, "Head dimensions (default 64,128).")
  batch: Optional[int] = plan_flags.setting(
      None, "Rows of (sequence, KV head) (default: 64 on a GPU/TPU, 8 on CPU).")
  groups: int = plan_flags.setting(4, "Query heads per KV head (GQA group).")
  dtype: str = plan_flags.setting("bfloat16", "K/V/Q dtype.", choices=("bfloat16", "float32"))
  repeats: int = plan_flags.setting(7, "Timed repetitions (median reported).")
  pallas: Optional[bool] = plan_flags.setting(
      None, "Include the Pallas kernel (default: on GPU/TPU only; interpreted, slowly, on "
      "CPU).")
  splits: tuple[int, ...] = plan_flags.setting(
      (), "num_splits values of the Pallas kernel to sweep, beside its default tiling (e.g. "
      "1,2,4,8).")
  tilings: tuple = plan_flags.setting(
      (), "Pallas kernel tilings to sweep, each block_k:num_splits:num_warps[:num_stages]"
      "[:split] (split: bfloat16 values multiplied as stored), e.g. 64:16:4,64:16:4:3:split.")
  iters: int = plan_flags.setting(
      0, "Attention calls per timed loop (0: enough to read 8 GB on a GPU/TPU, 250 MB on "
      "CPU).")
  probe_mb: Optional[float] = plan_flags.setting(
      None, "MiB of the read-bandwidth probe's buffer (default: 1024 on a GPU/TPU, 64 on "
      "CPU).")
  loop_bytes: Optional[float] = None  # bytes a timed loop reads when iters is 0
  max_seconds: float = plan_flags.setting(
      0.0, "Start no new cell after this many seconds (0: no limit); the outputs then hold "
      "the finished cells.")

  def resolve(self) -> "Plan":
    """Defaults filled in for this backend, ints parsed, every size checked."""
    defaults = DEFAULTS["accelerator" if on_accelerator() else "cpu"]
    kw = {f: defaults[f] if getattr(self, f) is None else getattr(self, f)
          for f in ("lengths", "head_dims", "batch", "probe_mb", "loop_bytes")}
    for name in ("lengths", "head_dims", "splits"):
      vals = [int(x) for x in (kw[name] if name in kw else getattr(self, name))]
      if any(x < 1 for x in vals):
        raise ValueError(f"--{name} must be positive ints, got {vals}")
      kw[name] = tuple(vals)
    for name in ("batch", "groups", "repeats"):
      val = kw.get(name, getattr(self, name))
      if not isinstance(val, int) or val < 1:
        raise ValueError(f"--{name} must be an int >= 1, got {val!r}")
    if not isinstance(self.iters, int) or not 0 <= self.iters <= MAX_ITERS:
      raise ValueError(f"--iters must be an int in [0, {MAX_ITERS}], got {self.iters!r}")
    if not kw["probe_mb"] > 0 or not kw["loop_bytes"] > 0 or self.max_seconds < 0:
      raise ValueError(f"--probe_mb and loop_bytes must be > 0 and --max_seconds >= 0, got "
                       f"{kw['probe_mb']}, {kw['loop_bytes']}, {self.max_seconds}")
    kw["tilings"] = tuple(t if isinstance(t, Tiling) else parse_tiling(t)
                          for t in self.tilings)
    if self.dtype not in ("bfloat16", "float32"):
      raise ValueError(f"--dtype must be bfloat16 or float32, got {self.dtype!r}")
    return dataclasses.replace(self, **kw)


def device_text() -> str:
  return (f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {platform.machine()}, "
          f"jax {jax.__version__}")


def run_and_report(plan: Plan, *, out=None, profile_dir=None) -> list[dict]:
  """The command: checks the sizes, times every method of ``plan``, optionally under a
  profiler trace (``profile_dir``), and writes the markdown table to ``out`` (JSON rows
  beside it) after every cell; returns the rows."""
  plan = plan.resolve()
  use_pallas = on_accelerator() if plan.pallas is None else plan.pallas
  plan = dataclasses.replace(plan, pallas=use_pallas)
  device = device_text()
  print(device, flush=True)

  def write(rows):
    if out:
      results_io.atomic_write_text(out, render(rows, device, plan))
      results_io.atomic_write_text(
          os.path.splitext(out)[0] + ".json",
          json.dumps(results_io.json_safe({"device": device, "jax": jax.__version__,
                                           "plan": dataclasses.asdict(plan),
                                           "targets": TARGETS, "rows": rows}), indent=1))
  if profile_dir:
    jax.profiler.start_trace(profile_dir)
  try:
    return run(plan, use_pallas, write)
  finally:
    if profile_dir:
      jax.profiler.stop_trace()
