"""The dtype option: a model's weights and KV caches in float32 (default) or bfloat16.

A model loaded in bfloat16 (``load_model(spec, dtype="bfloat16")``, the
loaders' ``dtype``) stores its matrices -- projection kernels and the
embedding, nearly all of its bytes -- in bfloat16 (:func:`stored_dtype`), and
its config says ``dtype="bfloat16"``. Then every matrix product takes
bfloat16 operands and accumulates in float32 (``models.llama``), and the
caches hold bfloat16 keys and values (:func:`cache_dtype`) while their per-slot
statistics stay float32: half the bytes a decode step reads. Norm scales and
biases stay float32: they are a few KB, and the norm multiplies in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ("float32", "bfloat16")
# Parameters stored in the model's dtype (the matrices); every other leaf stays float32.
MATRICES = ("kernel", "embedding")


def check_dtype(dtype, name: str = "dtype") -> str:
  """The dtype's name, one of :data:`DTYPES` (a name or a numpy / jnp dtype).

  Raises:
    ValueError naming ``name`` and the allowed values.
  """
  try:
    resolved = jnp.dtype(dtype).name
  except (TypeError, ValueError):
    resolved = None
  if isinstance(dtype, bool) or dtype is None or resolved not in DTYPES:
    raise ValueError(f"{name} must be one of {list(DTYPES)}, got {dtype!r}")
  return resolved


def cache_dtype(config) -> jnp.dtype:
  """The dtype of a model's cached keys and values: its config's ``dtype`` (float32
  for a config without one); the per-slot statistics are float32 whatever it is."""
  return jnp.dtype(getattr(config, "dtype", "float32"))


def is_low_precision(dtype) -> bool:
  """Whether ``dtype`` is narrower than float32 (bfloat16, float16): its products
  must then ask for float32 accumulation."""
  return jnp.dtype(dtype).itemsize < 4


def stored_dtype(path, dtype):
  """The dtype the parameter at ``path`` (a tuple of names ending with the leaf's,
  e.g. ``("q_proj", "kernel")``) is stored in: ``dtype`` for the matrices, float32
  for the rest."""
  return jnp.dtype(dtype) if path[-1] in MATRICES else np.dtype(np.float32)


def cast_params(params, dtype) -> dict:
  """``params`` (``{"params": ...}``, stacked or per-layer) with the matrices in
  ``dtype`` and every other leaf in float32 (:func:`stored_dtype`), e.g. randomly
  initialised float32 params for a ``dtype="bfloat16"`` config."""
  dtype = check_dtype(dtype)

  def cast(path, x):
    names = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
    return jnp.asarray(x, stored_dtype(names, dtype))
  return jax.tree_util.tree_map_with_path(cast, params)
