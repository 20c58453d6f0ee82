"""A model's caches: one :class:`certkv_jax.KVCache` per (layer, batch row, KV head).

The per-head caches are stacked into one pytree whose leaves are
``[n_layers, batch, n_kv_heads, ...]``. The single-head cache functions of
``certkv_jax.cache`` are lifted over batch and KV heads with ``jax.vmap``
(:func:`over_heads`); layers are the leading axis that the model's layer loop
or a third ``vmap`` (eviction) walks. Any model config with ``n_layers``,
``n_kv_heads`` and ``head_dim`` sizes them (:class:`CacheSpec` is the minimal one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import certkv_jax
from certkv_jax import cache as cache_lib
from certkv_jax import distributed
from certkv_jax.cache import KVCache


def over_heads(fn):
  """``fn`` (written for one head's cache) over ``[batch, n_kv_heads]`` leading axes."""
  return jax.vmap(jax.vmap(fn))


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """The sizes a model's caches need (any config with these fields will do)."""

  n_layers: int
  n_kv_heads: int
  head_dim: int


def init_caches(config, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
  """Empty caches, leaves ``[n_layers, batch, n_kv_heads, ...]``.

  ``config`` is any object with ``n_layers``, ``n_kv_heads`` and ``head_dim``
  (a :class:`CacheSpec`, ``models.LlamaConfig``, a user's own config).
  """
  one = certkv_jax.init_cache(capacity, config.head_dim, dtype=dtype)
  lead = (config.n_layers, batch, config.n_kv_heads)
  return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, lead + x.shape), one)


def abstract_caches(config, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
  """The shapes and dtypes of :func:`init_caches` without allocating them
  (``jax.ShapeDtypeStruct`` leaves), for sharding plans and memory sums."""
  return jax.eval_shape(lambda: init_caches(config, batch, capacity, dtype))


def append(cache: KVCache, k_new, v_new, new_valid) -> KVCache:
  """Appends a chunk's keys and values to one layer's caches.

  Traced under a mesh with the axes data, model and seq (``jax.set_mesh``),
  the caches are sequence-sharded and ``certkv_jax.distributed.append`` puts
  every token in the slot one device would; otherwise ``cache.append`` runs
  per (row, KV head).

  Args:
    cache: one layer's caches, leaves ``[batch, n_kv_heads, cap, ...]``.
    k_new: [batch, n_kv_heads, t, head_dim] keys.
    v_new: [batch, n_kv_heads, t, head_dim] values.
    new_valid: [batch, n_kv_heads, t] bool, False on padding (takes no slot).

  Returns:
    The caches with the new tokens.
  """
  if distributed.cache_mesh() is not None:
    return distributed.append(cache, k_new, v_new, new_valid)
  return over_heads(cache_lib.append)(cache, k_new, v_new, new_valid)


def layer(caches: KVCache, i) -> KVCache:
  """Layer ``i`` (int or traced) of stacked caches: leaves ``[batch, n_kv_heads, ...]``."""
  return jax.tree_util.tree_map(
      lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), caches)


def with_layer(caches: KVCache, i, cache: KVCache) -> KVCache:
  """Stacked caches with layer ``i`` replaced by ``cache`` (in place inside a loop)."""
  return jax.tree_util.tree_map(
      lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u.astype(a.dtype), i, axis=0),
      caches, cache)
