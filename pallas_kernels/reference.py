"""Pure-jnp reference for offset attention with certificate statistics.

This module is the single place where the formulas of SPEC sections 3-4 are
written down. ``certkv_jax.offset_attention`` calls it on the XLA path, and the
Pallas kernels are tested against it. It imports nothing from Pallas.

For one query ``q`` and slots ``i`` with keys ``k_i``, values ``v_i``, log
inclusion probabilities ``log_pi_i`` (0 for certain tokens) and validity
``mask_i``::

    l_i = q . k_i * scale - log_pi_i        (logit plus Hajek offset)
    p_i = exp(l_i) / sum_j exp(l_j)         (offset-attention probabilities)
    out = sum_i p_i v_i                     (the Hajek estimator o_hat)
    w_i = 1 - pi_i = -expm1(log_pi_i)
    var_hat = sum_i w_i p_i^2 ||v_i - out||^2
            = (S2 - 2 out . S1 + ||out||^2 S0) / Z^2
    range_hat = max_i w_i p_i ||v_i - out||

with, relative to a running maximum ``m`` of the logits,
``Z = sum e_i``, ``A = sum e_i v_i``, ``S0 = sum w_i e_i^2``,
``S1 = sum w_i e_i^2 v_i``, ``S2 = sum w_i e_i^2 ||v_i||^2``, ``e_i = exp(l_i - m)``.
These sums are accumulated in one sweep; two partial sums over disjoint key
blocks combine by rescaling with ``exp(m_a - m)`` (first-order sums) and
``exp(2 (m_a - m))`` (second-order sums): :func:`merge_partials`, the same
combine used by split-K decoding and by sequence-sharded caches.

The exact range term needs ``out``, which is known only after the sweep. When
the logits are materialised (``block_size=None``) it costs no extra pass. In
the blocked path it costs a second sweep; ``range_mode="bound"`` instead uses
the one-pass upper bound ``(max_i w_i e_i ||v_i|| + ||out|| max_i w_i e_i) / Z``
which follows from the triangle inequality and is never smaller than the exact
value.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

_NEG_INF = -jnp.inf


class Partials(NamedTuple):
  """Unnormalised one-pass statistics over a block of slots (leading dims ...)."""

  m: Array  # [...]      running maximum of the offset logits (-inf if empty)
  z: Array  # [...]      sum_i e_i
  acc: Array  # [..., dv]  sum_i e_i v_i
  s0: Array  # [...]      sum_i w_i e_i^2
  s1: Array  # [..., dv]  sum_i w_i e_i^2 v_i
  s2: Array  # [...]      sum_i w_i e_i^2 ||v_i||^2
  r1: Array  # [...]      max_i w_i e_i            (for the one-pass range bound)
  rv: Array  # [...]      max_i w_i e_i ||v_i||    (for the one-pass range bound)


class Finalized(NamedTuple):
  out: Array  # [..., dv] float32
  lse: Array  # [...]     float32, log sum_i exp(l_i); -inf for an empty row
  var_hat: Array  # [...]  float32
  range_bound: Array  # [...] float32 one-pass upper bound of range_hat


def offset_logits(q, k, log_pi, mask, scale):
  """Offset logits ``q.k * scale - log_pi``, -inf on invalid slots.

  Args:
    q: [..., d] query.
    k: [..., n, d] keys.
    log_pi: [..., n] log inclusion probabilities.
    mask: [..., n] bool validity.
    scale: python float.

  Returns:
    [..., n] float32 logits (leading dims broadcast).
  """
  qf = q.astype(jnp.float32)[..., None, :]  # [..., 1, d]
  kf = jnp.swapaxes(k.astype(jnp.float32), -1, -2)  # [..., d, n]
  s = jnp.matmul(qf, kf, precision=jax.lax.Precision.HIGHEST)[..., 0, :] * scale
  l = s - log_pi.astype(jnp.float32)
  return jnp.where(mask, l, _NEG_INF)


def _safe_max(l, axis=-1):
  m = jnp.max(l, axis=axis)
  return m, jnp.where(jnp.isfinite(m), m, 0.0)


def block_partials(l, v, log_pi, mask) -> Partials:
  """Partial statistics of one block from its offset logits.

  Args:
    l: [..., n] offset logits (-inf where invalid).
    v: [..., n, dv] values.
    log_pi: [..., n] log inclusion probabilities.
    mask: [..., n] bool.
  """
  m, m_safe = _safe_max(l)
  e = jnp.where(mask, jnp.exp(l - m_safe[..., None]), 0.0)  # [..., n]
  w = jnp.where(mask, -jnp.expm1(log_pi.astype(jnp.float32)), 0.0)
  vf = v.astype(jnp.float32)
  we = w * e
  we2 = we * e
  vnorm2 = jnp.sum(vf * vf, axis=-1)  # [..., n]
  hp = jax.lax.Precision.HIGHEST
  acc = jnp.matmul(e[..., None, :], vf, precision=hp)[..., 0, :]
  s1 = jnp.matmul(we2[..., None, :], vf, precision=hp)[..., 0, :]
  return Partials(
      m=m,
      z=jnp.sum(e, axis=-1),
      acc=acc,
      s0=jnp.sum(we2, axis=-1),
      s1=s1,
      s2=jnp.sum(we2 * vnorm2, axis=-1),
      r1=jnp.max(we, axis=-1, initial=0.0),
      rv=jnp.max(we * jnp.sqrt(vnorm2), axis=-1, initial=0.0),
  )


def merge_partials(a: Partials, b: Partials) -> Partials:
  """Combines the statistics of two disjoint blocks (associative, commutative)."""
  m = jnp.maximum(a.m, b.m)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  ca = jnp.where(jnp.isfinite(a.m), jnp.exp(a.m - m_safe), 0.0)
  cb = jnp.where(jnp.isfinite(b.m), jnp.exp(b.m - m_safe), 0.0)
  ca2, cb2 = ca * ca, cb * cb
  return Partials(
      m=m,
      z=ca * a.z + cb * b.z,
      acc=ca[..., None] * a.acc + cb[..., None] * b.acc,
      s0=ca2 * a.s0 + cb2 * b.s0,
      s1=ca2[..., None] * a.s1 + cb2[..., None] * b.s1,
      s2=ca2 * a.s2 + cb2 * b.s2,
      r1=jnp.maximum(ca * a.r1, cb * b.r1),
      rv=jnp.maximum(ca * a.rv, cb * b.rv),
  )


def finalize(p: Partials) -> Finalized:
  """Output, log-normaliser and variance estimate from merged statistics.

  An empty row (no valid slot) gives out = 0, lse = -inf, var_hat = 0: defined,
  never NaN.
  """
  nonempty = p.z > 0
  z = jnp.where(nonempty, p.z, 1.0)
  out = p.acc / z[..., None]
  out_sq = jnp.sum(out * out, axis=-1)
  num = p.s2 - 2.0 * jnp.sum(out * p.s1, axis=-1) + out_sq * p.s0
  # The expanded square can come out slightly negative through float rounding
  # (it is a sum of non-negative terms); clamp that rounding error at zero.
  var_hat = jnp.maximum(num, 0.0) / (z * z)
  lse = jnp.where(nonempty, p.m + jnp.log(z), _NEG_INF)
  range_bound = (p.rv + jnp.sqrt(out_sq) * p.r1) / z
  zero = jnp.zeros_like(var_hat)
  return Finalized(
      out=jnp.where(nonempty[..., None], out, 0.0),
      lse=lse,
      var_hat=jnp.where(nonempty, var_hat, zero),
      range_bound=jnp.where(nonempty, range_bound, zero),
  )


def exact_range(l, v, log_pi, mask, out, lse):
  """``max_i w_i p_i ||v_i - out||`` over valid slots with pi_i < 1.

  Args:
    l: [..., n] offset logits; v: [..., n, dv]; log_pi, mask: [..., n];
    out: [..., dv] final output; lse: [...] final log-normaliser.
  """
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  p = jnp.where(mask, jnp.exp(l - lse_safe[..., None]), 0.0)
  w = jnp.where(mask, -jnp.expm1(log_pi.astype(jnp.float32)), 0.0)
  dev = jnp.linalg.norm(v.astype(jnp.float32) - out[..., None, :], axis=-1)
  return jnp.max(w * p * dev, axis=-1, initial=0.0)


class Reference(NamedTuple):
  out: Array  # [..., dv] float32
  lse: Array  # [...]
  var_hat: Array  # [...]
  range_hat: Array  # [...]


def offset_attention_reference(
    q,
    k,
    v,
    log_pi,
    mask,
    *,
    scale: Optional[float] = None,
    block_size: Optional[int] = None,
    range_mode: str = "exact",
) -> Reference:
  """Reference offset attention with certificate statistics (float32 math).

  Leading dimensions of all inputs must already broadcast (numpy rules).

  Args:
    q: [..., d]; k: [..., n, d]; v: [..., n, dv]; log_pi: [..., n] (<= 0);
    mask: [..., n] bool.
    scale: logit scale, default 1/sqrt(d).
    block_size: None computes all logits at once; an int sweeps key blocks of
      that size with online-softmax rescaling (:func:`merge_partials`), the
      algorithm of the fused kernel.
    range_mode: "exact" (SPEC section 5's b_hat) or "bound" (one-pass upper
      bound, see module docstring).

  Returns:
    Reference(out, lse, var_hat, range_hat).
  """
  if range_mode not in ("exact", "bound"):
    raise ValueError(f"range_mode must be 'exact' or 'bound', got {range_mode!r}")
  d = q.shape[-1]
  n = k.shape[-2]
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  if block_size is None or block_size >= n:
    l = offset_logits(q, k, log_pi, mask, scale)
    fin = finalize(block_partials(l, v, log_pi, mask))
    if range_mode == "exact":
      rng = exact_range(l, v, log_pi, mask, fin.out, fin.lse)
    else:
      rng = fin.range_bound
    return Reference(fin.out, fin.lse, fin.var_hat, rng)
  if block_size < 1:
    raise ValueError(f"block_size must be a positive int or None, got {block_size}")
  return _blocked(q, k, v, log_pi, mask, scale, block_size, range_mode)


def _pad_blocks(x, n_pad, axis, block_size, fill):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n_pad)
  x = jnp.pad(x, pad, constant_values=fill)
  x = jnp.moveaxis(x, axis, 0)
  return x.reshape((-1, block_size) + x.shape[1:])  # [blocks, bs, ...]


def _blocked(q, k, v, log_pi, mask, scale, block_size, range_mode):
  n = k.shape[-2]
  n_pad = (-n) % block_size
  batch = jnp.broadcast_shapes(
      q.shape[:-1], k.shape[:-2], v.shape[:-2], log_pi.shape[:-1], mask.shape[:-1]
  )
  kb = _pad_blocks(k, n_pad, k.ndim - 2, block_size, 0)  # [nb, bs, ..., d]
  vb = _pad_blocks(v, n_pad, v.ndim - 2, block_size, 0)
  lb = _pad_blocks(log_pi, n_pad, log_pi.ndim - 1, block_size, 0)
  mb = _pad_blocks(mask, n_pad, mask.ndim - 1, block_size, False)

  def unblock(x, feature_dims):
    # [bs, ..., *f] -> [..., bs, *f]
    return jnp.moveaxis(x, 0, x.ndim - 1 - feature_dims)

  def logits_of(kb_i, lb_i, mb_i):
    return offset_logits(q, unblock(kb_i, 1), unblock(lb_i, 0), unblock(mb_i, 0), scale)

  dv = v.shape[-1]
  init = Partials(
      m=jnp.full(batch, _NEG_INF, jnp.float32),
      z=jnp.zeros(batch, jnp.float32),
      acc=jnp.zeros(batch + (dv,), jnp.float32),
      s0=jnp.zeros(batch, jnp.float32),
      s1=jnp.zeros(batch + (dv,), jnp.float32),
      s2=jnp.zeros(batch, jnp.float32),
      r1=jnp.zeros(batch, jnp.float32),
      rv=jnp.zeros(batch, jnp.float32),
  )

  def sweep(carry, blk):
    kb_i, vb_i, lb_i, mb_i = blk
    l = logits_of(kb_i, lb_i, mb_i)
    part = block_partials(l, unblock(vb_i, 1), unblock(lb_i, 0), unblock(mb_i, 0))
    return merge_partials(carry, part), None

  total, _ = jax.lax.scan(sweep, init, (kb, vb, lb, mb))
  fin = finalize(total)
  if range_mode == "bound":
    return Reference(fin.out, fin.lse, fin.var_hat, fin.range_bound)

  def range_sweep(carry, blk):
    kb_i, vb_i, lb_i, mb_i = blk
    l = logits_of(kb_i, lb_i, mb_i)
    r = exact_range(l, unblock(vb_i, 1), unblock(lb_i, 0), unblock(mb_i, 0), fin.out, fin.lse)
    return jnp.maximum(carry, r), None

  rng, _ = jax.lax.scan(range_sweep, jnp.zeros(batch, jnp.float32), (kb, vb, lb, mb))
  return Reference(fin.out, fin.lse, fin.var_hat, rng)
