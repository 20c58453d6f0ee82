"""Per-slot importance scores: ``score(cache) -> [cap] float32``, higher = more important.

A score is a frozen (hashable) dataclass, kvpress's ``score`` as a static
pytree, that declares ``reads`` (from :data:`READS`): designs and sharded
eviction ask it instead of knowing score types (method, section 9, "The score
protocol"). A new score is one class (see ``keydiff.py``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar, Protocol

import jax.numpy as jnp

from certkv_jax import _validate
from certkv_jax.kv.cache import KVCache

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
  """TOVA: attention of the latest query (``pi ∝ a`` of method, section 6, for the question)."""

  reads: ClassVar[frozenset] = frozenset({"last"})

  def __call__(self, cache: KVCache):
    return cache.last


@dataclasses.dataclass(frozen=True)
class WindowAttention:
  """SnapKV: observation-window attention mass, average-pooled over ``pool_size`` kept positions.

  Zero padding is counted, as in SnapKV's ``avg_pool1d``.
  """

  pool_size: int = 1
  reads: ClassVar[frozenset] = frozenset({"obs", "pos"})

  def __post_init__(self):
    _validate.check_positive_int("pool_size", self.pool_size)
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
  """A defensive mixture of a base score with the uniform score (method, section 6,
  "A defensive mixture").

  ``score_i = (1 - u) base_i / sum_valid(base) + u / n`` on the ``n`` valid
  slots (``u = uniform_share`` in [0, 1]), 0 on free ones; a base summing to 0
  gives ``1 / n``. ``base`` must be non-negative (a concrete negative one raises).
  With ``m`` the expected kept tail count, every tail token gets
  ``pi_i >= min(1, m u / n)``, so any query's Assumption-2 ratio obeys
  ``R <= min(max_T p_i / ((1 - u) bbar_i), n max_T p_i / u)`` (``bbar`` the
  normalised base): ``O(1 / u)`` only when the query spreads its tail attention.
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
    b_conc = _validate.concrete_array(b)
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
  """A weighted sum of scores, each first normalised to sum 1 over the valid slots.

  Normalising makes history (H2O) and window (SnapKV) attention comparable
  (method, section 3, "Blended weights"). ``parts`` are non-negative scores, at
  least one; ``weights`` one non-negative weight per part, with a positive sum.
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
  """``score`` shifted to be non-negative on the candidates, ranking as ``score`` does.

  The weights a certified twin samples by (:func:`certkv_jax.designs.certified`).
  """

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
  """:class:`Blend` of history and window whose window weight rises as the window focuses.

  Parts are normalised over the candidate slots (``on(cache, mask)``). The
  weight is ``diffuse_weight`` at an effective share of ``diffuse`` or more,
  ``focused_weight`` at ``focused`` or less, linear between (method, section 3,
  "Focus-weighted blend"); ``0 <= focused < diffuse <= 1``, weights in [0, 1].
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
    """Scalar ``1 / (n sum b_i^2)`` of the window over ``mask``'s ``n`` slots (1 when flat)."""
    b = _normalised(self.window(cache), mask)
    n = jnp.maximum(jnp.sum(mask).astype(jnp.float32), 1.0)
    return 1.0 / jnp.maximum(n * jnp.sum(b * b), 1e-30)

  def focus(self, cache: KVCache, mask):
    """0 at an effective share of ``diffuse`` or more, 1 at ``focused`` or less, linear between."""
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
  """What ``score`` reads, checked against :data:`READS`; TypeError if it declares nothing."""
  reads = getattr(score, "reads", None)
  if not isinstance(reads, (set, frozenset)) or not reads <= READS:
    raise TypeError(f"score {score!r} must declare `reads`, a subset of {sorted(READS)} "
                    f"(what it reads of the cache), got {reads!r}")
  return frozenset(reads)


def reads_observation(score) -> bool:
  """Whether ``score`` reads ``obs`` (a design scoring with it needs an observation window)."""
  return "obs" in reads_of(score)
