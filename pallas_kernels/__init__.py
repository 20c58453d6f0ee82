"""Pallas kernels for offset attention (``offset_decode``) and their jnp ``reference``."""

from pallas_kernels.config import KernelConfig

__all__ = ["KernelConfig"]
