r"""Variants: a registered design, its settings and a per-head allocation, by name.

``"design[:setting=value...][+allocation[:setting=value...]]"`` names a design
of the registry (``experiments.lib.design_defaults``) with the budgets of one
allocation (:data:`ALLOCATIONS`: uniform, AdaKV, certificate-targeted,
PyramidKV's layer schedule). The equal-memory comparison and the leaderboard
read the same names, so a variant means the same thing in both::

    parse_variant("priority_floor:min_tail=8+cert")   # ("priority_floor", "cert")
    design, alloc, b = make_variant("h2o+adakv", 64, 0.25, 4, 16)

A design with an allocation that reads the observation window's queries
(``needs_gains``) but has no window of its own gets
:data:`OBSERVATION_WINDOW` queries.
"""

from __future__ import annotations

import dataclasses

from certkv_jax import allocation as allocation_lib
from certkv_jax import memory
from experiments.lib import design_defaults

ALLOCATIONS = {
    "uniform": None,
    "adakv": allocation_lib.AdaKV(),
    "cert": allocation_lib.CertificateTargeted(scope="layer"),
    "cert_model": allocation_lib.CertificateTargeted(scope="model"),
    "pyramid": allocation_lib.Pyramid(),
    "pyramid_adakv": allocation_lib.Pyramid(within=allocation_lib.AdaKV()),
}
# PyramidKV = SnapKV's scores under the pyramid layer schedule (Cai et al., 2024).
ALIASES = {"pyramidkv": "snapkv+pyramid", "pyramidkv+adakv": "snapkv+pyramid_adakv"}
OBSERVATION_WINDOW = 16  # the window a cert allocation reads (SnapKV's is its own)


def parse_variant(variant: str, flag: str = "--variants") -> tuple[str, str]:
  """``"design[:setting=value...]+allocation"`` (allocation default ``uniform``)
  -> (design, allocation); the settings: :func:`variant_settings`.

  Raises:
    ValueError naming the unknown design or allocation.
  """
  variant = ALIASES.get(variant, variant)
  design, _, alloc = variant.partition("+")
  design, alloc = design.partition(":")[0], alloc.partition(":")[0]
  alloc = alloc or "uniform"
  if design not in design_defaults.names() or design == design_defaults.FULL:
    raise ValueError(f"{flag}: unknown design {design!r} in {variant!r}; choose from "
                     f"{list(design_defaults.names()[1:])}")
  if alloc not in ALLOCATIONS:
    raise ValueError(f"{flag}: unknown allocation {alloc!r} in {variant!r}; choose from "
                     f"{list(ALLOCATIONS)}")
  return design, alloc


def variant_settings(variant: str, part: str = "design", flag: str = "--variants") -> dict:
  """The settings of ``variant``'s ``part`` ("design" or "allocation"):
  ``"priority_floor:heavy_share=0.5+cert:max_share=2"`` -> ``{"heavy_share":
  0.5}`` and ``{"max_share": 2}`` (values are floats, or ints when integral).

  Raises:
    ValueError naming the malformed setting.
  """
  spec = ALIASES.get(variant, variant).partition("+")[0 if part == "design" else 2]
  out = {}
  for item in spec.split(":")[1:]:
    key, eq, value = item.partition("=")
    try:
      num = float(value)
    except ValueError:
      num = None
    if not key or not eq or num is None:
      raise ValueError(f"{flag}: setting {item!r} in {variant!r} must be name=number")
    out[key] = int(num) if num.is_integer() and "." not in value else num
  return out


def design_and_allocation(variant: str, n_sink: int, window: int, flag: str = "--variants"):
  """(design, allocation) of ``variant``, its settings applied (errors name the variant)."""
  name, alloc_name = parse_variant(variant, flag)
  allocation = ALLOCATIONS[alloc_name]
  alloc_settings = variant_settings(variant, "allocation", flag)
  if alloc_settings:
    if allocation is None:
      raise ValueError(f"{flag}: uniform budgets take no settings, got {variant!r}")
    fields = {f.name for f in dataclasses.fields(allocation)}
    unknown = sorted(set(alloc_settings) - fields)
    if unknown:
      raise ValueError(f"{flag}: allocation {alloc_name!r} takes no setting {unknown[0]!r}"
                       f" in {variant!r}; it takes {sorted(fields)}")
    allocation = dataclasses.replace(allocation, **alloc_settings)
  design = design_defaults.make_design(name, 0.5, n_sink, window,
                                       **variant_settings(variant, flag=flag))
  if allocation is not None and allocation.needs_gains and design.observation_window < 1:
    design = dataclasses.replace(design, observation_window=OBSERVATION_WINDOW)
  return design, allocation


def make_variant(variant: str, head_dim: int, memory_fraction: float, n_sink: int,
                 window: int):
  """(design, allocation, budget fraction) of ``variant`` at ``memory_fraction``."""
  design, allocation = design_and_allocation(variant, n_sink, window)
  b = memory.token_fraction(memory_fraction, design, head_dim, allocation=allocation)
  return design, allocation, b


def is_randomized(variant: str) -> bool:
  """Whether ``variant``'s design samples its tail (False for the full cache)."""
  return (variant != design_defaults.FULL
          and design_defaults.is_randomized(parse_variant(variant)[0]))
