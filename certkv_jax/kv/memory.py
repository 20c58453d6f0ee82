"""What a kept token costs: key/value bytes plus the per-slot metadata its design reads.

Designs are compared at equal memory, the bytes their kept tokens hold, not
their nominal budgets (method, section 12, "Equal memory"), in the layout a
serving system would store, not our caches' all-fields one (``cache.cache_bytes``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate

STAT_FIELDS = ("acc", "last", "obs")
BASE_BYTES = 4 + 1  # pos (int32) + valid
LOG_PI_BYTES = 4  # float32 log inclusion probability: randomized designs
V_SQ_BYTES = 4  # float32 ||v - v_ref||^2: the certificate, and allocations that need gains
STAT_BYTES = 4


def metadata_bytes(design, allocation=None) -> int:
  """Per-slot metadata bytes ``design`` (and ``allocation``) need; None = full cache (0)."""
  if design is None:
    return 0
  stats = set(design.reads) & set(STAT_FIELDS)
  gains = getattr(allocation, "needs_gains", False)  # reads the window's obs and v_sq
  if gains:
    stats.add("obs")
  return (BASE_BYTES + STAT_BYTES * len(stats) + (LOG_PI_BYTES if design.randomized else 0)
          + (V_SQ_BYTES if design.randomized or gains else 0))


def slot_bytes(design, head_dim: int, value_dim: int | None = None, dtype=jnp.float32,
               allocation=None) -> int:
  """Bytes one kept token costs in one KV head: key + value + metadata."""
  head_dim = _validate.check_positive_int("head_dim", head_dim)
  value_dim = head_dim if value_dim is None else _validate.check_positive_int("value_dim",
                                                                            value_dim)
  kv = (head_dim + value_dim) * np.dtype(dtype).itemsize
  return kv + metadata_bytes(design, allocation)


def token_fraction(memory: float, design, head_dim: int, value_dim: int | None = None,
                   dtype=jnp.float32, allocation=None) -> float:
  """The budget (fraction of tokens) whose kept bytes are ``memory`` in (0, 1] times the
  full cache's key/value bytes (ValueError otherwise)."""
  if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory <= 1:
    raise ValueError(f"memory must be a fraction in (0, 1] of the full cache, got {memory!r}")
  full = slot_bytes(None, head_dim, value_dim, dtype)
  return float(memory) * full / slot_bytes(design, head_dim, value_dim, dtype, allocation)


def kept_bytes(n_kept, design, head_dim: int, value_dim: int | None = None,
               dtype=jnp.float32, allocation=None):
  """Bytes held by ``n_kept`` kept tokens (any shape; summed by the caller)."""
  return np.asarray(n_kept, np.float64) * slot_bytes(design, head_dim, value_dim, dtype,
                                                     allocation)
