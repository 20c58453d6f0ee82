"""The decoder's two layer loops (``forward_chunk(layer_loop=...)``) on the tiny Llama.

``"scan"`` over stacked weights and caches and ``"unrolled"`` over per-layer ones
(``forward.unstack_layers``, ``caches.unstack``) must give the same logits,
caches and certificate statistics, with and without a design and the
certificate, and eviction of per-layer caches the same draws as of stacked ones.
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from models import decode
from models import forward
from models import llama
from tests import test_util


def _close(test, got, want):
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    test.assertEqual(np.shape(g), np.shape(w))
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=1e-5, atol=1e-5)


class LayerLoopTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.config, cls.tokens, cls.mask = test_util.tiny_llama_prompts()

  def _prefilled(self, design):
    caches = caches_lib.init_caches(self.config, 2, 14)
    logits, caches, _, _ = forward.forward_chunk(
        self.params, self.config, self.tokens, self.mask, caches,
        settings=layer_lib.Settings(design=design, certificate=False))
    if design is not None:
      caches, _, _, _ = eviction.evict(design, caches, jax.random.PRNGKey(1), budget=0.5)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None], caches

  def test_scan_and_unrolled_agree(self):
    self._agree(((None, True),))

  @pytest.mark.slow  # 20-30 s: two designs' decode steps and evictions, each loop compiled
  def test_scan_and_unrolled_agree_with_designs(self):
    self._agree(((None, False),
                 (certkv_jax.designs.poisson_tail(
                     0.5, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=2)), True),
                 (certkv_jax.designs.h2o(0.5, n_sink=1, window=2), False)))

  def _agree(self, cases):
    per_layer = forward.unstack_layers(self.params, self.config)
    one = jnp.ones((2, 1), bool)
    for design, cert in cases:
      with self.subTest(design=None if design is None else design.name, certificate=cert):
        token, caches = self._prefilled(design)
        step = lambda p, c, loop: forward.forward_chunk(
            p, self.config, token, one, c, settings=layer_lib.Settings(
                design=design, observe=False, certificate=cert), layer_loop=loop)
        want = step(self.params, caches, "scan")
        got = step(per_layer, caches.unstack(), "unrolled")
        self.assertTrue(got[1].per_layer)  # the caches stay per layer
        _close(self, got[0], want[0])
        _close(self, got[1].stack(), want[1])
        self.assertEqual(got[2] is None, not cert)
        _close(self, got[2], want[2])
        if design is not None:  # eviction per layer: the same draws as stacked
          key = jax.random.PRNGKey(2)
          new, state, info, _ = eviction.evict(design, got[1], key, budget=0.5)
          new_want, state_want, info_want, _ = eviction.evict(design, want[1], key, budget=0.5)
          _close(self, new.stack(), new_want)
          _close(self, (state, info), (state_want, info_want))

  @pytest.mark.slow  # 20-40 s: generate compiled with both loops
  def test_generate_with_both_loops_agrees(self):
    # Evicting every 2nd step (deferred to the next step's start) and stopping
    # early: the same tokens, statistics and final caches either way.
    design = certkv_jax.designs.poisson_tail(
        0.5, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=2))
    run = lambda loop: decode.generate(
        self.params, self.tokens, self.mask, jax.random.PRNGKey(4), config=self.config,
        gen=decode.GenerationConfig(n_steps=6, design=design, capacity=16,
                                    evict_each_step=True, evict_every=2,
                                    stop_tokens=(3,), layer_loop=loop))
    want, got = run("scan"), run("unrolled")
    np.testing.assert_array_equal(got.tokens, want.tokens)
    _close(self, got.caches, want.caches)
    _close(self, (got.var_hat, got.logprobs, got.n_dropped),
           (want.var_hat, want.logprobs, want.n_dropped))

  def test_unrolled_on_stacked_params_and_caches(self):
    token, caches = self._prefilled(None)
    step = lambda loop: forward.forward_chunk(self.params, self.config, token, jnp.ones(
        (2, 1), bool), caches, settings=layer_lib.Settings(observe=False), layer_loop=loop)
    got, want = step("unrolled"), step("scan")
    self.assertEqual(got[1].k.shape, caches.k.shape)  # stacked in, stacked out
    _close(self, got, want)

  def test_unstack_round_trips(self):
    _, caches = self._prefilled(None)
    per_layer = caches.unstack()
    self.assertTrue(per_layer.per_layer)
    self.assertFalse(caches.per_layer)
    self.assertIs(per_layer.unstack(), per_layer)
    _close(self, per_layer.stack(), caches)
    params = forward.unstack_layers(self.params, self.config)
    self.assertLen(params["params"]["layers"], self.config.n_layers)
    self.assertNotIn("q_proj", params["params"]["layers"][0])  # fused: one product
    _close(self, forward.stack_layers(params), self.params)

  def test_fused_qkv_is_the_three_projections(self):
    """``llama.fuse_qkv`` (with biases, as Qwen2's) gives the same q, k, v as
    the three projections, each KV head's query group beside its key and value,
    and ``unfuse_qkv`` inverts it exactly."""
    config = self.config.replace(qkv_bias=True)
    params = llama.init_params(config, jax.random.PRNGKey(5))
    layer = llama.layer_params(params, 1)
    fused = llama.fuse_qkv(layer, config)
    g = config.n_heads // config.n_kv_heads
    self.assertEqual(fused["qkv_proj"]["kernel"].shape,
                     (config.hidden, config.n_kv_heads, g + 2, config.head_dim))
    self.assertEqual(fused["qkv_proj"]["bias"].shape, (config.n_kv_heads, g + 2,
                                                       config.head_dim))
    x = jax.random.normal(jax.random.PRNGKey(6), (2, 3, config.hidden))
    pos = jnp.broadcast_to(jnp.arange(3), (2, 3))
    qkv = lambda p: llama.Block(config).apply({"params": p}, x, pos, method=llama.Block.qkv)
    _close(self, qkv(fused), qkv(layer))
    back = llama.unfuse_qkv(fused)
    self.assertEqual(set(back), set(layer))
    for name in ("q_proj", "k_proj", "v_proj"):
      for leaf in ("kernel", "bias"):
        np.testing.assert_array_equal(back[name][leaf], layer[name][leaf])

  def test_reserve_then_write_kv_is_append(self):
    _, caches = self._prefilled(None)
    b, h, d = 2, self.config.n_kv_heads, self.config.head_dim
    valid = jnp.array([[True, True], [True, False]])
    k = jax.random.normal(jax.random.PRNGKey(3), (self.config.n_layers, b, h, 2, d))
    v = k + 1.0
    per_head = jnp.repeat(valid[:, None], h, axis=1)
    want = caches_lib.Caches(tuple(caches_lib.append(caches.layer(i), k[i], v[i], per_head)
                                   for i in range(self.config.n_layers))).stack()
    for form in (caches, caches.unstack()):  # stacked, and per layer (the unrolled loop's)
      got, slots = form.reserve(valid)
      np.testing.assert_array_equal(slots.positions, [[10, 11], [7, 7]])  # padding: none
      for i in range(self.config.n_layers):
        got = got.write_kv(i, slots, k[i], v[i])
      self.assertEqual(got.per_layer, form.per_layer)
      _close(self, got.stack(), want)

  def test_bad_layer_loop_names_it(self):
    token, caches = self._prefilled(None)
    call = lambda p, c, loop: forward.forward_chunk(p, self.config, token,
                                                    jnp.ones((2, 1), bool), c, layer_loop=loop)
    with self.assertRaisesRegex(ValueError, r"layer_loop must be one of \('scan', 'unrolled'\)"):
      call(self.params, caches, "while")
    with self.assertRaisesRegex(ValueError, "layer_loop='scan' needs stacked params and caches"):
      call(forward.unstack_layers(self.params, self.config), caches, "scan")
    with self.assertRaisesRegex(ValueError, "layer_loop='scan' needs stacked params and caches"):
      call(self.params, caches.unstack(), "scan")
    with self.assertRaisesRegex(ValueError, "caches has 1 layers, config says n_layers=2"):
      call(self.params, caches_lib.Caches(caches.unstack().layers[:1]), "unrolled")
    with self.assertRaisesRegex(ValueError, "layer_loop must be one of"):
      decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                      config=self.config,
                      gen=decode.GenerationConfig(n_steps=2, capacity=16, layer_loop="loop"))

  def test_a_sliding_window_is_refused_not_ignored(self):
    # The cached path applies no window; before, it attended past it silently.
    token, caches = self._prefilled(None)
    with self.assertRaisesRegex(ValueError, r"config.sliding_window=4: .*sliding_window=None"):
      forward.forward_chunk(self.params, self.config.replace(sliding_window=4), token,
                            jnp.ones((2, 1), bool), caches)
    with self.assertRaisesRegex(ValueError, "config.sliding_window=4"):
      decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                      config=self.config.replace(sliding_window=4),
                      gen=decode.GenerationConfig(n_steps=2, capacity=16))

  def test_decode_step_unrolled_donates_and_agrees(self):
    token, caches = self._prefilled(None)
    want = decode.decode_step(self.params, jax.tree_util.tree_map(jnp.copy, caches), token[:, 0],
                              config=self.config)
    per_layer = caches.unstack()
    got = decode.decode_step(forward.unstack_layers(self.params, self.config), per_layer,
                             token[:, 0], config=self.config, layer_loop="unrolled")
    self.assertTrue(per_layer.layer(0).k.is_deleted())  # donated: updated in place
    _close(self, got[0], want[0])
    _close(self, got[1].stack(), want[1])
    _close(self, got[2], want[2])


if __name__ == "__main__":
  absltest.main()
