r"""Designs compared at equal memory: streaming loss, coverage, kept bytes.

Every variant (a registered design with an allocation: uniform, ``adakv``,
``cert``, or PyramidKV's layer schedule) runs at the same memory: kept key,
value and per-slot metadata bytes equal to a fraction of the full cache's key
and value bytes (``certkv_jax.kv.memory.token_fraction``; a design that stores
more metadata per slot keeps fewer tokens). Each text segment streams through
the model in chunks, evicted after every chunk
(:func:`experiments.lib.streaming_loss.core.streaming_nll`), and each token's
NLL increase over the full cache on the same segment is measured; randomized
variants run in evaluation mode, so every attention call's true error sits
beside its radius.

Segments: one per source file, its first ``context_len`` tokens, in file
order; the first ``n_eval`` files are the evaluation segments, the next
``n_calib`` the calibration segments (conformal scales are fitted on those
only, per (layer, KV head), and applied to the evaluation segments: held-out
sources).

Rows (``rows.jsonl``, atomic, resumable): one per (context_len, variant,
memory, split, segment). Per-call conformity scores ``||e|| / r`` of the
randomized variants go to ``calls/*.npz`` (float16, :func:`stored_scores`; not committed: the
report reads them to fit and apply the calibration).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import time
import zlib
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import calibration
from certkv_jax.designs.parts import Budget
from certkv_jax.kv import memory
from experiments.lib import design_defaults
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib import variants
from experiments.lib.streaming_loss import core as streaming_loss_core

# The variants' names (``experiments.lib.variants``), re-exported.
ALLOCATIONS, ALIASES = variants.ALLOCATIONS, variants.ALIASES
parse_variant, variant_settings = variants.parse_variant, variants.variant_settings
design_and_allocation, make_variant = variants.design_and_allocation, variants.make_variant
is_randomized = variants.is_randomized

# The Vim user manual shipped with the package (experiments/data/vim: README.md gives its
# source, version and licence); this file is experiments/lib/equal_memory/experiment.py.
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "data", "vim")
DEFAULT_SOURCES = os.path.join(DATA_DIR, "usr_[0-9]*.txt")
ROWS_FILE = "rows.jsonl"
KEY_FIELDS = ("context_len", "variant", "memory", "split", "segment", "seed")
DEFAULT_VARIANTS = ("snapkv", "tova", "h2o", "pyramidkv", "snapkv+adakv", "tova+adakv",
                    "h2o+adakv", "pyramidkv+adakv", "priority_tail", "priority_tail+adakv",
                    "priority_tail+cert", "poisson_tail", "poisson_tail+adakv",
                    "poisson_tail+cert", "poisson_floor", "poisson_floor+adakv",
                    "poisson_floor+cert", "priority_blend", "priority_blend+adakv",
                    "priority_blend+cert:min_share=0.8", "priority_focus",
                    "priority_focus:diffuse_weight=0.3+cert:min_share=0.8",
                    "priority_focus:diffuse_weight=0.3:focus_share=0.95+cert:min_share=0.8",
                    "priority_focus:diffuse_weight=0.3:focus_share=0.95+cert:min_share=0.95")


def source_segments(tok, paths: Sequence[str], context_len: int, n_needed: int):
  """``(names, segments)``: the first ``context_len`` tokens of each file with enough
  tokens (after the tokenizer's own prefix: BOS where it adds one, none for SmolLM2's
  GGUF), in order, ``n_needed`` of them; shorter files are passed over.

  Raises:
    ValueError naming --sources when fewer files are long enough.
  """
  names, segs = [], []
  prefix = list(tok.encode(""))
  for p in paths:
    body = list(tok.encode(open(p, encoding="utf-8").read(), add_bos=False))
    if len(prefix) + len(body) >= context_len:
      names.append(os.path.basename(p))
      segs.append(prefix + body[:context_len - len(prefix)])
    if len(segs) == n_needed:
      return names, segs
  raise ValueError(f"--sources: {len(segs)} files have >= {context_len} tokens, "
                   f"{n_needed} needed (--n_eval + --n_calib)")


CACHES = ("seen", "fixed")


def fixed_budget(design, fraction: float, context_len: int, variant: str, mem: float):
  """``design`` keeping ``floor(fraction x context_len)`` tokens (``--cache=fixed``).

  Raises:
    ValueError naming --memories when that is fewer than the design's certainty set.
  """
  tokens = int(np.floor(fraction * context_len))
  if tokens < design.certain.size:
    raise ValueError(f"--memories: {mem} of {context_len} tokens keeps {tokens} tokens "
                     f"of {variant!r}, fewer than its sinks and window ({design.certain.size})")
  return dataclasses.replace(design, budget=Budget(tokens=tokens))


def stored_scores(score) -> np.ndarray:
  """Conformity scores as stored in ``calls/`` (float16), rounded up, so that a miss by
  less than float16's spacing (a score just above 1) stays a miss; finite scores
  above float16's largest, 65504 (a radius under 1/65504 of the error: missed at any
  scale), are stored as 65504, so inf still means radius 0 with a nonzero error."""
  score = np.asarray(score, np.float64)
  top = float(np.finfo(np.float16).max)
  stored = np.where(np.isinf(score), score, np.minimum(score, top)).astype(np.float16)
  with np.errstate(over="ignore"):  # nextafter(65504) is inf; not taken (stored < top)
    up = np.nextafter(stored, np.float16(np.inf))
  return np.where((stored < score) & (stored < top), up, stored)


def first_evicted(kept, chunk: int, n: int) -> int:
  """The first position whose call reads a cache an eviction took tokens from (``n`` if
  none): ``kept`` per chunk against the tokens seen. The calls before it hold every token,
  so their error is float rounding and their radius 0; coverage starts here."""
  seen = np.minimum(chunk * np.arange(1, len(kept) + 1), n)
  cut = np.flatnonzero(np.asarray(kept) < seen)
  return min(n, (int(cut[0]) + 1) * chunk) if cut.size else n


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run` runs (validated by :meth:`check`; errors name the flag)."""

  sources: tuple
  context_lens: tuple = plan_flags.setting(
      (1024,), "Tokens per segment (the tokenizer's prefix included).")
  variants: tuple = plan_flags.setting(
      DEFAULT_VARIANTS, "Design strings design[:setting=value...][+allocation[:setting="
      "value...]] (certkv_jax.designs.registry.parse, as generate and the leaderboard read them): "
      f"allocations {list(ALLOCATIONS)}; aliases {list(ALIASES)}. The full cache always runs.")
  memories: tuple = plan_flags.setting(
      (0.125, 0.25, 0.5), "Kept bytes as fractions of the full cache's key/value bytes.")
  n_eval: int = plan_flags.setting(16, "Evaluation segments (the first files).")
  n_calib: int = plan_flags.setting(
      4, "Calibration segments (the next files), for the conformal scales only.")
  chunk: int = plan_flags.setting(64, "Tokens per streaming chunk (evict after each).")
  seed: int = plan_flags.setting(0, "Seed of the randomized designs.")
  n_sink: int = design_defaults.N_SINK
  window: int = design_defaults.WINDOW
  group: int = plan_flags.setting(
      8, "Segments per unit (one jitted call per memory x group).")
  max_units: Optional[int] = plan_flags.setting(
      None, "Stop after this many units (default: all); a rerun resumes.")
  coverage: bool = plan_flags.setting(
      True, "Run the randomized variants with their certificate in evaluation mode (true "
      "error beside every radius: coverage); without it only the streaming loss is measured "
      "(the same losses, much faster).")
  cache: str = plan_flags.setting(
      "seen", "seen: after each chunk keep the memory's share of the tokens seen so far (the "
      "cache starts tiny); fixed: a cache of the memory's share of --context_lens tokens, "
      "filled and then held at that size (the same peak memory).", choices=CACHES)

  def check(self) -> "Plan":
    if not self.sources:
      raise ValueError("--sources: no files")
    results_io.check_plan_lists(self, ("variants", "memories", "context_lens"))
    for v in self.variants:
      design_and_allocation(v, self.n_sink, self.window)
    for m in self.memories:
      if isinstance(m, bool) or not isinstance(m, float) or not 0.0 < m <= 1.0:
        raise ValueError(f"--memories entries must be fractions in (0, 1], got {m!r}")
    for name, v, lo in (("n_eval", self.n_eval, 2), ("n_calib", self.n_calib, 0),
                        ("chunk", self.chunk, 1), ("group", self.group, 1)):
      if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"--{name} must be an int >= {lo}, got {v!r}")
    for c in self.context_lens:
      if isinstance(c, bool) or not isinstance(c, int) or c <= self.chunk:
        raise ValueError(f"--context_lens entries must be ints > --chunk, got {c!r}")
    if self.cache not in CACHES:
      raise ValueError(f"--cache must be one of {CACHES}, got {self.cache!r}")
    return self


