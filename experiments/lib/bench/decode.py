r"""Decode benchmark: ms per decode step of the full cache and of each design.

For every (batch, context) cell, side by side in one run, configurations
interleaved round-robin: the full cache, and each design at each budget with
and without the certificate, evicting every step or every ``k`` steps, in
each layer loop; the cached prefill against the plain one-shot forward; and
this machine's streaming-read bandwidth, which gives each step's floor (its
weight and cache bytes over that bandwidth), beside the weights'
matrix-vector products and the full cache's attention timed alone.

How a step is timed, the floor, the cache layouts and the intervals:
docs/guide.md, "The decode benchmark, in detail".

The command: ``python -m experiments.bench_decode --out=/tmp/bench_decode``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import platform
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax.attention.offset import AttentionConfig
from certkv_jax.designs import registry
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.bench import decode_report as report_lib
from experiments.lib.bench import flags
from experiments.lib.bench.timing import LEVEL, WARMUP  # noqa: F401 (re-exported)
from experiments.lib.bench.timing import _finish, _memo, _round_robin, _stepper, _Timed
from experiments.lib.bench.timing import _timed_call, median_interval
from experiments.lib.bench.floor import _attention_fn, _matvec_fn, _read_fn  # noqa: F401 (re-exported)
from experiments.lib.bench.floor import attention_bytes, attention_inputs
from experiments.lib.bench.floor import floor_bytes, matvec_bytes, weight_bytes  # noqa: F401 (re-exported)
from models import forward
from models import llama
from models import memory
from models import precision
from models import prefill as prefill_lib

DESIGNS = ("poisson_tail", "snapkv", "h2o")
BUDGETS = (0.125, 0.25, 0.5)
CONTEXTS = (1024, 2048, 4096, 8192)
BATCHES = (1, 8)
EVICT_EVERY = (1, 16)
CERTIFICATE = ("both", "with", "without")
CAPACITY = ("compact", "full")
LAYER_LOOPS = forward.LAYER_LOOPS
QUICK = dict(contexts=(256, 512), batches=(1,), repeats=5, designs=("poisson_tail",),
             budgets=(0.25,), evict_every=(1, 4))
# The design's own static budget is replaced by the traced one in every call.
_STATIC_BUDGET = 0.5


@dataclasses.dataclass(frozen=True)
class Plan:
  """What to time (each setting a flag of ``experiments/bench_decode.py``)."""

  designs: tuple = plan_flags.setting(DESIGNS, "Designs (the full cache is always timed).")
  budgets: tuple = plan_flags.setting(BUDGETS, "Budgets (fractions in (0, 1)).")
  contexts: tuple = plan_flags.setting(CONTEXTS, "Context lengths (prompt tokens).")
  batches: tuple = plan_flags.setting(BATCHES, "Batch sizes.")
  evict_every: tuple = plan_flags.setting(
      EVICT_EVERY, "Decode steps per eviction (1: after every step; k > 1: amortized "
      "eviction into k slack slots, timed as calls of k steps, reported per step).")
  repeats: int = plan_flags.setting(
      11, "Timed calls per configuration (>= 6 for a 95% interval).")
  certificate: str = plan_flags.setting(
      "both", "Time the designs with the certificate statistics, without, or both.",
      choices=CERTIFICATE)
  capacity: str = plan_flags.setting(
      "compact", "'compact': caches hold the kept tokens (a deployment); 'full': the "
      "generate() layout, the prompt's capacity at every budget.", choices=CAPACITY)
  n_sink: int = plan_flags.setting(design_defaults.N_SINK, "Sink tokens of every design.")
  window: int = plan_flags.setting(design_defaults.WINDOW, "Recent window of every design.")
  seed: int = plan_flags.setting(0, "Seed of the prompts and the eviction draws.")
  max_seconds: float = plan_flags.setting(
      0.0, "Start no new cell after this many seconds (0: no limit); the outputs then hold "
      "the finished cells.")
  layer_loop: tuple = plan_flags.setting(
      LAYER_LOOPS, "Layer loops to time, interleaved: 'scan' (lax.scan over stacked weights "
      "and caches) and/or 'unrolled' (per-layer weights and caches read in place); both: the "
      "report gives their ratio.")
  plain_prefill: bool = plan_flags.setting(
      True, "Also time the plain one-shot forward beside the cached prefill (its dense "
      "softmax grows with the square of the context: most of a 4k cell's time).")
  prefill_chunk: int = plan_flags.setting(
      2048, "Prompt tokens per call of the cached prefill (a scan over chunks; 0: the whole "
      "prompt in one call, whose attention logits grow with the square of the context: "
      "8,192 tokens at batch 4 of a 32-head model need 69 GB).")
  dtype: str = plan_flags.setting(model_loading.DEFAULT_DTYPE, model_loading.DTYPE_HELP,
                                  choices=model_loading.DTYPES)
  compile_repeats: int = plan_flags.setting(
      0, "Also trace, lower and compile each step alone this many times, interleaved across "
      "the configurations, from a fresh jit with JAX's caches cleared each time (every "
      "jitted function traced again, as in a new process): compile_min_s is the "
      "fastest, steadier than the first call minus a steady call on a shared machine; a "
      "design's eviction alone likewise (eviction_compile_min_s) (0: off).")
  split_values: bool = plan_flags.setting(
      True, "Attention reads bfloat16 keys and values as stored (AttentionConfig."
      "split_values, the default); --nosplit_values: a float32 copy of them; no effect in "
      "float32.")

  @property
  def certificate_modes(self) -> tuple:
    return {"both": (False, True), "with": (True,), "without": (False,)}[self.certificate]

  @property
  def n_calls(self) -> int:
    return WARMUP + self.repeats

  @property
  def steps_per_call(self) -> int:
    """Decode steps in one timed call of every configuration: the largest ``evict_every``
    (the same horizon for all, so that the kept set grows alike)."""
    return max(self.evict_every)

  def check(self, max_positions: Optional[int] = None) -> "Plan":
    """Raises ValueError naming the flag and its allowed values; returns the plan."""
    known = list(registry.names())
    for flag, vals in (("designs", self.designs), ("budgets", self.budgets),
                       ("contexts", self.contexts), ("batches", self.batches),
                       ("evict_every", self.evict_every), ("layer_loop", self.layer_loop)):
      if not vals:
        raise ValueError(f"--{flag} must not be empty")
      if len(set(vals)) != len(vals):
        raise ValueError(f"--{flag} has duplicates: {list(vals)}")
    for d in self.designs:
      if d not in known:
        raise ValueError(f"--designs: unknown design {d!r}; choose from {known} (the full "
                         "cache is always timed)")
    if not all(isinstance(b, float) and 0.0 < b < 1.0 for b in self.budgets):
      raise ValueError(f"--budgets must be fractions in (0, 1), got {list(self.budgets)}")
    flags.check_int("n_sink", self.n_sink, 0)
    flags.check_int("window", self.window, 1)
    lo, hi = self.n_sink + self.window + 1, max_positions
    for c in self.contexts:
      if not isinstance(c, int) or c < lo or (hi is not None and c > hi):
        raise ValueError(f"--contexts must be ints in [n_sink + window + 1 = {lo}, "
                         f"{hi if hi is not None else 'inf'}] (the model's context), got "
                         f"{list(self.contexts)}")
    for b in self.batches:
      flags.check_int("batches", b, 1, 4096)
    for k in self.evict_every:
      flags.check_int("evict_every", k, 1, 4096)
      if self.steps_per_call % k:
        raise ValueError(f"--evict_every values must divide the largest "
                         f"({self.steps_per_call}), got {list(self.evict_every)}")
    flags.check_int("repeats", self.repeats, 1, 10000)
    flags.check_int("compile_repeats", self.compile_repeats, 0, 100)
    flags.check_int("prefill_chunk", self.prefill_chunk, 0)
    flags.check_int("seed", self.seed, 0)
    if self.certificate not in CERTIFICATE:
      raise ValueError(f"--certificate must be one of {list(CERTIFICATE)}, got "
                       f"{self.certificate!r}")
    if not set(self.layer_loop) <= set(LAYER_LOOPS):
      raise ValueError(f"--layer_loop must be a list of {list(LAYER_LOOPS)}, got "
                       f"{list(self.layer_loop)}")
    if self.capacity not in CAPACITY:
      raise ValueError(f"--capacity must be one of {list(CAPACITY)}, got {self.capacity!r}")
    if not (isinstance(self.max_seconds, (int, float)) and self.max_seconds >= 0):
      raise ValueError(f"--max_seconds must be >= 0 (0: no limit), got {self.max_seconds!r}")
    model_loading.check_dtype(self.dtype)
    return self


def plan_from_flags(fv) -> Plan:
  """The checked :class:`Plan` of the flags (``--quick`` replaces the defaults of the flags
  not given)."""
  quick = {k: v for k, v in QUICK.items() if not fv[k].present} if fv.quick else {}
  return plan_flags.plan_from_flags(Plan, fv, **quick)


def _step_fn(config, design, certificate: bool, every: int = 1, steps: int = 1,
             layer_loop: str = "scan", attention=None):
  """One jitted call on a donated ``(caches, logits, key)`` carry: ``steps`` decode steps,
  the design evicting after every ``every``-th (``every = 1``: after each step, as
  ``GenerationConfig(evict_each_step=True)``; more: amortized eviction,
  ``evict_every``). ``steps`` is a multiple of ``every``. With ``layer_loop="unrolled"``
  the params and caches are passed per layer; ``attention``: ``layer.Settings.attention``."""

  def one(params, carry, budget):
    caches, logits, key = carry
    batch = logits.shape[0]
    key, _ = jax.random.split(key)  # the step's key (its eviction's, in period)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    new_logits, caches, stats, _ = forward.forward_chunk(
        params, config, token[:, None], jnp.ones((batch, 1), bool), caches,
        settings=layer_lib.Settings(design=design, observe=False, certificate=certificate,
                                    attention=attention), layer_loop=layer_loop)
    out = () if stats is None else (stats.var_hat, stats.range_hat)  # kept: not dead code
    return (caches, new_logits[:, 0], key), out

  def period(params, carry, budget):
    # The previous step's eviction with the first step's key, then the ``every`` steps
    # as one loop: the model's step is compiled once, not once before the loop and
    # again in it.
    if design is not None:
      caches, logits, key = carry
      caches, _, _, _ = eviction.evict(design, caches, jax.random.split(key)[1], budget=budget)
      carry = (caches, logits, key)
    if every == 1:
      return one(params, carry, budget)
    return jax.lax.scan(lambda c, _: one(params, c, budget), carry, None, length=every)

  def call(params, carry, budget):
    if steps == every:
      return period(params, carry, budget)
    return jax.lax.scan(lambda c, _: period(params, c, budget), carry, None,
                        length=steps // every)

  return jax.jit(call, donate_argnums=1)


def _evict_fn(design):
  """The design's eviction alone, jitted: ``(caches, key, budget) -> caches``."""
  return jax.jit(lambda caches, key, budget: eviction.evict(design, caches, key,
                                                            budget=budget).caches)


