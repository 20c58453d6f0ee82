"""The budget at which a prompt's calls get a certificate: computed from the prompt.

A radius is positive only if its cache keeps a sampled token (``0 < pi < 1``,
method, section 3). :func:`certifying_budget` evicts the prefilled prompt at each
budget of a grid and returns the smallest one where enough caches keep one.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import eviction
from models import decode
from models import prefill as prefill_lib

TARGET = 0.9  # the share of caches (hence of calls) that should hold a sampled token
GRID = tuple(round(0.01 * i, 2) for i in range(1, 101))  # budgets tried, in order
# Eviction draws averaged per budget (the hint is for the expected share).
DRAWS = 16


class Hint(NamedTuple):
  """A suggested budget and what it was computed from."""

  budget: Optional[float]  # the smallest grid budget reaching ``target``; None: none does
  share: float  # mean share of caches with a sampled token at ``budget`` (or the best)
  target: float


def _share(caches):
  """Share of the (layer, row, KV head) caches that keep a sampled token."""
  sampled = jnp.any(caches.valid & (caches.log_pi < 0), axis=-1)
  return jnp.mean(sampled.astype(jnp.float32))


def certifying_budget(params, config, context_ids, design, key, *, start: float = 0.0,
                      target: float = TARGET, allocation=None) -> Hint:
  """The smallest budget of :data:`GRID` above ``start`` at which at least
  ``target`` (in (0, 1], else ValueError) of the caches keep a sampled token after
  the eviction of ``context_ids`` by the randomized ``design`` under ``allocation``
  (its per-head budgets, as the run applies them; None: uniform)."""
  if not 0.0 < target <= 1.0:
    raise ValueError(f"target must be in (0, 1], got {target!r}")
  tokens = jnp.asarray(np.asarray(context_ids, np.int32))[None, :]
  n = tokens.shape[1]
  best = Hint(None, 0.0, target)
  if n <= design.certain.size:  # the certainty set holds every token at any budget
    return best
  _, caches = prefill_lib.prefill(params, tokens, jnp.ones_like(tokens, bool), config=config,
                                  capacity=n, chunk=n, design=design)
  keys = jax.random.split(key, DRAWS)
  evict_args = decode.allocation_args(params, config, allocation)
  shares = jax.jit(lambda c, b: jax.vmap(
      lambda k: _share(eviction.evict(design, c, k, budget=b, **evict_args)[0]))(keys))
  for budget in (b for b in GRID if b > start):
    share = float(jnp.mean(shares(caches, jnp.float32(budget))))
    if share >= target:
      return Hint(budget, share, target)
    if share > best.share:
      best = Hint(None, share, target)
  return best


def describe(hint: Hint, where: str = "prompt") -> str:
  """One sentence for the report."""
  if hint.budget is None:
    return (f"no budget up to 1 keeps a sampled token in {hint.target:.0%} of the caches of "
            f"this {where} (at best {hint.share:.0%}): a longer {where}, or a smaller n_sink / "
            "window, leaves room for a sampled tail")
  return (f"--budget={hint.budget:g} or more (computed from this {where}: at {hint.budget:g}, "
          f"{hint.share:.0%} of the (layer, KV head) caches keep a sampled token after the "
          f"first eviction, on average over {DRAWS} draws; a call whose cache keeps one has a "
          "positive radius)")
