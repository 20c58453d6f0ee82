"""The experiment suite's rows (method, section 8): one collection shared by every analysis.

Every experiment script of the suite (``exp_*.py``, ``run_all.py``) works
from the same per-example rows, collected here by :func:`collect` (what to
run: :class:`experiments.lib.suite.settings.Settings`; the model:
:mod:`experiments.lib.model_loading`):

* a *unit* is one (regime, design, run): ONE jitted evaluation-mode call
  (``models.decode.generate`` or ``generate_streaming`` with
  ``evaluate=True``) over a batch of (budget x task x example) rows, the budgets
  passed as the traced per-row ``budget`` so that every budget of a design
  shares one compile (and run 1 of a randomized design reuses run 0's
  compile: only the PRNG key differs);
* a *row* is one (task, regime, design, budget, example, run): correctness of
  the generated answer, its output log-probabilities, and a summary of the
  decode calls' certificate statistics against the true attention error from
  the shadow full cache (coverage at every ``delta``, sharpness, the
  aggregated per-step certificate score, the Assumption-2 ratio ``R``, per-layer
  and per-head coverage) plus a small seeded sample of raw calls for the
  scatter plots and the ``log R`` regression.

Rows are written with :class:`experiments.lib.results_io.JsonlResults` as each
unit finishes (one atomic rewrite per row), keyed by
:data:`KEY_FIELDS`; a rerun skips the rows already there, and a unit whose
rows are all present is not run again. A unit interrupted half-way (some of
its rows written) is rerun with the same key, which reproduces the same
rows, and only the missing ones are added.

The ``full`` design (nothing evicted) is the reference: its rows carry the
full-cache correctness used by attribution and gating. It runs in the first
listed regime only: without eviction both regimes compute the same thing
(the streaming prefill only chunks the context), so its rows serve both.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from certkv_jax import certificate
from experiments.lib import batching
from experiments.lib import design_defaults
from experiments.lib import results_io
from experiments.lib import stats
from experiments.lib import tasks as tasks_lib
from experiments.lib.suite import settings as settings_lib
from models.text import answer_text

MOVING_WINDOW = 6  # decode steps (the paper's window)
KEY_FIELDS = ("model", "task", "regime", "design", "budget", "run", "example", "seed",
              "context_len")


def _q(x, p):
  return float(np.quantile(x, p)) if x.size else None


def summarize_row(gen_np: dict, j: int, deltas, *, n_sample: int, sample_seed: int,
                  subsample_fraction: float) -> dict:
  """Summary of batch row ``j``'s decode calls (arrays ``[steps, layers, batch, heads]``)."""
  take = lambda a: np.asarray(a[:, :, j, :], np.float64)  # [S, L, H]
  err, var, rng_, rel = (take(gen_np[k]) for k in ("true_error", "var_hat", "range_hat",
                                                     "rel_error"))
  R, m, nt = (take(gen_np[k]) for k in ("ratio", "tail_m", "tail_n"))
  radii = {d: np.asarray(certificate.radius_from_stats(var, rng_, d), np.float64)
           for d in deltas}
  r05 = radii[settings_lib.PRIMARY_DELTA]
  cov = lambda e, r: float(np.mean(e <= r))
  per_step = r05.sum(axis=(1, 2))  # [S]: sum over layers and heads
  window = np.asarray(certificate.moving_window(per_step, min(MOVING_WINDOW, len(per_step))))
  n_calls = r05[0].size
  k_sub = max(1, int(round(subsample_fraction * n_calls)))
  sub = np.asarray(certificate.subsample_mask(jax.random.PRNGKey(sample_seed),
                                              r05.shape[1:], k_sub))
  sub_step = np.asarray([float(certificate.subsampled_sum(r05[s], sub))
                         for s in range(r05.shape[0])])
  tail = R > 0
  sample_rng = np.random.default_rng(sample_seed)
  flat = np.arange(err.size)
  pick = sample_rng.choice(flat, size=min(n_sample, err.size), replace=False)
  s_idx, l_idx, h_idx = np.unravel_index(pick, err.shape)
  sample = {
      "err": err.ravel()[pick].tolist(), "radius": r05.ravel()[pick].tolist(),
      "var_hat": var.ravel()[pick].tolist(), "range_hat": rng_.ravel()[pick].tolist(),
      "R": R.ravel()[pick].tolist(), "m": m.ravel()[pick].tolist(),
      "n_tail": nt.ravel()[pick].tolist(), "step": s_idx.tolist(), "layer": l_idx.tolist(),
      "head": h_idx.tolist(),
  }
  return {
      "n_calls": int(err.size),
      "coverage": {str(d): cov(err, radii[d]) for d in deltas},
      "sharpness": stats.sharpness(err, r05) if np.any((err <= r05) & (err > 0)) else None,
      "mean_err": float(err.mean()), "max_err": float(err.max()),
      "mean_rel_err": float(rel.mean()), "mean_radius": float(r05.mean()),
      "err_step_sum_mean": float(err.sum(axis=(1, 2)).mean()),
      "cert_score": float(window.max()), "cert_mean": float(per_step.mean()),
      "cert_sub_mean": float(sub_step.mean()),
      "cov_layer": np.mean(err <= r05, axis=(0, 2)).tolist(),
      "cov_head": np.mean(err <= r05, axis=(0, 1)).tolist(),
      "err_layer": err.mean(axis=(0, 2)).tolist(),
      "R_frac_tail": float(tail.mean()),
      "R_median": _q(R[tail], 0.5), "R_p90": _q(R[tail], 0.9),
      "R_max": float(R[tail].max()) if tail.any() else None,
      "m_mean": float(m[tail].mean()) if tail.any() else None,
      "n_tail_mean": float(nt[tail].mean()) if tail.any() else None,
      "sample": sample,
  }


