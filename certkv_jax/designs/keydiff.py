"""KeyDiff (Park et al., 2025; kvpress's ``KeyDiffPress``): keep distinctive keys.

It reads the keys only, so it works with any attention and in streaming; this
file and one line in ``registry.py`` are the whole design.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from certkv_jax.designs import framework
from certkv_jax.kv.cache import KVCache


@dataclasses.dataclass(frozen=True)
class KeyDiff:
  """``-cos(k_i, mean_valid(k / ||k||))`` with torch's guards (eps 1e-12, 1e-8 on norms)."""

  reads: ClassVar[frozenset] = frozenset({"k"})

  def __call__(self, cache: KVCache):
    k = cache.k.astype(jnp.float32)
    norm = jnp.linalg.norm(k, axis=-1, keepdims=True)
    unit = jnp.where(cache.valid[:, None], k / jnp.maximum(norm, 1e-12), 0.0)
    anchor = jnp.sum(unit, axis=0) / jnp.maximum(jnp.sum(cache.valid), 1)
    cos = jnp.matmul(k / jnp.maximum(norm, 1e-8),
                     anchor / jnp.maximum(jnp.linalg.norm(anchor), 1e-8),
                     precision=jax.lax.Precision.HIGHEST)  # not TF32 on a GPU
    return -cos


def keydiff(budget, *, n_sink: int = 0, window: int = 0, value_aware: bool = False):
  """KeyDiff: sinks + recent window + the keys least similar to the mean key."""
  return framework.top_k(budget, KeyDiff(), n_sink=n_sink, window=window,
                       value_aware=value_aware, name="keydiff")
