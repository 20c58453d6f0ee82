"""Offset attention: attention over kept slots with Hajek logit offsets (method, section 3).

The arithmetic lives in ``pallas_kernels.reference``, which the Pallas kernels
are tested against; this module adds argument checks, broadcasting and the result type.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate
from pallas_kernels import reference

Array = jax.Array

IMPLEMENTATIONS = ("xla", "pallas", "auto")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How :func:`offset_attention` computes (static, hashable).

  Attributes:
    implementation: "xla" (the jnp reference), "pallas" (``pallas_kernels.
      offset_decode``; interpret mode on CPU) or "auto" (Pallas on a TPU when
      query rows share their keys, XLA otherwise).
    block_size: for "xla": None, all logits at once; an int, key blocks with
      online-softmax rescaling.
    block_sizes: for "pallas": an ``offset_decode.BlockSizes`` (None: default).
    range_mode: "exact" gives ``b_hat``; "bound" a one-pass upper bound.
    split_values: bfloat16 values ("xla": and keys) multiply as stored, each
      float32 row against them split into two bfloat16 parts (16 bits; method,
      section 9), so no float32 copy of them is made (False: the copy); float32
      caches are unaffected.
    with_probs: also return the probabilities: on the "xla" path from the same
      logits (no second pass over the keys), on "pallas" from :func:`attention_probs`.
  """

  implementation: str = "auto"
  block_size: Optional[int] = None
  block_sizes: Optional[Any] = None
  range_mode: str = "exact"
  split_values: bool = True
  with_probs: bool = False


class OffsetAttentionResult(NamedTuple):
  """Output of :func:`offset_attention` (leading dims ``...`` broadcast; method, section 4).

  Attributes:
    out: [..., dv] the Hajek estimate ``o_hat`` (dtype of ``q``/``v`` promoted).
    lse: [...] float32 log-normaliser; -inf for a row with no valid slot.
    var_hat: [...] float32 ``V_hat``.
    range_hat: [...] float32 ``b_hat``.
    probs: [..., n] float32 attention probabilities ``p_i`` (0 on invalid
      slots), with ``AttentionConfig(with_probs=True)`` only: what a design folds.
  """

  out: Array
  lse: Array
  var_hat: Array
  range_hat: Array
  probs: Optional[Array] = None


def _check_shapes(q, k, v, log_pi, mask):
  """Static shape and dtype checks; ``v`` None (attention probabilities) skips v."""
  if v is None:
    v = jnp.zeros(k.shape[:-1] + (1,), k.dtype)  # shape-only stand-in
  for name, x, min_ndim in (("q", q, 1), ("k", k, 2), ("v", v, 2), ("log_pi", log_pi, 1),
                            ("mask", mask, 1)):
    if jnp.ndim(x) < min_ndim:
      raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {jnp.shape(x)}")
  d, n = q.shape[-1], k.shape[-2]
  if n == 0:
    raise ValueError(f"k must have at least one slot (n >= 1) on axis -2, got {k.shape}")
  if k.shape[-1] != d:
    raise ValueError(f"k's last dim ({k.shape[-1]}) must equal q's last dim ({d}); "
                     f"q {q.shape}, k {k.shape}")
  if v.shape[-2] != n:
    raise ValueError(f"v must have n={n} slots on axis -2 like k; k {k.shape}, v {v.shape}")
  if log_pi.shape[-1] != n:
    raise ValueError(f"log_pi must have n={n} slots on its last axis; got {log_pi.shape}")
  if mask.shape[-1] != n:
    raise ValueError(f"mask must have n={n} slots on its last axis; got {mask.shape}")
  if mask.dtype != jnp.bool_:
    raise TypeError(f"mask must be bool, got {mask.dtype}")
  for name, x in (("q", q), ("k", k), ("v", v), ("log_pi", log_pi)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
  try:
    batch = jnp.broadcast_shapes(q.shape[:-1], k.shape[:-2], v.shape[:-2],
                                 log_pi.shape[:-1], mask.shape[:-1])
  except ValueError as err:
    raise ValueError(
        "leading dimensions must broadcast (numpy rules): q[...] "
        f"{q.shape[:-1]}, k[...] {k.shape[:-2]}, v[...] {v.shape[:-2]}, "
        f"log_pi[...] {log_pi.shape[:-1]}, mask[...] {mask.shape[:-1]}") from err
  return batch


def _check_scale(scale) -> None:
  if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                            or not math.isfinite(scale) or scale <= 0):
    raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")