def _units(settings: settings_lib.Settings):
  """(regime, design, run) units; 'full' runs in the first regime only (see module doc)."""
  units = []
  for k, regime in enumerate(settings.regimes):
    for d in settings.designs:
      if d == "full" and k > 0:
        continue
      if regime != "question_aware" and d in settings.question_aware_only:
        continue
      runs = settings.n_runs if d in settings.multi_run_designs else 1
      for run in range(runs):
        units.append((regime, d, run))
  return units


def unit_budgets(settings: settings_lib.Settings, design: str) -> tuple:
  return (1.0,) if design == "full" else tuple(settings.budgets)


def row_fields(settings: settings_lib.Settings, task, regime, design, budget, run, example) -> dict:
  return dict(model=settings.model, task=task, regime=regime, design=design,
              budget=float(budget), run=run, example=example, seed=settings.seed,
              context_len=settings.context_len)


def collect(params, config, tok, settings: settings_lib.Settings, out_dir: str, *,
            max_units: Optional[int] = None, log: Callable[[str], None] = print,
            examples_by_task: Optional[dict] = None) -> list[dict]:
  """Runs every unit with a missing row; returns the rows of ``settings``.

  A unit's batch holds every (budget, task, example) row of that (regime,
  design, run): the tasks share one compile (right-padded ragged batch).

  Args:
    params, config, tok: the model (:func:`experiments.lib.model_loading.load_model`).
    settings: what to run.
    out_dir: rows go to ``out_dir/rows.jsonl``.
    max_units: stop after running this many units (None: all), e.g. to test
      resuming; a rerun does the rest.
    log: progress lines (with an ETA) go here.
    examples_by_task: optional prebuilt examples per task (tests); default
      ``tasks.make_task(task, tok, num_examples, context_len, seed)``.

  Returns:
    The rows of ``settings`` present in the file (a subset if interrupted).
  """
  settings.check()
  results = results_io.JsonlResults(os.path.join(out_dir, "rows.jsonl"), KEY_FIELDS)
  examples = make_examples(tok, settings, examples_by_task)
  units = _units(settings)

  def batch_of(unit):
    return [(b, t, i) for b in unit_budgets(settings, unit[1]) for t in settings.tasks
            for i in range(len(examples[t]))]

  def missing(unit):
    regime, d, run = unit
    return [(b, t, i) for b, t, i in batch_of(unit)
            if not results.has(**row_fields(settings, t, regime, d, b, run, i))]

  recorded = dict(n_steps=settings.n_steps, chunk=settings.chunk, n_sink=settings.n_sink,
                  window=settings.window, deltas=list(settings.deltas),
                  subsample_fraction=settings.subsample_fraction,
                  n_sample_calls=settings.n_sample_calls)  # besides the key: a resume matches
  results_io.check_settings(results, {k: (k, v) for k, v in recorded.items()})
  todo = [u for u in units if missing(u)]
  progress = results_io.Progress(len(units), len(units) - len(todo))
  log(f"{len(todo)} of {len(units)} units to run; rows in {results.path}")
  for unit in results_io.limit_units(todo, max_units, log):
    regime, d, run = unit
    batch = batch_of(unit)
    key = jax.random.fold_in(jax.random.PRNGKey(settings.seed), run)
    t0 = time.time()
    gen_np = _run_unit(params, config, examples, batch, d, regime, key, settings)
    seconds = time.time() - t0
    todo_rows = set(missing(unit))
    n_correct = 0
    for j, (b, t, i) in enumerate(batch):
      ex = examples[t][i]
      toks = gen_np["tokens"][j].tolist()
      text = tok.decode(toks)
      correct = bool(ex.score(answer_text.answer(tok, toks)))  # the turn, not what follows
      n_correct += correct
      if (b, t, i) not in todo_rows:
        continue
      lp = gen_np["logprobs"][j].astype(np.float64)
      row = row_fields(settings, t, regime, d, b, run, i)
      row.update(
          randomized=design_defaults.is_randomized(d), **recorded,
          n_prompt_tokens=len(ex.context_ids) + len(ex.question_ids),
          answer=ex.answer, text=text, tokens=toks, correct=correct,
          mean_logprob=float(lp.mean()), min_logprob=float(lp.min()),
          unit_seconds=round(seconds, 2), batch_size=len(batch))
      row.update(summarize_row(gen_np, j, settings.deltas, n_sample=settings.n_sample_calls,
                               sample_seed=settings.seed * 1_000_003 + j * 7 + run,
                               subsample_fraction=settings.subsample_fraction))
      results.add(row)
    log(f"{progress.step()} {regime}/{d}/run{run}: {len(batch)} rows in {seconds:.0f}s "
        f"(compile included), accuracy {n_correct / len(batch):.2f}")
  return select(results.rows, settings)


