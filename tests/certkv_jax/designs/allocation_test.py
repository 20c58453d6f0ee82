"""Per-head allocations (``certkv_jax.designs.allocation``) and the memory accounting (``memory``).

Each allocation turns equal per-head targets into unequal ones: AdaKV and
CertificateTargeted keep the pool's total, TargetRadius follows a radius,
Pyramid scales layers. Checked here: the totals, the bounds the caches are
sized by (``max_target``, ``budgets.capacity``), AdaKV against a numpy
reference of kvpress's ``AdaKVPress.compress``, the greedy against brute force,
and the bytes a kept slot costs.
"""

import dataclasses
import functools
import itertools
import math

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certkv_jax import designs
from certkv_jax.designs import allocation
from certkv_jax.designs import budgets
from certkv_jax.designs import registry
from certkv_jax.designs import sampling
from certkv_jax import eviction
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv import caches as caches_lib
from certkv_jax.kv.caches import over_heads
from certkv_jax.kv import memory
from models import decode
from tests import test_util

L, B, H, CAP, N, D = 2, 2, 4, 64, 48, 8
FRACTION = 0.25  # uniform target floor(0.25 * 48) = 12 per head
T_UNIFORM = 12


def _design(name, **kw):
  """A registered design at FRACTION with 2 sinks, a window of 4 and an
  observation window of 4 (what CertificateTargeted reads)."""
  d = registry.make(name, FRACTION, n_sink=2, window=4, **kw)
  return dataclasses.replace(d, observation_window=4)


@functools.lru_cache(maxsize=None)
def _caches():
  """[L, B, H] caches holding N tokens, with skewed per-head statistics."""
  rng = np.random.default_rng(0)
  spec = caches_lib.CacheSpec(n_layers=L, n_kv_heads=H, head_dim=D)
  k = rng.normal(size=(L, B, H, N, D)).astype(np.float32)
  v = rng.normal(size=(L, B, H, N, D)).astype(np.float32)
  v *= rng.uniform(0.2, 3.0, size=(L, B, H, 1, 1)).astype(np.float32)  # heads differ
  # Attention of 4 window queries, peaked differently per head.
  conc = rng.choice([0.1, 0.3, 1.0, 3.0], size=(L, B, H))
  probs = np.stack([rng.dirichlet(np.full(CAP, c), size=4) for c in conc.ravel()])
  probs = probs.reshape(L, B, H, 4, CAP).astype(np.float32)

  @jax.jit
  def build(k, v, probs):
    cs = caches_lib.init_caches(spec, B, CAP).as_kvcache()  # stacked, as allocations take
    cs = jax.vmap(over_heads(cache_lib.append))(cs, k, v)
    return jax.vmap(over_heads(lambda c, p: cache_lib.observe(c, p, observation=True)))(
        cs, probs)

  return build(k, v, probs)


GAINS = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2.0, size=(L, H)), jnp.float32)


@functools.partial(jax.jit, static_argnames=("design", "alloc"))
def _targets_and_evict(design, alloc, cs, gains, key):
  """(uniform targets, allocated targets, kept counts after eviction, kept mask)."""
  base = jax.vmap(over_heads(design.budget.target))(cs)
  targets = alloc(design, cs, base, gains)
  new, _, _, _ = eviction.evict(design, caches_lib.Caches(cs), key, allocation=alloc,
                                gains=gains)
  return base, targets, jnp.sum(new.valid, -1), new.valid


def _run(design, alloc, cs=None, gains=GAINS, seed=0):
  cs = _caches() if cs is None else cs
  out = _targets_and_evict(design, alloc, cs, gains, jax.random.PRNGKey(seed))
  return jax.tree_util.tree_map(np.asarray, out)


