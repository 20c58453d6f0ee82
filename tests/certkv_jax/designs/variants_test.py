"""Defensive, envelope and blend designs: scores, observe_peak, evict, unbiasedness, R."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import certkv_jax
from certkv_jax.certificate import diagnostics
from certkv_jax import designs
from certkv_jax.designs import parts
from certkv_jax.designs import registry
from certkv_jax.designs import sampling
from certkv_jax.designs import scores
from certkv_jax.kv import cache as cache_lib

N, CAP, D, G = 48, 56, 8, 3  # tokens, capacity, head dim, query heads per KV head
N_HIST, N_WIN = 4, 2  # history queries, observation-window queries
VARIANTS = ("poisson_defensive", "poisson_envelope")


def _problem(seed=0, peaky=3.0):
  """Keys, values and queries of one synthetic KV head (peaky attention)."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  k = jax.random.normal(ks[0], (N, D))
  v = jax.random.normal(ks[1], (N, D))
  hist = peaky * jax.random.normal(ks[2], (G, N_HIST, D))
  win = peaky * jax.random.normal(ks[3], (G, N_WIN, D))
  return k, v, hist, win


def _probs(c, q):
  return certkv_jax.attention_probs(q, c.k, c.log_pi, c.valid)


def _cache(design=None, seed=0, peaky=3.0):
  """A cache of N tokens whose statistics were folded by ``design.update``
  (``cache.observe`` when None): history queries, then the observation window."""
  k, v, hist, win = _problem(seed, peaky)
  c = cache_lib.append(cache_lib.init_cache(CAP, D), k, v)
  if design is None:
    c = cache_lib.observe(c, _probs(c, hist))
    return cache_lib.observe(c, _probs(c, win), observation=True)
  state = design.init(c)
  c, state = design.update(c, state, _probs(c, hist))
  return design.update(c, state, _probs(c, win), observation=True)[0]


@jax.jit
def _evict(design, c, key):
  """One head's eviction from a fresh state (the design is a static pytree)."""
  return design.evict(c, design.init(c), key)


def _make(name, budget=32, uniform_share=0.2):
  if name == "priority_blend":
    return designs.priority_blend(budget, certain=designs.CertaintySet(n_sink=2, window=4))
  return getattr(designs, name)(budget, certain=designs.CertaintySet(n_sink=2, window=4),
                                uniform_share=uniform_share)


class BlendScoreTest(parameterized.TestCase):

  def test_values_against_numpy(self):
    c = _cache()
    valid = np.asarray(c.valid)
    acc = np.where(valid, np.asarray(c.acc, np.float64), 0.0)
    obs = np.where(valid, np.asarray(c.obs, np.float64), 0.0)
    want = 0.3 * acc / acc.sum() + 0.7 * obs / obs.sum()
    got = scores.Blend((scores.AccumulatedAttention(), scores.WindowAttention(1)), (0.3, 0.7))(c)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-8)
    self.assertAlmostEqual(float(np.sum(got)), 1.0, places=5)

  def test_a_zero_part_contributes_nothing(self):
    c = cache_lib.observe(cache_lib.append(cache_lib.init_cache(CAP, D), *_problem()[:2]),
                          jnp.where(jnp.arange(CAP) < N, 1.0 / N, 0.0))  # obs stays 0
    got = scores.Blend((scores.AccumulatedAttention(), scores.WindowAttention(1)), (0.5, 0.5))(c)
    np.testing.assert_allclose(np.asarray(got)[:N], 0.5 / N, rtol=1e-5)
    self.assertEqual(float(np.abs(np.asarray(got)[N:]).sum()), 0.0)

  def test_reads_is_the_union(self):
    b = scores.Blend((scores.AccumulatedAttention(), scores.WindowAttention(5)), (1, 1))
    self.assertEqual(b.reads, {"acc", "obs", "pos"})
    self.assertEqual(hash(b), hash(scores.Blend(
        (scores.AccumulatedAttention(), scores.WindowAttention(5)), (1.0, 1.0))))

  @parameterized.parameters(((1.0,),), ((-0.1, 1.0),), ((0.0, 0.0),), ((float("nan"), 1.0),),
                            ((True, 1.0),))
  def test_bad_weights(self, weights):
    with self.assertRaisesRegex(ValueError, "weights must be 2 finite numbers >= 0"):
      scores.Blend((scores.AccumulatedAttention(), scores.Uniform()), weights)

  def test_bad_parts(self):
    with self.assertRaisesRegex(TypeError, "parts must be a non-empty tuple of scores"):
      scores.Blend((), ())
    with self.assertRaisesRegex(TypeError, "parts must be a non-empty tuple of scores"):
      scores.Blend((3.0,), (1.0,))


