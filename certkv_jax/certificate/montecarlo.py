"""Monte Carlo evaluation of a design on a fixed attention problem.

The problem (query, keys, values) is fixed and only the design's draws vary:
each trial evicts once and compares offset attention with the full output. The
tests check unbiasedness, the variance estimator and coverage this way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import attention
from certkv_jax.certificate import diagnostics
from certkv_jax.certificate import radius
from certkv_jax.kv import cache as cache_lib

Array = jax.Array


class Problem(NamedTuple):
  q: Array  # [d]      the query whose attention error is certified
  k: Array  # [n, d]
  v: Array  # [n, dv]
  history: Array  # [h, d] earlier queries (h may be 0) that shaped the scores


class Spikes(NamedTuple):
  """Tokens with a key aligned with the query (logit ``logit``) and an
  outlying value of norm ``value * sqrt(dv)``."""

  count: int = 0
  logit: float = 8.0
  value: float = 6.0


def synthetic_problem(key, n: int = 256, d: int = 16, dv: int = 16, q_scale: float = 2.0,
                      spikes=0, n_history: int = 0, history_corr: float = 0.5) -> Problem:
  """Gaussian keys/values and a query of norm ``q_scale * sqrt(d)``.

  ``spikes`` (a count, or :class:`Spikes`): tokens in the middle of the
  context whose keys align with the query and whose values are outliers:
  peaked attention on tokens a flat score cannot see. ``n_history`` earlier
  queries, each with correlation ``history_corr`` to ``q``, stand in for the
  past queries that built the running scores.
  """
  spikes = spikes if isinstance(spikes, Spikes) else Spikes(count=spikes)
  spike_logit, spike_value, spikes = spikes.logit, spikes.value, spikes.count
  kq, kk, kv, ks, kh = jax.random.split(key, 5)
  q = jax.random.normal(kq, (d,))
  q = q / jnp.linalg.norm(q) * q_scale * math.sqrt(d)
  k = jax.random.normal(kk, (n, d))
  v = jax.random.normal(kv, (n, dv))
  if spikes:
    idx = n // 2 + jnp.arange(spikes) * 3
    qn = q / jnp.linalg.norm(q)
    # logit q.k/sqrt(d) = spike_logit for k = alpha * q/||q||
    k = k.at[idx].set(qn * (spike_logit * math.sqrt(d) / jnp.linalg.norm(q)))
    direction = jax.random.normal(ks, (dv,))
    direction = direction / jnp.linalg.norm(direction)
    v = v.at[idx].set(direction * spike_value * math.sqrt(dv))
  noise = jax.random.normal(kh, (n_history, d))
  noise = noise / jnp.linalg.norm(noise, axis=-1, keepdims=True) * jnp.linalg.norm(q)
  history = history_corr * q + math.sqrt(1.0 - history_corr**2) * noise
  return Problem(q, k, v, history)


def prepared_cache(problem: Problem, capacity=None, question_aware: bool = True):
  """A cache holding the whole context with its running scores.

  The history queries are observed first. With ``question_aware`` the query
  itself is observed last (as the latest and as an observation-window query):
  eviction knows the question. Otherwise (streaming) the scores come from the
  history alone, which also serves as the observation window.
  """
  n, d = problem.k.shape
  cap = n if capacity is None else capacity
  c = cache_lib.init_cache(cap, d, problem.v.shape[-1])
  c = cache_lib.append(c, problem.k, problem.v)
  if problem.history.shape[0]:
    probs = attention.attention_probs(problem.history, c.k[None], c.log_pi[None],
                                      c.valid[None])
    c = cache_lib.observe(c, probs, observation=not question_aware)
  elif not question_aware:
    raise ValueError("question_aware=False needs a problem with n_history > 0")
  if question_aware:
    probs = attention.attention_probs(problem.q, c.k, c.log_pi, c.valid)
    c = cache_lib.observe(c, probs, observation=True)
  return c


class Trial(NamedTuple):
  """Per-trial outputs (leading axis = trials)."""

  out: Array  # [dv] o_hat
  error: Array  # [] ||o_hat - o||
  var_hat: Array  # []
  range_hat: Array  # []
  n_kept: Array  # [] int32
  r_ratio: Array  # [] Assumption-2 ratio R
  n_dropped: Array  # [] int32 overflow fallback drops


def run_trials(problem: Problem, design, keys, question_aware: bool = True
               ) -> tuple[Array, Trial]:
  """Runs the design once per key (vmapped): ``(o [dv], stacked Trial)``, o the full output."""
  base = prepared_cache(problem, question_aware=question_aware)
  full_mask = base.valid
  o = diagnostics.full_attention(problem.q, base.k, base.v, full_mask)

  def one(key):
    state = design.init(base)
    c, state, info = design.evict(base, state, key)
    res = attention.offset_attention(problem.q, c.k, c.v, c.log_pi, c.valid)
    err = diagnostics.attention_error(res.out, o).abs
    tail = full_mask & ~info.certain
    r = diagnostics.assumption2_ratio(problem.q, base.k, full_mask, tail, info.pi)
    return Trial(res.out.astype(jnp.float32), err, res.var_hat, res.range_hat, c.n_valid, r,
                 state.n_dropped)

  return o, jax.jit(jax.vmap(one))(keys)


class Summary(NamedTuple):
  bias_norm: float  # ||mean(o_hat) - o||
  bias_se: float  # that norm's Monte Carlo scale: sqrt(sum of the mean's squared SEs)
  mse: float  # mean ||o_hat - o||^2
  mean_var_hat: float  # mean V_hat
  var_ratio: float  # mean V_hat / mse
  coverage: dict  # delta -> empirical coverage of the Bernstein radius
  sharpness: dict  # delta -> median r/||e|| over covered trials
  mean_kept: float
  median_r: float  # median Assumption-2 ratio R
  n_trials: int


def summarize(o, trials: Trial, deltas=(0.05, 0.2), form: str = "bernstein") -> Summary:
  """The figures the issue notes and reports quote, from :func:`run_trials`."""
  outs = np.asarray(trials.out, np.float64)
  n = outs.shape[0]
  mean = outs.mean(0)
  se = outs.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full(outs.shape[1:], np.nan)
  err = np.asarray(trials.error, np.float64)
  cov, shp = {}, {}
  for delta in deltas:
    r = np.asarray(radius.radius_from_stats(trials.var_hat, trials.range_hat, delta, form))
    cov[delta] = diagnostics.coverage(err, r)
    shp[delta] = diagnostics.sharpness(err, r)
  mse = float(np.mean(err**2))
  mvh = float(np.mean(np.asarray(trials.var_hat, np.float64)))
  return Summary(
      bias_norm=float(np.linalg.norm(mean - np.asarray(o, np.float64))),
      bias_se=float(np.sqrt(np.sum(se**2))),  # E bias_norm^2 = bias_se^2 where unbiased
      mse=mse,
      mean_var_hat=mvh,
      var_ratio=mvh / mse if mse > 0 else float("nan"),
      coverage=cov,
      sharpness=shp,
      mean_kept=float(np.mean(np.asarray(trials.n_kept))),
      median_r=float(np.median(np.asarray(trials.r_ratio))),
      n_trials=n,
  )
