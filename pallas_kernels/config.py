"""Static configuration of the fused decode kernels, importable without Pallas.

:class:`KernelConfig` is one frozen value (as Pallas ops group ``BlockSizes``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """How the fused decode kernel runs (hashable: a ``jit`` static argument)."""

  block_sizes: Optional[Any] = None  # offset_decode.BlockSizes; None: get_default
  backend: Optional[str] = None  # "triton" or "mosaic"; None: by the default device
  interpret: bool = False  # the Pallas interpreter (any device)
  debug: bool = False  # print the kernel's jaxpr and lowering
  range_mode: str = "exact"  # "exact" b_hat (one more XLA pass) or the one-pass "bound"
  num_warps: int = 4  # Triton only
  num_stages: Optional[int] = None  # Triton only; None: 3 where values split, else 2
  split_values: bool = True  # bfloat16 values multiply as stored (reference.split_matmul)
