"""Chunked prefill: a long prompt into the caches in bounded memory.

One :func:`models.forward.forward_chunk` call on an ``n``-token prompt
materialises ``[batch, heads, n, capacity]`` attention scores (and
``[batch, n, vocab]`` logits) per layer: several GB at 8k tokens.
:func:`prefill` feeds the prompt ``chunk`` tokens at a time in a ``lax.scan``
that carries the caches, so the scores are ``[batch, heads, chunk, capacity]``
and only the last chunk's logits are computed. Nothing is evicted here: a
caller evicts after (``certkv_jax.eviction.evict``).

The result equals the one-shot ``forward_chunk`` prefill: same positions,
slots, keys and values, and a design's statistics with the same observation
window. ``forward_chunk`` takes a chunk's last ``design.observation_window``
real queries as the window and replaces the previous chunk's, so each row's
last chunk must hold its last window of real queries. The padding therefore
goes into the first chunk, not the last: a row of ``L`` real tokens fills its
last ``min(L, chunk)`` tokens into the last chunk, full chunks before it, and
the remainder (right-padded) first; earlier chunks of a short row are all
padding, which takes no slot, no position and leaves the statistics as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from certkv_jax import caches as caches_lib
from models import forward
from models import precision
from models.config import LlamaConfig

Array = jax.Array


def _positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_args(n_tokens: int, *, config: LlamaConfig, capacity: int, chunk: int,
               design=None) -> None:
  """Checks :func:`prefill`'s static arguments for an ``n_tokens``-column prompt.

  Raises:
    ValueError naming the argument and its allowed range: ``chunk`` not an int
    in ``[max(1, design.observation_window), inf)`` (the window must fit in the
    last chunk); ``capacity`` not an int >= ``n_tokens`` (the prompt's
    length: nothing is evicted); ``n_tokens`` beyond ``config.max_positions``.
  """
  window = 0 if design is None else design.observation_window
  if not _positive_int(chunk) or chunk < window:
    raise ValueError(f"chunk must be an int >= max(1, design.observation_window) = "
                     f"{max(1, window)}, got {chunk!r}")
  if not _positive_int(capacity) or capacity < n_tokens:
    raise ValueError(f"capacity must be an int >= the prompt's length {n_tokens} "
                     f"(tokens.shape[1]; prefill evicts nothing), got {capacity!r}")
  if config.max_positions is not None and n_tokens > config.max_positions:
    raise ValueError(f"tokens has {n_tokens} columns, more than the model's context "
                     f"(config.max_positions = {config.max_positions})")


def chunk_layout(tokens, mask, chunk: int) -> tuple[Array, Array]:
  """The prompt as chunks whose last one holds every row's last real tokens.

  Each row's real tokens (``mask`` True, in column order) are packed and
  aligned to the end of ``n_chunks * chunk`` columns, then every chunk is
  right-padded: row ``r`` with ``L`` real tokens has ``min(L, chunk)`` of them
  in the last chunk, ``chunk`` in each chunk before back to its first one, the
  remainder at the front of that first chunk, and nothing earlier.

  Args:
    tokens: [batch, n] int token ids.
    mask: [batch, n] bool, True on real tokens.
    chunk: tokens per chunk.

  Returns:
    ``(tokens, valid)``, each ``[n_chunks, batch, chunk]``, ``n_chunks = ceil(n / chunk)``.
  """
  b, n = tokens.shape
  n_chunks = -(-n // chunk)
  order = jnp.argsort(~mask, axis=1, stable=True)  # real columns first, in order
  packed = jnp.take_along_axis(tokens, order, axis=1)
  lengths = jnp.sum(mask, axis=1).astype(jnp.int32)  # [b]
  lead = n_chunks * chunk - lengths  # [b] padded columns before the row's first token
  k = jnp.arange(n_chunks, dtype=jnp.int32)[:, None]  # [n_chunks, 1]
  count = jnp.clip((k + 1) * chunk - lead, 0, chunk)  # [n_chunks, b] real tokens per chunk
  start = jnp.maximum(k * chunk - lead, 0)  # [n_chunks, b] the chunk's first token
  j = jnp.arange(chunk, dtype=jnp.int32)
  src = jnp.clip(start[..., None] + j, 0, n - 1)  # [n_chunks, b, chunk]
  toks = packed[jnp.arange(b)[None, :, None], src]
  return toks, j < count[..., None]


@functools.partial(jax.jit, static_argnames=("config", "capacity", "chunk", "design",
                                             "certificate"))
def prefill(params, tokens, mask, *, config: LlamaConfig, capacity: int, chunk: int,
            design=None, certificate=False):
  """Prefills a prompt into empty caches ``chunk`` tokens at a time.

  Args:
    params: the model's parameters (stacked layers, as loaded).
    tokens: [batch, n] int token ids, right-padded per row.
    mask: [batch, n] bool, True on real tokens; every row needs >= 1 (its
      values are not checked here: ``models.inputs.check_prompt`` does,
      before the call).
    config: the model config (static).
    capacity: cache slots per (layer, row, KV head), >= n (static).
    chunk: tokens per ``forward_chunk`` call, >= the design's observation
      window (static); the attention scores are ``[batch, heads, chunk,
      capacity]``. A chunk of ``n`` or more is the one-shot prefill.
    design: optional ``certkv_jax.EvictionDesign`` whose statistics are folded
      (the prompt's last ``design.observation_window`` real queries are the
      observation window), as one-shot ``forward_chunk``.
    certificate: ``forward_chunk``'s; the statistics are not returned.

  Returns:
    ``(logits [batch, vocab] float32 of each row's last real token, caches)``,
    the caches as ``certkv_jax.caches.init_caches(config, batch, capacity, dtype)``,
    keys and values in the config's dtype (``models.precision.cache_dtype``).

  Raises:
    ValueError: :func:`check_args`.
  """
  batch, n = tokens.shape
  check_args(n, config=config, capacity=capacity, chunk=chunk, design=design)
  toks, valid = chunk_layout(tokens, mask, min(chunk, n))
  caches = caches_lib.init_caches(config, batch, capacity, precision.cache_dtype(config))

  def run(caches, t, v):
    logits, caches, _, _ = forward.forward_chunk(params, config, t, v, caches, design=design,
                                                 observe=True, certificate=certificate)
    return logits, caches

  if toks.shape[0] > 1:  # all but the last chunk; their logits are dead code
    caches, _ = jax.lax.scan(lambda c, x: (run(c, *x)[1], None), caches,
                             (toks[:-1], valid[:-1]))
  logits, caches = run(caches, toks[-1], valid[-1])
  last = jnp.maximum(jnp.sum(valid[-1], axis=1) - 1, 0)
  return logits[jnp.arange(batch), last], caches
