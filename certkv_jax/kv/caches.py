"""A model's caches: one :class:`Caches` holding a ``KVCache`` per (layer, batch row, KV head).

Its layers are stacked (leaves ``[n_layers, batch, n_kv_heads, ...]``, the form a
``lax.scan`` over layers and a mesh take) or one ``KVCache`` per layer (:meth:`Caches.unstack`,
read and updated in place by an unrolled loop). Every form question is answered here:
the decode loop, eviction and the sharded path call its methods and never ask.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv.cache import KVCache
from certkv_jax.kv import distributed
from certkv_jax.kv.distributed import DATA, MODEL, SEQ


def over_heads(fn):
  """``fn`` (written for one head's cache) over ``[batch, n_kv_heads]`` leading axes."""
  return jax.vmap(jax.vmap(fn))


def _flat_vmap(fn, n_lead: int):
  """``fn`` over ``n_lead`` leading axes as one ``vmap`` (one batching level to trace)."""

  def flat(*xs):
    lead = jax.tree_util.tree_leaves(xs)[0].shape[:n_lead]
    size = math.prod(lead)
    xs = jax.tree_util.tree_map(lambda a: a.reshape((size,) + a.shape[n_lead:]), xs)
    out = jax.vmap(fn)(*xs)
    return jax.tree_util.tree_map(lambda a: a.reshape(lead + a.shape[1:]), out)
  return flat


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """The sizes a model's caches need (any config with these fields will do)."""

  n_layers: int
  n_kv_heads: int
  head_dim: int


class ChunkSlots(NamedTuple):
  """Where a chunk's tokens go in every layer (:meth:`Caches.reserve`)."""

  idx: Optional[jax.Array]  # [n_layers, batch, n_kv_heads, t] int32 slot; cap = not stored
  positions: jax.Array  # [batch, t] int32 positions of the chunk's tokens
  new_valid: jax.Array  # [batch, n_kv_heads, t] bool, False on padding


def _is_kv(x) -> bool:
  return isinstance(x, KVCache)


def _stack(trees):
  """Same-structure trees stacked leaf by leaf on a new leading (layer) axis."""
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)


