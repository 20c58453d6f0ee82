r"""Streaming language-model loss under eviction on long natural text: the experiment.

A text file (``--text``, UTF-8) is tokenized once and cut into
``--num_examples`` consecutive, non-overlapping segments of ``--context_len``
tokens (each opened with the tokenizer's BOS when it adds one by default;
consecutive so that a larger ``--num_examples`` keeps the earlier segments,
and their rows, unchanged). Each segment streams through the model
``--chunk`` tokens at a time, evicted after each chunk
(:func:`experiments.lib.streaming_loss.core.streaming_nll`); 'full' (no eviction)
always runs first, so that every other row carries its NLL increase over the
full cache on the same segment.

Rows (``--out/perplexity_rows.jsonl``, one per (segment, design, budget, run),
atomic and resumable; one jitted call per (design, run) over all its
budgets x segments as batch rows, so one compile serves a design's budgets):
model, text name and sha256, segment, context_len, chunk, design, budget, run,
seed, n_scored, mean NLL, perplexity, mean NLL after the first chunk, delta NLL
vs full (overall and after the first chunk), per-chunk mean NLL and radius,
kept cache slots per chunk, and the Spearman correlation over the tokens after
the first chunk between the radius and the NLL increase (None when either is
constant, e.g. radius 0 everywhere). Full rows also hold every token's NLL
(``token_nll``), from which a resumed run computes the increases.

The design x budget table: :mod:`experiments.lib.streaming_loss.report`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import design_defaults
from experiments.lib import loaders
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib.streaming_loss import core as streaming_loss_core
from experiments.lib.streaming_loss import report as streaming_loss_report

KEY_FIELDS = ("model", "text_sha256", "segment", "context_len", "chunk", "design", "budget",
              "run", "seed", "n_sink", "window")
ROWS_FILE = "perplexity_rows.jsonl"


def text_sha256(text: str) -> str:
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def make_segments(tok, text: str, num_examples: int, context_len: int,
                  text_flag: str = "") -> list[list[int]]:
  """``num_examples`` consecutive, non-overlapping segments of ``context_len`` tokens.

  Each segment is the tokenizer's default prefix (``tok.encode("")``: its BOS
  when it adds one) followed by the next ``context_len - len(prefix)`` tokens
  of the text (tokenized once, without BOS).

  Raises:
    ValueError: the text has too few tokens (naming --text, --num_examples and
      --context_len and the counts).
  """
  prefix = list(tok.encode(""))
  body = list(tok.encode(text, add_bos=False))
  per = context_len - len(prefix)
  need = num_examples * per
  if per < 2 or len(body) < need:
    raise ValueError(
        f"--text={text_flag}: the text has {len(body)} tokens, too few for --num_examples="
        f"{num_examples} segments of --context_len={context_len} tokens ({len(prefix)} "
        f"BOS + {per} text tokens each: {need} text tokens needed); use a longer text or "
        "fewer/shorter segments")
  return [prefix + body[i * per:(i + 1) * per] for i in range(num_examples)]


def units_of(designs: Sequence[str], n_runs: int) -> list[tuple[str, int]]:
  """(design, run) units: 'full' first (the reference), one run per deterministic design."""
  units = [("full", 0)]
  for d in designs:
    if d != "full":
      units += [(d, r) for r in range(n_runs if design_defaults.is_randomized(d) else 1)]
  return units


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run_perplexity` runs; each setting is a flag of ``python -m
  experiments.perplexity``. Validated by :meth:`check` (errors name the flag). Run ``r``
  of a randomized design draws with ``fold_in(PRNGKey(seed), r)``; the draws depend on
  ``max_batch``'s grouping."""

  model: str = model_loading.DEFAULT_MODEL  # recorded in rows; --model names the checkpoint
  designs: tuple = plan_flags.setting(
      ("full", "snapkv", "poisson_tail"),
      f"Designs, from {', '.join(design_defaults.names())} ('full' = no eviction, the "
      "reference; always run).")
  budgets: tuple = plan_flags.setting((0.125, 0.25, 0.5), "Budgets: fractions in (0, 1] of "
                                      "the tokens seen.")
  context_len: int = plan_flags.setting(512, "Tokens per segment (BOS included).")
  chunk: int = plan_flags.setting(64, "Tokens per streaming chunk; the design evicts after "
                                  "each chunk.")
  num_examples: int = plan_flags.setting(4, "Non-overlapping segments of the tokenized text.")
  seed: int = plan_flags.setting(0, "Seed of the randomized designs.")
  n_runs: int = plan_flags.setting(2, "Independent runs of each randomized design.")
  n_sink: int = plan_flags.setting(design_defaults.N_SINK, "Sink tokens every design keeps.")
  window: int = plan_flags.setting(design_defaults.WINDOW, "Recent tokens every design keeps "
                                   "(and SnapKV's observation window).")
  max_units: Optional[int] = plan_flags.setting(
      None, "Stop after this many units (batched calls) this run (unset: all); a rerun "
      "resumes.")
  max_batch: Optional[int] = plan_flags.setting(
      None, "At most this many rows per call (unset: a unit's whole batch, budgets x "
      "segments).")

  def check(self) -> "Plan":
    """Validates the plan; errors name the flag. Returns it with float budgets."""
    for d in self.designs:
      if d not in design_defaults.names():
        raise ValueError(f"--designs: unknown design {d!r}; choose from "
                         f"{list(design_defaults.names())}")
    if not self.budgets:
      raise ValueError("--budgets: give at least one budget")
    for b in self.budgets:
      if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < float(b) <= 1.0:
        raise ValueError(f"--budgets entries must be fractions in (0, 1], got {b!r}")
    for name, v, lo in (("chunk", self.chunk, 1), ("context_len", self.context_len, 2),
                        ("num_examples", self.num_examples, 1), ("n_runs", self.n_runs, 1),
                        ("n_sink", self.n_sink, 0), ("window", self.window, 0)):
      if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"--{name} must be an int >= {lo}, got {v!r}")
    if self.chunk >= self.context_len:
      raise ValueError(f"--chunk ({self.chunk}) must be < --context_len ({self.context_len}): "
                       "with one chunk nothing is ever predicted from an evicted cache")
    if self.max_units is not None and (not isinstance(self.max_units, int)
                                       or self.max_units < 0):
      raise ValueError(f"--max_units must be None or an int >= 0, got {self.max_units!r}")
    if self.max_batch is not None and (not isinstance(self.max_batch, int)
                                       or self.max_batch < 1):
      raise ValueError(f"--max_batch must be None or an int >= 1, got {self.max_batch!r}")
    return dataclasses.replace(self, designs=tuple(self.designs),
                               budgets=tuple(float(b) for b in self.budgets))

  @property
  def units(self) -> list[tuple[str, int]]:
    return units_of(self.designs, self.n_runs)


