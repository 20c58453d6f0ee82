"""Split-conformal scaling of the radius (certkv_jax.calibration).

Synthetic law used throughout: per group g, ``error = radius * |Z|`` with
``Z ~ N(0, sigma_g^2)``, so the score ``error / radius = |Z|`` is half-normal
with CDF ``F_g(q) = erf(q / (sigma_g sqrt 2))``, independent of the radius.
"""

from fractions import Fraction
import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import calibration

_ERF = np.vectorize(math.erf)


def _half_normal_cdf(q, sigma):
  return _ERF(np.asarray(q, np.float64) / (sigma * math.sqrt(2.0)))


def _brute_force_quantile(scores, delta):
  """Smallest c among the scores with #{s <= c} >= (n + 1)(1 - delta), exactly
  (delta read as its decimal string); +inf if none."""
  need = (len(scores) + 1) * (1 - Fraction(str(delta)))
  for c in sorted(scores):
    if sum(1 for s in scores if s <= c) >= need:
      return c
  return math.inf


def _synthetic(rng, sigmas, n_per_group):
  """errors, radii, groups [len(sigmas) * n_per_group] from the half-normal law."""
  groups = np.repeat(np.arange(len(sigmas)), n_per_group)
  radii = rng.lognormal(0.0, 1.0, groups.size)
  errors = radii * np.abs(rng.normal(0.0, 1.0, groups.size)) * np.asarray(sigmas)[groups]
  return errors, radii, groups


class ConformalQuantileTest(parameterized.TestCase):

  @parameterized.product(seed=[0, 1, 2], delta=[0.05, 0.1, 0.2, 0.3, 0.5],
                         n=[0, 1, 3, 9, 19, 20, 37])
  def test_matches_brute_force_rank(self, seed, delta, n):
    rng = np.random.default_rng(seed)
    # Rounded to one decimal so that ties occur; one +inf score when n > 3.
    scores = list(np.round(rng.exponential(1.0, n), 1))
    if n > 3:
      scores[0] = math.inf
    self.assertEqual(calibration.conformal_quantile(np.asarray(scores), delta),
                     _brute_force_quantile(scores, delta))

  def test_known_values(self):
    scores = np.arange(1.0, 20.0)  # 1..19
    # n = 19, delta = 0.05: rank ceil(20 * 0.95) = 19 -> the largest score.
    self.assertEqual(calibration.conformal_quantile(scores, 0.05), 19.0)
    # n = 18: rank ceil(19 * 0.95) = 19 > 18 -> +inf.
    self.assertEqual(calibration.conformal_quantile(scores[:18], 0.05), math.inf)
    # n = 19, delta = 0.3: rank ceil(20 * 0.7) = 14 exactly (0.3 is not exact in binary).
    self.assertEqual(calibration.conformal_rank(19, 0.3), 14)
    self.assertEqual(calibration.conformal_quantile(scores, 0.3), 14.0)
    self.assertEqual(calibration.conformal_quantile([], 0.5), math.inf)

  @parameterized.parameters((0.05, 19), (0.1, 9), (0.3, 3), (0.5, 1), (0.04, 24), (0.9, 1))
  def test_min_finite_calls(self, delta, expected):
    n = calibration.min_finite_calls(delta)
    self.assertEqual(n, expected)
    self.assertLessEqual(calibration.conformal_rank(n, delta), n)
    if n > 1:
      self.assertGreater(calibration.conformal_rank(n - 1, delta), n - 1)

  @parameterized.parameters(0.0, 1.0, -0.1, 1.5, float("nan"), float("inf"), True)
  def test_bad_delta(self, delta):
    with self.assertRaisesRegex(ValueError, r"delta must be a float in \(0, 1\)"):
      calibration.conformal_quantile([1.0, 2.0], delta)
    with self.assertRaisesRegex(ValueError, "delta"):
      calibration.fit_scales([1.0], [1.0], [0], 1, delta)

  def test_bad_scores(self):
    with self.assertRaisesRegex(ValueError, "scores .*NaN"):
      calibration.conformal_quantile([1.0, float("nan")], 0.1)
    with self.assertRaisesRegex(ValueError, "scores"):
      calibration.conformal_quantile([1.0, -0.5], 0.1)
    with self.assertRaisesRegex(ValueError, "scores must be 1-D"):
      calibration.conformal_quantile(np.ones((2, 2)), 0.1)


