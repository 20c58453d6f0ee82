"""Per-head budgets: one memory total shared unequally among KV heads (method, section 12).

An allocation maps the uniform targets of a design's budget to unequal ones
with the same sum over its pool: :class:`AdaKV` (kvpress's), :class:`Pyramid`
(PyramidKV's layer schedule), :class:`CertificateTargeted` (least summed
projected variance) and :class:`TargetRadius` (a radius per head, no total).
It is a static, hashable object called in the jitted eviction::

    targets = allocation(design, caches, targets, gains)   # [L, B, H] int32

Caches must be sized for the largest target it gives (:meth:`max_target`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate
from certkv_jax.certificate import damage
from certkv_jax.designs import sampling
from certkv_jax.kv.cache import KVCache
from certkv_jax.kv.caches import over_heads

Array = jax.Array

SCOPES = ("layer", "model")
_BIG = 3.0e38  # certain tokens: above every score (kvpress uses finfo.max)


def _per_head(fn, caches: KVCache):
  """``fn(cache)`` for every (layer, row, KV head) cache."""
  return jax.vmap(over_heads(fn))(caches)


def _pools(x, scope: str):
  """[L, B, H, ...] -> [pools, members, ...]: per (layer, row) or per row."""
  L, B, H = x.shape[:3]
  if scope == "layer":
    return x.reshape((L * B, H) + x.shape[3:])
  return jnp.swapaxes(x, 0, 1).reshape((B, L * H) + x.shape[3:])


def _unpool(x, shape, scope: str):
  L, B, H = shape
  if scope == "layer":
    return x.reshape(L, B, H)
  return jnp.swapaxes(x.reshape(B, L, H), 0, 1)


def _check_scope(scope):
  if scope not in SCOPES:
    raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")


def _check_grid(allocation):
  """The grid settings the variance-based allocations share: steps, max_share, eps."""
  steps, share = allocation.steps, allocation.max_share
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  if (isinstance(share, bool) or not isinstance(share, (int, float))
      or not 1.0 <= share < math.inf):
    raise ValueError(f"max_share must be a finite number >= 1.0, got {share!r}")
  sampling.check_eps(allocation.eps)


@dataclasses.dataclass(frozen=True)
class AdaKV:
  """kvpress's ``AdaKVPress`` (Feng et al., 2024) over any design with a score.

  Per (layer, row), each KV head keeps its own top ``alpha_safeguard`` share of
  its target (and, for a design with ``min_tail``, its certainty set and that many
  tail tokens, which its eviction would keep anyway), then the layer's remaining
  total goes to the highest scores of all heads flattened (method, section 12, "AdaKV").
  """

  alpha_safeguard: float = 0.2
  needs_gains = False

  def __post_init__(self):
    a = self.alpha_safeguard
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
      raise ValueError(f"alpha_safeguard must be in [0, 1], got {a!r}")

  def max_target(self, target: int, n_heads: int, n_layers: int) -> int:
    """The largest per-head target for uniform targets ``target``."""
    del n_layers
    n_safe = int(math.floor(self.alpha_safeguard * target))
    if self.alpha_safeguard > 0 and target > 0:
      n_safe = max(n_safe, 1)
    return n_heads * target - (n_heads - 1) * n_safe

  def __call__(self, design, caches: KVCache, targets, gains=None) -> Array:
    del gains
    score = _design_score(design)

    def head_scores(cache):
      s = score(cache).astype(jnp.float32)
      s = jnp.where(design.certain(cache) & cache.valid, _BIG, s)
      return jnp.where(cache.valid, s, -jnp.inf)

    s = _pools(_per_head(head_scores, caches), "layer")  # [L*B, H, cap]
    t = _pools(targets, "layer")  # [L*B, H]
    # kvpress's int(n_kept * alpha) in float64 (0.7 * 90 -> 62), by a static table.
    cap = s.shape[-1]
    table = jnp.asarray(np.floor(np.arange(cap + 1) * float(self.alpha_safeguard)), jnp.int32)
    n_safe = jnp.where(t <= cap, table[jnp.clip(t, 0, cap)],
                       jnp.floor(self.alpha_safeguard * t.astype(jnp.float32)).astype(jnp.int32))
    if self.alpha_safeguard > 0:  # kvpress: at least one safe token per head that keeps any
      n_safe = jnp.where(t > 0, jnp.maximum(n_safe, 1), 0)
    if design.min_tail:  # the design keeps its certainty set and min_tail more regardless
      n_certain = _pools(_per_head(lambda c: jnp.sum(design.certain(c) & c.valid), caches),
                         "layer")
      n_safe = jnp.maximum(n_safe, n_certain + design.min_tail)
    valid = jnp.isfinite(s)
    safe = sampling.top_k_mask(s, n_safe) & valid
    # [pools]; the nominal counts, so no head exceeds max_target where another has fewer
    # valid tokens than its safe count (the layer then keeps less than its total)
    rest = jnp.maximum(jnp.sum(t, axis=-1) - jnp.sum(n_safe, axis=-1), 0)
    flat = jnp.where(safe, -jnp.inf, s).reshape(s.shape[0], -1)
    chosen = sampling.top_k_mask(flat, rest) & (valid & ~safe).reshape(flat.shape)
    counts = jnp.sum(chosen.reshape(s.shape), axis=-1) + jnp.sum(safe, axis=-1)
    return _unpool(counts.astype(jnp.int32), targets.shape, "layer")


def _design_score(design):
  score = getattr(design.tail, "score", None)
  if score is None:
    raise ValueError(f"design {design.name!r} has a tail rule without a score "
                     f"({type(design.tail).__name__}): a score-based allocation needs one")
  return score


def _window_costs(design, cache: KVCache, step, n_grid: int, eps: float):
  """``(costs [n_grid + 1], n_certain, n_tail, informed)`` of one head (method, section 12).

  ``costs[j]``: the window's Hajek variance with ``j * step`` tail slots;
  ``costs[0]`` the squared error of deleting the tail. ``informed`` is False
  before any window query was folded.
  """
  valid = cache.valid
  certain = design.certain(cache) & valid
  tail = valid & ~certain
  obs = jnp.where(valid, cache.obs, 0.0)
  total = jnp.sum(obs)
  a = obs / jnp.where(total > 0, total, 1.0)
  v = cache.v.astype(jnp.float32)
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)  # not TF32 (GPU)
  o = dot(a, v)
  o_r = o - cache.v_ref  # v_sq is ||v - v_ref||^2: distances to o about the same reference
  d2 = jnp.maximum(cache.v_sq - 2.0 * (dot(v, o_r) - dot(cache.v_ref, o_r)) + dot(o_r, o_r),
                   0.0)
  x = jnp.where(tail, a * a * d2, 0.0)
  w = jnp.where(tail, _design_score(design)(cache).astype(jnp.float32), 0.0)
  w = jnp.where(jnp.sum(w) > 0, w, tail.astype(jnp.float32))
  n_tail = jnp.sum(tail).astype(jnp.int32)
  slots = jnp.arange(1, n_grid + 1, dtype=jnp.float32) * step  # [n_grid]
  m = jnp.minimum(slots, n_tail.astype(jnp.float32))
  pi = inclusion_grid(w, tail, m, eps, getattr(design.tail, "heavy_share", 0.0))
  var = jnp.sum(jnp.where(tail, (1.0 / jnp.maximum(pi, 1e-30) - 1.0) * x, 0.0), axis=-1)
  var = jnp.where(m > 0, var, 0.0)
  a_certain = jnp.sum(jnp.where(certain, a, 0.0))
  deleted = jnp.sum(jnp.where(tail, a, 0.0)[:, None] * (v - o), axis=0)
  deleted = deleted / jnp.maximum(a_certain, 1e-6)
  costs = jnp.concatenate([jnp.sum(deleted * deleted)[None], var])
  return costs, jnp.sum(certain).astype(jnp.int32), n_tail, total > 0


def inclusion_grid(w, tail, ms, eps: float, heavy_share: float = 0.0):
  """Eq. 2's capped inclusion probabilities [J, n] for the tail sizes ``ms`` [J] at once.

  One sort instead of a bisection per size, since it runs at every eviction
  for every head and grid point; the ``eps`` floor is applied after, so sums
  can exceed ``m``. ``heavy_share`` first gives ``pi = 1`` to the
  ``floor(heavy_share * m)`` largest weights. 0 off ``tail``.
  """
  n = w.shape[-1]
  ws = -jnp.sort(-jnp.where(tail, w, 0.0))  # descending
  rest = jnp.cumsum(ws[::-1])[::-1]  # weight of all but the j largest (no cancellation)
  j = jnp.arange(n, dtype=jnp.float32)
  h = jnp.floor(heavy_share * ms)  # [J] top weights kept with certainty
  c = (ms[:, None] - j[None, :]) / jnp.where(rest > 0, rest, 1.0)[None, :]  # [J, n]
  ok = ((c * ws[None, :] < 1.0) & (j[None, :] <= ms[:, None]) & (j[None, :] >= h[:, None])
        & (rest > 0)[None, :])
  c_star = jnp.take_along_axis(c, jnp.argmax(ok, axis=1)[:, None], axis=1)  # [J, 1]
  pi = jnp.clip(c_star * w[None, :], eps, 1.0)
  if heavy_share:
    cut = ws[jnp.clip(h.astype(jnp.int32) - 1, 0, n - 1)]  # the h-th largest weight
    pi = jnp.where((h[:, None] > 0) & (w[None, :] >= cut[:, None]), 1.0, pi)
  pi = jnp.where((ms >= jnp.sum(tail))[:, None], 1.0, pi)
  return jnp.where(tail[None, :], pi, 0.0).astype(jnp.float32)


def _grid_step(targets, steps: int):
  """Slots per grid step of a pool: the mean uniform target over ``steps``."""
  mean = jnp.mean(targets.astype(jnp.float32), axis=-1)
  return jnp.maximum(jnp.ceil(mean / steps), 1.0)


def _greedy(costs, n_certain, limit, pool, step, floor):
  """Targets of one pool's members minimising the summed cost (method, section 12).

  ``costs`` [M, J + 1], ``limit`` [M] the most tail slots a member can take,
  ``pool`` the total, ``floor`` [M] tail slots given first (its whole grid steps
  forced, the remainder set aside, so floors that fit the pool are all met). Each
  member keeps its certainty set; the sum is ``pool`` unless all reach their limit
  or the certainty sets alone exceed it.
  """
  M, J1 = costs.shape
  J = J1 - 1
  gain = costs[:, :-1] - costs[:, 1:]  # [M, J]
  j = jnp.arange(J)
  useful = (j[None, :] * step) < limit[:, None]
  floor = jnp.minimum(floor, limit)
  forced = (floor.astype(jnp.float32) // step).astype(jnp.int32)  # whole steps, rounded down
  gain = jnp.where(j[None, :] < forced[:, None], jnp.inf, gain)
  gain = jnp.where(useful, gain, -jnp.inf)
  rest = jnp.maximum(pool - jnp.sum(n_certain), 0)
  aside = jnp.sum(floor - forced * step.astype(jnp.int32))  # the floors' part steps
  n_steps = (jnp.maximum(rest - aside, 0).astype(jnp.float32) // step).astype(jnp.int32)
  pick = sampling.top_k_mask(gain.reshape(-1), n_steps).reshape(M, J) & useful
  tail = jnp.minimum(jnp.sum(pick, axis=-1).astype(jnp.int32) * step.astype(jnp.int32), limit)
  tail = jnp.maximum(tail, floor)
  left = rest - jnp.sum(tail)
  nxt = jnp.take_along_axis(gain, jnp.minimum(jnp.sum(pick, axis=-1), J - 1)[:, None],
                            axis=-1)[:, 0]
  order = jnp.argsort(-jnp.where(limit > tail, nxt, -jnp.inf))
  room = (limit - tail)[order]
  before = jnp.cumsum(room) - room
  extra_sorted = jnp.clip(left - before, 0, room)
  extra = jnp.zeros_like(tail).at[order].set(extra_sorted)
  return n_certain + tail + extra


@dataclasses.dataclass(frozen=True)
class CertificateTargeted:
  """Memory where the certificate's variance is (method, section 12, "Certificate-targeted").

  Each head's window variance on a grid of tail sizes, weighted by ``gains``
  [L, H] (:func:`kv_head_gains`), goes greedily into the pool's total. The
  design needs ``observation_window >= 1``.

  Attributes:
    scope: "layer" (each layer keeps its total) or "model" (per row).
    steps: grid points per uniform share (>= 1).
    max_share: the largest target, in uniform shares (>= 1).
    min_share: the smallest target, in uniform shares, in [0, 1] (0: none).
    eps: the inclusion-probability floor of the variance formula.
  """

  scope: str = "layer"
  steps: int = 8
  max_share: float = 4.0
  min_share: float = 0.0
  eps: float = 1e-6
  needs_gains = True

  def __post_init__(self):
    _check_scope(self.scope)
    _check_grid(self)
    m = self.min_share
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 1.0:
      raise ValueError(f"min_share must be a number in [0, 1], got {m!r}")

  def max_target(self, target: int, n_heads: int, n_layers: int) -> int:
    del n_heads, n_layers
    return _largest(self.max_share, self.steps, target)

  def __call__(self, design, caches: KVCache, targets, gains=None) -> Array:
    _check_window(design, self)
    gains = _check_gains(gains, targets.shape)
    shape = targets.shape
    largest = _largest(self.max_share, self.steps, targets)
    pooled_t = _pools(targets, self.scope)  # [P, M]
    step = _grid_step(pooled_t, self.steps)  # [P]
    n_grid = int(math.ceil(self.max_share * self.steps))
    step_per_head = jnp.broadcast_to(
        _unpool(jnp.broadcast_to(step[:, None], pooled_t.shape), shape, self.scope), shape)
    costs, n_certain, n_tail, informed = jax.vmap(over_heads(
        lambda c, s: _window_costs(design, c, s, n_grid, self.eps)))(caches, step_per_head)
    costs = costs * jnp.broadcast_to(gains[:, None, :, None], costs.shape)
    limit = jnp.maximum(jnp.minimum(n_tail, largest - n_certain), 0)
    floor = jnp.ceil(self.min_share * targets.astype(jnp.float32)).astype(jnp.int32)
    floor = jnp.maximum(floor - n_certain, design.min_tail)  # the design keeps min_tail anyway
    out = jax.vmap(_greedy)(_pools(costs, self.scope), _pools(n_certain, self.scope),
                            _pools(limit, self.scope), jnp.sum(pooled_t, axis=-1), step,
                            _pools(floor, self.scope))
    ok = jnp.all(_pools(informed, self.scope), axis=-1, keepdims=True)  # else uniform
    out = jnp.where(ok, out, pooled_t)
    return _unpool(out.astype(jnp.int32), shape, self.scope)


@dataclasses.dataclass(frozen=True)
class TargetRadius:
  """Per head, the smallest target whose estimated projected radius meets ``radius``.

  The variance term of the Bernstein radius at ``delta`` on
  :class:`CertificateTargeted`'s grid (method, section 12, "Target radius");
  no pool, and a head that never meets it gets ``max_share`` shares.
  """

  radius: float = 1.0
  delta: float = 0.05
  steps: int = 8
  max_share: float = 4.0
  eps: float = 1e-6
  needs_gains = True

  def __post_init__(self):
    r = self.radius
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r < math.inf:
      raise ValueError(f"radius must be a positive finite number, got {r!r}")
    if not 0.0 < self.delta < 1.0:
      raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
    _check_grid(self)

  def max_target(self, target: int, n_heads: int, n_layers: int) -> int:
    del n_heads, n_layers
    return _largest(self.max_share, self.steps, target)

  def __call__(self, design, caches: KVCache, targets, gains=None) -> Array:
    _check_window(design, self)
    gains = _check_gains(gains, targets.shape)
    step = jnp.maximum(jnp.ceil(targets.astype(jnp.float32) / self.steps), 1.0)
    n_grid = int(math.ceil(self.max_share * self.steps))
    costs, n_certain, n_tail, informed = jax.vmap(over_heads(
        lambda c, s: _window_costs(design, c, s, n_grid, self.eps)))(caches, step)
    est = jnp.sqrt(gains[:, None, :, None] * costs * 2.0 * math.log(2.0 / self.delta))
    meets = est <= self.radius
    j = jnp.where(jnp.any(meets, axis=-1), jnp.argmax(meets, axis=-1), n_grid)
    tail = jnp.minimum(j.astype(jnp.float32) * step, n_tail.astype(jnp.float32))
    out = jnp.where(informed, n_certain + tail.astype(jnp.int32), targets)  # no window: uniform
    return jnp.minimum(out, jnp.maximum(_largest(self.max_share, self.steps, targets),
                                        n_certain)).astype(jnp.int32)


def _largest(max_share, steps, target):
  """The largest target a head may get: ``ceil(max_share * t) + steps`` (int or array)."""
  if isinstance(target, int):
    return int(math.ceil(max_share * target)) + steps
  t = jnp.asarray(target, jnp.float32)
  return (jnp.ceil(max_share * t) + steps).astype(jnp.int32)


def _check_window(design, allocation):
  if not design.randomized:
    raise ValueError(f"{type(allocation).__name__} allocates by the Hajek variance of a "
                     f"sampled tail: design {design.name!r} is deterministic (use AdaKV)")
  if design.observation_window < 1:
    raise ValueError(f"{type(allocation).__name__} estimates each head's error from the "
                     f"observation window: design {design.name!r} needs observation_window "
                     ">= 1 (dataclasses.replace(design, observation_window=16)), got 0")


def _check_gains(gains, shape):
  if gains is None:
    raise ValueError("this allocation needs gains [n_layers, n_kv_heads] (kv_head_gains)")
  gains = jnp.asarray(gains, jnp.float32)
  if gains.shape != (shape[0], shape[2]):
    raise ValueError(f"gains must be [n_layers={shape[0]}, n_kv_heads={shape[2]}], "
                     f"got {gains.shape}")
  found = _validate.concrete_array(gains)  # None under jit
  if found is not None and not (np.isfinite(found) & (found >= 0)).all():
    raise ValueError(f"gains must be finite and >= 0, got {found.tolist()}")
  return gains


def kv_head_gains(w_o, n_heads: int, n_kv_heads: int, head_dim: int) -> Array:
  """[L, n_kv_heads] summed squared RMS gains of each KV head's query heads.

  ``w_o`` [L, n_heads * head_dim, hidden] is the model's ``o_proj`` kernel.
  """
  if n_heads % n_kv_heads:
    raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
  g = damage.head_output_norms(w_o, n_heads, head_dim, kind="frobenius_rms")
  g = g.reshape(g.shape[:-1] + (n_kv_heads, n_heads // n_kv_heads))
  return jnp.sum(g * g, axis=-1)


@dataclasses.dataclass(frozen=True)
class Pyramid:
  """PyramidKV's layer schedule: layer ratios linear from ``2 - 1/beta`` down to
  ``1/beta`` (mean 1), then ``within`` (:class:`AdaKV` or a layer-scoped
  :class:`CertificateTargeted`) shares each layer's total. A row whose first layer
  would get more than the tokens it has seen keeps uniform targets, as kvpress's
  PyramidKV falls back to SnapKV."""

  beta: float = 20.0
  within: Optional[object] = None

  def __post_init__(self):
    if (isinstance(self.beta, bool) or not isinstance(self.beta, (int, float))
        or not math.isfinite(self.beta) or self.beta <= 1):
      raise ValueError(f"beta must be a finite number > 1, got {self.beta!r}")
    w = self.within
    if w is not None and not (isinstance(w, AdaKV) or (isinstance(w, CertificateTargeted)
                                                       and w.scope == "layer")):
      raise ValueError("within must be None, AdaKV() or CertificateTargeted(scope='layer') "
                       f"(an allocation that keeps each layer's total), got {w!r}")

  @property
  def needs_gains(self) -> bool:
    return bool(self.within is not None and self.within.needs_gains)

  def ratios(self, n_layers: int) -> np.ndarray:
    if n_layers == 1:
      return np.ones(1)
    return np.linspace(2.0 - 1.0 / self.beta, 1.0 / self.beta, n_layers)

  def max_target(self, target: int, n_heads: int, n_layers: int) -> int:
    top = int(math.floor(float(self.ratios(n_layers)[0]) * target * (1 + 2e-6)))
    return top if self.within is None else self.within.max_target(top, n_heads, n_layers)

  def __call__(self, design, caches: KVCache, targets, gains=None) -> Array:
    r = jnp.asarray(self.ratios(targets.shape[0]), jnp.float32)[:, None, None]
    t = jnp.floor(r * targets.astype(jnp.float32) * (1.0 + 1e-6)).astype(jnp.int32)
    over = jnp.any(t > caches.n_seen, axis=(0, 2), keepdims=True)  # [1, B, 1]: unreachable
    t = jnp.where(over, targets, t)
    return t if self.within is None else self.within(design, caches, t, gains)
