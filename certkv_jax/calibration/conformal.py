"""Split-conformal calibration of the certificate radius (method, section 10).

The score of a call is ``s = ||e|| / r``; a group's calibrated radius is
``q_g * r`` with ``q_g`` the ``ceil((n_g + 1)(1 - delta))``-th smallest of its
``n_g`` calibration scores. Coverage is at least ``1 - delta``, marginally and
only for calls exchangeable with the calibration ones (hence
:mod:`certkv_jax.calibration.store`'s checks). ``r = 0`` scores 0 when
``||e|| = 0``, else ``+inf``; an infinite scale gives an infinite radius. Small
groups borrow a coarser group's (or the pooled) quantile.
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate
from certkv_jax.certificate import diagnostics

Array = jax.Array

# (n + 1)(1 - delta) is computed in floating point; a decimal delta such as
# 0.3 is stored as 0.29999999999999998890, which would push an exact integer
# like 10 * 0.7 = 7 just above 7 and the rank up by one. Values within this
# relative tolerance of an integer are treated as that integer.
_RANK_RTOL = 1e-12


class ConformalScales(NamedTuple):
  """Per-group conformal scales fitted by :func:`fit_scales`.

  Attributes:
    scales: [n_groups] float64 multiplier of the raw radius (``+inf``: no
      finite scale has the guarantee).
    n_calls: [n_groups] int64 calibration calls of each group, before fallback.
    fell_back: [n_groups] bool, the groups that took a coarser or pooled scale.
  """

  scales: np.ndarray
  n_calls: np.ndarray
  fell_back: np.ndarray
  delta: float
  pooled: float


def _check_delta(delta) -> float:
  if (isinstance(delta, bool) or not isinstance(delta, numbers.Real)
      or not math.isfinite(delta) or not 0.0 < delta < 1.0):
    raise ValueError(f"delta must be a float in (0, 1), got {delta!r}")
  return float(delta)


def conformal_rank(n: int, delta: float) -> int:
  """``ceil((n + 1)(1 - delta))``, the conformal quantile's rank (above ``n``: ``+inf``)."""
  n = _validate.check_nonneg_int("n", n)
  delta = _check_delta(delta)
  x = (n + 1) * (1.0 - delta)
  nearest = round(x)
  if abs(x - nearest) <= _RANK_RTOL * max(1.0, x):
    return int(nearest)
  return math.ceil(x)


def min_finite_calls(delta: float) -> int:
  """The smallest ``n`` whose conformal quantile is finite: ``ceil(1/delta) - 1``."""
  delta = _check_delta(delta)
  n = max(0, math.ceil(1.0 / delta) - 1)
  while conformal_rank(n, delta) > n:
    n += 1
  while n > 0 and conformal_rank(n - 1, delta) <= n - 1:
    n -= 1
  return n


def _as_1d(name: str, x) -> np.ndarray:
  arr = np.asarray(x)
  if arr.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
  if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.floating)
                                   or np.issubdtype(arr.dtype, np.integer)):
    raise ValueError(f"{name} must hold real numbers, got dtype {arr.dtype}")
  return arr.astype(np.float64)


def _check_nonneg(name: str, arr: np.ndarray, *, allow_inf: bool) -> None:
  bad = np.isnan(arr) | (arr < 0)
  if not allow_inf:
    bad |= np.isinf(arr)
  if bad.any():
    what = "[0, inf]" if allow_inf else "[0, inf) (finite)"
    raise ValueError(f"{name} must be in {what} with no NaN; found {int(bad.sum())} bad "
                     f"entries, e.g. {arr[bad][:5]}")


def conformal_quantile(scores, delta: float) -> float:
  """The split-conformal quantile of ``scores`` [n] (``+inf`` allowed) at miss probability delta.

  ``+inf`` when the rank exceeds ``n`` (including ``n = 0``).

  Raises:
    ValueError: ``delta`` outside (0, 1); ``scores`` not 1-D, NaN or negative.
  """
  delta = _check_delta(delta)
  s = _as_1d("scores", scores)
  _check_nonneg("scores", s, allow_inf=True)
  k = conformal_rank(s.size, delta)
  if k > s.size:
    return math.inf
  return float(np.partition(s, k - 1)[k - 1])


