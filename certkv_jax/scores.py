"""Per-slot importance scores: ``score(cache) -> [cap] float32``.

Each score is a frozen (hashable) dataclass, so designs that hold one are
static pytrees: passing a design through ``jit`` compiles once per distinct
configuration. Scores are read only on valid slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from certkv_jax import _checks
from certkv_jax.cache import KVCache


@dataclasses.dataclass(frozen=True)
class AccumulatedAttention:
  """H2O: attention mass the slot has received from all queries so far."""

  def __call__(self, cache: KVCache):
    return cache.acc


@dataclasses.dataclass(frozen=True)
class CurrentAttention:
  """TOVA: attention of the latest query. With the question as the latest
  query this is the ``pi ∝ a`` score of SPEC section 6."""

  def __call__(self, cache: KVCache):
    return cache.last


@dataclasses.dataclass(frozen=True)
class WindowAttention:
  """SnapKV: attention mass from the observation-window queries, average-pooled
  over ``pool_size`` neighbouring kept positions (zero padding counted, as in
  SnapKV's ``avg_pool1d``)."""

  pool_size: int = 1

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

  def __call__(self, cache: KVCache):
    return -jnp.linalg.norm(cache.k.astype(jnp.float32), axis=-1)


@dataclasses.dataclass(frozen=True)
class Recency:
  """StreamingLLM's window as a score: later positions score higher."""

  def __call__(self, cache: KVCache):
    return cache.pos.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Uniform:
  """Every token scores 1 (flat inclusion probabilities)."""

  def __call__(self, cache: KVCache):
    return jnp.ones(cache.pos.shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ValueAware:
  """A base score times ``||v_i||`` (value-aware eviction)."""

  base: object

  def __call__(self, cache: KVCache):
    return self.base(cache) * jnp.linalg.norm(cache.v.astype(jnp.float32), axis=-1)
