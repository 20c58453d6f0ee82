"""The experiments' shared design settings, over the one registry of designs.

Every experiment builds its designs here: :func:`make_design` is
``certkv_jax.designs.registry.make`` with the sink and recent-window sizes the
experiments share (:data:`N_SINK`, :data:`WINDOW`; ``snapkv`` and
``poisson_envelope`` also take the window as their observation window), and
:data:`FULL` names the reference that evicts nothing. The names an
experiment accepts come from the registry (:func:`names`), so a design added
there is known everywhere; a name may carry the design's own settings
(``"priority_focus:diffuse_weight=0.3"``, parsed by ``certkv_jax.designs.registry.parse``;
per-head allocations: :mod:`experiments.lib.variants`)::

    design = make_design("snapkv", 0.25)          # snapkv with 4 sinks, window 16
    make_design(FULL, 0.25)                       # None: keep everything
    names()                                       # ("full", "sink_window", ...)
"""

from __future__ import annotations

from typing import Optional

from certkv_jax.designs.framework import EvictionDesign
from certkv_jax.designs import registry

N_SINK = 4  # sink tokens every design keeps
WINDOW = 16  # recent tokens every design keeps (snapkv / poisson_envelope: observation window)
FULL = registry.FULL  # "full": no eviction, the reference


def make_design(name: str, budget, n_sink: int = N_SINK,
                window: int = WINDOW, **settings) -> Optional[EvictionDesign]:
  """None for :data:`FULL`; else the registered design ``name`` at ``budget`` with the
  shared settings (and any of the design's own ``settings``).

  Raises:
    ValueError naming the design and listing the known names.
  """
  if name == FULL:
    return None
  return registry.make(name, budget, n_sink=n_sink, window=window, **settings)


def names(*, randomized: Optional[bool] = None) -> tuple[str, ...]:
  """:data:`FULL` and every registered design (``randomized``: only the registered
  designs of that kind, without :data:`FULL`)."""
  if randomized is not None:
    return registry.names(randomized=randomized)
  return (FULL,) + registry.names()


def is_randomized(name: str) -> bool:
  """Whether the design string ``name`` (allocations included) samples its tail (False
  for :data:`FULL`)."""
  design, _ = registry.make_with_allocation(name, 0.5, n_sink=N_SINK, window=WINDOW)
  return design is not None and bool(design.randomized)
