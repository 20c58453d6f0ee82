r"""Experiment 7: time and memory per decode step.

Configurations (one jitted ``lax.scan`` of ``--n_steps`` single-token decode
steps each, compile and one warm-up call excluded, timed in ``--repeats``
interleaved rounds: round r calls every configuration once, in an order
rotated by r; ms/step is the median over rounds):

* ``full``: no eviction, the whole prompt in the cache;
* ``deterministic``: SnapKV-style design (``--deterministic``) at ``--budget``,
  without the certificate's statistics;
* ``randomized``: ``poisson_tail`` at ``--budget`` without the certificate
  (the Hajek softmax only);
* ``randomized+certificate``: the same with ``certkv_jax.offset_attention``'s
  per-call variance and range statistics and the per-step radius sum.

The evicted caches are compacted to the capacity a deployment would allocate
(``certkv_jax.designs.budgets.capacity(..., compacted=True)``: the kept tokens,
gathered to the front by ``certkv_jax.kv.cache.compact``, plus the decoded
ones). The caches come from one prefill
without design statistics, evicted by each design (its scores are then
uninformative): what is kept does not change the cost of a step, only the
capacity and the design's per-step work do.

* ``randomized+certificate/layers``: the certificate on every 4th layer only
  (``certified.Subsample(layers=...)``; the other layers skip the second-order sums via a
  ``lax.cond`` in the layer scan);
* ``randomized+certificate/heads``: the certificate on the first KV head's
  query heads only (``Subsample(heads=...)``);
* ``randomized+certificate/layers+heads``: both (about 1/12 of the calls on
  SmolLM2: 8 of 30 layers x 1 of 3 KV heads).

Each configuration is a :class:`TimedConfig` (:data:`TIMED_CONFIGS`): what it
evicts with and which (layer, KV head) calls carry the certificate.

A subsampled score is the Horvitz-Thompson sum of the computed radii (their
sum divided by the fraction of calls computed). What such a subsample is
worth as a failure score is measured on the collection side
(``cert_sub_mean`` of ``experiments.lib.suite.rows``).

Ratios (``summarize``): the median over rounds of the per-round ratio of two
configurations' times, with its order-statistic interval
(``stats.intervals.median_interval``, as ``experiments.lib.bench.kernels``):
a drift of the shared machine hits both sides of a round alike and cancels.
Rows written before the rounds were interleaved (no ``timing_session``) timed
one configuration after another; their ratios are ratios of medians with a
bootstrap interval over the calls, which misses drift between configurations
(the report says which).

Memory: the bytes of the caches as allocated (keys/values and per-slot
metadata, ``models.memory.caches_bytes``).

The command: ``python -m experiments.overhead --out=/tmp/overhead``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional
import uuid

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax.attention import certified
from certkv_jax import certificate
from certkv_jax.designs import budgets
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from experiments.lib import batching
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib import plots
from experiments.lib import results_io
from experiments.lib import tasks
from experiments.lib.stats import intervals
from models import forward
from models import memory

LAYER_STRIDE = 4  # the layer-subsampled certificate: layers 0, 4, 8, ...
KEY_FIELDS = ("model", "config", "budget", "batch", "prompt_len", "n_steps", "seed")


@dataclasses.dataclass(frozen=True)
class TimedConfig:
  """One timed configuration of the decode step."""

  name: str  # the rows' ``config`` field
  evicts: bool = True  # False: the full cache, nothing evicted
  randomized: bool = False  # poisson_tail; else the ``deterministic`` design (when evicting)
  certificate: bool = False  # the certificate's statistics and per-step radius sum
  layer_stride: Optional[int] = None  # certificate on layers 0, s, 2s, ... only (None: all)
  kv_heads: Optional[tuple[int, ...]] = None  # certificate on these KV heads only (None: all)

  @property
  def subsampled(self) -> bool:
    """Whether the certificate covers a subset of the (layer, head) calls."""
    return self.layer_stride is not None or self.kv_heads is not None

  def design_name(self, deterministic: str) -> str:
    """The design this configuration evicts with ('full': none)."""
    if not self.evicts:
      return "full"
    return "poisson_tail" if self.randomized else deterministic

  def subsample(self, model_config):
    """``(layers, KV heads, fraction of calls)`` certified on ``model_config`` (None: all)."""
    layers = heads = None
    frac = 1.0
    if self.layer_stride is not None:
      layers = tuple(range(0, model_config.n_layers, self.layer_stride))
      frac *= len(layers) / model_config.n_layers
    if self.kv_heads is not None:
      heads = self.kv_heads
      frac *= len(heads) / model_config.n_kv_heads
    return layers, heads, frac


BASE_CONFIGS = (
    TimedConfig("full", evicts=False),
    TimedConfig("deterministic"),
    TimedConfig("randomized", randomized=True),
    TimedConfig("randomized+certificate", randomized=True, certificate=True),
)
SUBSAMPLED_CONFIGS = (
    TimedConfig("randomized+certificate/layers", randomized=True, certificate=True,
                layer_stride=LAYER_STRIDE),
    TimedConfig("randomized+certificate/heads", randomized=True, certificate=True,
                kv_heads=(0,)),
    TimedConfig("randomized+certificate/layers+heads", randomized=True, certificate=True,
                layer_stride=LAYER_STRIDE, kv_heads=(0,)),
)
TIMED_CONFIGS = BASE_CONFIGS + SUBSAMPLED_CONFIGS
ALL_CONFIGS = tuple(c.name for c in TIMED_CONFIGS)  # the names rows and ``configs`` use
BY_NAME = {c.name: c for c in TIMED_CONFIGS}


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run_overhead` times (and the rows' keys)."""

  model: str = model_loading.DEFAULT_MODEL  # the name in rows (the command: the --model spec)
  budget: float = plan_flags.setting(0.25, "Budget: the share of tokens kept.")
  deterministic: str = plan_flags.setting(
      "snapkv", "The design of the 'deterministic' configuration.")
  n_steps: int = plan_flags.setting(16, "Decode steps per timed call.")
  repeats: int = plan_flags.setting(5, "Timed calls.")
  seed: int = plan_flags.setting(0, "Seed.")
  configs: tuple = ALL_CONFIGS  # a subset of ALL_CONFIGS

  def check(self) -> "Plan":
    bad = sorted(set(self.configs) - set(ALL_CONFIGS))
    if bad:
      raise ValueError(f"configs: unknown {bad}; choose from {list(ALL_CONFIGS)}")
    if not isinstance(self.repeats, int) or self.repeats < 1:
      raise ValueError(f"repeats (timed rounds) must be an int >= 1, got {self.repeats!r}")
    if self.deterministic not in design_defaults.names(randomized=False):
      raise ValueError(f"--deterministic must be a deterministic design, got "
                       f"{self.deterministic!r}")
    return self


