"""The radius, its anytime variant and the aggregation over heads/layers/steps."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax import certificate


class RadiusTest(parameterized.TestCase):

  def test_bernstein_formula(self):
    res = certkv_jax.OffsetAttentionResult(jnp.zeros(3), jnp.zeros(()), jnp.asarray(0.04),
                                           jnp.asarray(0.1))
    lg = math.log(2 / 0.05)
    expected = math.sqrt(2 * 0.04 * lg) + 2 / 3 * 0.1 * lg
    self.assertAlmostEqual(float(certkv_jax.certificate_radius(res, 0.05)), expected, places=6)
    self.assertAlmostEqual(float(certkv_jax.certificate_radius(res, 0.05, form="chebyshev")),
                           math.sqrt(0.04 / 0.05), places=6)

  def test_radius_decreases_in_delta(self):
    r = certificate.radius_from_stats(0.1, 0.05, jnp.array([0.01, 0.05, 0.1, 0.2]))
    self.assertTrue(bool(jnp.all(jnp.diff(r) < 0)))

  @parameterized.parameters(0.0, 1.0, -0.1, 1.5, float("nan"))
  def test_bad_delta(self, delta):
    with self.assertRaisesRegex(ValueError, "delta"):
      certificate.radius_from_stats(0.1, 0.1, delta)

  def test_a_delta_below_float32s_smallest_normal_raises(self):
    # It passed the (0, 1) check and became 0 in float32: NaN where the radius is 0.
    self.assertEqual(float(certificate.radius_from_stats(0.0, 0.0, 1e-30)), 0.0)
    for delta in (1e-39, 1e-300, jnp.array([0.05, 1e-40])):
      with self.assertRaisesRegex(ValueError, "delta must be at least 1.17"):
        certificate.radius_from_stats(0.0, 0.0, delta)

  def test_bad_delta_array_and_form(self):
    with self.assertRaisesRegex(ValueError, "delta"):
      certificate.radius_from_stats(0.1, 0.1, jnp.array([0.1, 0.0]))
    with self.assertRaisesRegex(ValueError, "form"):
      certificate.radius_from_stats(0.1, 0.1, 0.1, form="hoeffding")

  @pytest.mark.slow  # 34 s cold on the 2-core CI machine (2026-12-01)
  def test_vmap_over_layers_and_heads(self):
    layers, heads, n, d = 3, 4, 32, 8
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(ks[0], (layers, heads, d))
    k = jax.random.normal(ks[1], (layers, heads, n, d))
    v = jax.random.normal(ks[2], (layers, heads, n, d))
    log_pi = -jax.random.exponential(ks[3], (layers, heads, n))
    mask = jax.random.bernoulli(ks[4], 0.7, (layers, heads, n))

    def certify(q, k, v, lp, m):
      return certkv_jax.certificate_radius(certkv_jax.offset_attention(q, k, v, lp, m), 0.05)

    mapped = jax.jit(jax.vmap(jax.vmap(certify)))(q, k, v, log_pi, mask)
    chex.assert_shape(mapped, (layers, heads))
    direct = certify(q, k, v, log_pi, mask)
    np.testing.assert_allclose(mapped, direct, rtol=1e-5)


class SmoothedVarianceTest(parameterized.TestCase):

  def _numpy(self, v, window):
    out = np.empty_like(v)
    for t in range(v.shape[1]):
      out[:, t] = np.maximum(v[:, t], v[:, max(0, t - window + 1):t + 1].mean(axis=1))
    return out

  @parameterized.parameters(1, 3, 6, 40)
  def test_matches_numpy_along_axis(self, window):
    v = np.random.default_rng(0).exponential(size=(2, 17, 3)).astype(np.float32)
    got = certificate.smoothed_variance(v, window, axis=1)
    np.testing.assert_allclose(got, self._numpy(v, window), rtol=1e-6)
    self.assertTrue(np.all(np.asarray(got) >= v))
    if window == 1:
      np.testing.assert_array_equal(got, v)

  def test_window_state_matches_the_whole_axis(self):
    v = jnp.asarray(np.random.default_rng(1).exponential(size=(9, 2, 4)), jnp.float32)
    whole = certificate.smoothed_variance(v, 4)

    def step(state, x):
      out, state = state.update(x)
      return state, out

    _, stepped = jax.lax.scan(step, certificate.VarianceWindow.init((2, 4), 4), v)
    np.testing.assert_allclose(stepped, whole, rtol=1e-6)

  def test_nan_stays_in_its_windows(self):
    v = np.ones((10,), np.float32)
    v[3] = np.nan
    got = np.asarray(certificate.smoothed_variance(v, 3))
    np.testing.assert_array_equal(np.isnan(got), np.isin(np.arange(10), [3, 4, 5]))

  def test_smoothed_radius(self):
    v = jnp.asarray([0.0, 4.0, 0.0], jnp.float32)
    b = jnp.asarray([0.1, 0.1, 0.1], jnp.float32)
    np.testing.assert_allclose(certificate.smoothed_radius(v, b, 0.05, 2),
                               certificate.radius_from_stats(jnp.asarray([0.0, 4.0, 2.0]), b,
                                                             0.05), rtol=1e-6)

  @parameterized.parameters(0, -1, 1.5, True)
  def test_bad_window(self, window):
    with self.assertRaisesRegex(ValueError, "window must be an int >= 1"):
      certificate.smoothed_variance(jnp.ones(3), window)
    with self.assertRaisesRegex(ValueError, "window must be an int >= 1"):
      certificate.VarianceWindow.init((3,), window)

  def test_bad_state_shape(self):
    with self.assertRaisesRegex(ValueError, r"var_hat must have shape \(3,\)"):
      certificate.VarianceWindow.init((3,), 4).update(jnp.ones(4))


class AnytimeTest(absltest.TestCase):

  def test_union_bound(self):
    t = jnp.arange(1, 100001)
    d = certkv_jax.anytime_delta(0.05, t)
    self.assertLessEqual(float(np.sum(np.asarray(d, np.float64))), 0.05 * (1 + 1e-5))
    self.assertAlmostEqual(float(d[0]), 0.025)
    with self.assertRaisesRegex(ValueError, "step"):
      certkv_jax.anytime_delta(0.05, jnp.array([0, 1]))

  def test_anytime_radius_is_wider(self):
    r1 = certificate.radius_from_stats(0.1, 0.01, 0.05)
    r10 = certificate.radius_from_stats(0.1, 0.01, certkv_jax.anytime_delta(0.05, 10))
    self.assertGreater(float(r10), float(r1))


class AggregationTest(absltest.TestCase):

  def test_sum_and_max_with_mask(self):
    r = jnp.arange(12.0).reshape(3, 4)
    mask = r % 2 == 0
    self.assertEqual(float(certificate.aggregate(r)), 66.0)
    np.testing.assert_allclose(certificate.aggregate(r, axis=1, how="max"), [3, 7, 11])
    self.assertEqual(float(certificate.aggregate(r, mask=mask)), 30.0)
    with self.assertRaisesRegex(ValueError, "how"):
      certificate.aggregate(r, how="mean")
    with self.assertRaisesRegex(ValueError, "mask shape"):
      certificate.aggregate(r, mask=mask[0])

  def test_moving_window_matches_numpy(self):
    x = np.random.default_rng(0).normal(size=(20, 3))
    for how, fn in (("mean", np.mean), ("sum", np.sum), ("max", np.max)):
      got = np.asarray(certificate.moving_window(x, 6, how))
      expected = np.stack([fn(x[max(0, t - 5):t + 1], axis=0) for t in range(20)])
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    with self.assertRaisesRegex(ValueError, "window"):
      certificate.moving_window(x, 0)

  def test_subsampling_is_unbiased(self):
    # Horvitz-Thompson over 4,000 random subsets of 6 of 24 (layer, head) pairs:
    # the mean estimate is within 4 Monte Carlo standard errors of the full sum.
    radii = jnp.asarray(np.random.default_rng(1).gamma(2.0, size=(4, 6)), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    est = jax.vmap(lambda k: certificate.subsampled_sum(
        radii, certificate.subsample_mask(k, radii.shape, 6)))(keys)
    masks = jax.vmap(lambda k: certificate.subsample_mask(k, radii.shape, 6))(keys[:5])
    np.testing.assert_array_equal(np.sum(np.asarray(masks), axis=(1, 2)), 6)
    se = float(jnp.std(est)) / math.sqrt(4000)
    self.assertLess(abs(float(jnp.mean(est)) - float(jnp.sum(radii))), 4 * se)
    with self.assertRaisesRegex(ValueError, "n_keep"):
      certificate.subsample_mask(keys[0], (2, 2), 5)


if __name__ == "__main__":
  absltest.main()
