"""The precision of every product in the kernels and the reference (one rule).

A GPU computes a float32 ``dot_general`` at its default precision in TF32
(operands rounded to a 10-bit mantissa), far from float32 tolerances; a
bfloat16 product is exact in float32. ``tests/precision_test.py`` reads every
product from the traced programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def product_operands(a, b):
  """The operands and precision of a product that loses nothing: two bfloat16
  (or float16) operands as they are (their products are exact in float32, the
  accumulation type); anything else in float32 at ``HIGHEST`` (on a GPU the
  default rounds float32 operands to TF32, about 1e-3 relative)."""
  if a.dtype == b.dtype and a.dtype in LOW_PRECISION:
    return a, b, jax.lax.Precision.DEFAULT
  return a.astype(jnp.float32), b.astype(jnp.float32), jax.lax.Precision.HIGHEST
