r"""A RULER-style leaderboard of the eviction designs: units, shared prefills, rows.

Every registered design (and the full cache, the reference) answers the RULER
tasks of :mod:`experiments.lib.ruler` at compression ratios in kvpress's
convention (the fraction of the cache removed: budget = 1 - ratio), greedily,
up to the task's ``tokens_to_generate``, in two regimes:

* ``streaming`` (kvpress's default): the context is compressed before the
  question is seen. With ``chunk=0`` the context is prefilled once and
  evicted once, as kvpress does; the question is then prefilled on the
  compressed cache and the answer decoded. ``chunk > 0`` evicts after every
  ``chunk`` context tokens instead (``models.decode.generate_streaming``).
* ``query_aware``: context and question are prefilled together and evicted
  once (kvpress's ``query_aware``; ``models.decode.generate``).

One prefill serves every design (``chunk=0``): a prefill leaves the keys,
values and the statistics ``acc`` (summed attention) and ``last`` (the last
query's attention) alike for every design, bit for bit; only ``obs``, the
observation window's attention, depends on the design's window and fold
(SnapKV: summed over 16 queries; ``poisson_envelope``: their maximum). So the
prompt is prefilled once per distinct window (:func:`stats_key`; with SnapKV
and its twin among the designs, once in all), the designs without a window
reuse whichever prefill there is, and each design evicts its own copy.
The result equals the design's own ``generate`` / ``generate_streaming``
call with the whole context as one chunk (``tests/experiments/leaderboard_test.py``).
Decoding folds nothing (no eviction during decoding), so it runs without the
design and compiles once for every design.

A *unit* is (context length, task, regime, first example, design): its rows
(one per example of the group x ratio, ``ratio=0.0`` for the full cache)
are one batched call. Rows (``rows.jsonl``, atomic, resumable) hold the
prediction, RULER's score and, for randomized designs (run in evaluation
mode: a shadow full cache gives every decode call's true error), each
step's median raw radius and true error over (layer, head) at delta 0.05,
raw coverage and medians over the calls up to the answer's end. Per-call
errors and radii of up to :data:`CALL_STEPS` steps per row go to
``calls/*.npz`` (float32, not committed) for the report's calibrated coverage.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import zlib
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import calibration
from certkv_jax import certificate
from certkv_jax import eviction
from certkv_jax.kv.caches import init_caches
from certkv_jax.kv import memory
from certkv_jax import layer as layer_lib
from experiments.lib import batching
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib.leaderboard import rows as rows_lib
from experiments.lib import ruler
from experiments.lib import variants
from models import decode
from models import precision
from models.decode import allocation_args
from models.forward import forward_chunk
from models.text import answer_text

ROWS_FILE = "rows.jsonl"
KEY_FIELDS = ("context_len", "task", "regime", "design", "ratio", "example", "seed")
REGIMES = ("streaming", "query_aware")
DEFAULT_RATIOS = (0.25, 0.5, 0.75, 0.875)
FULL_RATIO = 0.0  # the full cache's row: nothing removed
DELTA = 0.05  # the certificate's miss probability
CALL_STEPS = 8  # decode steps per row whose per-call error and radius are kept
QUESTION_PAD = 32  # questions are padded to a multiple of this (fewer compiles)


def parse_tasks_at(entries) -> tuple:
  """``--tasks_at`` entries ``CONTEXT:task+task...`` as ``((context, (task, ...)), ...)``."""
  out = []
  for e in entries:
    c, sep, tasks = e.partition(":")
    if not sep or not c.strip().isdigit() or not tasks:
      raise ValueError(f"--tasks_at entries must be CONTEXT:task+task..., got {e!r}")
    out.append((int(c), tuple(tasks.split("+"))))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run` runs (validated by :meth:`check`; errors name the flag)."""

  tasks: tuple = plan_flags.setting(ruler.TASKS, "RULER tasks (experiments.lib.ruler.TASKS).")
  context_lens: tuple = plan_flags.setting(
      (4096,), "Tokens per example: prompt + RULER's generation budget.")
  tasks_at: tuple = plan_flags.setting(
      (), "CONTEXT:task+task...: only these tasks at that context length, e.g. "
      "8192:niah_single_1+niah_multikey_1+vt.", parse=parse_tasks_at)
  n_examples: int = plan_flags.setting(10, "Examples per task and context length.")
  designs: tuple = plan_flags.setting(
      design_defaults.names(), "Designs, or variants design[:setting=value][+allocation] "
      "(experiments.lib.variants: adakv, cert, ...); the full cache always runs, as the "
      "reference.")
  ratios: tuple = plan_flags.setting(
      DEFAULT_RATIOS, "Compression ratios: the share of the cache removed (budget = 1 - ratio).")
  regimes: tuple = plan_flags.setting(
      REGIMES, "streaming (question after the compressed context) and/or query_aware "
      "(inside it).")
  chunk: int = plan_flags.setting(
      0, "Streaming: evict after every this many context tokens (0: the whole context at "
      "once, as kvpress; one prefill for every design).")
  group: int = plan_flags.setting(1, "Examples per batched call (each at every ratio).")
  seed: int = plan_flags.setting(0, "Seed of the examples and the randomized designs.")
  n_sink: int = design_defaults.N_SINK
  window: int = design_defaults.WINDOW
  haystack: Optional[str] = plan_flags.setting(
      None, "Text file for the essay haystack and word lists (default: "
      "experiments/lib/ruler's DEFAULT_HAYSTACK).")
  max_new_tokens: Optional[int] = plan_flags.setting(
      None, "Tokens to generate (default: RULER's per task).")
  use_chat: bool = plan_flags.setting(True, "Wrap prompts in the tokenizer's chat template.")
  max_units: Optional[int] = plan_flags.setting(
      None, "Stop after this many units (default: all); a rerun resumes.")
  equal_memory: bool = plan_flags.setting(
      False, "Ratios remove a share of the kept bytes (keys, values and per-slot metadata), "
      "not of the tokens: designs at equal memory.")
  coverage: bool = plan_flags.setting(
      True, "Run randomized designs in evaluation mode (a shadow full cache: every decode "
      "call's true error beside its radius).")
  dtype: str = plan_flags.setting(model_loading.DEFAULT_DTYPE, model_loading.DTYPE_HELP,
                                  choices=model_loading.DTYPES)

  def check(self) -> "Plan":
    results_io.check_plan_lists(self, ("tasks", "designs", "ratios", "regimes",
                                       "context_lens"))
    for t in self.tasks:
      if t not in ruler.TASKS:
        why = f" ({ruler.LEFT_OUT[t]})" if t in ruler.LEFT_OUT else ""
        raise ValueError(f"--tasks: unknown task {t!r}{why}; choose from {list(ruler.TASKS)}")
    for d in self.designs:
      if d != design_defaults.FULL:
        variants.design_and_allocation(d, self.n_sink, self.window, "--designs")
    for r in self.ratios:
      if isinstance(r, bool) or not isinstance(r, float) or not 0.0 < r < 1.0:
        raise ValueError(f"--ratios entries must be fractions in (0, 1) (the share of the "
                         f"cache removed), got {r!r}")
    for g in self.regimes:
      if g not in REGIMES:
        raise ValueError(f"--regimes entries must be in {REGIMES}, got {g!r}")
    for name, v, lo in (("n_examples", self.n_examples, 1), ("chunk", self.chunk, 0),
                        ("group", self.group, 1)):
      if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"--{name} must be an int >= {lo}, got {v!r}")
    for c in self.context_lens:
      if isinstance(c, bool) or not isinstance(c, int) or c < 64:
        raise ValueError(f"--context_lens entries must be ints >= 64, got {c!r}")
    for c, subset in self.tasks_at:
      if c not in self.context_lens or not set(subset) <= set(self.tasks):
        raise ValueError(f"--tasks_at: {c}:{'+'.join(subset)} needs a context length of "
                         f"--context_lens and tasks of --tasks")
    if self.max_new_tokens is not None and self.max_new_tokens < 1:
      raise ValueError(f"--max_new_tokens must be >= 1 (unset: RULER's), got "
                       f"{self.max_new_tokens!r}")
    if self.haystack is not None and not os.path.isfile(self.haystack):
      raise ValueError(f"--haystack: no file {self.haystack!r}")
    model_loading.check_dtype(self.dtype)
    return self

  @property
  def all_designs(self) -> tuple:
    """The full cache first, then the other designs in order."""
    return (design_defaults.FULL,) + tuple(d for d in self.designs
                                           if d != design_defaults.FULL)

  def tasks_for(self, context_len: int) -> tuple:
    return dict(self.tasks_at).get(context_len, self.tasks)

  def ratios_for(self, design: str) -> tuple:
    return (FULL_RATIO,) if design == design_defaults.FULL else self.ratios

  def units(self) -> list[tuple]:
    """(context_len, task, regime, first example, design): the designs with an observation
    window first, those of one window consecutive, then the rest and the full cache, which
    reuse a prefill made before them (:func:`stats_key`)."""
    keys = {d: stats_key(design_of(d, self)[0]) for d in self.all_designs[1:]}
    order = list(dict.fromkeys(k for k in keys.values() if k is not None)) + [None]
    designs = sorted(keys, key=lambda d: order.index(keys[d])) + [design_defaults.FULL]
    return [(c, t, g, s, d) for c in self.context_lens for t in self.tasks_for(c)
            for g in self.regimes for s in range(0, self.n_examples, self.group)
            for d in designs]

  def haystack_text(self) -> str:
    with open(self.haystack or ruler.DEFAULT_HAYSTACK, encoding="utf-8") as f:
      return f.read()


