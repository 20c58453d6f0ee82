"""The forward pass of a chunk of new tokens through the model and its caches.

:func:`forward_chunk` embeds the chunk, runs the decoder layers as a
``lax.scan`` over the stacked layer parameters and caches
(``models.caches``), and returns the logits. Each layer appends the chunk's
keys and values to its caches, attends over them
(:func:`models.certified_attention.attend`, with the certificate statistics)
and, with a design, folds the chunk's attention probabilities into the slot
statistics the design scores (``design.update``); in a prompt chunk
(``observe=True``) the last ``design.observation_window`` real queries are
the observation window (SnapKV's ``obs``, replaced chunk by chunk). Eviction
itself is ``models.eviction``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from certkv_jax import cache as cache_lib
from certkv_jax.cache import KVCache
from models import caches as caches_lib
from models import certified_attention
from models.config import LlamaConfig
from models.llama import Block
from models.llama import LlamaModel

Array = jax.Array


def _positions(cache: KVCache, valid) -> Array:
  """[batch, t] positions of new tokens: next position of each row, padding skipped."""
  start = cache.n_seen[:, 0]  # [batch], equal across KV heads
  return start[:, None] + jnp.cumsum(valid, axis=1).astype(jnp.int32) - 1


def _layer(config: LlamaConfig, design, observe: bool, certificate: bool, x, valid,
           layer_params, cache: KVCache, shadow: Optional[KVCache], layer_flag=None,
           certificate_heads: Optional[tuple] = None):
  """One decoder layer on a chunk: append keys/values, offset attention, MLP.

  ``shadow`` (evaluation mode) is a never-evicted cache that receives the same
  keys and values; the same queries attend over it to give the truth ``o``.
  Its ``log_pi`` is not an attention offset but the record of every token's
  cumulative log inclusion probability (``models.eviction.record_inclusion``),
  from which the Assumption-2 ratio ``R`` of each call is computed over the
  full context.

  ``layer_flag`` (traced bool) and ``certificate_heads`` (static KV-head
  indices) subsample the certificate (see :func:`forward_chunk`).

  Returns:
    ``(x [b, t, hidden], cache, stats [b, n_heads, t] or None, shadow)``.
  """
  c = config
  b, t, _ = x.shape
  block = Block(c)
  variables = {"params": layer_params}
  positions = _positions(cache, valid)
  q, k, v = block.apply(variables, x, positions, method=Block.qkv)
  new_kv = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
            jnp.repeat(valid[:, None], c.n_kv_heads, axis=1))
  cache = caches_lib.append(cache, *new_kv)
  if shadow is not None:  # never sharded
    shadow = caches_lib.over_heads(cache_lib.append)(shadow, *new_kv)
  qg = q.reshape(b, t, c.n_kv_heads, c.group_size, c.head_dim).transpose(0, 2, 3, 1, 4)
  out, stats, probs = certified_attention.attend(
      qg, cache, shadow, positions, certificate=certificate, with_probs=design is not None,
      layer_flag=layer_flag, heads=certificate_heads)  # out [b, h_kv, g, t, d]
  if stats is not None:  # [b, h_kv, g, t] -> [b, n_heads, t]
    stats = jax.tree_util.tree_map(lambda a: a.reshape(b, c.n_heads, t), stats)
  if design is not None:
    window = design.observation_window if observe else 0
    cache = _fold_statistics(design, cache, probs, valid, window)
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, c.n_heads, c.head_dim)
  x = block.apply(variables, x, out, method=Block.finish)
  return x, cache, stats, shadow


def _layer_slice(caches: KVCache, i) -> KVCache:
  """Layer ``i`` (traced) of stacked caches: leaves ``[batch, n_kv_heads, ...]``."""
  return jax.tree_util.tree_map(
      lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), caches)


def _put_layer(caches: KVCache, layer: KVCache, i) -> KVCache:
  """Stacked caches with layer ``i`` (traced) replaced by ``layer`` (in place in a loop)."""
  return jax.tree_util.tree_map(
      lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u.astype(a.dtype), i, axis=0),
      caches, layer)


def _fold_statistics(design, cache: KVCache, probs, valid,
                     observation_window: int) -> KVCache:
  """Folds a chunk's attention probabilities [b, h_kv, g, t, cap] into the slot
  statistics with ``design.update`` (per KV head).

  In order: the non-window real queries, then the last ``observation_window``
  real queries as the observation window, so that the last real query is the
  latest (``last``, TOVA) and ``obs`` holds this window only (SnapKV): with a
  window, ``obs`` is reset before the window is folded, so that in streaming
  each chunk's window replaces the previous chunk's (a row whose chunk is all
  padding keeps its statistics, ``obs`` included).
  """
  probs = jnp.where(valid[:, None, None, :, None], probs, 0.0)  # padded queries count 0
  t = valid.shape[1]
  n_real = jnp.sum(valid, axis=1).astype(jnp.int32)
  # Right-aligns each row's real queries, so that the last one is at t - 1.
  probs = jax.vmap(lambda p, n: jnp.roll(p, t - n, axis=-2))(probs, n_real)
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
    # A row whose chunk is all padding (ragged streaming) keeps its statistics.
    return jax.tree_util.tree_map(lambda a, b: jnp.where(has_real, a, b), new, cache_h)

  per_head = jax.vmap(fold, in_axes=(0, 0, None))  # over KV heads; one flag per row
  return jax.vmap(per_head)(cache, probs, n_real > 0)


@functools.partial(jax.jit, static_argnames=("config", "design", "observe",
                                             "certificate", "certificate_layers",
                                             "certificate_heads"))
def forward_chunk(params, config: LlamaConfig, tokens, valid, caches: KVCache, *,
                  design=None, observe: bool = True, certificate: bool = True,
                  shadow: Optional[KVCache] = None,
                  certificate_layers: Optional[tuple] = None,
                  certificate_heads: Optional[tuple] = None):
  """Runs a chunk of new tokens through the model with caches.

  Args:
    params: ``{"params": ...}`` of :class:`models.llama.LlamaModel`.
    config: the model config.
    tokens: [batch, t] int token ids.
    valid: [batch, t] bool, False on (right) padding: padding takes no cache
      slot and no position.
    caches: from :func:`models.caches.init_caches` (or a previous chunk).
    design: optional ``certkv_jax.EvictionDesign``; its ``update`` folds the
      chunk's attention probabilities into the slot statistics.
    observe: whether this is a prompt chunk whose last
      ``design.observation_window`` real queries are the design's observation
      window (``obs`` is replaced by their attention; SnapKV, the envelope
      design). The window belongs to the design (see
      ``certkv_jax.designs.EvictionDesign``); decode steps pass False, so that
      ``obs`` keeps the prompt's window.
    certificate: compute attention with ``certkv_jax.offset_attention`` and
      return its certificate statistics; False computes the same Hajek
      softmax with ``certkv_jax.attention_probs`` only (cheaper for long
      prefills: no per-slot second-order sums) and returns ``None`` stats.
    shadow: evaluation mode: full caches (never evicted, from
      ``init_caches``) that receive the same keys and values; with
      ``certificate`` the stats then include the true error of every call.
    certificate_layers: static tuple of layer indices (None = every layer):
      subsample the certificate by layer. The other layers attend with the
      plain Hajek softmax (a ``lax.cond`` inside the layer scan, so they skip
      the per-slot second-order sums) and their stats are NaN.
    certificate_heads: static tuple of KV-head indices (None = every head):
      subsample the certificate by KV head (all query heads of a KV group);
      the other heads' stats are NaN. Combine with ``certificate_layers`` for
      a (layer, head) subsample. The attention outputs, and so the logits,
      do not depend on either (the same Hajek estimate).

  Returns:
    ``(logits [batch, t, vocab] float32, caches, ChunkStats or None, shadow)``;
    every ChunkStats field is ``[t, n_layers, batch, n_heads]``: the one axis
    order of the package's per-call statistics (``Generation`` has
    ``[n_steps, n_layers, batch, n_heads]``, a decode step being a chunk of
    one query).
  """
  layer_flags = certified_attention.check_certificate_subsample(
      config, certificate, certificate_layers, certificate_heads)
  model = LlamaModel(config)
  x = model.apply(params, tokens, method=LlamaModel.embed_tokens)

  def body(carry, layer):
    x, caches, shadow = carry
    layer_params, flag, i = layer
    cache = _layer_slice(caches, i)
    shadow_cache = None if shadow is None else _layer_slice(shadow, i)
    x, cache, stats, shadow_cache = _layer(config, design, observe, certificate, x,
                                           valid, layer_params, cache, shadow_cache, flag,
                                           certificate_heads)
    caches = _put_layer(caches, cache, i)
    if shadow is not None:
      shadow = _put_layer(shadow, shadow_cache, i)
    return (x, caches, shadow), stats

  # The caches ride in the scan's carry and each layer's slice is written back in
  # place (dynamic_update_slice on the loop buffer). As scanned inputs and outputs
  # instead, XLA allocated and initialised a second set of stacked caches every call
  # and copied the caches in: on SmolLM2 at 2k tokens (CPU) a decode step took
  # 263 ms that way and 154 ms this way, with identical outputs.
  (x, caches, shadow), stats = jax.lax.scan(
      body, (x, caches, shadow),
      (params["params"]["layers"], layer_flags, jnp.arange(config.n_layers, dtype=jnp.int32)))
  if stats is not None:  # [n_layers, batch, n_heads, t] -> [t, n_layers, batch, n_heads]
    stats = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, -1, 0), stats)
  return model.apply(params, x, method=LlamaModel.head), caches, stats, shadow
