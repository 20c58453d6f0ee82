"""Per-layer budgets (PyramidKV-style) and the cache memory summary, on the tiny
Hugging Face Llama fixture (2 layers, 2 KV heads)."""

import os

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax.designs import budgets
from certkv_jax.kv import cache as cache_lib
from certkv_jax import layer as layer_lib
from models import decode
from models import hf_loader
from tests import test_util
from models import memory

FIXTURE = test_util.TINY_LLAMA
N_STEPS = 3
_evict = jax.jit(decode.evict, static_argnames=("layer_budgets",))


class PyramidBudgetsTest(absltest.TestCase):

  def test_fraction_schedule_is_linear_decreasing_with_the_mean(self):
    b = budgets.pyramid_budgets(30, 0.25)
    self.assertLen(b, 30)
    self.assertTrue(all(isinstance(x, float) for x in b))
    self.assertAlmostEqual(np.mean(b), 0.25, places=6)
    np.testing.assert_allclose(np.diff(b), np.diff(b)[0], rtol=1e-6)  # linear
    self.assertLess(np.diff(b)[0], 0)  # more tokens in lower layers
    self.assertAlmostEqual(b[-1], 0.25 / 20)
    self.assertAlmostEqual(b[0], 0.5 - 0.25 / 20)

  def test_token_schedule(self):
    b = budgets.pyramid_budgets(4, 40, beta=4.0)
    self.assertEqual(b, (70, 50, 30, 10))
    self.assertEqual(budgets.pyramid_budgets(1, 0.5), (0.5,))

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "first layer"):
      budgets.pyramid_budgets(8, 0.6)
    with self.assertRaisesRegex(ValueError, "one entry per layer"):
      budgets.check_layer_budgets((1, 2, 3), 2)
    with self.assertRaisesRegex(TypeError, "all ints"):
      budgets.check_layer_budgets((1, 0.5), 2)
    with self.assertRaisesRegex(ValueError, "exceeds the cache capacity"):
      budgets.check_layer_budgets((4, 20), 2, capacity=16)
    with self.assertRaisesRegex(ValueError, "in \\(0, 1\\]"):
      budgets.check_layer_budgets((0.5, 1.5), 2)

  def test_layer_targets_follow_the_budget_rule(self):
    n_seen = np.array([[[10, 10], [7, 7]]] * 2, np.int32)  # [layers, batch, kv]
    t = budgets.layer_targets((0.3, 0.5), n_seen)
    want = [certkv_jax.designs.Budget(fraction=f).target(
        cache_lib.init_cache(4, 2)._replace(n_seen=np.int32(n)))
            for f in (0.3, 0.5) for n in (10, 7)]
    np.testing.assert_array_equal(t[:, :, 0].reshape(-1), want)  # [3, 2, 5, 3]


class LayerBudgetsDecodeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.config, cls.tokens, cls.mask = test_util.tiny_llama_prompts()

  def _prefilled(self, design):
    c = self.config
    _, caches, _, _ = decode.forward_chunk(
        self.params, c, self.tokens, self.mask, decode.init_caches(c, 2, 16),
        settings=layer_lib.Settings(design=design, certificate=False))
    return caches

  @pytest.mark.slow  # 55 s cold on the 2-core CI machine (2026-12-01)
  def test_evict_each_layer_keeps_its_own_count(self):
    design = certkv_jax.designs.snapkv(4, window=2)  # its budget (4) is replaced per layer
    caches = self._prefilled(design)
    key = jax.random.PRNGKey(0)
    out, _, info, _ = _evict(design, caches, key, layer_budgets=(6, 3))
    n_valid = np.asarray(out.n_valid)  # [layers, batch, kv heads]
    np.testing.assert_array_equal(n_valid[0], 6)
    np.testing.assert_array_equal(n_valid[1], 3)
    np.testing.assert_array_equal(info.target[:, :, 0], [[6, 6], [3, 3]])
    # A uniform schedule equal to the design's own budget changes nothing.
    same, _, _, _ = _evict(design, caches, key, layer_budgets=(4, 4))
    plain, _, _, _ = _evict(design, caches, key)
    np.testing.assert_array_equal(same.pos, plain.pos)
    # Fractions per layer with a randomized design: Poisson keeps at most the
    # target floor(f n) and at least its certainty set.
    design = certkv_jax.designs.poisson_tail(
        0.5, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=1), overflow_prob=0.05)
    out, _, info, _ = _evict(design, self._prefilled(design), key, layer_budgets=(0.8, 0.3))
    np.testing.assert_array_equal(info.target[:, :, 0], [[8, 5], [3, 2]])
    n_valid = np.asarray(out.n_valid)
    self.assertTrue((n_valid <= np.asarray(info.target)).all())
    self.assertTrue((n_valid >= 2).all())
    self.assertGreater(n_valid[0].sum(), n_valid[1].sum())
    log_pi = np.asarray(out.log_pi)[np.asarray(out.valid)]
    self.assertTrue((log_pi < 0).any())  # Hajek offsets

  def test_question_aware_generate_keeps_per_layer_counts(self):
    design = certkv_jax.designs.snapkv(4, window=2)
    gen = decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                          config=self.config,
                          gen=decode.GenerationConfig(n_steps=N_STEPS, design=design,
                                                      capacity=16, layer_budgets=(6, 3),
                                                      evaluate=True))
    n_valid = np.asarray(gen.caches.n_valid)
    np.testing.assert_array_equal(n_valid[0], 6 + N_STEPS)
    np.testing.assert_array_equal(n_valid[1], 3 + N_STEPS)
    self.assertTrue(np.isfinite(np.asarray(gen.true_error)).all())

  def test_streaming_each_layer_keeps_its_own_count(self):
    design = certkv_jax.designs.sink_window(4, n_sink=1)
    question = np.array([[5, 6, 7], [8, 9, 10]], np.int32)
    gen = decode.generate_streaming(
        self.params, (self.tokens, self.mask), (question, np.ones((2, 3), bool)),
        jax.random.PRNGKey(0), config=self.config,
        gen=decode.GenerationConfig(n_steps=N_STEPS, design=design,
                                    capacity=5 + 3 + 3 + N_STEPS, chunk=3,
                                    layer_budgets=(5, 2)))
    n_valid = np.asarray(gen.caches.n_valid)
    np.testing.assert_array_equal(n_valid[0], 5 + 3 + N_STEPS)
    np.testing.assert_array_equal(n_valid[1], 2 + 3 + N_STEPS)
    np.testing.assert_array_equal(gen.caches.n_dropped, 0)

  def test_layer_budgets_need_a_design(self):
    with self.assertRaisesRegex(ValueError, "needs a design"):
      decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                      config=self.config,
                      gen=decode.GenerationConfig(n_steps=N_STEPS, capacity=16,
                                                  layer_budgets=(4, 4)))


class BudgetSpellingTest(absltest.TestCase):

  def test_ints_are_not_fractions(self):
    # budget=1 (int) would keep one token while 1.0 keeps everything (issue 13).
    with self.assertRaisesRegex(ValueError, r"layer_budgets \(4, 1\): budget=1 \(an int\)"):
      budgets.check_layer_budgets((4, 1), 2)
    for bad in (1, jnp.asarray([1, 1], jnp.int32)):
      with self.assertRaisesRegex(ValueError, r"budget here is a fraction .* got an int"):
        budgets.check_budget(bad, 2)
    np.testing.assert_allclose(budgets.check_budget(1.0), 1.0)


