"""Input checks shared by the statistics modules (errors name the argument)."""

from __future__ import annotations

import numpy as np


def vector(x, name: str, dtype=np.float64) -> np.ndarray:
  """``x`` as a non-empty 1-D array of ``dtype``."""
  a = np.asarray(x, dtype)
  if a.ndim != 1 or a.size == 0:
    raise ValueError(f"{name} must be a non-empty 1-D array, got shape {a.shape}")
  return a


def same_length(**arrays):
  """Raises unless every array has the same length."""
  sizes = {k: len(v) for k, v in arrays.items()}
  if len(set(sizes.values())) != 1:
    raise ValueError(f"arrays must have equal lengths, got {sizes}")


def check_alpha(alpha):
  if not (isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0):
    raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


def labels(values, name: str = "labels") -> np.ndarray:
  """``values`` (booleans or 0/1) as a non-empty 1-D bool array."""
  lab = np.asarray(values)
  if lab.ndim != 1 or lab.size == 0:
    raise ValueError(f"{name} must be a non-empty 1-D array, got shape {lab.shape}")
  if lab.dtype != bool:
    if not np.all((lab == 0) | (lab == 1)):
      raise ValueError(f"{name} must be boolean or 0/1")
    lab = lab.astype(bool)
  return lab


def finite_labels(labels: np.ndarray, name: str) -> None:
  """Group or stratum labels must be finite: ``NaN == NaN`` is False, so a NaN label's rows
  would be left out of every resample (or stratum) while the estimate still used them."""
  if labels.dtype.kind == "f" and not np.isfinite(labels).all():
    raise ValueError(f"{name} must be finite labels, got "
                     f"{int((~np.isfinite(labels)).sum())} non-finite")


def no_nan(**arrays) -> None:
  """A NaN error, radius or ratio would count as a miss (or drop out of a bin) unseen."""
  for name, x in arrays.items():
    if np.isnan(x).any():
      raise ValueError(f"{name} must not contain NaN, got {int(np.isnan(x).sum())}")