def check_caches(caches) -> None:
  """A TypeError naming the type unless ``caches`` is a :class:`Caches`."""
  if not isinstance(caches, Caches):
    raise TypeError(f"caches must be a certkv_jax.kv.caches.Caches (init_caches), got "
                    f"{type(caches).__name__}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Caches:
  """Every layer's caches, stacked or per layer; a pytree, so it passes through ``jit``.

  ``layers``: a ``KVCache`` with leaves ``[n_layers, batch, n_kv_heads, ...]``, or a
  tuple of one ``KVCache`` per layer (leaves ``[batch, n_kv_heads, ...]``). Each
  ``KVCache`` field reads as the stacked array (``caches.n_seen`` is ``[n_layers,
  batch, n_kv_heads]`` in either form; per layer it is a copy).
  """

  layers: Any

  @property
  def per_layer(self) -> bool:
    """Whether the layers are a tuple of per-layer caches (:meth:`unstack`)."""
    return not _is_kv(self.layers)

  @property
  def n_layers(self) -> int:
    return len(self.layers) if self.per_layer else self.layers.n_seen.shape[0]

  @property
  def capacity(self) -> int:
    return (self.layers[0] if self.per_layer else self.layers).capacity

  @property
  def n_valid(self) -> jax.Array:
    """[n_layers, batch, n_kv_heads] int32 kept tokens."""
    return jnp.sum(self.valid, axis=-1).astype(jnp.int32)

  def as_kvcache(self) -> KVCache:
    """One ``KVCache`` with leaves ``[n_layers, batch, n_kv_heads, ...]`` (a copy per layer)."""
    if not self.per_layer:
      return self.layers
    return _stack(self.layers)

  def unstack(self) -> "Caches":
    """One ``KVCache`` per layer: a layer loop and eviction then update each in place.
    It copies, so call it once before a decode loop."""
    if self.per_layer:
      return self
    return Caches(tuple(self.layer(i) for i in range(self.n_layers)))

  def _check_index(self, i) -> None:
    """An IndexError for a Python int ``i`` outside [0, n_layers) (a traced one, stacked, is
    clamped by ``dynamic_index_in_dim``: the caller keeps it in range)."""
    if isinstance(i, numbers.Integral) and not 0 <= i < self.n_layers:
      raise IndexError(f"layer index must be in [0, {self.n_layers}), got {i}")

  def stack(self) -> "Caches":
    """The stacked form (the inverse of :meth:`unstack`)."""
    return Caches(self.as_kvcache()) if self.per_layer else self

  def layer(self, i) -> KVCache:
    """Layer ``i``'s caches, leaves ``[batch, n_kv_heads, ...]`` (``i`` traced: stacked only)."""
    self._check_index(i)
    if self.per_layer:
      return self.layers[i]
    return jax.tree_util.tree_map(
        lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), self.layers)

  def with_layer(self, i, cache: KVCache, fields=None) -> "Caches":
    """These caches with layer ``i``'s ``fields`` (None: all) taken from ``cache``."""
    fields = KVCache._fields if fields is None else fields
    self._check_index(i)
    old = self.layer(i) if self.per_layer else None

    def given(f):  # the layer's own dtype; a shape that differs is refused, not padded
      u = jnp.asarray(getattr(cache, f))
      a = getattr(old, f) if self.per_layer else getattr(self.layers, f)
      shape = a.shape if self.per_layer else a.shape[1:]
      if u.shape != shape:
        raise ValueError(f"cache.{f}: layer {i} holds shape {shape}, got {u.shape}")
      return u.astype(a.dtype)

    if self.per_layer:
      new = old._replace(**{f: given(f) for f in fields})
      return Caches(self.layers[:i] + (new,) + self.layers[i + 1:])
    put = lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u, i, axis=0)
    kv = self.layers
    return Caches(kv._replace(**{f: put(getattr(kv, f), given(f)) for f in fields}))

  def replace(self, **fields) -> "Caches":
    """Stacked caches with whole fields (``[n_layers, batch, n_kv_heads, ...]``) replaced."""
    return Caches(self.as_kvcache()._replace(**fields))

  def compact(self, capacity: int) -> "Caches":
    """``cache.compact`` on every layer: the kept tokens gathered into ``capacity`` slots
    (what a deployment allocates after an eviction)."""
    return Caches(jax.tree_util.tree_map(lambda c: cache_lib.compact(c, capacity), self.layers,
                                         is_leaf=_is_kv))

  def map(self, fn, *args):
    """``fn(cache, *arg)`` on every (layer, row, KV head) cache.

    ``args``: :class:`Caches` (either form) or arrays ``[n_layers, batch, n_kv_heads,
    ...]``. In ``fn``'s result every ``KVCache`` comes back as :class:`Caches` in
    this form, everything else stacked over layers.
    """
    if not self.per_layer:
      flat = [a.as_kvcache() if isinstance(a, Caches) else a for a in args]
      out = jax.vmap(over_heads(fn))(self.layers, *flat)
      return jax.tree_util.tree_map(lambda x: Caches(x) if _is_kv(x) else x, out,
                                    is_leaf=_is_kv)
    at = lambda i: [a.layer(i) if isinstance(a, Caches) else a[i] for a in args]
    outs = [over_heads(fn)(c, *at(i)) for i, c in enumerate(self.layers)]
    return jax.tree_util.tree_map(
        lambda *xs: Caches(tuple(xs)) if _is_kv(xs[0]) else jnp.stack(xs), *outs,
        is_leaf=_is_kv)

  def evict_heads(self, design, fn, *args) -> tuple["Caches", Any]:
    """An eviction ``fn(cache, *arg) -> (new cache, out)`` on every cache, in this form.

    Stacked: one ``vmap``. Per layer: one decision on the stacked slot metadata (keys
    and values as norms, or zeros, unless ``design`` reads them), then each layer keeps
    its own slots in place. On a mesh: :func:`_sharded_evict`, whose kept
    set is the one-device one. ``args`` as in :meth:`map`, arrays only.
    """
    every = _flat_vmap(fn, 3)  # one vmap over the flattened [layer, batch, head] axes
    if distributed.cache_mesh() is not None:
      new, out = _sharded_evict(design, jax.vmap(over_heads(fn)), self.as_kvcache(), *args)
    elif not self.per_layer:
      new, out = every(self.layers, *args)
    else:
      new, out = every(_metadata(self.layers, design_reads(design)), *args)
      apply = over_heads(cache_lib.apply_keep)
      return Caches(tuple(apply(c, new.valid[i], new.log_pi[i])
                          for i, c in enumerate(self.layers))), out
    return Caches(new), out

  def rebase(self) -> "Caches":
    """``cache.rebase`` where an eviction left a stale ``v_ref`` (a ``lax.cond`` skips it
    elsewhere; on a mesh it runs, with no collectives inside a cond)."""
    if distributed.cache_mesh() is not None:
      return Caches(cache_lib.rebase(self.layers))
    needed = jnp.any(jnp.stack([cache_lib.needs_rebase(c) for c in self._parts()]))
    rebased = lambda ls: jax.tree_util.tree_map(cache_lib.rebase, ls, is_leaf=_is_kv)
    return Caches(jax.lax.cond(needed, rebased, lambda ls: ls, self.layers))

  def reserve(self, new_valid) -> tuple["Caches", ChunkSlots]:
    """Every layer's slots for a chunk, with all but its keys and values written.

    With :meth:`write_kv` per layer, an append on every layer without copies;
    ``new_valid`` [batch, t] is False on right padding. Either form; per layer, each
    layer's buffers stay its own. On a mesh ``idx`` is None and :meth:`write_kv` appends.
    """
    if self.per_layer:
      done = [_one(c).reserve(new_valid) for c in self.layers]
      slots = done[0][1]
      if slots.idx is not None:
        slots = slots._replace(idx=jnp.concatenate([s.idx for _, s in done]))
      return Caches(tuple(c.layer(0) for c, _ in done)), slots
    kv = self.layers
    n_kv = kv.n_seen.shape[-1]
    start = kv.n_seen[0, :, 0]  # [batch], equal across layers and KV heads
    positions = start[:, None] + jnp.cumsum(new_valid, axis=1).astype(jnp.int32) - 1
    per_head = jnp.repeat(new_valid[:, None], n_kv, axis=1)
    if distributed.cache_mesh() is not None:
      return self, ChunkSlots(None, positions, per_head)
    assign = jax.vmap(over_heads(cache_lib.slot_assignment), in_axes=(0, None))
    slots = assign(kv.valid, per_head)
    meta, counters = jax.vmap(over_heads(cache_lib.slot_metadata))(kv, slots)
    n_layers, b = slots.idx.shape[:2]
    at = (jnp.arange(n_layers)[:, None, None, None], jnp.arange(b)[None, :, None, None],
          jnp.arange(n_kv)[None, None, :, None], slots.idx)
    kv = kv._replace(**{f: getattr(kv, f).at[at].set(u, mode="drop") for f, u in meta.items()},
                     **counters)
    return Caches(kv), ChunkSlots(slots.idx, positions, per_head)

  def write_kv(self, i, slots: ChunkSlots, k_new, v_new) -> "Caches":
    """Layer ``i``'s (int or traced; per layer: int) keys [batch, n_kv_heads, t, head_dim]
    and values into the slots :meth:`reserve` gave them (one scatter per field, in place
    when donated)."""
    if k_new.shape[-2] == 0:  # an empty chunk: nothing to write
      return self
    if self.per_layer:
      if not isinstance(i, int):
        raise TypeError(f"Caches.write_kv on per-layer caches needs an int layer index i, "
                        f"got {type(i).__name__} (stack() them for a traced one)")
      idx = None if slots.idx is None else slots.idx[i][None]
      one = _one(self.layers[i]).write_kv(0, slots._replace(idx=idx), k_new, v_new)
      return Caches(self.layers[:i] + (one.layer(0),) + self.layers[i + 1:])
    if slots.idx is None:  # sequence-sharded: the whole append on the layer
      return self.with_layer(i, append(self.layer(i), k_new, v_new, slots.new_valid))
    idx = jax.lax.dynamic_index_in_dim(slots.idx, i, axis=0, keepdims=False)  # [b, h, t]
    b, h = idx.shape[:2]
    one = self.layer(i)
    stored = jnp.sum(idx < one.capacity, axis=-1)
    fresh = (jnp.sum(one.valid, axis=-1) == stored) & jnp.any(slots.new_valid, axis=-1)
    first = jnp.argmax(slots.new_valid, axis=-1)  # v_ref: the first real token's value
    new, v_ref = over_heads(cache_lib.slot_kv)(one, k_new, v_new, fresh, first)
    at = (i, jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], idx)
    kv = self.layers
    return Caches(kv._replace(
        **{f: getattr(kv, f).at[at].set(u, mode="drop") for f, u in new.items()},
        v_ref=jax.lax.dynamic_update_index_in_dim(kv.v_ref, v_ref, i, axis=0)))

  def _parts(self) -> tuple:
    return tuple(self.layers) if self.per_layer else (self.layers,)


