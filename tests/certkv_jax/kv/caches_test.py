"""certkv_jax.kv.caches: a model's caches, worked by hand on 2 layers, 1 row, 1 KV head."""

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv import caches as caches_lib

SPEC = caches_lib.CacheSpec(n_layers=2, n_kv_heads=1, head_dim=2)


class CachesTest(absltest.TestCase):

  def test_init_shapes_and_empty_fields(self):
    c = caches_lib.init_caches(caches_lib.CacheSpec(2, 3, 4), batch=2, capacity=5)
    self.assertEqual(c.k.shape, (2, 2, 3, 5, 4))
    self.assertEqual(c.pos.shape, (2, 2, 3, 5))
    np.testing.assert_array_equal(c.pos, -1)
    self.assertFalse(bool(c.valid.any()))
    np.testing.assert_array_equal(c.n_seen, 0)

  def test_reserve_then_write_kv_places_a_right_padded_chunk(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=4)
    new_valid = jnp.array([[True, True, False]])  # two tokens and one padding slot
    c, slots = caches_lib.reserve(c, new_valid)
    np.testing.assert_array_equal(slots.positions, [[0, 1, 1]])  # padding repeats the last
    # reserve writes every layer's positions and validity, no keys yet.
    np.testing.assert_array_equal(c.pos[:, 0, 0], [[0, 1, -1, -1]] * 2)
    np.testing.assert_array_equal(c.n_seen[:, 0, 0], [2, 2])
    self.assertEqual(float(jnp.abs(c.k).sum()), 0.0)
    k = jnp.array([[1., 2.], [3., 4.], [9., 9.]])[None, None]  # [batch, kv heads, t, d]
    c = caches_lib.write_kv(c, 1, slots, k, 2 * k)
    np.testing.assert_array_equal(c.k[1, 0, 0, :2], [[1., 2.], [3., 4.]])
    np.testing.assert_array_equal(c.v[1, 0, 0, :2], [[2., 4.], [6., 8.]])
    self.assertEqual(float(jnp.abs(c.k[1, 0, 0, 2:]).sum()), 0.0)  # padding not stored
    self.assertEqual(float(jnp.abs(c.k[0]).sum()), 0.0)  # layer 0 not written yet

  def test_append_equals_the_one_head_append(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=4)
    k = jnp.array([[[[1., 0.], [0., 1.]]]])
    got = caches_lib.append(caches_lib.layer(c, 0), k, k, jnp.ones((1, 1, 2), bool))
    one = cache_lib.append(cache_lib.init_cache(4, 2), k[0, 0], k[0, 0])
    for name in ("k", "pos", "valid", "n_seen"):
      np.testing.assert_array_equal(getattr(got, name)[0, 0], getattr(one, name), name)

  def test_layer_with_layer_stack_and_unstack(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=3)
    one = caches_lib.layer(c, 1)._replace(acc=jnp.full((1, 1, 3), 0.5))
    c2 = caches_lib.with_layer(c, 1, one, fields=("acc",))
    np.testing.assert_array_equal(c2.acc[:, 0, 0], [[0., 0., 0.], [.5, .5, .5]])
    per_layer = caches_lib.unstack(c2)
    self.assertLen(per_layer, 2)
    self.assertTrue(caches_lib.is_unstacked(per_layer))
    self.assertFalse(caches_lib.is_unstacked(c2))
    back = caches_lib.stack(per_layer)
    np.testing.assert_array_equal(back.acc, c2.acc)
    self.assertIs(caches_lib.stack(c2), c2)
    self.assertIs(caches_lib.unstack(per_layer), per_layer)


if __name__ == "__main__":
  absltest.main()
