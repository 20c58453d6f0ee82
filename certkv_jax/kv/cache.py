"""The KV cache of one attention head: a fixed-capacity pytree.

Slots are unordered and shapes never change; batch, heads and layers come
from ``jax.vmap``. Per-slot statistics (``acc`` for H2O, ``last`` for TOVA,
``obs`` for SnapKV or the envelope) and ``v_sq = ||v_i - v_ref||^2`` live
with their token (method, sections 4 and 9).
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp

from certkv_jax import _validate
from pallas_kernels import precision as precision_lib

Array = jax.Array


class KVCache(NamedTuple):
  """One head's cache. ``cap`` is the static capacity."""

  k: Array  # [cap, d]   keys (zero in free slots)
  v: Array  # [cap, dv]  values (zero in free slots)
  log_pi: Array  # [cap] float32 cumulative log inclusion probability (0 = certain)
  pos: Array  # [cap] int32 original token position (-1 in free slots)
  valid: Array  # [cap] bool, slot holds a kept token
  acc: Array  # [cap] float32 accumulated attention mass (H2O)
  last: Array  # [cap] float32 attention of the latest query (TOVA)
  obs: Array  # [cap] float32 attention mass of observation-window queries (SnapKV)
  v_sq: Array  # [cap] float32 ||v_i - v_ref||^2 of the stored value (0 in free slots)
  n_seen: Array  # [] int32 tokens appended so far (kept or not); next position
  n_dropped: Array  # [] int32 tokens that found no free slot on append (should stay 0)
  v_ref: Array  # [dv] float32 the reference of v_sq: the first value appended

  @property
  def capacity(self) -> int:
    return self.k.shape[-2]

  @property
  def n_valid(self) -> Array:
    return jnp.sum(self.valid, axis=-1).astype(jnp.int32)


def init_cache(capacity: int, head_dim: int, value_dim: int | None = None,
               dtype=jnp.float32) -> KVCache:
  """An empty cache of ``capacity`` slots for one head."""
  capacity = _validate.check_positive_int("capacity", capacity)
  head_dim = _validate.check_positive_int("head_dim", head_dim)
  value_dim = head_dim if value_dim is None else _validate.check_positive_int(
      "value_dim", value_dim)
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as err:
    raise TypeError(f"dtype must be a floating dtype (float32, bfloat16), got {dtype!r}") from err
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype (float32, bfloat16), got {dtype}")
  zeros = jnp.zeros((capacity,), jnp.float32)
  return KVCache(
      k=jnp.zeros((capacity, head_dim), dtype),
      v=jnp.zeros((capacity, value_dim), dtype),
      log_pi=zeros,
      pos=jnp.full((capacity,), -1, jnp.int32),
      valid=jnp.zeros((capacity,), bool),
      acc=zeros,
      last=zeros,
      obs=zeros,
      v_sq=zeros,
      n_seen=jnp.zeros((), jnp.int32),
      n_dropped=jnp.zeros((), jnp.int32),
      v_ref=jnp.zeros((value_dim,), jnp.float32),
  )


def append(cache: KVCache, k_new, v_new, new_valid=None) -> KVCache:
  """Writes ``t`` new tokens into free slots; they arrive certain (``log_pi = 0``).

  ``k_new`` is [t, d], ``v_new`` [t, dv]; ``new_valid`` [t] bool marks real
  tokens (padding takes neither a slot nor a position).

  Raises:
    ValueError when the new tokens do not fit and the masks are concrete.
    Under ``jit`` the overflow is counted in ``n_dropped`` instead (method,
    section 9, "Bad input"; ``certkv_jax.checked`` makes it an error).
  """
  cap = cache.capacity
  k_new = jnp.asarray(k_new)
  v_new = jnp.asarray(v_new)
  if k_new.ndim != 2 or k_new.shape[-1] != cache.k.shape[-1]:
    raise ValueError(f"k_new must be [t, {cache.k.shape[-1]}], got {k_new.shape}")
  t = k_new.shape[0]
  if v_new.shape != (t, cache.v.shape[-1]):
    raise ValueError(f"v_new must be [{t}, {cache.v.shape[-1]}], got {v_new.shape}")
  if new_valid is None:
    new_valid = jnp.ones((t,), bool)
  new_valid = jnp.asarray(new_valid)
  if new_valid.shape != (t,) or new_valid.dtype != jnp.bool_:
    raise ValueError(f"new_valid must be bool [{t}], got {new_valid.dtype} {new_valid.shape}")
  if t == 0:  # an empty chunk: nothing to write
    return cache
  slots = slot_assignment(cache.valid, new_valid)
  if (_validate.is_concrete(slots.n_new) and _validate.is_concrete(slots.n_free)
      and int(slots.n_new) > int(slots.n_free)):
    n_new, n_free = int(slots.n_new), int(slots.n_free)
    raise ValueError(f"append of {n_new} tokens needs free slots, but the cache (capacity "
                     f"{cap}) has {n_free}: {n_new - n_free} tokens would not fit (they would "
                     "be dropped); evict first or raise capacity")
  return write_slots(cache, slots, slots.idx, k_new, v_new)


