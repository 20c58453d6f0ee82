"""Per-layer eviction budgets (PyramidKV-style schedules).

A design (``certkv_jax.EvictionDesign``) carries one static budget that
:func:`models.decode.evict` applies to every layer. PyramidKV (Cai et al.,
2024) instead gives lower layers more tokens than upper ones. Here a per-layer
schedule is a static tuple with one entry per layer, all ``int`` (tokens kept
after eviction) or all ``float`` in (0, 1] (fraction of the tokens seen, with
the same ``floor(f * n_seen)`` rule as ``certkv_jax.designs.Budget``).

Inside the jitted eviction the schedule becomes an int32 array of targets over
``[n_layers, batch, n_kv_heads]``, vmapped together with the stacked caches;
each (layer, row, KV head) runs the design with its layer's target through
:func:`with_target`, which swaps the design's static budget for a traced one
(:class:`TracedBudget`). Everything else about the design (certainty set, tail
rule, scores) is unchanged, so the same design object serves every layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Union

import jax
import jax.numpy as jnp

from certkv_jax import designs

Array = jax.Array
LayerBudgets = tuple  # tuple[int, ...] or tuple[float, ...], one entry per layer


@dataclasses.dataclass(frozen=True, eq=False)
class TracedBudget(designs.Budget):
  """A budget whose target is an int32 array (possibly traced), not static.

  Only for use inside a trace (it is not hashable by value): ``tokens`` and
  ``fraction`` are both None, so ``EvictionDesign.init`` skips its static
  budget-vs-capacity check (:func:`check_layer_budgets` does it instead).
  """

  value: object = None

  def __post_init__(self):  # the parent's static checks do not apply
    if self.value is None:
      raise ValueError("TracedBudget needs a value")

  def target(self, cache) -> Array:
    del cache
    return jnp.asarray(self.value, jnp.int32)


def with_target(design: designs.EvictionDesign, target) -> designs.EvictionDesign:
  """``design`` with its budget replaced by the int32 ``target`` (tokens kept)."""
  return dataclasses.replace(design, budget=TracedBudget(value=target))


def check_layer_budgets(layer_budgets: Sequence[Union[int, float]], n_layers: int,
                        capacity: int | None = None) -> LayerBudgets:
  """Validates a per-layer schedule; returns it as a tuple.

  Raises:
    ValueError: wrong length, mixed kinds, an int < 1 or > ``capacity``, or a
      float outside (0, 1].
    TypeError: entries that are neither int nor float.
  """
  b = tuple(layer_budgets)
  if len(b) != n_layers:
    raise ValueError(f"layer_budgets needs one entry per layer ({n_layers}), got {len(b)}")
  if all(isinstance(x, int) and not isinstance(x, bool) for x in b):
    for x in b:
      if x < 1:
        raise ValueError(f"layer_budgets token counts must be >= 1, got {b}")
      if capacity is not None and x > capacity:
        raise ValueError(f"layer budget {x} tokens exceeds the cache capacity ({capacity})")
    return b
  if all(isinstance(x, float) for x in b):
    for x in b:
      if not 0.0 < x <= 1.0:
        raise ValueError(f"layer_budgets fractions must be in (0, 1], got {b}")
    return b
  raise TypeError(f"layer_budgets must be all ints (tokens) or all floats (fractions), got {b}")


def layer_targets(layer_budgets: LayerBudgets, n_seen) -> Array:
  """int32 targets, shape of ``n_seen`` (``[n_layers, ...]``), from a schedule.

  Fractions follow ``designs.Budget.target``: ``floor(f * n_seen)`` with the
  same relative guard against float32 rounding.
  """
  n_seen = jnp.asarray(n_seen)
  extra = (1,) * (n_seen.ndim - 1)
  if isinstance(layer_budgets[0], int):
    t = jnp.asarray(layer_budgets, jnp.int32).reshape((-1,) + extra)
    return jnp.broadcast_to(t, n_seen.shape)
  f = jnp.asarray(layer_budgets, jnp.float32).reshape((-1,) + extra)
  return jnp.floor(f * n_seen.astype(jnp.float32) * (1.0 + 1e-6)).astype(jnp.int32)


def fraction_targets(fraction, n_seen) -> Array:
  """int32 targets ``floor(fraction * n_seen)`` (shape of ``n_seen``) for one
  (possibly traced) fraction, with :func:`layer_targets`' rounding guard."""
  f = jnp.asarray(fraction, jnp.float32)
  n = jnp.asarray(n_seen).astype(jnp.float32)
  return jnp.floor(f * n * (1.0 + 1e-6)).astype(jnp.int32)


def pyramid_budgets(n_layers: int, mean: Union[int, float], beta: float = 20.0) -> LayerBudgets:
  """PyramidKV's schedule: linearly decreasing from the first layer to the last.

  The last layer gets ``mean / beta``, the first ``2 mean - mean / beta``, and
  the layers in between are linear, so the schedule averages ``mean``
  (PyramidKV's ``k^{L-1} = k_total / (beta L)``, ``k^0 = 2 k_total / L -
  k^{L-1}``). ``mean`` is a fraction (float in (0, 1]) or a token count (int;
  entries are rounded down, at least 1, so the mean can fall slightly short).

  Args:
    n_layers: number of layers (>= 1).
    mean: the average budget per layer.
    beta: top-to-mean ratio, > 1 (PyramidKV's default is 20). Larger is steeper.

  Returns:
    A tuple of ``n_layers`` floats (fractions) or ints (tokens).

  Raises:
    ValueError: if the first layer's budget would exceed 1 (fractions).
  """
  if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
    raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
  if not (isinstance(beta, (int, float)) and beta > 1):
    raise ValueError(f"beta must be > 1, got {beta!r}")
  is_tokens = isinstance(mean, int) and not isinstance(mean, bool)
  if is_tokens:
    if mean < 1:
      raise ValueError(f"mean token budget must be >= 1, got {mean}")
  elif not (isinstance(mean, float) and 0.0 < mean <= 1.0):
    raise ValueError(f"mean must be an int token count or a float fraction in (0, 1], "
                     f"got {mean!r}")
  if n_layers == 1:
    return (mean,)
  top = mean / beta
  bottom = 2.0 * mean - top
  if not is_tokens and bottom > 1.0:
    raise ValueError(f"pyramid with mean {mean} and beta {beta} gives the first layer "
                     f"{bottom:.3f} > 1; lower the mean or beta")
  sched = [bottom - (bottom - top) * i / (n_layers - 1) for i in range(n_layers)]
  if is_tokens:
    return tuple(max(1, int(math.floor(x + 1e-9))) for x in sched)
  return tuple(float(x) for x in sched)
