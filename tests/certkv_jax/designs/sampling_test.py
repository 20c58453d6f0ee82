"""Eq. 2 inclusion probabilities, the capacity rule and the Poisson draw."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import certkv_jax
from certkv_jax.designs import sampling


def _np_inclusion(score, m, eps):
  """Independent float64 fixed-point iteration of Eq. 2 with redistribution."""
  s = np.asarray(score, np.float64)
  pi = np.zeros_like(s)
  free = np.ones(s.shape, bool)
  m_rem = float(m)
  for _ in range(len(s) + 2):
    c = m_rem / s[free].sum()
    trial = c * s
    cap = free & (trial >= 1.0)
    flo = free & (trial <= eps)
    if not cap.any() and not flo.any():
      pi[free] = trial[free]
      return pi
    # Move capped mass first (as the redistribution of Eq. 2), then re-solve.
    if cap.any():
      pi[cap] = 1.0
      free &= ~cap
      m_rem -= cap.sum()
    else:
      pi[flo] = eps
      free &= ~flo
      m_rem -= eps * flo.sum()
  raise AssertionError("no convergence")


class InclusionTest(parameterized.TestCase):

  @parameterized.parameters((0, 5.0), (1, 20.0), (2, 50.0), (3, 1.5))
  def test_matches_independent_solver(self, seed, m):
    rng = np.random.default_rng(seed)
    score = rng.pareto(1.2, size=128) + 1e-3  # heavy-tailed: several caps
    pi = np.asarray(certkv_jax.inclusion_probabilities(jnp.asarray(score, jnp.float32), m, 1e-4))
    expected = _np_inclusion(score.astype(np.float32), m, 1e-4)
    np.testing.assert_allclose(pi, expected, rtol=2e-5, atol=1e-7)
    self.assertAlmostEqual(pi.sum(), m, delta=2e-5 * m)
    self.assertTrue(((pi >= 1e-4 * (1 - 1e-6)) & (pi <= 1.0)).all())

  def test_clipped_mass_is_redistributed(self):
    score = jnp.array([100.0, 1.0, 1.0, 1.0, 1.0])
    pi = certkv_jax.inclusion_probabilities(score, 2.0, 1e-6)
    # The dominant token is capped at 1 and the other 1.0 is shared equally.
    np.testing.assert_allclose(pi, [1.0, 0.25, 0.25, 0.25, 0.25], rtol=1e-6)

  def test_floor(self):
    score = jnp.array([1.0, 1.0, 1e-9, 0.0])
    pi = certkv_jax.inclusion_probabilities(score, 1.0, 0.01)
    np.testing.assert_allclose(pi, [0.49, 0.49, 0.01, 0.01], rtol=1e-5)

  def test_mask_and_batch(self):
    score = jax.random.exponential(jax.random.PRNGKey(0), (3, 4, 50))
    mask = jax.random.bernoulli(jax.random.PRNGKey(1), 0.6, (3, 4, 50))
    m = jnp.arange(1, 13, dtype=jnp.float32).reshape(3, 4)
    pi = certkv_jax.inclusion_probabilities(score, m, 1e-6, mask)
    np.testing.assert_array_equal(np.asarray(pi)[~np.asarray(mask)], 0.0)
    np.testing.assert_allclose(pi.sum(-1), m, rtol=1e-5)
    one = certkv_jax.inclusion_probabilities(score[1, 2], m[1, 2], 1e-6, mask[1, 2])
    np.testing.assert_allclose(pi[1, 2], one, rtol=1e-6)

  def test_edge_cases(self):
    score = jnp.array([3.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(certkv_jax.inclusion_probabilities(score, 4.0), 1.0)
    # Positive scores cannot carry m = 3: they are capped, zeros share the rest.
    np.testing.assert_allclose(certkv_jax.inclusion_probabilities(score, 3.0),
                               [1.0, 1.0, 0.5, 0.5], rtol=1e-6)

  def test_jit_and_vmap(self):
    score = jax.random.exponential(jax.random.PRNGKey(2), (6, 40))
    eager = certkv_jax.inclusion_probabilities(score, 7.0)
    jitted = jax.jit(lambda s: certkv_jax.inclusion_probabilities(s, 7.0))(score)
    mapped = jax.vmap(lambda s: certkv_jax.inclusion_probabilities(s, 7.0))(score)
    np.testing.assert_allclose(eager, jitted, rtol=1e-6)
    np.testing.assert_allclose(eager, mapped, rtol=1e-6)

  @parameterized.named_parameters(
      ("eps_zero", dict(eps=0.0), "eps must be a float in \\(0, 1\\]"),
      ("eps_big", dict(eps=1.5), "eps must be a float in \\(0, 1\\]"),
      ("m_zero", dict(m=0.0), "m must be in"),
      ("m_negative", dict(m=-2.0), "m must be in"),
      ("m_nan", dict(m=float("nan")), "m must be in"),
      ("score_nan", dict(score=jnp.array([1.0, jnp.nan, 1.0])), "score must be finite"),
      ("score_inf", dict(score=jnp.array([1.0, jnp.inf, 1.0])), "score must be finite"),
      ("score_negative", dict(score=jnp.array([1.0, -1.0, 1.0])), "score must be >= 0"),
      ("mask_shape", dict(mask=jnp.ones(4, bool)), "mask shape"),
      ("below_floor", dict(m=1e-3, eps=0.1), "m must be >= eps \\* n_tail"),
  )
  def test_bad_input(self, overrides, msg):
    kw = dict(score=jnp.array([1.0, 2.0, 3.0]), m=1.0, eps=1e-6, mask=None)
    kw.update(overrides)
    with self.assertRaisesRegex(ValueError, msg):
      certkv_jax.inclusion_probabilities(**kw)


class CapacityTest(parameterized.TestCase):

  @parameterized.parameters(1, 4, 16, 64, 256, 1024)
  def test_expected_count_meets_the_bound(self, slots):
    for p in (1e-2, 1e-3):
      m = float(sampling.expected_tail_count(slots, p))
      self.assertGreater(m, 0.0)
      self.assertLess(m, slots)
      self.assertLessEqual(float(sampling.overflow_bound(m, slots)), p * (1 + 1e-4))
      # Largest such m: 1% more breaks the bound.
      self.assertGreater(float(sampling.overflow_bound(m * 1.01, slots)), p)

  def test_bound_dominates_exact_binomial_tail(self):
    # For equal pi the count is Binomial(n, m/n); its exact tail must be below
    # the Chernoff bound used for the capacity.
    from scipy import stats  # pylint: disable=import-outside-toplevel
    for slots, n in ((16, 100), (64, 300), (128, 1000)):
      m = float(sampling.expected_tail_count(slots, 1e-3))
      exact = stats.binom.sf(slots, n, m / n)
      self.assertLessEqual(exact, float(sampling.overflow_bound(m, slots)))
      self.assertLessEqual(exact, 1e-3)

  def test_empirical_overflow_rate(self):
    # 20,000 draws at overflow_prob = 0.05: the empirical rate must not exceed
    # the bound by more than 4 Monte Carlo standard errors (sd <= 0.0016).
    slots, n = 32, 200
    m = float(sampling.expected_tail_count(slots, 0.05))
    pi = jnp.full((n,), m / n)
    u = jax.random.uniform(jax.random.PRNGKey(0), (20000, n))
    rate = float(jnp.mean(jnp.sum(u < pi, -1) > slots))
    self.assertLessEqual(rate, 0.05 + 4 * math.sqrt(0.05 * 0.95 / 20000))

  def test_bad_overflow_prob(self):
    with self.assertRaisesRegex(ValueError, "overflow_prob"):
      sampling.expected_tail_count(10, 0.0)
    with self.assertRaisesRegex(ValueError, "overflow_prob"):
      sampling.expected_tail_count(10, 1.0)


class DrawTest(absltest.TestCase):

  def test_draw_respects_slots_and_inclusion(self):
    n, slots = 100, 30
    m = float(sampling.expected_tail_count(slots, 1e-3))
    score = jax.random.exponential(jax.random.PRNGKey(0), (n,))
    pi = certkv_jax.inclusion_probabilities(score, m)
    mask = jnp.ones(n, bool)
    draws = jax.vmap(lambda k: sampling.poisson_draw(k, pi, mask, slots))(
        jax.random.split(jax.random.PRNGKey(1), 8000))
    self.assertTrue(bool(jnp.all(jnp.sum(draws.keep, -1) <= slots)))
    self.assertEqual(int(jnp.sum(draws.n_dropped)), 0)
    freq = np.asarray(jnp.mean(draws.keep, 0))
    # Per-token inclusion frequency vs pi: binomial SE, 5 sigma over 100 tokens.
    se = np.sqrt(np.asarray(pi) * (1 - np.asarray(pi)) / 8000) + 1e-9
    self.assertLess(np.max(np.abs(freq - np.asarray(pi)) / se), 5.0)

  def test_overflow_fallback_is_accounted(self):
    pi = jnp.full((50,), 0.9)
    d = sampling.poisson_draw(jax.random.PRNGKey(0), pi, jnp.ones(50, bool), 5, max_redraws=2)
    self.assertEqual(int(jnp.sum(d.keep)), 5)
    self.assertEqual(int(d.n_redraws), 2)
    self.assertGreater(int(d.n_dropped), 0)
    u = jax.random.uniform(jax.random.split(jax.random.PRNGKey(0))[0], (3, 50))
    self.assertEqual(int(d.n_dropped) + 5, int(jnp.sum(u[0] < 0.9)))

  def test_overflow_fallback_is_a_uniform_subset_of_the_first_draw(self):
    # Every draw overflows (pi 0.3 and 0.9 on 60 tokens, 5 slots, no redraw): the
    # fallback keeps 5 of draw 0's tokens, each with chance 5 / |draw 0| whatever its pi.
    # Per group about 2,000 x 5 x (9 or 27) / 36 kept: Monte Carlo sd <= 2% of the
    # expectation, so 8% is 4 sd; ranking by u alone (not u / pi) keeps no 0.3 token.
    pi = jnp.where(jnp.arange(60) < 30, 0.3, 0.9)
    keys = jax.random.split(jax.random.PRNGKey(7), 2000)
    draw = jax.vmap(lambda k: sampling.poisson_draw(k, pi, jnp.ones(60, bool), 5, 0))(keys)
    first = jax.vmap(lambda k: jax.random.uniform(jax.random.split(k)[0], (1, 60))[0] < pi)(
        keys)
    self.assertTrue(bool(jnp.all(draw.n_dropped > 0)))
    self.assertTrue(bool(jnp.all(draw.keep <= first)))
    expect = 5.0 * first / jnp.sum(first, axis=1, keepdims=True)
    for group in (pi == 0.3, pi == 0.9):
      ratio = float(jnp.sum(draw.keep[:, group]) / jnp.sum(expect[:, group]))
      self.assertAlmostEqual(ratio, 1.0, delta=0.08)


if __name__ == "__main__":
  absltest.main()
