"""certkv_jax.eviction: a design applied to a model's caches, worked by hand on 6 tokens."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import designs
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib

SPEC = caches_lib.CacheSpec(n_layers=2, n_kv_heads=1, head_dim=2)
ACC = [0.9, 0.1, 0.5, 0.05, 0.3, 0.2]  # accumulated attention of positions 0..5


def _caches():
  c = caches_lib.init_caches(SPEC, batch=1, capacity=8)
  k = jnp.arange(12, dtype=jnp.float32).reshape(1, 1, 6, 2)
  c = caches_lib.Caches(tuple(caches_lib.append(c.layer(i), k, k, jnp.ones((1, 1, 6), bool))
                              for i in range(2))).stack()
  return c.replace(acc=c.acc.at[..., :6].set(jnp.array(ACC)))


class EvictTest(absltest.TestCase):

  def test_h2o_keeps_sink_window_and_heavy_hitters(self):
    # 4 tokens: sink 0, window 5, and of 1..4 the two largest acc: 2 (0.5) and 4 (0.3).
    design = designs.h2o(4, n_sink=1, window=1)
    ev = eviction.evict(design, _caches(), jax.random.PRNGKey(0))
    for i in range(2):
      kept = np.asarray(ev.caches.pos[i, 0, 0])[np.asarray(ev.caches.valid[i, 0, 0])]
      self.assertEqual(sorted(kept.tolist()), [0, 2, 4, 5])
    np.testing.assert_array_equal(ev.info.evicted[0, 0, 0, :6], [0, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(ev.state.rounds, [[[1]], [[1]]])
    # Nothing to do when within budget: a second round keeps all 4 and counts no round.
    again = eviction.evict(design, ev.caches, jax.random.PRNGKey(1), state=ev.state)
    np.testing.assert_array_equal(again.caches.valid, ev.caches.valid)
    np.testing.assert_array_equal(again.state.rounds, [[[1]], [[1]]])

  def test_layer_budgets_replace_the_design_budget(self):
    ev = eviction.evict(designs.h2o(4, n_sink=1, window=1), _caches(), jax.random.PRNGKey(0),
                        layer_budgets=(3, 5))
    np.testing.assert_array_equal(ev.caches.valid.sum(-1)[:, 0, 0], [3, 5])
    # layer 0: sink, window and the top acc (2); layer 1: all but the lowest (3).
    kept0 = np.asarray(ev.caches.pos[0, 0, 0])[np.asarray(ev.caches.valid[0, 0, 0])]
    kept1 = np.asarray(ev.caches.pos[1, 0, 0])[np.asarray(ev.caches.valid[1, 0, 0])]
    self.assertEqual(sorted(kept0.tolist()), [0, 2, 5])
    self.assertEqual(sorted(kept1.tolist()), [0, 1, 2, 4, 5])

  def test_per_layer_caches_come_back_per_layer_and_equal(self):
    design = designs.h2o(4, n_sink=1, window=1)
    stacked = eviction.evict(design, _caches(), jax.random.PRNGKey(0))
    per_layer = eviction.evict(design, _caches().unstack(), jax.random.PRNGKey(0))
    self.assertTrue(per_layer.caches.per_layer)
    np.testing.assert_array_equal(per_layer.caches.stack().valid, stacked.caches.valid)

  def test_a_bare_kvcache_is_refused_by_name(self):
    with self.assertRaisesRegex(TypeError, "caches must be a certkv_jax.kv.caches.Caches"):
      eviction.evict(designs.h2o(4), _caches().as_kvcache(), jax.random.PRNGKey(0))

  def test_traced_budget_fraction(self):
    # budget 0.5 of 6 seen = 3 tokens: sink, window and position 2.
    ev = eviction.evict(designs.h2o(4, n_sink=1, window=1), _caches(), jax.random.PRNGKey(0),
                        budget=jnp.array(0.5))
    np.testing.assert_array_equal(ev.caches.valid.sum(-1)[:, 0, 0], [3, 3])

  def test_bad_budget_names_the_argument(self):
    with self.assertRaisesRegex(ValueError, "budget"):
      eviction.evict(designs.h2o(4), _caches(), jax.random.PRNGKey(0), budget=1.5)


if __name__ == "__main__":
  absltest.main()