class PriorityBlendTest(parameterized.TestCase):

  def test_registered_with_its_own_window(self):
    design = registry.make("priority_blend", 24, n_sink=2, window=4)
    self.assertTrue(design.randomized)
    self.assertEqual((design.observation_window, design.min_tail), (4, 16))
    self.assertIsInstance(design.tail.score, scores.Blend)
    self.assertEqual(design.tail.score.weights, (0.5, 0.5))
    self.assertEqual(designs.priority_blend(24).observation_window, 1)
    with self.assertRaisesRegex(ValueError, r"window_weight must be a float in \[0, 1\], got 1.5"):
      designs.priority_blend(24, window_weight=1.5)

  def test_window_weight_zero_is_priority_floor(self):
    """Priority sampling is scale-free, so the normalised accumulated attention
    keeps the same tokens with the same probabilities as priority_floor's raw one."""
    blend = designs.priority_blend(24, certain=designs.CertaintySet(n_sink=2, window=4),
                                   window_weight=0.0)
    floor = designs.priority_floor(24, certain=designs.CertaintySet(n_sink=2, window=4))
    c = _cache()
    for seed in range(3):
      key = jax.random.PRNGKey(seed)
      a, b = _evict(blend, c, key), _evict(floor, c, key)
      np.testing.assert_array_equal(np.asarray(a[2].kept), np.asarray(b[2].kept))
      np.testing.assert_allclose(np.asarray(a[2].pi), np.asarray(b[2].pi), rtol=1e-5)

  def test_window_share_is_filled_by_the_window_score(self):
    """window_share 0.5: the floor(0.5 * slots) tail tokens with the most pooled
    window attention are kept with pi = 1 under every key."""
    design = designs.priority_blend(24, certain=designs.CertaintySet(n_sink=2, window=4),
                                    window_share=0.5)
    c = _cache(design)
    _, _, info = _evict(design, c, jax.random.PRNGKey(0))
    tail = np.asarray(c.valid & ~info.certain)
    slots = int(info.target) - int(np.sum(np.asarray(info.certain)))
    snap = np.where(tail, np.asarray(scores.WindowAttention(5)(c)), -np.inf)
    top = np.argsort(-snap, kind="stable")[:slots // 2]
    for seed in range(5):
      _, _, info = _evict(design, c, jax.random.PRNGKey(seed))
      self.assertTrue(np.asarray(info.kept)[top].all())
      np.testing.assert_array_equal(np.asarray(info.pi)[top], 1.0)
    self.assertIn("obs", design.reads)

  def test_a_token_only_the_window_attends_to_is_kept(self):
    """A tail token with no history attention but most of the window's is kept
    with certainty at window_weight 0.5, and almost never at 0 (a weight of
    about eps times the tail mean)."""
    c = _cache()
    target = 10
    c = c._replace(acc=c.acc.at[target].set(0.0),
                   obs=c.obs.at[target].set(10.0 * float(jnp.sum(c.obs))))
    keys = jax.random.split(jax.random.PRNGKey(3), 50)
    kept = {}
    for ww in (0.0, 0.5):
      design = designs.priority_blend(20, certain=designs.CertaintySet(n_sink=2, window=4),
                                      window_weight=ww, pool_size=1)
      infos = jax.vmap(lambda k, d=design: d.evict(c, d.init(c), k)[2])(keys)
      kept[ww] = np.asarray(infos.kept[:, target])
      if ww:
        np.testing.assert_allclose(np.asarray(infos.pi[:, target]), 1.0)
    self.assertTrue(kept[0.5].all())
    self.assertEqual(int(kept[0.0].sum()), 0)


class FocusBlendTest(parameterized.TestCase):

  def _numpy(self, c, mask, fb):
    mask = np.asarray(mask)
    a = np.where(mask, np.asarray(c.acc, np.float64), 0.0)
    b = np.where(mask, np.asarray(c.obs, np.float64), 0.0)
    a, b = a / a.sum(), b / b.sum()
    share = 1.0 / (mask.sum() * np.sum(b * b))
    t = np.clip((fb.diffuse - share) / (fb.diffuse - fb.focused), 0.0, 1.0)
    lam = fb.diffuse_weight + t * (fb.focused_weight - fb.diffuse_weight)
    return (1 - lam) * a + lam * b, lam, share

  @parameterized.parameters((0.05, 0.2), (0.3, 0.9), (0.001, 0.01))
  def test_values_against_numpy(self, focused, diffuse):
    """Over the candidates (here every valid slot but the first two): the
    weight follows the window's effective share, clipped at both ends."""
    c = _cache()
    mask = c.valid & (jnp.arange(CAP) >= 2)
    fb = scores.FocusBlend(scores.AccumulatedAttention(), scores.WindowAttention(1),
                           focused, diffuse, 0.9, 0.2)
    want, lam, _ = self._numpy(c, mask, fb)
    np.testing.assert_allclose(float(fb.window_weight(c, mask)), lam, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(fb.on(c, mask)), want, rtol=1e-4, atol=1e-8)
    self.assertEqual(float(np.abs(np.asarray(fb.on(c, mask))[:2]).sum()), 0.0)

  def test_a_focused_window_gets_the_focused_weight(self):
    """A window whose attention sits on one candidate (share 1/n) gets
    focused_weight; a flat one (share 1) gets diffuse_weight."""
    c = _cache()
    n = int(np.sum(np.asarray(c.valid)))
    fb = scores.FocusBlend(scores.AccumulatedAttention(), scores.WindowAttention(1),
                           focused=1.5 / n, diffuse=0.9)
    one = c._replace(obs=jnp.zeros_like(c.obs).at[5].set(1.0))
    flat = c._replace(obs=jnp.where(c.valid, 1.0, 0.0))
    self.assertAlmostEqual(float(fb.window_weight(one, c.valid)), 1.0, places=6)
    self.assertAlmostEqual(float(fb.window_weight(flat, c.valid)), 0.5, places=6)

  def test_the_tail_rule_normalises_over_the_tail(self):
    """A sampled tail scores a FocusBlend over its own candidates, not over
    the sinks and window it never samples."""
    design = designs.priority_focus(20, certain=designs.CertaintySet(n_sink=2, window=4),
                                    focus=designs.Focus(pool_size=1))
    c = _cache(design)
    _, _, info = _evict(design, c, jax.random.PRNGKey(0))
    tail = c.valid & ~info.certain
    got = parts._tail_score(design.tail, c, tail)
    want, _, _ = self._numpy(c, tail, design.tail.score)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-8)

  @parameterized.parameters(
      (dict(focused=0.3, diffuse=0.2), "focused must be below diffuse"),
      (dict(focused=-0.1), r"focused must be a number in \[0, 1\], got -0.1"),
      (dict(diffuse_weight=1.5), r"diffuse_weight must be a number in \[0, 1\], got 1.5"),
      (dict(focused_weight=True), r"focused_weight must be a number in \[0, 1\], got True"))
  def test_bad_arguments(self, kwargs, msg):
    with self.assertRaisesRegex(ValueError, msg):
      scores.FocusBlend(**kwargs)
    with self.assertRaisesRegex(ValueError, msg):
      designs.Focus(**kwargs)
    with self.assertRaisesRegex(ValueError, msg):  # a design string's flat settings
      registry.make("priority_focus", 24, **kwargs)

  def test_registered(self):
    design = registry.make("priority_focus", 24, n_sink=2, window=4)
    self.assertTrue(design.randomized)
    self.assertEqual((design.observation_window, design.min_tail), (4, 16))
    self.assertEqual(design.reads, {"acc", "obs", "pos"})
    self.assertEqual(hash(design.tail.score), hash(scores.FocusBlend()))

  def test_a_token_the_focused_window_points_at_is_kept(self):
    """The needle case: a token with no history attention that a focused
    window attends to is kept with certainty."""
    c = _cache()
    target = 10
    c = c._replace(acc=c.acc.at[target].set(0.0),
                   obs=jnp.zeros_like(c.obs).at[target].set(1.0).at[12].set(0.2))
    design = designs.priority_focus(20, certain=designs.CertaintySet(n_sink=2, window=4),
                                    focus=designs.Focus(pool_size=1))
    keys = jax.random.split(jax.random.PRNGKey(3), 50)
    infos = jax.vmap(lambda k: design.evict(c, design.init(c), k)[2])(keys)
    np.testing.assert_array_equal(np.asarray(infos.kept[:, target]), True)
    np.testing.assert_allclose(np.asarray(infos.pi[:, target]), 1.0)


