"""Rotary position embeddings in the two layouts of the Llama family.

Both layouts rotate pairs of dimensions of a head by ``pos * inv_freq[i]``;
they differ in which dimensions form pair ``i``:

* ``"half"`` (Hugging Face ``rotate_half``): ``(x[i], x[i + d/2])``.
* ``"interleaved"`` (GGUF / llama.cpp, Meta's original): ``(x[2i], x[2i + 1])``.

llama.cpp's converter permutes the rows of ``W_q`` and ``W_k`` so that a
Hugging Face checkpoint in the ``"half"`` layout computes the same attention
in the ``"interleaved"`` layout; :func:`half_to_interleaved_rows` is that
permutation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig

Array = jax.Array


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
  """[head_dim // 2] float32 rotation frequencies, with ``rope_scaling`` applied.

  Mirrors Hugging Face's ``ROPE_INIT_FUNCTIONS`` (default, linear, llama3),
  computed in float32 like its reference.
  """
  d = config.head_dim
  exponent = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
  inv_freq = (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponent)).astype(
      np.float32)
  if config.rope_scaling is None:
    return inv_freq
  factor = np.float32(config.rope_factor)
  if config.rope_scaling == "linear":
    return (inv_freq / factor).astype(np.float32)
  # llama3: long wavelengths slowed down by `factor`, short ones kept, smooth in between.
  low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
  old_len = config.rope_original_max_positions
  wavelen = np.float32(2 * math.pi) / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x, positions, config: LlamaConfig) -> Array:
  """Rotates queries or keys.

  Args:
    x: [batch, seq, heads, head_dim].
    positions: [batch, seq] int token positions.
    config: gives ``rope_layout`` and the frequencies.

  Returns:
    [batch, seq, heads, head_dim], dtype of ``x`` (rotation in float32).
  """
  if x.ndim != 4 or x.shape[-1] != config.head_dim:
    raise ValueError(f"x must be [batch, seq, heads, {config.head_dim}], got {x.shape}")
  if positions.shape != x.shape[:2]:
    raise ValueError(f"positions must be [batch, seq] = {x.shape[:2]}, got {positions.shape}")
  inv_freq = jnp.asarray(inverse_frequencies(config))
  angle = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [b, s, 1, d/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  xf = x.astype(jnp.float32)
  if config.rope_layout == "half":
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  else:
    pairs = xf.reshape(xf.shape[:-1] + (config.head_dim // 2, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
  return out.astype(x.dtype)


def half_to_interleaved_rows(n_heads: int, head_dim: int) -> np.ndarray:
  """Row order that turns a ``"half"``-layout projection into ``"interleaved"``.

  ``w_interleaved = w_half[rows]`` for a ``[n_heads * head_dim, in]`` weight
  (llama.cpp's ``permute`` in ``convert_hf_to_gguf.py``): within each head,
  output ``2i`` takes row ``i`` and output ``2i + 1`` takes row ``i + d/2``.
  """
  half = head_dim // 2
  within = np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)
  return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
