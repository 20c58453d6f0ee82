"""certkv_jax.kv.caches: a model's caches, worked by hand on 2 layers, 1 row, 1 KV head."""

import types

from absl.testing import absltest
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
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

  def test_shadow_caches_hold_every_token_and_round_up_to_the_seq_axis(self):
    c = caches_lib.shadow_caches(SPEC, batch=1, n_tokens=6)
    self.assertEqual(c.capacity, 6)  # slot = position for all 6 tokens
    self.assertFalse(bool(c.valid.any()))
    mesh = AbstractMesh((1, 1, 4), ("data", "model", "seq"), axis_types=(AxisType.Auto,) * 3)
    with jax.sharding.use_abstract_mesh(mesh):  # a seq axis of 4: 6 slots -> 8
      self.assertEqual(caches_lib.shadow_caches(SPEC, batch=1, n_tokens=6).capacity, 8)

  def test_reserve_then_write_kv_places_a_right_padded_chunk(self):
    new_valid = jnp.array([[True, True, False]])  # two tokens and one padding slot
    k = jnp.array([[1., 2.], [3., 4.], [9., 9.]])[None, None]  # [batch, kv heads, t, d]
    for per_layer in (False, True):
      with self.subTest(per_layer=per_layer):
        c = caches_lib.init_caches(SPEC, batch=1, capacity=4)
        c, slots = (c.unstack() if per_layer else c).reserve(new_valid)
        self.assertEqual(c.per_layer, per_layer)  # the form given
        np.testing.assert_array_equal(slots.positions, [[0, 1, 1]])  # padding repeats the last
        np.testing.assert_array_equal(slots.idx[:, 0, 0], [[0, 1, 4]] * 2)  # 4: not stored
        # reserve writes every layer's positions and validity, no keys yet.
        np.testing.assert_array_equal(c.pos[:, 0, 0], [[0, 1, -1, -1]] * 2)
        np.testing.assert_array_equal(c.n_seen[:, 0, 0], [2, 2])
        self.assertEqual(float(jnp.abs(c.k).sum()), 0.0)
        c = c.write_kv(1, slots, k, 2 * k)
        self.assertEqual(c.per_layer, per_layer)
        np.testing.assert_array_equal(c.k[1, 0, 0, :2], [[1., 2.], [3., 4.]])
        np.testing.assert_array_equal(c.v[1, 0, 0, :2], [[2., 4.], [6., 8.]])
        self.assertEqual(float(jnp.abs(c.k[1, 0, 0, 2:]).sum()), 0.0)  # padding not stored
        self.assertEqual(float(jnp.abs(c.k[0]).sum()), 0.0)  # layer 0 not written yet

  def test_append_equals_the_one_head_append(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=4)
    k = jnp.array([[[[1., 0.], [0., 1.]]]])
    got = caches_lib.append(c.layer(0), k, k, jnp.ones((1, 1, 2), bool))
    one = cache_lib.append(cache_lib.init_cache(4, 2), k[0, 0], k[0, 0])
    for name in ("k", "pos", "valid", "n_seen"):
      np.testing.assert_array_equal(getattr(got, name)[0, 0], getattr(one, name), name)

  def test_layer_with_layer_stack_and_unstack(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=3)
    one = c.layer(1)._replace(acc=jnp.full((1, 1, 3), 0.5))
    c2 = c.with_layer(1, one, fields=("acc",))
    np.testing.assert_array_equal(c2.acc[:, 0, 0], [[0., 0., 0.], [.5, .5, .5]])
    per_layer = c2.unstack()
    self.assertEqual(per_layer.n_layers, 2)
    self.assertTrue(per_layer.per_layer)
    self.assertFalse(c2.per_layer)
    back = per_layer.stack()
    np.testing.assert_array_equal(back.acc, c2.acc)
    self.assertIs(c2.stack(), c2)
    self.assertIs(per_layer.unstack(), per_layer)

  def test_fields_read_stacked_in_either_form(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=3)
    c = c.with_layer(1, c.layer(1)._replace(n_seen=jnp.full((1, 1), 7, jnp.int32)))
    per_layer = c.unstack()
    for form in (c, per_layer):
      np.testing.assert_array_equal(form.n_seen[:, 0, 0], [0, 7])
      self.assertEqual(form.k.shape, (2, 1, 1, 3, 2))
      self.assertEqual(form.capacity, 3)
      self.assertEqual(form.n_layers, 2)
    # with_layer on the per-layer form replaces that layer's cache, not the others.
    one = per_layer.with_layer(0, per_layer.layer(0)._replace(n_seen=jnp.ones((1, 1), jnp.int32)))
    self.assertTrue(one.per_layer)
    np.testing.assert_array_equal(one.n_seen[:, 0, 0], [1, 7])
    self.assertIs(one.layer(1), per_layer.layer(1))

  def test_with_layer_keeps_dtypes_and_checks_shapes_in_either_form(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=3)
    for form in (c, c.unstack()):
      wide = form.layer(1)._replace(acc=jnp.full((1, 1, 3), 0.5, jnp.bfloat16),
                                    n_seen=jnp.full((1, 1), 2.0))  # float into int32
      got = form.with_layer(1, wide)
      self.assertEqual(got.acc.dtype, jnp.float32)
      self.assertEqual(got.n_seen.dtype, jnp.int32)
      np.testing.assert_array_equal(got.n_seen[:, 0, 0], [0, 2])
      with self.assertRaises((ValueError, TypeError)):  # one slot short
        form.with_layer(0, form.layer(0)._replace(acc=jnp.zeros((1, 1, 2))), fields=("acc",))

  def test_map_gives_caches_in_this_form_and_the_rest_stacked(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=3)
    extra = jnp.array([10, 20], jnp.int32)[:, None, None]  # [n_layers, batch, n_kv_heads]

    def fn(cache, other, x):  # one head: n_seen + x, and the sum of the other's pos
      return cache._replace(n_seen=cache.n_seen + x), jnp.sum(other.pos)

    for form in (c, c.unstack()):
      new, total = form.map(fn, c.unstack(), extra)
      self.assertIsInstance(new, caches_lib.Caches)
      self.assertEqual(new.per_layer, form.per_layer)
      np.testing.assert_array_equal(new.n_seen[:, 0, 0], [10, 20])
      np.testing.assert_array_equal(total, np.full((2, 1, 1), -3))  # 3 free slots, pos -1

  def test_write_kv_on_per_layer_caches_needs_an_int_layer(self):
    c, slots = caches_lib.init_caches(SPEC, batch=1, capacity=3).unstack().reserve(
        jnp.ones((1, 1), bool))
    with self.assertRaisesRegex(TypeError, r"write_kv on per-layer caches needs an int"):
      c.write_kv(jnp.int32(0), slots, jnp.ones((1, 1, 1, 2)), jnp.ones((1, 1, 1, 2)))

  def test_replace_is_stacked(self):
    c = caches_lib.init_caches(SPEC, batch=1, capacity=3).unstack()
    got = c.replace(acc=jnp.ones((2, 1, 1, 3)))
    self.assertFalse(got.per_layer)
    np.testing.assert_array_equal(got.acc, 1.0)

  def test_evict_heads_keeps_each_caches_place_in_both_forms(self):
    # One vmap over the flattened [layer, batch, head] axes: each cache meets its own
    # argument and comes back to its own place (n_seen = 100 layer + 10 row + head).
    c = caches_lib.init_caches(caches_lib.CacheSpec(2, 3, 2), batch=2, capacity=4)
    lbh = np.arange(2)[:, None, None] * 100 + np.arange(2)[None, :, None] * 10 + np.arange(3)
    c = c.replace(n_seen=jnp.asarray(lbh, jnp.int32), valid=c.valid.at[..., :2].set(True))
    arg = jnp.asarray(lbh * 1000, jnp.int32)

    def fn(cache, a):  # one (layer, row, KV head)
      return cache._replace(valid=cache.valid.at[1].set(False)), cache.n_seen + a  # keep slot 0

    for form in (c, c.unstack()):
      new, out = form.evict_heads(types.SimpleNamespace(reads=frozenset()), fn, arg)
      np.testing.assert_array_equal(out, lbh * 1001)
      self.assertEqual(new.per_layer, form.per_layer)
      np.testing.assert_array_equal(new.valid[..., 0], True)
      np.testing.assert_array_equal(new.valid[..., 1:], False)


if __name__ == "__main__":
  absltest.main()
