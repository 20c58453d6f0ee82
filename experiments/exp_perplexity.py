r"""Streaming language-model loss under eviction on long natural text.

A text file (``--text``, UTF-8) is tokenized once and cut into
``--num_examples`` consecutive, non-overlapping segments of ``--context_len``
tokens (each opened with the tokenizer's BOS when it adds one by default;
consecutive so that a larger ``--num_examples`` keeps the earlier segments,
and their rows, unchanged). Each segment streams through the model
``--chunk`` tokens at a time (:func:`streaming_nll`, one jitted ``lax.scan``
over chunks): every chunk is run with the kept cache (``models.decode.
forward_chunk``, certificate statistics on), each token's log-probability of
the NEXT token of the stream is scored, and then the design evicts down to its
budget (``models.decode.evict``) before the next chunk arrives. So the first
chunk never sees eviction, and every later token is predicted from a cache
that has been evicted after every earlier chunk: the streaming regime of SPEC
section 8 on natural text instead of a task.

Budgets are fractions of the tokens seen so far (``floor(b * n_seen)``, the
repo's convention), so the kept cache grows with the stream. 'full' is no
eviction (the whole segment in the cache) and is the reference: its pass
equals the one-shot forward pass (:func:`one_shot_logprob`, tested), and it
always runs first, so that every other row carries its NLL increase over
the full cache on the same segment.

Per-token certificate summary: the Bernstein radius of SPEC section 5 at
``delta = 0.05`` (``certkv_jax.certificate.radius_from_stats``) of each
attention call of the token's query, SUMMED over layers and query heads (the
per-step aggregate the suite uses: a bound on the summed attention-error
norms, by the triangle inequality and a union bound). It is 0 for the full
cache and for every design without Hajek offsets (deterministic designs,
``uniform_random``): they have no certificate (Theorem 1). A token's radius
is paired with its NLL increase over the full cache on the same segment: both
describe the forward pass of that token's query, which produces the
distribution of the next token. A Poisson design's radius is also 0 on a
call whose kept set holds no sampled tail token (``V_hat`` is computed from
the kept tokens only), e.g. while the budget does not exceed the certainty
set (``--n_sink`` sinks + ``--window`` recent tokens).

Designs run with the suite's certainty set (``--n_sink``, ``--window``). In
this streaming setting SnapKV's observation window is the last ``--window``
queries of each chunk, reset before every chunk (so each eviction ranks by
the window just before it, as SnapKV does at the end of a prompt); the other
designs' statistics (accumulated and latest attention) do not depend on it.

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
``summarize`` writes ``--out/perplexity.md``: by design x budget, the mean
delta NLL with a 95% bootstrap interval over segments, the perplexity ratio vs
full and the mean radius-vs-loss-increase correlation.

  python -m experiments.exp_perplexity --text=/usr/share/common-licenses/GPL-3 \
      --out=/tmp/ppl --num_examples=2 --context_len=256 --chunk=32 \
      --budgets=0.25,0.5 --designs=full,snapkv,poisson_tail
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from typing import Callable, NamedTuple, Optional, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import certificate
from experiments.lib import loaders
from experiments.lib import results_io
from experiments.lib import stats
from experiments.lib import suite
from models import decode
from models.llama import LlamaModel

FLAGS = flags.FLAGS
KEY_FIELDS = ("model", "text_sha256", "segment", "context_len", "chunk", "design", "budget",
              "run", "seed", "n_sink", "window")
ROWS_FILE = "perplexity_rows.jsonl"
SUMMARY_FILE = "perplexity.md"
DELTA = suite.PRIMARY_DELTA  # the certificate's miss probability (per call)
N_SINK = 4  # the suite's certainty-set settings (experiments.lib.suite.Settings)
WINDOW = 16


# ----------------------------------------------------------------------------- the jitted core


class StreamingNLL(NamedTuple):
  """Output of :func:`streaming_nll` (``n`` = the input's length)."""

  logprob: jax.Array  # [b, n] float32 log p(token i+1 | tokens <= i, kept cache); 0 unscored
  scored: jax.Array  # [b, n] bool: position i has a real next token (not the last, not pad)
  radius: jax.Array  # [b, n] float32 sum over layers, heads of the radius at delta; 0 unscored
  kept: jax.Array  # [b, n_chunks] float32 mean kept slots (layers, KV heads) after each chunk
  n_dropped: jax.Array  # [b] int32 tokens that found no free slot (should be 0)


def _check_chunk(chunk):
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")


@functools.partial(jax.jit, static_argnames=("config", "capacity", "chunk", "design",
                                             "observation_window", "delta"))
def _streaming_nll(params, tokens, mask, key, budget, *, config, capacity: int, chunk: int,
                   design, observation_window: int, delta: float) -> StreamingNLL:
  b, n = tokens.shape
  # Targets up front: position i predicts token i + 1; the last real token has none.
  targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
  scored = mask & jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
  n_chunks = -(-n // chunk)
  pad = ((0, 0), (0, n_chunks * chunk - n))
  as_chunks = lambda x: jnp.pad(x, pad).reshape(b, n_chunks, chunk).swapaxes(0, 1)
  xs = tuple(as_chunks(x) for x in (tokens, mask, targets, scored))
  with_cert = design is not None

  def step(carry, x):
    caches, key = carry
    toks, valid, tgt, sc = x
    if design is not None and observation_window:
      # SnapKV's statistic is the attention of the LAST observation_window queries
      # before this eviction (this chunk's), not of every earlier chunk's window.
      caches = caches._replace(obs=jnp.zeros_like(caches.obs))
    logits, caches, st, _ = decode.forward_chunk(
        params, config, toks, valid, caches, design=design,
        observation_window=observation_window, certificate=with_cert)
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    lp = jnp.where(sc, lp, 0.0)
    if with_cert:  # [layers, b, heads, t] -> [b, t]
      r = certificate.radius_from_stats(st.var_hat, st.range_hat, delta)
      r = jnp.where(sc, jnp.sum(r, axis=(0, 2)), 0.0)
    else:
      r = jnp.zeros(lp.shape, jnp.float32)
    if design is not None:
      key, sub = jax.random.split(key)
      caches, _ = decode.evict(design, caches, sub, budget=budget)
    kept = jnp.mean(jnp.sum(caches.valid, axis=-1).astype(jnp.float32), axis=(0, 2))  # [b]
    return (caches, key), (lp, r, kept)

  caches = decode.init_caches(config, b, capacity)
  (caches, _), (lp, r, kept) = jax.lax.scan(step, (caches, key), xs)
  unchunk = lambda a: a.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :n]
  n_dropped = jnp.sum(caches.n_dropped, axis=(0, 2)).astype(jnp.int32)
  return StreamingNLL(unchunk(lp), scored, unchunk(r), kept.T, n_dropped)


def streaming_nll(params, tokens, mask, key, *, config, capacity: int, chunk: int,
                  design=None, budget=None, observation_window: int = 0,
                  delta: float = DELTA) -> StreamingNLL:
  """Streams ``tokens`` through the model ``chunk`` tokens at a time, evicting after each.

  One jitted ``lax.scan`` over chunks. Each chunk runs through
  ``models.decode.forward_chunk`` with the caches so far (with
  ``certificate=True`` when there is a design), every real token's
  log-probability of the next real token is taken from its logits, and then
  ``design`` (if any) evicts every (layer, row, KV head) cache down to its
  budget with an independent PRNG key. Without a design nothing is evicted and
  the result equals the one-shot forward pass (:func:`one_shot_logprob`).

  Args:
    params: model parameters.
    tokens: [batch, n] int token ids, right-padded rows.
    mask: [batch, n] bool, True on real tokens.
    key: PRNG key of the randomized designs' draws.
    config: the model config (static).
    capacity: cache slots per (layer, row, KV head) (static): the kept tokens
      plus one chunk (see :func:`capacity_for`); without a design, the whole
      sequence. Tokens that find no slot are counted in ``n_dropped``.
    chunk: tokens per chunk (static, >= 1); the sequence is padded to a
      multiple of it (padding takes no slot and is not scored).
    design: a ``certkv_jax`` eviction design (static), or None.
    budget: optional fraction in (0, 1] of the tokens seen (a float, ``[]``
      or ``[batch]``: one budget per row), traced, so one compile serves
      every budget; replaces the design's budget. Needs a design.
    observation_window: with a design, the last this many queries of each
      chunk are SnapKV's observation window (its statistic is reset before
      each chunk, so it is the window before each eviction).
    delta: miss probability of the per-call radius (static).

  Returns:
    A :class:`StreamingNLL`.
  """
  _check_chunk(chunk)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  if tokens.ndim != 2 or mask.shape != tokens.shape or mask.dtype != jnp.bool_:
    raise ValueError(f"tokens must be [batch, n] with a bool mask of the same shape; got "
                     f"tokens {tokens.shape}, mask {mask.dtype} {mask.shape}")
  if budget is not None and design is None:
    raise ValueError("budget needs a design (without one nothing is evicted)")
  budget = decode.check_budget(budget, tokens.shape[0])
  if not isinstance(capacity, int) or capacity < chunk:
    raise ValueError(f"capacity must be an int >= chunk ({chunk}), got {capacity!r}")
  if design is None and capacity < tokens.shape[1]:
    raise ValueError(f"capacity ({capacity}) must hold the whole sequence "
                     f"({tokens.shape[1]} tokens) without a design")
  if not isinstance(observation_window, int) or observation_window < 0:
    raise ValueError(f"observation_window must be an int >= 0, got {observation_window!r}")
  if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 < delta < 1.0:
    raise ValueError(f"delta must be a float in (0, 1), got {delta!r}")
  return _streaming_nll(params, tokens, mask, key, budget, config=config, capacity=capacity,
                        chunk=chunk, design=design,
                        observation_window=observation_window if design is not None else 0,
                        delta=float(delta))


@functools.partial(jax.jit, static_argnames=("config",))
def one_shot_logprob(params, tokens, mask, *, config):
  """``[b, n]`` log p(token i+1) from one full forward pass (``LlamaModel.__call__``)
  over the whole sequence; 0 where position i has no real next token. The
  reference that the full-cache :func:`streaming_nll` must equal."""
  logits = LlamaModel(config).apply(params, tokens, mask)
  logp = jax.nn.log_softmax(logits, axis=-1)
  targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
  scored = mask & jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
  lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.where(scored, lp, 0.0)


def capacity_for(n: int, chunk: int, design_name: str, budgets: Sequence[float],
                 n_sink: int = N_SINK, window: int = WINDOW) -> int:
  """Cache slots that never overflow: after an eviction at most
  ``max(ceil(b n), n_sink + window)`` tokens are kept (a certainty set larger
  than the budget is kept whole), then one chunk is appended; never more than
  ``n``. 'full' keeps all ``n``."""
  if design_name == "full":
    return n
  kept = max(int(math.ceil(max(budgets) * n)), n_sink + window)
  return min(n, kept + chunk)


# ----------------------------------------------------------------------------- text


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


# ----------------------------------------------------------------------------- rows


def spearman(x, y) -> Optional[float]:
  """Spearman's rank correlation (Pearson on tie-averaged ranks); None when
  fewer than 3 values or either side is constant (undefined)."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
    return None
  rx = stats._average_ranks(x)  # pylint: disable=protected-access
  ry = stats._average_ranks(y)  # pylint: disable=protected-access
  return float(np.corrcoef(rx, ry)[0, 1])


def _mean_or_none(x) -> Optional[float]:
  return float(np.mean(x)) if np.size(x) else None


def row_summary(lp, scored, radius, kept, n_dropped, chunk: int, full_nll=None) -> dict:
  """Summary of one batch row: losses overall, after the first chunk, per chunk,
  and against the full cache's per-token NLL ``full_nll`` ([n], None for the
  full row itself)."""
  n = len(lp)
  nll = -np.asarray(lp, np.float64)
  sc = np.asarray(scored, bool)
  rad = np.asarray(radius, np.float64)
  pos = np.arange(n)
  late = sc & (pos >= chunk)  # tokens predicted from an evicted cache
  n_chunks = -(-n // chunk)
  in_chunk = [sc & (pos // chunk == k) for k in range(n_chunks)]
  out = dict(
      n_scored=int(sc.sum()), mean_nll=float(nll[sc].mean()),
      perplexity=float(np.exp(nll[sc].mean())),
      mean_nll_after_first_chunk=_mean_or_none(nll[late]),
      chunk_nll=[_mean_or_none(nll[m]) for m in in_chunk],
      chunk_radius=[_mean_or_none(rad[m]) for m in in_chunk],
      mean_radius=_mean_or_none(rad[late]),
      kept_per_chunk=[round(float(k), 3) for k in kept],
      n_dropped=int(n_dropped))
  if full_nll is None:
    out.update(delta_nll=0.0, delta_nll_after_first_chunk=0.0, spearman_radius_increase=None)
    out["token_nll"] = [round(float(v), 6) if s else None for v, s in zip(nll[:-1], sc[:-1])]
    return out
  full = np.asarray([np.nan if v is None else v for v in full_nll], np.float64)
  if len(full) != n - 1:
    raise ValueError(f"full_nll has {len(full)} tokens, expected {n - 1}")
  full = np.append(full, np.nan)
  inc = nll - full
  out.update(delta_nll=float(np.mean(inc[sc])),
             delta_nll_after_first_chunk=_mean_or_none(inc[late]),
             spearman_radius_increase=spearman(rad[late], inc[late]))
  return out


def _units(designs: Sequence[str], n_runs: int) -> list[tuple[str, int]]:
  """(design, run) units: 'full' first (the reference), one run per deterministic design."""
  units = [("full", 0)]
  for d in designs:
    if d != "full":
      units += [(d, r) for r in range(n_runs if suite.is_randomized(d) else 1)]
  return units


def check_args(*, designs, budgets, context_len, chunk, num_examples, n_runs, n_sink, window,
               max_units=None, max_batch=None):
  """Validates the run's arguments; errors name the flag."""
  for d in designs:
    if d not in suite.DESIGNS:
      raise ValueError(f"--designs: unknown design {d!r}; choose from {list(suite.DESIGNS)}")
  if not budgets:
    raise ValueError("--budgets: give at least one budget")
  for b in budgets:
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < float(b) <= 1.0:
      raise ValueError(f"--budgets entries must be fractions in (0, 1], got {b!r}")
  for name, v, lo in (("chunk", chunk, 1), ("context_len", context_len, 2),
                      ("num_examples", num_examples, 1), ("n_runs", n_runs, 1),
                      ("n_sink", n_sink, 0), ("window", window, 0)):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise ValueError(f"--{name} must be an int >= {lo}, got {v!r}")
  if chunk >= context_len:
    raise ValueError(f"--chunk ({chunk}) must be < --context_len ({context_len}): with one "
                     "chunk nothing is ever predicted from an evicted cache")
  if max_units is not None and (not isinstance(max_units, int) or max_units < 0):
    raise ValueError(f"--max_units must be None or an int >= 0, got {max_units!r}")
  if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
    raise ValueError(f"--max_batch must be None or an int >= 1, got {max_batch!r}")


