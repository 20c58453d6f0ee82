"""Certificate-gated recomputation: :func:`gain_from_correct`, :func:`gating_curve`
(fraction of the oracle's recoverable gain captured at each recompute budget),
:func:`oracle_share` (against oracle gating at the same budget) and
:func:`gain_captured_ratio` (against random gating)."""

from __future__ import annotations

import math

import numpy as np

from experiments.lib.stats import validation


def gain_from_correct(full_correct, evicted_correct) -> np.ndarray:
  """``gain_i = correct_full_i - correct_evicted_i`` in {-1, 0, 1}: what recomputing example
  ``i`` with the full cache changes. -1 (evicted right, full wrong) is a loss."""
  full = validation.labels(full_correct, "full_correct")
  ev = validation.labels(evicted_correct, "evicted_correct")
  validation.same_length(full_correct=full, evicted_correct=ev)
  return full.astype(np.float64) - ev.astype(np.float64)


def _n_recompute(budget: float, n: int) -> int:
  return int(math.floor(budget * n + 1e-9))


def _check_budgets(budgets) -> np.ndarray:
  b = np.asarray(budgets, np.float64).ravel()
  if b.size == 0 or np.any(~(b >= 0)) or np.any(~(b <= 1)):
    raise ValueError(f"budgets must be non-empty, each in [0, 1], got {list(b)}")
  return b


def _topk_gain(gain: np.ndarray, score: np.ndarray, k: int) -> float:
  """Expected gain of recomputing the top-``k`` by score, ties broken uniformly at random."""
  if k == 0:
    return 0.0
  order = np.argsort(-score, kind="mergesort")
  threshold = score[order[k - 1]]
  above = score > threshold
  tied = score == threshold
  slots = k - int(above.sum())
  return float(gain[above].sum() + slots * gain[tied].mean())


def gating_curve(gain, score, budgets, *, seed: int = 0, n_draws: int = 0) -> np.ndarray:
  """Fraction of the oracle's recoverable gain captured at each recompute budget.

  A budget ``b`` in [0, 1] recomputes ``k = floor(b n)`` examples with the
  full cache. The oracle's recoverable gain is ``sum(max(gain, 0))`` (the
  gain of recomputing exactly the positive-gain examples); the result is
  ``captured / recoverable`` (NaN if nothing is recoverable).

  Args:
    gain: [n] per-example gain, e.g. :func:`gain_from_correct` (may be
      negative: recomputing such an example loses a correct answer).
    score: how the ``k`` examples are chosen:
      * an [n] array: the ``k`` highest scores (certificate radius, or
        confidence = negative mean log-probability, ...); ties at the cut are
        broken uniformly at random, in expectation (exact, deterministic);
      * ``"oracle"``: the best choice of at most ``k`` (the positive gains,
        largest first; it never recomputes a harmful example), reaching 1.0
        at ``b = (number of positive gains) / n``;
      * ``"random"``: ``k`` uniformly random examples: the exact expectation
        ``k/n * sum(gain)`` when ``n_draws == 0``, else the mean over
        ``n_draws`` seeded draws.
    budgets: recompute fractions in [0, 1].
    seed: seed of the random draws (``score="random"``, ``n_draws > 0``).
    n_draws: see ``"random"``.

  Returns:
    [len(budgets)] fractions of the recoverable gain.
  """
  g = validation.vector(gain, "gain")
  if not np.all(np.isfinite(g)):
    raise ValueError("gain must be finite")
  b = _check_budgets(budgets)
  n = len(g)
  if not isinstance(n_draws, int) or n_draws < 0:
    raise ValueError(f"n_draws must be an int >= 0, got {n_draws!r}")
  recoverable = float(np.maximum(g, 0.0).sum())
  ks = [_n_recompute(x, n) for x in b]
  if isinstance(score, str):
    if score == "oracle":
      pos = np.sort(g[g > 0])[::-1]
      captured = [float(pos[:k].sum()) for k in ks]
    elif score == "random":
      if n_draws == 0:
        captured = [k / n * float(g.sum()) for k in ks]
      else:
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(n) for _ in range(n_draws)]
        captured = [float(np.mean([g[p[:k]].sum() for p in perms])) for k in ks]
    else:
      raise ValueError(f"score must be an array, 'oracle' or 'random', got {score!r}")
  else:
    s = validation.vector(score, "score")
    validation.same_length(gain=g, score=s)
    if not np.all(np.isfinite(s)):
      raise ValueError("score must be finite")
    captured = [_topk_gain(g, s, k) for k in ks]
  if recoverable == 0:
    return np.full(len(b), np.nan)
  return np.asarray(captured) / recoverable


def gain_captured_ratio(gain, score, budgets) -> np.ndarray:
  """Gain captured by ``score`` gating over that of random gating (exact expectation) at
  each budget: the paper's "1.7-1.8x random". NaN where random captures <= 0 (a ratio to a
  non-positive gain is meaningless) or nothing is recoverable."""
  ours = gating_curve(gain, score, budgets)
  rand = gating_curve(gain, "random", budgets)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(rand > 0, ours / np.where(rand > 0, rand, 1.0), np.nan)


def oracle_share(gain, score, budget: float) -> float:
  """Gain captured by ``score`` gating over that of oracle gating at the same recompute
  ``budget``: the paper's "about 36% of what oracle gating recovers". NaN when the oracle
  captures nothing (no positive gain, or a budget of no example)."""
  ours, oracle = (float(gating_curve(gain, s, [budget])[0]) for s in (score, "oracle"))
  return ours / oracle if oracle > 0 else float("nan")