def conformity_scores(errors, radii) -> np.ndarray:
  """Scores ``||e|| / r`` [n] float64 (0 where ``r = 0 = ||e||``, inf where ``r = 0 < ||e||``)."""
  e = _as_1d("errors", errors)
  r = _as_1d("radii", radii)
  _check_nonneg("errors", e, allow_inf=False)
  _check_nonneg("radii", r, allow_inf=False)
  if e.shape != r.shape:
    raise ValueError(f"errors and radii must have the same length, got {e.size} and {r.size}")
  pos = r > 0
  out = np.where(e > 0, np.inf, 0.0)
  out[pos] = e[pos] / r[pos]
  return out


def check_groups(name: str, groups, n_groups: int, bound: str = "n_groups") -> np.ndarray:
  """``groups`` as int64 [n] after checking: 1-D integers in ``[0, n_groups)``."""
  g = np.asarray(groups)
  if g.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {g.shape}")
  if g.dtype == np.bool_ or not np.issubdtype(g.dtype, np.integer):
    raise ValueError(f"{name} must be integers in [0, {bound}={n_groups}), got dtype {g.dtype}")
  bad = (g < 0) | (g >= n_groups)
  if bad.any():
    raise ValueError(f"{name} must be integers in [0, {bound}={n_groups}); got "
                     f"{np.unique(g[bad])[:5]}")
  return g.astype(np.int64)


def _fallback_map(fallback_groups, n_groups: int) -> np.ndarray:
  """``fallback_groups`` as an int64 array [n_groups] of coarse-group ids."""
  if isinstance(fallback_groups, Mapping):
    keys = set(fallback_groups)
    want = set(range(n_groups))
    if keys != want:
      missing = sorted(want - keys)[:5]
      extra = sorted(keys - want, key=repr)[:5]
      raise ValueError(f"fallback_groups must map every group 0..{n_groups - 1} (and only "
                       f"those) to a coarse group; missing {missing}, unexpected {extra}")
    values = [fallback_groups[g] for g in range(n_groups)]
  else:
    values = list(np.asarray(fallback_groups).ravel())
    if np.ndim(fallback_groups) != 1 or len(values) != n_groups:
      raise ValueError(f"fallback_groups must be a mapping or a 1-D sequence of length "
                       f"n_groups={n_groups}, got shape {np.shape(fallback_groups)}")
  for v in values:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, np.integer)):
      raise ValueError(f"fallback_groups values must be integer coarse-group ids, got {v!r}")
  return np.asarray(values, np.int64)


def fit_scales(
    errors,
    radii,
    groups,
    n_groups: int,
    delta: float,
    *,
    min_calls: Optional[int] = None,
    fallback_groups: Optional[Union[Mapping[int, int], Sequence[int]]] = None,
) -> ConformalScales:
  """Per-group split-conformal scales of the radius.

  Args:
    errors, radii: [n_calls] finite nonnegative true errors and raw radii
      ``r(delta)`` at this ``delta``.
    groups: [n_calls] int group of each call in ``[0, n_groups)``.
    min_calls: groups with fewer calls fall back (default
      :func:`min_finite_calls`).
    fallback_groups: coarse group of each group (mapping or [n_groups]); None
      or a too-small coarse group falls back to the pooled quantile.

  Raises:
    ValueError naming the argument: ``delta`` outside (0, 1); negative, NaN or
    infinite ``errors``/``radii``; unequal lengths; bad ``groups``;
    ``n_groups``/``min_calls`` < 1; an incomplete ``fallback_groups``.
  """
  delta = _check_delta(delta)
  n_groups = _validate.check_positive_int("n_groups", n_groups)
  s = conformity_scores(errors, radii)
  g = check_groups("groups", groups, n_groups)
  if g.size != s.size:
    raise ValueError(f"groups must have one entry per call like errors/radii: got {g.size} "
                     f"groups for {s.size} calls")
  if min_calls is None:
    min_calls = min_finite_calls(delta)
  min_calls = _validate.check_positive_int("min_calls", min_calls)
  coarse = None if fallback_groups is None else _fallback_map(fallback_groups, n_groups)

  n_calls = np.bincount(g, minlength=n_groups).astype(np.int64)  # [n_groups]
  pooled = conformal_quantile(s, delta)
  coarse_scale = {}
  if coarse is not None:
    coarse_of_call = coarse[g]  # [n_calls]
    for c in np.unique(coarse):
      members = s[coarse_of_call == c]
      coarse_scale[int(c)] = (conformal_quantile(members, delta)
                              if members.size >= min_calls else pooled)
  scales = np.empty(n_groups, np.float64)
  fell_back = n_calls < min_calls
  for grp in range(n_groups):
    if not fell_back[grp]:
      scales[grp] = conformal_quantile(s[g == grp], delta)
    elif coarse is not None:
      scales[grp] = coarse_scale[int(coarse[grp])]
    else:
      scales[grp] = pooled
  return ConformalScales(scales=scales, n_calls=n_calls, fell_back=fell_back, delta=delta,
                         pooled=pooled)


