r"""What a generate run's radii mean: their summary, whether they are a
certificate, and the calibrated radius where the shipped calibration applies.

Per-step summaries (:func:`summarize`), whether the design certifies
(:func:`certificate_status`: only a sampled tail with Hajek offsets; method,
section 2) and the calibrated radius (:func:`calibrated`, method, section 10).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import numpy as np

from certkv_jax.calibration import robust
from certkv_jax import designs

# The validity study's settings, which the shipped calibration was fitted with.
N_SINK = 4
WINDOW = 16
CHUNK = 64
# The shipped calibration: the validity study's artifact in this repository.
DEFAULT_CALIBRATION = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "experiments", "results", "validity", "calibration")


class RadiusSummary(NamedTuple):
  """Per-step summary over the (layer, query head) calls of a decode step."""

  median: np.ndarray  # [steps] median over layers x heads
  max: np.ndarray  # [steps] max over layers x heads


def summarize(radius) -> RadiusSummary:
  """Median and max over (layer, head) of ``radius [steps, layers, heads]``."""
  r = np.asarray(radius, np.float64)
  if r.shape[0] == 0:  # no decode step (the answer stopped at its first token)
    return RadiusSummary(median=np.zeros(0), max=np.zeros(0))
  flat = r.reshape(r.shape[0], -1)
  return RadiusSummary(median=np.median(flat, axis=1), max=np.max(flat, axis=1))


def certificate_status(design_name: str, design) -> tuple[bool, str]:
  """``(certified, note)``: only a sampled tail with Hajek offsets (Poisson or
  priority sampling) yields a radius that is a certificate (method, sections 3-5)."""
  if design is None:
    return False, ("design 'full' evicts nothing: o_hat = o exactly, so there is no error to "
                   "certify (the radius is 0)")
  if isinstance(design.tail, (designs.PoissonTail, designs.PriorityTail)):
    how = "Poisson" if isinstance(design.tail, designs.PoissonTail) else "priority sampling"
    return True, (f"design {design_name!r} samples its tail ({how}, Hajek offsets): the "
                  "radius bounds ||o_hat - o|| of each call with probability about 1 - delta "
                  "(method, section 5)")
  kind = ("a uniform random tail with no Hajek offset" if design.randomized
          else "deterministic")
  return False, (f"design {design_name!r} is {kind}: its radius is 0 by construction and is "
                 "NOT a certificate -- it does not mean there is no error (Theorem 1, method, "
                 "section 2); use poisson_tail for a certificate")


def no_sample_note(design, budget: float, n_context: int, regime: str,
                   suggestion: Optional[str] = None) -> str:
  """Why a randomized design sampled no tail token (radius 0), with ``suggestion``
  (``hint.describe``) or the smallest budget that leaves a tail slot."""
  target = int(math.floor(budget * n_context))
  size = design.certain.size
  where = "context" if regime == "streaming" else "prompt"
  if target >= n_context:
    return (f"design {design.name!r} evicted nothing (the budget keeps all {n_context} "
            f"{where} tokens): o_hat = o exactly, so there is no error to certify")
  if target <= size:
    why = (f"the budget keeps floor({budget:g} x {n_context}) = {target} tokens, no more "
           f"than the certainty set of {size} (n_sink + window), so only the certainty set "
           "was kept: no slot was left for a sampled tail")
  else:
    why = "no sampled tail token remained in any cache"
  need = size + 1
  hint = suggestion or (f"--budget={math.ceil(1000.0 * need / n_context) / 1000.0:g} or more"
                        if need < n_context else f"a {where} longer than {need} tokens")
  return (f"design {design.name!r} sampled no tail token: {why}. The radius is 0 and is NOT "
          f"a certificate here. For one: {hint} (or a longer {where}, or a smaller "
          "n_sink / window)")


class Run(NamedTuple):
  """What a calibration must have been made for: the run's model and settings."""

  model_name: Optional[str]  # as the calibration records it ('smollm2'); None: unknown
  design_name: str
  regime: str
  budget: float
  delta: float
  # Must be the validity study's (the calibration does not record them).
  n_sink: int = N_SINK
  window: int = WINDOW
  chunk: int = CHUNK
  dtype: str = "float32"  # the weights and caches; must be the calibration's


def calibrated(raw, run: Run, *, calibration: Optional[str], context_tokens: int
               ) -> tuple[Optional[np.ndarray], str, Optional[bool]]:
  """``(radius, note, in_range)``: the calibrated radius of ``raw``, or None.

  ``in_range``: None without a radius (the note says why), else whether
  ``context_tokens`` (a positive int, else ValueError) lie in the fitted context
  range; outside it the note starts with "WARNING:" and must be shown.
  ``raw``: [...] radii at ``run.delta``; ``calibration``: a
  :mod:`certkv_jax.calibration.robust` artifact path (method, section 10) or None.
  """
  if calibration is None:
    return None, "not requested (no calibration path)", None
  if not os.path.isdir(calibration):
    return None, (f"no calibration artifact at {calibration} (written by "
                  "python -m experiments.validity --out=DIR, in DIR/calibration)"), None
  if run.model_name is None:
    return None, ("the model's name was not given (model_name), so no calibration can match "
                  "it"), None
  if (isinstance(context_tokens, (bool, np.bool_))
      or not isinstance(context_tokens, (int, np.integer)) or context_tokens < 1):
    raise ValueError(f"context_tokens must be a positive int (the prompt's tokens), got "
                     f"{context_tokens!r}")
  used = dict(n_sink=run.n_sink, window=run.window, chunk=run.chunk)
  fitted = dict(n_sink=N_SINK, window=WINDOW, chunk=CHUNK)
  if run.regime == "question_aware":
    del used["chunk"], fitted["chunk"]
  if used != fitted:
    return None, (f"the calibration was fitted with {fitted}, this run uses {used}"), None
  try:
    cal = robust.load(calibration)
    calls = robust.Calls(run.model_name, run.design_name, run.regime, float(run.budget),
                         float(run.delta), run.dtype)
    out = cal.radius(raw, calls, context_len=int(context_tokens), outside_range="warn")
  except ValueError as err:
    return None, str(err), None
  radius = np.asarray(out, np.float64)
  mix = cal.budget_neighbours(float(run.budget))
  between = ""
  if len(mix) == 2:
    b_lo, b_hi = (cal.budgets[j] for j, _ in mix)
    between = (f"; budget {run.budget:g} lies between the fitted budgets {b_lo:g} and "
               f"{b_hi:g}: the radius mixes theirs in log budget (coverage is established "
               "at the fitted budgets, not between them)")
  if not cal.covers_context(int(context_tokens)):
    return radius, (
        f"WARNING: the calibration {calibration} was fitted on {cal.fitted_on()}; this "
        f"prompt has {int(context_tokens)} tokens, so its coverage is not established here "
        "(context length is a shift like another source: the calibrated radius can "
        f"under-cover; method, section 10){between}"), False
  return radius, (
      f"{calibration} (model {cal.model}, design {cal.design}, fitted on "
      f"{cal.fitted_on()}): valid marginally per radius bin for calls like its "
      f"calibration sources (method, section 10){between}"), True