def run_overhead(params, config, examples, out_dir: str, plan: Plan, *,
                 log=print) -> list[dict]:
  """One row per configuration in ``plan.configs`` (resumable; a file holding rows of
  another ``deterministic`` design or ``repeats`` is refused: ValueError)."""
  plan.check()
  budget, n_steps, seed = plan.budget, plan.n_steps, plan.seed
  results = results_io.JsonlResults(os.path.join(out_dir, "overhead_rows.jsonl"), KEY_FIELDS)
  settings = dict(deterministic=plan.deterministic, repeats=plan.repeats)
  # What each row on file was made with, read from its design and timings (rows written
  # before these fields were recorded hold them too).
  held = [dict(repeats=len(r["per_step_ms"]),
               **({"deterministic": r["design"]} if r["config"] == "deterministic" else {}))
          for r in results.rows]
  results_io.check_settings(results, {f: (f, v) for f, v in settings.items()}, rows=held)
  prompt, mask = batching.pad_batch([e.context_ids + e.question_ids for e in examples])
  batch, plen = prompt.shape
  common = dict(model=plan.model, budget=float(budget), batch=batch, prompt_len=plen,
                n_steps=n_steps, seed=seed)
  configs = plan.configs
  todo = [c for c in configs if not results.has(config=c, **common)]
  planned = lambda: [r for r in results.rows if r["config"] in configs
                     and all(r.get(k) == v for k, v in common.items())]
  if not todo:
    return planned()
  lengths = budgets.Lengths(n_context=plen, n_steps=n_steps)
  full_cap = budgets.capacity(None, lengths)

  @jax.jit
  def prefill(p):
    logits, caches, _, _ = forward.forward_chunk(
        p, config, prompt, mask, caches_lib.init_caches(config, batch, full_cap),
        settings=layer_lib.Settings(certificate=False))
    return batching.last_logits(logits, mask), caches

  first, full_caches = prefill(params)
  progress = results_io.Progress(len(configs), len(configs) - len(todo))
  prepared = {}  # name -> (compiled, caches, row fields)
  for name in todo:
    timed = BY_NAME[name]
    design_name = timed.design_name(plan.deterministic)
    design = design_defaults.make_design(design_name, budget)
    with_cert = timed.certificate
    cert_layers, cert_heads, cert_frac = timed.subsample(config)
    caches = full_caches
    if design is not None:
      caches, _, _, _ = eviction.evict(design, full_caches, jax.random.PRNGKey(seed))
      # What a deployment allocates after eviction: the kept tokens, compacted
      # to the front, plus the decoded ones (no prefill in this cache).
      small_cap = budgets.capacity(design, lengths, compacted=True)
      caches = caches.compact(small_cap)
    certify = (certified.Subsample(cert_layers, cert_heads) if with_cert
               else False)

    def steps(p, first_logits, caches, design=design, certify=certify, with_cert=with_cert,
              frac=cert_frac):
      def step(carry, _):
        caches, logits = carry
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        new_logits, caches, st, _ = forward.forward_chunk(
            p, config, token[:, None], jnp.ones((batch, 1), bool), caches,
            settings=layer_lib.Settings(design=design, certificate=certify))
        # Horvitz-Thompson: the computed radii (NaN elsewhere) over the fraction computed.
        score = (jnp.nansum(certificate.radius_from_stats(st.var_hat, st.range_hat, 0.05))
                 / frac if with_cert else jnp.float32(0.0))
        return (caches, new_logits[:, 0]), (token, score)
      (_, _), (toks, score) = jax.lax.scan(step, (caches, first_logits), None, length=n_steps)
      return toks, score

    t0 = time.perf_counter()
    compiled = jax.jit(steps).lower(params, first, caches).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(params, first, caches))  # warm-up, untimed
    mem = memory.caches_bytes(caches)
    prepared[name] = (compiled, caches, dict(
        common, **settings, config=name, design=design_name, certificate=with_cert,
        certificate_fraction=cert_frac if with_cert else 0.0,
        capacity=int(caches.k.shape[-2]), compile_s=round(compile_s, 2),
        cache_bytes={k: int(v) for k, v in mem.items()}))
    log(f"overhead/{name}: compiled in {compile_s:.1f}s, capacity {int(caches.k.shape[-2])}")
  # Interleaved rounds: round r times every configuration once (the order rotated by r), so
  # a drift of the machine hits every configuration of a round alike and the per-round
  # ratios (summarize) cancel it.
  times = {name: [] for name in todo}
  for r in range(plan.repeats):
    for name in todo[r % len(todo):] + todo[:r % len(todo)]:
      compiled, caches, _ = prepared[name]
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(params, first, caches))
      times[name].append(time.perf_counter() - t0)
  session = uuid.uuid4().hex[:12]
  for name in todo:
    per_step_ms = [1000.0 * t / n_steps for t in times[name]]
    row = dict(prepared[name][2], per_step_ms=per_step_ms,
               median_ms=float(np.median(per_step_ms)), timing="interleaved",
               timing_session=session)
    results.add(row)
    log(f"{progress.step()} overhead/{name}: {row['median_ms']:.1f} ms/step (median of "
        f"{plan.repeats} interleaved rounds), capacity {row['capacity']}")
  return planned()