class PoolTest(absltest.TestCase):

  def _check_bounds(self, alloc, targets):
    n_valid = np.asarray(_caches().valid).sum(-1)
    self.assertTrue((targets <= alloc.max_target(T_UNIFORM, H, L)).all(), targets)
    self.assertTrue((targets <= n_valid).all(), targets)
    self.assertTrue((targets >= 0).all(), targets)

  def test_adakv_keeps_each_layer_total_top_k_design(self):
    alloc = allocation.AdaKV()
    base, t, kept, _ = _run(_design("snapkv"), alloc)
    np.testing.assert_array_equal(base, T_UNIFORM)
    # Per (layer, row): the heads' targets add up to n_kv_heads * t, exactly.
    np.testing.assert_array_equal(t.sum(-1), H * T_UNIFORM)
    self.assertGreater(len(np.unique(t)), 1)  # the targets are unequal
    self._check_bounds(alloc, t)
    np.testing.assert_array_equal(kept, t)  # a top-k design keeps its target

  @pytest.mark.slow  # a compile of the variance grid per test
  def test_certificate_targeted_layer_priority_tail(self):
    alloc = allocation.CertificateTargeted(scope="layer")
    _, t, kept, _ = _run(_design("priority_tail"), alloc)
    np.testing.assert_array_equal(t.sum(-1), H * T_UNIFORM)  # per layer (and row)
    self.assertGreater(len(np.unique(t)), 1)
    self._check_bounds(alloc, t)
    np.testing.assert_array_equal(kept, t)  # fixed-size tail: exactly the target

  @pytest.mark.slow  # a compile of the variance grid per test
  def test_certificate_targeted_min_share(self):
    alloc = allocation.CertificateTargeted(scope="layer", min_share=0.75)
    _, t, kept, _ = _run(_design("priority_tail"), alloc)
    np.testing.assert_array_equal(t.sum(-1), H * T_UNIFORM)
    self.assertTrue((t >= math.ceil(0.75 * T_UNIFORM)).all(), t)  # no head starved
    self.assertGreater(len(np.unique(t)), 1)
    self._check_bounds(alloc, t)
    np.testing.assert_array_equal(kept, t)

  def test_a_design_min_tail_is_inside_the_layer_total(self):
    # priority_floor keeps its 6 certain tokens and min_tail=2 more whatever its target:
    # the allocations count them, so the heads' kept tokens still add up to the pool.
    design = _design("priority_floor", min_tail=2)
    for alloc in (allocation.AdaKV(), allocation.CertificateTargeted()):
      _, t, kept, _ = _run(design, alloc)
      np.testing.assert_array_equal(kept, t, err_msg=type(alloc).__name__)
      np.testing.assert_array_equal(kept.sum(-1), H * T_UNIFORM, err_msg=type(alloc).__name__)
      self.assertTrue((kept >= 6 + 2).all(), kept)

  @pytest.mark.slow  # a compile of the variance grid per test
  def test_certificate_targeted_model_poisson_tail(self):
    alloc = allocation.CertificateTargeted(scope="model")
    _, t, kept, _ = _run(_design("poisson_tail"), alloc)
    # Per row, over every layer and head: the model's total, exactly.
    np.testing.assert_array_equal(t.sum(axis=(0, 2)), L * H * T_UNIFORM)
    self.assertGreater(len(np.unique(t.sum(-1))), 1)  # layers trade memory
    self._check_bounds(alloc, t)
    self.assertTrue((kept <= t).all())  # Poisson keeps a random count <= target
    self.assertTrue((kept < t).any())


# --------------------------------------------------------------------------- AdaKV


def _adakv_reference(scores, n_kept, alpha):
  """kvpress's ``AdaKVPress.compress`` on one (layer, row): scores [H, n] ->
  kept [H, n]. Each head's top ``n_safe`` scores are raised to the float
  maximum, then the bottom ``H * (n - n_kept)`` of all heads flattened are
  pruned. (kvpress takes ``n_safe = int(n_kept * alpha)``; the allocation
  floors it at 1 while ``alpha > 0``, so the reference does too.)"""
  s = np.asarray(scores, np.float64).copy()
  n_heads, n = s.shape
  n_safe = max(1, int(n_kept * alpha))
  top = np.argsort(-s, axis=-1, kind="stable")[:, :n_safe]
  np.put_along_axis(s, top, np.finfo(np.float64).max, axis=-1)
  pruned = np.argsort(s.reshape(-1), kind="stable")[:n_heads * (n - n_kept)]
  keep = np.ones(n_heads * n, bool)
  keep[pruned] = False
  return keep.reshape(n_heads, n)


