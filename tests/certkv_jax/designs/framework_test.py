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
from certkv_jax import designs
from certkv_jax.designs import registry
from certkv_jax.designs import scores
from certkv_jax.kv import cache as cache_lib

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


# Every registered design (so a new one is tested here without editing this
# file), plus a value-aware variant.
ALL = {name: (lambda b, n=name: registry.make(n, b, n_sink=2, window=4))
       for name in registry.names()}
ALL["h2o_value_aware"] = lambda b: designs.h2o(b, window=4, value_aware=True)


def _evict(design, c, seed=0):
  return design.evict(c, design.init(c), jax.random.PRNGKey(seed))


# A 12-token cache whose statistics are set by hand. Two queries' attention
# (rows sum to 1); Q2 is the latest. Sums Q1 + Q2 (H2O's statistic):
#   [.10 .27 .32 .21 .03 .18 .04 .33 .22 .12 .09 .09]
Q1 = np.array([.05, .02, .30, .20, .01, .15, .02, .03, .02, .10, .05, .05])
Q2 = np.array([.05, .25, .02, .01, .02, .03, .02, .30, .20, .02, .04, .04])
KEY_NORMS = np.array([5.0, 3.0, 0.5, 2.0, 0.8, 4.0, 0.3, 1.5, 2.5, 0.9, 6.0, 7.0])
VALUE_NORMS = np.array([1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0])
# One observation-window query's attention, by position (SnapKV).
OBS = np.array([.10, .00, .05, .40, .01, .00, .12, .14, .12, .02, .03, .01])
PERM = np.array([5, 11, 0, 8, 2, 9, 3, 6, 10, 1, 7, 4])  # position held by each slot


