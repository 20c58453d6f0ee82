"""Pallas kernels for offset attention with certificate statistics.

* :mod:`pallas_kernels.reference` -- the pure-jnp formulas (one place) that
  ``certkv_jax`` uses on the XLA path and the kernels are tested against.
* :mod:`pallas_kernels.offset_decode` -- the fused decode kernel (Triton and
  Mosaic backends, split-K) and its chunk (multi-query) variant.
"""
