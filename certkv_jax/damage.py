"""From the per-head attention radius to damage in the residual stream.

The certificate bounds the error ``e_h = o_hat_h - o_h`` of one query head's
attention output (``[head_dim]``) by a radius ``r_h``. The layer writes that
output into the residual stream through the head's rows of the output
projection, ``W_o^h = W_o[h*head_dim:(h+1)*head_dim, :]`` (``[head_dim,
hidden]``), so the head's perturbation of the residual stream is
``e_h @ W_o^h`` and (method, section 11)

    ||e_h @ W_o^h|| <= ||W_o^h||_2 ||e_h|| <= ||W_o^h||_2 r_h

with ``||.||_2`` the largest singular value. Summing over the heads of a layer
(triangle inequality) bounds the attention block's total perturbation of the
residual stream; :func:`projected_radius` computes that per layer and
:func:`damage_score` sums it over layers.

This is the direct, one-layer effect: what each layer's attention writes
wrongly into the residual stream at this step. It is not the effect on the
logits, which passes through every later layer, the final norm and the
unembedding and is neither bounded nor estimated here; the learned predictor
of :mod:`certkv_jax.damage_predictor` maps such scores (and other features)
to output damage such as the KL divergence of the next-token distribution.

The spectral norm is a worst case over error directions. ``kind=
"frobenius_rms"`` gives instead ``||W_o^h||_F / sqrt(head_dim)``, the root
mean square gain for an error direction drawn uniformly on the sphere
(``E ||u W||^2 = ||W||_F^2 / head_dim`` for a uniform unit ``u``): a typical
value, not a bound.

Pure JAX; the model's ``o_proj`` kernel (``[L, n_heads*head_dim, hidden]``)
is passed in as an array, so this module does not import ``models``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _checks

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
  n_heads = _checks.check_positive_int("n_heads", n_heads)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  w_o = _as_float(w_o)
  if w_o.ndim < 2 or w_o.shape[-2] != n_heads * head_dim:
    raise ValueError(f"{name} must have shape [..., n_heads*head_dim={n_heads * head_dim}, "
                     f"hidden], got {w_o.shape}")
  _checks.check_finite(name, w_o)
  return w_o.reshape(w_o.shape[:-2] + (n_heads, head_dim, w_o.shape[-1]))


def head_output_norms(w_o, n_heads: int, head_dim: int, kind: str = "spectral") -> Array:
  """Per-head gain of the output projection, ``[..., n_heads]``.

  Args:
    w_o: [..., n_heads*head_dim, hidden] output projection kernel (leading
      axes e.g. layers: the model's ``layers/o_proj/kernel``); head ``h`` owns
      rows ``h*head_dim:(h+1)*head_dim``. Must be finite.
    n_heads: number of query heads (int >= 1).
    head_dim: per-head dimension (int >= 1).
    kind: "spectral" -- largest singular value of the head's ``[head_dim,
      hidden]`` slice, the exact bound ``max_u ||u W_o^h|| / ||u||``; or
      "frobenius_rms" -- ``||W_o^h||_F / sqrt(head_dim)``, the RMS gain for a
      uniformly random error direction (a typical value, not a bound).

  Returns:
    [..., n_heads] float (float32 unless ``w_o`` is float64), >= 0.

  Raises:
    ValueError: unknown ``kind``, ``w_o.shape[-2] != n_heads*head_dim``,
      ``n_heads``/``head_dim`` < 1, or (outside jit) non-finite ``w_o``.
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
  _checks.check_finite("norms", norms)
  _checks.check_in_range("norms", norms, 0.0, np.inf)
  r = _checks.concrete_array(radius)
  if r is not None:
    r = r.astype(np.float64)
    bad = ~np.isnan(r) & ~(r >= 0)
    if bad.any():
      raise ValueError(f"radius must be in [0, inf] or NaN (not certified); got "
                       f"{r[bad].ravel()[:5]}")


def projected_radius(radius, norms) -> Array:
  """Per-layer bound on the residual-stream perturbation of the attention block.

  ``out[..., l] = sum_h norms[l, h] * radius[..., l, h]``: with spectral
  ``norms`` (:func:`head_output_norms`) and radii that bound ``||e_h||``,
  this bounds ``||sum_h e_h @ W_o^h||``, the error layer ``l``'s attention
  adds to the residual stream (before any bias, which eviction does not
  change).

  A NaN radius (deterministic designs: not certified) makes its layer NaN:
  an uncertified head leaves the layer uncertified, and nothing is zeroed.
  An infinite radius gives an infinite layer bound, except on a head whose
  norm is exactly 0, which writes nothing into the residual stream and
  contributes 0 (never ``0 * inf = NaN``).

  Args:
    radius: [..., n_layers, n_heads] radii per query head, in [0, inf] or NaN.
    norms: [n_layers, n_heads] finite per-head gains, >= 0.

  Returns:
    [..., n_layers] float.

  Raises:
    ValueError: shapes that do not match, or (outside jit) negative radii
      or negative / non-finite norms.
  """
  radius, norms = _as_float(radius), _as_float(norms)
  _check_norms_radius(radius, norms)
  terms = norms * radius  # [..., L, H]
  terms = jnp.where((norms == 0) & ~jnp.isnan(radius), 0.0, terms)
  return jnp.sum(terms, axis=-1)


def damage_score(radius, norms) -> Array:
  """Sum over layers of :func:`projected_radius`: ``[...]`` (NaN if any head is NaN).

  Args:
    radius: [..., n_layers, n_heads] radii per query head, in [0, inf] or NaN.
    norms: [n_layers, n_heads] finite per-head gains, >= 0.

  Returns:
    [...] float: the summed direct (one-layer) perturbations of all layers.
  """
  return jnp.sum(projected_radius(radius, norms), axis=-1)


def projected_error(e, w_o, n_heads: int, head_dim: int) -> Array:
  """Brute-force truth ``||e_h @ W_o^h||`` per head (tests and evaluation).

  Args:
    e: [..., n_heads, head_dim] per-head attention errors (e.g. the shadow
      cache's ``o_hat - o`` in evaluation mode).
    w_o: [*W, n_heads*head_dim, hidden] output projection; its leading axes
      ``*W`` (e.g. layers) broadcast against the trailing leading axes of
      ``e`` (numpy rules), so ``e`` [..., L, H, hd] goes with ``w_o``
      [L, H*hd, hidden].
    n_heads, head_dim: as in :func:`head_output_norms`.

  Returns:
    [..., n_heads] float: the norm of each head's residual-stream error.

  Raises:
    ValueError: mismatched shapes, or (outside jit) non-finite ``w_o``.
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
