"""Memory of a run's caches (key/value payload and per-slot metadata) vs. the full cache.

Caches are fixed-capacity buffers, so their bytes (``certkv_jax.kv.cache.cache_bytes``)
are set by the capacity, not by the slots in use.
"""

from __future__ import annotations

import jax
import numpy as np

from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv.cache import KVCache
from models import decode
from models.config import LlamaConfig


def caches_bytes(caches: KVCache) -> dict:
  """``{"kv", "metadata", "total", "n_caches"}``: ``cache_bytes`` summed over a
  stacked pytree's caches (arrays or ``jax.ShapeDtypeStruct``s)."""
  lead = caches.n_seen.shape
  n = int(np.prod(lead)) if lead else 1
  as_np = jax.tree_util.tree_map(
      lambda x: np.empty(x.shape[len(lead):], x.dtype), caches)  # one cache (shapes only)
  one = cache_lib.cache_bytes(as_np)
  kv, meta = one["kv"] * n, one["metadata"] * n
  return {"kv": kv, "metadata": meta, "total": kv + meta, "n_caches": n}


def full_cache_bytes(config: LlamaConfig, batch: int, n_tokens: int, dtype=np.float32) -> dict:
  """:func:`caches_bytes` of the caches that would hold all ``n_tokens`` tokens."""
  shapes = jax.eval_shape(lambda: decode.init_caches(config, batch, n_tokens, dtype))
  return caches_bytes(shapes)


def memory_summary(caches: KVCache, config: LlamaConfig, n_tokens: int) -> dict:
  """A run's cache memory next to the full cache's.

  ``caches``: leaves ``[n_layers, batch, n_kv_heads, ...]``; ``n_tokens``: tokens per
  row a full cache holds. Returns a flat dict of the run's and the full cache's
  bytes (``kv``, ``metadata``, ``total``), their fractions and capacities.
  """
  batch = caches.n_seen.shape[1]
  dtype = caches.k.dtype
  run = caches_bytes(caches)
  full = full_cache_bytes(config, batch, n_tokens, dtype)
  return {
      "kv_bytes": run["kv"], "metadata_bytes": run["metadata"], "total_bytes": run["total"],
      "full_kv_bytes": full["kv"], "full_metadata_bytes": full["metadata"],
      "full_total_bytes": full["total"],
      "kv_fraction": run["kv"] / full["kv"], "total_fraction": run["total"] / full["total"],
      "capacity": int(caches.k.shape[-2]), "full_capacity": int(n_tokens),
  }


def format_bytes(n: float) -> str:
  """``1536`` -> ``"1.5 KiB"``."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} GiB"


def retained_bytes(caches: KVCache) -> dict:
  """Bytes of the slots in use (``valid``), summed over caches: ``kv`` and per-slot
  ``metadata`` of caches compacted to their kept tokens."""
  lead = caches.n_seen.shape
  one = jax.tree_util.tree_map(lambda x: np.empty(x.shape[len(lead):], x.dtype), caches)
  b = cache_lib.cache_bytes(one)
  cap = int(caches.k.shape[-2])
  counters = one.n_seen.nbytes + one.n_dropped.nbytes
  used = int(np.sum(np.asarray(caches.valid)))
  return {"kv": b["kv"] // cap * used, "metadata": (b["metadata"] - counters) // cap * used,
          "slots": used}