def _run_unit(params, config, segs, design_name, row_budgets, key, plan: Plan):
  """numpy arrays of :class:`StreamingNLL` for the batch rows; in groups of
  ``plan.max_batch`` rows (the last padded by repeating a row: one shape, one compile)."""
  unit_budgets = (1.0,) if design_name == "full" else plan.budgets
  design = design_defaults.make_design(design_name, max(unit_budgets), plan.n_sink,
                                       plan.window)
  # sized for the unit's largest budget: every group has the same shapes
  stream = streaming_loss_core.StreamConfig(chunk=plan.chunk, design=design).sized(
      len(segs[0]), max(unit_budgets))
  size = len(segs) if plan.max_batch is None else min(plan.max_batch, len(segs))
  outs = []
  for g, start in enumerate(range(0, len(segs), size)):
    idx = list(range(start, min(start + size, len(segs))))
    idx += [idx[0]] * (size - len(idx))
    toks = jnp.asarray(np.asarray([segs[i] for i in idx], np.int32))
    budget = None if design is None else jnp.asarray([row_budgets[i] for i in idx], jnp.float32)
    res = streaming_loss_core.streaming_nll(
        params, toks, jnp.ones(toks.shape, bool), jax.random.fold_in(key, g), config=config,
        stream=stream, budget=budget)
    res = jax.tree_util.tree_map(np.asarray, res)
    outs.append(jax.tree_util.tree_map(lambda a, m=min(size, len(segs) - start): a[:m], res))
  return jax.tree_util.tree_map(lambda *a: np.concatenate(a), *outs)


