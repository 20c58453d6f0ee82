"""Priority sampling (``sampling.priority_draw``, ``PriorityTail``) by seeded Monte Carlo.

Duffield, Lund and Thorup (2007): with priorities ``q_i = w_i / u_i`` and the
``k`` highest kept, ``pi_i = min(1, w_i / tau)`` (``tau`` the (k+1)-th
priority) makes the Horvitz-Thompson terms ``1{kept} / pi_i`` unbiased with
zero covariance. Every tolerance below is a multiple of a Monte Carlo standard
error estimated from the same draws, with fixed seeds, so the tests are
deterministic and can fail. Figures quoted in comments were measured with
these seeds on CPU (jax 0.10.2).
"""

import functools
import math

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certkv_jax import attention
from certkv_jax.certificate import montecarlo
from certkv_jax import designs
from certkv_jax.designs import sampling
from certkv_jax.kv import cache as cache_lib

Z = 4.5  # two-sided normal tail 6.8e-6 per statistic


def _draws(score, mask, slots, n_draws, seed, eps=1e-6):
  """``n_draws`` priority draws (vmapped, one compile; ``slots`` traced)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), n_draws)
  score = jnp.asarray(score, jnp.float32)
  mask = jnp.asarray(mask)
  f = jax.jit(jax.vmap(lambda k, s: sampling.priority_draw(k, score, mask, s, eps),
                       in_axes=(0, None)))
  return jax.tree_util.tree_map(np.asarray, f(keys, jnp.asarray(slots, jnp.int32)))


def _z(x, truth):
  """(mean - truth) / standard error, from the draws (axis 0)."""
  x = np.asarray(x, np.float64)
  se = x.std(0, ddof=1) / math.sqrt(x.shape[0])
  return (x.mean(0) - truth) / se


# A skewed problem: 32 tokens, 28 of them in the tail, gamma(0.5) weights
# (a few tokens carry most of the mass), k = 8 slots. eps = 0.05 floors each
# weight at 5% of the tail mean, so the smallest pi is ~0.01 and even the
# lightest token is kept ~100 times in N_DRAWS draws: the CLT z-scores of the
# heavy-tailed terms 1{kept}/pi are reliable.
N_TOK, K_SLOTS, EPS, N_DRAWS = 32, 8, 0.05, 4000


@functools.lru_cache(maxsize=None)
def _skewed():
  rng = np.random.default_rng(7)
  score = rng.gamma(0.5, size=N_TOK).astype(np.float32)
  mask = np.ones(N_TOK, bool)
  mask[[0, 5, 17, 30]] = False  # off the tail: never kept, pi = 0
  a = score / score[mask].sum()  # "attention" of the tail tokens
  v = rng.normal(size=N_TOK).astype(np.float32)
  x = np.where(mask, a * v, 0.0)  # a numerator term a_i v_i
  d = _draws(score, mask, K_SLOTS, N_DRAWS, seed=1, eps=EPS)
  return score, mask, a, x, d


class ExactSizeTest(absltest.TestCase):

  def test_keeps_exactly_min_slots_tail(self):
    rng = np.random.default_rng(0)
    score = rng.gamma(0.5, size=40).astype(np.float32)
    mask = rng.random(40) < 0.6
    n_t = int(mask.sum())
    f = jax.jit(jax.vmap(lambda k, s: sampling.priority_draw(k, score, mask, s),
                         in_axes=(0, None)))
    keys = jax.random.split(jax.random.PRNGKey(0), 200)
    # One compiled program for every slot count: slots is traced.
    for slots in (0, 1, 7, n_t - 1, n_t, n_t + 5):
      d = jax.tree_util.tree_map(np.asarray, f(keys, jnp.int32(slots)))
      np.testing.assert_array_equal(d.keep.sum(-1), min(slots, n_t), err_msg=str(slots))
      self.assertFalse((d.keep & ~mask).any())
      self.assertTrue((d.pi[:, ~mask] == 0).all())
      if 0 < slots:
        on = d.pi[:, mask]
        self.assertTrue(((on > 0) & (on <= 1)).all(), slots)
        # A token left out had priority w/u below the smallest kept one, so its
        # pi = w / q_min_kept < u <= 1.
        self.assertTrue((d.pi[mask[None] & ~d.keep] < 1).all(), slots)
      if slots >= n_t:  # everything kept, with certainty
        self.assertTrue(d.keep[:, mask].all())
        np.testing.assert_array_equal(d.pi[:, mask], 1.0)
        np.testing.assert_array_equal(d.tau, 0.0)
      elif slots > 0:
        # A kept token's pi is P(u < w / tau) with the returned tau: min(1, w / tau) on
        # the 2^-23 grid of the draw's u (sampling.below); atol: two grid steps, for w's
        # float32 rounding here and there.
        w = score + 1e-6 * score[mask].mean()
        want = np.minimum(1.0, w[None] / d.tau[:, None])
        got = d.pi[d.keep]
        np.testing.assert_allclose(got, np.broadcast_to(want, d.pi.shape)[d.keep], rtol=0,
                                   atol=2.0**-22)
        np.testing.assert_array_equal(got * 2.0**23, np.round(got * 2.0**23))
        self.assertTrue((d.tau > 0).all())

  def test_per_row_traced_slots(self):
    rng = np.random.default_rng(1)
    score = jnp.asarray(rng.gamma(0.5, size=(4, 24)), jnp.float32)
    mask = jnp.asarray(rng.random((4, 24)) < 0.7)
    slots = jnp.array([0, 3, 10, 30], jnp.int32)
    d = jax.jit(sampling.priority_draw)(jax.random.PRNGKey(3), score, mask, slots)
    want = np.minimum(np.asarray(slots), np.asarray(mask).sum(-1))
    np.testing.assert_array_equal(np.asarray(d.keep).sum(-1), want)

  def test_zero_scores_are_uniform(self):
    # All-zero scores: every weight is 1, so each of the 20 tokens is kept with
    # probability 6/20, and 1{kept}/pi still has mean 1.
    n, k, n_draws = 20, 6, 4000
    d = _draws(np.zeros(n, np.float32), np.ones(n, bool), k, n_draws, seed=2)
    np.testing.assert_array_equal(d.keep.sum(-1), k)
    freq = d.keep.mean(0)
    p = k / n
    z_freq = (freq - p) / math.sqrt(p * (1 - p) / n_draws)
    # 20 binomial frequencies, 4.5 binomial SEs each (family-wise ~1e-4).
    # Measured: max |z| = 1.8.
    self.assertLess(np.abs(z_freq).max(), Z, z_freq)
    ht = np.where(d.keep, 1.0 / np.where(d.keep, d.pi, 1.0), 0.0)
    z_ht = _z(ht, 1.0)
    # Same bound for the 20 HT terms. Measured: max |z| = 2.4.
    self.assertLess(np.abs(z_ht).max(), Z, z_ht)


class DiscreteUniformTest(absltest.TestCase):
  """``pi`` is the probability that the draw's float32 uniform (2^23 levels) falls below
  its threshold (priority: ``u = 1 - U < w / tau``; Poisson: ``U < pi``), not the
  threshold itself, which the grid cannot realize below 2^-23 or between its steps."""

  def test_uniforms_lie_on_the_grid_and_the_probabilities_count_it(self):
    big = np.asarray(jax.random.uniform(jax.random.PRNGKey(0), (1 << 20,)))
    j = big * 2.0**23
    np.testing.assert_array_equal(j, np.round(j))  # U = j / 2^23, as reached / below assume
    self.assertGreaterEqual(j.min(), 0.0)
    self.assertLess(j.max(), 2.0**23)
    grid = np.arange(2**23, dtype=np.float64) / 2.0**23  # every value of U
    for x in (0.5 / 2**23, 1.0 / 2**23, 1.5 / 2**23, 7.3 / 2**23, 1e-3, 0.3, 1.0, 2.0):
      x32 = np.float32(x)
      self.assertEqual(float(sampling.reached(jnp.float32(x))), np.mean(grid < x32), x)
      self.assertEqual(float(sampling.below(jnp.float32(x))), np.mean(1.0 - grid < x32), x)

  def test_an_unreachable_token_gets_pi_zero(self):
    # Zero scores at a relative floor of 1e-6 give w / tau under 2^-23: never drawn.
    rng = np.random.default_rng(0)
    score = rng.random(1000).astype(np.float32)
    score[:100] = 0.0
    d = sampling.priority_draw(jax.random.PRNGKey(1), jnp.asarray(score),
                               jnp.ones(1000, bool), 50)
    w = 1e-6 * score.mean()
    self.assertLess(w / float(d.tau), 2.0**-23)
    np.testing.assert_array_equal(np.asarray(d.pi)[:100], 0.0)  # before: w / tau, about 5e-8


class UnbiasednessTest(absltest.TestCase):

  def test_horvitz_thompson_numerator_and_normalizer(self):
    _, _, a, x, d = _skewed()
    inv = np.where(d.keep, 1.0 / np.where(d.keep, d.pi, 1.0), 0.0)
    num = (inv * x).sum(-1)  # sum_kept a_i v_i / pi_i
    den = (inv * a).sum(-1)  # sum_kept a_i / pi_i
    z_num, z_den = _z(num, x.sum()), _z(den, 1.0)
    # Measured: z = -1.38 (num), -0.58 (den);
    # with tau the k-th instead of the (k+1)-th priority: z = 28.6 (den).
    self.assertLess(abs(z_num), Z, (num.mean(), x.sum()))
    self.assertLess(abs(z_den), Z, den.mean())

  def test_each_token_has_unit_expected_weight(self):
    _, mask, _, _, d = _skewed()
    inv = np.where(d.keep, 1.0 / np.where(d.keep, d.pi, 1.0), 0.0)[:, mask]
    z = _z(inv, 1.0)
    # 28 tail tokens, Bonferroni: two-sided 4.5 SEs per token gives a
    # family-wise false alarm of 28 * 6.8e-6 = 2e-4 under normality.
    # Measured: max |z| = 2.45 (16.4 with the k-th priority as tau).
    self.assertLess(np.abs(z).max(), Z, z)
    # Every tail token was kept often enough for the CLT (eps floor).
    self.assertGreater(d.keep[:, mask].sum(0).min(), 30)

  def test_variance_estimator(self):
    _, _, _, x, d = _skewed()
    pi = np.where(d.keep, d.pi, 1.0).astype(np.float64)
    y = np.where(d.keep, x / pi, 0.0).sum(-1)  # HT estimate of sum x
    v_hat = np.where(d.keep, x**2 * (1.0 - pi) / pi**2, 0.0).sum(-1)
    # E[V_hat] - Var(Y) from the per-draw difference d_j = V_hat_j - (Y_j - mean)^2
    # (the influence function of the sample variance): its mean is the gap and
    # its standard deviation / sqrt(N) the gap's standard error (the mean's
    # own estimation error is O(1/N)).
    n = y.shape[0]
    gap = v_hat - (y - y.mean())**2 * n / (n - 1)
    z = gap.mean() / (gap.std(ddof=1) / math.sqrt(n))
    # 4.5 SEs. Measured: E[V_hat] 0.0315, Var(Y) 0.0337, z = -2.35 (with
    # 40,000 draws on 5 other seeds: |z| <= 2.5, gap < 2.5%; the terms are heavy-tailed).
    self.assertLess(abs(z), Z, (v_hat.mean(), y.var(ddof=1)))
    self.assertGreater(y.var(), 0.0)


# --------------------------------------------------------------------------- the design


STREAM = dict(cap=48, d=8, first=40, second=24, budget=16, n_sink=2, window=2)
N_STREAM_DRAWS = 3000


@functools.lru_cache(maxsize=None)
def _two_rounds(heavy_share=0.0, blend=False):
  """Two evictions of priority_tail (``blend``: priority_blend with ``heavy_share``
  as its window_share, or ``"focus"``: priority_focus; each query folded as an
  observation window) with an append in between, N draws."""
  s = STREAM
  rng = np.random.default_rng(3)
  n_total = s["first"] + s["second"]
  k_all = jnp.asarray(rng.normal(size=(n_total, s["d"])), jnp.float32)
  v_all = jnp.asarray(rng.normal(size=(n_total, s["d"])), jnp.float32)
  queries = jnp.asarray(rng.normal(size=(2, s["d"])), jnp.float32)
  certain = designs.CertaintySet(n_sink=s["n_sink"], window=s["window"])
  if blend == "focus":  # a wide focused range: the weight moves with the window
    design = designs.priority_focus(s["budget"], certain=certain,
                                    focus=designs.Focus(focused=0.1, diffuse=0.9), min_tail=0)
  elif blend == "focus_share":  # and a share by the window's rank that moves with it
    design = designs.priority_focus(s["budget"], certain=certain,
                                    focus=designs.Focus(focused=0.5, diffuse=1.0), min_tail=0,
                                    focus_share=0.9)
  elif blend:
    design = designs.priority_blend(s["budget"], certain=certain, window_share=heavy_share,
                                    min_tail=0)
  else:
    design = designs.priority_tail(s["budget"], certain=certain, heavy_share=heavy_share)

  def fold(c, st, q):  # the query's attention over the kept slots, with offsets
    probs = attention.attention_probs(q, c.k, c.log_pi, c.valid)
    return design.update(c, st, probs, observation=bool(blend))

  def one(key):
    k1, k2 = jax.random.split(key)
    c = cache_lib.init_cache(s["cap"], s["d"])
    st = design.init(c)
    c = cache_lib.append(c, k_all[:s["first"]], v_all[:s["first"]])
    c, st = fold(c, st, queries[0])
    c, st, info1 = design.evict(c, st, k1)
    c = cache_lib.append(c, k_all[s["first"]:], v_all[s["first"]:])
    c, st = fold(c, st, queries[1])
    c, st, info2 = design.evict(c, st, k2)
    return c, info1.triggered & info2.triggered, info1.pi, info2.pi

  keys = jax.random.split(jax.random.PRNGKey(4), N_STREAM_DRAWS)
  out = jax.tree_util.tree_map(np.asarray, jax.jit(jax.vmap(one))(keys))
  return out + (n_total,)


class CompositionTest(absltest.TestCase):

  def _assert_unbiased(self, c, n_total):
    """The two-round Hajek weights estimate a fixed f(pos) and the token count
    (f = 1) without bias: two statistics, 4.5 SEs each."""
    w = np.where(c.valid, np.exp(-c.log_pi.astype(np.float64)), 0.0)
    g = np.random.default_rng(5).normal(size=n_total) + 0.5  # a fixed f(pos)
    est_g = (w * np.where(c.valid, g[np.maximum(c.pos, 0)], 0.0)).sum(-1)
    z_g, z_n = _z(est_g, g.sum()), _z(w.sum(-1), float(n_total))
    self.assertLess(abs(z_g), Z, (est_g.mean(), g.sum()))
    self.assertLess(abs(z_n), Z, (w.sum(-1).mean(), n_total))

  def test_hajek_weights_compose_across_rounds(self):
    c, triggered, _, _, n_total = _two_rounds()
    self.assertTrue(triggered.all())
    np.testing.assert_array_equal(c.valid.sum(-1), STREAM["budget"])  # fixed size
    np.testing.assert_array_equal(c.n_dropped, 0)
    # Measured: z = -0.33 (f = g), 0.94 (f = 1, the number of tokens seen);
    # with only the second round's offset (not cumulative) z_n = -88; with tau
    # the k-th instead of the (k+1)-th priority z_n = 19.3.
    self._assert_unbiased(c, n_total)

  def test_heavy_share_keeps_the_top_and_stays_unbiased(self):
    # heavy_share 0.5: of the 12 tail slots (16 minus 2 sinks and 2 recent),
    # 6 go to the top-scored tail tokens with pi = 1, 6 are priority-sampled
    # among the rest; the two-round Hajek weights must stay unbiased.
    c, triggered, pi1, _, n_total = _two_rounds(0.5)
    self.assertTrue(triggered.all())
    np.testing.assert_array_equal(c.valid.sum(-1), STREAM["budget"])
    certain_pi1 = (pi1 == 1.0).sum(-1)  # sinks, recent and the top share (and ties)
    self.assertTrue((certain_pi1 >= STREAM["n_sink"] + STREAM["window"] + 6).all())
    # Measured: z = 0.61 (f = g), 0.88 (f = 1).
    self._assert_unbiased(c, n_total)

  def test_blend_with_a_window_share_stays_unbiased(self):
    # priority_blend: 6 of the 12 tail slots go to the top of the pooled window
    # attention with pi = 1, 6 are priority-sampled by the blended weights.
    c, triggered, pi1, _, n_total = _two_rounds(0.5, blend=True)
    self.assertTrue(triggered.all())
    np.testing.assert_array_equal(c.valid.sum(-1), STREAM["budget"])
    self.assertTrue(((pi1 == 1.0).sum(-1) >= STREAM["n_sink"] + STREAM["window"] + 6).all())
    # Measured: z = -1.41 (f = g), -0.48 (f = 1).
    self._assert_unbiased(c, n_total)

  def test_focus_blend_stays_unbiased(self):
    # priority_focus: the window weight is a function of the cache before the
    # draw, so the weights are fixed when drawn and the two-round Hajek
    # weights stay unbiased.
    c, triggered, _, _, n_total = _two_rounds(blend="focus")
    self.assertTrue(triggered.all())
    np.testing.assert_array_equal(c.valid.sum(-1), STREAM["budget"])
    # Measured: z = -1.09 (f = g), 0.23 (f = 1).
    self._assert_unbiased(c, n_total)

  def test_focused_share_stays_unbiased(self):
    # priority_focus with focus_share: how many slots go by the window's rank
    # is a function of the cache before the draw, so those tokens form a
    # round's certainty set and the sampled rest keeps the two-round Hajek
    # weights unbiased.
    c, triggered, pi1, _, n_total = _two_rounds(blend="focus_share")
    self.assertTrue(triggered.all())
    np.testing.assert_array_equal(c.valid.sum(-1), STREAM["budget"])
    base = STREAM["n_sink"] + STREAM["window"]
    # The share acts: measured 3.0 more certain tokens per draw than the
    # certainty set, against 0.18 (ties at the top) for priority_focus alone.
    self.assertGreater(float(((pi1 == 1.0).sum(-1) - base).mean()), 2.5)
    # Measured: z = -0.83 (f = g), 0.90 (f = 1).
    self._assert_unbiased(c, n_total)

  def test_heavy_share_out_of_range_is_refused(self):
    for bad in (1.0, -0.1, True):
      with self.assertRaisesRegex(ValueError, "heavy_share"):
        designs.priority_tail(16, heavy_share=bad)
      with self.assertRaisesRegex(ValueError, "window_share must be a float in"):
        designs.priority_blend(16, window_share=bad)

  def test_offsets_are_cumulative(self):
    # Slots stay in place (eviction zeroes, append fills free slots), so a
    # survivor of both rounds has log_pi = log pi_round1 + log pi_round2 of
    # its slot, and a token appended after round 1 has log pi_round2 only.
    c, _, pi1, pi2, _ = _two_rounds()
    first = c.valid & (c.pos < STREAM["first"])
    want = np.where(first, np.log(np.where(first, pi1, 1.0)), 0.0) + np.log(
        np.where(c.valid, pi2, 1.0))
    np.testing.assert_allclose(np.where(c.valid, c.log_pi, 0.0), want, rtol=1e-5, atol=1e-6)
    both = first & (pi1 < 1) & (pi2 < 1)
    self.assertGreater(both.sum(), 0)  # some draws keep tail tokens through both rounds


N_MC = 2000
MC_BUDGET = dict(budget=48, certain=designs.CertaintySet(n_sink=4, window=8))  # of 128
# Two problems: Gaussian keys/values, and a sharper query with one spike
# token (aligned key, outlying value) in the middle of the tail.
MC_PROBLEMS = (dict(q_scale=1.0, spikes=0), dict(q_scale=2.0, spikes=1))


@functools.lru_cache(maxsize=None)
def _coverage_runs():
  out = []
  for i, kw in enumerate(MC_PROBLEMS):
    problem = montecarlo.synthetic_problem(jax.random.PRNGKey(i), n=128, **kw)
    keys = jax.random.split(jax.random.PRNGKey(10 + i), N_MC)
    _, trials = montecarlo.run_trials(problem, designs.priority_tail(**MC_BUDGET), keys)
    out.append((problem, trials))
  return out


def _ratio_se(x, y):
  """Delta-method standard error of mean(x) / mean(y) from paired samples."""
  mx, my = x.mean(), y.mean()
  cov = np.cov(x, y)
  var = (cov[0, 0] / mx**2 + cov[1, 1] / my**2 - 2 * cov[0, 1] / (mx * my)) * (mx / my)**2
  return math.sqrt(var / len(x))


@pytest.mark.slow  # 17 s cold on the 2-core CI machine (2026-12-01)
class CoverageTest(absltest.TestCase):

  def test_radius_miss_rate(self):
    misses, sharp = [], []
    for _, trials in _coverage_runs():
      s = montecarlo.summarize(np.zeros(16), trials, deltas=(0.05,))
      misses.append(1.0 - s.coverage[0.05])
      sharp.append(s.sharpness[0.05])
    miss = float(np.mean(misses))  # pooled over 2 problems x 2000 draws
    # Nominal 0.05. The Bernstein radius uses plug-ins (N_hat, o_hat, V_hat)
    # and the Hajek linearisation, so it is approximate: 0.10 allows 0.05 for
    # that. The binomial SE of a 0.05 rate over 4000 draws is 0.0034, so
    # 0.10 is ~15 SEs above nominal: crossing it means a miscalibrated
    # radius, not chance. Measured: 0.0 and 0.004 (pooled 0.002).
    self.assertLessEqual(miss, 0.10, misses)
    # ... and it does not cover by being absurdly wide. Measured median
    # r/||e|| over covered draws: 3.4 and 4.7.
    self.assertLess(max(sharp), 10.0, sharp)

  def test_variance_estimate_matches_squared_error(self):
    for _, trials in _coverage_runs():
      err2 = np.asarray(trials.error, np.float64)**2
      vhat = np.asarray(trials.var_hat, np.float64)
      ratio = vhat.mean() / err2.mean()
      # E[V_hat] / E||e||^2: 4.5 delta-method SEs plus 5% for the terms the
      # linearisation drops (as tests/certkv_jax/certificate/montecarlo_test.py). Measured: 0.969, 0.996.
      self.assertLess(abs(ratio - 1.0), Z * _ratio_se(vhat, err2) + 0.05, ratio)


@pytest.mark.slow  # shares CoverageTest's Monte Carlo runs (slow tier)
class FillTest(absltest.TestCase):

  def test_priority_fills_every_slot_poisson_does_not(self):
    problem, trials = _coverage_runs()[0]
    kept = np.asarray(trials.n_kept)
    np.testing.assert_array_equal(kept, MC_BUDGET["budget"])  # every draw, exactly
    keys = jax.random.split(jax.random.PRNGKey(20), 500)
    _, poisson = montecarlo.run_trials(problem, designs.poisson_tail(**MC_BUDGET), keys)
    p_kept = np.asarray(poisson.n_kept)
    self.assertLessEqual(p_kept.max(), MC_BUDGET["budget"])
    # Poisson reserves its slots for a random count (E[X] = m < slots), so it
    # keeps strictly fewer on average. Measured: mean 30.7 vs 48.
    self.assertLess(p_kept.mean(), kept.mean())


if __name__ == "__main__":
  absltest.main()
