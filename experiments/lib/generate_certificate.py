r"""What a generate run's radii mean: their summary, whether they are a
certificate, and the calibrated radius where the shipped calibration applies.

:func:`experiments.lib.generate.generate_text` computes, for every decode step,
the raw Bernstein radius of every (layer, query head) attention call (method,
section 5). This module summarizes those radii per step (:func:`summarize`),
says whether the design makes them a certificate (:func:`certificate_status`,
:func:`no_sample_note`: only a Poisson tail with Hajek offsets that sampled
some token does; Theorem 1, method, section 2) and maps them to the calibrated
radius of a :mod:`certkv_jax.robust_calibration` artifact (method, section 10)
where it was made for the model, design, regime, budget and delta, or says why
not (:func:`calibrated`).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import numpy as np

from certkv_jax import designs
from certkv_jax import robust_calibration

# The settings of the validity study (experiments.lib.validity_collect.Plan), which
# the shipped calibration was fitted with; tests/generate_test.py checks they agree.
N_SINK = 4
WINDOW = 16
CHUNK = 64
DEFAULT_CALIBRATION = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "validity",
    "calibration")


class RadiusSummary(NamedTuple):
  """Per-step summary over the (layer, query head) calls of a decode step."""

  median: np.ndarray  # [steps] median over layers x heads
  max: np.ndarray  # [steps] max over layers x heads


def summarize(radius) -> RadiusSummary:
  """Median and max over (layer, head) of ``radius [steps, layers, heads]``."""
  r = np.asarray(radius, np.float64)
  flat = r.reshape(r.shape[0], -1)
  if flat.shape[0] == 0:
    return RadiusSummary(median=np.zeros(0), max=np.zeros(0))
  return RadiusSummary(median=np.median(flat, axis=1), max=np.max(flat, axis=1))


def certificate_status(design_name: str, design) -> tuple[bool, str]:
  """``(certified, note)``: only a Poisson tail with Hajek offsets yields a radius
  that is a certificate (method, sections 3-5)."""
  if design is None:
    return False, ("design 'full' evicts nothing: o_hat = o exactly, so there is no error to "
                   "certify (the radius is 0)")
  if isinstance(design.tail, designs.PoissonTail):
    return True, (f"design {design_name!r} samples its tail (Poisson, Hajek offsets): the "
                  "radius bounds ||o_hat - o|| of each call with probability about 1 - delta "
                  "(method, section 5)")
  kind = ("a uniform random tail with no Hajek offset" if design.randomized
          else "deterministic")
  return False, (f"design {design_name!r} is {kind}: its radius is 0 by construction and is "
                 "NOT a certificate -- it does not mean there is no error (Theorem 1, method, "
                 "section 2); use poisson_tail for a certificate")


def no_sample_note(design, budget: float, n_context: int, regime: str) -> str:
  """Why a randomized design sampled no tail token (its radius is then 0)."""
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
  return (f"design {design.name!r} sampled no tail token: {why}. The radius is 0 and is NOT "
          f"a certificate here; use a longer {where}, a larger budget or smaller "
          "n_sink / window")


def calibrated(raw, *, calibration, model_name, design_name, regime, budget, delta,
               n_sink, window, chunk) -> tuple[Optional[np.ndarray], str]:
  """The calibrated radius of ``raw`` and a note, or ``(None, why not)``.

  Args:
    raw: [...] raw radii at ``delta``.
    calibration: path of a :mod:`certkv_jax.robust_calibration` artifact
      (method, section 10), or None.
    model_name: the model's name as the calibration records it ('smollm2'),
      or None (unknown: nothing is looked up).
    design_name, regime, budget, delta: must be in the calibration.
    n_sink, window, chunk: must be the validity study's (the calibration was
      fitted with them; it does not record them).
  """
  if calibration is None:
    return None, "not requested (no calibration path)"
  if not os.path.isdir(calibration):
    return None, (f"no calibration artifact at {calibration} (written by "
                  "python -m experiments.validity --out=DIR, in DIR/calibration)")
  if model_name is None:
    return None, "the model's name was not given (model_name), so no calibration can match it"
  used = dict(n_sink=n_sink, window=window, chunk=chunk)
  fitted = dict(n_sink=N_SINK, window=WINDOW, chunk=CHUNK)
  if regime == "question_aware":
    del used["chunk"], fitted["chunk"]
  if used != fitted:
    return None, (f"the calibration was fitted with {fitted}, this run uses {used}")
  cal = robust_calibration.load(calibration)
  try:
    out = cal.radius(raw, model=model_name, design=design_name, regime=regime,
                     budget=float(budget), delta=float(delta))
  except ValueError as err:
    return None, str(err)
  return np.asarray(out, np.float64), (
      f"{calibration} (model {cal.model}, design {cal.design}, fitted on "
      f"{', '.join(cal.data)}): valid marginally per radius bin for calls like its "
      "calibration sources (method, section 10)")
