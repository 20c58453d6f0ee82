"""Flag checks the benchmarks share: an error names the flag and its allowed range."""

from __future__ import annotations


def check_int(flag, value, lo, hi=None):
  """Raises ValueError naming ``--flag`` unless ``value`` is an int in [lo, hi]."""
  if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
      hi is not None and value > hi):
    raise ValueError(f"--{flag} must be an int in [{lo}, {hi if hi is not None else 'inf'}], "
                     f"got {value!r}")