class FocusedShareTest(parameterized.TestCase):
  """``priority_focus(focus_share=f)``: a focused window fills ``floor(f k)`` of
  the ``k`` tail slots by rank of its score with ``pi = 1``; a flat one adds
  nothing."""

  def _design(self, focus_share, window_share=0.0, **focus):
    return designs.priority_focus(20, certain=designs.CertaintySet(n_sink=2, window=4),
                                  focus=designs.Focus(pool_size=1, **focus), min_tail=0,
                                  focus_share=focus_share, window_share=window_share)

  def test_a_focused_window_keeps_its_top_with_certainty(self):
    c = _cache()
    ranked = [10, 12, 14, 16, 18, 20, 22, 24, 26, 28]  # the window's top, in order
    obs = jnp.zeros_like(c.obs)
    for i, pos in enumerate(ranked):
      obs = obs.at[pos].set(1.0 - 0.05 * i)
    c = c._replace(obs=obs)  # effective share over the 42 tail slots: about 0.22
    design = self._design(0.5, focused=0.3, diffuse=0.6)
    tail_slots = 20 - 2 - 4
    n_top = math.floor(0.5 * tail_slots)  # share 0.22 <= focused: the whole 0.5
    keys = jax.random.split(jax.random.PRNGKey(3), 40)
    infos = jax.vmap(lambda k: design.evict(c, design.init(c), k)[2])(keys)
    kept, pi = np.asarray(infos.kept), np.asarray(infos.pi)
    np.testing.assert_array_equal(kept.sum(-1), 20)  # every slot used
    np.testing.assert_array_equal(kept[:, ranked[:n_top]], True)
    np.testing.assert_allclose(pi[:, ranked[:n_top]], 1.0)
    without = self._design(0.0)
    infos0 = jax.vmap(lambda k: without.evict(c, without.init(c), k)[2])(keys)
    # Without the share the window's 7th-ranked token is sampled, not certain.
    self.assertLess(float(np.asarray(infos0.pi)[:, ranked[n_top - 1]].min()), 1.0)

  def test_a_diffuse_window_adds_nothing(self):
    """Above ``diffuse`` the design is ``focus_share=0``, draw for draw."""
    c = _cache(peaky=0.1)  # near-flat attention: effective share near 1
    fb = self._design(0.5).tail.score
    tail = c.valid & (jnp.arange(CAP) >= 2)
    self.assertGreater(float(fb.effective_share(c, tail)), 0.5)
    key = jax.random.PRNGKey(5)
    _, _, a = _evict(self._design(0.5), c, key)
    _, _, b = _evict(self._design(0.0), c, key)
    np.testing.assert_array_equal(np.asarray(a.kept), np.asarray(b.kept))
    np.testing.assert_array_equal(np.asarray(a.pi), np.asarray(b.pi))

  def test_window_share_ranks_a_diffuse_window_too(self):
    """``window_share=w`` keeps the window's top ``floor(w k)`` with certainty
    even where the window is diffuse and the focused share adds nothing."""
    c = _cache(peaky=0.1)
    ranked = [10, 12, 14, 16, 18, 20, 22, 24, 26, 28]
    obs = jnp.full_like(c.obs, 0.5)
    for i, pos in enumerate(ranked):
      obs = obs.at[pos].set(1.0 - 0.04 * i)  # a broad window with a clear order
    c = c._replace(obs=obs)
    design = self._design(0.3, window_share=0.5)
    tail = c.valid & (jnp.arange(CAP) >= 2)
    self.assertEqual(float(design.tail.score.focus(c, tail)), 0.0)
    n_top = math.floor(0.5 * (20 - 2 - 4))
    keys = jax.random.split(jax.random.PRNGKey(4), 40)
    infos = jax.vmap(lambda k: design.evict(c, design.init(c), k)[2])(keys)
    kept, pi = np.asarray(infos.kept), np.asarray(infos.pi)
    np.testing.assert_array_equal(kept.sum(-1), 20)
    np.testing.assert_allclose(pi[:, ranked[:n_top]], 1.0)
    self.assertLess(float(pi[:, ranked[n_top]].min()), 1.0)  # the next one is sampled

  @parameterized.parameters(
      (dict(window_share=1.0), r"window_share must be a float in \[0, 1\), got 1.0"),
      (dict(window_share=0.5, focus_share=0.5),
       r"window_share \+ focus_share must be below 1"),
      (dict(focus_share=1.0), r"focus_share must be a float in \[0, 1\), got 1.0"),
      (dict(focus_share=-0.1), r"focus_share must be a float in \[0, 1\)"),
      (dict(focus_share=0.5, focused=0.1, diffuse=0.1), "focused must be below diffuse"))
  def test_bad_arguments(self, kwargs, msg):
    with self.assertRaisesRegex(ValueError, msg):
      registry.make("priority_focus", 24, **kwargs)
    with self.assertRaisesRegex(TypeError, "focus must be a designs.Focus"):
      designs.priority_focus(24, focus=scores.FocusBlend())

  def test_needs_a_window_score_and_a_slot_to_sample(self):
    with self.assertRaisesRegex(ValueError, "focus_share needs a score with a window"):
      parts.PriorityTail(focus_share=0.5)
    fb = scores.FocusBlend()
    with self.assertRaisesRegex(ValueError, "heavy_share \\+ focus_share must be below 1"):
      parts.PriorityTail(score=fb, heavy_share=0.5, focus_share=0.5)


