"""The compose API (certkv_jax.layer): settings, result types, scale, overflow, helpers."""

import dataclasses

from absl.testing import absltest
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from certkv_jax.attention import certified
from certkv_jax.designs import registry
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer


@dataclasses.dataclass(frozen=True)
class _Sizes:
  n_layers: int = 2
  n_kv_heads: int = 2
  head_dim: int = 4


SIZES = _Sizes()
B, T, H = 2, 5, 4  # batch, chunk, query heads (groups of 2 over 2 KV heads)


def _qkv(key, t=T):
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (B, t, H, SIZES.head_dim))
  k = jax.random.normal(kk, (B, t, SIZES.n_kv_heads, SIZES.head_dim))
  v = jax.random.normal(kv, (B, t, SIZES.n_kv_heads, SIZES.head_dim))
  return q, k, v


def _softmax_attention(q, k, v, scale):
  """Causal softmax attention of one chunk on empty caches, GQA groups of 2, in numpy."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
  s = np.einsum("bthd,bnhd->bhtn", q, k) * scale
  s = np.where(np.tril(np.ones((q.shape[1], k.shape[1]), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhtn,bnhd->bthd", p, v)


class LayerTest(absltest.TestCase):

  def test_attend_returns_named_fields_and_the_positions_it_used(self):
    cache = caches_lib.init_caches(SIZES, B, 8).layer(0)
    valid = jnp.asarray([[True] * T, [True, True, True, False, False]])
    res = layer.attend(*_qkv(jax.random.PRNGKey(0)), cache, valid=valid)
    self.assertIsInstance(res, layer.Attended)
    self.assertEqual(res.out.shape, (B, T, H, SIZES.head_dim))
    self.assertEqual(res.stats.var_hat.shape, (B, H, T))
    np.testing.assert_array_equal(res.positions, layer.positions(cache, valid))
    np.testing.assert_array_equal(res.positions[1, :3], [0, 1, 2])
    np.testing.assert_array_equal(res.overflow, [0, 0])
    # The next chunk continues from what each row has seen (5 and 3 tokens).
    nxt = layer.attend(*_qkv(jax.random.PRNGKey(1), 1), res.cache)
    np.testing.assert_array_equal(nxt.positions[:, 0], [5, 3])

  def test_scale_gives_the_softmax_at_that_scale(self):
    cache = caches_lib.init_caches(SIZES, B, 8).layer(0)
    q, k, v = _qkv(jax.random.PRNGKey(2))
    for scale in (None, 1.0, 0.1):
      out = layer.attend(q, k, v, cache, settings=layer.Settings(scale=scale)).out
      want = _softmax_attention(q, k, v, SIZES.head_dim**-0.5 if scale is None else scale)
      np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"scale={scale}")
    with self.assertRaisesRegex(ValueError, r"scale must be a finite number > 0.*-1"):
      layer.Settings(scale=-1.0)

  def test_overflow_is_reported_under_jit_and_raises_when_checked(self):
    cache = caches_lib.init_caches(SIZES, B, 3).layer(0)  # room for 3 of 5
    q, k, v = _qkv(jax.random.PRNGKey(3))
    valid = jnp.asarray([[True] * T, [True, True, False, False, False]])
    attend = jax.jit(layer.attend, static_argnames=("settings",))
    res = attend(q, k, v, cache, valid=valid)
    np.testing.assert_array_equal(res.overflow, [2, 0])  # row 0 lost 2 tokens, row 1 none
    checked = layer.Settings(checked=True)
    err, _ = jax.jit(checkify.checkify(lambda *a: attend(*a, valid=valid, settings=checked)))(
        q, k, v, cache)
    with self.assertRaisesRegex(checkify.JaxRuntimeError, r"\[2 0\] tokens .* no free slot"):
      err.throw()
    fits = lambda *a: attend(*a, valid=valid[:, :3], settings=checked)
    err, _ = jax.jit(checkify.checkify(fits))(q[:, :3], k[:, :3], v[:, :3], cache)
    err.throw()  # 3 tokens fit: no error

  def test_a_shadow_short_of_the_tokens_counts_as_overflow(self):
    # The caches hold all 5 tokens, the shadow 3: the 2 it loses are counted, not dropped
    # silently, in attend and attend_layer alike.
    q, k, v = _qkv(jax.random.PRNGKey(8))
    valid = jnp.asarray([[True] * T, [True, True, False, False, False]])
    kv, shadow = caches_lib.init_caches(SIZES, B, 8), caches_lib.shadow_caches(SIZES, B, 3)
    attend = jax.jit(layer.attend, static_argnames=("settings",))
    res = attend(q, k, v, kv.layer(0), valid=valid, shadow=shadow.layer(0))
    np.testing.assert_array_equal(res.overflow, [2, 0])
    reserved, slots = kv.reserve(valid)
    shadow_reserved, shadow_slots = shadow.reserve(valid)
    got = jax.jit(layer.attend_layer, static_argnums=(4,))(
        q, k, v, reserved, 1, slots, shadow=(shadow_reserved, shadow_slots))
    np.testing.assert_array_equal(got.overflow, [2, 0])
    checked = layer.Settings(checked=True)
    run = lambda *a, shadow: attend(*a, valid=valid, shadow=shadow, settings=checked)
    err, _ = jax.jit(checkify.checkify(run))(q, k, v, kv.layer(0), shadow=shadow.layer(0))
    with self.assertRaisesRegex(checkify.JaxRuntimeError, r"\[2 0\] tokens .* or the shadow"):
      err.throw()

  def test_attend_layer_in_place_equals_attend_per_layer(self):
    stacked = caches_lib.init_caches(SIZES, B, 8)
    valid = jnp.asarray([[True] * T, [True] * 4 + [False]])
    design = registry.make("snapkv", 0.5, n_sink=1, window=2)
    settings = layer.Settings(design)
    reserved, slots = stacked.reserve(valid)
    q, k, v = _qkv(jax.random.PRNGKey(4))
    got = layer.attend_layer(q, k, v, reserved, 1, slots, settings=settings)
    want = layer.attend(q, k, v, stacked.layer(1), valid=valid, settings=settings)
    np.testing.assert_allclose(got.out, want.out, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got.positions, want.positions)
    np.testing.assert_array_equal(got.overflow, want.overflow)
    for f in ("k", "v", "acc", "obs", "pos", "valid"):
      np.testing.assert_allclose(getattr(got.cache.layer(1), f),
                                 getattr(want.cache, f), rtol=1e-6, err_msg=f)

  def test_shadow_caches_hold_every_token_at_its_position(self):
    design = registry.make("poisson_tail", 0.5, n_sink=1, window=1)
    kv = caches_lib.init_caches(SIZES, B, 6)
    shadow = caches_lib.shadow_caches(SIZES, B, 6)
    q, k, v = _qkv(jax.random.PRNGKey(5))
    res = [layer.attend(q, k, v, kv.layer(i), shadow=shadow.layer(i),
                        settings=layer.Settings(design)) for i in range(SIZES.n_layers)]
    kv = caches_lib.Caches(tuple(r.cache for r in res)).stack()
    shadow = caches_lib.Caches(tuple(r.shadow for r in res)).stack()
    np.testing.assert_array_equal(shadow.pos[..., :T], np.broadcast_to(np.arange(T), (2, B, 2, T)))
    np.testing.assert_array_equal(res[0].stats.true_error, 0.0)  # nothing evicted yet
    ev = eviction.evict_and_record(design, kv, shadow, jax.random.PRNGKey(6))
    self.assertIsInstance(ev, eviction.Evicted)
    self.assertEqual(ev._fields, ("caches", "state", "info", "shadow"))
    self.assertLess(float(ev.shadow.log_pi.min()), 0.0)  # the sampled tail's record
    plain = eviction.evict(design, kv, jax.random.PRNGKey(6))
    self.assertIsNone(plain.shadow)
    np.testing.assert_array_equal(plain.caches.valid, ev.caches.valid)  # the same round

  def test_stack_stats_adds_a_leading_layer_axis(self):
    cache = caches_lib.init_caches(SIZES, B, 8).layer(0)
    q, k, v = _qkv(jax.random.PRNGKey(7))
    per_layer = [layer.attend(q, k, v, cache).stats, layer.attend(q, k, v, cache).stats]
    stacked = layer.stack_stats(per_layer)
    self.assertEqual(stacked.var_hat.shape, (2, B, H, T))
    off = layer.Settings(certificate=False)
    self.assertIsNone(layer.stack_stats([layer.attend(q, k, v, cache, settings=off).stats]))

  def test_a_design_with_the_certificate_reads_the_keys_once(self):
    # The fold's probabilities come from the certificate's own logits: a design adds no
    # product over the cache (on a GPU, each one is a pass over the keys or values).
    cap = 37  # a slot count no other axis has

    def products_over_the_cache(settings):
      cache = caches_lib.init_caches(SIZES, B, cap).layer(0)
      jaxpr = jax.make_jaxpr(lambda c: layer.attend(*_qkv(jax.random.PRNGKey(0)), c,
                                                    settings=settings))(cache)
      return sum(1 for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"
                 and any(cap in v.aval.shape for v in e.invars))

    snapkv = registry.make("snapkv", 0.5, n_sink=1, window=2)
    plain = products_over_the_cache(layer.Settings())
    self.assertGreater(plain, 0)
    self.assertEqual(products_over_the_cache(layer.Settings(snapkv)), plain)

  def test_the_certificate_is_one_type_and_a_layer_subsample_needs_the_layer(self):
    sub = certified.Subsample
    self.assertEqual(layer.Settings(certificate=True).certificate, sub())
    self.assertIsNone(layer.Settings(certificate=False).certificate)
    self.assertEqual(layer.Settings(certificate=True), layer.Settings())  # one compile
    with self.assertRaisesRegex(ValueError, "certificate must be True, False, None or a"):
      layer.Settings(certificate=(None, (0,)))
    cache = caches_lib.init_caches(SIZES, B, 8).layer(0)
    qkv = _qkv(jax.random.PRNGKey(3))
    on_layer_1 = layer.Settings(certificate=sub(layers=(1,)))
    with self.assertRaisesRegex(ValueError, r"needs the layer's index: pass layer="):
      layer.attend(*qkv, cache, settings=on_layer_1)
    full = layer.attend(*qkv, cache)
    for i, traced in ((1, False), (0, False), (1, True), (0, True)):
      at = jnp.asarray(i) if traced else i
      res = jax.jit(lambda c, at: layer.attend(*qkv, c, settings=on_layer_1, layer=at))(
          cache, at) if traced else layer.attend(*qkv, cache, settings=on_layer_1, layer=at)
      np.testing.assert_allclose(res.out, full.out, rtol=1e-6, atol=1e-6)
      if i == 1:
        np.testing.assert_allclose(res.stats.var_hat, full.stats.var_hat, rtol=1e-6)
      else:
        self.assertTrue(bool(jnp.all(jnp.isnan(res.stats.var_hat))))


def _equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else (p,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


if __name__ == "__main__":
  absltest.main()
