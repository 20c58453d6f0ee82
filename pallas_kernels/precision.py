"""The precision of every product in the kernels and the reference (method, section 9)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def product_operands(a, b):
  """``(a, b, precision)`` of a lossless product: bf16/f16 pairs as is, else f32 HIGHEST."""
  if a.dtype == b.dtype and a.dtype in LOW_PRECISION:
    return a, b, jax.lax.Precision.DEFAULT
  return a.astype(jnp.float32), b.astype(jnp.float32), jax.lax.Precision.HIGHEST


def bf16_rounded(a):
  """float32 ``a`` rounded to bfloat16 (to nearest, ties to even), kept float32.

  The same values as ``a.astype(bfloat16).astype(float32)`` for finite ``a``, by integer
  operations: XLA's GPU compiler may fold that round trip of converts to ``a``
  (``xla_allow_excess_precision``), which would make a split's low part zero.
  """
  bits = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32)
  bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def split_parts(a, dtype):
  """``(hi, lo)`` in ``dtype`` with ``hi + lo`` = float32 ``a`` to 16 significant bits."""
  hi = bf16_rounded(a) if dtype == jnp.bfloat16 else a.astype(dtype).astype(jnp.float32)
  return hi.astype(dtype), (a - hi).astype(dtype)
