"""The drop-in attention a model's layer calls to use a design (method, sections 1 and 3).

:func:`attend` appends a chunk to one layer's caches, attends with Hajek offsets and folds
the attention into the design's statistics (:func:`attend_layer`: in place on stacked caches)::

    out, cache, _, stats = layer.attend(q, k, v, cache, valid=valid, design=design)  # in jit
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from certkv_jax import cache as cache_lib
from certkv_jax import caches as caches_lib
from certkv_jax import certified_attention
from certkv_jax.cache import KVCache

Array = jax.Array


def positions(cache: KVCache, valid) -> Array:
  """[batch, t] positions continuing each row's ``n_seen``; padding takes none."""
  start = cache.n_seen[:, 0]  # [batch], equal across KV heads
  return start[:, None] + jnp.cumsum(valid, axis=1).astype(jnp.int32) - 1


def attend(q, k, v, cache: KVCache, *, valid=None, design=None, observe: bool = True,
           certificate=True, shadow: Optional[KVCache] = None):
  """Appends a chunk to one layer's caches and attends over them.

  Args:
    q: [batch, t, n_heads, head_dim] queries, positions encoded.
    k, v: [batch, t, n_kv_heads, head_dim]; ValueError unless ``n_kv_heads`` divides ``n_heads``.
    cache: this layer's caches, leaves ``[batch, n_kv_heads, cap, ...]``.
    valid: [batch, t] bool, False on right padding; None = all real.
    design: the ``EvictionDesign`` whose statistics are folded, or None.
    observe: the last ``design.observation_window`` real queries form the window (False: decode).
    certificate: True; False (``stats`` None); or ``(layer_flag, heads)``: a traced
      bool switching the layer off and a static tuple of KV heads (the rest NaN).
    shadow: evaluation only: a never-evicted cache of the layer (truth, audit).

  Returns ``(out [batch, t, n_heads, head_dim] float32, cache, shadow, stats)``,
  ``stats`` a ``ChunkStats`` of ``[batch, n_heads, t]`` arrays or None.
  """
  valid, new_kv = _new_tokens(q, k, v, valid)
  pos = positions(cache, valid)
  with jax.named_scope("append"):
    cache = caches_lib.append(cache, *new_kv)
    if shadow is not None:  # never sharded
      shadow = caches_lib.over_heads(cache_lib.append)(shadow, *new_kv)
  out, cache, stats = _attend_appended(q, cache, shadow, pos, valid, design, observe,
                                       certificate)
  return out, cache, shadow, stats


def attend_layer(q, k, v, caches: KVCache, i, slots: caches_lib.ChunkSlots, *, valid=None,
                 design=None, observe: bool = True, certificate=True,
                 shadow: Optional[KVCache] = None,
                 shadow_slots: Optional[caches_lib.ChunkSlots] = None):
  """:func:`attend` on layer ``i`` (int or traced) of stacked caches, in place: ``caches``
  leaves ``[n_layers, batch, n_kv_heads, cap, ...]``, ``slots`` from ``caches.reserve``
  (``shadow`` likewise, with ``shadow_slots``); returns as :func:`attend`."""
  valid, (k_new, v_new, _) = _new_tokens(q, k, v, valid)
  with jax.named_scope("append"):
    caches = caches_lib.write_kv(caches, i, slots, k_new, v_new)
    if shadow is not None:
      shadow = caches_lib.write_kv(shadow, i, shadow_slots, k_new, v_new)
  cache = caches_lib.layer(caches, i)
  shadow_cache = None if shadow is None else caches_lib.layer(shadow, i)
  out, folded, stats = _attend_appended(q, cache, shadow_cache, slots.positions, valid, design,
                                        observe, certificate)
  if design is not None:  # a design folds statistics only: the keys and values stay put
    caches = caches_lib.with_layer(caches, i, folded, fields=cache_lib.STATISTICS)
  return out, caches, shadow, stats


def _new_tokens(q, k, v, valid):
  """Checks the heads; ``(valid [b, t], (k, v [b, h_kv, t, d], valid [b, h_kv, t]))``."""
  b, t, n_heads, _ = q.shape
  n_kv = k.shape[2]
  if n_heads % n_kv:
    raise ValueError(f"q has {n_heads} heads, not a multiple of the {n_kv} KV heads of k")
  if valid is None:
    valid = jnp.ones((b, t), bool)
  return valid, (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                 jnp.repeat(valid[:, None], n_kv, axis=1))


def _attend_appended(q, cache, shadow, pos, valid, design, observe, certificate):
  """Attends over caches holding the chunk, then folds: ``(out [b, t, h, d], cache, stats)``."""
  b, t, n_heads, d = q.shape
  n_kv = cache.k.shape[1]
  qg = q.reshape(b, t, n_kv, n_heads // n_kv, d).transpose(0, 2, 3, 1, 4)
  layer_flag, heads = certificate if isinstance(certificate, tuple) else (None, None)
  certificate = certificate is not False
  with jax.named_scope("attention_statistics"):
    out, stats, probs = certified_attention.attend(
        qg, cache, shadow, pos, certificate=certificate, with_probs=design is not None,
        layer_flag=layer_flag, heads=heads)  # out [b, h_kv, g, t, d]
  if stats is not None:  # [b, h_kv, g, t] -> [b, n_heads, t]
    stats = jax.tree_util.tree_map(lambda a: a.reshape(b, n_heads, t), stats)
  if design is not None:
    with jax.named_scope("fold"):
      window = design.observation_window if observe else 0
      cache = fold_statistics(design, cache, probs, valid, window)
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n_heads, d)
  return out, cache, stats


def fold_statistics(design, cache: KVCache, probs, valid, observation_window: int) -> KVCache:
  """Folds probabilities [b, h_kv, g, t, cap] into slot statistics (``design.update``): the
  non-window real queries, then the window with ``obs`` reset, so the last real query is the
  latest (TOVA) and ``obs`` this chunk's window (SnapKV); all-padding rows keep theirs."""
  probs = jnp.where(valid[:, None, None, :, None], probs, 0.0)  # padded queries count 0
  t = valid.shape[1]
  n_real = jnp.sum(valid, axis=1).astype(jnp.int32)
  probs = jax.vmap(lambda p, n: jnp.roll(p, t - n, axis=-2))(probs, n_real)  # right-align
  in_window = jnp.arange(t) >= t - observation_window  # [t]

  def fold(cache_h, p, has_real):  # p [g, t, cap]
    state = design.init(cache_h)
    if observation_window == 0:
      new = design.update(cache_h, state, p)[0]
    else:
      w = in_window[None, :, None]
      new, state = design.update(cache_h, state, jnp.where(w, 0.0, p))
      new = new._replace(obs=jnp.zeros_like(new.obs))
      new = design.update(new, state, jnp.where(w, p, 0.0), observation=True)[0]
    return jax.tree_util.tree_map(lambda a, b: jnp.where(has_real, a, b), new, cache_h)

  per_head = jax.vmap(fold, in_axes=(0, 0, None))  # over KV heads; one flag per row
  return jax.vmap(per_head)(cache, probs, n_real > 0)
