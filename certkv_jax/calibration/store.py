"""A fitted conformal calibration as a versioned orbax artifact (method, section 10).

A :class:`Calibration` holds the scales of :mod:`certkv_jax.calibration` for
every (budget, delta, layer, KV head) of one model and design, with what it
was fitted on: the guarantee holds only for exchangeable calls, so
:meth:`Calibration.scale_for` refuses other models, designs, regimes, shapes,
budgets or deltas. On disk: ``arrays`` (``scales``, ``n_calls``, ``fell_back``) and
``metadata`` (JSON), format version 1::

    cal = calibration_store.fit(calls, deltas=(0.05,), budgets=(0.25,),
                                shape=(n_layers, n_kv_heads), provenance=...)
    calibration_store.save("/tmp/cal", cal)
    r_cal = calibration_store.load("/tmp/cal").apply(
        r_raw, model=..., design=..., regime="streaming", budget=0.25, delta=0.05)
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import numbers
import os
import shutil
import tempfile
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from certkv_jax import _validate
from certkv_jax.calibration import conformal
from certkv_jax import certificate

Array = jax.Array

FORMAT_VERSION = 1
RADIUS_FORMS = ("bernstein",)
FALLBACKS = ("layer", "pooled")
KIND = "certkv_jax.calibration"
# Tolerance for matching a requested budget or delta to a stored one.
MATCH_TOL = 1e-9


def _str_tuple(name: str, x) -> tuple:
  if isinstance(x, str) or not x or not all(isinstance(s, str) and s for s in x):
    raise ValueError(f"{name} must be a non-empty sequence of non-empty str, got {x!r}")
  return tuple(x)


def _float_tuple(name: str, x, lo: float, hi: float, hi_open: bool) -> tuple:
  if isinstance(x, (str, bytes)) or np.ndim(x) != 1 or len(x) == 0:
    raise ValueError(f"{name} must be a non-empty 1-D sequence of floats, got {x!r}")
  out = []
  for v in x:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.floating)):
      raise ValueError(f"{name} entries must be floats, got {v!r}")
    v = float(v)
    if not (math.isfinite(v) and lo < v and (v < hi if hi_open else v <= hi)):
      raise ValueError(f"{name} entries must be in ({lo}, {hi}{')' if hi_open else ']'}, "
                       f"got {v!r}")
    out.append(v)
  srt = sorted(out)
  if any(b - a <= MATCH_TOL for a, b in zip(srt, srt[1:])):
    raise ValueError(f"{name} entries must be distinct (more than {MATCH_TOL} apart), got {x}")
  return tuple(out)


def _index_of(name: str, value, stored: tuple) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating)):
    raise ValueError(f"{name} must be a float, got {value!r}")
  hits = [i for i, s in enumerate(stored) if abs(float(value) - s) <= MATCH_TOL]
  if not hits:
    raise ValueError(f"{name}: this calibration was made for {name}s {stored}, got {value!r}")
  return hits[0]


@dataclasses.dataclass(frozen=True, eq=False)
class Calibration:
  """Conformal scales of one (model, design) over budgets, deltas, layers and heads.

  Attributes:
    scales: [n_budgets, n_deltas, n_layers, n_kv_heads] float64 (read-only)
      multipliers of the raw radius; ``+inf`` means no finite guarantee.
    n_calls, fell_back: same shape, calls per (layer, head) and whether the
      entry took its layer's or the pooled scale.
    budgets: floats > 0, one per axis-0 entry; deltas: in (0, 1), axis 1.
    radius_form: the raw radius that the scales multiply ("bernstein").
  """

  scales: np.ndarray
  n_calls: np.ndarray
  fell_back: np.ndarray
  budgets: tuple
  deltas: tuple
  model: str
  design: str
  regimes: tuple
  data: tuple
  created: str
  radius_form: str = "bernstein"
  format_version: int = FORMAT_VERSION

  def __post_init__(self):
    put = lambda k, v: object.__setattr__(self, k, v)  # frozen: set once, here
    if self.format_version != FORMAT_VERSION or isinstance(self.format_version, bool):
      raise ValueError(f"format_version: this code reads version {FORMAT_VERSION}, got "
                       f"{self.format_version!r}")
    if self.radius_form not in RADIUS_FORMS:
      raise ValueError(f"radius_form must be one of {RADIUS_FORMS}, got {self.radius_form!r}")
    for name in ("model", "design"):
      if not isinstance(getattr(self, name), str) or not getattr(self, name):
        raise ValueError(f"{name} must be a non-empty str, got {getattr(self, name)!r}")
    put("regimes", _str_tuple("regimes", self.regimes))
    put("data", _str_tuple("data", self.data))
    put("budgets", _float_tuple("budgets", self.budgets, 0.0, math.inf, True))
    put("deltas", _float_tuple("deltas", self.deltas, 0.0, 1.0, True))
    try:
      datetime.datetime.fromisoformat(self.created)
    except (TypeError, ValueError) as err:
      raise ValueError(f"created must be an ISO-8601 time string, got {self.created!r}") from err
    scales = np.array(self.scales, np.float64)
    if scales.ndim != 4 or scales.shape[:2] != (len(self.budgets), len(self.deltas)):
      raise ValueError(f"scales must have shape [n_budgets={len(self.budgets)}, "
                       f"n_deltas={len(self.deltas)}, n_layers, n_kv_heads], got {scales.shape}")
    if np.isnan(scales).any() or (scales < 0).any():
      raise ValueError("scales must be in [0, inf] with no NaN")
    n_calls = np.asarray(self.n_calls)
    if not np.issubdtype(n_calls.dtype, np.integer) or (n_calls < 0).any():
      raise ValueError(f"n_calls must be nonnegative integers, got dtype {n_calls.dtype}")
    fell_back = np.asarray(self.fell_back)
    if fell_back.dtype != np.bool_:
      raise ValueError(f"fell_back must be bool, got dtype {fell_back.dtype}")
    for name, arr in (("n_calls", n_calls), ("fell_back", fell_back)):
      if arr.shape != scales.shape:
        raise ValueError(f"{name} must have the shape of scales {scales.shape}, got {arr.shape}")
    for name, arr in (("scales", scales), ("n_calls", n_calls.astype(np.int64)),
                      ("fell_back", fell_back.copy())):
      arr = np.array(arr)
      arr.setflags(write=False)
      put(name, arr)

  @property
  def n_layers(self) -> int:
    return self.scales.shape[2]

  @property
  def n_kv_heads(self) -> int:
    return self.scales.shape[3]

  def scale_for(self, *, model: str, design: str, regime: str, budget: float, delta: float,
                n_layers: int, n_kv_heads: int) -> np.ndarray:
    """The [n_layers, n_kv_heads] scales for one use, after checking it matches.

    Raises:
      ValueError naming the first mismatching field; ``regime`` must be one the
      scales were fitted on (pooled), ``budget`` and ``delta`` equal a stored
      entry within ``MATCH_TOL``.
    """
    for name, want, got in (("model", self.model, model), ("design", self.design, design),
                            ("n_layers", self.n_layers, n_layers),
                            ("n_kv_heads", self.n_kv_heads, n_kv_heads)):
      if got != want or type(got) is bool:
        raise ValueError(f"{name}: this calibration was made for {want!r}, got {got!r}")
    if regime not in self.regimes:
      raise ValueError(f"regime: this calibration was made for regimes {self.regimes}, got "
                       f"{regime!r}")
    b = _index_of("budget", budget, self.budgets)
    d = _index_of("delta", delta, self.deltas)
    return self.scales[b, d]

  def apply(self, radii, *, model: str, design: str, regime: str, budget: float,
            delta: float) -> Array:
    """Calibrated radii [..., n_layers, n_kv_heads] (traceable), checked as :meth:`scale_for`."""
    radii = jnp.asarray(radii)
    if radii.ndim < 2:
      raise ValueError(f"radii must be [..., n_layers, n_kv_heads], got shape {radii.shape}")
    scales = self.scale_for(model=model, design=design, regime=regime, budget=budget,
                            delta=delta, n_layers=radii.shape[-2], n_kv_heads=radii.shape[-1])
    groups = np.arange(scales.size).reshape(scales.shape)  # [n_layers, n_kv_heads]
    return conformal.apply_scales(radii, groups, scales.ravel())

  def metadata(self) -> dict:
    """The JSON-able fields (everything but the arrays), as stored on disk."""
    return {"kind": KIND, "format_version": self.format_version, "model": self.model,
            "design": self.design, "regimes": list(self.regimes), "data": list(self.data),
            "budgets": list(self.budgets), "deltas": list(self.deltas),
            "created": self.created, "radius_form": self.radius_form,
            "shape": list(self.scales.shape)}


def _checkpointer():
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def write_checkpoint(path, arrays: dict, metadata: dict, *, overwrite: bool = False) -> str:
  """Writes ``arrays`` (numpy) and ``metadata`` (JSON) to the directory ``path`` atomically.

  Written beside ``path`` and renamed into place, so ``path`` never holds a
  partial artifact. Returns the absolute path.

  Raises:
    FileExistsError: ``path`` exists and ``overwrite`` is False.
    ValueError: an array with no elements (orbax cannot save one).
  """
  path = os.path.abspath(os.fspath(path))
  if os.path.lexists(path) and not overwrite:
    raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
  for name, a in arrays.items():  # orbax refuses one only after its writer has started
    if np.asarray(a).size == 0:
      raise ValueError(f"arrays[{name!r}] has no elements (shape {np.shape(a)}): an "
                       "artifact cannot hold an empty array")
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
  try:
    staged = os.path.join(tmp, "calibration")
    ckpt = _checkpointer()
    try:
      ckpt.save(staged, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                metadata=ocp.args.JsonSave(metadata)))
    finally:  # closed on a failed save too
      ckpt.close()
    if os.path.lexists(path):
      os.rename(path, os.path.join(tmp, "replaced"))
    os.rename(staged, path)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return path


def read_checkpoint(path, kind: str, format_version: int):
  """``(metadata, read)``: ``read(target)`` restores the arrays into ``target``'s shapes/dtypes.

  Raises:
    FileNotFoundError: nothing at ``path``.
    ValueError: not an artifact of ``kind``, or another ``format_version``.
  """
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"no calibration at {path}")
  ckpt = _checkpointer()
  try:
    meta = ckpt.restore(path, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())).metadata
  except Exception as err:  # orbax raises several types for a foreign directory
    raise ValueError(f"{path} is not a certkv_jax calibration (no readable metadata)") from err
  if not isinstance(meta, dict) or meta.get("kind") != kind:
    raise ValueError(f"{path} is not a {kind} artifact (kind "
                     f"{meta.get('kind') if isinstance(meta, dict) else None!r})")
  version = meta.get("format_version")
  if version != format_version:
    raise ValueError(f"format_version: {path} has version {version!r}; this code reads "
                     f"version {format_version}")

  def read(target):
    arrays = ckpt.restore(path, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(target))).arrays
    ckpt.close()
    return arrays

  return meta, read


def save(path, calibration_: Calibration, *, overwrite: bool = False) -> str:
  """Writes ``calibration_`` to the directory ``path`` atomically (:func:`write_checkpoint`).

  Raises:
    FileExistsError: ``path`` exists and ``overwrite`` is False.
  """
  if not isinstance(calibration_, Calibration):
    raise ValueError(f"calibration_ must be a Calibration, got {type(calibration_).__name__}")
  arrays = {"scales": np.asarray(calibration_.scales),
            "n_calls": np.asarray(calibration_.n_calls),
            "fell_back": np.asarray(calibration_.fell_back)}
  return write_checkpoint(path, arrays, calibration_.metadata(), overwrite=overwrite)


def load(path) -> Calibration:
  """Reads a calibration written by :func:`save`.

  Raises:
    FileNotFoundError: nothing at ``path``.
    ValueError: ``path`` is not a calibration, or its ``format_version`` is
      not one this code reads.
  """
  meta, read = read_checkpoint(path, KIND, FORMAT_VERSION)
  shape = tuple(meta["shape"])
  arrays = read({"scales": np.zeros(shape, np.float64), "n_calls": np.zeros(shape, np.int64),
                 "fell_back": np.zeros(shape, np.bool_)})
  return Calibration(
      scales=np.asarray(arrays["scales"]), n_calls=np.asarray(arrays["n_calls"]),
      fell_back=np.asarray(arrays["fell_back"]), budgets=tuple(meta["budgets"]),
      deltas=tuple(meta["deltas"]), model=meta["model"], design=meta["design"],
      regimes=tuple(meta["regimes"]), data=tuple(meta["data"]), created=meta["created"],
      radius_form=meta["radius_form"], format_version=meta["format_version"])


def bernstein_radii(var_hat, range_hat, deltas: Sequence[float]) -> np.ndarray:
  """Raw Bernstein radii [n_deltas, ...] float64 for :func:`fit`, one row per delta."""
  deltas = _float_tuple("deltas", deltas, 0.0, 1.0, True)
  return np.stack([np.asarray(certificate.radius_from_stats(var_hat, range_hat, d), np.float64)
                   for d in deltas])


class GroupCalls(NamedTuple):
  """The calls a calibration is fitted on, as flat arrays (one entry per call).

  ``radii`` is [n_deltas, n_calls], row j at the fit's ``deltas[j]``; each
  ``budgets_per_call`` entry is one of the fit's ``budgets`` within ``MATCH_TOL``.
  """

  errors: object
  radii: object
  layers: object
  heads: object
  budgets_per_call: object


class Provenance(NamedTuple):
  """What a calibration was fitted for and on (see :class:`Calibration`)."""

  model: str
  design: str
  regimes: Sequence[str]
  data: Sequence[str]


def fit(calls: GroupCalls, *, deltas: Sequence[float], budgets: Sequence[float],
        shape: tuple[int, int], provenance: Provenance, fallback: str = "layer",
        min_calls: Optional[int] = None, created: Optional[str] = None) -> Calibration:
  """Fits a :class:`Calibration` from the calls' flat arrays (evaluation mode).

  Each (budget, delta) is fitted by :func:`certkv_jax.calibration.fit_scales`,
  one group per (layer, KV head); small groups fall back to their layer, then
  to all calls of the budget (``fallback="layer"``), or to the latter directly
  (``fallback="pooled"``). Radii are used as given, so the scales multiply the
  radius the caller computes at run time.

  Raises:
    ValueError naming the argument for mismatched lengths, out-of-range
    layers/heads, a call whose budget is not in ``budgets``, a budget with no
    calls, or an unknown ``fallback``.
  """
  errors, radii, layers, heads, budgets_per_call = calls
  n_layers, n_kv_heads = shape
  model, design, regimes, data = provenance
  if fallback not in FALLBACKS:
    raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
  deltas = _float_tuple("deltas", deltas, 0.0, 1.0, True)
  budgets = _float_tuple("budgets", budgets, 0.0, math.inf, True)
  n_layers = _validate.check_positive_int("n_layers", n_layers)
  n_kv_heads = _validate.check_positive_int("n_kv_heads", n_kv_heads)
  e = np.asarray(errors, np.float64)
  if e.ndim != 1:
    raise ValueError(f"errors must be 1-D [n_calls], got shape {e.shape}")
  n = e.size
  r = np.asarray(radii, np.float64)
  if r.shape != (len(deltas), n):
    raise ValueError(f"radii must have shape [n_deltas={len(deltas)}, n_calls={n}], got "
                     f"{r.shape}")
  lay = conformal.check_groups("layers", layers, n_layers, "n_layers")
  hd = conformal.check_groups("heads", heads, n_kv_heads, "n_kv_heads")
  bpc = np.asarray(budgets_per_call, np.float64)
  for name, arr in (("layers", lay), ("heads", hd), ("budgets_per_call", bpc)):
    if arr.shape != (n,):
      raise ValueError(f"{name} must have shape [n_calls={n}] like errors, got {arr.shape}")
  dist = np.abs(bpc[:, None] - np.asarray(budgets)[None, :])  # [n_calls, n_budgets]
  matched = dist <= MATCH_TOL + 1e-6 * np.abs(np.asarray(budgets))[None, :]  # float32-stored
  if not matched.any(axis=1).all():
    bad = np.unique(bpc[~matched.any(axis=1)])[:5]
    raise ValueError(f"budgets_per_call must each be one of budgets {budgets}; got {bad}")
  budget_idx = np.argmax(matched, axis=1)  # [n_calls]
  groups = lay * n_kv_heads + hd  # [n_calls] (layer, head) -> layer * n_kv_heads + head
  coarse = (np.arange(n_layers * n_kv_heads) // n_kv_heads) if fallback == "layer" else None
  shape = (len(budgets), len(deltas), n_layers, n_kv_heads)
  scales = np.empty(shape, np.float64)
  n_calls = np.empty(shape, np.int64)
  fell_back = np.empty(shape, np.bool_)
  for b, budget in enumerate(budgets):
    sel = budget_idx == b
    if not sel.any():
      raise ValueError(f"budgets: no calibration calls for budget {budget}")
    for d, delta in enumerate(deltas):
      fitted = conformal.fit_scales(e[sel], r[d, sel], groups[sel], n_layers * n_kv_heads,
                                      delta, min_calls=min_calls, fallback_groups=coarse)
      scales[b, d] = fitted.scales.reshape(n_layers, n_kv_heads)
      n_calls[b, d] = fitted.n_calls.reshape(n_layers, n_kv_heads)
      fell_back[b, d] = fitted.fell_back.reshape(n_layers, n_kv_heads)
  if created is None:
    created = datetime.datetime.now(datetime.timezone.utc).isoformat()
  return Calibration(scales=scales, n_calls=n_calls, fell_back=fell_back, budgets=budgets,
                     deltas=deltas, model=model, design=design, regimes=tuple(regimes),
                     data=tuple(data), created=created)
