"""Rotary position embeddings in the two layouts of the Llama family.

Pair ``i`` of a head rotates by ``pos * inv_freq[i]``: ``(x[i], x[i + d/2])`` in
``"half"`` (Hugging Face), ``(x[2i], x[2i + 1])`` in ``"interleaved"`` (GGUF).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig

Array = jax.Array


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
  """[head_dim // 2] float32 frequencies with ``rope_scaling`` applied, as Hugging
  Face's ``ROPE_INIT_FUNCTIONS`` (default, linear, llama3)."""
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
  """Rotates x [batch, seq, heads, head_dim] at int ``positions`` [batch, seq]
  (in float32; returns ``x``'s dtype); ValueError on other shapes."""
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
  """Rows with ``w_interleaved = w_half[rows]`` for a ``[n_heads * head_dim, in]``
  weight (llama.cpp's ``permute`` in ``convert_hf_to_gguf.py``)."""
  half = head_dim // 2
  within = np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)
  return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