def stats_key(design) -> Optional[tuple]:
  """The prefill a design needs: its observation window's fold and length, or None (the
  full cache and designs without a window read no ``obs``: any prefill serves)."""
  if design is None or design.observation_window == 0:
    return None
  return (design.fold, design.observation_window)


def is_randomized(name: str) -> bool:
  return variants.is_randomized(name)


def design_of(name: str, plan: Plan):
  """(design, allocation) of the variant ``name`` ((None, None) for the full cache)."""
  if name == design_defaults.FULL:
    return None, None
  return variants.design_and_allocation(name, plan.n_sink, plan.window, "--designs")


def token_budgets(plan: Plan, design, allocation, ratios, head_dim: int,
                  dtype=jnp.float32) -> list[float]:
  """The token budget of each ratio: ``1 - ratio`` (kvpress's convention), or with
  ``plan.equal_memory`` the token fraction whose kept key, value and metadata
  bytes are ``1 - ratio`` of the full cache's key and value bytes, keys and values
  in ``dtype`` (the caches'; ``certkv_jax.kv.memory.token_fraction``)."""
  if design is None or not plan.equal_memory:
    return [1.0 - r for r in ratios]
  return [memory.token_fraction(1.0 - r, design, head_dim, dtype=dtype, allocation=allocation)
          for r in ratios]