def run_perplexity(params, config, tok, text_path: str, out_dir: str, plan: Plan, *,
                   log: Callable[[str], None] = print) -> list[dict]:
  """Runs every (design, run) unit of ``plan`` with a missing row; returns its rows.

  Args:
    params, config, tok: the model (``experiments.lib.model_loading.load_model``).
    text_path: the UTF-8 text file (``experiments.lib.loaders.load_text``).
    out_dir: rows go to ``out_dir/perplexity_rows.jsonl``.
    plan: what to run (:class:`Plan`).
    log: progress lines (with an ETA).

  Returns:
    The rows of ``plan`` present in the file (a subset if stopped early).
  """
  plan = plan.check()
  text = loaders.load_text(text_path)
  segs = make_segments(tok, text, plan.num_examples, plan.context_len, text_path)
  sha = text_sha256(text)
  results = results_io.JsonlResults(os.path.join(out_dir, ROWS_FILE), KEY_FIELDS)
  common = dict(model=plan.model, text=os.path.basename(text_path), text_sha256=sha,
                context_len=plan.context_len, chunk=plan.chunk, seed=plan.seed,
                n_sink=plan.n_sink, window=plan.window)
  key_of = lambda d, b, run, s: {k: v for k, v in dict(common, design=d, budget=b, run=run,
                                                       segment=s).items() if k in KEY_FIELDS}
  units = plan.units
  unit_budgets = lambda d: (1.0,) if d == "full" else plan.budgets

  def batch_of(unit):
    return [(b, s) for b in unit_budgets(unit[0]) for s in range(plan.num_examples)]

  def missing(unit):
    d, run = unit
    return [(b, s) for b, s in batch_of(unit) if not results.has(**key_of(d, b, run, s))]

  def full_rows():
    return {r["segment"]: r for r in results.rows
            if r["design"] == "full" and all(r.get(k) == v for k, v in common.items()
                                             if k in KEY_FIELDS)}

  todo = [u for u in units if missing(u)]
  progress = results_io.Progress(len(units), len(units) - len(todo))
  log(f"{len(todo)} of {len(units)} units to run ({plan.num_examples} segments of "
      f"{plan.context_len} tokens from {os.path.basename(text_path)}); rows in {results.path}")
  for unit in results_io.limit_units(todo, plan.max_units, log):
    d, run = unit
    batch = batch_of(unit)
    t0 = time.time()
    res = _run_unit(params, config, [segs[s] for _, s in batch], d, [b for b, _ in batch],
                    jax.random.fold_in(jax.random.PRNGKey(plan.seed), run), plan)
    seconds = time.time() - t0
    full = full_rows()
    todo_rows = set(missing(unit))
    nlls = []
    for j, (b, s) in enumerate(batch):
      summary = streaming_loss_core.row_summary(
          res.logprob[j], res.scored[j], res.radius[j], res.kept[j], res.n_dropped[j],
          plan.chunk, None if d == "full" else full[s]["token_nll"])
      nlls.append(summary["mean_nll"])
      if (b, s) not in todo_rows:
        continue
      row = dict(common, segment=s, design=d, budget=b, run=run,
                 randomized=d != "full" and design_defaults.is_randomized(d),
                 delta=streaming_loss_core.DELTA,
                 unit_seconds=round(seconds, 2), batch_size=len(batch), **summary)
      results.add(row)
    n_tok = len(batch) * plan.context_len
    log(f"{progress.step()} {d}/run{run}: {len(batch)} rows in {seconds:.0f}s "
        f"({n_tok / max(seconds, 1e-9):.0f} tok/s, compile included), mean NLL "
        f"{np.mean(nlls):.3f}")
  return select(results.rows, plan, sha)


def select(rows, plan: Plan, text_sha: str) -> list[dict]:
  """The rows that belong to ``plan`` on the text whose sha256 is ``text_sha``."""
  want = set(plan.units)
  budgets = tuple(float(b) for b in plan.budgets)
  fixed = dict(model=plan.model, text_sha256=text_sha, context_len=plan.context_len,
               chunk=plan.chunk, seed=plan.seed, n_sink=plan.n_sink, window=plan.window)
  return [r for r in rows
          if all(r.get(k) == v for k, v in fixed.items()) and (r["design"], r["run"]) in want
          and r["segment"] < plan.num_examples
          and (r["design"] == "full" or r["budget"] in budgets)]


def expected_row_count(designs, budgets, num_examples: int, n_runs: int) -> int:
  return sum((1 if d == "full" else len(budgets)) * num_examples
             for d, _ in units_of(designs, n_runs))


def plan_from_flags(fv) -> Plan:
  """The checked :class:`Plan` of ``python -m experiments.perplexity``'s flags."""
  return plan_flags.plan_from_flags(Plan, fv, model=fv.model)


def run_from_flags(fv, log: Callable[[str], None] = print) -> Optional[dict]:
  """``python -m experiments.perplexity`` on its parsed flags ``fv``: rows, then
  (when complete) the summary.

  Returns:
    :func:`experiments.lib.streaming_loss.report.summarize`'s dict, or None when
    ``--max_units`` stopped it early.
  """
  plan = plan_from_flags(fv)
  loaders.load_text(fv.text)  # a missing/empty --text fails before the model loads
  t0 = time.time()
  params, config, tok = model_loading.load_model(fv.model)
  plan = dataclasses.replace(plan, model=model_loading.model_name(fv.model))
  rows = run_perplexity(params, config, tok, fv.text, fv.out, plan, log=log)
  want = expected_row_count(plan.designs, plan.budgets, plan.num_examples, plan.n_runs)
  if len(rows) < want:
    log(f"{len(rows)} of {want} rows; rerun to finish (no summary yet)")
    return None
  s = streaming_loss_report.summarize(rows, fv.out, fv.seed)
  log(s["md"])
  log(f"\nwall time {time.time() - t0:.0f}s (model load included)")
  return s
