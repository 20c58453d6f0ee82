"""certkv_jax.designs.keydiff: the KeyDiff score on keys worked by hand."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax.designs import keydiff
from certkv_jax.kv import cache as cache_lib


class KeyDiffTest(absltest.TestCase):

  def test_score_is_minus_cosine_to_the_mean_unit_key(self):
    # unit keys (1, 0), (1, 0), (0, 1): mean (2/3, 1/3), direction (2, 1) / sqrt(5).
    c = cache_lib.init_cache(capacity=4, head_dim=2)
    c = cache_lib.append(c, jnp.array([[2., 0.], [5., 0.], [0., 3.]]), jnp.ones((3, 2)))
    got = keydiff.KeyDiff()(c)
    np.testing.assert_allclose(got[:3], [-2 / 5 ** .5, -2 / 5 ** .5, -1 / 5 ** .5], rtol=1e-6)

  def test_design_keeps_the_distinctive_key(self):
    c = cache_lib.init_cache(capacity=4, head_dim=2)
    c = cache_lib.append(c, jnp.array([[1., 0.], [1., .1], [0., 1.], [1., 0.]]),
                         jnp.ones((4, 2)))
    design = keydiff.keydiff(2, window=1)
    c2, _, _ = design.evict(c, design.init(c), jax.random.PRNGKey(0))
    kept = np.asarray(c2.pos)[np.asarray(c2.valid)]
    self.assertEqual(sorted(kept.tolist()), [2, 3])  # window 3, and 2: the odd key out


if __name__ == "__main__":
  absltest.main()
