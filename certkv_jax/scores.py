"""Per-slot importance scores: ``score(cache) -> [cap] float32``.

The protocol (kvpress's ``score``, as a static pytree): a score is a frozen
(hashable) dataclass with

* ``__call__(cache) -> [cap]`` float32, higher = more important, read only on
  valid slots;
* ``reads``: the frozenset of what it reads of the cache, from :data:`READS`.

Designs, statistics folding and sharded eviction ask ``reads`` instead of
knowing score types: a score reading ``"obs"`` needs an observation window, a
score reading only metadata and norms is evicted across devices without
gathering keys and values. A new score is one class (see ``keydiff.py``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar, Protocol

import jax.numpy as jnp

from certkv_jax import _checks
from certkv_jax.cache import KVCache

# What a score may read of a cache: the slot statistics folded from attention
# (``acc`` accumulated, ``last`` latest query, ``obs`` observation window),
# positions, key / value norms only, or whole keys / values.
READS = frozenset({"acc", "last", "obs", "pos", "k_norm", "v_norm", "k", "v"})


@dataclasses.dataclass(frozen=True)
class AccumulatedAttention:
  """H2O: attention mass the slot has received from all queries so far."""

  reads: ClassVar[frozenset] = frozenset({"acc"})

  def __call__(self, cache: KVCache):
    return cache.acc


@dataclasses.dataclass(frozen=True)
class CurrentAttention:
  """TOVA: attention of the latest query. With the question as the latest
  query this is the ``pi ∝ a`` score of method, section 6."""

  reads: ClassVar[frozenset] = frozenset({"last"})

  def __call__(self, cache: KVCache):
    return cache.last


@dataclasses.dataclass(frozen=True)
class WindowAttention:
  """SnapKV: attention mass from the observation-window queries, average-pooled
  over ``pool_size`` neighbouring kept positions (zero padding counted, as in
  SnapKV's ``avg_pool1d``)."""

  pool_size: int = 1
  reads: ClassVar[frozenset] = frozenset({"obs", "pos"})

  def __post_init__(self):
    _checks.check_positive_int("pool_size", self.pool_size)
    if self.pool_size % 2 == 0:
      raise ValueError(f"pool_size must be odd (centred window), got {self.pool_size}")

  def __call__(self, cache: KVCache):
    if self.pool_size == 1:
      return cache.obs
    order_key = jnp.where(cache.valid, cache.pos, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(order_key, stable=True)
    x = jnp.where(cache.valid, cache.obs, 0.0)[order]
    half = self.pool_size // 2
    x = jnp.pad(x, (half, half))
    kernel = jnp.ones((self.pool_size,), jnp.float32) / self.pool_size
    pooled = jnp.convolve(x, kernel, mode="valid")
    return jnp.zeros_like(pooled).at[order].set(pooled)


@dataclasses.dataclass(frozen=True)
class KeyNorm:
  """Knorm: ``-||k||`` (low-norm keys draw attention, so they are kept)."""

  reads: ClassVar[frozenset] = frozenset({"k_norm"})

  def __call__(self, cache: KVCache):
    return -jnp.linalg.norm(cache.k.astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True)
class Recency:
  """StreamingLLM's window as a score: later positions score higher."""

  reads: ClassVar[frozenset] = frozenset({"pos"})

  def __call__(self, cache: KVCache):
    return cache.pos.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Uniform:
  """Every token scores 1 (flat inclusion probabilities)."""

  reads: ClassVar[frozenset] = frozenset()

  def __call__(self, cache: KVCache):
    return jnp.ones(cache.pos.shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ValueAware:
  """A base score times ``||v_i||`` (value-aware eviction)."""

  base: Score

  @property
  def reads(self) -> frozenset:
    return reads_of(self.base) | {"v_norm"}

  def __call__(self, cache: KVCache):
    return self.base(cache) * jnp.linalg.norm(cache.v.astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True)
class Defensive:
  """A defensive mixture of a base score with the uniform score (method,
  section 6).

  On the valid slots (``n`` of them)::

      score_i = (1 - u) * base_i / sum_valid(base) + u / n,    u = uniform_share

  and 0 on free slots; the scores sum to 1 over the valid slots. A base whose
  sum over the valid slots is 0 (nothing observed yet) falls back to the
  uniform ``1 / n``; an empty cache gives all zeros. ``base`` must be
  non-negative (attention masses); a negative concrete base raises, and under
  ``jit`` a negative base is not repaired (the result is then meaningless).

  **What it buys for Assumption 2** (method, sections 3 and 6). Let ``T`` be
  the tail, ``m`` the expected kept tail count and ``pi`` the Eq. 2
  probabilities from this score. Because the scores sum to 1 over the valid
  slots, ``sum_T score <= 1``; so at ``c0 = m / sum_T score`` every tail token
  has ``c0 score_i >= m score_i >= m u / n``. When ``eps <= m u / n`` (true for
  the default ``eps = 1e-6``) the floor does not bind at ``c0``, the capped
  tokens only raise the Eq. 2 multiplier above ``c0``, hence

      pi_i >= min(1, m ((1 - u) bbar_i + u / n)) >= min(1, m u / n),

  with ``bbar_i = base_i / sum_valid(base)``. For ANY query with attention
  probabilities ``p_i = a_i / sum_C a`` (over the context ``C`` at eviction,
  ``|C| = n``), the ratio ``R = m max_{T, pi<1} a_i / (pi_i sum_C a)`` obeys

      R <= max_{i in T} p_i / ((1 - u) bbar_i + u / n)
        <= min( max_T p_i / ((1 - u) bbar_i),   n max_T p_i / u ).

  The second form holds whatever the query: the floor's ``m / eps`` becomes
  ``n max_T p_i / u <= n / u``. That is still not a constant ``B`` (a query
  that puts all its attention on one tail token still gives ``R ~ n / u``);
  it is ``O(1 / u)`` only when the query spreads its tail attention, with
  ``max_T p_i = O(1 / n)``. The first form is the score-matching term: a query
  whose attention is at most ``K`` times the base share (``p_i <= K bbar_i``)
  gets ``R <= K / (1 - u)``. (``m`` in ``R`` counted over ``pi < 1`` tokens, as
  ``diagnostics.assumption2_ratio`` does, is at most the design's ``m``, so the
  bound stands. Over several eviction rounds ``pi`` is the product of the
  rounds' probabilities and the floors multiply.)

  Attributes:
    base: a non-negative score (e.g. ``AccumulatedAttention()``).
    uniform_share: ``u`` in [0, 1]; 0 is the normalised base, 1 is uniform.
  """

  base: Score
  uniform_share: float

  def __post_init__(self):
    if not callable(self.base):
      raise TypeError(f"base must be a score (callable on a KVCache), got {self.base!r}")
    u = self.uniform_share
    if (isinstance(u, bool) or not isinstance(u, numbers.Real) or not math.isfinite(u)
        or not 0.0 <= u <= 1.0):
      raise ValueError(f"uniform_share must be a float in [0, 1], got {u!r}")
    object.__setattr__(self, "uniform_share", float(u))

  @property
  def reads(self) -> frozenset:
    return reads_of(self.base)

  def __call__(self, cache: KVCache):
    valid = cache.valid
    b = jnp.where(valid, jnp.asarray(self.base(cache), jnp.float32), 0.0)
    b_conc = _checks.concrete_array(b)
    if b_conc is not None and (b_conc < 0).any():
      raise ValueError(f"Defensive needs a non-negative base score; {self.base} gave "
                       f"min {b_conc.min()} on the valid slots")
    n = jnp.sum(valid).astype(jnp.float32)
    total = jnp.sum(b)
    uniform = jnp.where(valid, 1.0 / jnp.maximum(n, 1.0), 0.0)
    normalized = jnp.where(total > 0, b / jnp.where(total > 0, total, 1.0), uniform)
    u = self.uniform_share
    return ((1.0 - u) * normalized + u * uniform).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Blend:
  """A weighted sum of scores, each first normalised to sum 1 over the valid
  slots (a part that is 0 everywhere contributes 0).

  Normalising makes parts of different scales comparable: accumulated
  attention sums to the number of queries folded so far, window attention to
  the window's size. ``Blend((AccumulatedAttention(), WindowAttention(5)),
  (0.5, 0.5))`` ranks a token high when either the history (H2O) or the
  latest queries (SnapKV) attend to it, which :func:`designs.priority_blend`
  samples from.

  Attributes:
    parts: non-negative scores, at least one.
    weights: one non-negative weight per part, summing to a positive number.
  """

  parts: tuple
  weights: tuple

  def __post_init__(self):
    parts, weights = tuple(self.parts), tuple(self.weights)
    if not parts or not all(callable(p) for p in parts):
      raise TypeError(f"parts must be a non-empty tuple of scores, got {self.parts!r}")
    if len(weights) != len(parts) or not all(
        isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
        for w in weights) or sum(weights) <= 0:
      raise ValueError(f"weights must be {len(parts)} finite numbers >= 0 with a positive "
                       f"sum (one per part), got {self.weights!r}")
    object.__setattr__(self, "parts", parts)
    object.__setattr__(self, "weights", tuple(float(w) for w in weights))

  @property
  def reads(self) -> frozenset:
    return frozenset().union(*(reads_of(p) for p in self.parts))

  def __call__(self, cache: KVCache):
    valid = cache.valid
    out = jnp.zeros(valid.shape, jnp.float32)
    for part, w in zip(self.parts, self.weights):
      x = jnp.where(valid, jnp.asarray(part(cache), jnp.float32), 0.0)
      total = jnp.sum(x)
      out = out + w * jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), 0.0)
    return out


@dataclasses.dataclass(frozen=True)
class TailShifted:
  """``score`` minus its minimum over the candidates where that minimum is
  negative (0 off them): non-negative weights that rank as ``score`` does, for
  sampling by a score that may be negative (Knorm's ``-||k||``); a
  non-negative score is left as it is. What a certified twin samples by
  (:func:`certkv_jax.designs.certified`)."""

  score: object

  @property
  def reads(self) -> frozenset:
    return reads_of(self.score)

  def on(self, cache: KVCache, mask):
    on = getattr(self.score, "on", None)
    x = jnp.asarray(on(cache, mask) if on is not None else self.score(cache), jnp.float32)
    low = jnp.min(jnp.where(mask, x, jnp.inf))
    return jnp.where(mask, x - jnp.where(jnp.isfinite(low), jnp.minimum(low, 0.0), 0.0), 0.0)

  def __call__(self, cache: KVCache):
    return self.on(cache, cache.valid)


@dataclasses.dataclass(frozen=True)
class FocusBlend:
  """:class:`Blend` of history and window attention whose window weight rises
  as the window's attention over the candidates concentrates.

  Each part is normalised over the candidate slots (``on(cache, mask)``; the
  tail when a sampled tail scores with it). The window's concentration is its
  effective share ``1 / (n * sum b_i^2)`` over the ``n`` candidates (1: flat,
  1/n: one token). A question points at few tokens (share near 0.05 on RULER
  prompts), a window of running text spreads wide (near 0.2), and the
  history's many queries estimate later attention better than 16 diffuse
  ones. The weight is ``diffuse_weight`` at a share of ``diffuse`` or more,
  ``focused_weight`` at ``focused`` or less, linear between (method,
  section 3, "Focus-weighted blend").

  Attributes:
    history: the history score (H2O's accumulated attention).
    window: the window score (SnapKV's pooled window attention).
    focused, diffuse: effective shares, 0 <= focused < diffuse <= 1.
    focused_weight, diffuse_weight: window weights in [0, 1].
  """

  history: object = AccumulatedAttention()
  window: object = WindowAttention(5)
  focused: float = 0.05
  diffuse: float = 0.2
  focused_weight: float = 1.0
  diffuse_weight: float = 0.5

  def __post_init__(self):
    for name in ("focused", "diffuse", "focused_weight", "diffuse_weight"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    if not self.focused < self.diffuse:
      raise ValueError(f"focused must be below diffuse, got focused={self.focused!r}, "
                       f"diffuse={self.diffuse!r}")
    if not (callable(self.history) and callable(self.window)):
      raise TypeError(f"history and window must be scores, got {self.history!r}, "
                      f"{self.window!r}")

  @property
  def reads(self) -> frozenset:
    return reads_of(self.history) | reads_of(self.window)

  def effective_share(self, cache: KVCache, mask):
    """The window's effective share ``1 / (n sum b_i^2)`` over ``mask``'s ``n``
    slots (a scalar float32; 1 when flat, ``1/n`` on one token)."""
    b = _normalised(self.window(cache), mask)
    n = jnp.maximum(jnp.sum(mask).astype(jnp.float32), 1.0)
    return 1.0 / jnp.maximum(n * jnp.sum(b * b), 1e-30)

  def focus(self, cache: KVCache, mask):
    """How focused the window is on ``mask``'s slots: 0 at an effective share
    of ``diffuse`` or more, 1 at ``focused`` or less, linear between."""
    share = self.effective_share(cache, mask)
    return jnp.clip((self.diffuse - share) / (self.diffuse - self.focused), 0.0, 1.0)

  def window_weight(self, cache: KVCache, mask):
    """The window weight on ``mask``'s slots (a scalar float32)."""
    t = self.focus(cache, mask)
    return self.diffuse_weight + t * (self.focused_weight - self.diffuse_weight)

  def on(self, cache: KVCache, mask):
    """The blended score, each part normalised over ``mask`` (0 off it)."""
    lam = self.window_weight(cache, mask)
    return ((1.0 - lam) * _normalised(self.history(cache), mask)
            + lam * _normalised(self.window(cache), mask))

  def __call__(self, cache: KVCache):
    return self.on(cache, cache.valid)


def _normalised(x, mask):
  x = jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0)
  total = jnp.sum(x)
  return jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), 0.0)


class Score(Protocol):
  """What a design scores tokens with (see the module docstring)."""

  reads: frozenset

  def __call__(self, cache: KVCache):
    ...


def reads_of(score) -> frozenset:
  """What ``score`` reads (its ``reads``), checked against :data:`READS`.

  Raises:
    TypeError naming the score when it does not declare ``reads``.
  """
  reads = getattr(score, "reads", None)
  if not isinstance(reads, (set, frozenset)) or not reads <= READS:
    raise TypeError(f"score {score!r} must declare `reads`, a subset of {sorted(READS)} "
                    f"(what it reads of the cache), got {reads!r}")
  return frozenset(reads)


def reads_observation(score) -> bool:
  """Whether ``score`` reads the observation-window statistic ``obs``: a design
  scoring with it needs an observation window."""
  return "obs" in reads_of(score)
