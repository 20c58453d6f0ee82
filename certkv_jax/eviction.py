"""Eviction of a model's caches: a design applied to every (layer, row, KV head).

:func:`evict` resolves the budget, then runs ``design.evict`` on each cache with
its own PRNG key (``jax.vmap``; sequence-sharded caches through
``distributed_eviction.map_evict``, with the same result). In evaluation mode
:func:`record_inclusion` keeps each round's inclusion probabilities in the shadow cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from certkv_jax.designs import budgets as budgets_lib
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv.cache import KVCache
from certkv_jax.kv import caches as caches_lib
from certkv_jax.kv.caches import over_heads
from certkv_jax.kv import distributed
from certkv_jax.kv import distributed_eviction


class Evicted(NamedTuple):
  """What :func:`evict` and :func:`evict_and_record` return."""

  caches: KVCache  # in the form given (stacked or per layer)
  state: Any  # the design's counters, carried to the next round
  info: Any  # the round's ``EvictionInfo``, leaves [n_layers, batch, n_kv_heads, ...]
  shadow: Optional[KVCache] = None  # evict_and_record's shadow with this round's record


def init_state(design, caches: KVCache):
  """The design's zero state, leaves ``[n_layers, batch, n_kv_heads]``, carried by the caller."""
  if caches_lib.is_unstacked(caches):
    return caches_lib.stack(tuple(over_heads(design.init)(c) for c in caches))
  return jax.vmap(over_heads(design.init))(caches)


def evict(design, caches: KVCache, key, *, state=None, layer_budgets=None, budget=None,
          allocation=None, gains=None):
  """Applies ``design.evict`` to every (layer, row, KV head) cache (jitted).

  Args:
    design: a ``certkv_jax.EvictionDesign``.
    caches: stacked caches, leaves ``[n_layers, batch, n_kv_heads, ...]``, or per
      layer (``caches.unstack``; returned per layer, not on a mesh).
    key: PRNG key, split into one key per cache.
    state: the design's counters from :func:`init_state` or the last round; None: zero.
    layer_budgets: optional, static: one budget per layer, all ints (tokens) or
      all floats (fractions), replacing the design's.
    budget: optional, may be traced: a fraction in (0, 1], scalar or ``[batch]``,
      replacing the design's in every layer (one program for every budget).
    allocation: optional, static: a per-head allocation (``certkv_jax.designs.allocation``;
      not on sequence-sharded caches), with ``gains`` [n_layers, n_kv_heads] if it needs them.

  Returns an :class:`Evicted` (``shadow`` None).
  """
  if layer_budgets is not None:
    layer_budgets = tuple(layer_budgets)
  if budget is not None:
    budget = budgets_lib.check_budget(budget, _n_seen(caches).shape[1])
  if state is None:
    state = init_state(design, caches)
  if distributed.cache_mesh() is not None:  # sequence-sharded, inside its own jit
    if caches_lib.is_unstacked(caches):
      raise ValueError("caches per layer (caches.unstack) are not supported on a mesh: "
                       "pass them stacked")
    if allocation is not None:
      raise ValueError("allocation is not supported on sequence-sharded caches: it pools "
                       "scores across heads that live on other devices")
    return Evicted(*_evict(design, caches, state, key, layer_budgets, budget))
  return Evicted(*_evict_jit(design, caches, state, key, layer_budgets, budget, allocation,
                             gains))


def _evict(design, caches: KVCache, state, key, layer_budgets, budget, allocation=None,
           gains=None):
  """:func:`evict`'s body (traced once per design, schedule and shapes)."""
  n_seen = _n_seen(caches)
  lead = n_seen.shape  # [n_layers, batch, n_kv_heads]
  keys = jax.random.split(key, lead[0] * lead[1] * lead[2])
  keys = keys.reshape(lead + keys.shape[1:])
  targets = budgets_lib.eviction_targets(n_seen, layer_budgets, budget)  # or None
  if allocation is not None:
    stacked = caches_lib.stack(caches)
    if targets is None:
      targets = jax.vmap(over_heads(design.budget.target))(stacked)
    targets = allocation(design, stacked, targets, gains)
  per_cache = (state, keys) if targets is None else (state, keys, targets)

  def one(cache, s, k, *target):  # one (layer, row, KV head); target [] int32, if any
    d = budgets_lib.with_target(design, target[0]) if target else design
    new, s, info = d.evict(cache, s, k)
    return new, (s, info)

  evict_all = jax.vmap(over_heads(one))  # over [n_layers, batch, n_kv_heads]
  with jax.named_scope("eviction"), cache_lib.rebase_deferred():
    if caches_lib.is_unstacked(caches):
      new, (state, info) = _evict_per_layer(design, evict_all, caches, per_cache)
    elif distributed.cache_mesh() is None:
      new, (state, info) = evict_all(caches, *per_cache)
    else:  # each device gathers its heads' slot metadata and keeps its own slots
      new, (state, info) = distributed_eviction.map_evict(design, evict_all, caches,
                                                          *per_cache)
    new = caches_lib.rebase(new)  # no evicted token's value stays as a reference
  return new, state, info


