"""Pallas kernels for offset attention with certificate statistics.

* :mod:`pallas_kernels.reference` -- the pure-jnp formulas (one place) that
  ``certkv_jax`` uses on the XLA path and the kernels are tested against.
* :mod:`pallas_kernels.offset_decode` -- the fused decode kernel (Triton and
  Mosaic backends, split-K) and its chunk (multi-query) variant.
* :class:`KernelConfig` (:mod:`pallas_kernels.config`) -- the kernels' static
  implementation knobs in one hashable value.
"""

from pallas_kernels.config import KernelConfig

__all__ = ["KernelConfig"]