def _abstract(args):
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)


def compact_capacity(kept: int, budget: float, every: int, appended: int, context: int) -> int:
  """Slots of a compacted cache: what the timed calls need and a deployment would allocate.

  The timed calls append ``appended`` tokens in all, and the design evicts to
  ``budget`` of the tokens seen after every ``every``-th: a design keeps at
  most ``floor(budget n_seen)`` (or its certainty set when that is larger,
  which ``kept`` includes), so the cache peaks at that target after the last
  call plus ``every`` slack slots.
  """
  return max(kept, math.floor(budget * (context + appended))) + every


def _prefill_fn(config, design, capacity: int, attention=None, chunk: int = 0):
  """Jitted cached prefill ``(params, tokens, mask) -> (last logits, caches)``, ``chunk``
  prompt tokens per ``forward_chunk`` call in a ``lax.scan`` (0: the whole prompt in one;
  a chunk's logits are [batch, heads, chunk, capacity])."""
  settings = layer_lib.Settings(design=design, certificate=False, attention=attention)

  def prefill(params, tokens, mask):
    caches = caches_lib.init_caches(config, tokens.shape[0], capacity,
                                    precision.cache_dtype(config))
    return prefill_lib.prefill_into(params, tokens, mask, caches, config=config,
                                    chunk=chunk or tokens.shape[1], settings=settings)
  return jax.jit(prefill)