def _run_unit(params, config, segs, design_name, row_budgets, key, *, chunk, n_sink, window,
              budgets, max_batch):
  """numpy arrays of :class:`StreamingNLL` for the batch rows; in groups of
  ``max_batch`` rows (the last padded by repeating a row: one shape, one compile)."""
  design = suite.make_design(design_name, max(budgets), n_sink, window)
  n = len(segs[0])
  capacity = capacity_for(n, chunk, design_name, budgets, n_sink, window)
  size = len(segs) if max_batch is None else min(max_batch, len(segs))
  outs = []
  for g, start in enumerate(range(0, len(segs), size)):
    idx = list(range(start, min(start + size, len(segs))))
    idx += [idx[0]] * (size - len(idx))
    toks = jnp.asarray(np.asarray([segs[i] for i in idx], np.int32))
    budget = None if design is None else jnp.asarray([row_budgets[i] for i in idx], jnp.float32)
    res = streaming_nll(params, toks, jnp.ones(toks.shape, bool), jax.random.fold_in(key, g),
                        config=config, capacity=capacity, chunk=chunk, design=design,
                        budget=budget, observation_window=window if design is not None else 0)
    res = jax.tree_util.tree_map(np.asarray, res)
    outs.append(jax.tree_util.tree_map(lambda a, m=min(size, len(segs) - start): a[:m], res))
  return jax.tree_util.tree_map(lambda *a: np.concatenate(a), *outs)


