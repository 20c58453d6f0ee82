"""A model's caches: one :class:`certkv_jax.KVCache` per (layer, batch row, KV head).

The per-head caches are stacked into one pytree whose leaves are
``[n_layers, batch, n_kv_heads, ...]``. The single-head cache functions of
``certkv_jax.cache`` are lifted over batch and KV heads with ``jax.vmap``
(:func:`over_heads`); layers are the leading axis that ``lax.scan`` (the
forward pass) or a third ``vmap`` (eviction) walks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import certkv_jax
from certkv_jax import cache as cache_lib
from certkv_jax import distributed
from certkv_jax.cache import KVCache
from models.config import LlamaConfig


def over_heads(fn):
  """``fn`` (written for one head's cache) over ``[batch, n_kv_heads]`` leading axes."""
  return jax.vmap(jax.vmap(fn))


def init_caches(config: LlamaConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
  """Empty caches, leaves ``[n_layers, batch, n_kv_heads, ...]``."""
  one = certkv_jax.init_cache(capacity, config.head_dim, dtype=dtype)
  lead = (config.n_layers, batch, config.n_kv_heads)
  return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, lead + x.shape), one)


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
