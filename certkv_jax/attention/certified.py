"""One layer's attention over its caches, with certificate statistics (method, section 4).

Offset attention over the kept slots gives ``V_hat`` and ``b_hat`` with every
call; in evaluation mode a shadow full cache adds the truth and the
Assumption-2 audit (section 6). The certificate can be subsampled by layer and
KV head: outputs do not change, statistics not computed are NaN.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax.attention import offset
from certkv_jax.certificate import signals
from certkv_jax.certificate import diagnostics
from certkv_jax.kv.cache import KVCache
from certkv_jax.kv import distributed
from pallas_kernels import reference
from pallas_kernels.reference import StoredNorms

Array = jax.Array


class ChunkStats(NamedTuple):
  """Certificate statistics of a chunk's calls, plus the truth in evaluation mode.

  ``layer.attend`` returns them as ``[batch, n_heads, t]``; the shapes below are
  ``models.forward.forward_chunk``'s ``[t, n_layers, batch, n_heads]``.
  """

  var_hat: Array  # [t, n_layers, batch, n_heads] float32 (method, section 4's V_hat)
  range_hat: Array  # [t, n_layers, batch, n_heads] float32 (b_hat)
  true_error: Optional[Array] = None  # [t, n_layers, batch, n_heads] ||o_hat - o||
  rel_error: Optional[Array] = None  # [t, n_layers, batch, n_heads] ||o_hat - o|| / ||o||
  # Assumption-2 audit (method, section 6):
  ratio: Optional[Array] = None  # [t, n_layers, batch, n_heads] R = m max_T a_i/(pi_i sum a)
  tail_m: Optional[Array] = None  # [t, n_layers, batch, n_heads] m = sum_T pi_i
  tail_n: Optional[Array] = None  # [t, n_layers, batch, n_heads] |T| (tokens with 0<pi<1)
  # Warning signals of the kept set (method, section 10; certkv_jax.certificate.signals):
  ess: Optional[Array] = None  # 1 / sum_S p_i^2
  max_tail_weight: Optional[Array] = None  # max over kept tail of (1 - pi_i) p_i
  range_ratio: Optional[Array] = None  # b_hat / sqrt(V_hat)
  entropy: Optional[Array] = None  # -sum_S p_i log p_i
  r_hat: Optional[Array] = None  # (kept tail slots) * max over kept tail of p_i
  tail_mass: Optional[Array] = None  # sum over kept tail of p_i
  out_norm: Optional[Array] = None  # ||o_hat||, NaN where not certified


SIGNAL_FIELDS = ("ess", "max_tail_weight", "range_ratio", "entropy", "r_hat", "tail_mass")


@dataclasses.dataclass(frozen=True)
class Subsample:
  """Certify only these layer / KV-head indices (None = all): static tuples."""

  layers: Optional[tuple] = None
  heads: Optional[tuple] = None

  def __bool__(self) -> bool:  # a subsample still certifies
    return True


def as_subsample(certificate) -> Optional[Subsample]:
  """``certificate`` as its one type: a :class:`Subsample` (True: every layer and head)
  or None (False, None: no statistics); ValueError for anything else."""
  if isinstance(certificate, Subsample):
    return certificate
  if certificate is True:
    return Subsample()
  if certificate is False or certificate is None:
    return None
  raise ValueError(f"certificate must be True, False, None or a Subsample, got "
                   f"{certificate!r}")


def check_certificate_subsample(config, certificate: bool,
                                certificate_layers: Optional[tuple],
                                certificate_heads: Optional[tuple]):
  """Checks the static certificate subsample (indices into ``config``'s layers, KV heads).

  Returns the ``[n_layers]`` bool layer flags, or None when every layer is
  certified; ValueError for a subsample without ``certificate`` or bad indices.
  """
  for name, value, n, what in (("certificate_layers", certificate_layers, config.n_layers,
                                "layer"),
                               ("certificate_heads", certificate_heads, config.n_kv_heads,
                                "KV head")):
    if value is None:
      continue
    if not certificate:
      raise ValueError(f"{name} needs certificate=True")
    if (not isinstance(value, tuple) or not value
        or not all(isinstance(i, int) and 0 <= i < n for i in value)
        or len(set(value)) != len(value)):
      raise ValueError(f"{name} must be a non-empty tuple of distinct {what} indices in "
                       f"[0, {n}), got {value!r}")
  if certificate_layers is None:
    return None
  return jnp.asarray([i in certificate_layers for i in range(config.n_layers)])


def _slots(a):
  """[b, h_kv, cap, ...] -> [b, h_kv, 1, 1, cap, ...]: broadcast over group and queries."""
  return a[:, :, None, None]


def _mask(cache: KVCache, positions) -> Array:
  """[b, h_kv, 1, t, cap] bool: valid slots at or before each query's position."""
  return _slots(cache.valid) & (_slots(cache.pos) <= positions[:, None, None, :, None])


def attend(qg, cache: KVCache, shadow: Optional[KVCache], positions, *, certificate,
           with_probs: bool, layer_flag=None, config=None):
  """Attention of one layer's grouped queries over its caches.

  On sequence-sharded caches (``certkv_jax.kv.distributed``) the per-device
  partials merge by the split-K combine, and the certificate cannot be
  subsampled nor take ``range_mode="bound"`` (ValueError).

  Args:
    qg: [b, h_kv, g, t, d] queries grouped by KV head.
    cache: one layer's caches, leaves [b, h_kv, cap, ...], holding the chunk.
    shadow: the never-evicted caches in evaluation mode, else None.
    positions: [b, t] int32 positions of the queries.
    certificate: a :class:`Subsample` (its ``heads`` certified, None = all, the rest
      NaN; True: all) or None / False: the same Hajek softmax without the statistics.
    with_probs: also return the probabilities (for a design's fold).
    layer_flag: whether this layer is in the certificate's layer subsample (None =
      yes; a Python or traced bool).
    config: the ``certkv_jax.AttentionConfig`` of every product (None: the default).

  Returns:
    ``(out [b, h_kv, g, t, d], stats, probs)``: ``stats`` a :class:`ChunkStats`
    of ``[b, h_kv, g, t]`` or None, ``probs`` ``[b, h_kv, g, t, cap]`` or None.
  """
  sub = as_subsample(certificate)
  certificate, heads = sub is not None, None if sub is None else sub.heads
  config = offset.AttentionConfig() if config is None else config
  layer_flag = None if layer_flag is True else layer_flag  # True: a static certified layer
  if distributed.cache_mesh() is None:
    return _one_device(qg, cache, shadow, positions, sub, with_probs, layer_flag, config)
  if certificate and (layer_flag is not None or heads is not None):
    raise ValueError("certificate_layers / certificate_heads are not supported on a "
                     "sequence-sharded cache")
  if certificate and config.range_mode != "exact":  # the shards' partials give b_hat
    raise ValueError(f"AttentionConfig.range_mode={config.range_mode!r} is not supported on "
                     "a sequence-sharded cache: use 'exact'")
  # per-device partials, merged by the split-K combine
  probs_out = with_probs or not certificate
  res = distributed.cache_attention(qg, cache, positions, with_stats=certificate,
                                    with_probs=probs_out or shadow is not None)
  stats = None
  if certificate:
    stats = _truth_stats(qg, res.out, shadow, positions,
                         ChunkStats(res.var_hat, res.range_hat, out_norm=_norm(res.out)))
    if shadow is not None:
      stats = _with_signals(stats, res.probs, cache, _mask(cache, positions), res.out)
  return res.out, stats, res.probs if probs_out else None


def _one_device(qg, cache: KVCache, shadow, positions, sub: Optional[Subsample], with_probs,
                layer_flag, config):
  """:func:`attend` on one device's caches (``sub``: the certificate's subsample or None)."""
  certificate, heads = sub is not None, None if sub is None else sub.heads
  if certificate and layer_flag is None and heads is None:  # one pass gives the probabilities
    return _certified_heads(qg, cache, shadow, positions, None, config, with_probs=with_probs)
  probs = None
  if with_probs or not certificate:
    probs = offset.attention_probs(qg, _slots(cache.k), _slots(cache.log_pi),
                                   _mask(cache, positions), split_values=config.split_values)
  if not certificate:  # the same Hajek softmax, without the per-slot statistics
    return _plain_heads(qg, cache, positions, probs, None, config), None, probs
  if layer_flag is False:  # a static layer outside the subsample: NaN statistics
    return (_plain_heads(qg, cache, positions, probs, None, config),
            _nan_stats(qg.shape[:-1], shadow is not None), probs)
  out, stats = _subsampled(qg, cache, shadow, positions, probs, layer_flag, heads, config)
  return out, stats, probs


def _certified_heads(qg, cache: KVCache, shadow: Optional[KVCache], positions, heads, config,
                     *, with_probs: bool = False):
  """Offset attention with statistics on the static KV heads ``heads`` only:
  ``(out [b, h, g, t, d], stats, probs)``, ``probs`` from the same logits or None."""
  take = lambda a: a[:, heads] if heads is not None else a
  qg, cache = take(qg), jax.tree_util.tree_map(take, cache)
  shadow = None if shadow is None else jax.tree_util.tree_map(take, shadow)
  mask = _mask(cache, positions)
  res = offset.offset_attention(
      qg, _slots(cache.k), _slots(cache.v), _slots(cache.log_pi), mask,
      value_sqnorm=StoredNorms(_slots(cache.v_sq), _slots(cache.v_ref)),
      config=dataclasses.replace(config, with_probs=with_probs or shadow is not None))
  stats = _truth_stats(qg, res.out, shadow, positions,
                       ChunkStats(res.var_hat, res.range_hat, out_norm=_norm(res.out)))
  if shadow is not None:
    stats = _with_signals(stats, res.probs, cache, mask, res.out)
  return res.out, stats, res.probs if with_probs else None


def _with_signals(stats: ChunkStats, probs, cache: KVCache, mask, out) -> ChunkStats:
  """Evaluation mode: the warning signals (``SIGNAL_FIELDS``) beside the truth."""
  sig = signals.signals_batched(probs, _slots(jnp.exp(cache.log_pi)), mask,
                                _slots(cache.v.astype(jnp.float32)), out.astype(jnp.float32))
  return stats._replace(**{k: getattr(sig, k) for k in SIGNAL_FIELDS})


def _truth_stats(qg, out, shadow: Optional[KVCache], positions, stats: ChunkStats) -> ChunkStats:
  """Evaluation mode: adds the true error of ``out`` and the Assumption-2 audit
  (from the shadow full cache, same KV heads as ``qg``) to ``stats``."""
  if shadow is None:
    return stats
  full_mask = _mask(shadow, positions)
  full = diagnostics.full_attention(qg, _slots(shadow.k), _slots(shadow.v), full_mask)
  err = diagnostics.attention_error(out, full)
  pi = _slots(jnp.exp(shadow.log_pi))
  tail = full_mask & (pi > 0.0) & (pi < 1.0)  # T: 0 < pi < 1 in some round; [b, h, 1, t, cap]
  tail_m = jnp.sum(jnp.where(tail, pi, 0.0), axis=-1)
  tail_n = jnp.sum(tail, axis=-1).astype(jnp.float32)
  ratio = diagnostics.assumption2_ratio(qg, _slots(shadow.k), full_mask, tail, pi, tail_m)
  grouped = lambda a: jnp.broadcast_to(a, stats.var_hat.shape)
  return stats._replace(true_error=err.abs, rel_error=err.rel, ratio=ratio,
                        tail_m=grouped(tail_m), tail_n=grouped(tail_n))


def _plain_heads(qg, cache: KVCache, positions, probs, heads, config):
  """The same Hajek softmax output on KV heads ``heads`` without the certificate's
  per-slot second-order sums (``probs``: all heads' probabilities, or None)."""
  take = lambda a: a[:, heads] if heads is not None else a
  if probs is None:
    c = jax.tree_util.tree_map(take, cache)
    probs = offset.attention_probs(take(qg), _slots(c.k), _slots(c.log_pi),
                                       _mask(c, positions), split_values=config.split_values)
  else:
    probs = take(probs)
  v = take(cache.v)  # probs [b, h, g, t, n], v [b, h, n, d]
  if config.split_values and v.dtype == jnp.bfloat16:  # the values read as stored
    b, h, g, t, n = probs.shape
    return reference.split_matmul(probs.reshape(b, h, g * t, n), v).reshape(b, h, g, t, -1)
  return jnp.einsum("bhgtn,bhnd->bhgtd", probs, v.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)


def _nan_stats(shape, evaluation: bool) -> ChunkStats:
  """Statistics that were not computed: NaN of ``shape`` in every field in use."""
  nan = jnp.full(shape, jnp.nan, jnp.float32)
  if not evaluation:
    return ChunkStats(nan, nan, out_norm=nan)
  return ChunkStats(*([nan] * len(ChunkStats._fields)))


def _norm(out):
  """``||o_hat||`` of each call: ``out [..., d]`` -> ``[...]`` float32."""
  return jnp.linalg.norm(out.astype(jnp.float32), axis=-1)


def _subsampled(qg, cache, shadow, positions, probs, layer_flag, heads: Optional[tuple],
                config):
  """Every head's output; statistics on static ``heads``, in a ``lax.cond`` on ``layer_flag``.

  Other heads and a switched-off layer get the plain Hajek softmax (no
  second-order work) and NaN statistics.
  """
  n_kv = qg.shape[1]
  shape = qg.shape[:-1]  # [b, h_kv, g, t]
  evaluation = shadow is not None
  rest = None if heads is None else tuple(h for h in range(n_kv) if h not in heads)

  def certified():
    out, stats, _ = _certified_heads(qg, cache, shadow, positions, heads, config)
    out = out.astype(jnp.float32)  # as the plain branch's
    if heads is None:
      return out, stats
    order = np.argsort(np.asarray(heads + rest))  # back to head order
    if rest:
      rest_out = _plain_heads(qg, cache, positions, probs, rest, config)
      out = jnp.concatenate([out, rest_out], axis=1)
    out = out[:, order]
    fill = _nan_stats(shape[:1] + (len(rest),) + shape[2:], evaluation)
    stats = jax.tree_util.tree_map(
        lambda a, f: jnp.concatenate([a, f], axis=1)[:, order], stats, fill)
    return out, stats

  def plain():
    return _plain_heads(qg, cache, positions, probs, None, config), _nan_stats(shape, evaluation)

  if layer_flag is None:
    return certified()
  return jax.lax.cond(layer_flag, certified, plain)
