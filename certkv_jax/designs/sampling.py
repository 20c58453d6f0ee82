"""Poisson and priority sampling of the tail: Eq. 2 inclusion probabilities and capacity.

Implements method, sections 3 and 9 ("Inclusion probabilities", "Capacity and
overflow", "Fixed-size tail"): Eq. 2 solved as a fixed point, the Chernoff
capacity rule, Poisson draws conditioned on fitting (a token that cannot fit
is counted, never dropped silently), priority draws and a sort-free top-k
(eviction runs every decode step, where a sort is the slowest op).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from certkv_jax import _validate

Array = jax.Array

_BISECT_ITERS = 64


def check_eps(eps) -> float:
  if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < eps <= 1.0):
    raise ValueError(f"eps must be a float in (0, 1], got {eps!r}")
  return float(eps)


def inclusion_probabilities(score, m, eps: float = 1e-6, mask=None) -> Array:
  """Eq. 2 inclusion probabilities with floor and redistributed clipped mass.

  ``score`` [..., n] is non-negative and finite, ``m`` (scalar or [...]) > 0,
  ``eps`` in (0, 1], ``mask`` [..., n] the tail T. Returns float32 ``pi``, 0
  off the mask, in [eps, 1] on it, ``sum_T pi = m``; edge cases as method,
  section 9, "Inclusion probabilities".

  Raises:
    ValueError naming ``score``, ``m``, ``eps`` or ``mask`` for bad input
    (value checks run outside ``jit``).
  """
  eps = check_eps(eps)
  score = jnp.asarray(score)
  if score.ndim < 1:
    raise ValueError(f"score must have at least 1 dim [..., n], got shape {score.shape}")
  if not jnp.issubdtype(score.dtype, jnp.floating):
    raise TypeError(f"score must be floating, got {score.dtype}")
  if mask is None:
    mask = jnp.ones(score.shape, bool)
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(f"mask must be bool, got {mask.dtype}")
  if mask.shape != score.shape:
    raise ValueError(f"mask shape {mask.shape} must equal score shape {score.shape}")
  m = jnp.asarray(m, jnp.float32)
  try:
    jnp.broadcast_shapes(m.shape, score.shape[:-1])
  except ValueError as err:
    raise ValueError(f"m shape {m.shape} must broadcast against score's leading "
                     f"dims {score.shape[:-1]}") from err
  s_np, mask_np, m_np = (_validate.concrete_array(x) for x in (score, mask, m))
  if s_np is not None and mask_np is not None:
    vals = s_np.astype("float64")[mask_np]
    _validate.check_finite("score", vals)
    if vals.size and (vals < 0).any():
      raise ValueError(f"score must be >= 0 on the tail, found min {vals.min()}")
  if m_np is not None:
    _validate.check_in_range("m", m_np, 0.0, math.inf, lo_open=True, hi_open=True)
    if mask_np is not None:
      n_t = mask_np.sum(axis=-1)
      if (m_np < eps * n_t - 1e-6 * n_t).any():
        raise ValueError(
            f"m must be >= eps * n_tail (the floor alone keeps eps * n_tail tokens in "
            f"expectation); got m={m_np}, eps={eps}, n_tail={n_t}")
  return solve_inclusion(score.astype(jnp.float32), m, eps, mask)


def solve_inclusion(score, m, eps, mask):
  """The solver behind :func:`inclusion_probabilities`, without value checks (for ``jit``)."""
  s = jnp.where(mask, score, 0.0)
  m = jnp.broadcast_to(m, s.shape[:-1])
  n_t = jnp.sum(mask, axis=-1).astype(jnp.float32)
  pos = mask & (s > 0)
  n_pos = jnp.sum(pos, axis=-1).astype(jnp.float32)
  n_zero = n_t - n_pos
  s_max = jnp.max(s, axis=-1)
  s_min = jnp.min(jnp.where(pos, s, jnp.inf), axis=-1)
  s_max_safe = jnp.where(s_max > 0, s_max, 1.0)
  s_min_safe = jnp.where(jnp.isfinite(s_min), s_min, 1.0)
  # Bisection for log c on f(c) = sum_T clip(c s_i, eps, 1), non-decreasing.
  lo = jnp.log(eps) - jnp.log(s_max_safe) - 1.0  # every token at the floor
  hi = -jnp.log(s_min_safe) + 1.0  # every positive token capped at 1

  def f(log_c):
    return jnp.sum(jnp.where(mask, jnp.clip(jnp.exp(log_c)[..., None] * s, eps, 1.0), 0.0),
                   axis=-1)

  def body(_, lohi):
    lo, hi = lohi
    mid = 0.5 * (lo + hi)
    below = f(mid) < m
    return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

  lo, hi = jax.lax.fori_loop(0, _BISECT_ITERS, body, (lo, hi))
  c = jnp.exp(0.5 * (lo + hi))[..., None]
  cs = c * s
  capped = pos & (cs >= 1.0)
  floored = mask & (cs <= eps)
  middle = mask & ~capped & ~floored
  n_cap = jnp.sum(capped, axis=-1)
  n_floor = jnp.sum(floored, axis=-1)
  mid_mass = jnp.sum(jnp.where(middle, s, 0.0), axis=-1)
  # Closed form on the identified sets makes sum_T pi = m up to rounding.
  c_star = (m - n_cap - eps * n_floor) / jnp.where(mid_mass > 0, mid_mass, 1.0)
  # Rounding at the set boundaries can put c* s a hair outside [eps, 1].
  pi_mid = jnp.clip(c_star[..., None] * s, eps, 1.0)
  pi = jnp.where(capped, 1.0, jnp.where(floored, eps, pi_mid))

  all_in = (m >= n_t)[..., None]
  short = (m > n_pos + eps * n_zero)[..., None]  # positive scores cannot carry m
  share = ((m - n_pos) / jnp.where(n_zero > 0, n_zero, 1.0))[..., None]
  below_floor = (m < eps * n_t)[..., None]
  uniform = (m / jnp.where(n_t > 0, n_t, 1.0))[..., None]
  pi = jnp.where(short, jnp.where(pos, 1.0, share), pi)
  pi = jnp.where(below_floor, uniform, pi)
  pi = jnp.where(all_in, 1.0, pi)
  return jnp.where(mask, pi, 0.0).astype(jnp.float32)


def overflow_bound(m, slots) -> Array:
  """Chernoff bound on ``P(X > slots)`` for ``X`` a sum of Bernoullis with mean ``m``."""
  m = jnp.asarray(m, jnp.float32)
  c = jnp.asarray(slots, jnp.float32) + 1.0
  m_safe = jnp.maximum(m, 1e-30)
  log_b = -m_safe + c * (1.0 + jnp.log(m_safe) - jnp.log(c))
  return jnp.where(m >= c, 1.0, jnp.minimum(jnp.exp(log_b), 1.0))


def expected_tail_count(slots, overflow_prob: float) -> Array:
  """Largest float32 ``m`` whose Chernoff overflow bound for ``slots`` is <= ``overflow_prob``."""
  if not (isinstance(overflow_prob, float) and 0.0 < overflow_prob < 1.0):
    raise ValueError(f"overflow_prob must be a float in (0, 1), got {overflow_prob!r}")
  slots = jnp.asarray(slots, jnp.float32)
  log_p = math.log(overflow_prob)
  c = slots + 1.0

  def g(m):  # log of the bound minus log_p; increasing in m on (0, c)
    return -m + c * (1.0 + jnp.log(jnp.maximum(m, 1e-30)) - jnp.log(c)) - log_p

  def body(_, lohi):
    lo, hi = lohi
    mid = 0.5 * (lo + hi)
    ok = g(mid) <= 0
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, _BISECT_ITERS, body, (jnp.zeros_like(slots), slots))
  return jnp.where(slots > 0, lo, 0.0)


# float32 uniforms take 2^23 values (the mantissa's): U = j / 2^23, j = 0, ..., 2^23 - 1.
U_LEVELS = 2.0**23


def reached(p) -> Array:
  """``P(U < p)`` for a float32 uniform ``U``: ``ceil(p 2^23) / 2^23`` in [0, 1], within
  2^-23 above ``p``; ``poisson_draw`` keeps a token of inclusion probability ``p`` with it."""
  return jnp.clip(jnp.ceil(p * U_LEVELS) / U_LEVELS, 0.0, 1.0)


def below(x) -> Array:
  """``P(u < x)`` for ``priority_draw``'s ``u = 1 - U``: ``(ceil(x 2^23) - 1) / 2^23`` in
  [0, 1], within 2^-23 of ``min(1, x)``; 0 below 2^-23, which no draw reaches."""
  return jnp.clip((jnp.ceil(x * U_LEVELS) - 1.0) / U_LEVELS, 0.0, 1.0)


class Draw(NamedTuple):
  keep: Array  # [..., n] bool, the kept tail tokens
  n_redraws: Array  # [...] int32, redraws used (0 = first draw fitted)
  n_dropped: Array  # [...] int32, tokens dropped by the fallback (expected 0)


def poisson_draw(key, pi, mask, slots, max_redraws: int = 3) -> Draw:
  """Independent Bernoulli(pi_i) draws conditioned on fitting into ``slots``.

  ``pi`` [n] (1: always kept), ``mask`` [n] the tail, ``slots`` an int scalar
  (may be traced). Returns Draw(keep [n], n_redraws [], n_dropped []).
  """
  k_draw = jax.random.split(key)[0]  # a seed's kept sets as in the committed results
  u = jax.random.uniform(k_draw, (max_redraws + 1,) + pi.shape)
  draws = (u < pi) & mask  # pi == 1 is always kept since u < 1
  counts = jnp.sum(draws, axis=-1)
  fits = counts <= slots
  first = jnp.argmax(fits)
  any_fit = jnp.any(fits)
  chosen = draws[first]
  # Fallback (probability <= overflow_prob ** (max_redraws + 1)): keep the
  # certain tokens first, then a uniformly random subset of draw 0 (given its
  # draw, u_i / pi_i is uniform on [0, 1) and independent across tokens).
  prio = jnp.where(pi >= 1.0, 2.0, 0.0) + u[0] / jnp.where(pi > 0, pi, 1.0)
  prio = jnp.where(draws[0], prio, -1.0)
  fallback = draws[0] & top_k_mask(prio, slots)
  keep = jnp.where(any_fit, chosen, fallback)
  n_dropped = jnp.where(any_fit, 0, counts[0] - jnp.sum(fallback))
  n_redraws = jnp.where(any_fit, first, max_redraws)
  return Draw(keep, n_redraws.astype(jnp.int32), n_dropped.astype(jnp.int32))


class PriorityDraw(NamedTuple):
  keep: Array  # [..., n] bool, the kept tail tokens (exactly min(slots, |T|))
  pi: Array  # [..., n] float32 inclusion probability given the other priorities (0 off T)
  tau: Array  # [...] float32 the largest priority left out (0 when all of T is kept)


def priority_draw(key, score, mask, slots, eps: float = 1e-6) -> PriorityDraw:
  """Priority sampling of ``min(slots, |T|)`` tail tokens (Duffield et al., 2007).

  Method, section 3, "Fixed-size tail": kept tokens get ``pi = min(1, w / tau)``,
  tokens left out ``min(1, w / q_min_kept)`` (for the shadow record), each as the
  probability that the draw's discrete ``u`` falls below (:func:`below`). ``score``
  [..., n] is non-negative (read on ``mask``); ``slots`` an int, scalar or [...]
  (may be traced); ``eps`` the relative weight floor in (0, 1].
  """
  eps = check_eps(eps)
  s = jnp.where(mask, score.astype(jnp.float32), 0.0)
  n_t = jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32)
  mean = jnp.sum(s, axis=-1, keepdims=True) / jnp.maximum(n_t, 1.0)
  w = jnp.where(mean > 0, s + eps * mean, 1.0)
  u = 1.0 - jax.random.uniform(key, s.shape)  # (0, 1], on a grid of U_LEVELS steps
  q = jnp.where(mask, w / u, -jnp.inf)
  keep = mask & top_k_mask(q, slots)
  tau = jnp.max(jnp.where(mask & ~keep, q, 0.0), axis=-1)
  q_min = jnp.min(jnp.where(keep, q, jnp.inf), axis=-1, keepdims=True)
  t = tau[..., None]
  pi_kept = jnp.where(t > 0, below(w / jnp.where(t > 0, t, 1.0)), 1.0)
  pi_out = jnp.where(jnp.isfinite(q_min), below(w / q_min), 0.0)
  pi = jnp.where(keep, pi_kept, jnp.where(mask, pi_out, 0.0))
  return PriorityDraw(keep, pi.astype(jnp.float32), tau)


def _sort_key(x) -> Array:
  """Unsigned integers in the order of ``jnp.sort(x)`` (``-0.0 == 0.0``, NaN after ``+inf``)."""
  x = jnp.asarray(x)
  nbits = 8 * x.dtype.itemsize
  udt = jnp.dtype(f"uint{nbits}")
  top = jnp.array(1 << (nbits - 1), udt)
  if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
    return x
  if jnp.issubdtype(x.dtype, jnp.integer):
    return jax.lax.bitcast_convert_type(x, udt) ^ top
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"score must be real, got {x.dtype}")
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.zeros_like(x), x), udt)
  key = jnp.where((bits & top) != 0, ~bits, bits | top)
  return jnp.where(jnp.isnan(x), jnp.array(jnp.iinfo(udt).max, udt), key)


def top_k_mask(score, k) -> Array:
  """The ``k`` largest entries of ``score``, ties to the lower index, without a sort.

  Exactly ``rank < k`` in ``jnp.argsort(-score, stable=True)`` (NaN last), by a
  bitwise search for the ``k``-th value over the sort key. ``score`` [..., n]
  real; ``k`` int scalar or [...] (may be traced). Returns [..., n] bool.
  """
  score = jnp.asarray(score)
  if score.ndim < 1:
    raise ValueError(f"score must have at least 1 dim [..., n], got shape {score.shape}")
  key = _sort_key(-score)  # ascending in -score = descending in score
  k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), score.shape[:-1])
  nbits = 8 * key.dtype.itemsize
  one = jnp.array(1, key.dtype)

  def body(b, t):  # t: the bits of the k-th smallest key found so far
    bit = jnp.left_shift(one, (nbits - 1 - b).astype(key.dtype))
    low_half = t | (bit - one)  # t with this bit 0 and every lower bit 1
    enough = jnp.sum(key <= low_half[..., None], axis=-1) >= k
    return jnp.where(enough, t, t | bit)

  t = jax.lax.fori_loop(0, nbits, body, jnp.zeros(score.shape[:-1], key.dtype))
  before = key < t[..., None]
  tie = key == t[..., None]
  tie_rank = jnp.cumsum(tie, axis=-1, dtype=jnp.int32) - 1
  room = k - jnp.sum(before, axis=-1, dtype=jnp.int32)
  return before | (tie & (tie_rank < room[..., None]))