class DefensiveScoreTest(parameterized.TestCase):

  @parameterized.product(share=(0.0, 0.2, 0.7, 1.0),
                         base=("acc", "obs"))
  def test_values_against_numpy(self, share, base):
    c = _cache()
    base_score = {"acc": scores.AccumulatedAttention(), "obs": scores.WindowAttention(1)}[base]
    got = np.asarray(scores.Defensive(base_score, share)(c))
    b = np.asarray(getattr(c, base), np.float64)
    valid = np.asarray(c.valid)
    expected = np.zeros(CAP)
    expected[valid] = (1 - share) * b[valid] / b[valid].sum() + share / valid.sum()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-8)
    self.assertAlmostEqual(float(got.sum()), 1.0, places=5)

  def test_share_zero_is_normalized_base_and_one_is_uniform(self):
    c = _cache()
    acc = np.asarray(c.acc)
    np.testing.assert_allclose(scores.Defensive(scores.AccumulatedAttention(), 0.0)(c),
                               acc / acc.sum(), rtol=1e-6)
    uniform = np.where(np.asarray(c.valid), 1.0 / N, 0.0)
    np.testing.assert_allclose(scores.Defensive(scores.AccumulatedAttention(), 1)(c),
                               uniform, rtol=1e-6)

  def test_zero_sum_base_falls_back_to_uniform(self):
    c = cache_lib.append(cache_lib.init_cache(CAP, D), *_problem()[:2])  # no queries yet
    got = scores.Defensive(scores.AccumulatedAttention(), 0.3)(c)
    np.testing.assert_allclose(got, np.where(np.asarray(c.valid), 1.0 / N, 0.0), rtol=1e-6)
    empty = scores.Defensive(scores.AccumulatedAttention(), 0.3)(cache_lib.init_cache(CAP, D))
    np.testing.assert_array_equal(empty, 0.0)

  @parameterized.named_parameters(("negative", -0.1), ("above_one", 1.5),
                                  ("nan", float("nan")), ("bool", True), ("string", "0.2"))
  def test_bad_uniform_share(self, share):
    with self.assertRaisesRegex(ValueError, r"uniform_share must be a float in \[0, 1\]"):
      scores.Defensive(scores.AccumulatedAttention(), share)
    for name in VARIANTS:
      with self.assertRaisesRegex(ValueError, "uniform_share"):
        _make(name, uniform_share=share)

  def test_negative_base_raises(self):
    with self.assertRaisesRegex(ValueError, "non-negative base"):
      scores.Defensive(scores.KeyNorm(), 0.2)(_cache())
    with self.assertRaisesRegex(TypeError, "base must be a score"):
      scores.Defensive(3.0, 0.2)

  def test_hashable_and_static(self):
    a = scores.Defensive(scores.AccumulatedAttention(), 0.2)
    self.assertEqual(hash(a), hash(scores.Defensive(scores.AccumulatedAttention(), 0.2)))
    self.assertEqual(_make("poisson_defensive"), _make("poisson_defensive"))
    self.assertNotEqual(_make("poisson_defensive"), _make("poisson_defensive", uniform_share=0.3))

  @parameterized.parameters(2.0, 8.0, 20.0)
  def test_inclusion_floor_after_eq2(self, m):
    """pi_i >= min(1, m s_i / sum_T s) >= min(1, m u / n_valid) (scores.Defensive)."""
    u = 0.2
    c = _cache(peaky=5.0)
    s = scores.Defensive(scores.AccumulatedAttention(), u)(c)
    tail = np.asarray(c.valid & (c.pos >= 2) & (c.pos < N - 4))
    pi = np.asarray(sampling.inclusion_probabilities(s, m, mask=jnp.asarray(tail)))
    s = np.asarray(s, np.float64)
    self.assertAlmostEqual(float(pi[tail].sum()), m, places=4)
    direct = np.minimum(1.0, m * s[tail] / s[tail].sum())
    floor = min(1.0, m * u / N)
    self.assertTrue(np.all(pi[tail] >= direct * (1 - 1e-5)))
    self.assertTrue(np.all(pi[tail] >= floor * (1 - 1e-5)))
    # Without the mixture the same scores go far below that floor.
    raw = np.asarray(sampling.inclusion_probabilities(c.acc, m, mask=jnp.asarray(tail)))
    self.assertLess(raw[tail].min(), 0.1 * floor)


