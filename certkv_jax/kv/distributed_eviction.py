"""Eviction on sequence-sharded caches, exactly as on one device (:func:`map_evict`).

Each device gathers only per-slot metadata (``O(cap)`` per head, not the
``O(cap d)`` keys and values), so the design sees whole heads with the same keys.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from certkv_jax.kv.cache import KVCache
from certkv_jax.kv import distributed
from certkv_jax.kv.distributed import DATA
from certkv_jax.kv.distributed import MODEL
from certkv_jax.kv.distributed import SEQ


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


def map_evict(design, fn, caches: KVCache, *head_args):
  """Runs a per-head eviction on sequence-sharded caches exactly as on one device.

  In ``shard_map`` each device all-gathers its heads' slot metadata over ``seq``
  (keys and values as norms unless ``design``'s scores read them whole), runs
  ``fn(caches, *head_args) -> (new_caches, info)``, the one-device eviction, on
  whole heads with the same PRNG keys, then keeps or zeroes its own slots.
  ``caches`` are sharded by ``distributed.cache_specs(1)``, ``head_args`` (keys,
  targets) ``[n_layers, batch, n_kv_heads, ...]`` like them; the result is
  sharded like the inputs (info's slot leaves over seq).
  """
  mesh = distributed._require_mesh(None)  # pylint: disable=protected-access
  distributed.check_cache(mesh, caches, lead=1)
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
