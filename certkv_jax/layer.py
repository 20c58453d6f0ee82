"""The drop-in attention a model's layer calls to use a design (method, sections 1 and 3).

:func:`attend` appends a chunk to one layer's caches, attends with Hajek offsets and folds
the attention into the design's statistics (:func:`attend_layer`: in place on a model's
:class:`Caches`)::

    pos = layer.positions(cache, valid)  # the model's rotary or learned positions
    res = layer.attend(q, k, v, cache, valid=valid, settings=layer.Settings(design))  # in jit
    out, cache, stats = res.out, res.cache, res.stats
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from certkv_jax import _validate
from certkv_jax.attention import certified
from certkv_jax.attention import offset
from certkv_jax.attention.certified import ChunkStats
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv.cache import KVCache
from certkv_jax.kv import caches as caches_lib
from certkv_jax.kv.caches import Caches
from certkv_jax.kv import distributed

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Settings:
  """What :func:`attend` does besides attention; static under ``jit`` (hashable).

  ``design``: the ``EvictionDesign`` whose statistics are folded, or None.
  ``observe``: the chunk is a prompt whose last ``design.observation_window`` real queries
  form the window; decode steps pass False. ``certificate``: a ``certified.Subsample``
  (the layers and KV heads certified, the others NaN) or None (``stats`` None); True
  and False are kept as ``Subsample()`` and None. ``scale``: the logit scale (None:
  ``1/sqrt(head_dim)``). ``checked``: raise on overflow through ``checkify.check``
  (eager calls raise; under ``jit`` wrap in ``checkify.checkify``; not on
  sequence-sharded caches, where ``Attended.overflow`` holds it). ``attention``: the
  ``certkv_jax.AttentionConfig`` of every product (None: the default).
  """

  design: Any = None
  observe: bool = True
  certificate: Optional[certified.Subsample] = certified.Subsample()
  scale: Optional[float] = None
  checked: bool = False
  attention: Any = None

  def __post_init__(self):
    _validate.check_design(self.design, optional=True)
    offset.check_attention_config(self.attention)
    if self.scale is not None and not (isinstance(self.scale, (int, float))
                                       and math.isfinite(self.scale) and self.scale > 0):
      raise ValueError(f"scale must be a finite number > 0 or None, got {self.scale!r}")
    object.__setattr__(self, "certificate", certified.as_subsample(self.certificate))


class Attended(NamedTuple):
  """What :func:`attend` and :func:`attend_layer` return."""

  out: Array  # [batch, t, n_heads, head_dim] float32
  cache: Any  # the layer's KVCache (attend_layer: all layers' Caches), the chunk appended
  shadow: Any  # the shadow likewise, or None
  stats: Optional[ChunkStats]  # fields [batch, n_heads, t], or None without the certificate
  positions: Array  # [batch, t] int32 positions of the chunk's tokens (padding: none)
  overflow: Array  # [batch] int32 tokens of the chunk the caches or the shadow could not store


def positions(cache: KVCache, valid) -> Array:
  """[batch, t] positions continuing each row's ``n_seen``; padding takes none."""
  start = cache.n_seen[:, 0]  # [batch], equal across KV heads
  return start[:, None] + jnp.cumsum(valid, axis=1).astype(jnp.int32) - 1


def stack_stats(per_layer: Sequence[Optional[ChunkStats]]) -> Optional[ChunkStats]:
  """Per-layer statistics stacked on a new leading layer axis (None without the certificate)."""
  if per_layer[0] is None:
    return None
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_layer)


