"""Eviction budgets: validated and resolved into each cache's target here.

Two arguments replace a design's static budget: ``layer_budgets``, a static
per-layer schedule (all ints or all fractions; :func:`pyramid_budgets`), and
``budget``, a possibly traced fraction per row, so one compile serves every
budget. :func:`eviction_targets` turns them into int32 targets
``[n_layers, batch, n_kv_heads]`` that :func:`with_target` puts in the design
(method, sections 9 and 12).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate
from certkv_jax.designs import framework
from certkv_jax.designs import parts

Array = jax.Array
LayerBudgets = tuple  # tuple[int, ...] or tuple[float, ...], one entry per layer


@dataclasses.dataclass(frozen=True, eq=False)
class TracedBudget(parts.Budget):
  """A budget whose target is an int32 array (possibly traced), not static.

  Trace-only; :func:`check_layer_budgets` replaces ``EvictionDesign.init``'s capacity check.
  """

  value: object = None

  def __post_init__(self):  # the parent's static checks do not apply
    if self.value is None:
      raise ValueError("TracedBudget needs a value")

  def target(self, cache) -> Array:
    del cache
    return jnp.asarray(self.value, jnp.int32)


def with_target(design: framework.EvictionDesign, target) -> framework.EvictionDesign:
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
      if x == 1:
        raise ValueError(f"layer_budgets {b}: {parts.AMBIGUOUS_ONE}")
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


def check_budget(budget, batch: Optional[int] = None):
  """A budget fraction (None, float, or float32 ``[]``/``[batch]``) as float32, or None.

  Raises:
    ValueError: a wrong shape, an int (write 1.0, not 1 token), or a concrete
      value outside (0, 1].
  """
  if budget is None:
    return None
  if (isinstance(budget, int) and not isinstance(budget, bool)) or (
      hasattr(budget, "dtype") and jnp.issubdtype(budget.dtype, jnp.integer)):
    raise ValueError(f"budget here is a fraction of the tokens seen (a float in (0, 1]), got "
                     f"an int ({budget!r}): write it as a float (1.0 keeps everything); a "
                     "token count goes in the design (e.g. framework.poisson_tail("
                     "budget=parts.Budget(tokens=n))) or in layer_budgets")
  b = jnp.asarray(budget, jnp.float32)
  if b.ndim > 1 or (b.ndim == 1 and batch is not None and b.shape[0] != batch):
    raise ValueError(f"budget must be a scalar fraction or one per batch row ([{batch}]), "
                     f"got shape {b.shape}")
  if not isinstance(b, jax.core.Tracer):
    bad = [float(x) for x in np.ravel(np.asarray(b)) if not 0.0 < float(x) <= 1.0]
    if bad:
      raise ValueError(f"budget must be a fraction in (0, 1] of the tokens seen, got {bad}")
  return b


def check_generation_budgets(design, layer_budgets, budget, *, n_layers: int, capacity: int,
                             batch: Optional[int] = None) -> Optional[LayerBudgets]:
  """Validates a generation call's design and budgets; returns ``layer_budgets`` as a tuple or None.

  Raises:
    ValueError: a budget without a design, both ``layer_budgets`` and
      ``budget``, or an invalid budget or schedule.
    TypeError: a schedule with entries that are neither int nor float.
  """
  check_budget(budget, batch)
  if budget is not None:
    if design is None:
      raise ValueError("budget needs a design (the design's budget is what it replaces)")
    if layer_budgets is not None:
      raise ValueError("give either layer_budgets or budget, not both")
  if layer_budgets is None:
    return None
  if design is None:
    raise ValueError("layer_budgets needs a design (the design's budget is what they replace)")
  return check_layer_budgets(layer_budgets, n_layers, capacity)


def eviction_targets(n_seen, layer_budgets: Optional[LayerBudgets] = None,
                     budget=None) -> Optional[Array]:
  """Int32 targets, shape of ``n_seen``, under ``layer_budgets`` or ``budget`` (None: neither).

  Raises ValueError when both are given or either is invalid.
  """
  if layer_budgets is None and budget is None:
    return None
  if layer_budgets is not None and budget is not None:
    raise ValueError("give either layer_budgets or budget, not both")
  n_layers, batch = n_seen.shape[:2]
  if layer_budgets is not None:
    return layer_targets(check_layer_budgets(layer_budgets, n_layers), n_seen)
  frac = check_budget(budget, batch)
  frac = frac if frac.ndim == 0 else frac[None, :, None]  # rows -> [layers, batch, kv]
  return fraction_targets(frac, n_seen)


def layer_targets(layer_budgets: LayerBudgets, n_seen) -> Array:
  """int32 targets, shape of ``n_seen`` (``[n_layers, ...]``), from a schedule."""
  n_seen = jnp.asarray(n_seen)
  extra = (1,) * (n_seen.ndim - 1)
  if isinstance(layer_budgets[0], int):
    t = jnp.asarray(layer_budgets, jnp.int32).reshape((-1,) + extra)
    return jnp.broadcast_to(t, n_seen.shape)
  f = jnp.asarray(layer_budgets, jnp.float32).reshape((-1,) + extra)
  return jnp.floor(f * n_seen.astype(jnp.float32) * (1.0 + 1e-6)).astype(jnp.int32)


def fraction_targets(fraction, n_seen) -> Array:
  """int32 targets ``floor(fraction * n_seen)`` for one (possibly traced) fraction."""
  f = jnp.asarray(fraction, jnp.float32)
  n = jnp.asarray(n_seen).astype(jnp.float32)
  return jnp.floor(f * n * (1.0 + 1e-6)).astype(jnp.int32)


def pyramid_budgets(n_layers: int, mean: Union[int, float], beta: float = 20.0) -> LayerBudgets:
  """PyramidKV's schedule, ``2 mean - mean / beta`` down to ``mean / beta`` (method, section 12).

  ``mean`` is a fraction in (0, 1] or a token count >= 2 (entries floored, >= 2: a 1 in
  a schedule reads as ambiguous, :func:`check_layer_budgets`); ``beta`` > 1.

  Raises:
    ValueError: if the first layer's budget would exceed 1 (fractions).
  """
  if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
    raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
  if not (isinstance(beta, (int, float)) and beta > 1):
    raise ValueError(f"beta must be > 1, got {beta!r}")
  is_tokens = isinstance(mean, int) and not isinstance(mean, bool)
  if is_tokens:
    if mean < 2:
      raise ValueError(f"mean token budget must be >= 2, got {mean}")
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
    return tuple(max(2, int(math.floor(x + 1e-9))) for x in sched)
  return tuple(float(x) for x in sched)


@dataclasses.dataclass(frozen=True)
class Lengths:
  """The tokens a generation run puts through each cache, for :func:`capacity`.

  ``chunk`` is the streaming chunk, or None for question-aware generation.

  Raises:
    TypeError or ValueError naming the field unless the counts are ints >= 0
    and ``chunk`` is None or an int >= 1.
  """

  n_context: int
  n_question: int = 0
  n_steps: int = 0
  chunk: Optional[int] = None

  def __post_init__(self):
    for name in ("n_context", "n_question", "n_steps"):
      _validate.check_nonneg_int(name, getattr(self, name))
    if self.chunk is not None:
      _validate.check_positive_int("chunk", self.chunk)


def capacity(design, lengths: Lengths, *, budget=None, layer_budgets=None,
             compacted: bool = False, allocation=None, config=None) -> int:
  """Cache slots per (layer, row, KV head) so that no token is dropped.

  Method, section 9, "The capacity rule". ``compacted`` sizes a cache holding only
  what an eviction kept plus the decoded tokens; ``allocation`` needs ``config``.

  Raises:
    TypeError unless ``lengths`` is a :class:`Lengths`; ValueError for a ``budget``
    outside (0, 1] (:func:`check_budget`), a bad ``layer_budgets`` or both given.
  """
  if not isinstance(lengths, Lengths):
    raise TypeError(f"lengths must be a budgets.Lengths, got {lengths!r}")
  n_context, n_question, n_steps, chunk = (lengths.n_context, lengths.n_question,
                                           lengths.n_steps, lengths.chunk)
  n_padded = n_context if chunk is None else -(-n_context // chunk) * chunk
  total = n_padded + n_question + n_steps
  if budget is not None and layer_budgets is not None:
    raise ValueError("give budget or layer_budgets, not both")
  budget = check_budget(budget)
  if layer_budgets is not None:
    layer_budgets = check_layer_budgets(layer_budgets, len(tuple(layer_budgets)))
  if design is None:
    return total
  if budget is not None:
    fractions = [float(np.max(np.asarray(budget)))]
  elif layer_budgets is not None:
    fractions = list(layer_budgets)
  else:
    b = design.budget
    fractions = [b.tokens if b.tokens is not None else b.fraction]
  n_prompt = n_context + (n_question if chunk is None else 0)

  def kept_after(x):
    # The targets' own floor (parts.Budget.target, float32 with a 1e-6 guard),
    # with a wider guard so that float64 is never below it.
    return x if isinstance(x, int) else int(math.floor(x * n_prompt * (1.0 + 2e-6)))

  kept = max(max(kept_after(x) for x in fractions), design.certain.size + design.min_tail)
  if allocation is not None:
    if config is None:
      raise ValueError("capacity with an allocation needs config (n_layers, n_kv_heads)")
    top = allocation.max_target(kept, config.n_kv_heads, config.n_layers)
    kept = min(max(top, kept), n_prompt)
  if compacted:
    return kept + n_question + n_steps
  if chunk is None:
    return max(n_prompt, kept + n_steps)
  return min(total, kept + chunk + n_question + n_steps)
