"""The one registry of eviction designs: a name to its factory.

Every place that lists, builds or checks designs by name reads this table:
experiments, the generation CLI, the benchmarks and the tests. A factory takes
the budget and keyword settings and returns an :class:`EvictionDesign`; the
defaults are the factory's own (the core defaults). Settings shared by an
experiment (``n_sink``, ``window``) are passed by name, and only to the
factories that take them (:func:`make`); experiment defaults live in
``experiments``. Adding a design is one line here (see ``keydiff.py``)::

    designs = registry.names()                       # every registered name
    design = registry.make("snapkv", 0.25, n_sink=4, window=16)
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

from certkv_jax import designs
from certkv_jax import keydiff
from certkv_jax.designs import EvictionDesign

SHARED = ("n_sink", "window")

_FACTORIES: dict[str, Callable[..., EvictionDesign]] = {
    "sink_window": designs.sink_window,
    "h2o": designs.h2o,
    "tova": designs.tova,
    "snapkv": designs.snapkv,
    "key_norm": designs.key_norm,
    "keydiff": keydiff.keydiff,
    "uniform_random": designs.uniform_random,
    "poisson_tail": designs.poisson_tail,
    "poisson_flat": designs.poisson_flat,
    "attention_proportional": designs.attention_proportional,
    "poisson_defensive": designs.poisson_defensive,
    "poisson_envelope": designs.poisson_envelope,
    "poisson_floor": designs.poisson_floor,
    "priority_tail": designs.priority_tail,
    "priority_floor": designs.priority_floor,
    "priority_blend": designs.priority_blend,
    "priority_focus": designs.priority_focus,
}

# A budget that any design accepts, to read a design's static properties.
_PROBE_BUDGET = 0.5


def register(name: str, factory: Callable[..., EvictionDesign]) -> None:
  """Adds a user's design (``factory(budget, **settings) -> EvictionDesign``).

  Raises:
    ValueError if ``name`` is taken.
  """
  if name in _FACTORIES:
    raise ValueError(f"design {name!r} is already registered")
  _FACTORIES[name] = factory


def names(*, randomized: Optional[bool] = None) -> tuple[str, ...]:
  """Registered design names in registration order (deterministic ones first
  among the built-ins); ``randomized`` filters by the design's tail rule."""
  if randomized is None:
    return tuple(_FACTORIES)
  return tuple(n for n in _FACTORIES if make(n, _PROBE_BUDGET).randomized == randomized)


def make(name: str, budget, **settings) -> EvictionDesign:
  """The design ``name`` at ``budget``.

  The shared settings (``n_sink``, ``window``) go to the factories that take
  them: :func:`designs.sink_window` has no recent-window setting (its window is
  whatever the budget leaves after the sinks). Any other setting must be one
  of the factory's keywords.

  Raises:
    ValueError naming the design and listing the known names, or naming a
    setting the design does not take.
  """
  if name not in _FACTORIES:
    raise ValueError(f"unknown design {name!r}; choose from {sorted(_FACTORIES)}")
  factory = _FACTORIES[name]
  params = inspect.signature(factory).parameters
  takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
  kwargs = {}
  for key, value in settings.items():
    if key in params or takes_any:
      kwargs[key] = value
    elif key not in SHARED:
      raise ValueError(f"design {name!r} takes no setting {key!r}; it takes "
                       f"{sorted(k for k in params if k != 'budget')}")
  return factory(budget, **kwargs)
