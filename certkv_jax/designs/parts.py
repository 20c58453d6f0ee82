"""The parts a design composes (method, section 3): the budget, the certainty set, tail rules.

:class:`CertaintySet` keeps tokens with probability 1; a tail rule (:class:`TopK`,
:class:`UniformTail`, :class:`PoissonTail`, :class:`PriorityTail`) chooses
among the rest for the remaining slots. :func:`certkv_jax.designs.compose`
puts them together under a budget.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Protocol, Union

import jax
import jax.numpy as jnp

from certkv_jax import _validate
from certkv_jax.designs import sampling
from certkv_jax.designs import scores
from certkv_jax.kv.cache import KVCache

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Budget:
  """Tokens kept after eviction: a count, or a fraction of the tokens seen."""

  tokens: Optional[int] = None
  fraction: Optional[float] = None

  def __post_init__(self):
    if (self.tokens is None) == (self.fraction is None):
      raise ValueError("budget needs exactly one of tokens or fraction")
    if self.tokens is not None:
      _validate.check_positive_int("budget", self.tokens)
    else:
      f = self.fraction
      if isinstance(f, bool) or not isinstance(f, float) or not (0.0 < f <= 1.0):
        hint = (f"; for {int(f)} tokens write the int {int(f)} or Budget(tokens={int(f)})"
                if isinstance(f, float) and f > 1.0 and f == int(f) else "")
        raise ValueError(f"budget as a fraction must be a float in (0, 1], got {f!r}{hint}")

  def target(self, cache: KVCache) -> Array:
    """int32 [] number of tokens to keep."""
    if self.tokens is not None:
      return jnp.asarray(self.tokens, jnp.int32)
    # floor(f * n) with a relative guard against float32 rounding (0.3 * 10).
    n = cache.n_seen.astype(jnp.float32)
    return jnp.floor(self.fraction * n * (1.0 + 1e-6)).astype(jnp.int32)


AMBIGUOUS_ONE = ("budget=1 (an int) would mean one token kept, while budget=1.0 (a float) "
                 "means everything: write budget=1.0 or Budget(fraction=1.0) to keep every "
                 "token, or Budget(tokens=1) if one token is really meant")


def as_budget(budget: Union[int, float, Budget]) -> Budget:
  """Reads a budget: an int >= 2 = tokens, a float in (0, 1] = fraction, or a :class:`Budget`.

  ValueError for the int 1 (it reads as "everything" but would mean one token;
  the message says how to write each) and for values out of range.
  """
  if isinstance(budget, Budget):
    return budget
  if isinstance(budget, bool):
    raise TypeError(f"budget must be an int token count or a float fraction, got {budget!r}")
  if isinstance(budget, int):
    if budget == 1:
      raise ValueError(AMBIGUOUS_ONE)
    return Budget(tokens=budget)
  if isinstance(budget, float):
    return Budget(fraction=budget)
  raise TypeError(f"budget must be an int token count or a float fraction in (0, 1], "
                  f"got {budget!r}")


@dataclasses.dataclass(frozen=True)
class CertaintySet:
  """Tokens kept with probability 1: sinks, recent window, heavy hitters.

  Attributes:
    n_sink: tokens at positions ``< n_sink`` (attention sinks).
    window: the ``window`` most recent positions (``>= n_seen - window``).
    heavy: the ``heavy`` highest ``heavy_score`` among the rest.
    heavy_score: score for the heavy hitters (default accumulated attention).
  """

  n_sink: int = 0
  window: int = 0
  heavy: int = 0
  heavy_score: scores.Score = scores.AccumulatedAttention()

  def __post_init__(self):
    for name in ("n_sink", "window", "heavy"):
      _validate.check_nonneg_int(name, getattr(self, name))

  @property
  def size(self) -> int:
    """Upper bound on the number of certain tokens."""
    return self.n_sink + self.window + self.heavy

  def __call__(self, cache: KVCache) -> Array:
    valid = cache.valid
    sink = valid & (cache.pos < self.n_sink)
    recent = valid & (cache.pos >= cache.n_seen - self.window)
    base = sink | recent
    if self.heavy == 0:
      return base
    s = rank_within(valid & ~base, self.heavy_score(cache))
    heavy = sampling.top_k_mask(s, self.heavy) & valid & ~base
    return base | heavy


def rank_within(members, score) -> Array:
  """``score`` on ``members``, ``-inf`` off them, for :func:`sampling.top_k_mask`: a member's
  NaN or ``-inf`` is raised to the lowest finite float, so every member outranks every
  non-member and a top-k of members keeps its count."""
  s = score.astype(jnp.float32)
  s = jnp.maximum(jnp.where(jnp.isnan(s), -jnp.inf, s), jnp.finfo(jnp.float32).min)
  return jnp.where(members, s, -jnp.inf)


class TailChoice(NamedTuple):
  keep: Array  # [cap] bool, kept tail tokens
  log_pi: Array  # [cap] float32, log inclusion probability applied as offset (0 = none)
  pi: Array  # [cap] float32, this round's inclusion probability of each tail token
  m: Array  # [] float32, expected number of kept tail tokens
  n_redraws: Array  # [] int32
  n_dropped: Array  # [] int32


class TailRule(Protocol):
  """Chooses tail tokens for the slots the certainty set leaves; ``randomized``: the
  choice is a draw, so the certificate certifies it."""

  randomized: bool

  def select(self, cache: KVCache, tail, slots, key) -> TailChoice:
    ...


def _tail_score(rule, cache, tail) -> Array:
  """A sampled tail rule's score on the tail (0 elsewhere), float32; where it is
  concrete, checked finite and non-negative (ValueError naming the rule)."""
  on = getattr(rule.score, "on", None)  # a score normalised over the candidates
  raw = on(cache, tail) if on is not None else rule.score(cache)
  s = jnp.where(tail, raw.astype(jnp.float32), 0.0)
  s_conc = _validate.concrete_array(s)
  if s_conc is not None:
    _validate.check_finite("score", s_conc)
    if (s_conc < 0).any():
      raise ValueError(f"{type(rule).__name__} needs a non-negative score; {rule.score} gave "
                       f"min {s_conc.min()} on the tail")
  return s


def _no_random(keep, pi, m):
  zero = jnp.zeros((), jnp.int32)
  return TailChoice(keep, jnp.zeros(keep.shape, jnp.float32), pi, m, zero, zero)


@dataclasses.dataclass(frozen=True)
class TopK:
  """Deterministic: keep the ``slots`` tail tokens with the highest score."""

  score: scores.Score = scores.AccumulatedAttention()
  randomized = False

  def select(self, cache, tail, slots, key) -> TailChoice:
    del key
    keep = tail & sampling.top_k_mask(rank_within(tail, self.score(cache)), slots)
    return _no_random(keep, keep.astype(jnp.float32), jnp.sum(keep).astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class UniformTail:
  """Ablation: a uniformly random ``slots``-subset of the tail, no offset."""

  randomized = True

  def select(self, cache, tail, slots, key) -> TailChoice:
    del cache
    prio = jnp.where(tail, jax.random.uniform(key, tail.shape), -jnp.inf)
    keep = tail & sampling.top_k_mask(prio, slots)
    n_tail = jnp.sum(tail)
    frac = jnp.minimum(slots, n_tail) / jnp.maximum(n_tail, 1)
    return _no_random(keep, jnp.where(tail, frac, 0.0).astype(jnp.float32),
                      jnp.sum(keep).astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class PoissonTail:
  """Poisson sampling of the tail with Hajek offsets (method, section 3).

  ``m`` is the largest expected count whose overflow probability of the free
  slots is <= ``overflow_prob``; an overflowing draw is redrawn up to
  ``max_redraws`` times.

  Attributes:
    score: non-negative importance score (``scores.CurrentAttention()``: ``pi ∝ a``).
    eps: probability floor in (0, 1].
    overflow_prob: per-draw overflow bound in (0, 1).
    max_redraws: redraws after an overflow (>= 0).
  """

  score: scores.Score = scores.AccumulatedAttention()
  eps: float = 1e-6
  overflow_prob: float = 1e-3
  max_redraws: int = 3
  randomized = True

  def __post_init__(self):
    sampling.check_eps(self.eps)
    if not (isinstance(self.overflow_prob, float) and 0.0 < self.overflow_prob < 1.0):
      raise ValueError(f"overflow_prob must be a float in (0, 1), got {self.overflow_prob!r}")
    _validate.check_nonneg_int("max_redraws", self.max_redraws)

  def select(self, cache, tail, slots, key) -> TailChoice:
    s_tail = _tail_score(self, cache, tail)
    n_tail = jnp.sum(tail).astype(jnp.float32)
    m = jnp.minimum(sampling.expected_tail_count(slots, self.overflow_prob), n_tail)
    m_pos = jnp.maximum(m, 1e-30)
    pi = sampling.solve_inclusion(s_tail, m_pos, self.eps, tail)
    pi = jnp.where(m > 0, pi, 0.0)
    draw = sampling.poisson_draw(key, pi, tail, slots, self.max_redraws)
    pi = sampling.reached(pi)  # the draw's own probability (its uniforms take 2^23 values)
    log_pi = jnp.where(draw.keep, jnp.log(jnp.where(draw.keep, pi, 1.0)), 0.0)
    return TailChoice(draw.keep, log_pi, pi, m, draw.n_redraws, draw.n_dropped)


@dataclasses.dataclass(frozen=True)
class PriorityTail:
  """Fixed-size randomized tail: priority sampling (method, section 3, "Fixed-size tail").

  The ``slots`` highest priorities ``w_i / u_i`` are kept, so every slot is
  used, with ``pi_i = min(1, w_i / tau)``; the offsets and variance estimator
  keep their Poisson form. ``heavy_share`` and ``focus_share`` keep a share of
  the slots by rank with certainty (section 3, "Deterministic share",
  "Focused share").

  Attributes:
    score: non-negative importance score (default accumulated attention).
    eps: relative floor of the weights in (0, 1].
    heavy_share: fraction of the slots filled by rank, in [0, 1).
    heavy_score: the ranking score (None: ``score``, or the window's score
      with ``focus_share``).
    focus_share: the share added at a focused window (``score`` a
      :class:`scores.FocusBlend`), in [0, 1) with ``heavy_share + focus_share < 1``.
  """

  score: scores.Score = scores.AccumulatedAttention()
  eps: float = 1e-6
  heavy_share: float = 0.0
  heavy_score: Optional[scores.Score] = None
  focus_share: float = 0.0
  randomized = True

  def __post_init__(self):
    sampling.check_eps(self.eps)
    for name in ("heavy_share", "focus_share"):
      h = getattr(self, name)
      if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0.0 <= h < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {h!r}")
    if self.heavy_share + self.focus_share >= 1.0:
      raise ValueError("heavy_share + focus_share must be below 1 (a slot left to sample), "
                       f"got {self.heavy_share!r} + {self.focus_share!r}")
    if self.focus_share and not hasattr(self.score, "focus"):
      raise ValueError(f"focus_share needs a score with a window (scores.FocusBlend), "
                       f"got {self.score!r}")

  def _share(self, cache, tail):
    """The share of the slots kept by rank (a float, or a traced scalar)."""
    if not self.focus_share:
      return self.heavy_share
    return self.heavy_share + self.focus_share * self.score.focus(cache, tail)

  def select(self, cache, tail, slots, key) -> TailChoice:
    s = _tail_score(self, cache, tail)
    sampled = tail
    top = jnp.zeros_like(tail)
    if self.heavy_share or self.focus_share:
      share = self._share(cache, tail)
      n_top = jnp.floor(share * jnp.asarray(slots, jnp.float32)).astype(jnp.int32)
      rank = self.heavy_score
      if rank is None and self.focus_share:
        rank = self.score.window
      h = s if rank is None else rank(cache).astype(jnp.float32)
      top = tail & sampling.top_k_mask(rank_within(tail, h), n_top)
      sampled = tail & ~top
      slots = slots - n_top
    draw = sampling.priority_draw(key, s, sampled, slots, self.eps)
    keep = draw.keep | top
    pi = jnp.where(top, 1.0, draw.pi)
    log_pi = jnp.where(draw.keep, jnp.log(jnp.where(draw.keep, draw.pi, 1.0)), 0.0)
    zero = jnp.zeros((), jnp.int32)
    m = jnp.sum(keep).astype(jnp.float32)
    return TailChoice(keep, log_pi, pi, m, zero, zero)
