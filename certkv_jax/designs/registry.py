"""The one registry of eviction designs: a name to its factory.

Experiments, the CLI, benchmarks and tests list, build and check designs
here, so a name means the same everywhere. A design string
``"design[:setting=value...][+allocation[:setting=value...]]"`` names a design,
its settings (fields of a grouped dataclass setting by their own names) and a
per-head allocation (:data:`ALLOCATIONS`); :func:`parse` is its one parser::

    design = registry.make("snapkv", 0.25, n_sink=4, window=16)
    design, allocation = registry.make_with_allocation(
        "priority_focus:diffuse_weight=0.3+cert:min_share=0.95", 0.25)
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional, Union

from certkv_jax.designs import allocation as allocation_lib
from certkv_jax.designs import framework
from certkv_jax.designs.framework import EvictionDesign
from certkv_jax.designs import keydiff

SHARED = ("n_sink", "window")
FULL = "full"  # no eviction: the reference (no registered design)

_FACTORIES: dict[str, Callable[..., EvictionDesign]] = {
    "sink_window": framework.sink_window,
    "h2o": framework.h2o,
    "tova": framework.tova,
    "snapkv": framework.snapkv,
    "key_norm": framework.key_norm,
    "keydiff": keydiff.keydiff,
    "uniform_random": framework.uniform_random,
    "poisson_tail": framework.poisson_tail,
    "poisson_flat": framework.poisson_flat,
    "attention_proportional": framework.attention_proportional,
    "poisson_defensive": framework.poisson_defensive,
    "poisson_envelope": framework.poisson_envelope,
    "poisson_floor": framework.poisson_floor,
    "priority_tail": framework.priority_tail,
    "priority_floor": framework.priority_floor,
    "priority_blend": framework.priority_blend,
    "priority_focus": framework.priority_focus,
}

# A budget that any design accepts, to read a design's static properties.
_PROBE_BUDGET = 0.5

# Per-head budgets by name (``+allocation`` in a design string; uniform: none).
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
# The window given to a design without one when its allocation reads the window's queries.
OBSERVATION_WINDOW = 16


TWIN_SUFFIX = "_cert"
# The settings a twin adds to its design's, with their defaults.
TWIN_SETTINGS = (("eps", framework.TWIN_EPS), ("spill", True), ("spill_slots", 0),
                 ("top_share", framework.TWIN_SHARE))


def _twin(factory):
  """The factory of ``factory``'s certified twin (:func:`framework.certified`), with
  ``top_share``, ``eps``, ``spill`` and ``spill_slots``."""

  def twin(budget, *, top_share: float = framework.TWIN_SHARE, eps: float = framework.TWIN_EPS,
           spill: bool = True, spill_slots: int = 0, **settings):
    return framework.certified(factory(budget, **settings), top_share=top_share, eps=eps,
                               spill=spill, spill_slots=spill_slots)
  params = list(inspect.signature(factory).parameters.values())
  at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
  for name, default in TWIN_SETTINGS:
    params.insert(at, inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
  twin.__signature__ = inspect.Signature(params)
  return twin


def _factory(name: str):
  """The factory of a registered ``name`` or of ``<deterministic>_cert``, its twin; else None."""
  if name in _FACTORIES:
    return _FACTORIES[name]
  base = name[:-len(TWIN_SUFFIX)] if name.endswith(TWIN_SUFFIX) else None
  if base in _FACTORIES and not make(base, _PROBE_BUDGET).randomized:
    return _twin(_FACTORIES[base])
  return None


def twins() -> tuple[str, ...]:
  """The certified twins' names, one per deterministic registered design."""
  return tuple(n + TWIN_SUFFIX for n in names(randomized=False))


def register(name: str, factory: Callable[..., EvictionDesign]) -> None:
  """Adds a user design (``factory(budget, **settings) -> EvictionDesign``); ValueError if taken."""
  if _factory(name) is not None:
    raise ValueError(f"design {name!r} is already registered")
  _FACTORIES[name] = factory


def names(*, randomized: Optional[bool] = None) -> tuple[str, ...]:
  """Registered design names in registration order (deterministic ones first
  among the built-ins); ``randomized`` filters by the design's tail rule."""
  if randomized is None:
    return tuple(_FACTORIES)
  return tuple(n for n in _FACTORIES if make(n, _PROBE_BUDGET).randomized == randomized)


def make(name: str, budget, **settings) -> EvictionDesign:
  """The design ``name`` (a design string's own settings override ``settings``) at ``budget``.

  The shared settings (``n_sink``, ``window``) go only to the factories that
  take them; any other must be a keyword of the factory or a field of a grouped
  one. Raises ValueError for an unknown design (listing the names), a setting
  the design does not take, or an allocation (use :func:`make_with_allocation`).
  """
  if isinstance(name, str) and _factory(name) is not None:
    return _make_registered(name, budget, settings)
  if not isinstance(name, str) or not (":" in name or "+" in name or name in ALIASES):
    raise ValueError(f"unknown design {name!r}; choose from {sorted(_FACTORIES)}")
  spec = parse(name)
  if spec.allocation != "uniform":
    raise ValueError(f"design {name!r} has a per-head allocation ({spec.allocation!r}): "
                     "use registry.make_with_allocation, which returns (design, allocation)")
  return _make_registered(spec.name, budget, settings, spec.settings)


def _grouped(name: str, params) -> dict:
  """``{setting: parameter}`` for the fields of keyword parameters whose default is a frozen
  dataclass (``certain=CertaintySet()``); TypeError if two would share a name."""
  out = {}
  for p in params.values():
    if p.kind is not p.KEYWORD_ONLY or not dataclasses.is_dataclass(p.default) or isinstance(
        p.default, type):
      continue
    for f in dataclasses.fields(p.default):
      if not f.init:
        continue
      if f.name in params or f.name in out:
        raise TypeError(f"design {name!r}: setting {f.name!r} of {p.name!r} is also "
                        f"{'a parameter' if f.name in params else 'in ' + repr(out[f.name])}")
      out[f.name] = p.name
  return out


