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
