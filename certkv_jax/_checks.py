"""Input validation shared by the public functions.

Shape checks always run (shapes are static under ``jit``). Value checks (finite
scores, probabilities in range) run when the argument is concrete, i.e. outside
``jit``; traced values cannot raise, so inside ``jit`` the functions document
what they return instead (and never silently repair an input).
"""

from __future__ import annotations

import numbers

import jax
import numpy as np


def is_concrete(x) -> bool:
  """True when ``x`` has a value now (not a tracer inside jit/vmap/grad)."""
  if isinstance(x, jax.core.Tracer):
    return False
  return True


def concrete_array(x):
  """``np.asarray(x)`` when ``x`` is concrete, else None."""
  if not is_concrete(x):
    return None
  return np.asarray(x)


def check_finite(name: str, x) -> None:
  arr = concrete_array(x)
  if arr is not None and not np.all(np.isfinite(arr.astype(np.float64))):
    bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr.astype(np.float64))))
    raise ValueError(f"{name} must be finite; found {bad} non-finite entries")


def check_in_range(name: str, x, lo, hi, *, lo_open=False, hi_open=False) -> None:
  """Checks lo <(=) x <(=) hi for a concrete scalar or array."""
  arr = concrete_array(x)
  if arr is None:
    return
  arr = arr.astype(np.float64)
  ok = np.isfinite(arr)
  ok &= (arr > lo) if lo_open else (arr >= lo)
  ok &= (arr < hi) if hi_open else (arr <= hi)
  if not np.all(ok):
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    shown = arr if arr.ndim == 0 else arr[~ok].ravel()[:5]
    raise ValueError(f"{name} must be in {left}{lo}, {hi}{right}; got {shown}")


def check_positive_int(name: str, x, *, minimum: int = 1) -> int:
  if isinstance(x, bool) or not isinstance(x, numbers.Integral):
    raise TypeError(f"{name} must be an int >= {minimum}, got {x!r}")
  if x < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {x}")
  return int(x)


def check_nonneg_int(name: str, x) -> int:
  return check_positive_int(name, x, minimum=0)