class AdaKVTest(absltest.TestCase):

  def test_matches_kvpress_reference(self):
    # TOVA scores read ``last``: set it to random scores, head scales 0.1..10
    # so that heads win very different shares. No sinks or window.
    rng = np.random.default_rng(2)
    scale = np.array([0.1, 1.0, 3.0, 10.0])[rng.permutation(H)]
    last = rng.uniform(size=(L, B, H, CAP)) * scale[:, None]
    cs = _caches()
    cs = cs._replace(last=jnp.where(cs.valid, jnp.asarray(last, jnp.float32), 0.0))
    design = designs.tova(FRACTION)
    n_kept = int(N * FRACTION)
    for alpha in (0.05, 0.2, 0.5):
      _, t, kept_n, kept = _run(design, allocation.AdaKV(alpha_safeguard=alpha), cs=cs)
      for layer, row in itertools.product(range(L), range(B)):
        want = _adakv_reference(np.asarray(cs.last)[layer, row, :, :N], n_kept, alpha)
        np.testing.assert_array_equal(kept[layer, row, :, :N], want, err_msg=str(alpha))
        self.assertFalse(kept[layer, row, :, N:].any())
      np.testing.assert_array_equal(kept_n, t)
      # The safeguard binds: the weakest heads keep exactly n_safe tokens
      # (measured targets per layer and row: [37, 9, 1, 1] at alpha 0.05).
      self.assertEqual(t.min(), max(1, int(n_kept * alpha)))

  def test_max_target(self):
    # One head takes everything the others leave above their safeguard.
    self.assertEqual(allocation.AdaKV(0.2).max_target(12, 4, 2), 4 * 12 - 3 * 2)
    self.assertEqual(allocation.AdaKV(0.0).max_target(12, 4, 2), 48)
    self.assertEqual(allocation.AdaKV(0.05).max_target(12, 4, 2), 48 - 3)  # floor 1
    self.assertEqual(allocation.AdaKV(1.0).max_target(12, 4, 2), 12)


# --------------------------------------------------------------------------- certificate-targeted