def run_perplexity(params, config, tok, text_path: str, out_dir: str, *, model: str,
                   designs: Sequence[str] = ("full", "snapkv", "poisson_tail"),
                   budgets: Sequence[float] = (0.125, 0.25, 0.5), context_len: int = 512,
                   chunk: int = 64, num_examples: int = 4, seed: int = 0, n_runs: int = 2,
                   n_sink: int = N_SINK, window: int = WINDOW,
                   max_units: Optional[int] = None, max_batch: Optional[int] = None,
                   log: Callable[[str], None] = print) -> list[dict]:
  """Runs every (design, run) unit with a missing row; returns this run's rows.

  Args:
    params, config, tok: the model (``experiments.lib.suite.load_model``).
    text_path: the UTF-8 text file (``experiments.lib.loaders.load_text``).
    out_dir: rows go to ``out_dir/perplexity_rows.jsonl``.
    model: the model name recorded in rows.
    designs: design names of ``experiments.lib.suite.DESIGNS``; 'full' (the
      reference) always runs, listed or not.
    budgets: fractions in (0, 1] of the tokens seen.
    context_len: tokens per segment (BOS included).
    chunk: tokens per streaming chunk (< context_len).
    num_examples: segments (consecutive, non-overlapping).
    seed: seed of the randomized designs' draws (run ``r`` uses
      ``fold_in(PRNGKey(seed), r)``).
    n_runs: independent runs of each randomized design.
    n_sink, window: the designs' certainty set (sinks, recent window; also
      SnapKV's observation window).
    max_units: stop after running this many units (None: all); a rerun resumes.
    max_batch: at most this many batch rows per call (None: a unit's whole
      batch, budgets x segments); the draws depend on the grouping.
    log: progress lines (with an ETA).

  Returns:
    The rows of these settings present in the file (a subset if stopped early).
  """
  designs, budgets = tuple(designs), tuple(float(b) for b in budgets)
  check_args(designs=designs, budgets=budgets, context_len=context_len, chunk=chunk,
             num_examples=num_examples, n_runs=n_runs, n_sink=n_sink, window=window,
             max_units=max_units, max_batch=max_batch)
  text = loaders.load_text(text_path)
  segs = make_segments(tok, text, num_examples, context_len, text_path)
  sha = text_sha256(text)
  results = results_io.JsonlResults(os.path.join(out_dir, ROWS_FILE), KEY_FIELDS)
  common = dict(model=model, text=os.path.basename(text_path), text_sha256=sha,
                context_len=context_len, chunk=chunk, seed=seed, n_sink=n_sink, window=window)
  key_of = lambda d, b, run, s: {k: v for k, v in dict(common, design=d, budget=b, run=run,
                                                       segment=s).items() if k in KEY_FIELDS}
  units = _units(designs, n_runs)
  unit_budgets = lambda d: (1.0,) if d == "full" else budgets

  def batch_of(unit):
    return [(b, s) for b in unit_budgets(unit[0]) for s in range(num_examples)]

  def missing(unit):
    d, run = unit
    return [(b, s) for b, s in batch_of(unit) if not results.has(**key_of(d, b, run, s))]

  def full_rows():
    return {r["segment"]: r for r in results.rows
            if r["design"] == "full" and all(r.get(k) == v for k, v in common.items()
                                             if k in KEY_FIELDS)}

  todo = [u for u in units if missing(u)]
  progress = results_io.Progress(len(units), len(units) - len(todo))
  log(f"{len(todo)} of {len(units)} units to run ({num_examples} segments of {context_len} "
      f"tokens from {os.path.basename(text_path)}); rows in {results.path}")
  for n_done, unit in enumerate(todo):
    if max_units is not None and n_done >= max_units:
      log(f"stopping after {max_units} units (--max_units); rerun to resume")
      break
    d, run = unit
    batch = batch_of(unit)
    t0 = time.time()
    res = _run_unit(params, config, [segs[s] for _, s in batch], d, [b for b, _ in batch],
                    jax.random.fold_in(jax.random.PRNGKey(seed), run), chunk=chunk,
                    n_sink=n_sink, window=window, budgets=unit_budgets(d), max_batch=max_batch)
    seconds = time.time() - t0
    full = full_rows()
    todo_rows = set(missing(unit))
    nlls = []
    for j, (b, s) in enumerate(batch):
      summary = row_summary(res.logprob[j], res.scored[j], res.radius[j], res.kept[j],
                            res.n_dropped[j], chunk,
                            None if d == "full" else full[s]["token_nll"])
      nlls.append(summary["mean_nll"])
      if (b, s) not in todo_rows:
        continue
      row = dict(common, segment=s, design=d, budget=b, run=run,
                 randomized=d != "full" and suite.is_randomized(d), delta=DELTA,
                 unit_seconds=round(seconds, 2), batch_size=len(batch), **summary)
      results.add(row)
    n_tok = len(batch) * context_len
    log(f"{progress.step()} {d}/run{run}: {len(batch)} rows in {seconds:.0f}s "
        f"({n_tok / max(seconds, 1e-9):.0f} tok/s, compile included), mean NLL "
        f"{np.mean(nlls):.3f}")
  return select(results.rows, model=model, text_sha256=sha, context_len=context_len,
                chunk=chunk, seed=seed, n_sink=n_sink, window=window, units=units,
                budgets=budgets, num_examples=num_examples)


