"""From the per-head attention radius to damage in the residual stream (method, section 11).

Head ``h`` writes its error through its rows ``W_o^h`` of the output projection, so
``||e_h W_o^h|| <= ||W_o^h||_2 r_h``; summed over heads and layers: the direct damage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate

Array = jax.Array

KINDS = ("spectral", "frobenius_rms")


def _as_float(x) -> Array:
  """``x`` as a jnp float array of at least float32 (bfloat16 weights upcast)."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    x = x.astype(jnp.float32)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _head_slices(name: str, w_o, n_heads: int, head_dim: int) -> Array:
  """[..., n_heads * head_dim, hidden] -> [..., n_heads, head_dim, hidden]."""
  n_heads = _validate.check_positive_int("n_heads", n_heads)
  head_dim = _validate.check_positive_int("head_dim", head_dim)
  w_o = _as_float(w_o)
  if w_o.ndim < 2 or w_o.shape[-2] != n_heads * head_dim:
    raise ValueError(f"{name} must have shape [..., n_heads*head_dim={n_heads * head_dim}, "
                     f"hidden], got {w_o.shape}")
  _validate.check_finite(name, w_o)
  return w_o.reshape(w_o.shape[:-2] + (n_heads, head_dim, w_o.shape[-1]))


def head_output_norms(w_o, n_heads: int, head_dim: int, kind: str = "spectral") -> Array:
  """Per-head gain ``[..., n_heads]`` of ``w_o`` [..., n_heads*head_dim, hidden].

  ``kind``: "spectral" (largest singular value of each head's rows, a bound) or
  "frobenius_rms" (``||W_o^h||_F / sqrt(head_dim)``, a typical gain). Raises
  ValueError for an unknown ``kind``, a mismatched shape, sizes < 1 or (outside
  jit) non-finite ``w_o``.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  w = _head_slices("w_o", w_o, n_heads, head_dim)  # [..., H, hd, hidden]
  if kind == "spectral":
    return jnp.linalg.svd(w, compute_uv=False)[..., 0]
  return jnp.sqrt(jnp.sum(w * w, axis=(-2, -1)) / head_dim)


def _check_norms_radius(radius: Array, norms: Array) -> None:
  if norms.ndim != 2:
    raise ValueError(f"norms must be [n_layers, n_heads], got shape {norms.shape}")
  if radius.ndim < 2 or radius.shape[-2:] != norms.shape:
    raise ValueError(f"radius must have shape [..., n_layers={norms.shape[0]}, "
                     f"n_heads={norms.shape[1]}] like norms, got {radius.shape}")
  _validate.check_finite("norms", norms)
  _validate.check_in_range("norms", norms, 0.0, np.inf)
  r = _validate.concrete_array(radius)
  if r is not None:
    r = r.astype(np.float64)
    bad = ~np.isnan(r) & ~(r >= 0)
    if bad.any():
      raise ValueError(f"radius must be in [0, inf] or NaN (not certified); got "
                       f"{r[bad].ravel()[:5]}")


def projected_radius(radius, norms) -> Array:
  """Per-layer bound ``sum_h norms[l, h] * radius[..., l, h]``, shape [..., n_layers].

  A NaN radius (uncertified head) makes its layer NaN; a zero norm contributes
  0 even against an infinite radius. Raises ValueError for bad shapes or (outside
  jit) negative radii or negative / non-finite norms.
  """
  radius, norms = _as_float(radius), _as_float(norms)
  _check_norms_radius(radius, norms)
  terms = norms * radius  # [..., L, H]
  terms = jnp.where((norms == 0) & ~jnp.isnan(radius), 0.0, terms)
  return jnp.sum(terms, axis=-1)


def damage_score(radius, norms) -> Array:
  """Sum over layers of :func:`projected_radius`: ``[...]`` (NaN if any head is NaN)."""
  return jnp.sum(projected_radius(radius, norms), axis=-1)


def projected_error(e, w_o, n_heads: int, head_dim: int) -> Array:
  """Brute-force truth ``||e_h @ W_o^h||`` per head, [..., n_heads] (tests and evaluation).

  ``e`` [..., L, H, hd] goes with ``w_o`` [L, H*hd, hidden] (leading axes broadcast).
  """
  w = _head_slices("w_o", w_o, n_heads, head_dim)  # [*W, H, hd, hidden]
  e = _as_float(e)
  if e.ndim < 2 or e.shape[-2:] != (n_heads, head_dim):
    raise ValueError(f"e must have shape [..., n_heads={n_heads}, head_dim={head_dim}], "
                     f"got {e.shape}")
  lead_w = w.shape[:-3]
  try:
    jnp.broadcast_shapes(e.shape[:-2], lead_w)
  except ValueError as err:
    raise ValueError(f"e's leading shape {e.shape[:-2]} does not broadcast against w_o's "
                     f"leading shape {lead_w}") from err
  out = jnp.einsum("...hd,...hdk->...hk", e, w, precision=jax.lax.Precision.HIGHEST)
  return jnp.linalg.norm(out, axis=-1)