class ObservePeakTest(parameterized.TestCase):

  def _probs_and_cache(self):
    k, v, hist, win = _problem()
    c = cache_lib.append(cache_lib.init_cache(CAP, D), k, v)
    # A first observation folded in, so that obs starts nonzero (running max).
    c = cache_lib.observe_peak(c, _probs(c, hist), observation=True)
    return c, _probs(c, win)

  def test_obs_is_running_max_over_group_and_queries(self):
    c, p = self._probs_and_cache()
    out = cache_lib.observe_peak(c, p, observation=True)
    p_np = np.where(np.asarray(c.valid), np.asarray(p), 0.0)
    expected = np.maximum(np.asarray(c.obs), p_np.max(axis=(0, 1)))
    np.testing.assert_array_equal(np.asarray(out.obs), expected.astype(np.float32))
    self.assertTrue(np.all(np.asarray(out.obs)[~np.asarray(c.valid)] == 0.0))
    # Not an observation: obs untouched.
    np.testing.assert_array_equal(cache_lib.observe_peak(c, p).obs, c.obs)

  @parameterized.parameters((3,), (2,), (1,))
  def test_acc_and_last_identical_to_observe(self, ndim):
    c, p = self._probs_and_cache()
    p = p if ndim == 3 else p[0] if ndim == 2 else p[0, -1]
    for observation in (False, True):
      peak = cache_lib.observe_peak(c, p, observation=observation)
      summed = cache_lib.observe(c, p, observation=observation)
      chex.assert_trees_all_equal(peak._replace(obs=c.obs), summed._replace(obs=c.obs))

  def test_traced_observation_flag(self):
    c, p = self._probs_and_cache()
    run = jax.jit(lambda cc, pp, flag: cache_lib.observe_peak(cc, pp, observation=flag))
    for flag in (False, True):
      chex.assert_trees_all_close(run(c, p, jnp.asarray(flag)),
                                  cache_lib.observe_peak(c, p, observation=flag))

  def test_bad_probs_shape(self):
    c, _ = self._probs_and_cache()
    with self.assertRaisesRegex(ValueError, "probs must be"):
      cache_lib.observe_peak(c, jnp.ones((2, 3, 4, CAP)))

  def test_observe_unchanged_against_numpy(self):
    """observe (the existing fold) still computes mean over the group, sum over
    queries, last query, and adds to obs only for observation queries."""
    c, p = self._probs_and_cache()
    c = c._replace(obs=c.obs * 0.5, acc=c.acc + 0.25 * c.valid)
    valid = np.asarray(c.valid)
    mean = np.where(valid, np.asarray(p, np.float64).mean(axis=0), 0.0)  # [q, cap]
    for observation in (False, True):
      out = cache_lib.observe(c, p, observation=observation)
      np.testing.assert_allclose(out.acc, np.asarray(c.acc) + mean.sum(0), rtol=1e-6)
      np.testing.assert_allclose(out.last, mean[-1], rtol=1e-6)
      np.testing.assert_allclose(out.obs, np.asarray(c.obs) + observation * mean.sum(0),
                                 rtol=1e-6)

  def test_design_update_uses_the_fold(self):
    # Two window queries over three slots, worked by hand: the "sum" fold adds them
    # into obs, the "peak" fold keeps each slot's larger probability.
    c = cache_lib.append(cache_lib.init_cache(40, 2), jnp.ones((3, 2)), jnp.ones((3, 2)))
    p = jnp.pad(jnp.asarray([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]]), ((0, 0), (0, 37)))  # 37 free
    env, dfn, tail = _make("poisson_envelope"), _make("poisson_defensive"), designs.poisson_tail(
        32, certain=designs.CertaintySet(n_sink=2, window=4))
    for design, obs in ((env, [0.6, 0.7, 0.1]), (dfn, [0.8, 1.0, 0.2]),
                        (tail, [0.8, 1.0, 0.2])):
      got, _ = design.update(c, design.init(c), p, observation=True)
      np.testing.assert_allclose(got.obs[:3], obs, rtol=1e-6, err_msg=design.name)
      np.testing.assert_allclose(got.acc[:3], [0.8, 1.0, 0.2], rtol=1e-6)  # summed either way
      np.testing.assert_allclose(got.last[:3], [0.2, 0.7, 0.1], rtol=1e-6)
    with self.assertRaisesRegex(ValueError, "fold must be one of"):
      designs.compose(designs.CertaintySet(), designs.TopK(), 8, fold="mean")