_evict_jit = jax.jit(_evict, static_argnames=("design", "layer_budgets", "allocation"))


def _evict_per_layer(design, evict_all, caches: tuple, per_cache):
  """``evict_all`` on per-layer caches: one decision on the stacked slot metadata (keys
  and values as norms or zeros unless read), applied by each layer to its own buffers."""
  reads = distributed_eviction.design_reads(design)

  def stand_in(name):  # [n_layers, b, h, cap, 1]: the stacked norms, or zeros unread
    xs = [getattr(c, name) for c in caches]
    if f"{name}_norm" in reads:
      return jnp.stack([distributed_eviction.norm_column(x) for x in xs])
    return jnp.zeros((len(xs),) + xs[0].shape[:-1] + (1,), jnp.float32)

  if reads is None:
    meta = caches_lib.stack(caches)
  else:
    meta = caches_lib.stack([c._replace(k=None, v=None) for c in caches])
    meta = meta._replace(k=stand_in("k"), v=stand_in("v"))
  new, out = evict_all(meta, *per_cache)
  apply = over_heads(cache_lib.apply_keep)
  return tuple(apply(c, new.valid[i], new.log_pi[i]) for i, c in enumerate(caches)), out


def _n_seen(caches):
  """[n_layers, batch, n_kv_heads] tokens seen, of stacked or per-layer caches."""
  if caches_lib.is_unstacked(caches):
    return jnp.stack([c.n_seen for c in caches])
  return caches.n_seen


def record_inclusion(shadow: KVCache, before: KVCache, info) -> KVCache:
  """Evaluation mode: adds one eviction round's ``log pi`` to the shadow cache's record.

  The never-evicted shadow (slot = position) accumulates each token's log
  inclusion probability over its rounds (method, section 9); ``before``: the
  caches the round applied to, ``info``: its ``EvictionInfo``.
  """
  if caches_lib.is_unstacked(shadow) or caches_lib.is_unstacked(before):
    shadows, befores = caches_lib.unstack(shadow), caches_lib.unstack(before)
    new = tuple(_record_layer(sh, b, info.pi[i]) for i, (sh, b) in enumerate(zip(shadows,
                                                                                 befores)))
    return new if caches_lib.is_unstacked(shadow) else caches_lib.stack(new)
  return _record_jit(shadow, before, info.pi)


def _record_one(sh, cache, pi):  # one (layer, row, KV head)
  log_pi = jnp.log(jnp.where(cache.valid, pi, 1.0))
  idx = jnp.where(cache.valid, cache.pos, sh.log_pi.shape[0])  # invalid -> dropped
  return sh._replace(log_pi=sh.log_pi.at[idx].add(log_pi, mode="drop"))


@jax.jit
def _record_jit(shadow, before, pi):
  return jax.vmap(over_heads(_record_one))(shadow, before, pi)


@jax.jit
def _record_layer(shadow, before, pi):
  return over_heads(_record_one)(shadow, before, pi)


def evict_and_record(design, caches: KVCache, shadow: Optional[KVCache], key, **evict_args):
  """:func:`evict` (``evict_args``: its keywords), and in evaluation mode (``shadow``
  not None) the shadow's inclusion record (:func:`record_inclusion`); an :class:`Evicted`."""
  new = evict(design, caches, key, **evict_args)
  if shadow is not None:
    shadow = record_inclusion(shadow, caches, new.info)
  return new._replace(shadow=shadow)