def _one(cache: KVCache) -> Caches:
  """One layer's caches as stacked caches of one layer (a reshape, no copy)."""
  return Caches(jax.tree_util.tree_map(lambda a: a[None], cache))


def _stacked_field(name: str):
  return property(lambda self: (getattr(self.layers, name) if not self.per_layer else
                                jnp.stack([getattr(c, name) for c in self.layers])),
                  doc=f"``KVCache.{name}`` of every layer, stacked on a leading layer axis.")


for _name in KVCache._fields:  # caches.n_seen, caches.valid, ...: [n_layers, ...] in either form
  setattr(Caches, _name, _stacked_field(_name))


def _metadata(layers: tuple, reads) -> KVCache:
  """Per-layer caches' slot metadata stacked, keys and values whole (``reads`` None) or as
  ``[n_layers, b, h, cap, 1]`` norms where ``reads`` names them, else zeros."""
  if reads is None:
    return _stack(layers)

  def stand_in(name):
    xs = [getattr(c, name) for c in layers]
    if f"{name}_norm" in reads:
      return jnp.stack([norm_column(x) for x in xs])
    return jnp.zeros((len(xs),) + xs[0].shape[:-1] + (1,), jnp.float32)

  meta = _stack([c._replace(k=None, v=None) for c in layers])
  return meta._replace(k=stand_in("k"), v=stand_in("v"))