def _check_values(q, k, v, log_pi, mask, value_sqnorm=None) -> None:
  """Eager value checks (method, section 9, "Bad input"); skipped for tracers.
  ``value_sqnorm``: None or checked ``StoredNorms`` (:func:`_check_sqnorm`)."""
  _validate.check_finite_where("q", q)
  _validate.check_finite_where("k", k, mask, value_axes=1)
  if v is not None:
    _validate.check_finite_where("v", v, mask, value_axes=1)
  _validate.check_finite_where("log_pi", log_pi, mask)
  _validate.check_where(log_pi, mask, lambda x: x <= 0, "log_pi must be <= 0 (a log "
                        "probability, pi in (0, 1]) on every valid slot (mask True); found "
                        "max {}", np.max)
  if value_sqnorm is not None:
    _validate.check_finite_where("value_sqnorm.ref", value_sqnorm.ref)
    _validate.check_finite_where("value_sqnorm", value_sqnorm.sq, mask)
    _validate.check_where(value_sqnorm.sq, mask, lambda x: x >= 0, "value_sqnorm must be "
                          ">= 0 (a squared norm) on every valid slot; found min {}", np.min)


def check_attention_config(attention, name: str = "attention") -> None:
  """A TypeError unless ``attention`` is None or an :class:`AttentionConfig`."""
  if attention is not None and not isinstance(attention, AttentionConfig):
    raise TypeError(f"{name} must be None or a certkv_jax.AttentionConfig, got "
                    f"{type(attention).__name__} {attention!r}")


def offset_attention(
    q,
    k,
    v,
    log_pi,
    mask,
    *,
    scale: Optional[float] = None,
    config: AttentionConfig = AttentionConfig(),
    value_sqnorm=None,
) -> OffsetAttentionResult:
  """Attention over kept slots with Hajek offsets and certificate statistics.

  Logits ``q . k_i * scale - log_pi_i`` give the Hajek estimate (method,
  section 3) and, in the same sweep, the variance statistics (section 4).
  Leading dimensions broadcast by numpy rules: a GQA group ``q [b, h_kv, g, d]``
  attends over ``k [b, h_kv, 1, n, d]``.

  Args:
    q: [..., d] queries.
    k: [..., n, d] keys.
    v: [..., n, dv] values.
    log_pi: [..., n] cumulative log inclusion probability of each slot (<= 0;
      0 for certain tokens), read only where ``mask`` is True.
    mask: [..., n] bool, True for slots that hold a kept token.
    scale: logit scale, finite and > 0; default ``1/sqrt(d)``.
    config: an :class:`AttentionConfig`.
    value_sqnorm: optional stored norms (read where ``mask`` is True): a
      ``reference.StoredNorms(sq [..., n], ref [..., dv])`` with
      ``sq = ||v_i - ref||^2`` (a cache's ``v_sq``, ``v_ref``), or [..., n]
      ``||v_i||^2``. The "xla" path then skips a pass over the values (method,
      section 4, "Stored value norms"); "pallas" does not take them.

  Returns:
    OffsetAttentionResult. A row with no valid slot gives out 0, lse -inf,
    var_hat and range_hat 0.

  Raises:
    ValueError/TypeError naming the argument for bad shapes, dtypes, scale or
    config; for concrete arrays also for NaN/inf in ``q``, NaN/inf in ``k``,
    ``v`` or ``log_pi`` on a valid slot, or ``log_pi > 0`` there. Traced values
    are not checked: method, section 9, "Bad input", lists what they give;
    ``certkv_jax.checked.checked_offset_attention`` checks them.
  """
  q, k, v, log_pi, mask = (jnp.asarray(x) for x in (q, k, v, log_pi, mask))
  _check_shapes(q, k, v, log_pi, mask)
  _check_scale(scale)
  implementation = _implementation(config, k, v, log_pi, mask, value_sqnorm)
  if value_sqnorm is not None:  # bad input fails on every backend alike
    value_sqnorm = _check_sqnorm(value_sqnorm, v, mask)
  grouped, back = _grouped_layout(q, k, v, log_pi, mask,
                                  None if implementation == "pallas" else value_sqnorm)
  _check_values(q, k, v, log_pi, mask, value_sqnorm)
  block_size, block_sizes = config.block_size, config.block_sizes
  range_mode, with_probs = config.range_mode, config.with_probs
  gq, gk, gv, glp, gmask, gsq = grouped
  if implementation == "pallas":
    from pallas_kernels import offset_decode  # pylint: disable=import-outside-toplevel
    offset = jnp.where(gmask, -glp.astype(jnp.float32), -jnp.inf)
    res = offset_decode.offset_decode_attention(
        gq, gk, gv, offset, scale=scale, config=offset_decode.KernelConfig(
            block_sizes=block_sizes, interpret=jax.default_backend() not in ("gpu", "tpu"),
            range_mode=range_mode, split_values=config.split_values))
  else:
    one_block = block_size is None or block_size >= k.shape[-2]
    res = reference.grouped_reference(
        gq, gk, gv, glp, gmask, scale=scale,
        config=reference.ReferenceConfig(block_size=block_size, range_mode=range_mode,
                                         with_probs=with_probs and one_block,
                                         split_values=config.split_values),
        value_sqnorm=gsq)
  ref = back(res)
  probs = ref.probs
  if with_probs and probs is None:  # the kernel or key blocks: a pass of their own
    probs = reference.offset_probs(q, k, log_pi, mask,
                                   1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
                                   config.split_values)
  out_dtype = jnp.result_type(q.dtype, v.dtype)
  return OffsetAttentionResult(ref.out.astype(out_dtype), ref.lse, ref.var_hat, ref.range_hat,
                               probs)


