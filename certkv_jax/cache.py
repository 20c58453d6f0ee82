"""The KV cache of one attention head: a fixed-capacity pytree.

Written for one KV head; batch, heads and layers come from ``jax.vmap``.
Slots are unordered (attention is permutation invariant): a token lives in a
slot until it is evicted, and new tokens fill free slots. ``pos`` keeps each
token's original position. Appending and evicting never change array shapes.

Per-slot running importance statistics (what the designs score with) live here
too, so that a slot's statistics move with its token:

* ``acc``:  attention mass received from every query observed so far (H2O).
* ``last``: attention of the most recent query (TOVA; ``pi ∝ a`` when the
  query is known at eviction time).
* ``obs``:  attention mass from observation-window queries only (SnapKV);
  :func:`observe_peak` folds the same field as a running max instead (the
  attention envelope of ``designs.poisson_envelope``).

Each slot also keeps ``v_sq = ||v_i - v_ref||^2``, its stored value's squared
distance to the head's reference value ``v_ref`` (the first value appended
to the empty cache: it shares the channels' common component, so float32
rounding scales with the values' spread, not their size). The certificate's
second-order sum and range term read it instead of a pass over the values
at every step (method, section 4, "Stored value norms"), for 4 bytes per
slot. It depends on that slot's value and the reference alone, so eviction
leaves no trace of an evicted token in it (Theorem 1's blind retained state).
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp

from certkv_jax import _checks

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
  capacity = _checks.check_positive_int("capacity", capacity)
  head_dim = _checks.check_positive_int("head_dim", head_dim)
  value_dim = head_dim if value_dim is None else _checks.check_positive_int(
      "value_dim", value_dim)
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
  """Writes ``t`` new tokens into free slots.

  Args:
    cache: one head's cache.
    k_new: [t, d] keys; v_new: [t, dv] values.
    new_valid: optional [t] bool; False marks padding (ragged batches), which
      takes neither a slot nor a position.

  Returns:
    The updated cache. Tokens are certain on arrival (``log_pi = 0``), with
    zeroed statistics and positions ``n_seen, n_seen + 1, ...``.

  Raises:
    ValueError naming the capacity and the number of tokens that do not fit,
    when the cache has fewer free slots than real new tokens and ``valid`` and
    ``new_valid`` are concrete (size the capacity as budget + chunk, and evict
    before appending).

  Overflow under ``jit`` or ``vmap`` (method, section 9, "Bad input"): the
  tokens beyond the free slots are not stored, still take positions, and are
  counted in ``n_dropped``; attention then silently misses them. Nothing else
  reports it: read ``n_dropped``, or use ``certkv_jax.checked.checked_append``
  / ``check_no_overflow`` to make it a checkify error.
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
  slots = slot_assignment(cache.valid, new_valid)
  if (_checks.is_concrete(slots.n_new) and _checks.is_concrete(slots.n_free)
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
  """The slots that :func:`append` fills: free slots in slot order, real tokens in order.

  Split from the write so that a cache whose slots are spread over devices
  (``certkv_jax.distributed``) places tokens exactly as one device would: it
  computes this from the gathered ``valid`` mask and writes only its own slots.

  Args:
    valid: [cap] bool, the slots that hold a token.
    new_valid: [t] bool, the real (non-padding) new tokens.
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
  """[cap] int32 (``[1]`` for ``t = 1``): the free slots in slot order, then
  ``cap`` (no sort), for a chunk of ``t`` new tokens.

  Entry ``j < n_free`` is the ``j``-th free slot, the same as
  ``jnp.argsort(valid, stable=True)[j]``; the entries from ``n_free`` on
  (where that argsort lists the occupied slots) are ``cap``, which
  :func:`slot_assignment` never reads: a token whose rank reaches ``n_free``
  does not fit. A cumulative count and one scatter replace the sort; a decode
  step (``t = 1``) needs only the first free slot, one argmax.
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


def write_slots(cache: KVCache, slots: SlotAssignment, idx, k_new, v_new) -> KVCache:
  """Writes new tokens at slot indices ``idx`` [t] (``>= capacity`` = not written).

  ``idx`` is ``slots.idx`` on one device, or its part that falls in this
  device's slot range (shifted to local indices) on a sequence-sharded cache;
  the counters come from ``slots`` either way.
  """
  meta, counters = slot_metadata(cache, slots)
  kv, v_ref = slot_kv(cache, k_new, v_new, ~jnp.any(cache.valid) & (slots.rank[0] == 0))
  new = dict(meta, **kv)
  return cache._replace(
      **{f: getattr(cache, f).at[idx].set(u, mode="drop") for f, u in new.items()},
      **counters, v_ref=v_ref)


# The per-slot statistics a design folds (``EvictionDesign.update`` changes only these).
STATISTICS = ("acc", "last", "obs")


def slot_metadata(cache: KVCache, slots: SlotAssignment) -> tuple[dict, dict]:
  """What :func:`write_slots` writes besides the keys and values, none of which
  depends on them: ``(field -> [t] values of the new tokens' slots, the counters
  {"n_seen", "n_dropped"} after the append)``. Tokens arrive certain
  (``log_pi = 0``) with zeroed statistics."""
  z = jnp.zeros(slots.idx.shape, jnp.float32)
  meta = dict(pos=cache.n_seen + slots.rank, valid=jnp.ones(slots.idx.shape, bool), log_pi=z,
              **{f: z for f in STATISTICS})
  counters = dict(n_seen=cache.n_seen + slots.n_new,
                  n_dropped=cache.n_dropped + (slots.n_new - slots.n_stored))
  return meta, counters


def slot_kv(cache: KVCache, k_new, v_new, fresh) -> tuple[dict, Array]:
  """The new tokens' ``k``, ``v`` (in the cache's dtypes) and ``v_sq`` [t, ...],
  and the cache's ``v_ref`` after them: the chunk's first value when ``fresh``
  (a traced bool: the cache held no token and the chunk's first token is
  real), else the cache's own (:func:`rebase` keeps it the value of the kept
  token with the smallest position)."""
  v_stored = v_new.astype(cache.v.dtype)
  v32 = v_stored.astype(jnp.float32)
  v_ref = jnp.where(fresh, v32[0], cache.v_ref)
  dv = v32 - v_ref
  return dict(k=k_new.astype(cache.k.dtype), v=v_stored, v_sq=jnp.sum(dv * dv, axis=-1)), v_ref


def observe(cache: KVCache, probs, *, observation: bool | Array = False) -> KVCache:
  """Folds attention probabilities of new queries into the slot statistics.

  Args:
    cache: one KV head's cache.
    probs: [cap], [q, cap] or [g, q, cap] attention probabilities over the
      slots (``g`` query heads of a GQA group, averaged; ``q`` queries in order,
      summed into ``acc``, the last one becomes ``last``).
    observation: whether these queries belong to the observation window
      (SnapKV); bool or traced bool scalar.

  Returns:
    The cache with ``acc``, ``last`` (and ``obs`` if observation) updated.
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

  ``acc`` and ``last`` are updated exactly as :func:`observe` does (mean over
  the GQA group; sum over queries; the last query). When ``observation`` is
  true, ``obs`` becomes the running max, over the observation-window queries
  and over the query heads of the group, of each slot's attention
  probability: ``obs_i = max(obs_i, max_{g, q} probs[g, q, i])`` (0 on free
  slots). So every observed window query and head has ``p_i <= obs_i``, which
  the mean over the group (a head may put ``g`` times the mean on a slot) and
  the sum over queries do not give slot by slot. The statistic lives in the
  same field, so the cache pytree is unchanged; do not mix :func:`observe` and
  this function on one cache between :func:`reset_observation` calls.

  Args:
    cache: one KV head's cache.
    probs: [cap], [q, cap] or [g, q, cap] attention probabilities over the slots.
    observation: whether these queries belong to the observation window; bool
      or traced bool scalar.

  Returns:
    The cache with ``acc``, ``last`` (and ``obs`` if observation) updated.
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
  """Keeps the slots in ``keep`` and adds ``log_pi_round`` to their offsets.

  Evicted slots are zeroed (keys, values, statistics), so that the retained
  state holds no trace of the evicted tokens.

  Args:
    keep: [cap] bool (must be a subset of ``valid``).
    log_pi_round: [cap] float32 log inclusion probability of this round (0 for
      certain tokens).
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
  """:func:`keep_only` of an eviction decided elsewhere: the same cache, given the
  kept slots ``keep`` [cap] (a subset of ``valid``) and the new offsets ``log_pi``
  [cap] (``keep_only``'s, 0 off ``keep``).

  For per-layer caches evicted on their stacked metadata
  (``certkv_jax.eviction``): ``valid`` is cleared by the scatter that zeroes
  the evicted keys and values, and every other field is updated from that
  scatter's output, so that only those scatters read the stacked decision.
  The updates then read this layer's buffers alone and are the same program
  for every layer, which XLA compiles once; a slice of the decision in each
  would give every layer and field its own copy of the decision's
  computation to compile.
  """
  gone = cache.valid & ~keep
  rows = jnp.where(gone, jnp.arange(cache.capacity), cache.capacity)  # capacity: not written
  clear = lambda x, fill: x.at[rows].set(jnp.asarray(fill, x.dtype), mode="drop")
  valid = clear(cache.valid, False)  # = keep & valid
  f0 = jnp.zeros_like(cache.log_pi)
  return cache._replace(
      k=clear(cache.k, 0), v=clear(cache.v, 0), log_pi=jnp.asarray(log_pi, jnp.float32),
      pos=jnp.where(valid, cache.pos, -1), valid=valid,
      **{f: jnp.where(valid, getattr(cache, f), f0) for f in ("acc", "last", "obs", "v_sq")})


_DEFERRED = threading.local()


@contextlib.contextmanager
def rebase_deferred():
  """Within it, a design's evict leaves :func:`rebase` to its caller
  (``certkv_jax.eviction.evict`` checks every cache once per round); outside
  it, a design that evicts the reference token rebases that cache itself."""
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
  """``(slot, any)``: the kept token with the smallest position, whose value is
  the reference of ``v_sq`` (``any`` False: nothing kept). Leading axes allowed."""
  big = jnp.iinfo(jnp.int32).max
  slot = jnp.argmin(jnp.where(cache.valid, cache.pos, big), axis=-1)
  return slot, jnp.any(cache.valid, axis=-1)


def needs_rebase(cache: KVCache) -> Array:
  """Whether any cache's ``v_ref`` is no longer its reference slot's value (that
  token was evicted; or nothing is kept and ``v_ref`` is not 0)."""
  slot, kept = reference_slot(cache)
  v = jnp.take_along_axis(cache.v, slot[..., None, None], axis=-2)[..., 0, :]
  want = jnp.where(kept[..., None], v.astype(jnp.float32), 0.0)
  return jnp.any(want != cache.v_ref)


def rebase(cache: KVCache) -> KVCache:
  """``v_ref`` set to the value of the kept token with the smallest position (0
  if none) and ``v_sq`` recomputed about it: after an eviction, so that no
  evicted token's value stays in the cache (Theorem 1's blind retained state).
  One pass over the values; leading axes allowed."""
  slot, kept = reference_slot(cache)
  v = cache.v.astype(jnp.float32)
  ref = jnp.take_along_axis(v, slot[..., None, None], axis=-2)[..., 0, :]
  ref = jnp.where(kept[..., None], ref, 0.0)
  d = v - ref[..., None, :]
  return cache._replace(v_ref=ref,
                        v_sq=jnp.where(cache.valid, jnp.sum(d * d, axis=-1), 0.0))


def zero_slots(x, gone):
  """``x`` [cap, d] with the rows ``gone`` [cap] zeroed: a scatter that writes only those
  rows (in place in a donated buffer), where a ``where`` over ``x`` rewrites all of it.
  Free slots already hold zeros, so zeroing the evicted ones zeroes every row not kept."""
  cap = x.shape[0]
  rows = jnp.where(gone, jnp.arange(cap), cap)  # cap: not written
  return x.at[rows].set(jnp.zeros((), x.dtype), mode="drop")


def compact(cache: KVCache, capacity: int) -> KVCache:
  """The cache re-allocated at ``capacity`` slots, its kept tokens gathered to the front.

  Eviction (:func:`keep_only`) zeroes evicted slots in place and never
  changes a shape, so a cache evicted to a budget still has its old capacity.
  This is the allocation a deployment makes after an eviction: the kept
  tokens, in slot order, then empty slots (for the tokens appended before the
  next eviction; ``capacity`` may exceed the current one). Attention is
  invariant to slot order, so every output is unchanged. It sorts and copies
  the whole cache: a host-side re-allocation, not a per-step operation.

  Works on one head's cache or on stacked caches (any leading axes, e.g.
  ``certkv_jax.caches``' ``[n_layers, batch, n_kv_heads, cap, ...]``): the slot
  axis is the last axis of ``valid``.

  Args:
    cache: the cache(s).
    capacity: int >= 1; must hold every cache's kept tokens.

  Raises:
    ValueError naming ``capacity`` when it is not an int >= 1, or (``valid``
    concrete) smaller than a cache's kept tokens.
  """
  cap = cache.valid.shape[-1]
  if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
    raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
  if _checks.is_concrete(cache.valid):
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