def init_caches(config, batch: int, capacity: int, dtype=jnp.float32) -> Caches:
  """Empty stacked caches for a config such as :class:`CacheSpec`."""
  one = cache_lib.init_cache(capacity, config.head_dim, dtype=dtype)
  lead = (config.n_layers, batch, config.n_kv_heads)
  return Caches(jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, lead + x.shape), one))


def abstract_caches(config, batch: int, capacity: int, dtype=jnp.float32) -> Caches:
  """:func:`init_caches`' ``jax.ShapeDtypeStruct`` leaves, allocating nothing."""
  return jax.eval_shape(lambda: init_caches(config, batch, capacity, dtype))


def shadow_caches(config, batch: int, n_tokens: int, dtype=jnp.float32) -> Caches:
  """Evaluation mode's never-evicted caches: room for all ``n_tokens``, so slot = position.

  Pass a layer's (``.layer(i)``) to ``certkv_jax.layer.attend`` (``shadow=``; the
  statistics then hold the true error) and all to ``eviction.evict_and_record`` (each
  token's inclusion record; method, section 9). Under a mesh (``jax.set_mesh``) the slots
  are rounded up to a multiple of its ``seq`` axis, the extra ones left empty.
  """
  mesh = distributed.cache_mesh()
  if mesh is not None:
    seq = distributed.axis_size(mesh, SEQ)
    n_tokens = -(-n_tokens // seq) * seq
  return init_caches(config, batch, n_tokens, dtype)


def append(cache: KVCache, k_new, v_new, new_valid) -> KVCache:
  """Appends keys and values ``[batch, n_kv_heads, t, head_dim]`` to one layer's caches.

  ``new_valid`` [batch, n_kv_heads, t] is False on padding (no slot).
  """
  if distributed.cache_mesh() is not None:
    return _sharded_append(cache, k_new, v_new, new_valid)
  return over_heads(cache_lib.append)(cache, k_new, v_new, new_valid)


# --------------------------------------------------------------------------- on a mesh
# Sequence-sharded caches (``certkv_jax.kv.distributed``): the slot axis split over
# ``seq``. Divisibility is checked where caches are placed (``distributed.shard_caches``,
# ``models.sharding``); ``shard_map`` names the axis otherwise.


def _sharded_append(cache: KVCache, k_new, v_new, new_valid) -> KVCache:
  """:func:`append` on one layer's sharded caches, into the slots one device would use."""
  mesh = distributed.require_mesh(None)
  n_local = cache.capacity // distributed.axis_size(mesh, SEQ)

  def body(c, k_new, v_new, new_valid):
    valid_all = jax.lax.all_gather(c.valid, SEQ, axis=2, tiled=True)  # [b, h, cap]
    slots = over_heads(cache_lib.slot_assignment)(valid_all, new_valid)
    lo = jax.lax.axis_index(SEQ) * n_local
    mine = (slots.idx >= lo) & (slots.idx < lo + n_local)
    idx = jnp.where(mine, slots.idx - lo, n_local)  # n_local: not this device's slot
    fresh = ~jnp.any(valid_all, axis=-1)  # the whole cache's, not this shard's
    return over_heads(cache_lib.write_slots)(c, slots, idx, k_new, v_new, fresh)

  specs, new = distributed.cache_specs(0), P(DATA, MODEL)
  return jax.shard_map(body, mesh=mesh, in_specs=(specs, new, new, new), out_specs=specs,
                       check_vma=False)(cache, k_new, v_new, new_valid)


# What a score may read beyond the gathered metadata (log_pi, pos, valid, acc, last, obs).
_NORMS = frozenset({"k_norm", "v_norm"})


def design_reads(design) -> Optional[set]:
  """The "k_norm" / "v_norm" that ``design.evict`` reads, or None if it reads whole k or v."""
  reads = design.reads & (_NORMS | {"k", "v"})
  return set(reads) if reads <= _NORMS else None


def norm_column(x):
  """[..., cap, d] -> [..., cap, 1] float32 row norms; a score's norm of this one-element
  row is the norm again, exactly."""
  return jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True)