def select(rows, *, model, text_sha256, context_len, chunk, seed, n_sink, window, units,
           budgets, num_examples) -> list[dict]:
  """The rows that belong to these settings."""
  want = set(units)
  fixed = dict(model=model, text_sha256=text_sha256, context_len=context_len, chunk=chunk,
               seed=seed, n_sink=n_sink, window=window)
  return [r for r in rows
          if all(r.get(k) == v for k, v in fixed.items()) and (r["design"], r["run"]) in want
          and r["segment"] < num_examples
          and (r["design"] == "full" or r["budget"] in budgets)]


def expected_row_count(designs, budgets, num_examples: int, n_runs: int) -> int:
  return sum((1 if d == "full" else len(budgets)) * num_examples
             for d, _ in _units(designs, n_runs))


# ----------------------------------------------------------------------------- summary


def _fmt(x, spec=".3f") -> str:
  return "-" if x is None or not math.isfinite(x) else format(x, spec)


def _ci(values, seed: int) -> Optional[stats.Interval]:
  v = np.asarray(values, np.float64)
  if v.size == 0:
    return None
  if v.size == 1:
    return stats.Interval(float(v[0]), float("nan"), float("nan"))
  return stats.bootstrap_ci(np.mean, v, n_boot=1000, seed=seed)