def _hand_cache(slot_positions=None):
  """Keys of norm KEY_NORMS, values of norm VALUE_NORMS (axis-aligned), the
  queries Q1 then Q2 observed (acc = Q1 + Q2, last = Q2) and obs = OBS, all
  indexed by position; with ``slot_positions``, slot i holds position
  slot_positions[i]."""
  n, d = 12, 4
  pos = np.arange(n) if slot_positions is None else np.asarray(slot_positions)
  axis = np.eye(d)[pos % d]
  k = axis * KEY_NORMS[pos][:, None]
  v = np.roll(axis, 1, axis=1) * VALUE_NORMS[pos][:, None]
  c = cache_lib.init_cache(n, d)
  c = cache_lib.append(c, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
  c = c._replace(pos=jnp.asarray(pos, jnp.int32))
  c = cache_lib.observe(c, jnp.asarray(np.stack([Q1, Q2])[:, pos], jnp.float32))
  return c._replace(obs=jnp.asarray(OBS[pos], jnp.float32))


def _kept_positions(c):
  return set(np.asarray(c.pos)[np.asarray(c.valid)].tolist())


def _avg_pool(x, size):
  """avg_pool1d over positions, stride 1, zero padding counted (numpy loop)."""
  half, n = size // 2, len(x)
  return np.array([sum(x[j] for j in range(i - half, i + half + 1) if 0 <= j < n) / size
                   for i in range(n)])


def _chernoff_m(slots, overflow_prob):
  """Largest m with exp(-m) (e m / c)^c <= overflow_prob, c = slots + 1 (the
  capacity rule of sampling.expected_tail_count), by float64 bisection."""
  c = slots + 1.0
  lo, hi = 0.0, c  # the log bound -m + c (1 + log(m / c)) increases on (0, c)
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if -mid + c * (1.0 + math.log(mid / c)) <= math.log(overflow_prob):
      lo = mid
    else:
      hi = mid
  return lo


def _overflow_prob(pi, slots):
  """P(sum of independent Bernoulli(pi_i) > slots), exactly (numpy convolution)."""
  dist = np.array([1.0])
  for p in pi:
    dist = np.convolve(dist, [1.0 - p, p])
  return float(dist[slots + 1:].sum())


class DesignTest(parameterized.TestCase):

  @parameterized.product(name=sorted(ALL), budget=(16, 32, 0.25, 0.5))
  def test_budget_shapes_and_certainty_set(self, name, budget):
    design = ALL[name](budget)
    c = _cache()
    c2, state, info = _evict(design, c)
    chex.assert_trees_all_equal_shapes(c, c2)
    target = budget if isinstance(budget, int) else int(budget * N)
    if design.min_tail:  # a tail floor raises the target above a small budget
      target = max(target, design.certain.size + design.min_tail)
    self.assertLessEqual(int(c2.n_valid), target)
    self.assertTrue(bool(info.triggered))
    fixed_size = (designs.UniformTail, designs.PriorityTail)
    if not design.randomized or isinstance(design.tail, fixed_size):
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
    plain = designs.poisson_tail(0.05, certain=designs.CertaintySet(n_sink=4, window=8))
    floor = designs.poisson_tail(0.05, certain=designs.CertaintySet(n_sink=4, window=8), min_tail=6)
    _, _, info0 = _evict(plain, c)
    c1, _, info1 = _evict(floor, c)
    self.assertEqual(float(info0.m), 0.0)
    self.assertEqual(int(info1.target), 4 + 8 + 6)
    self.assertGreater(float(info1.m), 0.0)
    self.assertLessEqual(int(c1.n_valid), 4 + 8 + 6)
    tail_pi = np.asarray(info1.pi)[np.asarray(c.valid) & ~np.asarray(info1.certain)]
    self.assertGreater(tail_pi.max(), 1e-3)
    self.assertEqual(registry.make("poisson_floor", 0.25).min_tail, 16)
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

  @parameterized.named_parameters(
      # Sinks {0} and window {10, 11} are certain; 3 tail slots among 1..9.
      # H2O: largest Q1 + Q2 on the tail: 7 (.33), 2 (.32), 1 (.27).
      ("h2o", lambda b: designs.h2o(b, n_sink=1, window=2), {0, 1, 2, 7, 10, 11}),
      # TOVA: largest Q2 (the latest query): 7 (.30), 1 (.25), 8 (.20).
      ("tova", lambda b: designs.tova(b, n_sink=1, window=2), {0, 1, 7, 8, 10, 11}),
      # Knorm: smallest ||k||: 6 (0.3), 2 (0.5), 4 (0.8).
      ("key_norm", lambda b: designs.key_norm(b, n_sink=1, window=2), {0, 2, 4, 6, 10, 11}),
      # Value-aware H2O: (Q1 + Q2) ||v||: 3 (.42), 9 (.36), 7 (.33).
      ("h2o_value_aware", lambda b: designs.h2o(b, n_sink=1, window=2, value_aware=True),
       {0, 3, 7, 9, 10, 11}),
      # StreamingLLM: the sink and the 5 most recent.
      ("sink_window", lambda b: designs.sink_window(b, n_sink=1), {0, 7, 8, 9, 10, 11}),
  )
  def test_hand_computed_kept_sets(self, make, expected):
    c = _hand_cache()
    # The statistics the scores read, as set by hand (observe sums the queries'
    # attention into acc and keeps the latest one in last).
    np.testing.assert_allclose(c.acc, Q1 + Q2, rtol=1e-6)
    np.testing.assert_allclose(c.last, Q2, rtol=1e-6)
    c2, _, info = _evict(make(6), c)
    self.assertEqual(_kept_positions(c2), expected)
    self.assertEqual(set(np.flatnonzero(np.asarray(info.evicted)).tolist()),
                     set(range(12)) - expected)

  def test_snapkv_pools_window_attention_by_position(self):
    # Slots hold positions in a shuffled order (as after evictions and
    # appends); SnapKV pools the observation-window attention over
    # neighbouring *positions*, size 3, zero padding counted:
    #   pooled[p] = (OBS[p-1] + OBS[p] + OBS[p+1]) / 3
    # e.g. pooled[3] = (.05 + .40 + .01) / 3 = .1533, pooled[2] = .15,
    # pooled[4] = .1367, pooled[7] = .1267: the tail's top 3 are 3, 2, 4,
    # while the raw statistic would have kept 7 (.14) over 2 and 4.
    c = _hand_cache(slot_positions=PERM)
    by_pos = np.argsort(PERM)  # slot holding each position
    np.testing.assert_allclose(np.asarray(c.obs)[by_pos], OBS, rtol=1e-6)
    pooled = np.asarray(scores.WindowAttention(3)(c))
    np.testing.assert_allclose(pooled[by_pos], _avg_pool(OBS, 3), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(pooled[by_pos][[2, 3, 4, 7]],
                               [0.45 / 3, 0.46 / 3, 0.41 / 3, 0.38 / 3], rtol=1e-6)
    c2, _, _ = _evict(designs.snapkv(6, window=2, pool_size=3, n_sink=1), c)
    self.assertEqual(_kept_positions(c2), {0, 2, 3, 4, 10, 11})

  def test_snapkv_pooling_matches_avg_pool(self):
    c = _cache()
    pooled = np.asarray(scores.WindowAttention(5)(c))[:N]
    np.testing.assert_allclose(pooled, _avg_pool(np.asarray(c.obs)[:N], 5), rtol=1e-6,
                               atol=1e-7)

  def test_value_aware_score(self):
    v = jnp.asarray([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]])  # ||v|| = 5, 1, 0
    c = cache_lib.append(cache_lib.init_cache(4, 2), jnp.ones((3, 2)), v)
    c = c._replace(acc=jnp.asarray([0.5, 0.2, 0.3, 0.0]))
    s = scores.ValueAware(scores.AccumulatedAttention())(c)
    np.testing.assert_allclose(s[:3], [2.5, 0.2, 0.0], rtol=1e-6)  # acc x ||v||, worked by hand

  def test_uniform_random_has_no_offsets(self):
    c2, _, info = _evict(designs.uniform_random(20, window=4), _cache())
    np.testing.assert_array_equal(c2.log_pi, 0.0)
    tail = np.asarray(~info.certain & (info.pi > 0))
    np.testing.assert_allclose(np.asarray(info.pi)[tail], 16 / 60, rtol=1e-6)

  def test_poisson_offsets_and_info(self):
    design = designs.poisson_tail(32, certain=designs.CertaintySet(n_sink=2, window=4))
    c = _cache()
    c2, _, info = _evict(design, c)
    kept_tail = np.asarray(c2.valid & ~info.certain)
    np.testing.assert_allclose(np.asarray(c2.log_pi)[kept_tail],
                               np.log(np.asarray(info.pi)[kept_tail]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(c2.log_pi)[np.asarray(info.certain)], 0.0)
    tail = np.asarray(c.valid & ~info.certain)
    self.assertAlmostEqual(float(np.sum(np.asarray(info.pi)[tail])), float(info.m), places=3)
    self.assertEqual(int(info.n_tail), N - 6)
    # m from the Chernoff capacity rule for 32 - 6 = 26 tail slots, solved
    # independently (float64 bisection): 11.98990; float32 bisection in the design.
    self.assertAlmostEqual(_chernoff_m(26, 1e-3), 11.98990, places=5)
    self.assertAlmostEqual(float(info.m), 11.98990, places=4)
    # The design's actual pi overflow the 26 slots with probability <= 1e-3
    # (exact Poisson-binomial tail; the Chernoff bound is loose, so far below).
    self.assertLess(_overflow_prob(np.asarray(info.pi, np.float64)[tail], 26), 1e-3)

  def test_capacity_rule_against_independent_values(self):
    # expected_tail_count(slots, p) is the m solving exp(-m) (e m / c)^c = p,
    # c = slots + 1; literals from float64 bisection (_chernoff_m), which the
    # float32 bisection matches to ~1e-6 relative.
    table = {(1, 1e-3): 0.0235422325, (2, 1e-3): 0.114663725, (3, 1e-3): 0.2806998,
             (8, 1e-3): 1.89748152, (26, 1e-3): 11.9898961, (100, 1e-3): 68.1014871,
             (10, 0.05): 4.74356662}
    for (slots, p), m in table.items():
      self.assertAlmostEqual(_chernoff_m(slots, p) / m, 1.0, places=6)
      got = float(certkv_jax.designs.sampling.expected_tail_count(slots, p))
      self.assertAlmostEqual(got / m, 1.0, places=5, msg=(slots, p, got, m))
      # At m the Chernoff bound is p; a Poisson count of mean m exceeds the
      # slots with probability at most p (exact Poisson tail, numpy).
      c = slots + 1
      self.assertAlmostEqual(-m + c * (1 + math.log(m / c)), math.log(p), places=4)
      tail = 1.0 - sum(math.exp(-m) * m**j / math.factorial(j) for j in range(c))
      self.assertLessEqual(tail, p)
    self.assertEqual(float(certkv_jax.designs.sampling.expected_tail_count(0, 1e-3)), 0.0)

  def test_poisson_tail_probabilities_by_hand(self):
    # Budget 6 with sink {0} and window {10, 11}: 3 tail slots, m = 0.28070
    # (Chernoff rule, c = 4); Eq. 2 with the H2O score (no token reaches 1):
    # pi_i = m (Q1 + Q2)_i / sum_{1..9} (Q1 + Q2) = m (Q1 + Q2)_i / 1.72.
    m = _chernoff_m(3, 1e-3)
    self.assertAlmostEqual(m, 0.2806998, places=6)
    c = _hand_cache()
    c2, _, info = _evict(
        designs.poisson_tail(6, certain=designs.CertaintySet(n_sink=1, window=2)), c)
    acc = Q1 + Q2
    expected = np.ones(12)
    expected[1:10] = m * acc[1:10] / 1.72
    # pi is the draw's own probability: Eq. 2's rounded up to the 2^-23 grid of its float32
    # uniforms (sampling.reached), hence atol of two grid steps.
    pi = np.asarray(info.pi)
    np.testing.assert_allclose(pi, expected, rtol=1e-5, atol=2.0**-22)
    np.testing.assert_array_equal(pi * 2.0**23, np.round(pi * 2.0**23))
    self.assertAlmostEqual(float(info.m), m, places=5)
    kept = np.asarray(c2.valid)
    np.testing.assert_allclose(np.asarray(c2.log_pi)[kept], np.log(pi[kept]), rtol=1e-6,
                               atol=1e-7)

  def test_cumulative_offsets_across_rounds(self):
    design = designs.poisson_tail(40, certain=designs.CertaintySet(window=4))
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
    design = designs.poisson_tail(24, certain=designs.CertaintySet(window=4))
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


class RegistryTest(absltest.TestCase):

  def test_every_name_builds_and_evicts_as_its_kind(self):
    """Each registered design evicts within budget; a deterministic one keeps
    the same set under every key, a randomized one does not (5 keys)."""
    c = _cache()
    for name in registry.names():
      design = registry.make(name, 24, n_sink=2, window=4)
      evict = jax.jit(lambda c, key, d=design: d.evict(c, d.init(c), key)[2].kept)  # 1 compile
      kept = [np.asarray(evict(c, jax.random.PRNGKey(s))) for s in range(5)]
      self.assertLessEqual(int(kept[0].sum()), 24, name)
      same = all(np.array_equal(kept[0], k) for k in kept[1:])
      self.assertEqual(same, not design.randomized, name)
    self.assertEqual(set(registry.names(randomized=True)) | set(registry.names(randomized=False)),
                     set(registry.names()))

  def test_bad_names_and_settings(self):
    with self.assertRaisesRegex(ValueError, "unknown design 'h3o'"):
      registry.make("h3o", 24)
    with self.assertRaisesRegex(ValueError, "design 'h2o' takes no setting 'pool_size'"):
      registry.make("h2o", 24, pool_size=3)
    with self.assertRaisesRegex(ValueError, "already registered"):
      registry.register("h2o", designs.h2o)
    # The shared window goes only to designs that have one.
    self.assertEqual(registry.make("sink_window", 24, n_sink=2, window=4).certain.window, 0)
    self.assertEqual(registry.make("h2o", 24, n_sink=2, window=4).certain.window, 4)


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
    design = designs.poisson_tail(0.5, certain=designs.CertaintySet(n_sink=8, window=16))
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