@functools.partial(jax.jit, static_argnames=("config", "design", "capacity"))
def prefill(params, tokens, mask, *, config, design, capacity: int):
  """The prompt through empty caches of ``capacity`` slots, ``design``'s statistics
  folded: ``(last logits [batch, vocab], caches)``."""
  caches = init_caches(config, tokens.shape[0], capacity, precision.cache_dtype(config))
  logits, caches, _, _ = forward_chunk(
      params, config, tokens, mask, caches,
      settings=layer_lib.Settings(design=design, certificate=False))
  return batching.last_logits(logits, mask), caches


@functools.partial(jax.jit, static_argnames=("config", "gen"))
def answer(params, carry: decode.DecodeCarry, first_logits, question, question_mask, *, config,
           gen: decode.GenerationConfig) -> decode.Generation:
  """Prefills ``question`` (None: the prompt held it) on the evicted caches of ``carry``
  (caches, shadow, no design state, key) and decodes greedily
  (``models.decode.decode_from``; ``gen.design`` None: decoding evicts nothing)."""
  if question is not None:
    logits, caches, _, shadow = forward_chunk(params, config, question, question_mask, carry.caches,
                                              settings=layer_lib.Settings(certificate=False),
                                              shadow=carry.shadow)
    carry = carry._replace(caches=caches, shadow=shadow)
    first_logits = batching.last_logits(logits, question_mask)
  return decode.decode_from(params, carry, first_logits, config=config, gen=gen)