def summarize(rows: Sequence[dict], out_dir: Optional[str] = None, seed: int = 0) -> dict:
  """Design x budget table of the streaming loss; writes ``out_dir/perplexity.md``.

  Segments are the unit of the bootstrap: a randomized design's runs are
  averaged per segment first. ``delta NLL`` is against the full cache on the
  same segments; the perplexity ratio is ``exp(mean delta NLL)`` (every
  segment scores the same number of tokens); the correlation is the mean over
  rows of the per-row Spearman correlation (tokens after the first chunk)
  between the summed radius and the NLL increase.

  Returns:
    ``{"md": markdown, "table": [per design/budget dicts], "rows": n}``.
  """
  full = {r["segment"]: r for r in rows if r["design"] == "full"}
  cells = {}
  for r in rows:
    cells.setdefault((r["design"], r["budget"]), []).append(r)
  rank = lambda d: suite.DESIGNS.index(d) if d in suite.DESIGNS else len(suite.DESIGNS)
  order = sorted(cells, key=lambda k: (rank(k[0]), k[0], k[1]))  # full first
  table, body = [], []
  for d, b in order:
    rs = cells[(d, b)]
    by_seg = {}
    for r in rs:
      by_seg.setdefault(r["segment"], []).append(r)
    segs = sorted(by_seg)
    seg_mean = lambda f: np.asarray([np.mean([r[f] for r in by_seg[s]]) for s in segs])
    nll = seg_mean("mean_nll")
    paired = [s for s in segs if s in full]
    delta = np.asarray([np.mean([r["delta_nll"] for r in by_seg[s]]) for s in paired])
    late = np.asarray([np.mean([r["delta_nll_after_first_chunk"] for r in by_seg[s]])
                       for s in paired if all(r["delta_nll_after_first_chunk"] is not None
                                              for r in by_seg[s])])
    corr_seg = []
    for s in segs:
      c = [r["spearman_radius_increase"] for r in by_seg[s]
           if r.get("spearman_radius_increase") is not None]
      if c:
        corr_seg.append(float(np.mean(c)))
    ci = _ci(delta, seed)
    cci = _ci(corr_seg, seed)
    radius = [r["mean_radius"] for r in rs if r.get("mean_radius") is not None]
    entry = dict(design=d, budget=b, n_segments=len(segs), n_rows=len(rs),
                 mean_nll=float(nll.mean()), perplexity=float(np.exp(nll.mean())),
                 delta_nll=None if ci is None else list(ci),
                 delta_nll_after_first_chunk=_mean_or_none(late),
                 ppl_ratio=None if ci is None else float(np.exp(ci.estimate)),
                 spearman=None if cci is None else list(cci),
                 mean_radius=_mean_or_none(radius))
    table.append(entry)
    ci_txt = "-" if ci is None else (f"{ci.estimate:+.4f}" + (
        f" [{ci.lo:+.4f}, {ci.hi:+.4f}]" if math.isfinite(ci.lo) else ""))
    cc_txt = "-" if cci is None else (f"{cci.estimate:.3f}" + (
        f" [{cci.lo:.3f}, {cci.hi:.3f}]" if math.isfinite(cci.lo) else ""))
    body.append([d, f"{b:g}", f"{len(segs)} x {len(rs) // max(len(segs), 1)}",
                 _fmt(entry["mean_nll"]), _fmt(entry["perplexity"], ".2f"), ci_txt,
                 "-" if d == "full" else _fmt(entry["delta_nll_after_first_chunk"], "+.4f"),
                 _fmt(entry["ppl_ratio"], ".3f"), cc_txt, _fmt(entry["mean_radius"], ".3g")])
  first = rows[0] if rows else {}
  md = ["## Streaming loss under eviction", ""]
  if rows:
    md += [f"Text `{first['text']}` (sha256 {first['text_sha256'][:12]}), model "
           f"{first['model']}, segments of {first['context_len']} tokens streamed in chunks of "
           f"{first['chunk']}; budgets are fractions of the tokens seen. Delta NLL (nats/token) "
           "is against the full cache on the same segments, with a 95% bootstrap interval "
           "over segments; ppl ratio = exp(mean delta NLL). Spearman: per-token certificate "
           f"radius (delta {first.get('delta', DELTA)}, summed over layers and heads) vs "
           "per-token NLL increase, tokens after the first chunk, mean over rows ('-': "
           "radius 0 everywhere, no certificate).", ""]
  md += ["| design | budget | segments x runs | mean NLL | ppl | delta NLL vs full [95% CI] | "
         "delta NLL after chunk 1 | ppl ratio | Spearman(radius, NLL increase) | "
         "mean radius |", "|" + "---|" * 10]
  md += ["| " + " | ".join(row) + " |" for row in body]
  out = {"md": "\n".join(md), "table": table, "rows": len(rows)}
  if out_dir:
    results_io.atomic_write_text(os.path.join(out_dir, SUMMARY_FILE), out["md"] + "\n")
    results_io.atomic_write_text(
        os.path.join(out_dir, "perplexity.json"),
        json.dumps(results_io.json_safe({"table": table, "rows": len(rows)}), indent=1))
  return out


