"""The fixed-capacity cache pytree: append, observe, keep_only."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import cache as cache_lib


def _filled(n=10, cap=16, d=4, key=0):
  c = cache_lib.init_cache(cap, d)
  k = jax.random.normal(jax.random.PRNGKey(key), (n, d))
  return cache_lib.append(c, k, 2 * k), k


class CacheTest(absltest.TestCase):

  def test_append_positions_and_shapes(self):
    c, k = _filled()
    chex.assert_shape((c.k, c.v), (16, 4))
    self.assertEqual(int(c.n_valid), 10)
    self.assertEqual(int(c.n_seen), 10)
    np.testing.assert_array_equal(c.pos[:10], np.arange(10))
    np.testing.assert_array_equal(c.pos[10:], -1)
    np.testing.assert_allclose(c.k[:10], k)
    np.testing.assert_array_equal(c.log_pi, 0.0)

  def test_append_fills_free_slots_after_eviction(self):
    c, _ = _filled()
    keep = jnp.arange(16) % 2 == 0
    c = cache_lib.keep_only(c, keep, jnp.where(keep, -0.5, 0.0))
    self.assertEqual(int(c.n_valid), 5)
    np.testing.assert_array_equal(c.k[1], 0.0)  # evicted slots are zeroed
    new = jnp.ones((3, 4))
    c2 = cache_lib.append(c, new, new)
    self.assertEqual(int(c2.n_valid), 8)
    np.testing.assert_array_equal(np.where(np.asarray(c2.pos) >= 10)[0], [1, 3, 5])
    np.testing.assert_array_equal(np.asarray(c2.pos)[[1, 3, 5]], [10, 11, 12])
    np.testing.assert_allclose(np.asarray(c2.log_pi)[[0, 2, 4]], -0.5)  # offsets of kept tokens stay
    np.testing.assert_allclose(np.asarray(c2.log_pi)[[1, 3, 5]], 0.0)

  def test_ragged_padding(self):
    c = cache_lib.init_cache(8, 2)
    k = jnp.arange(8.0).reshape(4, 2)
    c = cache_lib.append(c, k, k, jnp.array([True, False, True, False]))
    self.assertEqual(int(c.n_valid), 2)
    self.assertEqual(int(c.n_seen), 2)
    np.testing.assert_allclose(c.k[:2], k[jnp.array([0, 2])])

  def test_overflow_raises_eagerly_and_is_counted_under_jit(self):
    c, _ = _filled(n=10, cap=12)
    new = jnp.ones((5, 4))
    with self.assertRaisesRegex(ValueError, "free slots"):
      cache_lib.append(c, new, new)
    c2 = jax.jit(cache_lib.append)(c, new, new)
    self.assertEqual(int(c2.n_valid), 12)
    self.assertEqual(int(c2.n_dropped), 3)
    self.assertEqual(int(c2.n_seen), 15)

  def test_observe_gqa_and_observation(self):
    c, _ = _filled(n=4, cap=6)
    probs = jnp.zeros((2, 3, 6)).at[:, :, 0].set(1.0).at[1, 2, 0].set(0.0).at[1, 2, 1].set(1.0)
    c = cache_lib.observe(c, probs, observation=True)
    np.testing.assert_allclose(c.acc[:2], [2.5, 0.5])
    np.testing.assert_allclose(c.last[:2], [0.5, 0.5])
    np.testing.assert_allclose(c.obs, c.acc)
    c = cache_lib.observe(c, jnp.zeros(6).at[3].set(1.0))
    np.testing.assert_allclose(c.acc[3], 1.0)
    np.testing.assert_allclose(c.obs[3], 0.0)
    # Probability on invalid slots is ignored, never stored.
    c = cache_lib.observe(c, jnp.ones(6))
    np.testing.assert_array_equal(c.acc[4:], 0.0)

  def test_vmap_over_heads_and_jit(self):
    heads = jax.vmap(lambda _: cache_lib.init_cache(8, 4))(jnp.arange(3))
    k = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 4))
    heads = jax.jit(jax.vmap(cache_lib.append))(heads, k, k)
    chex.assert_shape(heads.k, (3, 8, 4))
    np.testing.assert_array_equal(heads.n_seen, [5, 5, 5])

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "capacity"):
      cache_lib.init_cache(0, 4)
    c = cache_lib.init_cache(4, 4)
    with self.assertRaisesRegex(ValueError, "k_new"):
      cache_lib.append(c, jnp.ones((2, 3)), jnp.ones((2, 4)))
    with self.assertRaisesRegex(ValueError, "v_new"):
      cache_lib.append(c, jnp.ones((2, 4)), jnp.ones((3, 4)))
    with self.assertRaisesRegex(ValueError, "probs"):
      cache_lib.observe(c, jnp.ones(5))

  def test_bytes(self):
    c = cache_lib.init_cache(100, 64, dtype=jnp.bfloat16)
    b = cache_lib.cache_bytes(c)
    self.assertEqual(b["kv"], 2 * 100 * 64 * 2)
    # per slot: log_pi, pos, valid, acc/last/obs, v_sq; per cache: 2 counters
    self.assertEqual(b["metadata"], 100 * (4 + 4 + 1 + 4 * 3 + 4) + 8)


def _stored_norms_hold(test, c):
  """v_sq is ||v||^2 (of the stored, cast values) on kept slots, 0 elsewhere."""
  del test
  expect = np.sum(np.asarray(c.v, np.float64) ** 2, axis=-1)
  expect = np.where(np.asarray(c.valid), expect, 0.0)
  np.testing.assert_allclose(c.v_sq, expect, rtol=1e-6, atol=1e-6)


class StoredValueNormsTest(absltest.TestCase):
  """``v_sq``: written on append (padding skipped), zeroed on eviction, moved by compact."""

  def test_append_writes_the_norms_of_real_tokens(self):
    c = cache_lib.init_cache(16, 4)
    v1 = jax.random.normal(jax.random.PRNGKey(1), (5, 4)) + 3.0
    real = jnp.array([True, False, True, True, False])
    c = cache_lib.append(c, jnp.zeros((5, 4)), v1, real)
    self.assertEqual(int(c.n_valid), 3)
    _stored_norms_hold(self, c)
    c = cache_lib.append(c, jnp.zeros((4, 4)), 10.0 + jnp.ones((4, 4)))
    _stored_norms_hold(self, c)

  def test_eviction_zeroes_and_compact_moves_them(self):
    c, _ = _filled(n=12)
    keep = jnp.arange(16) % 3 == 0
    c = cache_lib.keep_only(c, keep, jnp.where(keep, -0.5, 0.0))
    _stored_norms_hold(self, c)
    small = cache_lib.compact(c, 6)
    _stored_norms_hold(self, small)
    np.testing.assert_allclose(np.sort(np.asarray(small.v_sq)[np.asarray(small.valid)]),
                               np.sort(np.asarray(c.v_sq)[np.asarray(c.valid)]))

  def test_low_precision_cache_stores_the_norm_of_the_stored_value(self):
    c = cache_lib.init_cache(8, 4, dtype=jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(3), (6, 4)) * 7.0
    c = cache_lib.append(c, jnp.zeros((6, 4)), v)
    self.assertEqual(c.v_sq.dtype, jnp.float32)
    _stored_norms_hold(self, c)  # of the bfloat16 values, not of v


if __name__ == "__main__":
  absltest.main()
