r"""Variants: a registered design, its settings and a per-head allocation, by name.

``"design[:setting=value...][+allocation[:setting=value...]]"`` names a design
of the registry with the budgets of one allocation (uniform, AdaKV,
certificate-targeted, PyramidKV's layer schedule). The strings are parsed by
the one parser, ``certkv_jax.designs.registry.parse`` (it lives in the core so that
``models.text.generate`` reads them too); this module adds the experiments'
shared sink and window sizes (``experiments.lib.design_defaults``) and the
equal-memory budget. The equal-memory comparison, the leaderboard and
``generate`` read the same names, so a variant means the same thing in all::

    parse_variant("priority_floor:min_tail=8+cert")   # ("priority_floor", "cert")
    design, alloc, b = make_variant("h2o+adakv", 64, 0.25, 4, 16)

A design with an allocation that reads the observation window's queries
(``needs_gains``) but has no window of its own gets
:data:`OBSERVATION_WINDOW` queries.
"""

from __future__ import annotations

from typing import Optional

from certkv_jax.designs import registry
from certkv_jax.kv import memory
from experiments.lib import design_defaults

# The registry's tables, re-exported (the names the experiments' flags list).
ALLOCATIONS = registry.ALLOCATIONS
ALIASES = registry.ALIASES
OBSERVATION_WINDOW = registry.OBSERVATION_WINDOW


def parse_variant(variant: str, flag: str = "--variants") -> tuple[str, str]:
  """``"design[:setting=value...]+allocation"`` (allocation default ``uniform``)
  -> (design, allocation); the settings: :func:`variant_settings`.

  Raises:
    ValueError naming the unknown design or allocation (the full cache is no variant).
  """
  spec = registry.parse(variant, flag=flag)
  if spec.name == registry.FULL:
    raise ValueError(f"{flag}: unknown design {variant!r} (the full cache always runs); "
                     f"choose from {list(registry.names())}")
  return spec.name, spec.allocation


def variant_settings(variant: str, part: str = "design", flag: str = "--variants") -> dict:
  """The settings of ``variant``'s ``part`` ("design" or "allocation"):
  ``"priority_floor:heavy_share=0.5+cert:max_share=2"`` -> ``{"heavy_share":
  0.5}`` and ``{"max_share": 2}`` (values are floats, or ints when integral).

  Raises:
    ValueError naming the malformed setting.
  """
  spec = registry.parse(variant, flag=flag)
  return dict(spec.settings if part == "design" else spec.allocation_settings)


def design_and_allocation(variant: str, n_sink: int, window: int, flag: str = "--variants"):
  """(design, allocation) of ``variant``, its settings applied (errors name the variant)."""
  parse_variant(variant, flag)
  return registry.make_with_allocation(variant, 0.5, flag=flag, n_sink=n_sink, window=window)


def make_variant(variant: str, head_dim: int, memory_fraction: float, n_sink: int,
                 window: int):
  """(design, allocation, budget fraction) of ``variant`` at ``memory_fraction``."""
  design, allocation = design_and_allocation(variant, n_sink, window)
  b = memory.token_fraction(memory_fraction, design, head_dim, allocation=allocation)
  return design, allocation, b


def is_randomized(variant: str) -> bool:
  """Whether ``variant``'s design samples its tail (False for the full cache)."""
  return design_defaults.is_randomized(variant)


def twin_base(variant: str) -> Optional[str]:
  """The deterministic variant a certified twin (``<design>_cert``, with any
  ``top_share`` or ``spill``) is paired with: the same design string without the suffix
  and the twin's own settings, the same allocation; None for a variant that is no twin."""
  design, plus, allocation = variant.partition("+")
  name, *settings = design.split(":")
  if not name.endswith(registry.TWIN_SUFFIX):
    return None
  own = tuple(f"{name}=" for name, _ in registry.TWIN_SETTINGS)
  kept = [s for s in settings if not s.startswith(own)]
  return ":".join([name[:-len(registry.TWIN_SUFFIX)]] + kept) + plus + allocation