# ----------------------------------------------------------------------------- script


def define_flags(flag_values=FLAGS):
  """The script's flags (named and defaulted as ``experiments.lib.suite.define_common_flags``
  and ``experiments.lib.suite.Settings`` where they mean the same thing)."""
  fv = dict(flag_values=flag_values)
  flags.DEFINE_string("out", None, "Output directory (perplexity_rows.jsonl, perplexity.md).",
                      required=True, **fv)
  flags.DEFINE_string("text", None, "UTF-8 text file to stream.", required=True, **fv)
  flags.DEFINE_string("model", suite.DEFAULT_MODEL, "'smollm2' (SmolLM2-135M-Instruct from "
                      "its GGUF package) or a Hugging Face safetensors directory "
                      "(Llama/Mistral/Qwen2) holding tokenizer.json.", **fv)
  flags.DEFINE_integer("context_len", 512, "Tokens per segment (BOS included).", **fv)
  flags.DEFINE_integer("chunk", 64, "Tokens per streaming chunk; the design evicts after "
                       "each chunk.", **fv)
  flags.DEFINE_list("budgets", ["0.125", "0.25", "0.5"], "Budgets: fractions in (0, 1] of "
                    "the tokens seen.", **fv)
  flags.DEFINE_list("designs", ["full", "snapkv", "poisson_tail"], f"Designs, from "
                    f"{', '.join(suite.DESIGNS)} ('full' = no eviction, the reference; "
                    "always run).", **fv)
  flags.DEFINE_integer("num_examples", 4, "Non-overlapping segments of the tokenized text.",
                       **fv)
  flags.DEFINE_integer("seed", 0, "Seed of the randomized designs.", **fv)
  flags.DEFINE_integer("n_runs", 2, "Independent runs of each randomized design.", **fv)
  flags.DEFINE_integer("n_sink", N_SINK, "Sink tokens every design keeps.", **fv)
  flags.DEFINE_integer("window", WINDOW, "Recent tokens every design keeps (and SnapKV's "
                       "observation window).", **fv)
  flags.DEFINE_integer("max_units", -1, "Stop after this many units (batched calls) this run "
                       "(-1: all); a rerun resumes.", **fv)
  flags.DEFINE_integer("max_batch", 0, "At most this many rows per call (0: a unit's whole "
                       "batch, budgets x segments).", **fv)


