"""Flat per-call tables of the validity study and their calibration folds.

:func:`load_calls` turns the unit files of :mod:`experiments.lib.validity.collect`
into one flat table (numpy columns, one entry per decode call: step, layer,
row, query head), :func:`fit_fold` fits a split-conformal
:class:`certkv_jax.calibration.store.Calibration` on the calls of some data
sources, and :func:`radii` gives the raw or calibrated radius of every call.

Calibration folds (method, section 10): a calibration is fitted on the calls
of one group of data sources (e.g. natural text) and evaluated on the others
(the retrieval tasks), and the reverse, so that the shift between what a
calibration was fitted on and where it is used is measured, not assumed.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence

import numpy as np

from certkv_jax import calibration
from certkv_jax.calibration import robust
from certkv_jax.calibration import store
from certkv_jax import certificate
from experiments.lib.validity import collect as collect_lib

DELTAS = (0.01, 0.05, 0.1)
PRIMARY_DELTA = 0.05
CATEGORIES = ("design", "regime", "data")


@dataclasses.dataclass
class Calls:
  """One entry per decode call; every column has the same length."""

  columns: dict  # name -> [n_calls] array
  n_layers: int
  n_heads: int
  n_kv_heads: int
  model: str

  def __len__(self) -> int:
    return len(self.columns["true_error"])

  def __getitem__(self, name: str) -> np.ndarray:
    return self.columns[name]

  def select(self, mask) -> "Calls":
    return dataclasses.replace(self, columns={k: v[mask] for k, v in self.columns.items()})

  def where(self, **eq) -> np.ndarray:
    """Bool mask of the calls whose columns equal ``eq`` (a tuple/list value: any of)."""
    mask = np.ones(len(self), bool)
    for k, v in eq.items():
      col = self.columns[k]
      if isinstance(v, (tuple, list, set, frozenset)):
        mask &= np.isin(col, list(v))
      else:
        mask &= col == v
    return mask


def load_calls(paths: Sequence[str]) -> Calls:
  """Flattens unit files into a :class:`Calls` table.

  Besides the per-call arrays of the unit (``true_error``, ``var_hat``, ...,
  signals), each call carries: ``step``, ``layer``, ``head`` (query head),
  ``kv_head``, ``budget``, ``example`` (index within its data source),
  ``cluster`` (one id per (context, regime, design, data, example): the calls
  that are not independent of each other), ``correct`` / ``mean_logprob`` of
  its row, ``n_prompt`` (its row's prompt tokens: context + question),
  ``var_smoothed`` (:func:`smoothed_radii`'s variance), and the unit's
  ``context_len``, ``regime``, ``design``, ``data``.
  """
  if not paths:
    raise ValueError("paths: no unit files to load (run the collection first)")
  cols: dict = {}
  shape_meta = None
  cluster_base = 0
  for p in paths:
    arrays, meta = collect_lib.load_unit(p)
    dims = (meta["n_layers"], meta["n_heads"], meta["n_kv_heads"], meta["model"])
    if shape_meta is None:
      shape_meta = dims
    elif dims != shape_meta:
      raise ValueError(f"{p}: model shape {dims} differs from the other units' {shape_meta}")
    if "n_prompt" not in arrays:
      raise ValueError(f"{p}: no n_prompt (prompt tokens per row); rerun its collection")
    err = arrays["true_error"]  # [S, L, B, H]
    n_s, n_l, n_b, n_h = err.shape
    grid = np.meshgrid(np.arange(n_s), np.arange(n_l), np.arange(n_b), np.arange(n_h),
                       indexing="ij")
    step, layer, row, head = (g.ravel() for g in grid)
    group = meta["n_heads"] // meta["n_kv_heads"]
    lp = arrays["logprobs"].astype(np.float64).mean(axis=1)  # [B]
    add = {
        "step": step, "layer": layer, "head": head, "kv_head": head // group,
        "budget": arrays["budget"][row].astype(np.float64),
        "example": arrays["example"][row],
        "cluster": cluster_base + arrays["example"][row],
        "correct": arrays["correct"][row], "mean_logprob": lp[row],
        "n_prompt": arrays["n_prompt"][row].astype(np.int64),
        "context_len": np.full(step.shape, meta["context_len"]),
        "regime": np.full(step.shape, meta["regime"]),
        "design": np.full(step.shape, meta["design"]),
        "data": np.full(step.shape, meta["data"]),
    }
    # V_hat smoothed over each (layer, row, head)'s decode steps (method, section 5)
    add["var_smoothed"] = np.asarray(certificate.smoothed_variance(
        arrays["var_hat"].astype(np.float32), axis=0), np.float64).ravel()
    cluster_base += int(arrays["example"].max()) + 1
    for k in collect_lib.CALL_FIELDS + collect_lib.SIGNAL_FIELDS:
      if k in arrays:
        add[k] = arrays[k].astype(np.float64).ravel()
    for k, v in add.items():
      cols.setdefault(k, []).append(v)
  columns = {k: np.concatenate(v) for k, v in cols.items()}
  n_layers, n_heads, n_kv, model = shape_meta
  return Calls(columns, n_layers, n_heads, n_kv, model)


def raw_radii(calls: Calls, delta: float) -> np.ndarray:
  """The certificate's (Bernstein) radius of every call at ``delta`` (method, section 5)."""
  return np.asarray(certificate.radius_from_stats(calls["var_hat"], calls["range_hat"], delta),
                    np.float64)


def smoothed_radii(calls: Calls, delta: float) -> np.ndarray:
  """The smoothed radius of every call at ``delta``: the Bernstein radius with ``V_hat``
  replaced by the larger of itself and its mean over the call's (layer, row, head)'s
  last 6 decode steps (method, section 5, "Smoothed variance")."""
  return np.asarray(certificate.radius_from_stats(calls["var_smoothed"], calls["range_hat"],
                                                  delta), np.float64)


def fit_fold(calls: Calls, *, design: str, data: Sequence[str], context_len: int,
             budgets: Sequence[float], deltas: Sequence[float] = DELTAS,
             regimes: Optional[Sequence[str]] = None,
             fallback: str = "layer") -> store.Calibration:
  """A calibration of ``design`` fitted on the calls of ``data`` at ``context_len``.

  One scale per (budget, delta, layer, KV head), from the calls of both
  regimes (or ``regimes``) pooled; a (layer, KV head) with too few calls for
  a finite quantile takes its layer's scale (``fallback``).
  """
  regimes = tuple(regimes) if regimes else tuple(np.unique(calls["regime"]).tolist())
  sel = calls.where(design=design, data=tuple(data), context_len=context_len, regime=regimes)
  fit_calls = calls.select(sel & np.isfinite(calls["true_error"]))
  if len(fit_calls) == 0:
    raise ValueError(f"no calls of design {design!r} on data {list(data)} at context "
                     f"{context_len} to calibrate on")
  radii = np.stack([raw_radii(fit_calls, d) for d in deltas])
  group_calls = store.GroupCalls(fit_calls["true_error"], radii, fit_calls["layer"],
                                             fit_calls["kv_head"], fit_calls["budget"])
  return store.fit(
      group_calls, deltas=deltas, budgets=budgets, shape=(calls.n_layers, calls.n_kv_heads),
      provenance=store.Provenance(calls.model, design, regimes, tuple(data)),
      fallback=fallback)


def calibrated_radii(calls: Calls, calib: store.Calibration, delta: float,
                     budgets: Sequence[float]) -> np.ndarray:
  """``scale[budget, delta, layer, kv_head] * raw radius`` of every call (all of one design);
  NaN for calls at a budget not in ``budgets`` or in a regime ``calib`` was not fitted on
  (unscored, as :func:`binned_radii` leaves them)."""
  out = np.full(len(calls), np.nan)
  raw = raw_radii(calls, delta)
  for b, r in itertools.product(budgets, np.unique(calls["regime"]).tolist()):
    m = (np.abs(calls["budget"] - b) < 1e-6) & (calls["regime"] == r)
    if not m.any() or r not in calib.regimes:
      continue
    scale = calib.scale_for(model=calls.model, design=calib.design, regime=r, budget=b,
                            delta=delta, n_layers=calls.n_layers, n_kv_heads=calls.n_kv_heads)
    groups = calls["layer"][m] * calls.n_kv_heads + calls["kv_head"][m]
    out[m] = np.asarray(calibration.apply_scales(raw[m], groups, np.ravel(scale)))
  return out


def fit_binned(calls: Calls, *, design: str, data: Sequence[str], context_len: int,
               budgets: Sequence[float], deltas: Sequence[float] = DELTAS,
               n_bins: int = robust.DEFAULT_BINS
               ) -> robust.BinnedCalibration:
  """The source-robust, radius-binned calibration of ``design`` fitted on ``data``
  (:mod:`certkv_jax.calibration.robust`): per regime, budget and delta, the max over
  the data sources of each source's conformal quantile in each radius bin. It records
  the range of its calls' prompt tokens (``n_prompt``: context + question)."""
  sel = calls.where(design=design, data=tuple(data), context_len=context_len)
  c = calls.select(sel & np.isfinite(calls["true_error"]))
  if len(c) == 0:
    raise ValueError(f"no calls of design {design!r} on data {list(data)} at context "
                     f"{context_len} to calibrate on")
  regimes = tuple(sorted(np.unique(c["regime"]).tolist()))
  radii = np.stack([raw_radii(c, d) for d in deltas])
  fit_calls = robust.FitCalls(
      c["true_error"], radii, regimes_per_call=c["regime"], budgets_per_call=c["budget"],
      sources_per_call=c["data"], context_tokens_per_call=c["n_prompt"])
  return robust.fit(fit_calls, regimes=regimes, budgets=budgets, deltas=deltas,
                                model=calls.model, design=design, n_bins=n_bins)


def binned_radii(calls: Calls, cal: robust.BinnedCalibration, delta: float,
                 budgets: Sequence[float]) -> np.ndarray:
  """The binned calibration's radius of every call (all of ``cal.design``); NaN for
  calls of a regime the calibration was not made for. The context length is not
  checked: the study scores calls of every context on purpose, to measure that shift."""
  out = np.full(len(calls), np.nan)
  raw = raw_radii(calls, delta)
  for regime in np.unique(calls["regime"]).tolist():
    if regime not in cal.regimes:
      continue
    for b in budgets:
      m = (calls["regime"] == regime) & (np.abs(calls["budget"] - b) < 1e-6)
      if m.any():
        out[m] = np.asarray(cal.radius(raw[m], robust.Calls(calls.model, cal.design, regime,
                                                            b, delta)))
  return out