def _plain_fn(config):
  model = llama.LlamaModel(config)
  return jax.jit(lambda params, tokens: model.apply(params, tokens)[:, -1])


def time_cell(params, config, plan: Plan, cell: tuple, steps: dict, executables: set,
              per_layer_params=None, log=None) -> tuple[list, list, dict]:
  """Decode rows, prefill rows and the bandwidth probe of one ``cell``, a (context, batch).

  ``per_layer_params``: ``forward.unstack_layers(params, config)`` for the unrolled loop
  (made here when None and the plan times it). ``log``: given, says each prefill's and
  each configuration's first call (compile and run) as it ends.
  """
  context, batch = cell
  say = log or (lambda _: None)
  key = jax.random.PRNGKey(plan.seed)
  tokens = jax.random.randint(jax.random.fold_in(key, context * 131 + batch), (batch, context),
                              0, config.vocab_size, jnp.int32)
  mask = jnp.ones((batch, context), bool)
  per_call = plan.steps_per_call
  cap_full = context + plan.n_calls * per_call  # the full cache keeps every token
  param_bytes = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(params))
  loop_params = {"scan": params}
  if "unrolled" in plan.layer_loop:
    loop_params["unrolled"] = (forward.unstack_layers(params, config) if per_layer_params is None
                               else per_layer_params)
  base = dict(context=context, batch=batch, split_values=plan.split_values)
  attention = AttentionConfig(split_values=plan.split_values)
  full_prefill = _memo(steps, ("prefill", None, cap_full),
                       lambda: _prefill_fn(config, None, cap_full, attention,
                                           plan.prefill_chunk))
  (logits, full_caches), prefill_first = _timed_call(full_prefill, params, tokens, mask)
  say(f"  first call {prefill_first:.1f} s: prefill full, context {context} batch {batch}")
  timed, states, compiles = [], [], []

  def add(design_name, design, cert, budget, caches, first_logits, kept, every=1):
    cap = int(caches.k.shape[-2])
    for loop in plan.layer_loop:
      fn = _memo(steps, (design_name, cert, every, per_call, loop),
                 lambda: _step_fn(config, design, cert, every, per_call, loop, attention))
      shape_key = (design_name, cert, every, context, batch, cap, loop)
      row = dict(base, design=design_name, certificate=cert, budget=budget, evict_every=every,
                 layer_loop=loop, capacity=cap, kept_tokens=kept,
                 new_executable=shape_key not in executables,
                 step_bytes=param_bytes + memory.caches_bytes(caches)["total"],
                 floor_bytes=floor_bytes(params, config, design, cap, batch,
                                         caches.k.dtype, certificate=cert))
      executables.add(shape_key)
      carry = jax.tree_util.tree_map(jnp.copy, (caches, first_logits, key))  # donated: own
      if loop == "unrolled":
        carry = (carry[0].unstack(),) + carry[1:]
      args = (loop_params[loop], carry, jnp.float32(1.0 if budget is None else budget))
      if plan.compile_repeats:
        fresh = functools.partial(_step_fn, config, design, cert, every, per_call, loop,
                                  attention)
        compiles.append((row, "compile", fresh, _abstract(args)))
        if design is not None:  # the step's eviction alone: how much of the step it is
          compiles.append((row, "eviction_compile", functools.partial(_evict_fn, design),
                           _abstract((carry[0], carry[2], args[2]))))
      call, state = _stepper(fn, *args)
      timed.append(_Timed(row, call, steps=per_call))
      states.append(state)

  add("full", None, False, None, full_caches, logits, context)
  probe_bytes = timed[0].row["floor_bytes"]  # the full cache's step bytes
  att_args = attention_inputs(full_caches, config, context, jax.random.fold_in(key, 11))
  att_bytes = attention_bytes(full_caches)
  del full_caches
  for name in plan.designs:
    design = design_defaults.make_design(name, _STATIC_BUDGET, plan.n_sink, plan.window)
    prefill = _memo(steps, ("prefill", name, cap_full),
                    lambda: _prefill_fn(config, design, cap_full, attention,
                                        plan.prefill_chunk))
    (d_logits, d_caches), first = _timed_call(prefill, params, tokens, mask)
    say(f"  first call {first:.1f} s: prefill {name}")
    for b in plan.budgets:
      evicted, _, _, _ = eviction.evict(design, d_caches, jax.random.fold_in(key, 7), budget=b)
      kept = int(jnp.max(evicted.valid.sum(-1)))
      for every in plan.evict_every:
        caches = evicted
        if plan.capacity == "compact":
          caches = evicted.compact(
              compact_capacity(kept, b, every, plan.n_calls * per_call, context))
        for cert in plan.certificate_modes:
          add(name, design, cert, b, caches, d_logits, kept, every)
    del d_caches
  # The probes, like a step's call, make per_call passes in one call: a sample is one pass.
  one_pass = lambda fn, *args: _timed_call(fn, *args)[1] / per_call
  read, buf = _read_fn(per_call), jnp.ones((max(probe_bytes // 4, 1),), jnp.float32)
  probe = _Timed(dict(base, part="read probe", bytes=int(buf.nbytes), passes=per_call),
                 lambda: one_pass(read, buf))
  per_layer = loop_params.get("unrolled") or forward.unstack_layers(params, config)
  matvec = _memo(steps, ("matvec", batch), lambda: _matvec_fn(config, batch, per_call))
  mv = _Timed(dict(base, part="matvec probe", bytes=matvec_bytes(per_layer, config),
                   passes=per_call), lambda: one_pass(matvec, per_layer))
  att_fn = _memo(steps, ("attention",), lambda: _attention_fn(per_call, attention))
  att = _Timed(dict(base, part="attention probe", bytes=att_bytes, passes=per_call),
               lambda: one_pass(att_fn, *att_args))
  _round_robin(timed + [probe, mv, att], plan.repeats, log=log)
  dropped = [int(jnp.sum(s["carry"][0].n_dropped)) for s in states]
  if any(dropped):
    raise RuntimeError(f"decode benchmark bug: tokens found no cache slot ({dropped}); the "
                       "capacity must hold every appended token")
  for r in range(plan.compile_repeats):  # after the timed calls: no compile beside them
    for i in range(len(compiles)):
      row, part, fresh, abstract = compiles[(i + r) % len(compiles)]
      # The step calls module-level jitted functions (forward_chunk, the eviction), whose
      # traces the timed calls cached: cleared, each try traces them again, as a new
      # process would.
      jax.clear_caches()
      t0 = time.perf_counter()
      fresh().lower(*abstract).compile()
      row.setdefault(f"{part}_samples_s", []).append(time.perf_counter() - t0)
  for row, part, _, _ in compiles:
    row[f"{part}_min_s"] = min(row[f"{part}_samples_s"])
    row["compile_traces_cleared"] = True
  rows = [_finish(t, 1e3) for t in timed]
  probe_s = np.asarray(probe.samples)
  # A part's floor in each round: its bytes at that round's probe bandwidth (seconds).
  floor_s = lambda nbytes: nbytes * probe_s / probe.row["bytes"]
  # The weights' matrix-vector products and the full cache's attention alone, each over
  # its own floor, per round.
  mvm = median_interval(np.asarray(mv.samples) / floor_s(mv.row["bytes"]))
  am = median_interval(np.asarray(att.samples) / floor_s(att.row["bytes"]))
  bandwidth = dict(base, bytes=probe.row["bytes"], samples=probe.samples,
                   gbps=probe.row["bytes"] / float(np.median(probe_s)) / 1e9,
                   matvec_bytes=mv.row["bytes"], matvec_ms=float(np.median(mv.samples)) * 1e3,
                   matvec_floor_multiple=mvm["median"],
                   matvec_floor_multiple_ci=[mvm["lo"], mvm["hi"]],
                   attention_bytes=att.row["bytes"],
                   attention_ms=float(np.median(att.samples)) * 1e3,
                   attention_floor_multiple=am["median"],
                   attention_floor_multiple_ci=[am["lo"], am["hi"]])
  per_round = lambda a, b: median_interval(np.asarray(a["samples"]) / np.asarray(b["samples"]))
  same = lambda r, **kw: next(x for x in rows if all(x[k] == v for k, v in dict(dict(
      design=r["design"], certificate=r["certificate"], budget=r["budget"],
      evict_every=r["evict_every"], layer_loop=r["layer_loop"]), **kw).items()))
  for r in rows:
    full = same(r, design="full", certificate=False, budget=None, evict_every=1)
    ratio = per_round(r, full)
    r["ratio_vs_full"] = ratio["median"]
    r["ratio_vs_full_ci"] = [ratio["lo"], ratio["hi"]]
    # The bytes ratio: a step that reads every weight and cache byte once at one bandwidth.
    r["bytes_ratio_vs_full"] = r["step_bytes"] / full["step_bytes"]
    floor_ms = floor_s(r["floor_bytes"]) * 1e3
    fm = median_interval(np.asarray(r["samples"]) / floor_ms)
    r["floor_ms"] = float(np.median(floor_ms))
    r["floor_multiple"], r["floor_multiple_ci"] = fm["median"], [fm["lo"], fm["hi"]]
    if len(plan.layer_loop) == 2:
      other = same(r, layer_loop="unrolled" if r["layer_loop"] == "scan" else "scan")
      scan, unrolled = (r, other) if r["layer_loop"] == "scan" else (other, r)
      lr = per_round(scan, unrolled)
      r["scan_over_unrolled"], r["scan_over_unrolled_ci"] = lr["median"], [lr["lo"], lr["hi"]]
  pre = [_Timed(dict(base, method="cached", tokens=batch * context),
                lambda: _timed_call(full_prefill, params, tokens, mask)[1], prefill_first)]
  if plan.plain_prefill:
    plain = _memo(steps, ("plain",), lambda: _plain_fn(config))
    pre.append(_Timed(dict(base, method="plain", tokens=batch * context),
                      lambda: _timed_call(plain, params, tokens)[1]))
  _round_robin(pre, plan.repeats)
  prefill_rows = []
  for t in pre:
    r = _finish(t, 1.0)
    r["tokens_per_s"] = r["tokens"] / r["median"]
    r["tokens_per_s_ci"] = [r["tokens"] / r["ci"][1], r["tokens"] / r["ci"][0]]
    prefill_rows.append(r)
  return rows, prefill_rows, bandwidth


def device_name() -> str:
  d = jax.devices()[0]
  return (f"{d.device_kind} ({jax.default_backend()}), {platform.machine()}, "
          f"jax {jax.__version__}")


def run(params, config, plan: Plan, out: Optional[str], *, model: str, log=print) -> dict:
  """Times every cell of ``plan`` (batches outer, contexts inner) and writes the outputs
  under ``out`` after each cell; returns the results dict (``results.json``)."""
  plan.check(config.max_positions)
  if config.dtype != plan.dtype:
    raise ValueError(f"--dtype={plan.dtype} but the model was loaded in {config.dtype} "
                     "(load_model(..., dtype=plan.dtype))")
  results = dict(model=model, dtype=config.dtype, device=device_name(),
                 plan=dataclasses.asdict(plan),
                 units=dict(decode="ms per step", prefill="seconds", bandwidth="GB/s"),
                 warmup_calls=WARMUP, decode=[], prefill=[], bandwidth=[],
                 cells_done=[], cells_skipped=[], complete=False)
  steps, executables = {}, set()
  per_layer = forward.unstack_layers(params, config) if "unrolled" in plan.layer_loop else None
  t_start = time.perf_counter()
  cells = [(c, b) for b in plan.batches for c in plan.contexts]
  for i, (context, batch) in enumerate(cells):
    if plan.max_seconds and time.perf_counter() - t_start > plan.max_seconds:
      results["cells_skipped"] = [list(c) for c in cells[i:]]
      log(f"--max_seconds={plan.max_seconds} reached: skipping {len(cells) - i} cells")
      break
    t0 = time.perf_counter()
    rows, pre, bandwidth = time_cell(params, config, plan, (context, batch), steps,
                                     executables, per_layer, log=log)
    results["decode"] += rows
    results["prefill"] += pre
    results["bandwidth"].append(bandwidth)
    results["cells_done"].append([context, batch])
    results["executables"] = len(executables)
    # Every cell has its own shapes: free its executables (the LLVM JIT maps each one's
    # code; three cells of unrolled steps ran out of mappings at 4k).
    steps.clear()
    jax.clear_caches()
    log(f"[{i + 1}/{len(cells)}] context {context} batch {batch}: "
        f"{bandwidth['gbps']:.1f} GB/s, weights' matvecs "
        f"{bandwidth['matvec_floor_multiple']:.2f}x floor, attention "
        f"{bandwidth['attention_floor_multiple']:.2f}x floor; "
        + ", ".join(f"{r['design']}{'+cert' if r['certificate'] else ''}"
                    f"{'' if r['budget'] is None else '@' + str(r['budget'])}"
                    f"[{r['layer_loop']}] {r['median']:.1f} ms = {r['floor_multiple']:.2f}x "
                    f"floor, {r['ratio_vs_full']:.2f}x full" for r in rows)
        + f" ({time.perf_counter() - t0:.0f} s)")
    if out:
      report_lib.write_outputs(results, out)
  else:
    results["complete"] = True
  if out:
    report_lib.write_outputs(results, out)
  return results


def run_and_report(*, plan: Plan, model: str, out: str, log=print) -> dict:
  """The command: loads ``--model`` and runs :func:`run`; returns the summary."""
  params, config, _ = model_loading.load_model(model, plan.dtype)
  log(f"{device_name()}; weights and caches in {plan.dtype}")
  results = run(params, config, plan, out, model=model_loading.model_name(model), log=log)
  return report_lib.summarize(results)
