"""certkv_jax.certificate.diagnostics: the truths the certificate is judged against, by hand."""

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from certkv_jax.certificate import diagnostics


class DiagnosticsTest(absltest.TestCase):

  def test_full_attention_of_equal_scores_is_the_mean_value(self):
    q = jnp.zeros((1, 2))  # every score 0: uniform attention over the valid keys
    k = jnp.ones((3, 2))
    v = jnp.array([[1., 0.], [0., 1.], [9., 9.]])
    got = diagnostics.full_attention(q, k, v, jnp.array([True, True, False]))
    np.testing.assert_allclose(got, [[0.5, 0.5]], rtol=1e-6)

  def test_attention_error(self):
    err = diagnostics.attention_error(jnp.array([[3., 4.], [1., 1.]]),
                                      jnp.array([[0., 0.], [1., 1.]]))
    np.testing.assert_allclose(err.abs, [5., 0.])
    self.assertEqual(float(err.rel[0]), np.inf)  # ||o|| = 0 with a nonzero error
    self.assertEqual(float(err.rel[1]), 0.0)

  def test_coverage_and_sharpness(self):
    errors, radii = [1., 2., 4., 0.], [2., 2., 3., 1.]
    self.assertEqual(diagnostics.coverage(errors, radii), 0.75)  # 4 > 3 is missed
    # covered with a positive error: radius / error = 2 and 1; median 1.5.
    self.assertEqual(diagnostics.sharpness(errors, radii), 1.5)
    with self.assertRaisesRegex(ValueError, "must be equal, non-empty shapes"):
      diagnostics.coverage([1.], [1., 2.])


if __name__ == "__main__":
  absltest.main()
