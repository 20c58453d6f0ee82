"""Verdicts: a paper's claimed range against our interval (:func:`verdict`)."""

from __future__ import annotations

import math
from typing import Sequence


VERDICTS = ("reproduced", "refuted", "inconclusive")
DIRECTIONS = ("higher", "lower", "two_sided")


def claim_region(paper_range: Sequence[float], direction: str) -> tuple[float, float]:
  """The closed region ``(lo, hi)`` (infinite ends allowed) where the claim holds.

  ``"higher"``: ``[p_lo, +inf)``; ``"lower"``: ``(-inf, p_hi]``; ``"two_sided"``:
  ``[p_lo, p_hi]``. Arguments as :func:`verdict`.
  """
  if direction not in DIRECTIONS:
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
  try:
    p = [float(x) for x in paper_range]
  except (TypeError, ValueError):
    p = []
  if len(p) != 2 or not all(map(math.isfinite, p)) or not p[0] <= p[1]:
    raise ValueError(f"paper_range must be finite (lo, hi) with lo <= hi, got {paper_range!r}")
  if direction == "higher":
    return p[0], math.inf
  if direction == "lower":
    return -math.inf, p[1]
  return p[0], p[1]


def verdict(paper_range: Sequence[float], ours_ci: Sequence[float],
            direction: str = "two_sided") -> str:
  """Our interval against a paper's claim: one of :data:`VERDICTS`.

  Rule: the claim holds on a region (:func:`claim_region`): ``"higher"`` (at
  least about ``p_lo``, e.g. coverage, AUC) ``[p_lo, +inf)``; ``"lower"`` (at
  most about ``p_hi``) ``(-inf, p_hi]``; ``"two_sided"`` (a point claim with
  a band, e.g. "about 2x") ``[p_lo, p_hi]``. ``"reproduced"`` if our whole
  interval lies in the region, ``"refuted"`` if it lies wholly outside it,
  ``"inconclusive"`` if it spans a boundary of the region (part in, part out).

  Args:
    paper_range: ``(lo, hi)`` with ``lo <= hi`` (a point claim: ``(x, x)``).
    ours_ci: ``(lo, hi)`` or ``(estimate, lo, hi)`` (e.g. an :class:`Interval`),
      finite, ``lo <= hi``.
    direction: one of :data:`DIRECTIONS`.
  """
  r_lo, r_hi = claim_region(paper_range, direction)
  try:
    c = [float(x) for x in ours_ci]
  except (TypeError, ValueError):
    c = []
  if len(c) == 3:
    c = c[1:]
  if len(c) != 2 or not all(map(math.isfinite, c)) or not c[0] <= c[1]:
    raise ValueError(f"ours_ci must be finite (lo, hi) or (estimate, lo, hi) with lo <= hi, "
                     f"got {ours_ci!r}")
  if r_lo <= c[0] and c[1] <= r_hi:
    return "reproduced"
  if c[1] < r_lo or c[0] > r_hi:
    return "refuted"
  return "inconclusive"