def _fraction(config_name: str, row: dict) -> float:
  """Fraction of (layer, head) calls certified (rows written before the field existed:
  all or none)."""
  if "certificate_fraction" in row:
    return float(row["certificate_fraction"])
  return 1.0 if BY_NAME[config_name].certificate else 0.0


def interleaved(a: dict, b: dict) -> bool:
  """Whether rows ``a`` and ``b`` were timed in the same interleaved rounds (element r of
  their ``per_step_ms`` is round r of one run), so their per-round ratios pair up."""
  return (a.get("timing") == "interleaved" and a.get("timing_session") is not None
          and a.get("timing_session") == b.get("timing_session")
          and len(a["per_step_ms"]) == len(b["per_step_ms"]))


def describe_ratio(info: dict) -> str:
  """How a ratio's interval was made (``summarize``'s ``timing`` entry), in words."""
  if info["method"] == "interleaved":
    return (f"median of {info['rounds']} per-round ratios (interleaved rounds in one run), "
            f"order-statistic interval (coverage {info['level']:.2f})")
  return (f"ratio of medians of {info['calls'][0]} and {info['calls'][1]} calls timed one "
          "configuration after another (not in interleaved rounds: drift of the machine "
          "between configurations is not in the interval), 95% bootstrap")


def half_width(ci) -> float:
  """The interval's half-width relative to its estimate (``(hi - lo) / 2 / estimate``)."""
  e, lo, hi = ci
  return (hi - lo) / 2.0 / abs(e) if e else float("inf")