def _make_registered(name: str, budget, settings: dict, own=()) -> EvictionDesign:
  """The registered design ``name`` with ``settings`` overridden by the string's ``own``
  (see :func:`make`); grouped fields replace those of the group or its default."""
  factory = _factory(name)
  params = inspect.signature(factory).parameters
  takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
  grouped = _grouped(name, params)
  kwargs, fields = {}, {}
  for key, value in list(settings.items()) + list(own):
    if key in grouped:
      fields.setdefault(grouped[key], {})[key] = value
    elif key in params or takes_any:
      kwargs[key] = value
    elif key not in SHARED or key in dict(own):
      known = (set(params) | set(grouped)) - {"budget"}
      raise ValueError(f"design {name!r} takes no setting {key!r}; it takes {sorted(known)}")
  for group, values in fields.items():
    kwargs[group] = dataclasses.replace(kwargs.get(group, params[group].default), **values)
  return factory(budget, **kwargs)


@dataclasses.dataclass(frozen=True)
class Spec:
  """A parsed design string (:func:`parse`); settings are ``((key, value), ...)`` in order,
  ``allocation`` a name of :data:`ALLOCATIONS`."""

  name: str
  settings: tuple = ()
  allocation: str = "uniform"
  allocation_settings: tuple = ()


def _settings(part: str, text: str, flag: str) -> tuple:
  """``":a=1:b=0.5"`` -> ``(("a", 1), ("b", 0.5))`` (ints when written without a point)."""
  out = []
  for item in part.split(":")[1:]:
    key, eq, value = item.partition("=")
    try:
      num = float(value)
    except ValueError:
      num = None
    if not key or not eq or num is None:
      raise ValueError(f"{flag}: setting {item!r} in {text!r} must be name=number")
    out.append((key, int(num) if num.is_integer() and "." not in value else num))
  return tuple(out)


def parse(text: str, *, flag: str = "design") -> Spec:
  """The :class:`Spec` of a design string (aliases in :data:`ALIASES`).

  Raises ValueError naming ``flag``, the unknown design, allocation or malformed
  setting, and the allowed names; :data:`FULL` takes no settings or allocation.
  """
  if not isinstance(text, str) or not text:
    raise ValueError(f"{flag}: a design must be a non-empty string, got {text!r}")
  spec = ALIASES.get(text, text)
  design_part, plus, alloc_part = spec.partition("+")
  name, alloc = design_part.partition(":")[0], alloc_part.partition(":")[0]
  if plus and not alloc:
    raise ValueError(f"{flag}: no allocation after '+' in {text!r}; choose from "
                     f"{list(ALLOCATIONS)}")
  alloc = alloc or "uniform"
  if name == FULL:
    if spec != FULL:
      raise ValueError(f"{flag}: {FULL!r} (no eviction) takes no settings or allocation, "
                       f"got {text!r}")
    return Spec(FULL)
  if _factory(name) is None:
    where = "" if name == text else f" in {text!r}"
    raise ValueError(f"{flag}: unknown design {name!r}{where}; choose from "
                     f"{[FULL] + list(_FACTORIES)}, as design[:setting=value...]"
                     f"[+allocation[:setting=value...]] with an allocation of "
                     f"{list(ALLOCATIONS)}")
  if alloc not in ALLOCATIONS:
    raise ValueError(f"{flag}: unknown allocation {alloc!r} in {text!r}; choose from "
                     f"{list(ALLOCATIONS)}")
  return Spec(name, _settings(design_part, text, flag), alloc,
              _settings(alloc_part, text, flag))


def _allocation(spec: Spec, text: str, flag: str):
  """The allocation object of ``spec``, its settings applied."""
  allocation = ALLOCATIONS[spec.allocation]
  if not spec.allocation_settings:
    return allocation
  if allocation is None:
    raise ValueError(f"{flag}: uniform budgets take no settings, got {text!r}")
  fields = {f.name for f in dataclasses.fields(allocation)}
  unknown = sorted(set(dict(spec.allocation_settings)) - fields)
  if unknown:
    raise ValueError(f"{flag}: allocation {spec.allocation!r} takes no setting "
                     f"{unknown[0]!r} in {text!r}; it takes {sorted(fields)}")
  return dataclasses.replace(allocation, **dict(spec.allocation_settings))


def make_with_allocation(text: Union[str, Spec], budget, *, flag: str = "design",
                         **settings):
  """``(design, allocation)`` of a design string at ``budget`` (``(None, None)`` for :data:`FULL`).

  ``settings`` go to the design as in :func:`make`. A design with no window of
  its own whose allocation reads one gets :data:`OBSERVATION_WINDOW` queries.
  ValueError naming ``flag`` and what is wrong.
  """
  spec = text if isinstance(text, Spec) else parse(text, flag=flag)
  label = text if isinstance(text, str) else spec.name
  if spec.name == FULL:
    return None, None
  allocation = _allocation(spec, label, flag)
  try:
    design = _make_registered(spec.name, budget, settings, spec.settings)
  except (ValueError, TypeError) as err:  # the factory's own checks, e.g. a setting's type
    raise ValueError(f"{flag}: {err} (in {label!r})") from err
  if allocation is not None and allocation.needs_gains and design.observation_window < 1:
    design = dataclasses.replace(design, observation_window=OBSERVATION_WINDOW)
  return design, allocation
