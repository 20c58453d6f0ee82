"""The dtype option: a model's weights and KV caches in float32 (default) or bfloat16.

Matrices and cached keys and values take it; the rest is float32 (method, section 9).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ("float32", "bfloat16")
MATRICES = ("kernel", "embedding")


def check_dtype(dtype, name: str = "dtype") -> str:
  """The dtype's name, one of :data:`DTYPES`; ValueError naming ``name`` otherwise."""
  try:
    resolved = jnp.dtype(dtype).name
  except (TypeError, ValueError):
    resolved = None
  if isinstance(dtype, bool) or dtype is None or resolved not in DTYPES:
    raise ValueError(f"{name} must be one of {list(DTYPES)}, got {dtype!r}")
  return resolved


def cache_dtype(config) -> jnp.dtype:
  """Cached keys' and values' dtype: the config's ``dtype`` (default float32)."""
  return jnp.dtype(getattr(config, "dtype", "float32"))


def is_low_precision(dtype) -> bool:
  """Whether ``dtype`` is narrower than float32 (products then accumulate in float32)."""
  return jnp.dtype(dtype).itemsize < 4


def stored_dtype(path, dtype):
  """``dtype`` for a matrix leaf (``path[-1]`` in :data:`MATRICES`), else float32."""
  return jnp.dtype(dtype) if path[-1] in MATRICES else np.dtype(np.float32)


def cast_params(params, dtype) -> dict:
  """``params`` with each leaf in its :func:`stored_dtype`."""
  dtype = check_dtype(dtype)

  def cast(path, x):
    names = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
    return jnp.asarray(x, stored_dtype(names, dtype))
  return jax.tree_util.tree_map_with_path(cast, params)