def ratio_lines(summary: dict) -> list[str]:
  """The markdown lines of ``summarize``'s ratios: how they were timed, then each ratio
  with its interval and relative half-width."""
  keys = [k for k in summary if k.startswith("ratio_")]
  how = {describe_ratio(summary["timing"][k]) for k in keys}
  if len(how) == 1:
    lines = [f"Ratios of ms/step: {how.pop()}; +-: the interval's half-width relative to "
             "the estimate:", ""]
    tail = {k: "" for k in keys}
  else:
    lines = ["Ratios of ms/step (how each was timed beside it); +-: the interval's "
             "half-width relative to the estimate:", ""]
    tail = {k: f"; {describe_ratio(summary['timing'][k])}" for k in keys}
  for k in keys:
    e, lo, hi = summary[k]
    lines.append(f"- {k}: {e:.2f} [{lo:.2f}, {hi:.2f}] (+-{100 * half_width(summary[k]):.0f}%"
                 f"{tail[k]})")
  return lines


def summarize(rows, plot_dir=None, seed: int = 0) -> dict:
  by = {r["config"]: r for r in rows}
  out = {"rows": len(rows), "plots": []}
  md = ["## Overhead per decode step (experiment 7)", ""]
  if not all(c.name in by for c in BASE_CONFIGS):
    out["md"] = "\n".join(md + ["(incomplete)"])
    return out
  rng = np.random.default_rng(seed)
  out["timing"] = {}

  def ratio_ci(key, a, b):
    """``out[key] = [estimate, lo, hi]`` of time(a) / time(b); how, in ``timing``."""
    x, y = np.asarray(by[a]["per_step_ms"]), np.asarray(by[b]["per_step_ms"])
    if interleaved(by[a], by[b]):
      mi = intervals.median_interval(x / y)
      out[key] = [mi["median"], mi["lo"], mi["hi"]]
      out["timing"][key] = dict(method="interleaved", rounds=len(x), level=mi["level"])
      return
    est = float(np.median(x) / np.median(y))
    boots = [np.median(rng.choice(x, len(x))) / np.median(rng.choice(y, len(y)))
             for _ in range(1000)]
    out[key] = [est, float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]
    out["timing"][key] = dict(method="sequential", calls=[len(x), len(y)], level=0.95)
  ratio_ci("ratio_cert_vs_deterministic", "randomized+certificate", "deterministic")
  ratio_ci("ratio_cert_vs_randomized", "randomized+certificate", "randomized")
  ratio_ci("ratio_cert_vs_full", "randomized+certificate", "full")
  present = [c for c in ALL_CONFIGS if c in by]
  for c in present:
    if BY_NAME[c].subsampled:  # what the subsample saves of the certificate's extra time
      ratio_ci(f"ratio_{c}_vs_deterministic", c, "deterministic")
      ratio_ci(f"ratio_{c}_vs_randomized", c, "randomized")
  body = []
  for c in present:
    r = by[c]
    b = r["cache_bytes"]
    body.append([c, r["design"], f"{_fraction(c, r):.3f}",
                 r["capacity"], f"{r['median_ms']:.1f}",
                 f"{min(r['per_step_ms']):.1f}-{max(r['per_step_ms']):.1f}",
                 memory.format_bytes(b.get("kv", 0)), memory.format_bytes(b.get("metadata", 0))])
  md += [f"batch {by['full']['batch']}, prompt {by['full']['prompt_len']} tokens, "
         f"{by['full']['n_steps']} steps, budget {by['full']['budget']}", "",
         "| config | design | certified calls | capacity | ms/step (median) | range | K/V | "
         "metadata |", "|---|---|---|---|---|---|---|---|"]
  md += ["| " + " | ".join(str(x) for x in row) + " |" for row in body]
  md += [""] + ratio_lines(out)
  if plot_dir:
    out["plots"].append(plots.plot_overhead(
        {c: by[c]["median_ms"] for c in present}, os.path.join(plot_dir, "overhead.png"),
        errors={c: float(np.std(by[c]["per_step_ms"])) for c in present},
        title="Decode step time (CPU)"))
    md += ["", "![overhead.png](overhead.png)"]
  out["md"] = "\n".join(md)
  return out


def run_and_report(plan: Plan, *, out: str, task: str, context_len: int,
                   num_examples: int) -> str:
  """The command: times every configuration of ``plan`` (``plan.model``: the ``--model``
  spec) on ``num_examples`` prompts of ``task``, writes ``out/overhead_rows.jsonl``,
  ``out/summary.md`` (and ``overhead.png``); returns the summary's markdown."""
  plan.check()
  params, config, tok = model_loading.load_model(plan.model)
  exs = tasks.make_task(task, tok, num_examples, context_len, plan.seed)
  rows = run_overhead(params, config, exs, out,
                      dataclasses.replace(plan, model=model_loading.model_name(plan.model)))
  s = summarize(rows, out)
  results_io.atomic_write_text(os.path.join(out, "summary.md"), s["md"] + "\n")
  return s["md"]