class FitScalesTest(parameterized.TestCase):

  SIGMAS = (0.5, 1.0, 2.0)

  @parameterized.parameters((0.05, 1999, 0), (0.1, 999, 1))
  def test_held_out_coverage_within_bounds_and_has_power(self, delta, n_cal, seed):
    rng = np.random.default_rng(seed)
    fitted = calibration.fit_scales(*_synthetic(rng, self.SIGMAS, n_cal), len(self.SIGMAS),
                                    delta)
    np.testing.assert_array_equal(fitted.n_calls, [n_cal] * 3)
    self.assertFalse(fitted.fell_back.any())
    n_test = 20000
    e_t, r_t, g_t = _synthetic(rng, self.SIGMAS, n_test)  # fresh, independent sample
    lo, hi = 1 - delta, 1 - delta + 1 / (n_cal + 1)
    # Monte Carlo error of a held-out coverage, two independent parts:
    # (a) the calibration draw: given the scale q, the coverage is F(q), and
    #     F(q) ~ Beta(k, n + 1 - k), k = ceil((n+1)(1-delta)); its SD is
    #     sqrt(k (n+1-k) / ((n+1)^2 (n+2))) = 0.0049 (delta 0.05, n 1999) /
    #     0.0095 (delta 0.1, n 999). This part is NOT the binomial SE, and
    #     ignoring it would make the test flaky.
    # (b) the test sample: binomial SE sqrt(c (1-c) / n_test) = 0.0015 / 0.0021.
    # Per group we allow 4 combined SE (two-sided miss chance 6e-5 per check);
    # the pooled coverage averages 3 independent groups (SE / sqrt 3).
    k = calibration.conformal_rank(n_cal, delta)
    sd_cal = math.sqrt(k * (n_cal + 1 - k) / ((n_cal + 1) ** 2 * (n_cal + 2)))
    sd_test = math.sqrt(lo * delta / n_test)
    se = math.sqrt(sd_cal ** 2 + sd_test ** 2)

    def within(scales, per_group_se, pooled_se):
      radii = calibration.apply_scales(r_t, g_t, scales)
      cov = [float(np.mean(e_t[g_t == g] <= np.asarray(radii)[g_t == g])) for g in range(3)]
      ok = all(lo - 4 * per_group_se <= c <= hi + 4 * per_group_se for c in cov)
      pooled = float(np.mean(e_t <= np.asarray(radii)))
      return ok and lo - 4 * pooled_se <= pooled <= hi + 4 * pooled_se, cov

    ok, cov = within(fitted.scales, se, se / math.sqrt(3))
    self.assertTrue(ok, f"coverage {cov} not in [{lo}, {hi}] +- 4 SE ({se:.4f})")
    # Power: the same check fails for a scale 20% too small or 25% too large
    # (0.8 q: half-normal coverage ~0.88 at delta 0.05, > 10 SE below; 1.25 q:
    # ~0.986, > 6 SE above).
    for factor in (0.8, 1.25):
      bad_ok, bad_cov = within(factor * fitted.scales, se, se / math.sqrt(3))
      self.assertFalse(bad_ok, f"x{factor} scale passed with coverage {bad_cov}")

  @parameterized.parameters((22, 0.1), (19, 0.05), (50, 0.2))
  def test_expected_coverage_is_exact(self, n_cal, delta):
    # Over R independent calibration draws, the mean of the exact conditional
    # coverage F(q) is k / (n+1) for continuous scores. Its MC SE is the Beta
    # SD / sqrt(R): 0.0575 / sqrt(4000) = 0.0009 for (22, 0.1). We allow 4 SE,
    # while k / (n + 1) - (1 - delta) = 0.013 there, so the test distinguishes
    # the exact value from the nominal level.
    reps, sigma = 4000, 1.7
    rng = np.random.default_rng(123)
    k = calibration.conformal_rank(n_cal, delta)
    exact = k / (n_cal + 1)
    cover = np.empty(reps)
    for i in range(reps):
      errors, radii, groups = _synthetic(rng, (sigma,), n_cal)
      q = calibration.fit_scales(errors, radii, groups, 1, delta).scales[0]
      cover[i] = _half_normal_cdf(q, sigma)
    se = math.sqrt(k * (n_cal + 1 - k) / ((n_cal + 1) ** 2 * (n_cal + 2)) / reps)
    self.assertAlmostEqual(float(cover.mean()), exact, delta=4 * se)
    self.assertGreaterEqual(exact, 1 - delta)
    self.assertLessEqual(exact, 1 - delta + 1 / (n_cal + 1))

  def test_scales_equal_group_quantiles(self):
    rng = np.random.default_rng(7)
    errors, radii, groups = _synthetic(rng, self.SIGMAS, 40)
    fitted = calibration.fit_scales(errors, radii, groups, 3, 0.1)
    scores = errors / radii
    for g in range(3):
      self.assertEqual(fitted.scales[g], calibration.conformal_quantile(scores[groups == g], 0.1))
    self.assertEqual(fitted.pooled, calibration.conformal_quantile(scores, 0.1))
    self.assertEqual(fitted.delta, 0.1)
    self.assertEqual(fitted.scales.dtype, np.float64)

  def test_fallback_to_layer_then_pooled(self):
    # 2 layers x 2 heads, group = layer * 2 + head. delta 0.1 -> min_calls 9.
    rng = np.random.default_rng(3)
    counts = {0: 30, 1: 30, 2: 30, 3: 4}  # group 3 too small, its layer (1) is not
    groups = np.concatenate([np.full(c, g) for g, c in counts.items()])
    radii = rng.lognormal(size=groups.size)
    errors = radii * rng.exponential(1.0 + groups)
    scores = errors / radii
    layer_of = {0: 0, 1: 0, 2: 1, 3: 1}
    fitted = calibration.fit_scales(errors, radii, groups, 4, 0.1, fallback_groups=layer_of)
    np.testing.assert_array_equal(fitted.fell_back, [False, False, False, True])
    np.testing.assert_array_equal(fitted.n_calls, [30, 30, 30, 4])
    layer1 = calibration.conformal_quantile(scores[groups >= 2], 0.1)
    self.assertEqual(fitted.scales[3], layer1)
    self.assertEqual(fitted.scales[2], calibration.conformal_quantile(scores[groups == 2], 0.1))
    # The same mapping as a sequence.
    seq = calibration.fit_scales(errors, radii, groups, 4, 0.1, fallback_groups=[0, 0, 1, 1])
    np.testing.assert_array_equal(seq.scales, fitted.scales)
    # Without a mapping: the pooled quantile.
    pooled = calibration.fit_scales(errors, radii, groups, 4, 0.1)
    self.assertEqual(pooled.scales[3], pooled.pooled)
    # min_calls 40: every group falls back; layer 0 (60 calls) gives its own
    # quantile, layer 1 (34 calls) is too small as a whole -> pooled.
    big = calibration.fit_scales(errors, radii, groups, 4, 0.1, fallback_groups=layer_of,
                                 min_calls=40)
    self.assertTrue(big.fell_back.all())
    layer0 = calibration.conformal_quantile(scores[groups <= 1], 0.1)
    np.testing.assert_array_equal(big.scales, [layer0, layer0, big.pooled, big.pooled])
    self.assertNotEqual(layer0, big.pooled)
    # A group with no calls at all (n_groups 5) falls back and counts 0.
    five = calibration.fit_scales(errors, radii, groups, 5, 0.1)
    self.assertEqual(five.n_calls[4], 0)
    self.assertTrue(five.fell_back[4])
    self.assertEqual(five.scales[4], five.pooled)

  def test_radius_zero(self):
    scores = calibration.conformity_scores([0.0, 0.5, 1.0], [0.0, 0.0, 2.0])
    np.testing.assert_array_equal(scores, [0.0, np.inf, 0.5])
    # All calls r = 0 = e: scale 0, and a calibrated r = 0 still covers e = 0.
    z = calibration.fit_scales(np.zeros(20), np.zeros(20), np.zeros(20, int), 1, 0.1)
    self.assertEqual(z.scales[0], 0.0)
    self.assertEqual(float(calibration.apply_scales(0.0, 0, z.scales)), 0.0)
    # Many r = 0 < e calls in a group: the quantile is +inf, and so is every
    # calibrated radius of the group, including r = 0 (never inf * 0 = NaN).
    e = np.r_[np.ones(5), np.full(15, 0.1)]
    r = np.r_[np.zeros(5), np.ones(15)]
    inf = calibration.fit_scales(e, r, np.zeros(20, int), 1, 0.1)
    self.assertEqual(inf.scales[0], math.inf)
    np.testing.assert_array_equal(calibration.apply_scales(jnp.array([0.0, 1.0]),
                                                           jnp.array([0, 0]), inf.scales),
                                  [np.inf, np.inf])

  def test_bad_inputs_name_the_argument(self):
    ok = dict(errors=[0.1, 0.2], radii=[1.0, 1.0], groups=[0, 1], n_groups=2, delta=0.1)
    cases = [
        (dict(errors=[0.1, float("nan")]), "errors"),
        (dict(errors=[-0.1, 0.2]), "errors"),
        (dict(radii=[1.0, -1.0]), "radii"),
        (dict(radii=[1.0, float("inf")]), "radii"),
        (dict(radii=[1.0]), "same length"),
        (dict(groups=[0]), "groups must have one entry per call"),
        (dict(groups=[0, 2]), r"groups must be integers in \[0, n_groups=2\)"),
        (dict(groups=[0, -1]), "groups"),
        (dict(groups=[0.0, 1.0]), "groups must be integers"),
        (dict(n_groups=0), "n_groups"),
    ]
    for change, pattern in cases:
      with self.subTest(change=change), self.assertRaisesRegex(ValueError, pattern):
        calibration.fit_scales(**{**ok, **change})
    with self.assertRaisesRegex(ValueError, "min_calls"):
      calibration.fit_scales(**ok, min_calls=0)
    with self.assertRaisesRegex(ValueError, "fallback_groups must map every group"):
      calibration.fit_scales(**ok, fallback_groups={0: 0})
    with self.assertRaisesRegex(ValueError, "fallback_groups"):
      calibration.fit_scales(**ok, fallback_groups=[0, 0, 1])
    with self.assertRaisesRegex(ValueError, "fallback_groups values"):
      calibration.fit_scales(**ok, fallback_groups=[0.5, 0.0])


