"""Verdicts: a paper's claimed range against our interval (:func:`verdict`)."""

from __future__ import annotations

import math
from typing import Sequence


VERDICTS = ("reproduced", "not reproduced", "refuted")
DIRECTIONS = ("higher", "lower", "two_sided")


def verdict(paper_range: Sequence[float], ours_ci: Sequence[float],
            direction: str = "two_sided") -> str:
  """Our interval against a paper's claimed range.

  Rule: ``"reproduced"`` if the intervals overlap. Otherwise ``"refuted"``
  if ours lies entirely on the side that contradicts the claim, else ``"not
  reproduced"`` (ours is disjoint on the side the claim does not rule out,
  e.g. better than claimed). ``direction`` says which side contradicts:
  ``"higher"`` (the claim is "at least about this", e.g. coverage or AUC:
  below refutes), ``"lower"`` (e.g. an overhead: above refutes),
  ``"two_sided"`` (either side refutes, so "not reproduced" never occurs).

  Args:
    paper_range: ``(lo, hi)`` (a point claim: ``(x, x)``).
    ours_ci: ``(lo, hi)`` or ``(estimate, lo, hi)`` (e.g. an :class:`Interval`).
    direction: one of :data:`DIRECTIONS`.
  """
  if direction not in DIRECTIONS:
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
  p = [float(x) for x in paper_range]
  c = [float(x) for x in ours_ci]
  if len(p) != 2 or not p[0] <= p[1]:
    raise ValueError(f"paper_range must be (lo, hi) with lo <= hi, got {paper_range!r}")
  if len(c) == 3:
    c = c[1:]
  if len(c) != 2 or not c[0] <= c[1] or not all(map(math.isfinite, c + p)):
    raise ValueError(f"ours_ci must be finite (lo, hi) or (estimate, lo, hi) with lo <= hi, "
                     f"got {ours_ci!r}")
  if c[1] >= p[0] and c[0] <= p[1]:
    return "reproduced"
  below = c[1] < p[0]
  if direction == "two_sided" or (direction == "higher") == below:
    return "refuted"
  return "not reproduced"