def _implementation(config: AttentionConfig, k, v, log_pi, mask, value_sqnorm) -> str:
  """``config.implementation`` checked against the other settings, "auto" resolved."""
  implementation, block_size, block_sizes = (config.implementation, config.block_size,
                                             config.block_sizes)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation == "pallas" and value_sqnorm is not None:
    raise ValueError("value_sqnorm is for implementation='xla' (the Pallas kernel computes "
                     "the norms on its tiles)")
  if implementation == "pallas" and block_size is not None:
    raise ValueError("block_size is for implementation='xla'; use block_sizes for 'pallas'")
  if implementation == "xla" and block_sizes is not None:
    raise ValueError("block_sizes is for implementation='pallas'; use block_size for 'xla'")
  if implementation == "auto":  # an automatic "pallas" drops value_sqnorm: its tiles hold them
    implementation = _auto(k, v, log_pi, mask, block_size, block_sizes)
  return implementation


def _auto(k, v, log_pi, mask, block_size, block_sizes) -> str:
  """"pallas" on a TPU when every KV row is read once (as in a decode step), or
  on a GPU/TPU when its tiling is given; "xla" elsewhere."""
  if jax.default_backend() not in ("gpu", "tpu") or block_size is not None:
    return "xla"
  if block_sizes is not None:
    return "pallas"
  if jax.default_backend() == "gpu":
    return "xla"
  r = max(k.ndim - 2, v.ndim - 2, log_pi.ndim - 1, mask.ndim - 1)
  pad = lambda shape: (1,) * (r - len(shape)) + tuple(shape)
  kv_rows = math.prod(jnp.broadcast_shapes(pad(k.shape[:-2]), pad(v.shape[:-2])))
  slots = math.prod(jnp.broadcast_shapes(pad(k.shape[:-2]), pad(v.shape[:-2]),
                                         pad(log_pi.shape[:-1]), pad(mask.shape[:-1])))
  return "pallas" if slots == kv_rows else "xla"


def _check_sqnorm(value_sqnorm, v, mask):
  """Shape and dtype checks of the stored value norms (their values: :func:`_check_values`);
  returns them as ``StoredNorms``."""
  if isinstance(value_sqnorm, reference.StoredNorms):
    value_sqnorm, ref = jnp.asarray(value_sqnorm.sq), jnp.asarray(value_sqnorm.ref)
  else:
    value_sqnorm, ref = jnp.asarray(value_sqnorm), jnp.zeros((v.shape[-1],), jnp.float32)
  kv_lead = jnp.broadcast_shapes(v.shape[:-2], mask.shape[:-1])
  if ref.ndim < 1 or ref.shape[-1] != v.shape[-1] or not _broadcasts_to(ref.shape[:-1],
                                                                        kv_lead):
    raise ValueError(f"value_sqnorm.ref must be [..., dv={v.shape[-1]}] with leading dims "
                     f"that broadcast to those of v and mask {tuple(kv_lead)}, got {ref.shape}")
  n = v.shape[-2]
  if value_sqnorm.ndim < 1 or value_sqnorm.shape[-1] != n:
    raise ValueError(f"value_sqnorm must have n={n} slots on its last axis, got "
                     f"{value_sqnorm.shape}")
  if not jnp.issubdtype(value_sqnorm.dtype, jnp.floating):
    raise TypeError(f"value_sqnorm must be a floating dtype, got {value_sqnorm.dtype}")
  if not _broadcasts_to(value_sqnorm.shape[:-1], kv_lead):
    raise ValueError(f"value_sqnorm's leading dims {value_sqnorm.shape[:-1]} must broadcast "
                     f"to those of v and mask {tuple(kv_lead)}")
  return reference.StoredNorms(value_sqnorm, ref)