class MemorySummaryTest(absltest.TestCase):

  def test_budget_b_uses_b_of_the_full_kv_bytes_plus_metadata(self):
    _, config = hf_loader.load_hf_checkpoint(FIXTURE)
    full_tokens, batch = 64, 2
    for b in (0.125, 0.25, 0.5):
      cap = int(b * full_tokens)
      caches = decode.init_caches(config, batch, cap)
      s = memory.memory_summary(caches, config, full_tokens)
      self.assertEqual(s["kv_bytes"] * full_tokens, s["full_kv_bytes"] * cap)
      self.assertAlmostEqual(s["kv_fraction"], b)
      n_caches = config.n_layers * batch * config.n_kv_heads
      # Per slot: log_pi, acc, last, obs, v_sq (float32), pos (int32), valid (bool);
      # per cache: n_seen and n_dropped (int32) and v_ref (head_dim float32).
      per_cache = 8 + 4 * config.head_dim
      self.assertEqual(s["metadata_bytes"], n_caches * (25 * cap + per_cache))
      self.assertEqual(s["full_metadata_bytes"], n_caches * (25 * full_tokens + per_cache))
      self.assertEqual(s["total_bytes"], s["kv_bytes"] + s["metadata_bytes"])
      # The same as certkv_jax.kv.cache.cache_bytes per cache, summed.
      one = cache_lib.cache_bytes(jax.tree_util.tree_map(lambda x: x[0, 0, 0], caches))
      self.assertEqual(s["kv_bytes"], n_caches * one["kv"])
      self.assertEqual(s["metadata_bytes"], n_caches * one["metadata"])
      kv_full = n_caches * 2 * full_tokens * config.head_dim * 4
      self.assertEqual(s["full_kv_bytes"], kv_full)

  def test_format_bytes(self):
    self.assertEqual(memory.format_bytes(512), "512 B")
    self.assertEqual(memory.format_bytes(1536), "1.5 KiB")
    self.assertEqual(memory.format_bytes(3 * 2**20), "3.0 MiB")


class CapacityRuleTest(absltest.TestCase):
  """``budgets.capacity`` against values worked out by hand (docs/method.md, section 9)."""

  def test_values(self):
    d = certkv_jax.designs
    cap = budgets.capacity
    lengths = budgets.Lengths
    h2o = d.h2o(0.25, n_sink=4, window=16)  # certainty set 20
    stream = lengths(n_context=256, n_question=10, n_steps=8, chunk=64)
    # Question-aware: the 256-token prompt, then 64 kept + 8 decoded.
    self.assertEqual(cap(h2o, lengths(n_context=256, n_steps=8)), 256)
    # Streaming: 64 kept + a 64-token chunk + 10 question + 8 decoded = 146 < 274 in all.
    self.assertEqual(cap(h2o, stream), 146)
    # A budget below the certainty set: the set (20) is kept whole.
    self.assertEqual(cap(h2o, stream, budget=0.05), 20 + 64 + 18)
    # min_tail adds to the certainty set: 4 + 16 + 16 = 36.
    floor = d.poisson_floor(0.05, certain=d.CertaintySet(n_sink=4, window=16))
    self.assertEqual(cap(floor, stream), 36 + 82)
    # Per-row fractions: the largest; per-layer schedules: the largest.
    self.assertEqual(cap(h2o, lengths(n_context=256, n_steps=8), budget=np.array([0.25, 0.5])),
                     256)
    self.assertEqual(cap(h2o, lengths(n_context=200, n_steps=8), layer_budgets=(0.5, 0.25)),
                     max(200, 100 + 8))
    # Tokens budget: 100 kept + 8 decoded exceed a 90-token prompt.
    self.assertEqual(cap(d.h2o(100), lengths(n_context=90, n_steps=8)), 108)
    # No design: every token, the context padded to whole chunks.
    self.assertEqual(cap(None, lengths(n_context=250, n_question=10, n_steps=8, chunk=64)), 274)
    # 0.3 * 10 is 3.0000000000000004 in floating point: still 3 kept.
    self.assertEqual(cap(d.h2o(0.3), lengths(n_context=10, n_steps=1)), 10)
    self.assertEqual(cap(d.h2o(0.3), lengths(n_context=10, n_question=2, n_steps=1, chunk=4)),
                     3 + 4 + 3)

  def test_bad_lengths(self):
    h2o = certkv_jax.designs.h2o(0.25)
    for kw, err, msg in ((dict(n_context=-1), ValueError, "n_context must be an int >= 0"),
                         (dict(n_context=8, chunk=0), ValueError, "chunk must be an int >= 1"),
                         (dict(n_context=8.0), TypeError, "n_context must be an int")):
      with self.assertRaisesRegex(err, msg):
        budgets.Lengths(**kw)
    with self.assertRaisesRegex(TypeError, "lengths must be a budgets.Lengths"):
      budgets.capacity(h2o, (8, 0, 2, None))


if __name__ == "__main__":
  absltest.main()