def units(plan: Plan, randomized: Callable[[str], bool]) -> list[tuple]:
  """(context_len, variant, split, first segment) units: the full cache first."""
  out = []
  for c in plan.context_lens:
    for v in ("full",) + tuple(plan.variants):
      # calibration rows: the randomized variants', and the full cache's beside them
      calib = plan.n_calib > 0 and (v == "full" or randomized(v))
      for split in ("eval", "calib") if calib else ("eval",):
        n = plan.n_eval if split == "eval" else plan.n_calib
        out += [(c, v, split, s) for s in range(0, n, plan.group)]
  return out


def sources_sha256(paths) -> str:
  """One sha256 over the source files' bytes, in order (the report's provenance)."""
  h = hashlib.sha256()
  for p in paths:
    h.update(open(p, "rb").read())
  return h.hexdigest()


def row_settings(plan: Plan, model: str) -> dict:
  """``{flag: (row field, value)}``: the run's settings every row records."""
  return dict(model=("model", model), chunk=("chunk", plan.chunk),
              n_sink=("n_sink", plan.n_sink), window=("window", plan.window),
              coverage=("with_coverage", plan.coverage),
              sources=("sources_sha256", sources_sha256(plan.sources)))


def check_rows(results: results_io.JsonlResults, plan: Plan, model: str) -> None:
  """Refuses rows on file made with other settings than ``plan``'s, on a resume and
  before a report."""
  other = {r.get("cache", "seen") for r in results.rows} - {plan.cache}
  if other:
    raise ValueError(f"--cache={plan.cache}, but {results.path} holds rows of --cache="
                     f"{other.pop()}: write to another --out")
  results_io.check_settings(results, row_settings(plan, model))