class GreedyTest(absltest.TestCase):

  def test_matches_brute_force_on_convex_costs(self):
    greedy = jax.jit(allocation._greedy)  # pylint: disable=protected-access
    rng = np.random.default_rng(3)
    m_members, j_max, step = 3, 5, 2
    for trial in range(25):
      # Convex and decreasing: marginal decreases positive and non-increasing in j.
      dec = -np.sort(-rng.exponential(size=(m_members, j_max)), axis=-1)
      costs = np.concatenate([np.full((m_members, 1), 20.0), 20.0 - np.cumsum(dec, -1)], -1)
      n_certain = rng.integers(0, 4, m_members)
      max_steps = rng.integers(1, j_max + 1, m_members)
      limit = step * max_steps  # the tail slots each member can take
      n_steps = int(rng.integers(0, max_steps.sum() + 2))
      pool = int(n_certain.sum()) + step * n_steps
      out = np.asarray(greedy(jnp.asarray(costs, jnp.float32), jnp.asarray(n_certain, jnp.int32),
                              jnp.asarray(limit, jnp.int32), jnp.int32(pool),
                              jnp.float32(step), jnp.zeros(m_members, jnp.int32)))
      reachable = min(n_steps, int(max_steps.sum()))
      best = min(sum(costs[i, j[i]] for i in range(m_members))
                 for j in itertools.product(*[range(s + 1) for s in max_steps])
                 if sum(j) == reachable)
      tail = out - n_certain
      self.assertTrue((tail % step == 0).all() and (tail >= 0).all() and (tail <= limit).all(),
                      (trial, out))
      got = sum(costs[i, tail[i] // step] for i in range(m_members))
      self.assertAlmostEqual(got, best, places=4, msg=(trial, out))
      self.assertEqual(out.sum(), n_certain.sum() + step * reachable, trial)

  def test_remainder_fills_the_pool(self):
    # A pool that is not a multiple of the step still adds up exactly.
    greedy = jax.jit(allocation._greedy)  # pylint: disable=protected-access
    costs = jnp.asarray([[9.0, 5.0, 3.0, 2.0, 1.5], [9.0, 8.0, 7.5, 7.2, 7.0]], jnp.float32)
    for pool in (4, 5, 7, 9, 11):
      out = np.asarray(greedy(costs, jnp.array([2, 2], jnp.int32), jnp.array([8, 8], jnp.int32),
                              jnp.int32(pool), jnp.float32(3.0), jnp.zeros(2, jnp.int32)))
      self.assertEqual(out.sum(), pool, (pool, out))
      self.assertTrue((out >= 2).all() and (out <= 10).all(), out)

  def test_floor_comes_first(self):
    # Member 1's costs barely fall: without a floor it gets nothing, with a floor of 4
    # tail slots it gets exactly 4 (a whole step of 3 and a part one) before costs are
    # compared, and member 0 the rest.
    greedy = jax.jit(allocation._greedy)  # pylint: disable=protected-access
    costs = jnp.asarray([[9.0, 5.0, 3.0, 2.0, 1.5], [9.0, 8.9, 8.8, 8.7, 8.6]], jnp.float32)
    args = (costs, jnp.array([2, 2], jnp.int32), jnp.array([12, 12], jnp.int32), jnp.int32(16),
            jnp.float32(3.0))
    np.testing.assert_array_equal(greedy(*args, jnp.zeros(2, jnp.int32)), [14, 2])
    np.testing.assert_array_equal(greedy(*args, jnp.array([0, 4], jnp.int32)), [10, 6])

  def test_every_floor_that_fits_the_pool_is_met(self):
    # Four like members, floors of 9 tail slots on a grid of 2: rounded up to whole
    # steps (10 each) they need 40 of the 36 tail slots, and before, the last member
    # got 6 (its target 9 < 3 + 9); now each gets its floor and the pool adds up.
    greedy = jax.jit(allocation._greedy)  # pylint: disable=protected-access
    costs = jnp.tile(jnp.linspace(10.0, 0.0, 25), (4, 1))
    three, nine = jnp.full(4, 3, jnp.int32), jnp.full(4, 9, jnp.int32)
    out = np.asarray(greedy(costs, three, jnp.full(4, 45, jnp.int32), jnp.int32(48),
                            jnp.float32(2.0), nine))
    self.assertTrue((out >= 3 + 9).all(), out)
    self.assertEqual(out.sum(), 48)

  @pytest.mark.slow  # two compiles of the variance grid
  def test_high_variance_head_gets_more(self):
    # One layer, two KV heads with identical caches: only the gains differ.
    cs = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x[:1, :1, :1], (1, 1, 2) + x.shape[3:]),
                                _caches())
    design = _design("priority_tail")
    alloc = allocation.CertificateTargeted()
    _, t_a, kept_a, _ = _run(design, alloc, cs=cs, gains=jnp.array([[1.0, 100.0]]))
    _, t_b, _, _ = _run(design, alloc, cs=cs, gains=jnp.array([[100.0, 1.0]]))
    t_a, t_b = t_a.reshape(2), t_b.reshape(2)
    self.assertGreater(t_a[1], t_a[0], t_a)
    self.assertGreater(t_b[0], t_b[1], t_b)
    self.assertEqual(t_a.sum(), 2 * T_UNIFORM)
    np.testing.assert_array_equal(t_a, t_b[::-1])  # symmetric
    np.testing.assert_array_equal(kept_a.reshape(2), t_a)