class VariantDesignTest(parameterized.TestCase):

  def test_registered(self):
    for name in VARIANTS:
      self.assertIn(name, registry.names(randomized=True))
      design = registry.make(name, 24, n_sink=2, window=4)
      self.assertEqual(design.name, name)
      self.assertTrue(design.randomized)
      self.assertIsInstance(design.tail.score, scores.Defensive)
      self.assertEqual(design.tail.score.uniform_share, 0.2)

  @parameterized.parameters(*VARIANTS)
  def test_evict_under_jit_and_vmap(self, name):
    design = _make(name)
    caches = jax.tree_util.tree_map(lambda *x: jnp.stack(x),
                                    *[_cache(design, seed=s) for s in range(3)])
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    out, state, info = jax.jit(jax.vmap(lambda c, k: design.evict(c, design.init(c), k)))(
        caches, keys)
    chex.assert_shape(out.k, (3, CAP, D))
    for h in range(3):
      c = _cache(design, seed=h)
      one = _evict(design, c, keys[h])
      chex.assert_trees_all_close(jax.tree_util.tree_map(lambda x: x[h], (out, state, info)),
                                  one, rtol=1e-5, atol=1e-6)
      c2, st, inf = one
      self.assertTrue(bool(inf.triggered))
      self.assertLessEqual(int(c2.n_valid), 32)
      self.assertEqual(int(st.n_dropped), 0)
      kept = set(np.asarray(c2.pos)[np.asarray(c2.valid)].tolist())
      self.assertTrue({0, 1} | set(range(N - 4, N)) <= kept)
      log_pi = np.asarray(c2.log_pi)[np.asarray(c2.valid)]
      self.assertTrue(np.all(np.isfinite(log_pi)) and np.all(log_pi <= 0.0))
      kept_tail = np.asarray(c2.valid & ~inf.certain)
      np.testing.assert_allclose(np.asarray(c2.log_pi)[kept_tail],
                                 np.log(np.asarray(inf.pi)[kept_tail]), rtol=1e-6)
      tail = np.asarray(c.valid & ~inf.certain)
      self.assertAlmostEqual(float(np.asarray(inf.pi)[tail].sum()), float(inf.m), delta=1e-4)

  @parameterized.parameters(*VARIANTS, "priority_blend")
  def test_hajek_unbiased_within_monte_carlo_error(self, name):
    """4000 draws. The Horvitz-Thompson numerator sum_S a v / pi and
    denominator sum_S a / pi are exactly unbiased: each coordinate's mean is
    within 4 standard errors (sample sd / sqrt(4000)) of the full-cache value.
    The Hajek ratio o_hat is unbiased to second order: its mean is within
    4 standard errors plus the oracle second-order bias
    (diagnostics.linearized_moments) of the full-cache output o (Poisson
    tails only: a priority tail's pi is conditional on the draw's tau)."""
    n_draws = 4000
    design = _make(name, budget=24)
    c = _cache(design, peaky=2.0)
    q = jax.random.normal(jax.random.PRNGKey(11), (D,))
    keys = jax.random.split(jax.random.PRNGKey(5), n_draws)
    out, _, info = jax.jit(jax.vmap(lambda k: design.evict(c, design.init(c), k)))(keys)
    s = np.asarray(c.k @ q / math.sqrt(D), np.float64)
    valid = np.asarray(c.valid)
    a = np.where(valid, np.exp(s - s[valid].max()), 0.0)
    vals = np.asarray(c.v, np.float64)
    full_num, full_den = (a[:, None] * vals).sum(0), a.sum()
    w = np.where(np.asarray(out.valid), a * np.exp(-np.asarray(out.log_pi, np.float64)), 0.0)
    num, den = w @ vals, w.sum(1)  # [draws, D], [draws]
    se = lambda x: x.std(0, ddof=1) / math.sqrt(n_draws)
    self.assertTrue(np.all(np.abs(num.mean(0) - full_num) <= 4 * se(num)), name)
    self.assertLessEqual(abs(den.mean() - full_den), 4 * se(den), name)
    if name == "priority_blend":  # its pi depends on the draw's tau: no one-draw oracle bias
      return
    o_hat = num / den[:, None]
    pi = np.asarray(info.pi[0])
    moments = diagnostics.linearized_moments(q, c.k, c.v, c.valid, jnp.asarray(pi))
    np.testing.assert_allclose(moments.full, full_num / full_den, rtol=1e-4, atol=1e-5)
    gap = np.abs(o_hat.mean(0) - full_num / full_den)
    self.assertTrue(np.all(gap <= 4 * se(o_hat) + np.abs(np.asarray(moments.bias))), name)
    self.assertGreater(float(np.mean(np.asarray(out.n_valid))), 6)  # it did sample

  def _pi_and_tail(self, design, c):
    _, _, info = _evict(design, c, jax.random.PRNGKey(0))
    pi = np.asarray(info.pi)
    tail = np.asarray(c.valid & ~info.certain) & (pi < 1.0)
    return pi, tail

  def test_assumption2_ratio_adversarial_query(self):
    """A query whose attention concentrates on poisson_tail's lowest-score tail
    token (among the tokens a query can single out: the keys k_j with
    |k_j| > max_i k_i . k_j / |k_j|), after very peaky history queries: R is
    huge for poisson_tail, and for poisson_defensive it is over 100 times
    smaller and under the derived bound n max_T p / u."""
    u = 0.2
    c = _cache(peaky=12.0)
    base = designs.poisson_tail(32, certain=designs.CertaintySet(n_sink=2, window=4))
    dfn = designs.poisson_defensive(32, certain=designs.CertaintySet(n_sink=2, window=4),
                                    uniform_share=u)
    pi_base, tail_base = self._pi_and_tail(base, c)
    pi_def, tail_def = self._pi_and_tail(dfn, c)
    k = np.asarray(c.k, np.float64)[:N]
    norms = np.linalg.norm(k, axis=1)
    proj = k @ (k / norms[:, None]).T  # [i, j] = k_i . k_j / |k_j|
    np.fill_diagonal(proj, -np.inf)
    margin = norms - proj.max(axis=0)
    reachable = tail_base[:N] & (margin > 0)
    j = int(np.argmin(np.where(reachable, np.asarray(c.acc)[:N], np.inf)))
    q = jnp.asarray(k[j] / norms[j] * 8.0 * math.sqrt(D) / margin[j], jnp.float32)
    ratio = lambda pi, tail: float(diagnostics.assumption2_ratio(
        q, c.k, c.valid, jnp.asarray(tail), jnp.asarray(pi)))
    r_base, r_def = ratio(pi_base, tail_base), ratio(pi_def, tail_def)
    p = np.asarray(_probs(c, q))
    self.assertGreater(p[j], 0.99)  # the query does concentrate on token j
    self.assertLess(pi_base[j], 1e-4)
    bound = N * p[tail_def].max() / u
    self.assertLessEqual(r_def, bound * (1 + 1e-4))
    self.assertGreater(r_base, 100 * r_def, (r_base, r_def))

  def test_assumption2_bound_for_random_queries(self):
    """R <= n max_T p / u for poisson_defensive, whatever the query."""
    u = 0.2
    c = _cache(peaky=5.0)
    pi, tail = self._pi_and_tail(_make("poisson_defensive", uniform_share=u), c)
    qs = 3.0 * jax.random.normal(jax.random.PRNGKey(3), (64, D))
    r = np.asarray(diagnostics.assumption2_ratio(qs, c.k, c.valid, jnp.asarray(tail),
                                                 jnp.asarray(pi)))
    p = np.asarray(_probs(c, qs))
    bound = N * np.where(tail, p, 0.0).max(-1) / u
    self.assertTrue(np.all(r <= bound * (1 + 1e-4)))

  def test_envelope_bound_for_window_queries(self):
    """For each observed window query and head, poisson_envelope's R is at most
    O / (1 - u) with O = sum_valid obs (the envelope's total)."""
    u = 0.2
    design = _make("poisson_envelope", uniform_share=u)
    c = _cache(design, peaky=5.0)
    pi, tail = self._pi_and_tail(design, c)
    win = _problem(peaky=5.0)[3].reshape(G * N_WIN, D)
    r = np.asarray(diagnostics.assumption2_ratio(win, c.k, c.valid, jnp.asarray(tail),
                                                 jnp.asarray(pi)))
    total = float(np.asarray(c.obs)[np.asarray(c.valid)].sum())
    self.assertTrue(1.0 - 1e-5 <= total <= G * N_WIN + 1e-5)
    self.assertTrue(np.all(r <= total / (1 - u) * (1 + 1e-4)), (r, total))


if __name__ == "__main__":
  absltest.main()