def _repeat(tree, n: int):
  """Every cache row (axis 1 of ``[n_layers, batch, ...]``) ``n`` times, in place order."""
  return jax.tree_util.tree_map(lambda a: jnp.repeat(a, n, axis=1), tree)


class _Batch:
  """One group of examples padded for a regime: prompt (or context and question), and
  ``prefills``, which maps :func:`stats_key` to a prefill of this batch, filled on demand
  (shared by the designs of the batch)."""

  def __init__(self, examples, regime: str, context_len: int, n_steps: int):
    self.regime, self.n_steps = regime, n_steps
    self.prefills = {}
    bound = context_len - n_steps  # RULER's sizing: prompt + n_steps <= context_len
    if regime == "query_aware":
      self.prompt = batching.pad_batch([e.context_ids + e.question_ids for e in examples],
                                         bound)
      self.question = (None, None)
      self.capacity = bound + n_steps
    else:
      self.prompt = batching.pad_batch([e.context_ids for e in examples], bound)
      longest = max(len(e.question_ids) for e in examples)
      self.question = batching.pad_batch([e.question_ids for e in examples],
                                           -(-longest // QUESTION_PAD) * QUESTION_PAD)
      self.capacity = bound + self.question[0].shape[1] + n_steps


def run_design(params, config, batch: _Batch, name: str, ratios, key, plan: Plan,
               stop_tokens: tuple = ()):
  """One unit: ``name`` at every ratio on the batch's examples (rows example-major).

  The prompt's prefill is the batch's (``batch.prefills``), made here if no design
  of the batch made it. Decoding stops once every row has emitted one of
  ``stop_tokens`` (``GenerationConfig.stop_tokens``; the answers are cut there
  anyway). Returns ``(Generation, kept fraction [rows], prefill seconds paid)``.
  """
  design, allocation = design_of(name, plan)
  n_rows = batch.prompt[0].shape[0] * len(ratios)
  randomized = design is not None and design.randomized and plan.coverage
  budgets = token_budgets(plan, design, allocation, ratios, config.head_dim,
                          precision.cache_dtype(config))
  budget = jnp.asarray(np.tile(budgets, batch.prompt[0].shape[0]), jnp.float32)
  key, sub = jax.random.split(key)
  gen = decode.GenerationConfig(n_steps=batch.n_steps, stop_tokens=tuple(stop_tokens))
  t0 = time.time()
  if plan.chunk and batch.regime == "streaming" and design is not None:
    out = decode.generate_streaming(
        params, *(tuple(_repeat_rows(x, len(ratios)) for x in pair)
                  for pair in (batch.prompt, batch.question)), key,
        config=config, gen=gen.replace(design=design, allocation=allocation, chunk=plan.chunk,
                                       evaluate=randomized),
        budget=budget)
    return out, np.full(n_rows, np.nan), 0.0
  prefills = batch.prefills
  want = stats_key(design)
  if want is None and prefills:
    want = next(iter(prefills))
  paid = 0.0
  if want not in prefills:
    prefills[want] = jax.block_until_ready(prefill(
        params, *batch.prompt, config=config, design=design, capacity=batch.capacity))
    paid = time.time() - t0
  logits, caches = prefills[want]
  caches, logits = _repeat(caches, len(ratios)), jnp.repeat(logits, len(ratios), axis=0)
  shadow = caches if randomized else None
  if design is not None:
    caches, _, _, shadow = eviction.evict_and_record(
        design, caches, shadow, sub, budget=budget,
        **allocation_args(params, config, allocation))
  kept = np.asarray(jnp.mean(jnp.sum(caches.valid, axis=-1) / caches.n_seen, axis=(0, 2)))
  q, q_mask = batch.question
  if q is not None:
    q, q_mask = _repeat_rows(q, len(ratios)), _repeat_rows(q_mask, len(ratios))
  out = answer(params, decode.DecodeCarry(caches, shadow, None, key), logits, q, q_mask,
               config=config, gen=gen)
  return out, kept, paid


def _repeat_rows(x, n: int):
  return jnp.repeat(x, n, axis=0)


def _used_steps(n_used: int, n_steps: int) -> int:
  """Decode steps whose output was read: step i produces token i + 1; the answer used
  ``n_used`` tokens (its stop token included)."""
  return max(0, min(n_used, n_steps) - 1)


def row_certificate(out, j: int, used: int) -> tuple[dict, Optional[dict]]:
  """Row ``j``'s certificate fields over its first ``used`` decode steps, and the
  per-call arrays kept for the report (None without calls)."""
  if used == 0:
    return {"n_calls": 0}, None
  var = np.asarray(out.var_hat[:used, :, j], np.float32)  # [steps, layers, heads]
  rng = np.asarray(out.range_hat[:used, :, j], np.float32)
  radius = np.asarray(certificate.radius_from_stats(var, rng, DELTA), np.float64)
  # V_hat smoothed over each head's last decode steps (method, section 5)
  smoothed = np.asarray(certificate.smoothed_radius(var, rng, DELTA, axis=0), np.float64)
  err = np.asarray(out.true_error[:used, :, j], np.float64)
  flat = lambda a: a.reshape(a.shape[0], -1)
  score = calibration.conformity_scores(err.ravel(), radius.ravel())
  fields = {"n_calls": int(err.size), "raw_coverage": float(np.mean(err <= radius)),
            "smoothed_coverage": float(np.mean(err <= smoothed)),
            "median_radius": float(np.median(radius)), "median_error": float(np.median(err)),
            "unseen_deletions": float(np.mean(np.isinf(score))),
            "radius_steps": [float(x) for x in np.median(flat(radius), axis=1)],
            "error_steps": [float(x) for x in np.median(flat(err), axis=1)]}
  pick = np.unique(np.linspace(0, used - 1, min(used, CALL_STEPS)).round().astype(int))
  return fields, {"error": err[pick].astype(np.float32), "radius": radius[pick].astype(np.float32)}


def run(params, config, tok, out_dir: str, plan: Plan, *, model: str,
        log: Callable[[str], None] = print) -> list[dict]:
  """Runs every unit of ``plan`` with missing rows; returns the rows on file."""
  plan = plan.check()
  os.makedirs(os.path.join(out_dir, "calls"), exist_ok=True)
  results = results_io.JsonlResults(os.path.join(out_dir, ROWS_FILE), KEY_FIELDS)
  stops = answer_text.stop_ids(tok)
  text = plan.haystack_text()
  examples = {}

  def examples_of(c, task):
    if (c, task) not in examples:
      examples[(c, task)] = ruler.make_examples(
          task, tok, plan.n_examples, c, plan.seed, haystack=text, use_chat=plan.use_chat,
          max_new_tokens=plan.max_new_tokens)
    return examples[(c, task)]

  def rows_of(unit):
    _, _, _, start, design = unit
    idx = range(start, min(start + plan.group, plan.n_examples))
    return [(e, r) for e in idx for r in plan.ratios_for(design)]

  def done(unit):
    c, task, regime, _, design = unit
    return all(results.has(context_len=c, task=task, regime=regime, design=design, ratio=r,
                           example=e, seed=plan.seed) for e, r in rows_of(unit))

  if config.dtype != plan.dtype:
    raise ValueError(f"--dtype={plan.dtype} but the model was loaded in {config.dtype}")
  rows_lib.check_rows(results, plan, model)
  settings = {field: value for field, value, *_ in rows_lib.row_settings(plan, model).values()}
  todo_all = plan.units()
  todo = [u for u in todo_all if not done(u)]
  part = [u for u in todo if any(results.has(context_len=u[0], task=u[1], regime=u[2],
                                             design=u[4], ratio=r, example=e, seed=plan.seed)
                                 for e, r in rows_of(u))]
  if part:  # a unit reruns whole: its rows on file would be written twice
    raise ValueError(f"--ratios / --n_examples / --group: {results.path} holds some of the "
                     f"rows of unit {part[0]} (another split of the work): rerun with the "
                     "earlier settings or write to another --out")
  progress = results_io.Progress(len(todo_all), len(todo_all) - len(todo))
  log(f"{len(todo)} of {len(todo_all)} units to run; rows in {results.path}")
  group_id = None
  for unit in results_io.limit_units(todo, plan.max_units, log):
    c, task, regime, start, name = unit
    if unit[:4] != group_id:  # a new batch of examples, with its own prefills
      group_id = unit[:4]
      exs = examples_of(c, task)[start:start + plan.group]
      n_steps = exs[0].meta["max_new_tokens"]
      batch = _Batch(exs, regime, c, n_steps)
    ratios = plan.ratios_for(name)
    budget_of = dict(zip(ratios, token_budgets(plan, *design_of(name, plan), ratios,
                                               config.head_dim, precision.cache_dtype(config))))
    unit_id = zlib.crc32("/".join(map(str, unit)).encode()) % 2**31
    key = jax.random.fold_in(jax.random.PRNGKey(plan.seed), unit_id)
    t0 = time.time()
    out, kept, paid = run_design(params, config, batch, name, ratios, key, plan,
                                 stop_tokens=stops)
    out = jax.device_get(out._replace(caches=None, design_state=None))  # rows need no caches
    seconds = time.time() - t0 - paid
    if np.any(out.n_dropped):
      raise ValueError(f"unit {unit}: {int(np.max(out.n_dropped))} tokens found no cache "
                       "slot (capacity too small); this is a bug")
    rows, calls = [], {}
    for j, (e, r) in enumerate(rows_of(unit)):
      ex = exs[e - start]
      ids, stopped, _ = answer_text.truncate_at_stop(np.asarray(out.tokens[j]), stops)
      pred = ruler.postprocess(answer_text.whole_text(tok, ids))
      row = dict(context_len=c, task=task, regime=regime, design=name, ratio=r, example=e,
                 seed=plan.seed, **settings, budget=budget_of[r],
                 randomized=is_randomized(name), prediction=pred, answers=list(ex.answers),
                 score=ex.grade(pred), stopped=bool(stopped), n_generated=int(len(ids)),
                 max_new_tokens=n_steps, n_prompt_tokens=ex.meta["n_prompt_tokens"],
                 n_context_tokens=ex.meta["n_context_tokens"],
                 kept=None if np.isnan(kept[j]) else float(kept[j]),
                 unit_seconds=round(seconds, 3), prefill_seconds=round(paid, 3),
                 unit_rows=len(rows_of(unit)))
      if row["randomized"] and out.true_error is not None:
        used = _used_steps(len(ids) + int(stopped), n_steps)
        fields, arrays = row_certificate(out, j, used)
        row.update(fields)
        if arrays is not None:
          calls.update({f"e{e}_r{r}_{k}": v for k, v in arrays.items()})
      rows.append(row)
    if calls:  # before the rows: a row on file always has its calls
      results_io.atomic_write(rows_lib.calls_path(out_dir, unit, plan.seed),
                              lambda f: np.savez_compressed(f, **calls), binary=True)
    results.add_many(rows)  # the unit's rows at once: a killed unit reruns whole
    mean = np.mean([row["score"] for row in rows])
    log(f"{progress.step()} {c} {task} {regime} ex {start}+ {name}: {len(rows)} rows in "
        f"{seconds:.1f}s" + (f" (+ prefill {paid:.1f}s)" if paid else "") +
        f", mean score {mean:.2f}")
  return results.rows
