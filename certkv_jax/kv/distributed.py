"""Scale-out on JAX's own runtime: a (data, model, seq) mesh for certkv caches.

``data`` splits batch rows, ``model`` KV heads (and, Megatron-style, the
weights: ``models.sharding``), ``seq`` the slot axis of every cache. Slot-axis
work runs in ``jax.shard_map`` with collectives over ``seq`` only: attention
merges per-device partials with the Pallas kernel's split-K combine (method,
section 9, "Single-pass statistics and kernels"). Appends and evictions on sharded
caches are ``certkv_jax.kv.caches.Caches`` methods, like the one-device ones.
``models.decode`` runs under a context mesh with these axes (:func:`cache_mesh`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from certkv_jax import _validate
from certkv_jax.kv.cache import KVCache
from pallas_kernels import reference

Array = jax.Array

DATA, MODEL, SEQ = "data", "model", "seq"
AXES = (DATA, MODEL, SEQ)
_HP = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------- the mesh


def make_mesh(data: int = 1, model: int = 1, seq: int = 1, devices=None) -> jax.sharding.Mesh:
  """A mesh with axes ``("data", "model", "seq")`` of the given sizes (ints >= 1).

  The first ``data * model * seq`` of ``devices`` (default ``jax.devices()``)
  form it, in ``jax.make_mesh``'s order.

  Raises:
    TypeError/ValueError naming the axis for a non-int or size < 1; ValueError
    when the mesh needs more devices than there are.
  """
  sizes = {DATA: data, MODEL: model, SEQ: seq}
  for name, n in sizes.items():
    _validate.check_positive_int(f"mesh axis {name!r}", n)
  devices = list(jax.devices() if devices is None else devices)
  n = data * model * seq
  if n > len(devices):
    raise ValueError(f"mesh (data={data}, model={model}, seq={seq}) needs {n} devices, "
                     f"only {len(devices)} available")
  return jax.make_mesh((data, model, seq), AXES, axis_types=(AxisType.Auto,) * 3,
                       devices=devices[:n])


def axis_size(mesh, axis: str) -> int:
  """Size of ``axis`` in ``mesh`` (concrete or abstract)."""
  if axis not in mesh.axis_names:
    raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.axis_names)} "
                     f"(make it with certkv_jax.kv.distributed.make_mesh)")
  return int(dict(mesh.shape)[axis])


def check_divisible(what: str, size: int, mesh, axis: str) -> None:
  """Raises a ValueError naming both sizes unless ``axis``'s size divides ``size``."""
  n = axis_size(mesh, axis)
  if size % n:
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    raise ValueError(f"{what} ({size}) is not divisible by the size of mesh axis {axis!r} "
                     f"({n}); choose a {axis!r} axis size that divides {size}: {divisors}")


def check_mesh(mesh) -> None:
  """Checks that ``mesh`` has the axes data, model and seq."""
  missing = [a for a in AXES if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"mesh needs the axes {AXES}; missing {missing} (axes: "
                     f"{tuple(mesh.axis_names)}); make it with certkv_jax.kv.distributed.make_mesh")


