"""Chunked prefill: a long prompt into the caches in bounded memory.

:func:`prefill` scans ``forward_chunk`` over chunks (scores ``[batch, heads, chunk,
capacity]``), evicting nothing; padding goes first, so it equals one-shot prefill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from models import forward
from models import precision
from models.config import LlamaConfig

Array = jax.Array


def _positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_args(n_tokens: int, *, config: LlamaConfig, capacity: int, chunk: int,
               design=None) -> None:
  """Checks :func:`prefill`'s static arguments; ValueError for ``chunk`` not an int
  >= max(1, observation window), ``capacity`` < ``n_tokens`` or too long a prompt."""
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

  Returns ``(tokens, valid)``, each ``[n_chunks, batch, chunk]``, from ``tokens``
  and ``mask`` [batch, n]; every chunk is right-padded.
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

  ``tokens`` [batch, n] int and ``mask`` [batch, n] bool (True on real tokens, >= 1
  per row); static ``capacity`` >= n slots and ``chunk`` tokens per call (>= the
  observation window; n or more is one-shot). Returns ``(logits [batch, vocab]
  float32 of each row's last real token, caches)``; ValueError: :func:`check_args`.
  """
  batch, n = tokens.shape
  check_args(n, config=config, capacity=capacity, chunk=chunk, design=design)
  caches = caches_lib.init_caches(config, batch, capacity, precision.cache_dtype(config))
  settings = layer_lib.Settings(design=design, observe=True, certificate=certificate)
  return prefill_into(params, tokens, mask, caches, config=config, chunk=chunk,
                      settings=settings)


def prefill_into(params, tokens, mask, caches, *, config: LlamaConfig, chunk: int,
                 settings: layer_lib.Settings):
  """:func:`prefill`'s scan into given ``caches`` under any ``layer.Settings`` (unchecked,
  not jitted): ``(logits of each row's last real token, caches)``."""
  batch, n = tokens.shape
  toks, valid = chunk_layout(tokens, mask, min(chunk, n))

  def run(caches, t, v):
    logits, caches, _, _ = forward.forward_chunk(params, config, t, v, caches,
                                                 settings=settings)
    return logits, caches

  if toks.shape[0] > 1:  # all but the last chunk; their logits are dead code
    caches, _ = jax.lax.scan(lambda c, x: (run(c, *x)[1], None), caches,
                             (toks[:-1], valid[:-1]))
  logits, caches = run(caches, toks[-1], valid[-1])
  last = jnp.maximum(jnp.sum(valid[-1], axis=1) - 1, 0)
  return logits[jnp.arange(batch), last], caches
