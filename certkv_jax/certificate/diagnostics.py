"""Evaluation-mode truths the certificate is judged against, from the full cache.

The true output, the realised error, the Assumption-2 ratio (method, section 6)
and the summaries the experiments report (coverage, sharpness, the log R fit).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax.attention import offset
from pallas_kernels import reference

Array = jax.Array


def full_attention(q, k, v, mask, *, scale: Optional[float] = None) -> Array:
  """Full-cache output ``o`` [..., dv] (offsets 0), float32."""
  mask = jnp.asarray(mask)
  res = offset.offset_attention(q, k, v, jnp.zeros(mask.shape, jnp.float32), mask,
                                   scale=scale)
  return res.out.astype(jnp.float32)


class ErrorNorms(NamedTuple):
  abs: Array  # [...] ||o_hat - o||
  rel: Array  # [...] ||o_hat - o|| / ||o||  (inf where ||o|| = 0 and the error is not)


def attention_error(estimate, full) -> ErrorNorms:
  """Realised eviction error of one call (``estimate`` and ``full`` [..., dv])."""
  e = jnp.asarray(estimate, jnp.float32) - jnp.asarray(full, jnp.float32)
  err = jnp.linalg.norm(e, axis=-1)
  ref_norm = jnp.linalg.norm(jnp.asarray(full, jnp.float32), axis=-1)
  rel = jnp.where(ref_norm > 0, err / jnp.where(ref_norm > 0, ref_norm, 1.0),
                  jnp.where(err > 0, jnp.inf, 0.0))
  return ErrorNorms(err, rel)


def assumption2_ratio(q, k, mask, tail, pi, m=None, *, scale: Optional[float] = None) -> Array:
  """``R = m * max_{i in T} a_i / (pi_i sum_{j in C} a_j)`` (method, section 6), in log space.

  Args:
    q: [..., d]; k: [..., n, d] keys of the FULL context.
    mask: [..., n] bool, tokens of the context C.
    tail: [..., n] bool, candidate tail tokens (those with 0 < pi < 1 count).
    pi: [..., n] inclusion probabilities.
    m: expected number of kept random tail tokens; default ``sum_T pi``.

  Returns R [...] float32, 0 where the tail is empty.
  """
  q, k, mask, tail, pi = (jnp.asarray(x) for x in (q, k, mask, tail, pi))
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  zeros = jnp.zeros(mask.shape, jnp.float32)
  s = reference.offset_logits(q, k, zeros, mask, scale)  # log a_i, -inf off C
  lse = jax.nn.logsumexp(s, axis=-1)
  tail = tail & mask & (pi < 1.0) & (pi > 0.0)
  if m is None:
    m = jnp.sum(jnp.where(tail, pi, 0.0), axis=-1)
  log_ratio = s - jnp.log(jnp.where(tail, pi, 1.0)) - lse[..., None]
  worst = jnp.max(jnp.where(tail, log_ratio, -jnp.inf), axis=-1)
  return jnp.where(jnp.isfinite(worst), jnp.asarray(m, jnp.float32) * jnp.exp(worst), 0.0)


class LinearizedMoments(NamedTuple):
  bias: Array  # [..., dv] second-order Hajek bias of o_hat
  var: Array  # [...] V = E||e_lin||^2 (method, section 4)
  full: Array  # [..., dv] full-cache output o


def linearized_moments(q, k, v, mask, pi, *, scale: Optional[float] = None
                       ) -> LinearizedMoments:
  """Oracle moments of the Hajek estimator under Poisson sampling.

  With ``N = sum_C a_j`` and ``c_i = (1 - pi_i) / pi_i``::

      V    = (1/N^2) sum_C c_i a_i^2 ||v_i - o||^2
      bias = -(1/N^2) sum_C c_i a_i^2 (v_i - o)      (second-order delta method)

  Tokens with ``pi_i = 1`` contribute nothing. Needs the full context.

  Args:
    q: [..., d]; k: [..., n, d]; v: [..., n, dv]; mask: [..., n] bool (C);
    pi: [..., n] inclusion probabilities (1 for certain tokens).
  """
  q, k, v, mask, pi = (jnp.asarray(x) for x in (q, k, v, mask, pi))
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  s = reference.offset_logits(q, k, jnp.zeros(mask.shape, jnp.float32), mask, scale)
  p = jax.nn.softmax(s, axis=-1)  # a_i / N
  p = jnp.where(mask, p, 0.0)
  o = jnp.sum(p[..., None] * v.astype(jnp.float32), axis=-2)
  c = jnp.where(mask & (pi < 1.0), (1.0 - pi) / jnp.where(pi > 0, pi, 1.0), 0.0)
  dev = v.astype(jnp.float32) - o[..., None, :]
  w = c * p * p
  return LinearizedMoments(
      bias=-jnp.sum(w[..., None] * dev, axis=-2),
      var=jnp.sum(w * jnp.sum(dev * dev, axis=-1), axis=-1),
      full=o,
  )


def coverage(errors, radii) -> float:
  """Fraction of calls with ``error <= radius``."""
  e, r = np.asarray(errors, np.float64), np.asarray(radii, np.float64)
  if e.shape != r.shape or e.size == 0:
    raise ValueError(f"errors {e.shape} and radii {r.shape} must be equal, non-empty shapes")
  return float(np.mean(e <= r))


def sharpness(errors, radii) -> float:
  """Median of ``radius / error`` over covered calls with a positive error
  (method, section 5: a radius that covers by being huge is useless). NaN if none."""
  e, r = np.asarray(errors, np.float64), np.asarray(radii, np.float64)
  sel = (e <= r) & (e > 0)
  return float(np.median(r[sel] / e[sel])) if sel.any() else float("nan")


class LogRFit(NamedTuple):
  intercept: float
  slope_log_m: float
  slope_n_tail: float
  r_squared: float
  n: int


def fit_log_r(r, m, n_tail) -> LogRFit:
  """OLS of ``log R`` on ``log m`` and ``n_tail`` (with intercept), method, section 6."""
  r, m, n_tail = (np.asarray(x, np.float64).ravel() for x in (r, m, n_tail))
  if not (r.shape == m.shape == n_tail.shape):
    raise ValueError(f"r, m, n_tail must have equal sizes, got {r.shape} {m.shape} "
                     f"{n_tail.shape}")
  ok = (r > 0) & (m > 0) & np.isfinite(r)
  if ok.sum() < 4:
    raise ValueError(f"need >= 4 calls with R > 0 and m > 0 to fit, got {int(ok.sum())}")
  y = np.log(r[ok])
  x = np.stack([np.ones(ok.sum()), np.log(m[ok]), n_tail[ok]], axis=1)
  coef, *_ = np.linalg.lstsq(x, y, rcond=None)
  resid = y - x @ coef
  ss_tot = np.sum((y - y.mean()) ** 2)
  r2 = 1.0 - np.sum(resid**2) / ss_tot if ss_tot > 0 else float("nan")
  return LogRFit(float(coef[0]), float(coef[1]), float(coef[2]), float(r2), int(ok.sum()))
