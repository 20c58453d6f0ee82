"""Pure-jnp reference for offset attention with certificate statistics.

The one implementation of the single-pass sums of method, sections 4 and 9:
``certkv_jax.offset_attention`` runs it on the XLA path, the Pallas kernels call
``online_update`` per tile and are tested against ``grouped_reference``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_kernels import precision as precision_lib

Array = jax.Array

_NEG_INF = -jnp.inf
# Finite "no valid slot yet" for running maxima (kernels avoid inf - inf).
M_EMPTY = -1e30


class Partials(NamedTuple):
  """Unnormalised one-pass statistics per query row ``[...]`` (method, section 9)."""

  m: Array  # [...]      running maximum of the offset logits (M_EMPTY if none)
  z: Array  # [...]      sum_i e_i
  acc: Array  # [..., dv]  sum_i e_i v_i
  c: Array  # [..., dv]  centre of the second-order sums (see ``online_update``)
  s0: Array  # [...]      sum_i w_i e_i^2
  s1: Array  # [..., dv]  sum_i w_i e_i^2 (v_i - c)
  s2: Array  # [...]      sum_i w_i e_i^2 ||v_i - c||^2
  r1: Array  # [...]      max_i w_i e_i              (for the one-pass range bound)
  rv: Array  # [...]      max_i w_i e_i ||v_i - c||  (for the one-pass range bound)


class Finalized(NamedTuple):
  out: Array  # [..., dv] float32
  lse: Array  # [...]     float32, log sum_i exp(l_i); -inf for an empty row
  var_hat: Array  # [...]  float32
  range_bound: Array  # [...] float32 one-pass upper bound of range_hat


def empty_partials(rows_shape, dv: int) -> Partials:
  z = jnp.zeros(rows_shape, jnp.float32)
  zv = jnp.zeros(tuple(rows_shape) + (dv,), jnp.float32)
  return Partials(m=jnp.full(rows_shape, M_EMPTY, jnp.float32), z=z, acc=zv, c=zv, s0=z,
                  s1=zv, s2=z, r1=z, rv=z)


def one_minus_pi(offset):
  """``w = 1 - pi = 1 - exp(-offset)`` for ``offset >= 0``, as ``2t / (1 + t)``,
  ``t = tanh(offset / 2)``: accurate near pi = 1 without expm1 (absent on TPU)."""
  t = jnp.tanh(0.5 * offset)
  return 2.0 * t / (1.0 + t)


class StoredNorms(NamedTuple):
  """Stored ``||v_i - ref||^2`` (``KVCache.v_sq`` about ``v_ref``), read by the
  second-order sums instead of a pass over the values (method, section 4)."""

  sq: Array  # [..., n] (``[..., 1, n]`` inside online_update) ||v_i - ref||^2
  ref: Array  # [..., dv] (``[..., 1, dv]`` inside) the reference; 0 gives ||v_i||^2


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
  """Numerics of :func:`online_update`, one value for all its callers.

  Attributes:
    precision: of the float32 value products (default HIGHEST, not TF32).
    second_order: False skips the certificate statistics (they stay zero).
    stacked_matmul: ``e @ v`` and ``w e^2 @ v`` as one matmul over stacked
      rows; False uses two (Triton concatenates only along the last axis).
    center: optional [..., 1, dv] centre of the second-order sums instead of
      the tile mean; an array, so options holding one are not hashable.
    split_values: bfloat16 values multiply as stored (:func:`split_matmul`),
      with no float32 copy of them; float32 values are unaffected.
  """

  precision: Optional[jax.lax.Precision] = jax.lax.Precision.HIGHEST
  second_order: bool = True
  stacked_matmul: bool = True
  center: Optional[Array] = None
  split_values: bool = False


def _split(a, dtype):
  """float32 ``a`` [..., r, m] as bfloat16 rows ``[hi; lo]`` [..., 2r, m], ``hi + lo = a`` to
  16 significant bits (relative error below 2^-16)."""
  return jnp.concatenate(precision_lib.split_parts(a, dtype), axis=-2)


def split_matmul(a, v, stacked: bool = True):
  """``a @ v`` for float32 ``a`` [..., r, n] and bfloat16 ``v`` [..., n, dv], reading ``v``
  as stored: one product of ``a``'s two bfloat16 parts (:func:`_split`), accumulating in
  float32, so the values are never copied to float32. ``stacked=False``: two products,
  one per part (Triton concatenates only along the last axis)."""
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.DEFAULT,
                          preferred_element_type=jnp.float32)
  if not stacked:
    hi, lo = precision_lib.split_parts(a, v.dtype)
    return dot(hi, v) + dot(lo, v)
  both = dot(_split(a, v.dtype), v)
  rows = a.shape[-2]
  return both[..., :rows, :] + both[..., rows:, :]


def split_rows(v, x):
  """``x . v_i`` for each slot: float32 ``x`` [..., r, dv] against bfloat16 ``v``
  [..., n, dv] -> [..., r, n] float32, ``v`` read as stored (:func:`split_matmul`)."""
  both = jnp.swapaxes(jnp.matmul(v, jnp.swapaxes(_split(x, v.dtype), -1, -2),
                                 precision=jax.lax.Precision.DEFAULT,
                                 preferred_element_type=jnp.float32), -1, -2)
  rows = x.shape[-2]
  return both[..., :rows, :] + both[..., rows:, :]


def online_update(carry: Partials, l, v, w, valid, valid_col=None, *, sqnorm=None,
                  options: UpdateOptions = UpdateOptions()) -> Partials:
  """Folds one block of slots into running statistics (online softmax).

  The arithmetic of the fused kernel (the Pallas kernels call it per tile).
  Second-order sums are about a centre ``c``, the mean of the valid values of
  the first non-empty block (method, sections 4 and 9).

  Args:
    carry: statistics so far, rows ``[..., g]``.
    l: [..., g, n] offset logits of the block (any value where invalid).
    v: [..., n, dv] values of the block.
    w: [..., 1 or g, n] ``1 - pi`` of each slot (ignored where invalid).
    valid: [..., 1 or g, n] bool.
    valid_col: [..., n, 1] bool, slots valid for any row (default: the first
      row of ``valid``); values outside it are never read; it sets the centre.
    sqnorm: optional :class:`StoredNorms` (``sq`` [..., 1, n], ``ref``
      [..., 1, dv]), read only on valid slots: the second-order sum then comes
      from the stored norms without a pass over the values (method, section 4).
    options: :class:`UpdateOptions`.

  Returns:
    Updated statistics.
  """
  precision, center = options.precision, options.center
  dot = functools.partial(jnp.matmul, precision=precision,
                          preferred_element_type=jnp.float32)
  if valid_col is None:
    valid_col = jnp.swapaxes(valid[..., :1, :], -1, -2)
  vf = jnp.where(valid_col, v.astype(jnp.float32), 0.0)  # [..., n, dv]
  if options.split_values and v.dtype == jnp.bfloat16:  # products on the values as stored
    vs = jnp.where(valid_col, v, jnp.zeros((), v.dtype))
    v_dot = functools.partial(split_matmul, v=vs, stacked=options.stacked_matmul)
    v_rows = functools.partial(split_rows, vs)
  else:
    v_dot = lambda a: dot(a, vf)
    v_rows = lambda x: jnp.swapaxes(dot(vf, jnp.swapaxes(x, -1, -2)), -1, -2)
  if not options.second_order:
    m_new = jnp.maximum(carry.m, jnp.max(jnp.where(valid, l, M_EMPTY), axis=-1))
    r = jnp.exp(carry.m - m_new)
    e = jnp.where(valid, jnp.exp(l - m_new[..., None]), 0.0)
    return carry._replace(m=m_new, z=r * carry.z + jnp.sum(e, axis=-1),
                          acc=r[..., None] * carry.acc + v_dot(e))
  # Centre: mean of this block's valid values, adopted while the carry is empty.
  if center is None:
    count = jnp.sum(valid_col.astype(jnp.float32), axis=-2, keepdims=True)  # [..., 1, 1]
    center = jnp.sum(vf, axis=-2, keepdims=True) / jnp.maximum(count, 1.0)  # [..., 1, dv]
  started = jnp.max(carry.z, axis=-1, keepdims=True)[..., None] > 0  # [..., 1, 1]
  c1 = jnp.where(started, jnp.mean(carry.c, axis=-2, keepdims=True), center)
  m_blk = jnp.max(jnp.where(valid, l, M_EMPTY), axis=-1)
  m_new = jnp.maximum(carry.m, m_blk)
  r = jnp.exp(carry.m - m_new)
  r2 = r * r
  e = jnp.where(valid, jnp.exp(l - m_new[..., None]), 0.0)  # [..., g, n]
  we = jnp.where(valid, w, 0.0) * e
  we2 = we * e
  s0 = jnp.sum(we2, axis=-1)
  # One matmul over the values for first- and second-order sums.
  if options.stacked_matmul:
    both = v_dot(jnp.concatenate([e, we2], axis=-2))  # [..., 2g, dv]
    rows = e.shape[-2]
    acc_blk, s1_raw = both[..., :rows, :], both[..., rows:, :]
  else:
    acc_blk, s1_raw = v_dot(e), v_dot(we2)
  if sqnorm is None:
    dvc = jnp.where(valid_col, vf - c1, 0.0)
    vn2 = jnp.sum(dvc * dvc, axis=-1)[..., None, :]  # [..., 1, n]: ||v - c||^2 per slot
    s2_blk = jnp.sum(we2 * vn2, axis=-1)
  else:  # ||v - r||^2 stored at append time: the sum about c from S1's raw sum
    sq = jnp.where(jnp.swapaxes(valid_col, -1, -2), sqnorm.sq.astype(jnp.float32), 0.0)
    ref = sqnorm.ref.astype(jnp.float32)  # [..., 1, dv]
    cr = c1 - ref
    cr_sq = jnp.sum(cr * cr, axis=-1)  # [..., 1]
    s1_ref = s1_raw - s0[..., None] * ref  # sum w e^2 (v - r)
    s2_blk = (jnp.sum(we2 * sq, axis=-1) - 2.0 * jnp.sum(cr * s1_ref, axis=-1)
              + cr_sq * s0)
    # [..., 1, n]: the range bound's (v - r) . (c - r).
    v_c = v_rows(cr) - jnp.sum(ref * cr, axis=-1)[..., None]
    vn2 = jnp.maximum(sq - 2.0 * v_c + cr_sq[..., None], 0.0)
  return Partials(
      m=m_new,
      z=r * carry.z + jnp.sum(e, axis=-1),
      acc=r[..., None] * carry.acc + acc_blk,
      c=jnp.broadcast_to(c1, carry.c.shape),
      s0=r2 * carry.s0 + s0,
      s1=r2[..., None] * carry.s1 + (s1_raw - s0[..., None] * c1),
      s2=r2 * carry.s2 + s2_blk,
      r1=jnp.maximum(r * carry.r1, jnp.max(we, axis=-1)),
      rv=jnp.maximum(r * carry.rv, jnp.max(we * jnp.sqrt(vn2), axis=-1)),
  )


def combine(p: Partials, axis: int) -> Partials:
  """Merges statistics of disjoint slot sets stacked along ``axis`` of ``m``'s dims
  (split-K blocks, sequence shards), moving second-order sums to the centre of
  the part with the largest running max (method, section 9)."""
  axis = axis % p.m.ndim
  m = jnp.max(p.m, axis=axis)
  lead = jnp.argmax(p.m, axis=axis)
  c = jnp.squeeze(jnp.take_along_axis(
      p.c, jnp.expand_dims(lead, axis)[..., None], axis=axis), axis)
  dc = p.c - jnp.expand_dims(c, axis)  # [..., parts, ..., dv]
  s1c = p.s1 + p.s0[..., None] * dc
  s2c = p.s2 + 2.0 * jnp.sum(dc * p.s1, axis=-1) + jnp.sum(dc * dc, axis=-1) * p.s0
  rvc = p.rv + jnp.linalg.norm(dc, axis=-1) * p.r1
  r = jnp.exp(p.m - jnp.expand_dims(m, axis))
  r2 = r * r
  return Partials(
      m=m,
      z=jnp.sum(r * p.z, axis=axis),
      acc=jnp.sum(r[..., None] * p.acc, axis=axis),
      c=c,
      s0=jnp.sum(r2 * p.s0, axis=axis),
      s1=jnp.sum(r2[..., None] * s1c, axis=axis),
      s2=jnp.sum(r2 * s2c, axis=axis),
      r1=jnp.max(r * p.r1, axis=axis),
      rv=jnp.max(r * rvc, axis=axis),
  )


def merge_partials(a: Partials, b: Partials) -> Partials:
  """Combines the statistics of two disjoint slot sets (associative)."""
  return combine(jax.tree_util.tree_map(lambda x, y: jnp.stack([x, y]), a, b), 0)


def finalize(p: Partials) -> Finalized:
  """Output, lse and variance from merged statistics; an empty row gives out = 0,
  lse = -inf, var_hat = 0 (never NaN)."""
  nonempty = p.z > 0
  z = jnp.where(nonempty, p.z, 1.0)
  out = p.acc / z[..., None]
  oc = out - p.c
  oc_sq = jnp.sum(oc * oc, axis=-1)
  num = p.s2 - 2.0 * jnp.sum(oc * p.s1, axis=-1) + oc_sq * p.s0
  # A sum of non-negative terms: clamp float rounding below zero.
  var_hat = jnp.maximum(num, 0.0) / (z * z)
  lse = jnp.where(nonempty, p.m + jnp.log(z), _NEG_INF)
  range_bound = (p.rv + jnp.sqrt(oc_sq) * p.r1) / z
  zero = jnp.zeros_like(var_hat)
  return Finalized(
      out=jnp.where(nonempty[..., None], out, 0.0),
      lse=lse,
      var_hat=jnp.where(nonempty, var_hat, zero),
      range_bound=jnp.where(nonempty, range_bound, zero),
  )


def slot_logits(q, k, offset, valid, scale, split_values: bool = False):
  """``q . k * scale + offset`` for rows q [..., g, d] and keys k [..., n, d].

  Computed as ``k @ q^T`` so that XLA's CPU matmul reads the keys in place;
  ``split_values``: float32 rows against bfloat16 keys read the keys as stored
  (:func:`split_rows`).
  """
  if split_values and k.dtype == jnp.bfloat16 and q.dtype == jnp.float32:
    s = split_rows(k, q)
  else:
    k, q, precision = precision_lib.product_operands(k, q)
    s = jnp.swapaxes(jnp.matmul(k, jnp.swapaxes(q, -1, -2), precision=precision,
                                preferred_element_type=jnp.float32), -1, -2)
  return jnp.where(valid, s * scale + offset, _NEG_INF)


def offset_logits(q, k, log_pi, mask, scale, split_values: bool = False):
  """Offset logits ``q.k * scale - log_pi`` [..., n], -inf on invalid slots.

  Args: q [..., d]; k [..., n, d]; log_pi, mask [..., n]; scale float; split_values
  as :func:`slot_logits`."""
  l = slot_logits(q[..., None, :], k, -log_pi.astype(jnp.float32)[..., None, :],
                  mask[..., None, :], scale, split_values)
  return l[..., 0, :]


def offset_probs(q, k, log_pi, mask, scale, split_values: bool = False):
  """Offset-attention probabilities ``p_i`` [..., n] over :func:`offset_logits` (0 on
  invalid slots; a row with no valid slot is all 0)."""
  l = offset_logits(q, k, log_pi, mask, scale, split_values)
  m = jnp.max(l, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(mask, jnp.exp(l - m), 0.0)
  z = jnp.sum(e, axis=-1, keepdims=True)
  return e / jnp.where(z > 0, z, 1.0)


def probabilities(l, lse, valid):
  """``p_i = exp(l_i - lse)`` [..., g, n] on valid slots, 0 elsewhere (an empty row: all 0)."""
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.where(valid, jnp.exp(l - lse_safe[..., None]), 0.0)


def exact_range(l, v, w, valid, out, lse, sqnorm=None, split_values: bool = False):
  """``max_i w_i p_i ||v_i - out||`` over valid slots (rows [..., g]).

  Args:
    l: [..., g, n] offset logits; v: [..., n, dv]; w, valid: [..., 1|g, n];
    out: [..., g, dv] final output; lse: [..., g] final log-normaliser.
    sqnorm: optional :class:`StoredNorms`: the distances then come from one
      matmul over the values instead of a ``[g, n, dv]`` pass (method, section 4).
    split_values: that matmul reads bfloat16 values as stored (:func:`split_rows`).
  """
  p = probabilities(l, lse, valid)
  w = jnp.where(valid, w, 0.0)
  if sqnorm is None:
    dev = jnp.linalg.norm(v.astype(jnp.float32)[..., None, :, :] - out[..., :, None, :],
                          axis=-1)
  else:
    valid_any = jnp.any(valid, axis=-2, keepdims=True)  # [..., 1, n]
    ref = sqnorm.ref.astype(jnp.float32)  # [..., 1, dv]
    o_r = out - ref  # [..., g, dv]
    if split_values and v.dtype == jnp.bfloat16:
      v_o = split_rows(jnp.where(jnp.swapaxes(valid_any, -1, -2), v, jnp.zeros((), v.dtype)),
                       o_r)  # [..., g, n]
    else:
      vf = jnp.where(jnp.swapaxes(valid_any, -1, -2), v.astype(jnp.float32), 0.0)
      v_o = jnp.swapaxes(jnp.matmul(vf, jnp.swapaxes(o_r, -1, -2),
                                    precision=jax.lax.Precision.HIGHEST), -1, -2)  # [..., g, n]
    v_o = v_o - jnp.sum(ref * o_r, axis=-1, keepdims=True)  # (v - r) . (out - r)
    d2 = (jnp.where(valid_any, sqnorm.sq, 0.0) - 2.0 * v_o
          + jnp.sum(o_r * o_r, axis=-1, keepdims=True))
    dev = jnp.sqrt(jnp.maximum(d2, 0.0))
  dev = jnp.where(valid, dev, 0.0)  # values of invalid slots are never read
  return jnp.max(w * p * dev, axis=-1, initial=0.0)


class Reference(NamedTuple):
  out: Array  # [..., dv] float32
  lse: Array  # [...]
  var_hat: Array  # [...]
  range_hat: Array  # [...]
  probs: Optional[Array] = None  # [..., n] float32 p_i (0 on invalid slots), when asked for


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
  """:func:`grouped_reference` with one query per leading index (g = 1).

  Args: q [..., d]; k [..., n, d]; v [..., n, dv]; log_pi, mask [..., n].
  """
  res = grouped_reference(q[..., None, :], k, v, log_pi, mask, scale=scale,
                          config=ReferenceConfig(block_size=block_size, range_mode=range_mode))
  return Reference(res.out[..., 0, :], res.lse[..., 0], res.var_hat[..., 0],
                   res.range_hat[..., 0])


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
  """How :func:`grouped_reference` sweeps and what it returns (static, hashable).

  Attributes:
    block_size: None folds all slots in one block; an int sweeps key blocks of
      that size (the kernel's algorithm).
    range_mode: "exact" (b_hat, method, section 5) or "bound" (one-pass bound).
    with_stats: False computes the offset attention alone (statistics zero).
    with_probs: also return the probabilities ``p_i`` from the same logits, so a
      design's fold needs no second pass over the keys (one block only).
    split_values: products read bfloat16 keys and values as stored
      (:func:`slot_logits`, ``UpdateOptions``).
  """

  block_size: Optional[int] = None
  range_mode: str = "exact"
  with_stats: bool = True
  with_probs: bool = False
  split_values: bool = False


def grouped_reference(
    q,
    k,
    v,
    log_pi,
    mask,
    *,
    scale: Optional[float] = None,
    config: ReferenceConfig = ReferenceConfig(),
    value_sqnorm=None,
) -> Reference:
  """Reference offset attention with certificate statistics (float32 math).

  The ``g`` query rows of each leading index share its keys and values (a GQA
  group, or a chunk's queries).

  Args:
    q: [..., g, d]; k: [..., n, d]; v: [..., n, dv]; log_pi: [..., n] (<= 0);
    mask: [..., n] bool. Leading dims broadcast (numpy rules).
    scale: logit scale, default 1/sqrt(d).
    config: :class:`ReferenceConfig` (block size, range mode, statistics on/off).
    value_sqnorm: optional :class:`StoredNorms` (``sq`` [..., n], ``ref``
      [..., dv]; the cache's ``v_sq`` and ``v_ref``) or an array [..., n] of
      ``||v_i||^2`` (ref 0); same result up to float32 rounding.

  Raises:
    ValueError: for a bad ``range_mode``, ``block_size`` or ``value_sqnorm`` shape.

  Returns:
    Reference(out [..., g, dv], lse, var_hat, range_hat [..., g]).
  """
  block_size, range_mode, with_stats = config.block_size, config.range_mode, config.with_stats
  if range_mode not in ("exact", "bound"):
    raise ValueError(f"range_mode must be 'exact' or 'bound', got {range_mode!r}")
  if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
    raise ValueError(f"block_size must be a positive int or None, got {block_size}")
  if config.with_probs and block_size is not None and block_size < k.shape[-2]:
    raise ValueError(f"with_probs needs one block (block_size None or >= n={k.shape[-2]}), "
                     f"got block_size {block_size}")
  g, d, n, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], log_pi.shape[:-1],
                              mask.shape[:-1])
  rows = lead + (g,)
  given_sq = None
  if value_sqnorm is not None:
    sq, ref = (value_sqnorm if isinstance(value_sqnorm, StoredNorms)
               else (value_sqnorm, jnp.zeros((dv,), jnp.float32)))
    if sq.shape[-1:] != (n,) or ref.shape[-1:] != (dv,):
      raise ValueError(f"value_sqnorm must be [..., {n}] with a reference [..., {dv}]; got "
                       f"{sq.shape} and {ref.shape}")
    given_sq = StoredNorms(sq.astype(jnp.float32)[..., None, :],  # [..., 1, n]
                           ref.astype(jnp.float32)[..., None, :])  # [..., 1, dv]
  offset = -log_pi.astype(jnp.float32)[..., None, :]  # [..., 1, n]
  valid = mask[..., None, :]
  w = one_minus_pi(offset)
  hp = jax.lax.Precision.HIGHEST
  if block_size is None or block_size >= n:
    # One block: centre = value of the first row's highest-logit slot (one gather).
    l = slot_logits(q, k, offset, valid, scale, config.split_values)  # [..., g, n]
    top = jnp.argmax(jnp.where(valid, l, M_EMPTY)[..., :1, :], axis=-1)[..., None]
    vb = jnp.broadcast_to(v, lead + (n, dv))
    center = jnp.take_along_axis(vb, jnp.broadcast_to(top, lead + (1, 1)), axis=-2)
    center = jnp.where(jnp.any(valid, axis=-1, keepdims=True), center.astype(jnp.float32), 0.0)
    fin = finalize(online_update(
        empty_partials(rows, dv), l, v, w, valid, sqnorm=given_sq,
        options=UpdateOptions(precision=hp, second_order=with_stats, center=center,
                              split_values=config.split_values)))
    if range_mode == "bound" or not with_stats:
      rng = fin.range_bound
    else:
      rng = exact_range(l, v, w, valid, fin.out, fin.lse, given_sq, config.split_values)
    probs = probabilities(l, fin.lse, valid) if config.with_probs else None
    return Reference(fin.out, fin.lse, fin.var_hat, rng, probs)
  bs = block_size
  carry = empty_partials(rows, dv)
  blocks = [slice(b * bs, min((b + 1) * bs, n)) for b in range(-(-n // bs))]
  for sl in blocks:  # static Python loop: the blocked path is for testing the algorithm
    l_b = slot_logits(q, k[..., sl, :], offset[..., sl], valid[..., sl], scale,
                      config.split_values)
    carry = online_update(carry, l_b, v[..., sl, :], w[..., sl], valid[..., sl],
                          sqnorm=None if given_sq is None else given_sq._replace(
                              sq=given_sq.sq[..., sl]),
                          options=UpdateOptions(precision=hp, second_order=with_stats,
                                                split_values=config.split_values))
  fin = finalize(carry)
  if range_mode == "bound" or not with_stats:
    rng = fin.range_bound
  else:
    rng = jnp.zeros(rows, jnp.float32)
    for sl in blocks:  # the exact range needs the final output: a second sweep
      l_b = slot_logits(q, k[..., sl, :], offset[..., sl], valid[..., sl], scale,
                      config.split_values)
      rng = jnp.maximum(rng, exact_range(
          l_b, v[..., sl, :], w[..., sl], valid[..., sl], fin.out, fin.lse,
          None if given_sq is None else given_sq._replace(sq=given_sq.sq[..., sl]),
          config.split_values))
  return Reference(fin.out, fin.lse, fin.var_hat, rng)