GEN_FIELDS = ("tokens", "logprobs", "var_hat", "range_hat", "true_error", "rel_error", "ratio",
              "tail_m", "tail_n")


def _run_unit(params, config, examples, batch, design: str, regime: str, key,
              settings: settings_lib.Settings) -> dict:
  """A unit's ``Generation`` arrays (numpy, batch on axis 0 of tokens/logprobs and axis 2
  of the per-call arrays), in slices of ``settings.max_batch`` rows.

  Every slice is padded (repeating its last row, whose outputs are dropped) to
  the same number of rows and to the unit's padded lengths, so one compile
  serves them all; slice ``c`` draws with ``fold_in(key, c)`` (slice 0 with
  ``key`` itself, so a unit that fits in one slice draws as without slicing).
  """
  exs = [examples[t][i] for _, t, i in batch]
  budgets = [b for b, _, _ in batch]
  size = settings.max_batch or len(batch)
  unit = batching.UnitCall(design=design, regime=regime, n_steps=settings.n_steps,
                           chunk=settings.chunk, n_sink=settings.n_sink, window=settings.window,
                           shape=batching.pad_shape(exs), max_budget=max(budgets))
  parts = []
  for c, start in enumerate(range(0, len(batch), size)):
    idx = list(range(start, min(start + size, len(batch))))
    n_real = len(idx)
    if len(batch) > size:
      idx += [idx[-1]] * (size - n_real)
    gen = batching.run_batch(params, config, [exs[i] for i in idx],
                             [budgets[i] for i in idx],
                             key if c == 0 else jax.random.fold_in(key, c), unit)
    part = {}
    for k in GEN_FIELDS:
      a = np.asarray(getattr(gen, k))
      part[k] = a[:n_real] if k in ("tokens", "logprobs") else a[:, :, :n_real]
    parts.append(part)
  return {k: np.concatenate([p[k] for p in parts], axis=0 if k in ("tokens", "logprobs")
                            else 2) for k in GEN_FIELDS}


def make_examples(tok, settings: settings_lib.Settings,
                  examples_by_task: Optional[dict] = None) -> dict:
  """task -> examples (``examples_by_task`` entries win; the rest from ``tasks.make_task``)."""
  out = dict(examples_by_task or {})
  for task in settings.tasks:
    if task not in out:
      out[task] = tasks_lib.make_task(task, tok, settings.num_examples, settings.context_len,
                                      settings.seed)
    out[task] = list(out[task])[:settings.num_examples]
  return out


def select(rows: Sequence[dict], settings: settings_lib.Settings) -> list[dict]:
  """The rows that belong to ``settings``."""
  want = set(_units(settings))
  return [r for r in rows
          if (r["regime"], r["design"], r["run"]) in want and r["task"] in settings.tasks
          and r["model"] == settings.model and r["seed"] == settings.seed
          and r["context_len"] == settings.context_len
          and r["example"] < settings.num_examples
          and (r["design"] == "full" or r["budget"] in settings.budgets)]


def expected_row_count(settings: settings_lib.Settings) -> int:
  per = len(settings.tasks) * settings.num_examples
  return sum(len(unit_budgets(settings, d)) * per for _, d, _ in _units(settings))
