"""A model's caches: one :class:`certkv_jax.KVCache` per (layer, batch row, KV head).

Stacked, leaves ``[n_layers, batch, n_kv_heads, ...]``, or a tuple per layer
(:func:`unstack`); :func:`over_heads` lifts ``certkv_jax.kv.cache`` over the heads.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

import certkv_jax
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv.cache import KVCache
from certkv_jax.kv import distributed


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
  """Empty caches ``[n_layers, batch, n_kv_heads, ...]`` for a config such as :class:`CacheSpec`."""
  one = certkv_jax.init_cache(capacity, config.head_dim, dtype=dtype)
  lead = (config.n_layers, batch, config.n_kv_heads)
  return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, lead + x.shape), one)


def abstract_caches(config, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
  """:func:`init_caches`' ``jax.ShapeDtypeStruct`` leaves, allocating nothing."""
  return jax.eval_shape(lambda: init_caches(config, batch, capacity, dtype))


def append(cache: KVCache, k_new, v_new, new_valid) -> KVCache:
  """Appends keys and values ``[batch, n_kv_heads, t, head_dim]`` to one layer's caches.

  ``new_valid`` [batch, n_kv_heads, t] is False on padding (no slot).
  """
  if distributed.cache_mesh() is not None:
    return distributed.append(cache, k_new, v_new, new_valid)
  return over_heads(cache_lib.append)(cache, k_new, v_new, new_valid)


class ChunkSlots(NamedTuple):
  """Where a chunk's tokens go in every layer (:func:`reserve`)."""

  idx: Optional[jax.Array]  # [n_layers, batch, n_kv_heads, t] int32 slot; cap = not stored
  positions: jax.Array  # [batch, t] int32 positions of the chunk's tokens
  new_valid: jax.Array  # [batch, n_kv_heads, t] bool, False on padding


def reserve(caches: KVCache, new_valid) -> tuple[KVCache, ChunkSlots]:
  """Every layer's slots for a chunk, with all but its keys and values written.

  With :func:`write_kv` per layer, :func:`append` on every layer without copies;
  ``new_valid`` [batch, t] is False on right padding. Sequence-sharded caches get
  ``idx`` None, and :func:`write_kv` appends.
  """
  n_kv = caches.n_seen.shape[-1]
  start = caches.n_seen[0, :, 0]  # [batch], equal across layers and KV heads
  positions = start[:, None] + jnp.cumsum(new_valid, axis=1).astype(jnp.int32) - 1
  per_head = jnp.repeat(new_valid[:, None], n_kv, axis=1)
  if distributed.cache_mesh() is not None:
    return caches, ChunkSlots(None, positions, per_head)
  assign = jax.vmap(over_heads(cache_lib.slot_assignment), in_axes=(0, None))
  slots = assign(caches.valid, per_head)
  meta, counters = jax.vmap(over_heads(cache_lib.slot_metadata))(caches, slots)
  n_layers, b = slots.idx.shape[:2]
  at = (jnp.arange(n_layers)[:, None, None, None], jnp.arange(b)[None, :, None, None],
        jnp.arange(n_kv)[None, None, :, None], slots.idx)
  caches = caches._replace(
      **{f: getattr(caches, f).at[at].set(u, mode="drop") for f, u in meta.items()},
      **counters)
  return caches, ChunkSlots(slots.idx, positions, per_head)


def write_kv(caches: KVCache, i, slots: ChunkSlots, k_new, v_new) -> KVCache:
  """Layer ``i``'s (int or traced) keys [batch, n_kv_heads, t, head_dim] and values into
  the slots :func:`reserve` gave them (one scatter per field, in place when donated)."""
  if slots.idx is None:  # sequence-sharded: the whole append on the layer
    return with_layer(caches, i, append(layer(caches, i), k_new, v_new, slots.new_valid))
  idx = jax.lax.dynamic_index_in_dim(slots.idx, i, axis=0, keepdims=False)  # [b, h, t]
  b, h = idx.shape[:2]
  one = layer(caches, i)
  stored = jnp.sum(idx < one.capacity, axis=-1)
  fresh = (jnp.sum(one.valid, axis=-1) == stored) & slots.new_valid[:, :, 0]  # v_ref: the first
  new, v_ref = over_heads(cache_lib.slot_kv)(one, k_new, v_new, fresh)
  at = (i, jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], idx)
  return caches._replace(
      **{f: getattr(caches, f).at[at].set(u, mode="drop") for f, u in new.items()},
      v_ref=jax.lax.dynamic_update_index_in_dim(caches.v_ref, v_ref, i, axis=0))


def rebase(caches):
  """``cache.rebase``, run only where an eviction left a stale ``v_ref`` (any layout)."""
  if distributed.cache_mesh() is not None:  # sharded: no collectives inside a cond
    return cache_lib.rebase(caches)
  if is_unstacked(caches):
    needed = jnp.any(jnp.stack([cache_lib.needs_rebase(c) for c in caches]))
    return jax.lax.cond(needed, lambda cs: tuple(cache_lib.rebase(c) for c in cs),
                        lambda cs: tuple(cs), tuple(caches))
  return jax.lax.cond(cache_lib.needs_rebase(caches), cache_lib.rebase, lambda c: c, caches)


def unstack(caches: KVCache) -> tuple:
  """Stacked caches as a tuple of per-layer caches (leaves ``[batch, n_kv_heads, ...]``).

  A layer loop and eviction then update each layer's buffers in place; it copies,
  so call it once before a decode loop. Unstacked caches are returned as they are.
  """
  if is_unstacked(caches):
    return caches
  return tuple(layer(caches, i) for i in range(caches.n_seen.shape[0]))


def stack(caches) -> KVCache:
  """The inverse of :func:`unstack` (stacked caches are returned as they are)."""
  if not is_unstacked(caches):
    return caches
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *caches)


def is_unstacked(caches) -> bool:
  """Whether ``caches`` is a tuple of per-layer caches (:func:`unstack`)."""
  return isinstance(caches, (tuple, list)) and not isinstance(caches, KVCache)


def layer(caches: KVCache, i) -> KVCache:
  """Layer ``i`` (int or traced) of stacked caches: leaves ``[batch, n_kv_heads, ...]``."""
  return jax.tree_util.tree_map(
      lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), caches)


def with_layer(caches: KVCache, i, cache: KVCache, fields=None) -> KVCache:
  """Stacked caches with layer ``i``'s ``fields`` (None: all) replaced by ``cache``'s."""
  fields = KVCache._fields if fields is None else fields
  put = lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u.astype(a.dtype), i, axis=0)
  return caches._replace(**{f: put(getattr(caches, f), getattr(cache, f)) for f in fields})
