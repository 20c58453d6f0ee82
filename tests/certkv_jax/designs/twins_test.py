"""Certified twins (``designs.certified``, ``registry`` ``<name>_cert``; method, section 3,
"Certified twins"): what they keep, their inclusion probabilities, unbiasedness."""

import dataclasses

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import certkv_jax
from certkv_jax import designs
from certkv_jax.designs import registry
from certkv_jax.kv import cache as cache_lib

N, CAP, D = 40, 48, 8
BUDGET, N_SINK, WINDOW = 16, 2, 4
SLOTS = BUDGET - N_SINK - WINDOW  # tail slots: 10
TOP = int(designs.TWIN_SHARE * SLOTS)  # kept by rank: 5; sampled: 5


def _cache(seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  k = jax.random.normal(ks[0], (N, D)) * jnp.linspace(0.5, 2.0, N)[:, None]
  v = jax.random.normal(ks[1], (N, D))
  c = cache_lib.append(cache_lib.init_cache(CAP, D), k, v)
  q = jax.random.normal(ks[2], (3, 2, D))  # 3 query heads, 2 queries
  probs = certkv_jax.attention_probs(q, c.k, c.log_pi, c.valid)
  return cache_lib.observe(c, probs, observation=True)


def _evict(design, c, key):
  return design.evict(c, design.init(c), key)


def _tail(c):
  pos = np.asarray(c.pos)
  return np.asarray(c.valid) & (pos >= N_SINK) & (pos < N - WINDOW)


class TwinTest(absltest.TestCase):

  def _check_kept(self, name, score):
    """Over 20 keys: the sinks and window, the TOP best tail tokens by ``score`` with
    pi = 1, and SLOTS - TOP sampled ones with pi < 1 and offset log pi."""
    c = _cache()
    twin = registry.make(name + "_cert", BUDGET, n_sink=N_SINK, window=WINDOW)
    self.assertEqual((twin.name, twin.randomized), (name + "_cert", True))
    tail = _tail(c)
    s = np.where(tail, score, -np.inf)
    best = np.zeros(CAP, bool)
    best[np.argsort(-s)[:TOP]] = True
    certain = np.asarray(c.valid) & ~tail
    for seed in range(20):
      new, _, info = _evict(twin, c, jax.random.PRNGKey(seed))
      kept, pi = np.asarray(info.kept), np.asarray(info.pi)
      self.assertEqual(int(kept.sum()), BUDGET)
      np.testing.assert_array_equal(kept[certain | best], True)
      np.testing.assert_array_equal(pi[certain | best], 1.0)
      sampled = kept & tail & ~best
      self.assertEqual(int(sampled.sum()), SLOTS - TOP)
      self.assertTrue((pi[sampled] < 1.0).all(), (seed, pi[sampled]))
      np.testing.assert_allclose(np.asarray(new.log_pi)[sampled], np.log(pi[sampled]),
                                 rtol=1e-6)
      np.testing.assert_array_equal(np.asarray(new.log_pi)[certain | best], 0.0)
    # The twin keeps the first TOP of what the deterministic design keeps, and more.
    det_kept = np.asarray(_evict(registry.make(name, BUDGET, n_sink=N_SINK, window=WINDOW),
                                 c, jax.random.PRNGKey(0))[2].kept)
    self.assertTrue((det_kept[best]).all())

  def test_h2o_twin(self):
    c = _cache()
    self._check_kept("h2o", np.asarray(c.acc))

  def test_key_norm_twin_samples_a_negative_score(self):
    # Knorm's score is -||k||: the twin samples by its shift above the tail's minimum.
    c = _cache()
    self._check_kept("key_norm", -np.linalg.norm(np.asarray(c.k), axis=-1))

  def test_horvitz_thompson_over_draws_is_unbiased(self):
    # sum over the tail of x, estimated by the twin's draws: the kept tail's x / pi.
    # 4,000 draws; the bound is 4 Monte Carlo standard errors (a false failure about
    # once in 16,000 seeds), and the estimator must be random (its SE well above 0).
    c = _cache(seed=1)
    twin = registry.make("h2o_cert", BUDGET, n_sink=N_SINK, window=WINDOW)
    tail = jnp.asarray(_tail(c))
    x = jnp.abs(c.v[:, 0]) + 0.1

    def estimate(key):
      _, _, info = _evict(twin, c, key)
      on = info.kept & tail
      return jnp.sum(jnp.where(on, x / jnp.where(on, info.pi, 1.0), 0.0))
    est = np.asarray(jax.jit(jax.vmap(estimate))(jax.random.split(jax.random.PRNGKey(7), 4000)))
    truth = float(jnp.sum(jnp.where(tail, x, 0.0)))
    se = est.std() / np.sqrt(est.size)
    self.assertGreater(se, 1e-4 * truth)
    self.assertLess(abs(est.mean() - truth), 4 * se, (est.mean(), truth, se))

  def test_a_registered_deterministic_design_gets_a_twin(self):

    @dataclasses.dataclass(frozen=True)
    class FirstValue:  # a score this test adds: the first value component
      reads = frozenset({"v"})

      def __call__(self, cache):
        return cache.v[..., 0]

    def factory(budget, *, n_sink=0, window=0):
      return designs.top_k(budget, FirstValue(), n_sink=n_sink, window=window,
                           name="first_value")
    registry.register("first_value", factory)
    self.addCleanup(registry._FACTORIES.pop, "first_value")  # pylint: disable=protected-access
    self.assertIn("first_value_cert", registry.twins())
    twin = registry.make("first_value_cert:top_share=0.7:eps=0.2", BUDGET, n_sink=N_SINK,
                         window=WINDOW)
    self.assertEqual((twin.name, twin.randomized, twin.tail.heavy_share, twin.tail.eps),
                     ("first_value_cert", True, 0.7, 0.2))
    c = _cache()
    info = _evict(twin, c, jax.random.PRNGKey(0))[2]
    self.assertEqual(int(np.asarray(info.kept).sum()), BUDGET)
    with self.assertRaisesRegex(ValueError, "already registered"):
      registry.register("first_value_cert", factory)

  def test_spill_when_the_budget_cannot_hold_the_certainty_set(self):
    # A budget of 4 tokens (10% of 40) against 2 sinks + a 4-token window: the deterministic design
    # keeps the 6 certain tokens and drops the rest with pi = 0. The twin keeps 6 as
    # well (equal memory), the sinks certain and 4 others by its tail rule over the
    # window and the tail together (2 by rank, 2 sampled), so every token it drops had
    # pi > 0; spill=0 keeps the old behaviour.
    c = _cache()
    det = _evict(registry.make("h2o", 0.1, n_sink=N_SINK, window=WINDOW), c,
                 jax.random.PRNGKey(0))[2]
    pos = np.asarray(c.pos)
    certain = np.asarray(c.valid) & ((pos < N_SINK) | (pos >= N - WINDOW))
    np.testing.assert_array_equal(np.asarray(det.kept), certain)
    old = _evict(registry.make("h2o_cert:spill=0", 0.1, n_sink=N_SINK, window=WINDOW), c,
                 jax.random.PRNGKey(0))[2]
    np.testing.assert_array_equal(np.asarray(old.kept), certain)
    self.assertEqual(float(np.asarray(old.pi)[np.asarray(old.evicted)].max()), 0.0)
    twin = registry.make("h2o_cert", 0.1, n_sink=N_SINK, window=WINDOW)
    acc = np.where(np.asarray(c.valid) & (pos >= N_SINK), np.asarray(c.acc), -np.inf)
    best = np.argsort(-acc)[:2]  # the two highest accumulated attention, sinks aside
    for seed in range(10):
      new, state, info = _evict(twin, c, jax.random.PRNGKey(seed))
      kept, pi = np.asarray(info.kept), np.asarray(info.pi)
      self.assertEqual(int(kept.sum()), N_SINK + WINDOW)
      self.assertTrue(kept[np.asarray(c.valid) & (pos < N_SINK)].all() and kept[best].all())
      np.testing.assert_array_equal(pi[best], 1.0)
      gone = np.asarray(info.evicted)
      self.assertEqual(int(gone.sum()), N - N_SINK - WINDOW)
      self.assertGreater(float(pi[gone].min()), 0.0)  # no deletion outside the sample
      sampled = kept & (pos >= N_SINK) & (pi < 1.0)
      self.assertEqual(int(sampled.sum()), 2)
      np.testing.assert_allclose(np.asarray(new.log_pi)[sampled], np.log(pi[sampled]),
                                 rtol=1e-6)
      self.assertEqual(int(state.n_over_budget), 1)  # over the nominal budget, as h2o
    # Within budget spill changes nothing.
    for seed in range(3):
      a = _evict(registry.make("h2o_cert", BUDGET, n_sink=N_SINK, window=WINDOW), c,
                 jax.random.PRNGKey(seed))[2]
      b = _evict(registry.make("h2o_cert:spill=0", BUDGET, n_sink=N_SINK, window=WINDOW),
                 c, jax.random.PRNGKey(seed))[2]
      np.testing.assert_array_equal(np.asarray(a.kept), np.asarray(b.kept))

  def test_a_certainty_set_covering_every_token_counts_as_over_budget(self):
    # A window of 44 over 40 tokens at a budget of 0.1 (4 tokens): spill raises the
    # target to the 40 it keeps, and before, the round then did not count in
    # n_over_budget (h2o's did).
    c = _cache()
    n = int(np.asarray(c.valid).sum())
    for name in ("h2o", "h2o_cert"):
      d = registry.make(name, 0.1, n_sink=N_SINK, window=n + 4)
      _, state, info = _evict(d, c, jax.random.PRNGKey(0))
      self.assertEqual(int(np.asarray(info.kept).sum()), n, name)
      self.assertEqual(int(state.n_over_budget), 1, name)

  def test_spill_without_a_window_samples_the_sinks_too(self):
    # 4 sinks, no window, a budget of 3 of the 40 tokens: the certainty set (the sinks) is the
    # whole count kept, and no window can give up a slot. The twin keeps 4 as well,
    # by its tail rule over sinks and tail together (2 by rank, 2 sampled), so no
    # token leaves with pi = 0 (before: the sinks kept, 36 tokens gone with pi = 0).
    c = _cache()
    twin = registry.make("h2o_cert", 0.075, n_sink=4, window=0)  # 3 of 40 tokens
    for seed in range(10):
      _, _, info = _evict(twin, c, jax.random.PRNGKey(seed))
      kept, pi, gone = np.asarray(info.kept), np.asarray(info.pi), np.asarray(info.evicted)
      self.assertEqual((int(kept.sum()), int(gone.sum())), (4, N - 4))
      self.assertGreater(float(pi[gone].min()), 0.0)
      self.assertEqual(int((kept & (pi < 1.0)).sum()), 2)

  def test_spill_slots_keep_the_most_recent_tokens(self):
    # The same tight budget with spill_slots=2: the 2 newest tokens stay certain, and
    # the 2 oldest window slots join the tail (1 by rank, 1 sampled), so the twin still
    # keeps 6 and every token it drops had pi > 0.
    c = _cache()
    pos = np.asarray(c.pos)
    twin = registry.make("h2o_cert:spill_slots=2", 0.1, n_sink=N_SINK, window=WINDOW)
    newest = np.asarray(c.valid) & (pos >= N - 2)
    for seed in range(10):
      _, _, info = _evict(twin, c, jax.random.PRNGKey(seed))
      kept, pi, gone = np.asarray(info.kept), np.asarray(info.pi), np.asarray(info.evicted)
      self.assertEqual(int(kept.sum()), N_SINK + WINDOW)
      self.assertTrue(kept[newest].all() and kept[np.asarray(c.valid) & (pos < N_SINK)].all())
      np.testing.assert_array_equal(pi[newest], 1.0)
      self.assertGreater(float(pi[gone].min()), 0.0)
      self.assertEqual(int((kept & (pi < 1.0)).sum()), 1)  # one sampled slot
    with self.assertRaisesRegex(ValueError, "spill_slots must be an int >= 0"):
      designs.certified(registry.make("h2o", BUDGET), spill_slots=-1)

  def test_errors(self):
    with self.assertRaisesRegex(TypeError, "deterministic top-k design"):
      designs.certified(registry.make("poisson_tail", BUDGET))
    with self.assertRaisesRegex(ValueError, "top_share must be a float in \\[0, 1\\)"):
      designs.certified(registry.make("h2o", BUDGET), top_share=1.0)
    with self.assertRaisesRegex(ValueError, "spill must be a bool"):
      designs.certified(registry.make("h2o", BUDGET), spill=2)
    with self.assertRaisesRegex(ValueError, "eps must be a float in \\(0, 1\\]"):
      registry.make("h2o_cert:eps=0", BUDGET)
    with self.assertRaisesRegex(ValueError, "unknown design 'poisson_tail_cert'"):
      registry.make("poisson_tail_cert", BUDGET)


if __name__ == "__main__":
  absltest.main()
