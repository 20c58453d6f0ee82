"""Eviction designs: what each keeps, offsets across rounds, jit/vmap, errors."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax import cache as cache_lib
from certkv_jax import designs
from certkv_jax import scores

N, CAP, D = 64, 80, 8


def _cache(n=N, cap=CAP, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  k = jax.random.normal(ks[0], (n, D))
  v = jax.random.normal(ks[1], (n, D))
  c = cache_lib.init_cache(cap, D)
  c = cache_lib.append(c, k, v)
  q = jax.random.normal(ks[2], (3, 2, D))  # 3 query heads in the group, 2 queries
  probs = certkv_jax.attention_probs(q, c.k, c.log_pi, c.valid)
  return cache_lib.observe(c, probs, observation=True)


ALL = {
    "sink_window": lambda b: designs.sink_window(b, n_sink=4),
    "h2o": lambda b: designs.h2o(b, n_sink=2, window=4),
    "tova": lambda b: designs.tova(b, window=4),
    "snapkv": lambda b: designs.snapkv(b, window=8, pool_size=5),
    "key_norm": lambda b: designs.key_norm(b, n_sink=1),
    "h2o_value_aware": lambda b: designs.h2o(b, window=4, value_aware=True),
    "uniform_random": lambda b: designs.uniform_random(b, n_sink=2, window=4),
    "poisson_tail": lambda b: designs.poisson_tail(b, n_sink=2, window=4),
    "attention_proportional": lambda b: designs.attention_proportional(b, n_sink=2, window=4),
}


def _evict(design, c, seed=0):
  return design.evict(c, design.init(c), jax.random.PRNGKey(seed))


class DesignTest(parameterized.TestCase):

  @parameterized.product(name=sorted(ALL), budget=(16, 32, 0.25, 0.5))
  def test_budget_shapes_and_certainty_set(self, name, budget):
    design = ALL[name](budget)
    c = _cache()
    c2, state, info = _evict(design, c)
    chex.assert_trees_all_equal_shapes(c, c2)
    target = budget if isinstance(budget, int) else int(budget * N)
    self.assertLessEqual(int(c2.n_valid), target)
    self.assertTrue(bool(info.triggered))
    if not design.randomized or isinstance(design.tail, designs.UniformTail):
      self.assertEqual(int(c2.n_valid), target)
    kept_pos = set(np.asarray(c2.pos)[np.asarray(c2.valid)].tolist())
    cs = design.certain
    must = set(range(cs.n_sink)) | set(range(N - cs.window, N))
    self.assertTrue(must <= kept_pos)
    self.assertEqual(int(state.n_dropped), 0)
    np.testing.assert_array_equal(np.asarray(info.kept), np.asarray(c2.valid))

  def test_min_tail_keeps_a_sampled_tail_below_the_certainty_set(self):
    # A fraction whose target (0.05 * N) is below the certainty set (4 + 8): with
    # min_tail 0 the whole tail goes with pi = eps (m = 0); with min_tail 6 the
    # target is the certainty set + 6 and the tail is sampled (m > 0).
    c = _cache()
    plain = designs.poisson_tail(0.05, n_sink=4, window=8)
    floor = designs.poisson_tail(0.05, n_sink=4, window=8, min_tail=6)
    _, _, info0 = _evict(plain, c)
    c1, _, info1 = _evict(floor, c)
    self.assertEqual(float(info0.m), 0.0)
    self.assertEqual(int(info1.target), 4 + 8 + 6)
    self.assertGreater(float(info1.m), 0.0)
    self.assertLessEqual(int(c1.n_valid), 4 + 8 + 6)
    tail_pi = np.asarray(info1.pi)[np.asarray(c.valid) & ~np.asarray(info1.certain)]
    self.assertGreater(tail_pi.max(), 1e-3)
    self.assertEqual(designs.by_name("poisson_floor", 0.25).min_tail, 16)
    with self.assertRaisesRegex(ValueError, "min_tail must be an int >= 0"):
      designs.poisson_tail(0.25, min_tail=-1)

  def test_within_budget_is_a_noop(self):
    c = _cache(n=10)
    for name, make in ALL.items():
      c2, _, info = _evict(make(16), c)
      chex.assert_trees_all_equal(c, c2, custom_message=name)
      self.assertFalse(bool(info.triggered))

  def test_sink_window_positions(self):
    c2, _, _ = _evict(designs.sink_window(20, n_sink=4), _cache())
    kept = sorted(np.asarray(c2.pos)[np.asarray(c2.valid)].tolist())
    self.assertEqual(kept, list(range(4)) + list(range(N - 16, N)))

  @parameterized.parameters(
      ("h2o", scores.AccumulatedAttention()),
      ("tova", scores.CurrentAttention()),
      ("key_norm", scores.KeyNorm()),
  )
  def test_top_k_keeps_highest_scores(self, name, score):
    c = _cache()
    design = designs.top_k(24, score)
    c2, _, _ = _evict(design, c)
    s = np.asarray(score(c))[:N]
    expected = set(np.argsort(-s, kind="stable")[:24].tolist())
    self.assertEqual(set(np.where(np.asarray(c2.valid))[0].tolist()), expected, name)

  def test_snapkv_pooling_matches_avg_pool(self):
    c = _cache()
    pooled = np.asarray(scores.WindowAttention(5)(c))[:N]
    x = np.pad(np.asarray(c.obs)[:N], 2)
    expected = np.convolve(x, np.ones(5) / 5, mode="valid")
    np.testing.assert_allclose(pooled, expected, rtol=1e-6)

  def test_value_aware_score(self):
    c = _cache()
    s = scores.ValueAware(scores.AccumulatedAttention())(c)
    np.testing.assert_allclose(s, c.acc * jnp.linalg.norm(c.v, axis=-1), rtol=1e-6)

  def test_uniform_random_has_no_offsets(self):
    c2, _, info = _evict(designs.uniform_random(20, window=4), _cache())
    np.testing.assert_array_equal(c2.log_pi, 0.0)
    tail = np.asarray(~info.certain & (info.pi > 0))
    np.testing.assert_allclose(np.asarray(info.pi)[tail], 16 / 60, rtol=1e-6)

  def test_poisson_offsets_and_info(self):
    design = designs.poisson_tail(32, n_sink=2, window=4)
    c = _cache()
    c2, _, info = _evict(design, c)
    kept_tail = np.asarray(c2.valid & ~info.certain)
    np.testing.assert_allclose(np.asarray(c2.log_pi)[kept_tail],
                               np.log(np.asarray(info.pi)[kept_tail]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(c2.log_pi)[np.asarray(info.certain)], 0.0)
    tail = np.asarray(c.valid & ~info.certain)
    self.assertAlmostEqual(float(np.sum(np.asarray(info.pi)[tail])), float(info.m), places=3)
    self.assertEqual(int(info.n_tail), N - 6)
    expected_m = float(certkv_jax.sampling.expected_tail_count(32 - 6, 1e-3))
    self.assertAlmostEqual(float(info.m), expected_m, places=4)

  def test_cumulative_offsets_across_rounds(self):
    design = designs.poisson_tail(40, window=4)
    c = _cache()
    state = design.init(c)
    c1, state, info1 = design.evict(c, state, jax.random.PRNGKey(1))
    new = jax.random.normal(jax.random.PRNGKey(7), (24, D))
    c1 = cache_lib.append(c1, new, new)
    probs = certkv_jax.attention_probs(new[0], c1.k, c1.log_pi, c1.valid)
    c1, state = design.update(c1, state, probs)
    c2, state, info2 = design.evict(c1, state, jax.random.PRNGKey(2))
    self.assertEqual(int(state.rounds), 2)
    both = np.asarray(c2.valid) & np.asarray(info1.kept) & (np.asarray(c2.pos) < N)
    self.assertGreater(both.sum(), 0)
    expected = (np.log(np.asarray(info1.pi)[both]) + np.log(np.asarray(info2.pi)[both]))
    np.testing.assert_allclose(np.asarray(c2.log_pi)[both], expected, rtol=1e-5)

  @pytest.mark.slow  # 30 s cold on the 2-core CI machine (2026-12-01)
  def test_design_passes_through_jit_as_an_argument(self):
    c = _cache()
    for name, make in ALL.items():
      design = make(24)
      run = jax.jit(lambda dsg, cc, key: dsg.evict(cc, dsg.init(cc), key))
      eager = _evict(design, c, seed=3)
      jitted = run(design, c, jax.random.PRNGKey(3))
      chex.assert_trees_all_close(eager, jitted, custom_message=name)

  def test_vmap_over_heads(self):
    caches = jax.vmap(lambda s: _cache(seed=s))(jnp.arange(3))
    design = designs.poisson_tail(24, window=4)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    out, state, info = jax.jit(jax.vmap(lambda c, k: design.evict(c, design.init(c), k)))(
        caches, keys)
    chex.assert_shape(out.k, (3, CAP, D))
    for h in range(3):
      one = _evict(design, _cache(seed=h))
      one = design.evict(_cache(seed=h), design.init(_cache(seed=h)), keys[h])
      chex.assert_trees_all_close(jax.tree_util.tree_map(lambda x: x[h], (out, state, info)),
                                  one)

  def test_fraction_budget_follows_context(self):
    design = designs.h2o(0.25, window=2)
    for n in (20, 40, 64):
      c2, _, info = _evict(design, _cache(n=n))
      self.assertEqual(int(info.target), math.floor(0.25 * n))
      self.assertEqual(int(c2.n_valid), math.floor(0.25 * n))


class ByNameTest(absltest.TestCase):

  def test_every_name_builds_and_evicts(self):
    c = _cache()
    for name in designs.DETERMINISTIC + designs.RANDOMIZED:
      design = designs.by_name(name, 24, n_sink=2, window=4)
      self.assertEqual(design.randomized, name in designs.RANDOMIZED, name)
      c2, _, _ = _evict(design, c)
      self.assertLessEqual(int(c2.n_valid), 24, name)
    with self.assertRaisesRegex(ValueError, "unknown design 'h3o'"):
      designs.by_name("h3o", 24)


class BadDesignInputTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("negative", -3), ("zero", 0), ("fraction_above_one", 1.5), ("fraction_zero", 0.0),
      ("nan", float("nan")))
  def test_bad_budget(self, budget):
    with self.assertRaisesRegex(ValueError, "budget"):
      designs.h2o(budget)

  def test_budget_spellings_are_explicit(self):
    # budget=1 (int) would be one token while 1.0 is everything: refused, with how
    # to write each; 2.0 (a float above 1) says how to write two tokens.
    with self.assertRaisesRegex(ValueError, r"budget=1 \(an int\).*budget=1\.0.*"
                                r"Budget\(tokens=1\)"):
      designs.h2o(1)
    with self.assertRaisesRegex(ValueError, r"for 2 tokens write the int 2"):
      designs.h2o(2.0)
    self.assertEqual(designs.h2o(1.0).budget, designs.Budget(fraction=1.0))
    self.assertEqual(designs.sink_window(designs.Budget(tokens=1), n_sink=0).budget.tokens, 1)
    self.assertEqual(designs.h2o(8).budget, designs.Budget(tokens=8))

  def test_bool_budget(self):
    with self.assertRaisesRegex(TypeError, "budget"):
      designs.h2o(True)

  def test_bad_eps_and_overflow(self):
    with self.assertRaisesRegex(ValueError, "eps"):
      designs.poisson_tail(16, eps=0.0)
    with self.assertRaisesRegex(ValueError, "eps"):
      designs.poisson_tail(16, eps=2.0)
    with self.assertRaisesRegex(ValueError, "overflow_prob"):
      designs.poisson_tail(16, overflow_prob=1.0)
    with self.assertRaisesRegex(ValueError, "n_sink"):
      designs.h2o(16, n_sink=-1)

  def test_capacity_smaller_than_certainty_set(self):
    design = designs.poisson_tail(0.5, n_sink=8, window=16)
    with self.assertRaisesRegex(ValueError, "capacity 20 is smaller than the certainty set"):
      design.init(cache_lib.init_cache(20, D))

  def test_budget_smaller_than_certainty_set(self):
    with self.assertRaisesRegex(ValueError, "budget \\(10 tokens\\) is smaller"):
      designs.h2o(10, n_sink=4, window=8)

  def test_budget_above_capacity(self):
    with self.assertRaisesRegex(ValueError, "exceeds the cache capacity"):
      designs.h2o(100).init(cache_lib.init_cache(50, D))

  def test_non_finite_scores(self):
    c = _cache()
    c = c._replace(acc=c.acc.at[3].set(jnp.nan))
    with self.assertRaisesRegex(ValueError, "score must be finite"):
      _evict(designs.poisson_tail(16), c)

  def test_negative_score_for_poisson(self):
    with self.assertRaisesRegex(ValueError, "non-negative score"):
      _evict(designs.poisson_tail(16, score=scores.KeyNorm()), _cache())

  def test_bad_pool_size(self):
    with self.assertRaisesRegex(ValueError, "pool_size"):
      designs.snapkv(32, pool_size=4)


if __name__ == "__main__":
  absltest.main()
