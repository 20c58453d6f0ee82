"""The fixed-capacity cache pytree: append, observe, keep_only."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax.designs import registry
from certkv_jax import eviction
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv import caches as caches_lib


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
    # per slot: log_pi, pos, valid, acc/last/obs, v_sq; per cache: 2 counters and
    # v_ref (64 float32)
    self.assertEqual(b["metadata"], 100 * (4 + 4 + 1 + 4 * 3 + 4) + 8 + 64 * 4)


def _stored_norms_hold(test, c):
  """v_sq is ||v - v_ref||^2 (of the stored, cast values) on kept slots, 0 elsewhere."""
  del test
  ref = np.asarray(c.v_ref, np.float64)
  expect = np.sum((np.asarray(c.v, np.float64) - ref) ** 2, axis=-1)
  expect = np.where(np.asarray(c.valid), expect, 0.0)
  np.testing.assert_allclose(c.v_sq, expect, rtol=1e-6, atol=1e-6)


class StoredValueNormsTest(parameterized.TestCase):
  """``v_sq``: written on append (padding skipped), zeroed on eviction, moved by compact."""

  def test_append_writes_the_norms_of_real_tokens(self):
    c = cache_lib.init_cache(16, 4)
    v1 = jax.random.normal(jax.random.PRNGKey(1), (5, 4)) + 3.0
    real = jnp.array([True, False, True, True, False])
    c = cache_lib.append(c, jnp.zeros((5, 4)), v1, real)
    self.assertEqual(int(c.n_valid), 3)
    np.testing.assert_array_equal(c.v_ref, v1[0])  # the first value appended
    _stored_norms_hold(self, c)
    c = cache_lib.append(c, jnp.zeros((4, 4)), 10.0 + jnp.ones((4, 4)))
    np.testing.assert_array_equal(c.v_ref, v1[0])  # kept for the cache's life
    _stored_norms_hold(self, c)

  def test_stacked_append_sets_the_same_reference(self):
    spec = caches_lib.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=4)
    v = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 3, 4)) + 5.0
    mask = jnp.array([[True, True, False]])
    stacked, slots = caches_lib.init_caches(spec, 1, 8).reserve(mask)
    for i in range(2):
      stacked = stacked.write_kv(i, slots, jnp.zeros_like(v), v)
    one = cache_lib.append(cache_lib.init_cache(8, 4), jnp.zeros((3, 4)), v[0, 1], mask[0])
    np.testing.assert_array_equal(stacked.v_ref[1, 0, 1], one.v_ref)
    np.testing.assert_allclose(stacked.v_sq[1, 0, 1], one.v_sq, rtol=1e-6)

  def test_padding_before_the_first_real_token_changes_nothing(self):
    # Before: a chunk starting with padding left v_ref at 0 (append and write_kv alike),
    # so the norms of values offset by 100 lost precision until the next eviction.
    v = jax.random.normal(jax.random.PRNGKey(3), (3, 4)) + 100.0
    k = jnp.zeros((3, 4))
    end = cache_lib.append(cache_lib.init_cache(8, 4), k, v, jnp.array([True, True, False]))
    front = cache_lib.append(cache_lib.init_cache(8, 4), jnp.roll(k, 1, 0), jnp.roll(v, 1, 0),
                             jnp.array([False, True, True]))
    np.testing.assert_array_equal(front.v_ref, v[0])
    np.testing.assert_array_equal(front.v_sq, end.v_sq)
    spec = caches_lib.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4)
    mask = jnp.array([[False, True, True]])
    stacked, slots = caches_lib.init_caches(spec, 1, 8).reserve(mask)
    stacked = stacked.write_kv(0, slots, jnp.roll(k, 1, 0)[None, None],
                               jnp.roll(v, 1, 0)[None, None])
    np.testing.assert_array_equal(stacked.v_ref[0, 0, 0], v[0])

  def test_an_empty_chunk_is_a_no_op(self):
    c = cache_lib.append(cache_lib.init_cache(8, 4), jnp.ones((2, 4)), jnp.ones((2, 4)))
    chex.assert_trees_all_equal(cache_lib.append(c, jnp.zeros((0, 4)), jnp.zeros((0, 4))), c)
    spec = caches_lib.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4)
    stacked, slots = caches_lib.init_caches(spec, 1, 8).reserve(jnp.zeros((1, 0), bool))
    got = stacked.write_kv(0, slots, jnp.zeros((1, 1, 0, 4)), jnp.zeros((1, 1, 0, 4)))
    chex.assert_trees_all_equal(got.as_kvcache(), stacked.as_kvcache())

  @parameterized.parameters("stacked", "unrolled")
  def test_eviction_rebases_so_no_evicted_value_remains(self, layout):
    # A design without sinks evicts the oldest tokens, the first of which gave
    # v_ref: eviction.evict moves the reference to the oldest kept token and
    # recomputes v_sq about it, so two caches that differ only in an evicted
    # value end up equal bit for bit (Theorem 1's blind retained state).
    spec = caches_lib.CacheSpec(n_layers=2, n_kv_heads=1, head_dim=4)
    design = registry.make("sink_window", 0.5, n_sink=0, window=4)
    v = jax.random.normal(jax.random.PRNGKey(5), (1, 1, 8, 4)) + 20.0
    out = []
    for first in (0.0, 7.0):
      vv = v.at[:, :, 0].add(first)
      kv, slots = caches_lib.init_caches(spec, 1, 8).reserve(jnp.ones((1, 8), bool))
      for i in range(2):
        kv = kv.write_kv(i, slots, vv, vv)
      np.testing.assert_array_equal(kv.v_ref[:, 0, 0], jnp.stack([vv[0, 0, 0]] * 2))
      if layout == "unrolled":
        kv = kv.unstack()
      kv, _, _, _ = eviction.evict(design, kv, jax.random.PRNGKey(0))
      out.append(kv.stack())
    kept = np.asarray(out[0].valid[0, 0, 0])
    self.assertEqual(kept.sum(), 4)
    self.assertFalse(kept[0])  # token 0 (the old reference) was evicted
    oldest = int(np.argmin(np.where(kept, np.asarray(out[0].pos[0, 0, 0]), 99)))
    np.testing.assert_array_equal(out[0].v_ref[:, 0, 0], out[0].v[:, 0, 0, oldest])
    for c in out:
      for i in range(2):
        _stored_norms_hold(self, jax.tree_util.tree_map(lambda a: a[i, 0, 0], c))
    chex.assert_trees_all_equal(out[0], out[1])

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