class InclusionGridTest(absltest.TestCase):
  """The cost grid's inclusion probabilities against the bisection solver."""

  def test_matches_solve_inclusion_with_and_without_heavy_share(self):
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.gamma(0.4, size=60), jnp.float32)
    tail = jnp.asarray(rng.random(60) < 0.8)
    ms = jnp.asarray([1.0, 4.0, 9.0, 20.0, 33.0], jnp.float32)
    eps = 1e-6
    for share in (0.0, 0.5):
      grid = np.asarray(allocation.inclusion_grid(w, tail, ms, eps, share))
      ws = np.sort(np.asarray(w)[np.asarray(tail)])[::-1]
      for j, m in enumerate(np.asarray(ms)):
        h = int(np.floor(share * m))
        top = np.asarray(tail) & (np.asarray(w) >= ws[h - 1]) if h else np.zeros(60, bool)
        rest = np.asarray(tail) & ~top
        want = np.asarray(sampling.solve_inclusion(w, jnp.float32(m - h), eps, rest))
        want = np.where(top, 1.0, want)
        # 1e-5: the grid's closed form and the solver's bisection in float32
        np.testing.assert_allclose(grid[j], want, atol=1e-5, err_msg=f"{share} {m}")
        self.assertAlmostEqual(float(grid[j].sum()), float(m), delta=1e-3 + eps * 60)


class TargetRadiusTest(absltest.TestCase):

  def test_monotone_in_radius(self):
    design = _design("priority_tail")
    radii = (1e-6, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 10.0, 1e6)

    @jax.jit
    def all_targets(cs, gains):
      base = jax.vmap(over_heads(design.budget.target))(cs)
      return jnp.stack([allocation.TargetRadius(radius=r)(design, cs, base, gains)
                        for r in radii])

    cs = _caches()
    t = np.asarray(all_targets(cs, GAINS))
    # A larger radius never asks for more memory.
    self.assertTrue((np.diff(t, axis=0) <= 0).all(), t.reshape(len(radii), -1))
    self.assertGreater(len(np.unique(t.sum(axis=(1, 2, 3)))), 3)  # it does move
    n_certain = np.asarray(jax.vmap(over_heads(
        lambda c: jnp.sum(design.certain(c) & c.valid)))(cs))
    np.testing.assert_array_equal(t[-1], n_certain)  # huge radius: certainty set, +0 tail
    # Tiny radius: the whole tail (pi = 1 has zero variance), within max_share.
    n_valid = np.asarray(cs.valid).sum(-1)
    largest = allocation.TargetRadius().max_target(T_UNIFORM, H, L)
    np.testing.assert_array_equal(t[0], np.minimum(n_valid, largest))


class PyramidTest(absltest.TestCase):

  def test_ratios(self):
    for beta in (1.5, 20.0):
      p = allocation.Pyramid(beta=beta)
      for n_layers in (1, 2, 5, 32):
        r = p.ratios(n_layers)
        self.assertAlmostEqual(float(r.mean()), 1.0, places=12)
        if n_layers > 1:
          self.assertAlmostEqual(float(r[0]), 2.0 - 1.0 / beta, places=12)
          self.assertAlmostEqual(float(r[-1]), 1.0 / beta, places=12)
          self.assertTrue((np.diff(r) < 0).all())

  def test_targets_and_max_target(self):
    design = _design("snapkv")
    p = allocation.Pyramid(beta=4.0)
    base = jnp.full((L, B, H), T_UNIFORM, jnp.int32)
    t = np.asarray(p(design, _caches(), base))
    r = p.ratios(L)  # [1.75, 0.25]
    np.testing.assert_array_equal(t[0], math.floor(r[0] * T_UNIFORM))  # 21
    np.testing.assert_array_equal(t[1], math.floor(r[1] * T_UNIFORM))  # 3
    self.assertEqual(p.max_target(T_UNIFORM, H, L), 21)
    self.assertEqual(allocation.Pyramid(beta=4.0, within=allocation.AdaKV()).max_target(
        T_UNIFORM, H, L), allocation.AdaKV().max_target(21, H, L))
    self.assertTrue(allocation.Pyramid(within=allocation.CertificateTargeted()).needs_gains)
    self.assertFalse(allocation.Pyramid(within=allocation.AdaKV()).needs_gains)

  def test_a_first_layer_past_the_tokens_seen_falls_back_to_uniform(self):
    # At a target of 30 of the 48 tokens seen, beta 4's first layer would get
    # floor(1.75 * 30) = 52 > 48: as kvpress's PyramidKV, the row keeps uniform targets
    # (before, the first layer kept its 48 and the layers' total fell short).
    p = allocation.Pyramid(beta=4.0)
    base = jnp.full((L, B, H), T_UNIFORM, jnp.int32).at[:, 1].set(30)  # row 1 only
    t = np.asarray(p(_design("snapkv"), _caches(), base))
    np.testing.assert_array_equal(t[:, 0], [[21] * H, [3] * H])  # row 0: the schedule
    np.testing.assert_array_equal(t[:, 1], 30)