class SlotAssignment(NamedTuple):
  """Where :func:`append` puts ``t`` new tokens (see :func:`slot_assignment`)."""

  idx: Array  # [t] int32 slot of each new token; ``cap`` = not stored (padding or no room)
  rank: Array  # [t] int32 j for the j-th real new token (its position is n_seen + j)
  n_new: Array  # [] int32 real new tokens
  n_stored: Array  # [] int32 real new tokens that found a free slot
  n_free: Array  # [] int32 free slots before the append


def slot_assignment(valid, new_valid) -> SlotAssignment:
  """The slots :func:`append` fills: free slots in slot order, real tokens in order.

  Split from the write so a sequence-sharded cache (``certkv_jax.kv.distributed``)
  places tokens exactly as one device would. ``valid`` [cap], ``new_valid`` [t].
  """
  if new_valid.shape[-1] > 1:
    # Caches made inside a jitted function (a prefill into empty caches) have a
    # constant mask; XLA would evaluate its free-slot ranks (a cumulative sum over
    # every slot, of every layer) at compile time, for seconds to minutes. The
    # barrier ties the mask to the chunk's, an argument, so they are computed at
    # run time; the values are the same.
    valid, new_valid = jax.lax.optimization_barrier((valid, new_valid))
  cap = valid.shape[-1]
  rank_new = (jnp.cumsum(new_valid) - 1).astype(jnp.int32)  # j-th real token -> j
  n_new = jnp.sum(new_valid).astype(jnp.int32)
  free_slots = _free_slots(valid, new_valid.shape[-1])  # free slots first, in slot order
  n_free = (cap - jnp.sum(valid)).astype(jnp.int32)
  fits = new_valid & (rank_new < n_free)
  idx = jnp.where(fits, free_slots[jnp.clip(rank_new, 0, free_slots.shape[0] - 1)],
                  cap).astype(jnp.int32)
  n_stored = jnp.sum(fits).astype(jnp.int32)
  return SlotAssignment(idx, rank_new, n_new, n_stored, n_free)


def _free_slots(valid, t: int) -> Array:
  """[cap] int32 (``[1]`` for ``t = 1``): the free slots in slot order, then ``cap``.

  The stable argsort of ``valid`` up to ``n_free``, by a cumulative count and
  one scatter (one argmax for a decode step).
  """
  cap = valid.shape[-1]
  if t == 1:
    first = jnp.argmax(~valid).astype(jnp.int32)
    return jnp.where(valid[first], cap, first)[None]
  free = ~valid
  free_rank = (jnp.cumsum(free) - 1).astype(jnp.int32)  # j on the j-th free slot
  dest = jnp.where(free, free_rank, cap)  # occupied slots are dropped
  return jnp.full((cap,), cap, jnp.int32).at[dest].set(
      jnp.arange(cap, dtype=jnp.int32), mode="drop")


def write_slots(cache: KVCache, slots: SlotAssignment, idx, k_new, v_new,
                fresh=None) -> KVCache:
  """Writes new tokens at slot indices ``idx`` [t] (``>= capacity`` = not written).

  ``idx`` is ``slots.idx``, or this device's local part of it on a sharded cache;
  ``fresh``: whether the whole cache is empty before the chunk (None: from ``cache``,
  which a device's shard alone cannot tell).
  """
  meta, counters = slot_metadata(cache, slots)
  if fresh is None:
    fresh = ~jnp.any(cache.valid)
  first = jnp.argmax(slots.rank == 0)  # the first real token (padding has rank -1)
  kv, v_ref = slot_kv(cache, k_new, v_new, fresh & (slots.n_new > 0), first)
  new = dict(meta, **kv)
  return cache._replace(
      **{f: getattr(cache, f).at[idx].set(u, mode="drop") for f, u in new.items()},
      **counters, v_ref=v_ref)


# The per-slot statistics a design folds (``EvictionDesign.update`` changes only these).
STATISTICS = ("acc", "last", "obs")


def slot_metadata(cache: KVCache, slots: SlotAssignment) -> tuple[dict, dict]:
  """The fields besides ``k``/``v`` that :func:`write_slots` writes, and the counters."""
  z = jnp.zeros(slots.idx.shape, jnp.float32)
  meta = dict(pos=cache.n_seen + slots.rank, valid=jnp.ones(slots.idx.shape, bool), log_pi=z,
              **{f: z for f in STATISTICS})
  counters = dict(n_seen=cache.n_seen + slots.n_new,
                  n_dropped=cache.n_dropped + (slots.n_new - slots.n_stored))
  return meta, counters