def _broadcasts_to(shape, target) -> bool:
  try:
    return jnp.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
  except ValueError:
    return False


def _grouped_layout(q, k, v, log_pi, mask, value_sqnorm=None):
  """Maps broadcast inputs onto the grouped [B, G, d] / [B, n, d] layout.

  Axes where only the query has size > 1 are GQA groups (G), so keys and
  values are never copied per query; the rest flatten into B. Returns the
  grouped arrays and ``back``, which maps a grouped ``reference.Reference``
  to the broadcast shape.
  """
  d, n, dv = q.shape[-1], k.shape[-2], v.shape[-1]
  batch = jnp.broadcast_shapes(q.shape[:-1], k.shape[:-2], v.shape[:-2], log_pi.shape[:-1],
                               mask.shape[:-1])
  r = len(batch)
  kv_lead = jnp.broadcast_shapes(k.shape[:-2], v.shape[:-2], log_pi.shape[:-1],
                                 mask.shape[:-1])
  kv_lead = (1,) * (r - len(kv_lead)) + tuple(kv_lead)
  group_axes = [i for i in range(r) if kv_lead[i] == 1 and batch[i] > 1]
  kv_axes = [i for i in range(r) if i not in group_axes]
  perm = kv_axes + group_axes
  b_shape = tuple(batch[i] for i in kv_axes)
  g_shape = tuple(batch[i] for i in group_axes)
  nb, ng = math.prod(b_shape), math.prod(g_shape)
  gq = jnp.transpose(jnp.broadcast_to(q, batch + (d,)), perm + [r]).reshape(nb, ng, d)

  def kv(x, tail):
    x = jnp.broadcast_to(x, kv_lead + tail)
    return jnp.transpose(x, perm + list(range(r, x.ndim))).reshape((nb,) + tail)

  inverse = [perm.index(i) for i in range(r)]

  def unflatten(x, tail):
    x = x.reshape(b_shape + g_shape + tail)
    return jnp.transpose(x, inverse + list(range(r, x.ndim)))

  def back(res):
    probs = None if res.probs is None else unflatten(res.probs, (n,))
    return reference.Reference(unflatten(res.out, (dv,)), unflatten(res.lse, ()),
                               unflatten(res.var_hat, ()), unflatten(res.range_hat, ()), probs)

  gsq = None  # the stored norms travel like log_pi, their reference like a value
  if value_sqnorm is not None:
    gsq = reference.StoredNorms(kv(value_sqnorm.sq, (n,)), kv(value_sqnorm.ref, (dv,)))
  grouped = (gq, kv(k, (n, d)), kv(v, (n, dv)), kv(log_pi, (n,)), kv(mask, (n,)), gsq)
  return grouped, back


def attention_probs(q, k, log_pi, mask, *, scale: Optional[float] = None,
                    split_values: bool = False):
  """Offset-attention probabilities ``p_i`` [..., n] (0 on invalid slots), which designs fold.

  Checked as :func:`offset_attention`; under ``jit`` bad input gives what
  method, section 9, "Bad input" lists. A row with no valid slot is all 0.
  ``split_values``: bfloat16 keys read as stored (``AttentionConfig``).
  """
  q, k, log_pi, mask = (jnp.asarray(x) for x in (q, k, log_pi, mask))
  _check_shapes(q, k, None, log_pi, mask)
  _check_scale(scale)
  _check_values(q, k, None, log_pi, mask)
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  return reference.offset_probs(q, k, log_pi, mask, scale, split_values)