def apply_scales(radii, groups, scales) -> Array:
  """Calibrated radii ``scales[groups] * radii`` (jnp; works inside jit/vmap).

  ``+inf`` where either factor is infinite (also when the other is 0). Inside
  jit an out-of-range group gives NaN, never a clipped index.

  Raises:
    ValueError naming the argument for non-integer ``groups``, non-1-D
    ``scales``, shapes that do not broadcast and, when concrete, out-of-range
    ``groups`` or NaN or negative ``radii``/``scales``.
  """
  radii, groups, scales = jnp.asarray(radii), jnp.asarray(groups), jnp.asarray(scales)
  if scales.ndim != 1:
    raise ValueError(f"scales must be 1-D [n_groups], got shape {scales.shape}")
  if not jnp.issubdtype(groups.dtype, jnp.integer):
    raise ValueError(f"groups must be integers in [0, {scales.shape[0]}), got dtype "
                     f"{groups.dtype}")
  try:
    jnp.broadcast_shapes(radii.shape, groups.shape)
  except ValueError as err:
    raise ValueError(f"radii {radii.shape} and groups {groups.shape} must broadcast") from err
  for name, x in (("radii", radii), ("scales", scales)):
    arr = _validate.concrete_array(x)
    if arr is not None:
      _check_nonneg(name, np.asarray(arr, np.float64).ravel(), allow_inf=True)
  g = _validate.concrete_array(groups)
  if g is not None:
    bad = (g < 0) | (g >= scales.shape[0])
    if bad.any():
      raise ValueError(f"groups must be in [0, n_groups={scales.shape[0]}); got "
                       f"{np.unique(g[bad])[:5]}")
  n = scales.shape[0]  # take(mode="fill") would wrap a negative group: masked here
  s = jnp.where((groups < 0) | (groups >= n), jnp.nan, jnp.take(scales, groups, mode="fill"))
  return jnp.where(jnp.isnan(s), jnp.nan,
                   jnp.where(jnp.isinf(s) | jnp.isinf(radii), jnp.inf, s * radii))


def coverage_and_sharpness(errors, radii) -> tuple[float, float]:
  """Coverage ``mean(||e|| <= r)`` and sharpness, median ``r / ||e||`` over covered ``||e|| > 0``.

  As :func:`certkv_jax.certificate.diagnostics.coverage` and ``sharpness``; NaN sharpness if none.
  """
  e = np.asarray(errors, np.float64)
  r = np.asarray(radii, np.float64)
  if e.shape != r.shape or e.size == 0:
    raise ValueError(f"errors {e.shape} and radii {r.shape} must be equal, non-empty shapes")
  e, r = e.ravel(), r.ravel()
  if np.isnan(e).any() or np.isnan(r).any():
    raise ValueError("errors and radii must not contain NaN")
  return diagnostics.coverage(e, r), diagnostics.sharpness(e, r)
