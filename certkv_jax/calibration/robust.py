"""Source-robust, radius-binned conformal calibration (method, section 10, "The shipped scheme").

Calls are binned by their raw radius (Mondrian conformal), and a bin's scale is
the largest of the per-source split-conformal quantiles, so any mixture of the
calibration sources is covered. One set of edges and scales per regime, budget
and delta; a budget between two fitted ones gets the log-linear mix of their
radii (coverage is established at fitted budgets only), none outside. The
artifact, :class:`BinnedCalibration`, records its sources and the range of
prompt lengths it was fitted on and refuses anything else.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate
from certkv_jax.calibration import conformal
from certkv_jax.calibration import store
Array = jax.Array
KIND = "certkv_jax.robust_calibration"  # the artifact format name, kept from before the move
FORMAT_VERSION = 2
OUTSIDE_RANGE = ("raise", "warn")
DEFAULT_BINS = 8
DTYPES = ("float32", "bfloat16")  # models.precision.DTYPES


def bin_edges(radii, n_bins: int) -> np.ndarray:
  """[n_bins - 1] interior edges: quantiles of ``radii`` at ``k / n_bins``."""
  n_bins = _validate.check_positive_int("n_bins", n_bins)
  r = np.asarray(radii, np.float64).ravel()
  if r.size == 0 or not np.all(np.isfinite(r)):
    raise ValueError(f"radii must be finite and non-empty, got {r.size} values")
  return np.quantile(r, np.arange(1, n_bins) / n_bins)


def robust_scales(errors, radii, sources, edges, delta: float) -> tuple[np.ndarray, np.ndarray]:
  """Per-bin scales: the max over sources of each source's conformal quantile.

  ``errors``, ``radii`` (raw, at ``delta``) and ``sources`` (hashable labels) are
  [n_calls]; ``edges`` [n_bins - 1] are increasing. Returns ``(scales [n_bins],
  n_calls [n_sources, n_bins])``: a source with too few calls in a bin has no
  say there, a bin where none has enough gets ``+inf``.
  """
  labels = np.asarray(sources)
  e = np.asarray(errors, np.float64)
  r = np.asarray(radii, np.float64)
  if not (e.shape == r.shape == labels.shape) or e.ndim != 1:
    raise ValueError(f"errors, radii and sources must be 1-D of one length, got {e.shape}, "
                     f"{r.shape}, {labels.shape}")
  edges = np.asarray(edges, np.float64)
  n_bins = edges.size + 1
  bins = np.searchsorted(edges, r, side="right")
  names = np.unique(labels)
  scales = np.full(n_bins, -np.inf)
  counts = np.zeros((names.size, n_bins), np.int64)
  for i, name in enumerate(names):
    sel = labels == name
    fit = conformal.fit_scales(e[sel], r[sel], bins[sel], n_bins, delta,
                                 min_calls=conformal.min_finite_calls(delta))
    counts[i] = fit.n_calls
    own = np.where(fit.fell_back, -np.inf, fit.scales)  # too few calls: no say
    scales = np.maximum(scales, own)
  scales[np.isneginf(scales)] = np.inf
  return scales, counts


class Calls(NamedTuple):
  """What a batch of raw radii came from; :meth:`BinnedCalibration.radius` checks each
  field against what the calibration was fitted on (ValueError naming the field)."""
  model: str
  design: str
  regime: str
  budget: float
  delta: float
  dtype: str = "float32"  # the calls' weights and caches


@dataclasses.dataclass(frozen=True)
class BinnedCalibration:
  """Scales per (regime, budget, delta, radius bin) of one (model, design).

  Attributes:
    scales: [n_regimes, n_budgets, n_deltas, n_bins] float64 multipliers.
    edges: [n_regimes, n_budgets, n_deltas, n_bins - 1] interior radius edges.
    n_calls: [n_regimes, n_budgets, n_deltas, n_sources, n_bins] int64.
    regimes, budgets, deltas, data: the axes (``data`` = calibration sources).
    context_range: ``(lo, hi)`` prompt tokens (context + question) of the fitted calls.
    dtype: the weights and caches of the fitted calls ("float32" or "bfloat16"):
      rounding changes the errors, so calls of another dtype are a shift.
  """

  scales: np.ndarray
  edges: np.ndarray
  n_calls: np.ndarray
  regimes: tuple
  budgets: tuple
  deltas: tuple
  data: tuple
  context_range: tuple
  model: str
  design: str
  created: str
  dtype: str = "float32"
  format_version: int = FORMAT_VERSION

  def __post_init__(self):
    if self.format_version != FORMAT_VERSION:
      raise ValueError(f"format_version: this code reads version {FORMAT_VERSION}, got "
                       f"{self.format_version!r}")
    shape = (len(self.regimes), len(self.budgets), len(self.deltas))
    scales = np.asarray(self.scales, np.float64)
    if scales.ndim != 4 or scales.shape[:3] != shape:
      raise ValueError(f"scales must be [n_regimes, n_budgets, n_deltas, n_bins] = {shape} + "
                       f"[n_bins], got {scales.shape}")
    if np.isnan(scales).any() or (scales < 0).any():
      raise ValueError("scales must be in [0, inf] with no NaN")
    edges = np.asarray(self.edges, np.float64)
    if edges.shape != scales.shape[:3] + (scales.shape[3] - 1,):
      raise ValueError(f"edges must be {scales.shape[:3] + (scales.shape[3] - 1,)}, got "
                       f"{edges.shape}")
    if np.any(np.diff(edges, axis=-1) < 0):
      raise ValueError("edges must be nondecreasing along the bin axis")
    for name in ("model", "design"):
      if not isinstance(getattr(self, name), str) or not getattr(self, name):
        raise ValueError(f"{name} must be a non-empty str")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
    datetime.datetime.fromisoformat(self.created)
    object.__setattr__(self, "context_range", _check_range(self.context_range))
    for name, arr in (("scales", scales), ("edges", edges),
                      ("n_calls", np.asarray(self.n_calls, np.int64))):
      arr = np.array(arr)
      arr.setflags(write=False)
      object.__setattr__(self, name, arr)

  @property
  def n_bins(self) -> int:
    return self.scales.shape[-1]

  def covers_context(self, context_len: int) -> bool:
    """Whether ``context_len`` prompt tokens lie in the fitted ``context_range``."""
    lo, hi = self.context_range
    return lo <= context_len <= hi

  def fitted_on(self) -> str:
    """'contexts of LO-HI tokens from sources A, B, ...' (for messages)."""
    lo, hi = self.context_range
    span = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f"contexts of {span} tokens from sources {', '.join(self.data)}"

  def budget_neighbours(self, budget: float) -> Optional[tuple]:
    """``((b_lo, weight_lo), (b_hi, weight_hi))``: fitted-budget indices and log-linear
    weights giving ``budget`` (one entry when fitted), None outside their range."""
    budget = float(budget)
    hits = [i for i, s in enumerate(self.budgets) if abs(budget - s) <= store.MATCH_TOL]
    if hits:
      return ((hits[0], 1.0),)
    order = sorted(range(len(self.budgets)), key=lambda i: self.budgets[i])
    for lo, hi in zip(order, order[1:]):
      b_lo, b_hi = self.budgets[lo], self.budgets[hi]
      if b_lo < budget < b_hi:
        t = math.log(budget / b_lo) / math.log(b_hi / b_lo)
        return ((lo, 1.0 - t), (hi, t))
    return None

  def _entry(self, model, design, regime, budget, delta, dtype):
    for name, want, got in (("model", self.model, model), ("design", self.design, design)):
      if got != want:
        raise ValueError(f"{name}: this calibration was made for {want!r}, got {got!r}")
    if dtype != self.dtype:
      raise ValueError(f"dtype: this calibration was fitted on {self.dtype} weights and "
                       f"caches, got {dtype!r}; rounding changes the errors, so its scales "
                       "are not established for these calls (method, section 10)")
    if regime not in self.regimes:
      raise ValueError(f"regime: this calibration was made for {list(self.regimes)}, got "
                       f"{regime!r}")
    i = self.regimes.index(regime)
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (float, int, np.floating)):
      raise ValueError(f"budget must be a float, got {budget!r}")
    b = self.budget_neighbours(budget)
    if b is None:
      raise ValueError(f"budget: this calibration was fitted at budgets {self.budgets} and "
                       f"interpolates between them; {budget!r} is outside "
                       f"[{min(self.budgets)}, {max(self.budgets)}] (refit with the "
                       "validity study at that budget)")
    d = store._index_of("delta", delta, self.deltas)  # pylint: disable=protected-access
    return i, b, d

  def radius(self, raw, calls: Calls, *, context_len: Optional[int] = None,
             outside_range: str = "raise") -> Array:
    """Calibrated radii of raw radii ``raw [...]`` at ``calls.delta`` (jnp; may be traced).

    Every field of ``calls`` must be one this calibration was made for
    (ValueError naming the field). ``context_len``:
    prompt tokens of the calls, None to skip the check; outside
    :attr:`context_range` it raises (naming the range and sources) or, with
    ``outside_range="warn"``, returns the radius and the caller must warn.
    """
    if outside_range not in OUTSIDE_RANGE:
      raise ValueError(f"outside_range must be one of {OUTSIDE_RANGE}, got {outside_range!r}")
    i, b, d = self._entry(*calls)
    if context_len is not None:
      if isinstance(context_len, (bool, np.bool_)) or not isinstance(context_len,
                                                                     (int, np.integer)):
        raise ValueError(f"context_len must be an int (prompt tokens), got {context_len!r}")
      if not self.covers_context(int(context_len)) and outside_range == "raise":
        raise ValueError(f"context_len: this calibration was fitted on {self.fitted_on()}, "
                         f"got context_len={int(context_len)}; its coverage is not "
                         "established there (pass outside_range='warn' to use it anyway and "
                         "warn)")
    raw = jnp.asarray(raw)
    out = 0.0
    for j, weight in b:  # a fitted budget, or a log-linear mix of its two neighbours
      bins = jnp.searchsorted(jnp.asarray(self.edges[i, j, d]), raw, side="right")
      out = out + weight * conformal.apply_scales(raw, bins.astype(jnp.int32),
                                                    self.scales[i, j, d])
    return out

  def metadata(self) -> dict:
    return {"kind": KIND, "format_version": self.format_version, "model": self.model,
            "design": self.design, "regimes": list(self.regimes), "data": list(self.data),
            "budgets": list(self.budgets), "deltas": list(self.deltas),
            "context_range": list(self.context_range), "dtype": self.dtype,
            "created": self.created, "shapes": {k: list(getattr(self, k).shape)
                                                for k in ("scales", "edges", "n_calls")}}


def _check_range(value) -> tuple:
  try:
    lo, hi = value
  except (TypeError, ValueError) as err:
    raise ValueError(f"context_range must be (lo, hi) ints, got {value!r}") from err
  for v in (lo, hi):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
      raise ValueError(f"context_range must be (lo, hi) ints, got {value!r}")
  if not 1 <= lo <= hi:
    raise ValueError(f"context_range must have 1 <= lo <= hi, got {value!r}")
  return int(lo), int(hi)


class FitCalls(NamedTuple):
  """The calls a calibration is fitted on, flat (one entry per call).

  Attributes:
    errors: [n_calls] true errors.
    radii: [n_deltas, n_calls] raw radii, row j at the fit's ``deltas[j]``.
    regimes_per_call, budgets_per_call, sources_per_call: [n_calls] labels.
    context_tokens_per_call: [n_calls] int prompt tokens (context + question).
    dtype: the weights and caches that made the calls (one of :data:`DTYPES`).
  """

  errors: object
  radii: object
  regimes_per_call: object
  budgets_per_call: object
  sources_per_call: object
  context_tokens_per_call: object
  dtype: str = "float32"


def fit(calls: FitCalls, *, regimes: Sequence[str], budgets: Sequence[float],
        deltas: Sequence[float], model: str, design: str, n_bins: int = DEFAULT_BINS,
        created: Optional[str] = None) -> BinnedCalibration:
  """Fits a :class:`BinnedCalibration` on the calls of ``regimes`` x ``budgets``.

  Every (regime, budget) needs calls; ``n_bins`` radius bins per (regime,
  budget, delta); ``model``, ``design`` and the calls' ``dtype`` are checked when
  applied.
  """
  if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 2:
    raise ValueError(f"n_bins must be an int >= 2 (one bin has no edges, which the saved "
                     f"artifact cannot hold), got {n_bins!r}")
  (errors, radii, regimes_per_call, budgets_per_call, sources_per_call,
   context_tokens_per_call, dtype) = calls
  e = np.asarray(errors, np.float64)
  r = np.asarray(radii, np.float64)
  if r.shape != (len(deltas), e.size):
    raise ValueError(f"radii must be [n_deltas={len(deltas)}, n_calls={e.size}], got {r.shape}")
  reg = np.asarray(regimes_per_call)
  bud = np.asarray(budgets_per_call, np.float64)
  src = np.asarray(sources_per_call)
  ctx = np.asarray(context_tokens_per_call)
  for name, arr in (("regimes_per_call", reg), ("budgets_per_call", bud),
                    ("sources_per_call", src), ("context_tokens_per_call", ctx)):
    if arr.shape != e.shape:
      raise ValueError(f"{name} must be [n_calls={e.size}] like errors, got shape {arr.shape}")
  if not np.issubdtype(ctx.dtype, np.integer):
    raise ValueError(f"context_tokens_per_call must be ints (prompt tokens), got dtype "
                     f"{ctx.dtype}")
  used = np.zeros(e.shape, bool)
  names = tuple(sorted(np.unique(src).tolist()))
  shape = (len(regimes), len(budgets), len(deltas))
  scales = np.empty(shape + (n_bins,))
  edges = np.empty(shape + (n_bins - 1,))
  n_calls = np.zeros(shape + (len(names), n_bins), np.int64)
  for i, regime in enumerate(regimes):
    for b, budget in enumerate(budgets):
      sel = (reg == regime) & (np.abs(bud - budget) <= store.MATCH_TOL + 1e-6 * budget)
      if not sel.any():
        raise ValueError(f"no calibration calls for regime {regime!r}, budget {budget}")
      used |= sel
      for d, delta in enumerate(deltas):
        edges[i, b, d] = bin_edges(r[d, sel], n_bins)
        s, c = robust_scales(e[sel], r[d, sel], src[sel], edges[i, b, d], delta)
        scales[i, b, d] = s
        present = [names.index(x) for x in sorted(np.unique(src[sel]).tolist())]
        n_calls[i, b, d, present] = c
  created = created or datetime.datetime.now(datetime.timezone.utc).isoformat()
  return BinnedCalibration(scales=scales, edges=edges, n_calls=n_calls, regimes=tuple(regimes),
                           budgets=tuple(float(x) for x in budgets),
                           deltas=tuple(float(x) for x in deltas), data=names,
                           context_range=(int(ctx[used].min()), int(ctx[used].max())),
                           model=model, design=design, created=created, dtype=dtype)


def save(path, cal: BinnedCalibration, *, overwrite: bool = False) -> str:
  """Writes ``cal`` atomically to the directory ``path`` (orbax; see calibration_store.save)."""
  if not isinstance(cal, BinnedCalibration):
    raise ValueError(f"cal must be a BinnedCalibration, got {type(cal).__name__}")
  arrays = {"scales": np.asarray(cal.scales), "edges": np.asarray(cal.edges),
            "n_calls": np.asarray(cal.n_calls)}
  return store.write_checkpoint(path, arrays, cal.metadata(), overwrite=overwrite)


def load(path) -> BinnedCalibration:
  """Reads a calibration written by :func:`save` (errors as calibration_store.load;
  another format version, e.g. 1, is a ValueError saying how to re-fit it)."""
  try:
    meta, read = store.read_checkpoint(path, KIND, FORMAT_VERSION)
  except ValueError as err:
    if not str(err).startswith("format_version"):
      raise
    raise ValueError(f"{err}. Artifacts before version 2 do not record the context lengths "
                     "they were fitted on, so where they apply cannot be checked; re-fit it "
                     "from its unit files: python -m experiments.calibrate --from_units "
                     "--out=DIR --design=... --data=... --context_len=... --overwrite (fits "
                     "DIR/units into DIR/calibration)") from err
  shapes = meta["shapes"]
  arrays = read({"scales": np.zeros(shapes["scales"], np.float64),
                 "edges": np.zeros(shapes["edges"], np.float64),
                 "n_calls": np.zeros(shapes["n_calls"], np.int64)})
  return BinnedCalibration(
      scales=np.asarray(arrays["scales"]), edges=np.asarray(arrays["edges"]),
      n_calls=np.asarray(arrays["n_calls"]), regimes=tuple(meta["regimes"]),
      budgets=tuple(meta["budgets"]), deltas=tuple(meta["deltas"]), data=tuple(meta["data"]),
      context_range=tuple(meta["context_range"]), model=meta["model"], design=meta["design"],
      created=meta["created"], format_version=meta["format_version"],
      # Artifacts from before the field: the validity and calibration studies that
      # wrote them run float32 only.
      dtype=meta.get("dtype", "float32"))
