"""Eviction of a model's caches: a design applied to every (layer, row, KV head).

:func:`evict` resolves the budget, then runs ``design.evict`` on each cache with
its own PRNG key (``Caches.evict_heads``: stacked, per layer or sequence-sharded, with
the same result). In evaluation mode
:func:`record_inclusion` keeps each round's inclusion probabilities in the shadow cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from certkv_jax import _validate
from certkv_jax.designs import budgets as budgets_lib
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv import caches as caches_lib
from certkv_jax.kv.caches import Caches
from certkv_jax.kv.caches import over_heads
from certkv_jax.kv import distributed


class Evicted(NamedTuple):
  """What :func:`evict` and :func:`evict_and_record` return."""

  caches: Caches  # in the form given (stacked or per layer)
  state: Any  # the design's counters, carried to the next round
  info: Any  # the round's ``EvictionInfo``, leaves [n_layers, batch, n_kv_heads, ...]
  shadow: Optional[Caches] = None  # evict_and_record's shadow with this round's record


def init_state(design, caches: Caches):
  """The design's zero state, leaves ``[n_layers, batch, n_kv_heads]``, carried by the caller."""
  return caches.map(design.init)


def evict(design, caches: Caches, key, *, state=None, layer_budgets=None, budget=None,
          allocation=None, gains=None):
  """Applies ``design.evict`` to every (layer, row, KV head) cache (jitted).

  Args:
    design: a ``certkv_jax.EvictionDesign``.
    caches: ``certkv_jax.kv.caches.Caches``, stacked or per layer (not per layer on a mesh);
      returned in the same form.
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
  _validate.check_design(design)
  _validate.check_allocation(allocation)
  caches_lib.check_caches(caches)
  if layer_budgets is not None:
    layer_budgets = tuple(layer_budgets)
  targets = budgets_lib.eviction_targets(caches.n_seen, layer_budgets, budget)  # or None
  if state is None:
    state = init_state(design, caches)
  if distributed.cache_mesh() is not None:  # sequence-sharded, inside its own jit
    if caches.per_layer:
      raise ValueError("caches per layer (Caches.unstack) are not supported on a mesh: "
                       "pass them stacked")
    if allocation is not None:
      raise ValueError("allocation is not supported on sequence-sharded caches: it pools "
                       "scores across heads that live on other devices")
    return Evicted(*_evict(design, caches, state, key, targets))
  return Evicted(*_evict_jit(design, caches, state, key, targets, allocation, gains))


def _evict(design, caches: Caches, state, key, targets, allocation=None, gains=None):
  """:func:`evict`'s body (traced once per design and shapes); ``targets``
  ``[n_layers, batch, n_kv_heads]`` int32 or None (the design's own budget)."""
  lead = caches.n_seen.shape  # [n_layers, batch, n_kv_heads]
  keys = jax.random.split(key, lead[0] * lead[1] * lead[2])
  keys = keys.reshape(lead + keys.shape[1:])
  if allocation is not None:
    stacked = caches.as_kvcache()
    if targets is None:
      targets = jax.vmap(over_heads(design.budget.target))(stacked)
    targets = allocation(design, stacked, targets, gains)
  per_cache = (state, keys) if targets is None else (state, keys, targets)

  def one(cache, s, k, *target):  # one (layer, row, KV head); target [] int32, if any
    d = budgets_lib.with_target(design, target[0]) if target else design
    new, s, info = d.evict(cache, s, k)
    return new, (s, info)

  with jax.named_scope("eviction"), cache_lib.rebase_deferred():
    new, (state, info) = caches.evict_heads(design, one, *per_cache)
    new = new.rebase()  # no evicted token's value stays as a reference
  return new, state, info


_evict_jit = jax.jit(_evict, static_argnames=("design", "allocation"))


def _record_one(sh, cache, pi):  # one (layer, row, KV head)
  log_pi = jnp.log(jnp.where(cache.valid, pi, 1.0))
  idx = jnp.where(cache.valid, cache.pos, sh.log_pi.shape[0])  # invalid -> dropped
  return sh._replace(log_pi=sh.log_pi.at[idx].add(log_pi, mode="drop"))


@jax.jit
def record_inclusion(shadow: Caches, before: Caches, info) -> Caches:
  """Evaluation mode: adds one eviction round's ``log pi`` to the shadow cache's record.

  The never-evicted shadow (slot = position) accumulates each token's log
  inclusion probability over its rounds (method, section 9); ``before``: the
  caches the round applied to, ``info``: its ``EvictionInfo``.
  """
  return shadow.map(_record_one, before, info.pi)


def evict_and_record(design, caches: Caches, shadow: Optional[Caches], key, **evict_args):
  """:func:`evict` (``evict_args``: its keywords), and in evaluation mode (``shadow``
  not None) the shadow's inclusion record (:func:`record_inclusion`); an :class:`Evicted`."""
  new = evict(design, caches, key, **evict_args)
  if shadow is not None:
    shadow = record_inclusion(shadow, caches, new.info)
  return new._replace(shadow=shadow)