def cache_mesh():
  """The context mesh (``jax.set_mesh``) if it has the data, model and seq axes, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not all(a in mesh.axis_names for a in AXES):
    return None
  return mesh


def require_mesh(mesh):
  """``mesh``, or the context mesh if None; ValueError when there is none or its axes are wrong."""
  mesh = cache_mesh() if mesh is None else mesh
  if mesh is None:
    raise ValueError("no mesh: pass mesh= or call under `with jax.set_mesh(mesh):` with a "
                     "mesh from certkv_jax.kv.distributed.make_mesh")
  check_mesh(mesh)
  return mesh


# --------------------------------------------------------------------------- cache shardings


def cache_specs(lead: int = 1) -> KVCache:
  """``PartitionSpec`` of every cache leaf, as a :class:`KVCache`.

  ``lead`` counts unsharded axes before ``[batch, n_kv_heads]`` (1 for stacked
  per-layer caches). ``n_seen``, ``n_dropped`` and ``v_ref`` are replicated over seq.
  """
  pre = (None,) * lead
  slot, head = P(*pre, DATA, MODEL, SEQ), P(*pre, DATA, MODEL)
  return KVCache(k=slot, v=slot, log_pi=slot, pos=slot, valid=slot, acc=slot, last=slot,
                 obs=slot, v_sq=slot, n_seen=head, n_dropped=head, v_ref=head)


def check_cache(mesh, caches: KVCache, lead: int = 1) -> None:
  """Checks that batch, KV heads and capacity are divisible by data, model, seq."""
  check_mesh(mesh)
  if caches.valid.ndim != lead + 3:
    raise ValueError(f"cache leaves must be [{'n_layers, ' * lead}batch, n_kv_heads, cap, ...]"
                     f"; valid has shape {caches.valid.shape}")
  b, h, cap = caches.valid.shape[lead:]
  check_divisible("batch", b, mesh, DATA)
  check_divisible("n_kv_heads", h, mesh, MODEL)
  check_divisible("cache capacity", cap, mesh, SEQ)


def cache_shardings(mesh, lead: int = 1) -> KVCache:
  """:class:`NamedSharding` of every cache leaf (see :func:`cache_specs`)."""
  check_mesh(mesh)
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), cache_specs(lead),
                                is_leaf=lambda x: isinstance(x, P))


def shard_caches(caches, mesh, lead: int = 1):
  """Places caches on ``mesh`` (batch -> data, KV heads -> model, slots -> seq): a
  ``KVCache`` or a tree of them (``certkv_jax.kv.caches.Caches``, stacked)."""
  is_kv = lambda x: isinstance(x, KVCache)
  for c in jax.tree_util.tree_leaves(caches, is_leaf=is_kv):
    check_cache(mesh, c, lead)
  shardings = jax.tree_util.tree_map(lambda _: cache_shardings(mesh, lead), caches,
                                     is_leaf=is_kv)
  return jax.device_put(caches, shardings)


def per_device_bytes(tree) -> dict:
  """``{device id: bytes}`` of ``tree``'s arrays on this process's devices."""
  out: dict = {}
  for leaf in jax.tree_util.tree_leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device.id] = out.get(shard.device.id, 0) + int(shard.data.nbytes)
  return out


# --------------------------------------------------------------------------- attention


def combine_over(partials: reference.Partials, axis_name: str = SEQ) -> reference.Partials:
  """Merges per-device partials over a mesh axis (in ``shard_map``) with ``reference.combine``."""
  gathered = jax.tree_util.tree_map(lambda x: jax.lax.all_gather(x, axis_name, axis=0),
                                    partials)
  return reference.combine(gathered, axis=0)


def _local_partials(q, k, v, log_pi, mask, scale, second_order):
  """One device's (Partials [b, h, R], logits [b, h, R, n], w [b, h, 1, n]) over its slots.

  q [b, h, R, d]; k [b, h, n, d]; v [b, h, n, dv]; log_pi [b, h, n]; mask [b, h, R, n].
  """
  offset = -log_pi.astype(jnp.float32)[..., None, :]  # [b, h, 1, n]
  w = reference.one_minus_pi(offset)
  l = reference.slot_logits(q, k, offset, mask, scale)
  col = jnp.any(mask, axis=-2)  # [b, h, n]: slots some row may read
  # Centre of the second-order sums: the value of the highest-logit slot (one
  # gather, as in reference.grouped_reference); combine re-centres the parts.
  top = jnp.argmax(jnp.max(jnp.where(mask, l, reference.M_EMPTY), axis=-2), axis=-1)
  center = jnp.take_along_axis(v, top[..., None, None], axis=-2).astype(jnp.float32)
  center = jnp.where(jnp.any(col, axis=-1)[..., None, None], center, 0.0)  # [b, h, 1, dv]
  p = reference.online_update(reference.empty_partials(l.shape[:-1], v.shape[-1]), l, v, w,
                              mask, valid_col=col[..., None],
                              options=reference.UpdateOptions(
                                  precision=_HP, second_order=second_order, center=center))
  return p, l, w


class ShardedAttention(NamedTuple):
  """Offset attention over a sequence-sharded cache (fields as in
  ``certkv_jax.OffsetAttentionResult``, plus the slot probabilities)."""

  out: Array  # [b, h, R, dv] float32
  lse: Array  # [b, h, R]
  var_hat: Array  # [b, h, R] (0 when computed without statistics)
  range_hat: Array  # [b, h, R] exact b_hat (0 without statistics)
  probs: Optional[Array]  # [b, h, R, n] offset-attention probabilities p_i, or None


@dataclasses.dataclass(frozen=True)
class Outputs:
  """What :func:`sharded_offset_attention` computes besides ``out`` and ``lse`` (static).

  ``stats``: ``var_hat`` and exact ``range_hat`` (else 0); ``probs``: ``p_i``
  [b, h, R, n], sharded like the slots. Raises TypeError unless both are bools.
  """

  stats: bool = True
  probs: bool = False

  def __post_init__(self):
    for name in ("stats", "probs"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")


def _attention_body(q, k, v, log_pi, mask, *, scale, outputs: Outputs):
  p, l, w = _local_partials(q, k, v, log_pi, mask, scale, outputs.stats)
  fin = reference.finalize(combine_over(p, SEQ))
  lse_safe = jnp.where(jnp.isfinite(fin.lse), fin.lse, 0.0)[..., None]
  if outputs.stats:
    rng = jax.lax.pmax(reference.exact_range(l, v, w, mask, fin.out, fin.lse), SEQ)
  else:
    rng = jnp.zeros_like(fin.var_hat)
  probs = jnp.where(mask, jnp.exp(l - lse_safe), 0.0) if outputs.probs else None
  return ShardedAttention(fin.out, fin.lse, fin.var_hat, rng, probs)


def sharded_offset_attention(q, k, v, log_pi, mask, *, mesh=None, scale: Optional[float] = None,
                             outputs: Outputs = Outputs()) -> ShardedAttention:
  """``certkv_jax.offset_attention`` over a cache sharded on its slot axis.

  Equal to the one-device result up to float32 summation order.

  Args:
    q: [b, h, R, d] query rows (R = a GQA group times queries).
    k: [b, h, n, d]; v: [b, h, n, dv]; log_pi: [b, h, n] (<= 0 where valid).
    mask: [b, h, R, n] or [b, h, n] bool, the slots each row attends to.
    mesh: default: the context mesh. scale: default ``1/sqrt(d)``.

  Raises:
    ValueError for mismatched shapes or a mesh axis that does not divide
    ``b``, ``h`` or ``n``.
  """
  mesh = require_mesh(mesh)
  if not isinstance(outputs, Outputs):
    raise TypeError(f"outputs must be a distributed.Outputs, got {outputs!r}")
  q, k, v, log_pi, mask = (jnp.asarray(x) for x in (q, k, v, log_pi, mask))
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [b, h, R, d], [b, h, n, d], [b, h, n, dv]; got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  b, h, r, d = q.shape
  n = k.shape[2]
  if k.shape != (b, h, n, d) or v.shape[:3] != (b, h, n):
    raise ValueError(f"k must be {(b, h, 'n', d)} and v {(b, h, 'n', 'dv')}; got {k.shape}, "
                     f"{v.shape}")
  if log_pi.shape != (b, h, n):
    raise ValueError(f"log_pi must be {(b, h, n)}, got {log_pi.shape}")
  if mask.shape == (b, h, n):
    mask = mask[:, :, None, :]
  if mask.dtype != jnp.bool_ or mask.shape[-1] != n or mask.shape[:2] != (b, h) or (
      mask.shape[2] not in (1, r)):
    raise ValueError(f"mask must be bool [b, h, R or 1, n] = {(b, h, r, n)}, got "
                     f"{mask.dtype} {mask.shape}")
  mask = jnp.broadcast_to(mask, (b, h, r, n))
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  elif not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
    raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")
  check_divisible("batch (b)", b, mesh, DATA)
  check_divisible("KV heads (h)", h, mesh, MODEL)
  check_divisible("slots (n)", n, mesh, SEQ)
  rows, slots = P(DATA, MODEL), P(DATA, MODEL, SEQ)
  out_specs = ShardedAttention(rows, rows, rows, rows,
                               P(DATA, MODEL, None, SEQ) if outputs.probs else None)
  body = lambda *a: _attention_body(*a, scale=float(scale), outputs=outputs)
  return jax.shard_map(body, mesh=mesh, in_specs=(rows, slots, slots, slots,
                                                  P(DATA, MODEL, None, SEQ)),
                       out_specs=out_specs, check_vma=False)(q, k, v, log_pi, mask)


def cache_attention(qg, cache: KVCache, positions, *, with_stats: bool,
                    with_probs: bool) -> ShardedAttention:
  """A decoder layer's attention over its sequence-sharded caches.

  ``qg`` [b, h_kv, g, t, d]; cache leaves [b, h_kv, cap, ...]; ``positions``
  [b, t]. Returns ``out`` [b, h_kv, g, t, dv], statistics [b, h_kv, g, t] and
  ``probs`` [b, h_kv, g, t, cap] (or None).
  """
  b, h, g, t, d = qg.shape
  mask = cache.valid[:, :, None, :] & (cache.pos[:, :, None, :] <= positions[:, None, :, None])
  mask = jnp.broadcast_to(mask[:, :, None], (b, h, g, t, cache.capacity))
  res = sharded_offset_attention(qg.reshape(b, h, g * t, d), cache.k, cache.v, cache.log_pi,
                                 mask.reshape(b, h, g * t, cache.capacity),
                                 outputs=Outputs(stats=bool(with_stats), probs=bool(with_probs)))
  rows = lambda x: x.reshape((b, h, g, t) + x.shape[3:])
  return ShardedAttention(rows(res.out), rows(res.lse), rows(res.var_hat), rows(res.range_hat),
                          None if res.probs is None else rows(res.probs))


# --------------------------------------------------------------------------- certificates


def aggregate_heads(radii, *, mesh=None, how: str = "sum") -> Array:
  """[n_steps, batch] sum or max (``how``) of radii [n_steps, n_layers, batch, n_heads]."""
  if how not in ("sum", "max"):
    raise ValueError(f"how must be 'sum' or 'max', got {how!r}")
  mesh = require_mesh(mesh)
  radii = jnp.asarray(radii, jnp.float32)
  if radii.ndim != 4:
    raise ValueError(f"radii must be [n_steps, n_layers, batch, n_heads], got {radii.shape}")
  check_divisible("batch", radii.shape[2], mesh, DATA)
  check_divisible("n_heads", radii.shape[3], mesh, MODEL)

  def body(r):
    if how == "sum":
      return jax.lax.psum(jnp.sum(r, axis=(1, 3)), MODEL)
    return jax.lax.pmax(jnp.max(r, axis=(1, 3)), MODEL)

  return jax.shard_map(body, mesh=mesh, in_specs=P(None, None, DATA, MODEL),
                       out_specs=P(None, DATA))(radii)