def check_segments(results: results_io.JsonlResults, plan: Plan, names: dict) -> None:
  """Refuses rows whose segment number reads another file than ``plan``'s: which file a
  calibration segment is depends on ``--n_eval`` (``names[context_len]``: the files in
  segment order, evaluation first)."""
  for r in results.rows:
    c, n = r["context_len"], plan.n_eval if r["split"] == "eval" else plan.n_calib
    if c not in names or "source" not in r or r["segment"] >= n:  # not in this plan
      continue
    i = r["segment"] + (0 if r["split"] == "eval" else plan.n_eval)
    want = names[c][i] if i < len(names[c]) else None
    if r["source"] != want:
      raise ValueError(
          f"{results.path}: {r['split']} segment {r['segment']} at {c} tokens was made from "
          f"{r['source']}, which is {want} under --n_eval={plan.n_eval} "
          f"--n_calib={plan.n_calib}: rerun with the run's own counts or write to another "
          "--out")


def run(params, config, tok, out_dir: str, plan: Plan, *, model: str,
        log: Callable[[str], None] = print) -> list[dict]:
  """Runs every unit of ``plan`` with missing rows; returns the rows on file."""
  plan = plan.check()
  os.makedirs(os.path.join(out_dir, "calls"), exist_ok=True)
  results = results_io.JsonlResults(os.path.join(out_dir, ROWS_FILE), KEY_FIELDS)
  todo_all = units(plan, is_randomized)
  segs = {c: source_segments(tok, plan.sources, c, plan.n_eval + plan.n_calib)
          for c in plan.context_lens}
  head_dim = config.head_dim
  full_slot = memory.slot_bytes(None, head_dim)

  def rows_of(unit):
    c, v, split, start = unit
    n = plan.n_eval if split == "eval" else plan.n_calib
    seg_ids = range(start, min(start + plan.group, n))
    mems = (1.0,) if v == "full" else plan.memories
    return [(m, s) for m in mems for s in seg_ids]

  def done(unit):
    c, v, split, _ = unit
    return all(results.has(context_len=c, variant=v, memory=m, split=split, segment=s,
                           seed=plan.seed) for m, s in rows_of(unit))

  check_rows(results, plan, model)  # a resume reads rows of these settings only
  check_segments(results, plan, {c: names for c, (names, _) in segs.items()})
  settings = row_settings(plan, model)
  todo = [u for u in todo_all if not done(u)]
  progress = results_io.Progress(len(todo_all), len(todo_all) - len(todo))
  log(f"{len(todo)} of {len(todo_all)} units to run; rows in {results.path}")
  for unit in results_io.limit_units(todo, plan.max_units, log):
    c, v, split, start = unit
    names, all_segs = segs[c]
    offset = 0 if split == "eval" else plan.n_eval
    batch = rows_of(unit)
    toks = jnp.asarray(np.asarray([all_segs[offset + s] for _, s in batch], np.int32))
    t0 = time.time()
    unit_id = zlib.crc32(f"{c}/{v}/{split}/{start}".encode()) % 2**31
    key = jax.random.fold_in(jax.random.PRNGKey(plan.seed), unit_id)
    tokens = [None] * len(batch)
    if v == "full":
      design, allocation, fractions = None, None, [1.0] * len(batch)
      calls = [(streaming_loss_core.StreamConfig(chunk=plan.chunk), None, toks, key)]
    else:
      made = {m: make_variant(v, head_dim, m, plan.n_sink, plan.window)
              for m in plan.memories}
      design, allocation = made[plan.memories[0]][:2]
      fractions = [made[m][2] for m, _ in batch]
      stream = lambda d: streaming_loss_core.StreamConfig(
          chunk=plan.chunk, design=d, allocation=allocation,
          evaluate=plan.coverage and is_randomized(v), certificate=plan.coverage)
      if plan.cache == "seen":  # one call: the budget a traced fraction per row
        calls = [(stream(design), jnp.asarray(fractions, jnp.float32), toks, key)]
      else:  # one call per memory: its token count is the design's budget
        calls = []
        for i, m in enumerate(plan.memories):
          at = np.asarray([j for j, (mm, _) in enumerate(batch) if mm == m])
          d = fixed_budget(made[m][0], made[m][2], c, v, m)
          for j in at:
            tokens[j] = d.budget.tokens
          calls.append((stream(d), None, toks[at], jax.random.fold_in(key, i)))
    res = [streaming_loss_core.streaming_nll(params, t, jnp.ones(t.shape, bool), k,
                                             config=config, stream=st, budget=b)
           for st, b, t, k in calls]
    res = jax.tree_util.tree_map(lambda *a: np.concatenate([np.asarray(x) for x in a]), *res)
    seconds = time.time() - t0
    slot = memory.slot_bytes(design, head_dim, allocation=allocation)
    full_rows = {r["segment"]: r for r in results.rows if r["variant"] == "full"
                 and r["context_len"] == c and r["split"] == split and r["seed"] == plan.seed}
    calls, rows = {}, []
    for j, (m, s) in enumerate(batch):
      summary = streaming_loss_core.row_summary(
          res.logprob[j], res.scored[j], res.radius[j], res.kept[j], res.n_dropped[j],
          plan.chunk, None if v == "full" else full_rows[s]["token_nll"])
      # time-averaged bytes held over the full cache's: after chunk k the cache holds
      # kept[k] of (k + 1) * chunk tokens seen (the last eviction serves no token)
      seen = plan.chunk * np.arange(1, len(res.kept[j]))
      held = float(np.sum(res.kept[j][:-1]) / np.sum(seen)) * slot / full_slot
      row = dict(context_len=c, variant=v, memory=m, split=split, segment=s, seed=plan.seed,
                 source=names[offset + s], **dict(settings.values()),
                 budget_fraction=fractions[j], slot_bytes=slot,
                 **({} if plan.cache == "seen" else dict(cache="fixed",
                                                         budget_tokens=tokens[j])),
                 held_memory=held,
                 randomized=is_randomized(v), unit_seconds=round(seconds, 2),
                 **{k: summary[k] for k in ("n_scored", "mean_nll", "delta_nll",
                                            "delta_nll_after_first_chunk", "n_dropped",
                                            "kept_per_chunk", "chunk_nll", "mean_radius")})
      if v == "full":
        row["token_nll"] = summary["token_nll"]
      if res.calls is not None:
        sc = res.scored[j] & (np.arange(c) >= first_evicted(res.kept[j], plan.chunk, c))
        e = res.calls.error[j][sc]  # [calls, layers, heads]
        r = res.calls.radius[j][sc]
        score = calibration.conformity_scores(e.ravel(), r.ravel()).reshape(e.shape)
        calls[f"m{m}_s{s}"] = stored_scores(score)
        w = res.calls.smoothed[j][sc]  # the smoothed radius (method, section 5)
        calls[f"w{m}_s{s}"] = stored_scores(calibration.conformity_scores(
            e.ravel(), w.ravel()).reshape(e.shape))
        row.update(coverage=float(np.mean(score <= 1.0)),
                   median_radius=float(np.median(r)), median_error=float(np.median(e)))
      rows.append(row)
    if calls:  # before the rows: a row on file always has its calls
      path = os.path.join(out_dir, "calls", f"{c}_{v}_{split}_{start}_seed{plan.seed}.npz")
      results_io.atomic_write(path, lambda f: np.savez_compressed(f, **calls), binary=True)
    results.add_many(rows)  # the unit's rows at once: a killed unit reruns whole
    nll = np.mean([row["mean_nll"] for row in rows])
    log(f"{progress.step()} {c} {v} {split} segs {start}+: {len(batch)} rows in "
        f"{seconds:.0f}s, mean NLL {nll:.3f}")
  return results.rows


def default_sources(pattern: str) -> tuple:
  """The files of a comma-separated list of globs: each glob sorted, the globs
  in the given order (tables of contents left out). Relative globs are read from
  the working directory.

  Raises:
    ValueError naming --sources when a glob matches no file or a file is listed twice.
  """
  paths = []
  for part in pattern.split(","):
    part = part.strip()
    found = [p for p in sorted(glob.glob(part)) if "toc" not in os.path.basename(p)]
    if not found:
      raise ValueError(f"--sources: {part!r} matches no file (tables of contents left out; "
                       f"default {DEFAULT_SOURCES!r})")
    paths += found
  twice = sorted({p for p in paths if paths.count(p) > 1})
  if twice:
    raise ValueError(f"--sources: files listed more than once: {twice}")
  return tuple(paths)
