"""The per-call error certificate of method, section 5, and its aggregation.

``r = sqrt(2 V_hat L) + (2/3) b_hat L`` with ``L = log(2 / delta)``
("bernstein", the default) or ``r = sqrt(V_hat / delta)`` ("chebyshev"), from
an ``OffsetAttentionResult``'s ``var_hat`` and ``range_hat``; both are
approximate. :func:`smoothed_variance` tempers ``V_hat``'s skew. All of it is
elementwise or a reduction, so ``jax.vmap`` gives every head and layer.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from certkv_jax import _validate

Array = jax.Array

FORMS = ("bernstein", "chebyshev")
SMOOTHING_WINDOW = 6  # the paper's moving window over decode steps


def _check_window(window) -> int:
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(f"window must be an int >= 1, got {window!r}")
  return window


def smoothed_variance(var_hat, window: int = SMOOTHING_WINDOW, axis: int = 0) -> Array:
  """``max(V_hat_t, mean(V_hat_{t-window+1..t}))`` per call, causal along ``axis``.

  Method, section 5, "Smoothed variance". The first calls average over those there
  are; ``window=1`` returns ``var_hat``. A NaN makes NaN only the windows holding it.
  """
  window = _check_window(window)
  v = jnp.moveaxis(jnp.asarray(var_hat, jnp.float32), axis, 0)
  n = v.shape[0]
  total = v
  for s in range(1, min(window, n)):
    total = total + jnp.pad(v, [(s, 0)] + [(0, 0)] * (v.ndim - 1))[:n]
  count = jnp.minimum(jnp.arange(1, n + 1), window).astype(jnp.float32)
  mean = total / count.reshape((n,) + (1,) * (v.ndim - 1))
  return jnp.moveaxis(jnp.maximum(v, mean), 0, axis)


class VarianceWindow(NamedTuple):
  """The last calls' ``V_hat`` for :func:`smoothed_variance` one step at a time.

  ``recent`` [window - 1, ...] holds the previous calls, newest last, ``count``
  how many are real. Carry it between decode steps.
  """

  recent: Array
  count: Array

  @classmethod
  def init(cls, shape, window: int = SMOOTHING_WINDOW) -> "VarianceWindow":
    window = _check_window(window)
    return cls(jnp.zeros((window - 1,) + tuple(shape), jnp.float32), jnp.zeros((), jnp.int32))

  def update(self, var_hat) -> tuple:
    """``(smoothed V_hat of this call, the state for the next call)``."""
    v = jnp.asarray(var_hat, jnp.float32)
    if v.shape != self.recent.shape[1:]:
      raise ValueError(f"var_hat must have shape {self.recent.shape[1:]}, got {v.shape}")
    k = self.recent.shape[0]
    real = (jnp.arange(k) >= k - self.count).reshape((k,) + (1,) * v.ndim)
    mean = (jnp.sum(jnp.where(real, self.recent, 0.0), axis=0) + v) / (
        jnp.minimum(self.count, k) + 1).astype(jnp.float32)
    recent = jnp.concatenate([self.recent, v[None]])[1:] if k else self.recent
    return jnp.maximum(v, mean), VarianceWindow(recent, jnp.minimum(self.count + 1, k))


def smoothed_radius(var_hat, range_hat, delta, window: int = SMOOTHING_WINDOW,
                    axis: int = 0, form: str = "bernstein") -> Array:
  """:func:`radius_from_stats` with ``V_hat`` replaced by :func:`smoothed_variance`."""
  return radius_from_stats(smoothed_variance(var_hat, window, axis), range_hat, delta, form)


_DELTA_MIN = 1.1754944e-38  # float32's smallest normal number: a smaller delta reads as 0


def _check_delta(delta):
  if isinstance(delta, (int, float)) and not isinstance(delta, bool):
    if not (0.0 < delta < 1.0) or not math.isfinite(delta):
      raise ValueError(f"delta must be in (0, 1), got {delta!r}")
  else:
    _validate.check_in_range("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
  found = _validate.concrete_array(delta)
  if found is not None and (found < _DELTA_MIN).any():
    raise ValueError(f"delta must be at least {_DELTA_MIN} (below it float32 rounds it to 0 "
                     f"and the radius to NaN or inf), got {found.min()!r}")


def radius_from_stats(var_hat, range_hat, delta, form: str = "bernstein") -> Array:
  """Radius from the statistics; ``delta`` is a scalar or broadcasts against them.

  A concrete ``delta`` outside (0, 1) raises ValueError; a traced one is not
  checked and gives an infinite, meaningless or NaN radius (method, section 9,
  "Bad input"; ``checked.checked_certificate_radius`` makes it an error). A NaN
  statistic (a call left out of a subsampled certificate) gives a NaN radius.
  """
  _check_delta(delta)
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  var_hat = jnp.asarray(var_hat, jnp.float32)
  delta = jnp.asarray(delta, jnp.float32)
  if form == "chebyshev":
    return jnp.sqrt(var_hat / delta)
  log_term = jnp.log(2.0 / delta)
  return jnp.sqrt(2.0 * var_hat * log_term) + (2.0 / 3.0) * jnp.asarray(
      range_hat, jnp.float32) * log_term


def certificate_radius(result, delta, form: str = "bernstein") -> Array:
  """Radius ``r`` with ``P(||o_hat - o|| <= r) >= 1 - delta`` (approximately).

  ``result`` has ``var_hat`` and ``range_hat``; ``delta`` in (0, 1) is a float or
  an array (e.g. :func:`anytime_delta`); ``form`` "bernstein" or "chebyshev".
  Float32 with the result's leading shape; raises as :func:`radius_from_stats`.
  """
  return radius_from_stats(result.var_hat, result.range_hat, delta, form)


def anytime_delta(delta: float, step) -> Array:
  """``delta_t = delta / (t (t + 1))`` for steps ``t >= 1`` (method, section 5).

  A concrete ``step < 1`` raises ValueError; a traced step 0 gives an infinite ``delta_t``.
  """
  _check_delta(delta)
  step = jnp.asarray(step)
  s = _validate.concrete_array(step)
  if s is not None and (s < 1).any():
    raise ValueError(f"step must be >= 1 (1-based decode step), got min {s.min()}")
  t = step.astype(jnp.float32)
  return delta / (t * (t + 1.0))


def aggregate(radii, axis=None, how: str = "sum", mask=None) -> Array:
  """Sums (``how="sum"``) or maximises radii over ``axis`` (default all), counting only ``mask``.

  A sum bounds the summed error norms only if the radii were built at
  ``delta`` over the number of calls (method, section 9).
  """
  if how not in ("sum", "max"):
    raise ValueError(f"how must be 'sum' or 'max', got {how!r}")
  radii = jnp.asarray(radii, jnp.float32)
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.shape != radii.shape:
      raise ValueError(f"mask shape {mask.shape} must equal radii shape {radii.shape}")
    radii = jnp.where(mask, radii, 0.0)
  if how == "sum":
    return jnp.sum(radii, axis=axis)
  return jnp.max(radii, axis=axis)


def subsample_mask(key, shape, n_keep: int) -> Array:
  """A uniformly random set of ``n_keep`` calls, for a cheaper :func:`subsampled_sum`."""
  shape = tuple(shape)
  total = math.prod(shape)
  _validate.check_positive_int("n_keep", n_keep)
  if n_keep > total:
    raise ValueError(f"n_keep must be <= {total} (the number of calls), got {n_keep}")
  prio = jax.random.uniform(key, (total,))
  order = jnp.argsort(prio)
  chosen = jnp.zeros((total,), bool).at[order[:n_keep]].set(True)
  return chosen.reshape(shape)


def subsampled_sum(radii, mask) -> Array:
  """Horvitz-Thompson estimate ``(total / n_keep) * sum_{mask} radii`` of the full sum."""
  radii = jnp.asarray(radii, jnp.float32)
  mask = jnp.asarray(mask)
  if mask.shape != radii.shape:
    raise ValueError(f"mask shape {mask.shape} must equal radii shape {radii.shape}")
  n_keep = jnp.sum(mask)
  return radii.size / jnp.maximum(n_keep, 1) * jnp.sum(jnp.where(mask, radii, 0.0))


def moving_window(per_step, window: int = 6, how: str = "mean") -> Array:
  """Causal moving ``how`` ("mean", "sum" or "max") of ``window`` >= 1 decode steps (axis 0)."""
  _validate.check_positive_int("window", window)
  if how not in ("mean", "sum", "max"):
    raise ValueError(f"how must be 'mean', 'sum' or 'max', got {how!r}")
  x = jnp.asarray(per_step, jnp.float32)
  steps = x.shape[0]
  t = jnp.arange(steps)
  in_win = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)  # [T, T]
  w = in_win.reshape(in_win.shape + (1,) * (x.ndim - 1))
  if how == "max":
    return jnp.max(jnp.where(w, x[None], -jnp.inf), axis=1)
  total = jnp.sum(jnp.where(w, x[None], 0.0), axis=1)
  if how == "sum":
    return total
  count = jnp.sum(in_win, axis=1).reshape((steps,) + (1,) * (x.ndim - 1))
  return total / count
