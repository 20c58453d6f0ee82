"""certkv_jax.designs.scores on a 4-slot cache worked by hand: three tokens, one free slot."""

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from certkv_jax.designs import scores
from certkv_jax.kv import cache as cache_lib


def _cache():
  # keys with norms 5, 1, 1; values with norms 1, 2, 0; slot 3 free.
  c = cache_lib.init_cache(capacity=4, head_dim=2)
  c = cache_lib.append(c, jnp.array([[3., 4.], [0., 1.], [1., 0.]]),
                       jnp.array([[1., 0.], [0., 2.], [0., 0.]]))
  return c._replace(acc=jnp.array([0.5, 0.1, 0.3, 0.]), last=jnp.array([0.2, 0.7, 0.1, 0.]),
                    obs=jnp.array([0.3, 0.6, 0.9, 0.]))


class ScoresTest(absltest.TestCase):

  def test_statistics_scores_read_their_field(self):
    c = _cache()
    np.testing.assert_allclose(scores.AccumulatedAttention()(c), [0.5, 0.1, 0.3, 0.])
    np.testing.assert_allclose(scores.CurrentAttention()(c), [0.2, 0.7, 0.1, 0.])
    np.testing.assert_allclose(scores.WindowAttention()(c), [0.3, 0.6, 0.9, 0.])

  def test_position_and_norm_scores(self):
    c = _cache()
    np.testing.assert_allclose(scores.Recency()(c)[:3], [0., 1., 2.])
    np.testing.assert_allclose(scores.KeyNorm()(c), [-5., -1., -1., 0.])
    np.testing.assert_allclose(scores.Uniform()(c), [1., 1., 1., 1.])

  def test_value_aware_multiplies_by_the_value_norm(self):
    # acc x ||v||: 0.5 x 1, 0.1 x 2, 0.3 x 0.
    np.testing.assert_allclose(scores.ValueAware(scores.AccumulatedAttention())(_cache())[:3],
                               [0.5, 0.2, 0.0], rtol=1e-6)

  def test_window_pooling_counts_zero_padding(self):
    # obs by position 0.3, 0.6, 0.9, pooled over 3 with zero padding: 0.9/3, 1.8/3, 1.5/3.
    got = scores.WindowAttention(pool_size=3)(_cache())
    np.testing.assert_allclose(got[:3], [0.3, 0.6, 0.5], rtol=1e-6)

  def test_defensive_mixture_on_valid_slots(self):
    # (1 - u) acc / 0.9 + u / 3 with u = 0.5: 0.4444, 0.2222, 0.3333; the free slot 0.
    got = scores.Defensive(scores.AccumulatedAttention(), 0.5)(_cache())
    np.testing.assert_allclose(got, [4 / 9, 2 / 9, 1 / 3, 0.], rtol=1e-5)

  def test_reads(self):
    self.assertEqual(scores.reads_of(scores.ValueAware(scores.AccumulatedAttention())),
                     {"acc", "v_norm"})
    self.assertEqual(scores.reads_of(scores.WindowAttention(3)), {"obs", "pos"})
    self.assertTrue(scores.reads_observation(scores.WindowAttention()))
    self.assertFalse(scores.reads_observation(scores.KeyNorm()))

  def test_bad_pool_size_names_the_argument(self):
    with self.assertRaisesRegex(ValueError, "pool_size must be odd"):
      scores.WindowAttention(pool_size=2)


if __name__ == "__main__":
  absltest.main()