class ApplyScalesTest(parameterized.TestCase):

  def test_values_and_jit(self):
    scales = np.array([0.5, 2.0, 3.0])
    radii = jnp.arange(6.0).reshape(2, 3)
    groups = jnp.array([[0, 1, 2], [2, 1, 0]])
    want = np.asarray(radii) * scales[np.asarray(groups)]
    np.testing.assert_allclose(calibration.apply_scales(radii, groups, scales), want)
    jitted = jax.jit(calibration.apply_scales)(radii, groups, scales)
    np.testing.assert_allclose(jitted, want)
    # Broadcasting: one group row for a batch of radii.
    out = calibration.apply_scales(jnp.ones((4, 3)), jnp.array([0, 1, 2]), scales)
    self.assertEqual(out.shape, (4, 3))

  def test_out_of_range_group_is_never_clipped(self):
    scales = jnp.array([1.0, 2.0])
    with self.assertRaisesRegex(ValueError, r"groups must be in \[0, n_groups=2\)"):
      calibration.apply_scales(jnp.ones(2), jnp.array([0, 2]), scales)
    # Traced groups cannot raise: NaN marks the bad entry.
    out = jax.jit(calibration.apply_scales)(jnp.ones(2), jnp.array([0, 2]), scales)
    self.assertEqual(float(out[0]), 1.0)
    self.assertTrue(bool(jnp.isnan(out[1])))
    # A negative group is not wrapped to the last one, and an infinite radius does not
    # turn a bad group's NaN into +inf.
    out = jax.jit(calibration.apply_scales)(jnp.array([1.0, jnp.inf, 1.0]),
                                            jnp.array([-1, 5, 1]), scales)
    np.testing.assert_array_equal(np.isnan(out), [True, True, False])
    self.assertEqual(float(out[2]), 2.0)

  def test_bad_inputs(self):
    with self.assertRaisesRegex(ValueError, "scales must be 1-D"):
      calibration.apply_scales(1.0, 0, jnp.ones((1, 1)))
    with self.assertRaisesRegex(ValueError, "scales"):
      calibration.apply_scales(1.0, 0, jnp.array([float("nan")]))
    with self.assertRaisesRegex(ValueError, "radii"):
      calibration.apply_scales(-1.0, 0, jnp.array([1.0]))
    with self.assertRaisesRegex(ValueError, "groups must be integers"):
      calibration.apply_scales(1.0, 0.0, jnp.array([1.0]))
    with self.assertRaisesRegex(ValueError, "must broadcast"):
      calibration.apply_scales(jnp.ones(3), jnp.zeros(2, int), jnp.array([1.0]))


class CoverageSharpnessTest(absltest.TestCase):

  def test_values(self):
    errors = np.array([0.0, 1.0, 2.0, 4.0])
    radii = np.array([1.0, 3.0, 3.0, 2.0])
    cov, sharp = calibration.coverage_and_sharpness(errors, radii)
    self.assertEqual(cov, 0.75)
    self.assertEqual(sharp, 2.25)  # median of r/e over covered e > 0: (3, 1.5)
    _, none = calibration.coverage_and_sharpness([1.0], [0.5])
    self.assertTrue(math.isnan(none))
    with self.assertRaisesRegex(ValueError, "errors .* radii"):
      calibration.coverage_and_sharpness([1.0, 2.0], [1.0])


if __name__ == "__main__":
  absltest.main()