def _sharded_evict(design, fn, caches: KVCache, *head_args):
  """A per-head eviction on sequence-sharded caches, exactly as on one device.

  In ``shard_map`` each device all-gathers its heads' slot metadata over ``seq``
  (``O(cap)`` per head: keys and values as norms unless ``design``'s scores read
  them whole), runs ``fn(caches, *head_args) -> (new_caches, info)``, the one-device
  eviction, on whole heads with the same PRNG keys, then keeps or zeroes its own
  slots. ``caches`` [n_layers, batch, n_kv_heads, ...] and ``head_args`` (keys,
  targets) are sharded by ``distributed.cache_specs(1)``; info's slot leaves over seq.
  """
  mesh = distributed.require_mesh(None)
  n_local = caches.capacity // distributed.axis_size(mesh, SEQ)
  reads = design_reads(design)

  def gather(x):
    return jax.lax.all_gather(x, SEQ, axis=3, tiled=True)

  def body(c, *args):
    if reads is None:
      k_all, v_all = gather(c.k), gather(c.v)
    else:  # norms only (or nothing): O(cap) per head instead of O(cap d)
      k_all = gather(norm_column(c.k)) if "k_norm" in reads else jnp.zeros(
          c.k.shape[:3] + (c.capacity * distributed.axis_size(mesh, SEQ), 1), jnp.float32)
      v_all = gather(norm_column(c.v)) if "v_norm" in reads else jnp.zeros_like(k_all)
    meta = c._replace(k=k_all, v=v_all, log_pi=gather(c.log_pi), pos=gather(c.pos),
                      valid=gather(c.valid), acc=gather(c.acc), last=gather(c.last),
                      obs=gather(c.obs), v_sq=gather(c.v_sq))
    new, info = fn(meta, *args)
    lo = jax.lax.axis_index(SEQ) * n_local
    mine = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, n_local, axis=3)
    keep = mine(new.valid)
    out = c._replace(
        k=jnp.where(keep[..., None], c.k, jnp.zeros_like(c.k)),
        v=jnp.where(keep[..., None], c.v, jnp.zeros_like(c.v)),
        log_pi=mine(new.log_pi), pos=mine(new.pos), valid=keep, acc=mine(new.acc),
        last=mine(new.last), obs=mine(new.obs), v_sq=mine(new.v_sq),
        n_seen=new.n_seen, n_dropped=new.n_dropped)
    info = jax.tree_util.tree_map(lambda x: mine(x) if x.ndim > 3 else x, info)
    return out, info

  # info's structure (which leaves carry the slot axis) from an abstract run of fn.
  meta_shapes = caches._replace(
      k=jax.ShapeDtypeStruct(caches.k.shape[:4] + (1,), jnp.float32),
      v=jax.ShapeDtypeStruct(caches.v.shape[:4] + (1,), jnp.float32))
  _, info_shapes = jax.eval_shape(fn, meta_shapes, *head_args)
  info_specs = jax.tree_util.tree_map(
      lambda x: P(None, DATA, MODEL, SEQ) if x.ndim > 3 else P(None, DATA, MODEL), info_shapes)
  arg_specs = tuple(jax.tree_util.tree_map(lambda _: P(None, DATA, MODEL), a) for a in head_args)
  specs = distributed.cache_specs(1)
  return jax.shard_map(body, mesh=mesh, in_specs=(specs,) + arg_specs,
                       out_specs=(specs, info_specs), check_vma=False)(caches, *head_args)