def slot_kv(cache: KVCache, k_new, v_new, fresh, first=0) -> tuple[dict, Array]:
  """The new tokens' ``k``, ``v``, ``v_sq`` and the cache's ``v_ref`` after them.

  ``v_ref`` becomes the value of the chunk's first real token (index ``first``, after
  any padding) when ``fresh`` (a traced bool).
  """
  if cache.v.dtype == jnp.bfloat16:  # as stored, without a round trip XLA may fold (GPU)
    v32 = precision_lib.bf16_rounded(v_new)
    v_stored = v32.astype(jnp.bfloat16)
  else:
    v_stored = v_new.astype(cache.v.dtype)
    v32 = v_stored.astype(jnp.float32)
  v_ref = jnp.where(fresh, v32[first], cache.v_ref)
  dv = v32 - v_ref
  return dict(k=k_new.astype(cache.k.dtype), v=v_stored, v_sq=jnp.sum(dv * dv, axis=-1)), v_ref


def observe(cache: KVCache, probs, *, observation: bool | Array = False) -> KVCache:
  """Folds attention probabilities of new queries into the slot statistics.

  ``probs`` is [cap], [q, cap] or [g, q, cap]: averaged over the ``g`` heads of
  a GQA group, summed over queries into ``acc`` (and ``obs`` when
  ``observation``); the last query becomes ``last``.
  """
  probs = jnp.asarray(probs, jnp.float32)
  cap = cache.capacity
  if probs.shape[-1] != cap or probs.ndim > 3:
    raise ValueError(f"probs must be [cap], [q, cap] or [g, q, cap] with cap={cap}, "
                     f"got {probs.shape}")
  p = probs.reshape((1,) * (3 - probs.ndim) + probs.shape)
  p = jnp.mean(p, axis=0)  # [q, cap], mean over the GQA group
  p = jnp.where(cache.valid, p, 0.0)
  mass = jnp.sum(p, axis=0)
  obs_w = jnp.asarray(observation, jnp.float32)
  return cache._replace(acc=cache.acc + mass, last=p[-1], obs=cache.obs + obs_w * mass)


def observe_peak(cache: KVCache, probs, *, observation: bool | Array = False) -> KVCache:
  """:func:`observe` with the attention envelope in ``obs`` (method, section 6).

  ``obs`` becomes the running max over window queries and group heads of each
  slot's probability, so every observed query and head has ``p_i <= obs_i``.
  Do not mix with :func:`observe` on one cache between resets.
  """
  new = observe(cache, probs)  # validates probs; acc and last as observe
  probs = jnp.asarray(probs, jnp.float32)
  p = probs.reshape((1,) * (3 - probs.ndim) + probs.shape)  # [g, q, cap]
  peak = jnp.max(jnp.where(cache.valid, p, 0.0), axis=(0, 1))
  obs = jnp.where(jnp.asarray(observation, bool), jnp.maximum(cache.obs, peak), cache.obs)
  return new._replace(obs=obs)


def reset_observation(cache: KVCache) -> KVCache:
  """Clears the observation-window statistic (e.g. when a new question starts)."""
  return cache._replace(obs=jnp.zeros_like(cache.obs))


def keep_only(cache: KVCache, keep, log_pi_round) -> KVCache:
  """Keeps the slots in ``keep`` [cap] and adds ``log_pi_round`` [cap] to their offsets.

  Evicted slots are zeroed, so the retained state holds no trace of them.
  """
  keep = keep & cache.valid
  f0 = jnp.zeros_like(cache.log_pi)
  gone = cache.valid & ~keep
  return cache._replace(
      k=zero_slots(cache.k, gone),
      v=zero_slots(cache.v, gone),
      log_pi=jnp.where(keep, cache.log_pi + log_pi_round, f0),
      pos=jnp.where(keep, cache.pos, -1),
      valid=keep,
      acc=jnp.where(keep, cache.acc, f0),
      last=jnp.where(keep, cache.last, f0),
      obs=jnp.where(keep, cache.obs, f0),
      v_sq=jnp.where(keep, cache.v_sq, f0),
  )


def apply_keep(cache: KVCache, keep, log_pi) -> KVCache:
  """:func:`keep_only` of an eviction decided elsewhere, given the new ``log_pi``.

  For per-layer caches (``certkv_jax.eviction``), once per layer: elementwise
  selects, which compile to one small loop each where :func:`zero_slots`'
  scatters compile to several (the same values).
  """
  valid = cache.valid & keep
  f0 = jnp.zeros_like(cache.log_pi)
  zero = lambda x: jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))
  return cache._replace(
      k=zero(cache.k), v=zero(cache.v), log_pi=jnp.asarray(log_pi, jnp.float32),
      pos=jnp.where(valid, cache.pos, -1), valid=valid,
      **{f: jnp.where(valid, getattr(cache, f), f0) for f in ("acc", "last", "obs", "v_sq")})


