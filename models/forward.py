"""The forward pass of a chunk of new tokens through the model and its caches.

:func:`forward_chunk` embeds the chunk, runs the decoder layers as a
``lax.scan`` over the stacked layer parameters and caches
(``certkv_jax.caches``), and returns the logits. Each layer appends the chunk's
keys and values to its caches, attends over them with the certificate
statistics and, with a design, folds the chunk's attention probabilities into
the slot statistics the design scores: one call of the drop-in
:func:`certkv_jax.layer.attend`; in a prompt chunk
(``observe=True``) the last ``design.observation_window`` real queries are
the observation window (SnapKV's ``obs``, replaced chunk by chunk). Eviction
itself is ``certkv_jax.eviction``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from certkv_jax import allocation as allocation_lib
from certkv_jax import caches as caches_lib
from certkv_jax import certified_attention
from certkv_jax import layer
from certkv_jax.cache import KVCache
from models.config import LlamaConfig
from models.llama import Block
from models.llama import LlamaModel

Array = jax.Array


def _layer(config: LlamaConfig, design, observe: bool, certificate, x, valid,
           layer_params, cache: KVCache, shadow: Optional[KVCache]):
  """One decoder layer on a chunk: q, k, v, the drop-in attention
  (``certkv_jax.layer.attend``: append, offset attention with the certificate
  statistics, the design's statistics folded), then the output projection and MLP.
  ``certificate`` is ``attend``'s: a bool or ``(layer_flag, heads)``.

  Returns:
    ``(x [b, t, hidden], cache, stats [b, n_heads, t] or None, shadow)``.
  """
  block = Block(config)
  variables = {"params": layer_params}
  with jax.named_scope("qkv"):
    q, k, v = block.apply(variables, x, layer.positions(cache, valid), method=Block.qkv)
  out, cache, shadow, stats = layer.attend(
      q, k, v, cache, valid=valid, design=design, observe=observe, certificate=certificate,
      shadow=shadow)
  with jax.named_scope("mlp"):
    x = block.apply(variables, x, out, method=Block.finish)
  return x, cache, stats, shadow


def allocation_args(params, config: LlamaConfig, allocation) -> dict:
  """``eviction.evict``'s ``allocation`` and ``gains`` for this model: the gains
  (``certkv_jax.allocation.kv_head_gains`` of the ``o_proj`` kernel) only for
  an allocation that needs them."""
  gains = None
  if allocation is not None and allocation.needs_gains:
    gains = allocation_lib.kv_head_gains(params["params"]["layers"]["o_proj"]["kernel"],
                                         config.n_heads, config.n_kv_heads, config.head_dim)
  return dict(allocation=allocation, gains=gains)


@functools.partial(jax.jit, static_argnames=("config", "design", "observe", "certificate"))
def forward_chunk(params, config: LlamaConfig, tokens, valid, caches: KVCache, *,
                  design=None, observe: bool = True, certificate=True,
                  shadow: Optional[KVCache] = None):
  """Runs a chunk of new tokens through the model with caches.

  Args:
    params: ``{"params": ...}`` of :class:`models.llama.LlamaModel`.
    config: the model config.
    tokens: [batch, t] int token ids.
    valid: [batch, t] bool, False on (right) padding: padding takes no cache
      slot and no position.
    caches: from :func:`certkv_jax.caches.init_caches` (or a previous chunk).
    design: optional ``certkv_jax.EvictionDesign``; its ``update`` folds the
      chunk's attention probabilities into the slot statistics.
    observe: whether this is a prompt chunk whose last
      ``design.observation_window`` real queries are the design's observation
      window (``obs`` is replaced by their attention); decode steps pass
      False, so that ``obs`` keeps the prompt's window.
    certificate: True: attention with ``certkv_jax.offset_attention`` and its
      certificate statistics; False: the same Hajek softmax without them
      (cheaper for long prefills) and ``None`` stats; a
      ``certified_attention.Subsample(layers, heads)``: certify only those
      layers / KV heads (the others attend with the plain softmax, a
      ``lax.cond`` per layer, and report NaN; the logits do not change).
    shadow: evaluation mode: full caches (never evicted) that receive the same
      keys and values; with the certificate the stats then include the true
      error of every call.

  Returns:
    ``(logits [batch, t, vocab] float32, caches, ChunkStats or None, shadow)``;
    every ChunkStats field is ``[t, n_layers, batch, n_heads]`` (``Generation``
    has ``[n_steps, n_layers, batch, n_heads]``, a decode step being a chunk of
    one query).
  """
  sub = certificate if isinstance(certificate, certified_attention.Subsample) else None
  certificate_layers, certificate_heads = (None, None) if sub is None else (sub.layers,
                                                                            sub.heads)
  certificate = bool(certificate)
  layer_flags = certified_attention.check_certificate_subsample(
      config, certificate, certificate_layers, certificate_heads)
  model = LlamaModel(config)
  x = model.apply(params, tokens, method=LlamaModel.embed_tokens)

  def body(carry, layer):
    x, caches, shadow = carry
    layer_params, flag, i = layer
    cache = caches_lib.layer(caches, i)
    shadow_cache = None if shadow is None else caches_lib.layer(shadow, i)
    cert = certificate
    if certificate and (flag is not None or certificate_heads is not None):
      cert = (flag, certificate_heads)  # this layer's subsample
    x, cache, stats, shadow_cache = _layer(config, design, observe, cert, x, valid,
                                           layer_params, cache, shadow_cache)
    caches = caches_lib.with_layer(caches, i, cache)
    if shadow is not None:
      shadow = caches_lib.with_layer(shadow, i, shadow_cache)
    return (x, caches, shadow), stats

  # The caches ride in the carry, each layer's slice written back in place
  # (scanned inputs and outputs would copy the stacked caches every call).
  (x, caches, shadow), stats = jax.lax.scan(
      body, (x, caches, shadow),
      (params["params"]["layers"], layer_flags, jnp.arange(config.n_layers, dtype=jnp.int32)))
  if stats is not None:  # [n_layers, batch, n_heads, t] -> [t, n_layers, batch, n_heads]
    stats = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, -1, 0), stats)
  return model.apply(params, x, method=LlamaModel.head), caches, stats, shadow