class GainsTest(absltest.TestCase):

  def test_kv_head_gains_numpy(self):
    rng = np.random.default_rng(4)
    n_layers, n_heads, n_kv, hd, hidden = 2, 6, 2, 4, 10
    w_o = rng.normal(size=(n_layers, n_heads * hd, hidden)).astype(np.float32)
    g = np.asarray(allocation.kv_head_gains(jnp.asarray(w_o), n_heads, n_kv, hd))
    want = np.zeros((n_layers, n_kv))
    for layer, h in itertools.product(range(n_layers), range(n_heads)):
      block = w_o[layer, h * hd:(h + 1) * hd].astype(np.float64)
      want[layer, h // (n_heads // n_kv)] += (block**2).sum() / hd  # squared RMS gain
    np.testing.assert_allclose(g, want, rtol=1e-5)
    with self.assertRaisesRegex(ValueError, "n_kv_heads"):
      allocation.kv_head_gains(jnp.asarray(w_o), n_heads, 4, hd)


# --------------------------------------------------------------------------- bad input


class BadInputTest(absltest.TestCase):

  def test_certificate_targeted_needs(self):
    cs = _caches()
    base = jnp.full((L, B, H), T_UNIFORM, jnp.int32)
    alloc = allocation.CertificateTargeted()
    with self.assertRaisesRegex(ValueError, "design 'snapkv' is deterministic"):
      alloc(_design("snapkv"), cs, base, GAINS)
    with self.assertRaisesRegex(ValueError, "observation_window"):
      alloc(registry.make("priority_tail", FRACTION), cs, base, GAINS)
    with self.assertRaisesRegex(ValueError, "needs gains"):
      alloc(_design("priority_tail"), cs, base, None)
    with self.assertRaisesRegex(ValueError, r"gains must be \[n_layers=2, n_kv_heads=4\]"):
      alloc(_design("priority_tail"), cs, base, jnp.ones((H, L)))
    # The same through eviction.evict (raised while tracing, before any work).
    with self.assertRaisesRegex(ValueError, "needs gains"):
      eviction.evict(_design("priority_tail"), caches_lib.Caches(cs), jax.random.PRNGKey(0),
                     allocation=alloc)
    with self.assertRaisesRegex(ValueError, "observation_window"):
      allocation.TargetRadius()(registry.make("poisson_tail", FRACTION), cs, base, GAINS)

  def test_constructor_arguments(self):
    for a in (-0.1, 1.5, True, "0.2"):
      with self.assertRaisesRegex(ValueError, "alpha_safeguard"):
        allocation.AdaKV(alpha_safeguard=a)
    for s in ("head", "Layer", None):
      with self.assertRaisesRegex(ValueError, "scope"):
        allocation.CertificateTargeted(scope=s)
    for m in (-0.1, 1.5, True):
      with self.assertRaisesRegex(ValueError, r"min_share must be a number in \[0, 1\]"):
        allocation.CertificateTargeted(min_share=m)
    with self.assertRaisesRegex(ValueError, "steps"):
      allocation.CertificateTargeted(steps=0)
    for m in (0.5, math.inf):  # inf: before, an OverflowError in max_target
      with self.assertRaisesRegex(ValueError, "max_share must be a finite number"):
        allocation.CertificateTargeted(max_share=m)
    with self.assertRaisesRegex(ValueError, "radius"):
      allocation.TargetRadius(radius=0.0)
    with self.assertRaisesRegex(ValueError, "delta"):
      allocation.TargetRadius(delta=1.0)
    with self.assertRaisesRegex(ValueError, "beta"):
      allocation.Pyramid(beta=1.0)
    # within must keep each layer's total (before, these erased the schedule or failed late)
    for w in (allocation.CertificateTargeted(scope="model"), allocation.TargetRadius(), "adakv"):
      with self.assertRaisesRegex(ValueError, "within must be None, AdaKV"):
        allocation.Pyramid(within=w)

  def test_gains_must_be_finite_and_nonnegative(self):
    base = jnp.full((L, B, H), T_UNIFORM, jnp.int32)
    for bad in (np.nan, np.inf, -1.0):
      gains = GAINS.at[0, 1].set(bad)
      with self.assertRaisesRegex(ValueError, "gains must be finite and >= 0"):
        allocation.CertificateTargeted()(_design("priority_tail"), _caches(), base, gains)


# --------------------------------------------------------------------------- capacity


STREAM = budgets.Lengths(n_context=96, chunk=16)
STREAM_L, STREAM_H, STREAM_D = 2, 2, 8


def _stream(design, alloc, gains):
  """Streams STREAM.n_context random tokens chunk by chunk through caches
  sized by ``budgets.capacity(allocation=...)``: append, fold the chunk's
  window attention, evict with the allocation. Returns (caches, capacity,
  largest kept count of a head after any eviction)."""
  spec = caches_lib.CacheSpec(n_layers=STREAM_L, n_kv_heads=STREAM_H, head_dim=STREAM_D)
  cap = budgets.capacity(design, STREAM, allocation=alloc, config=spec)
  chunk = STREAM.chunk
  rng = np.random.default_rng(5)

  @jax.jit
  def step(cs, k, v, logits, key):
    cs = jax.vmap(over_heads(cache_lib.append))(cs, k, v)
    probs = jax.nn.softmax(jnp.where(cs.valid[..., None, :], logits, -jnp.inf), -1)
    cs = jax.vmap(over_heads(lambda c, p: design.update(c, design.init(c), p,
                                                        observation=True)[0]))(cs, probs)
    cs = eviction.evict(design, caches_lib.Caches(cs), key, allocation=alloc,
                        gains=gains).caches.as_kvcache()
    return cs, jnp.max(jnp.sum(cs.valid, -1))

  cs = caches_lib.init_caches(spec, 1, cap).as_kvcache()
  most = 0
  for i in range(STREAM.n_context // chunk):
    shape = (STREAM_L, 1, STREAM_H, chunk, STREAM_D)
    k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    logits = jnp.asarray(3.0 * rng.normal(size=(STREAM_L, 1, STREAM_H, 4, cap)), jnp.float32)
    cs, kept = step(cs, k, v, logits, jax.random.PRNGKey(i))
    most = max(most, int(kept))
  return cs, cap, most


class CapacityTest(absltest.TestCase):

  def _check(self, design, alloc, gains=None):
    cs, cap, most = _stream(design, alloc, gains)
    np.testing.assert_array_equal(np.asarray(cs.n_dropped), 0)  # never a dropped token
    self.assertEqual(int(np.asarray(cs.n_seen).min()), STREAM.n_context)
    # The allocation did need the room: without it, the largest kept head
    # plus the next chunk would not have fit.
    plain = budgets.capacity(design, STREAM)
    self.assertLess(plain, cap)
    self.assertGreater(most + STREAM.chunk, plain, (most, plain, cap))
    return cap

  def test_adakv(self):
    cap = self._check(_design("snapkv"), allocation.AdaKV())
    # floor(0.25 * 96) = 24 per head; one of 2 heads can take 2 * 24 - 4 = 44.
    self.assertEqual(cap, 44 + STREAM.chunk)

  @pytest.mark.slow  # a streamed compile of the variance grid
  def test_certificate_targeted_model(self):
    # GQA with 2 query heads per KV head; the query heads' output projections
    # are scaled so that the KV heads' gains differ 100-fold.
    rng = np.random.default_rng(6)
    scale = np.repeat([3.0, 3.0, 0.3, 0.3], STREAM_D)[None, :, None]
    w_o = rng.normal(size=(STREAM_L, 2 * STREAM_H * STREAM_D, 16)) * scale
    gains = allocation.kv_head_gains(jnp.asarray(w_o, jnp.float32), 2 * STREAM_H, STREAM_H,
                                     STREAM_D)
    alloc = allocation.CertificateTargeted(scope="model", steps=4, max_share=1.5)
    cap = self._check(_design("priority_tail"), alloc, gains)
    self.assertEqual(cap, math.ceil(1.5 * 24) + 4 + STREAM.chunk)


# --------------------------------------------------------------------------- memory


class MemoryTest(absltest.TestCase):

  def test_slot_bytes(self):
    # head_dim 64, float32: key + value = 2 * 64 * 4 = 512 bytes.
    self.assertEqual(memory.slot_bytes(None, 64), 512)  # full cache: K and V only
    # snapkv: + pos (4) + valid (1) + obs (4).
    self.assertEqual(memory.slot_bytes(designs.snapkv(0.25), 64), 521)
    # priority_tail (accumulated attention): + pos, valid, acc, log_pi, v_sq.
    self.assertEqual(memory.slot_bytes(designs.priority_tail(0.25), 64), 529)
    # ... + obs when an allocation reads the observation window.
    self.assertEqual(memory.slot_bytes(designs.priority_tail(0.25), 64,
                                       allocation=allocation.CertificateTargeted()), 533)
    self.assertEqual(memory.slot_bytes(designs.priority_tail(0.25), 64,
                                       allocation=allocation.AdaKV()), 529)
    # bfloat16 keys and values, value_dim 32: (64 + 32) * 2 + 5 + 4 (h2o: acc).
    self.assertEqual(memory.slot_bytes(designs.h2o(0.25), 64, 32, jnp.bfloat16), 201)

  def test_token_fraction_and_kept_bytes(self):
    for design in (None, designs.snapkv(0.25), designs.priority_tail(0.25)):
      per_slot = memory.slot_bytes(design, 64)
      for m in (0.1, 0.25, 1.0):
        f = memory.token_fraction(m, design, 64)
        self.assertAlmostEqual(f * per_slot, m * 512, places=9)
    self.assertEqual(float(memory.kept_bytes(10, designs.snapkv(0.25), 64)), 5210.0)
    np.testing.assert_array_equal(memory.kept_bytes(np.array([0, 2]), None, 64), [0, 1024])

  def test_bad_memory(self):
    for m in (0, 1.5, True, -0.1, "0.5"):
      with self.assertRaisesRegex(ValueError, "memory"):
        memory.token_fraction(m, designs.snapkv(0.25), 64)
    with self.assertRaisesRegex(ValueError, "head_dim"):
      memory.slot_bytes(None, 0)


if __name__ == "__main__":
  absltest.main()


@pytest.mark.slow  # compiles two generation loops of the tiny model
class GenerationTest(absltest.TestCase):
  """An allocation through ``models.decode``: capacity sized for it, nothing dropped
  (the certificate-targeted one, which also needs the model's gains; AdaKV goes
  through the same ``evict`` call in PoolTest)."""

  def test_generate_streaming_with_allocations(self):
    params, config, tokens, mask = test_util.tiny_llama_prompts()
    question = np.array([[5, 6], [7, 8]], np.int32)
    for design, alloc in (
        (dataclasses.replace(designs.priority_tail(
            0.5, certain=designs.CertaintySet(n_sink=1, window=1)), observation_window=2),
         allocation.CertificateTargeted()),):
      gen = decode.generate_streaming(
          params, (tokens, mask), (question, np.ones(question.shape, bool)),
          jax.random.PRNGKey(0),
          config=config, gen=decode.GenerationConfig(n_steps=2, design=design, chunk=4,
                                                     allocation=alloc))
      np.testing.assert_array_equal(gen.caches.n_dropped, 0)
      kept = np.asarray(gen.caches.valid.sum(-1))  # [layers, batch, kv heads]
      uniform = decode.generate_streaming(
          params, (tokens, mask), (question, np.ones(question.shape, bool)),
          jax.random.PRNGKey(0),
          config=config, gen=decode.GenerationConfig(n_steps=2, design=design, chunk=4))
      # same total per (layer, row) as the uniform budget (top-k / fixed-size tails)
      np.testing.assert_array_equal(kept.sum(-1),
                                    np.asarray(uniform.caches.valid.sum(-1)).sum(-1))
