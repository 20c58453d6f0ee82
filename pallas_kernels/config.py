"""Static configuration of the fused decode kernels (no Pallas import).

:class:`KernelConfig` bundles the implementation knobs of
``pallas_kernels.offset_decode`` into one frozen, hashable value, the way
jax's Pallas ops group ``BlockSizes``: the kernel entry points take it as one
static argument under ``jit``. This module imports nothing from Pallas, so
``certkv_jax`` can build a config without loading the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """How the fused decode kernel runs (static: hashable, a ``jit`` static arg).

  Attributes:
    block_sizes: ``offset_decode.BlockSizes`` tiling (None:
      ``BlockSizes.get_default`` for the cache length, batch and backend).
    backend: "triton" or "mosaic" (None: by the default JAX device).
    interpret: run the kernel in the Pallas interpreter (any device).
    debug: print the kernel's jaxpr and lowering.
    range_mode: "exact" (one more cheap XLA pass over the keys for the
      method's b_hat) or "bound" (the kernel's one-pass upper bound).
    num_warps, num_stages: Triton compiler parameters (ignored by Mosaic).
  """

  block_sizes: Optional[Any] = None
  backend: Optional[str] = None
  interpret: bool = False
  debug: bool = False
  range_mode: str = "exact"
  num_warps: int = 4
  num_stages: int = 2