_DEFERRED = threading.local()


@contextlib.contextmanager
def rebase_deferred():
  """Within it, :func:`rebase` is left to ``certkv_jax.eviction.evict``."""
  before = getattr(_DEFERRED, "on", False)
  _DEFERRED.on = True
  try:
    yield
  finally:
    _DEFERRED.on = before


def rebase_if_needed(cache: KVCache) -> KVCache:
  """:func:`rebase` where :func:`needs_rebase`, unless :func:`rebase_deferred`."""
  if getattr(_DEFERRED, "on", False):
    return cache
  return jax.lax.cond(needs_rebase(cache), rebase, lambda c: c, cache)


def reference_slot(cache: KVCache) -> tuple[Array, Array]:
  """``(slot, any)``: the kept token with the smallest position, the reference of ``v_sq``."""
  big = jnp.iinfo(jnp.int32).max
  slot = jnp.argmin(jnp.where(cache.valid, cache.pos, big), axis=-1)
  return slot, jnp.any(cache.valid, axis=-1)


def needs_rebase(cache: KVCache) -> Array:
  """Whether any cache's ``v_ref`` is no longer its reference slot's value."""
  slot, kept = reference_slot(cache)
  v = jnp.take_along_axis(cache.v, slot[..., None, None], axis=-2)[..., 0, :]
  want = jnp.where(kept[..., None], v.astype(jnp.float32), 0.0)
  return jnp.any(want != cache.v_ref)


def rebase(cache: KVCache) -> KVCache:
  """``v_ref`` reset to the reference slot's value and ``v_sq`` recomputed.

  After an eviction, so no evicted value stays in the cache (Theorem 1).
  """
  slot, kept = reference_slot(cache)
  v = cache.v.astype(jnp.float32)
  ref = jnp.take_along_axis(v, slot[..., None, None], axis=-2)[..., 0, :]
  ref = jnp.where(kept[..., None], ref, 0.0)
  d = v - ref[..., None, :]
  return cache._replace(v_ref=ref,
                        v_sq=jnp.where(cache.valid, jnp.sum(d * d, axis=-1), 0.0))


def zero_slots(x, gone):
  """``x`` [cap, d] with the rows ``gone`` [cap] zeroed, by a scatter (in place)."""
  cap = x.shape[0]
  rows = jnp.where(gone, jnp.arange(cap), cap)  # cap: not written
  return x.at[rows].set(jnp.zeros((), x.dtype), mode="drop")


def compact(cache: KVCache, capacity: int) -> KVCache:
  """The cache re-allocated at ``capacity`` slots, its kept tokens first.

  A host-side re-allocation after an eviction; outputs are unchanged. Works on
  stacked caches (the slot axis is the last axis of ``valid``).

  Raises:
    ValueError when ``capacity`` is not an int >= 1 or (``valid`` concrete)
    smaller than a cache's kept tokens.
  """
  cap = cache.valid.shape[-1]
  if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
    raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
  if _validate.is_concrete(cache.valid):
    kept = int(jnp.max(jnp.sum(cache.valid, axis=-1)))
    if kept > capacity:
      raise ValueError(f"capacity ({capacity}): a cache keeps {kept} tokens, more than the "
                       f"capacity {capacity}")
  lead = cache.valid.ndim - 1
  order = jnp.argsort(~cache.valid, axis=-1, stable=True)[..., :capacity]  # kept first
  grow = capacity - cap

  def take(x, empty, per_cache=False):
    if per_cache or x.ndim <= lead:  # per-cache values (n_seen, n_dropped, v_ref)
      return x
    idx = order.reshape(order.shape + (1,) * (x.ndim - lead - 1))
    x = jnp.take_along_axis(x, idx, axis=lead)
    if grow > 0:  # new empty slots, as init_cache makes them
      pad = [(0, 0)] * x.ndim
      pad[lead] = (0, grow)
      x = jnp.pad(x, pad, constant_values=empty)
    return x
  empty = cache._replace(**{f: (-1 if f == "pos" else 0) for f in cache._fields})
  per_cache = cache._replace(**{f: f == "v_ref" for f in cache._fields})
  return jax.tree_util.tree_map(take, cache, empty, per_cache)


def cache_bytes(cache: KVCache) -> dict:
  """Bytes of the key/value payload and of the per-slot metadata."""
  kv = cache.k.nbytes + cache.v.nbytes
  meta = sum(x.nbytes for x in (cache.log_pi, cache.pos, cache.valid, cache.acc,
                                cache.last, cache.obs, cache.v_sq, cache.n_seen,
                                cache.n_dropped, cache.v_ref))
  return {"kv": int(kv), "metadata": int(meta)}