def attend(q, k, v, cache: KVCache, *, valid=None, shadow: Optional[KVCache] = None,
           settings: Settings = Settings(), layer: Optional[int] = None) -> Attended:
  """Appends a chunk to one layer's caches and attends over them.

  Args:
    q: [batch, t, n_heads, head_dim] queries, positions encoded (:func:`positions`).
    k, v: [batch, t, n_kv_heads, head_dim]; ValueError unless ``n_kv_heads`` divides ``n_heads``.
    cache: this layer's caches, leaves ``[batch, n_kv_heads, cap, ...]``.
    valid: [batch, t] bool, False on right padding; None = all real.
    shadow: evaluation only: the layer's ``caches.shadow_caches`` (truth, audit).
    settings: the design, observe, certificate and scale (:class:`Settings`).
    layer: this layer's index in the model (int or traced), which a certificate's
      layer subsample (``settings.certificate.layers``) needs.
  """
  layer_flag = _layer_flag(settings, layer)
  valid, new_kv = _new_tokens(q, k, v, valid)
  pos = positions(cache, valid)
  dropped = cache.n_dropped
  with jax.named_scope("append"):
    cache = caches_lib.append(cache, *new_kv)
    overflow = jnp.max(cache.n_dropped - dropped, axis=1)
    if shadow is not None:  # never sharded; one short of the tokens seen loses their truth
      shadow_dropped = shadow.n_dropped
      shadow = caches_lib.over_heads(cache_lib.append)(shadow, *new_kv)
      overflow = jnp.maximum(overflow, jnp.max(shadow.n_dropped - shadow_dropped, axis=1))
  _check_overflow(settings, overflow)
  out, cache, stats = _attend_appended(q, cache, shadow, pos, valid, settings, layer_flag)
  return Attended(out, cache, shadow, stats, pos, overflow)


def attend_layer(q, k, v, caches: Caches, i, slots: caches_lib.ChunkSlots, *,
                 shadow=None, settings: Settings = Settings()) -> Attended:
  """:func:`attend` on layer ``i`` (int or traced; per-layer caches: int) of :class:`Caches`,
  in place:
  ``slots`` from ``caches.reserve`` (its ``new_valid`` gives the padding); ``shadow``:
  None or ``(shadow caches, their slots)``. Returns :class:`Attended` with all layers'
  caches and shadow."""
  layer_flag = _layer_flag(settings, i)
  valid = slots.new_valid[:, 0]
  _, (k_new, v_new, _) = _new_tokens(q, k, v, valid)
  shadow, shadow_slots = (None, None) if shadow is None else shadow
  with jax.named_scope("append"):
    caches, overflow = _write(caches, i, slots, k_new, v_new)
    if shadow is not None:
      shadow, lost = _write(shadow, i, shadow_slots, k_new, v_new)
      overflow = jnp.maximum(overflow, lost)
  cache = caches.layer(i)
  shadow_cache = None if shadow is None else shadow.layer(i)
  _check_overflow(settings, overflow)
  out, folded, stats = _attend_appended(q, cache, shadow_cache, slots.positions, valid,
                                        settings, layer_flag)
  if settings.design is not None:  # a design folds statistics only: keys and values stay put
    caches = caches.with_layer(i, folded, fields=cache_lib.STATISTICS)
  return Attended(out, caches, shadow, stats, slots.positions, overflow)


def _layer_flag(settings: Settings, layer):
  """Whether ``layer`` is in the certificate's layer subsample: None (no subsample),
  a Python bool (an int layer) or a traced bool."""
  sub = settings.certificate
  if sub is None or sub.layers is None:
    return None
  if layer is None:
    raise ValueError(f"settings.certificate.layers={sub.layers} needs the layer's index: "
                     "pass layer= to attend")
  if isinstance(layer, int):
    return layer in sub.layers
  return jnp.isin(layer, jnp.asarray(sub.layers, jnp.int32))


def _write(caches: Caches, i, slots: caches_lib.ChunkSlots, k_new, v_new):
  """``caches.write_kv`` and the [batch] real tokens of the chunk layer ``i`` could not store."""
  if slots.idx is None:  # sequence-sharded: appended whole, the loss counted in n_dropped
    before = caches.layer(i).n_dropped
    caches = caches.write_kv(i, slots, k_new, v_new)
    return caches, jnp.max(caches.layer(i).n_dropped - before, axis=1)
  idx = jax.lax.dynamic_index_in_dim(slots.idx, i, axis=0, keepdims=False)  # [b, h, t]
  lost = jnp.sum(slots.new_valid & (idx >= caches.capacity), axis=-1).astype(jnp.int32)
  return caches.write_kv(i, slots, k_new, v_new), jnp.max(lost, axis=1)