def run_from_flags(fv=FLAGS, log: Callable[[str], None] = print) -> Optional[dict]:
  """The script on parsed flags: rows, then (when complete) the summary.

  Returns:
    :func:`summarize`'s dict, or None when ``--max_units`` stopped it early.
  """
  try:
    budgets = tuple(float(b) for b in fv.budgets)
  except ValueError as err:
    raise ValueError(f"--budgets must be numbers, got {fv.budgets}") from err
  max_units = None if fv.max_units < 0 else fv.max_units
  check_args(designs=fv.designs, budgets=budgets, context_len=fv.context_len, chunk=fv.chunk,
             num_examples=fv.num_examples, n_runs=fv.n_runs, n_sink=fv.n_sink,
             window=fv.window, max_units=max_units, max_batch=fv.max_batch or None)
  loaders.load_text(fv.text)  # a missing/empty --text fails before the model loads
  t0 = time.time()
  params, config, tok = suite.load_model(fv.model)
  rows = run_perplexity(params, config, tok, fv.text, fv.out, model=suite.model_name(fv.model),
                        designs=fv.designs, budgets=budgets, context_len=fv.context_len,
                        chunk=fv.chunk, num_examples=fv.num_examples, seed=fv.seed,
                        n_runs=fv.n_runs, n_sink=fv.n_sink, window=fv.window,
                        max_units=max_units, max_batch=fv.max_batch or None, log=log)
  want = expected_row_count(fv.designs, budgets, fv.num_examples, fv.n_runs)
  if len(rows) < want:
    log(f"{len(rows)} of {want} rows; rerun to finish (no summary yet)")
    return None
  s = summarize(rows, fv.out, fv.seed)
  log(s["md"])
  log(f"\nwall time {time.time() - t0:.0f}s (model load included)")
  return s


def main(argv):
  del argv
  run_from_flags(FLAGS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