def _check_overflow(settings: Settings, overflow) -> None:
  if settings.checked and distributed.cache_mesh() is not None:
    raise ValueError("Settings.checked is not supported on sequence-sharded caches "
                     "(checkify does not pass through their shard_map): read "
                     "Attended.overflow instead")
  if settings.checked:
    checkify.check(jnp.all(overflow == 0), "attend: {} tokens of the chunk found no free "
                   "slot (per row) in the caches or the shadow; evict before appending or "
                   "raise the capacity", overflow)


def _new_tokens(q, k, v, valid):
  """Checks the heads; ``(valid [b, t], (k, v [b, h_kv, t, d], valid [b, h_kv, t]))``."""
  b, t, n_heads, _ = q.shape
  n_kv = k.shape[2]
  if n_heads % n_kv:
    raise ValueError(f"q has {n_heads} heads, not a multiple of the {n_kv} KV heads of k")
  if valid is None:
    valid = jnp.ones((b, t), bool)
  return valid, (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                 jnp.repeat(valid[:, None], n_kv, axis=1))


def _attend_appended(q, cache, shadow, pos, valid, settings: Settings, layer_flag=None):
  """Attends over caches holding the chunk, then folds: ``(out [b, t, h, d], cache, stats)``;
  ``layer_flag``: :func:`_layer_flag`."""
  b, t, n_heads, d = q.shape
  design, sub = settings.design, settings.certificate
  if settings.scale is not None:  # the kernels scale by 1/sqrt(d)
    q = q * jnp.asarray(settings.scale * math.sqrt(d), q.dtype)
  n_kv = cache.k.shape[1]
  qg = q.reshape(b, t, n_kv, n_heads // n_kv, d).transpose(0, 2, 3, 1, 4)
  with jax.named_scope("attention_statistics"):
    out, stats, probs = certified.attend(
        qg, cache, shadow, pos, certificate=sub, with_probs=design is not None,
        layer_flag=layer_flag, config=settings.attention)  # out [b, h_kv, g, t, d]
  if stats is not None:  # [b, h_kv, g, t] -> [b, n_heads, t]
    stats = jax.tree_util.tree_map(lambda a: a.reshape(b, n_heads, t), stats)
  if design is not None:
    with jax.named_scope("fold"):
      window = design.observation_window if settings.observe else 0
      cache = fold_statistics(design, cache, probs, valid, window)
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n_heads, d)
  return out, cache, stats


def fold_statistics(design, cache: KVCache, probs, valid, observation_window: int) -> KVCache:
  """Folds probabilities [b, h_kv, g, t, cap] into slot statistics (``design.update``): every
  real query into ``acc`` and ``last`` (the last real query is the latest: TOVA), as a design
  without a window folds them, and with a window its queries alone into a fresh ``obs``
  (SnapKV); all-padding rows keep theirs."""
  probs = jnp.where(valid[:, None, None, :, None], probs, 0.0)  # padded queries count 0
  t = valid.shape[1]
  n_real = jnp.sum(valid, axis=1).astype(jnp.int32)
  probs = jax.vmap(lambda p, n: jnp.roll(p, t - n, axis=-2))(probs, n_real)  # right-align
  in_window = jnp.arange(t) >= t - observation_window  # [t]

  def fold(cache_h, p, has_real):  # p [g, t, cap]
    state = design.init(cache_h)
    new = design.update(cache_h, state, p)[0]
    if observation_window:
      fresh = cache_h._replace(obs=jnp.zeros_like(cache_h.obs))
      window = jnp.where(in_window[None, :, None], p, 0.0)
      new = new._replace(obs=design.update(fresh, state, window, observation=True)[0].obs)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(has_real, a, b), new, cache_h)

  per_head = jax.vmap(fold, in_axes=(0, 0, None))  # over KV heads; one flag per row
  return jax.vmap(per_head)(cache, probs, n_real > 0)
