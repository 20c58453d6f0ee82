"""experiments.lib.stats on inputs with known answers."""

import itertools
import math

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
from scipy import stats as sps

from experiments.lib import stats


def _brute_auc(scores, labels):
  pos = [s for s, y in zip(scores, labels) if y]
  neg = [s for s, y in zip(scores, labels) if not y]
  total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
  return total / (len(pos) * len(neg))


class RocTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("perfect", [0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1], 1.0),
      ("inverted", [0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1], 0.0),
      # pairs (pos, neg): (0.5,0.5)=1/2, (0.5,0.1)=1, (0.9,0.5)=1, (0.9,0.1)=1 -> 3.5/4
      ("tie", [0.1, 0.5, 0.5, 0.9], [0, 0, 1, 1], 0.875),
      ("all_tied", [1.0, 1.0, 1.0], [0, 1, 1], 0.5),
      # pos {3, 1}, neg {2, 2}: (3,2)x2 = 2, (1,2)x2 = 0 -> 2/4
      ("half", [3.0, 2.0, 2.0, 1.0], [1, 0, 0, 1], 0.5),
  )
  def test_hand_computed(self, scores, labels, want):
    self.assertAlmostEqual(stats.roc_auc(scores, labels), want)

  def test_matches_brute_force_and_curve_area(self):
    rng = np.random.default_rng(0)
    for _ in range(5):
      s = rng.integers(0, 6, 60).astype(float)  # many ties
      y = rng.random(60) < 0.4
      auc = stats.roc_auc(s, y)
      self.assertAlmostEqual(auc, _brute_auc(s, y), places=12)
      c = stats.roc_curve(s, y)
      self.assertAlmostEqual(auc, float(np.trapezoid(c.tpr, c.fpr)), places=12)
      self.assertEqual((c.fpr[0], c.tpr[0], c.fpr[-1], c.tpr[-1]), (0.0, 0.0, 1.0, 1.0))
      self.assertTrue(np.all(np.diff(c.thresholds) < 0))

  @parameterized.parameters(([1, 2], [1, 1]), ([1, 2], [0, 0]), ([1, 2, 3], [0, 1]),
                            ([1, float("nan")], [0, 1]), ([1, 2], [0, 2]))
  def test_errors(self, scores, labels):
    with self.assertRaises(ValueError):
      stats.roc_auc(scores, labels)

  def test_single_class_error_names_labels(self):
    with self.assertRaisesRegex(ValueError, "both classes"):
      stats.roc_auc([1, 2, 3], [True, True, True])

  def test_failure_and_attribution(self):
    score = np.array([0.9, 0.8, 0.1, 0.7, 0.2, 0.3])
    ev = np.array([0, 0, 1, 0, 1, 0], bool)
    full = np.array([1, 1, 1, 0, 1, 0], bool)
    # failures (ev False) are 0.9, 0.8, 0.7, 0.3; successes 0.1, 0.2: perfect
    self.assertEqual(stats.failure_auc(score, ev), 1.0)
    # among failures: cache-induced (full right) 0.9, 0.8; inherent 0.7, 0.3
    self.assertEqual(stats.attribution_auc(score, full, ev), 1.0)
    self.assertEqual(stats.attribution_auc(-score, full, ev), 0.0)

  def test_stratified_auc_counts_within_stratum_pairs_only(self):
    # Stratum a: positives 3, 1 vs negative 2 -> 1/2; stratum b: positive 0 vs
    # negatives 5, 4 -> 0; stratum c has one class and no pair. Pooled AUC would
    # compare across strata; the stratified one is (1 + 0) / (2 + 2) = 0.25.
    s = np.array([3, 1, 2, 0, 5, 4, 9], float)
    y = np.array([1, 1, 0, 1, 0, 0, 1], bool)
    g = np.array(["a", "a", "a", "b", "b", "b", "c"])
    self.assertAlmostEqual(stats.stratified_auc(s, y, g), 0.25)
    rng = np.random.default_rng(3)  # brute force on random strata with ties
    s, y, g = rng.integers(0, 4, 60).astype(float), rng.random(60) < 0.4, rng.integers(0, 3, 60)
    num = den = 0.0
    for i in range(60):
      for j in range(60):
        if y[i] and not y[j] and g[i] == g[j]:
          num += 1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0
          den += 1
    self.assertAlmostEqual(stats.stratified_auc(s, y, g), num / den, places=12)
    with self.assertRaisesRegex(ValueError, "no stratum contains both classes"):
      stats.stratified_auc([1, 2], [True, False], ["a", "b"])
    with self.assertRaisesRegex(ValueError, "strata must be finite labels"):
      stats.stratified_auc([1, 2, 3, 4], [True, False, True, False], [0, 0, np.nan, np.nan])

  def test_stratified_attribution_separates_task_from_score(self):
    # Task A's failures are all cache-induced, task B's all inherent: a score that
    # only knows the task reaches pooled AUC 1 but has no within-task pair.
    task = np.array(["A"] * 4 + ["B"] * 4)
    ev = np.zeros(8, bool)
    full = task == "A"
    self.assertEqual(stats.attribution_auc(full.astype(float), full, ev), 1.0)
    with self.assertRaisesRegex(ValueError, "no stratum"):
      stats.stratified_attribution_auc(full.astype(float), full, ev, task)
    full[[1, 5]] = ~full[[1, 5]]  # one failure of each kind in each task
    score = np.array([4, 0, 3, 2, 1, 9, 0, 0], float)
    # A: cache-induced 4, 3, 2 vs inherent 0 -> 3/3; B: cache-induced 9 vs 1, 0, 0 -> 3/3
    self.assertEqual(stats.stratified_attribution_auc(score, full, ev, task), 1.0)


class BootstrapTest(absltest.TestCase):

  def test_normal_mean_contains_truth_and_is_deterministic(self):
    x = np.random.default_rng(1).normal(2.0, 1.0, 400)
    ci = stats.bootstrap_ci(np.mean, x, n_boot=500, seed=3)
    self.assertLess(ci.lo, 2.0)
    self.assertGreater(ci.hi, 2.0)
    self.assertAlmostEqual(ci.estimate, float(x.mean()))
    # width ~ 2 * 1.96 / sqrt(400) = 0.196
    self.assertAlmostEqual(ci.hi - ci.lo, 0.196, delta=0.04)
    self.assertEqual(ci, stats.bootstrap_ci(np.mean, x, n_boot=500, seed=3))
    self.assertNotEqual(ci, stats.bootstrap_ci(np.mean, x, n_boot=500, seed=4))

  def test_paired_and_stratified(self):
    rng = np.random.default_rng(2)
    y = rng.random(80) < 0.1  # few positives: plain resamples may lose them
    s = y + rng.normal(0, 1, 80)
    ci = stats.bootstrap_ci(stats.roc_auc, s, y, n_boot=200, seed=0, strata=y)
    self.assertLessEqual(ci.lo, ci.estimate)
    self.assertLessEqual(ci.estimate, ci.hi)
    # paired: the difference of identical arrays is 0 in every resample
    d = stats.bootstrap_ci(lambda a, b: np.mean(a - b), s, s, n_boot=50, seed=0)
    self.assertEqual((d.lo, d.hi), (0.0, 0.0))
    # A NaN label matched no stratum, so its examples were never resampled (before).
    with self.assertRaisesRegex(ValueError, "strata must be finite labels, got 1 non-finite"):
      stats.bootstrap_ci(np.mean, s, strata=np.where(np.arange(80) == 3, np.nan, 1.0))

  def test_cluster(self):
    rng = np.random.default_rng(3)
    groups = np.repeat(np.arange(30), 20)
    x = rng.normal(0, 1, 30)[groups] + rng.normal(0, 0.1, 600)  # strongly clustered
    naive = stats.bootstrap_ci(np.mean, x, n_boot=300, seed=0)
    clus = stats.cluster_bootstrap_ci(np.mean, x, groups=groups, n_boot=300, seed=0)
    self.assertAlmostEqual(naive.estimate, clus.estimate)
    self.assertGreater(clus.hi - clus.lo, 2.5 * (naive.hi - naive.lo))  # ~sqrt(20) wider
    self.assertEqual(clus, stats.cluster_bootstrap_ci(np.mean, x, groups=groups, n_boot=300,
                                                      seed=0))

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "n_boot"):
      stats.bootstrap_ci(np.mean, [1.0, 2.0], n_boot=1)
    with self.assertRaisesRegex(ValueError, "alpha"):
      stats.bootstrap_ci(np.mean, [1.0, 2.0], alpha=1.5)
    with self.assertRaisesRegex(ValueError, "first-axis"):
      stats.bootstrap_ci(lambda a, b: 0.0, [1.0, 2.0], [1.0])
    with self.assertRaisesRegex(ValueError, "groups"):
      stats.cluster_bootstrap_ci(np.mean, [1.0, 2.0], groups=[0, 0])
    # A NaN group was never resampled while the estimate used its rows.
    with self.assertRaisesRegex(ValueError, "groups must be finite labels, got 2 non-finite"):
      stats.cluster_bootstrap_ci(np.mean, [0.0, 0.0, 1.0, 1.0, 99.0, 99.0],
                                 groups=[0, 0, 1, 1, np.nan, np.nan])


class IntervalAndCoverageTest(parameterized.TestCase):

  @parameterized.parameters(  # Newcombe (1998), Stat. Med. 17:857, Table I, method 3
      (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611),
      (1, 29, 0.0061, 0.1718))
  def test_wilson_known_values(self, k, n, lo, hi):
    a, b = stats.wilson_interval(k, n)
    self.assertAlmostEqual(a, lo, places=4)
    self.assertAlmostEqual(b, hi, places=4)

  def test_wilson_errors(self):
    with self.assertRaisesRegex(ValueError, r"k must be an int in \[0, n=5\]"):
      stats.wilson_interval(6, 5)
    with self.assertRaisesRegex(ValueError, "n must be"):
      stats.wilson_interval(0, 0)

  def test_radius_matches_certkv(self):
    from certkv_jax import certificate  # pylint: disable=g-import-not-at-top
    v, b = np.array([0.0, 0.01, 0.3]), np.array([0.1, 0.02, 0.5])
    for form in ("bernstein", "chebyshev"):
      np.testing.assert_allclose(stats.radius_bernstein(v, b, 0.05, form),
                                 np.asarray(certificate.radius_from_stats(v, b, 0.05, form)),
                                 rtol=1e-6)

  def test_coverage_curve_gaussian(self):
    # |N(0, s^2)| <= s * z_{1-delta/2} with probability exactly 1 - delta
    rng = np.random.default_rng(0)
    s = rng.uniform(0.5, 2.0, 4000)
    err = np.abs(rng.normal(0, s))
    deltas = [0.5, 0.2, 0.05]
    curve = stats.coverage_curve(err, deltas,
                                 radii_fn=lambda d: s * sps.norm.ppf(1 - d / 2))
    np.testing.assert_allclose(curve.nominal, [0.5, 0.8, 0.95])
    self.assertTrue(np.all(curve.lo <= curve.nominal) and np.all(curve.nominal <= curve.hi))
    self.assertEqual(curve.n, 4000)
    # the var/range form: Bernstein radii are conservative here
    c2 = stats.coverage_curve(err, deltas, var_hat=s**2, range_hat=np.zeros_like(s))
    self.assertTrue(np.all(c2.empirical >= curve.empirical))
    with self.assertRaisesRegex(ValueError, "exactly one"):
      stats.coverage_curve(err, deltas)
    with self.assertRaisesRegex(ValueError, r"deltas .* \(0, 1\)"):
      stats.coverage_curve(err, [0.0], radii_fn=lambda d: s)

  def test_coverage_by_bins_and_sharpness(self):
    R = np.array([1, 2, 3, 4, 5, 6, 7, 8], float)
    err = np.ones(8)
    radii = np.array([2, 2, 2, 2, 0, 0, 2, 0.5])
    res = stats.coverage_by_bins(err, radii, R, bins=[0, 4.5, 8])
    np.testing.assert_array_equal(res.count, [4, 4])
    np.testing.assert_allclose(res.coverage, [1.0, 0.25])
    self.assertTrue(res.lo[1] < 0.25 < res.hi[1])
    q = stats.coverage_by_bins(err, radii, R, bins=2)
    np.testing.assert_array_equal(q.count, [4, 4])
    empty = stats.coverage_by_bins(err, radii, R, bins=[100, 200])
    self.assertTrue(np.isnan(empty.coverage[0]))
    self.assertEqual(stats.sharpness(err, radii), 2.0)
    self.assertTrue(math.isnan(stats.sharpness(err, np.zeros(8))))
    with self.assertRaisesRegex(ValueError, "bins"):
      stats.coverage_by_bins(err, radii, R, bins=[3, 1])
    # NaN would count as a miss, or fall out of every bin, unseen; an infinite R has no
    # quantile edges.
    nan_at = lambda x, i: np.where(np.arange(8) == i, np.nan, x)
    with self.assertRaisesRegex(ValueError, "radii must not contain NaN, got 1"):
      stats.sharpness(err, nan_at(radii, 2))
    with self.assertRaisesRegex(ValueError, "errors must not contain NaN"):
      stats.coverage_curve(nan_at(err, 0), [0.05], radii_fn=lambda d: radii)
    with self.assertRaisesRegex(ValueError, "R must not contain NaN"):
      stats.coverage_by_bins(err, radii, nan_at(R, 1), bins=[0, 4.5, 8])
    with self.assertRaisesRegex(ValueError, "R must be finite with bins=int"):
      stats.coverage_by_bins(err, radii, np.where(R == 8, np.inf, R), bins=2)
    inf_r = stats.coverage_by_bins(err, radii, np.where(R == 8, np.inf, R), bins=[0, 5, np.inf])
    np.testing.assert_array_equal(inf_r.count, [4, 4])


class RegressionTest(absltest.TestCase):

  def test_recovers_coefficients_and_matches_closed_form(self):
    rng = np.random.default_rng(0)
    n = 2000
    m = rng.integers(8, 512, n).astype(float)
    nt = rng.integers(10, 4000, n).astype(float)
    y = 0.7 + 0.5 * np.log(m) - 2e-4 * nt + rng.normal(0, 0.3, n)
    fit = stats.log_r_regression(np.exp(y), m, nt)
    # within 4 standard errors of the truth, and the SEs are small
    for got, se, want in zip(fit.coef, fit.se, [0.7, 0.5, -2e-4]):
      self.assertLess(abs(got - want), 4 * se)
    self.assertLess(fit.se[1], 0.02)
    self.assertAlmostEqual(fit.sigma, 0.3, delta=0.02)
    x = np.stack([np.ones(n), np.log(m), nt], 1)
    xtx_inv = np.linalg.inv(x.T @ x)
    beta = xtx_inv @ x.T @ y
    resid = y - x @ beta
    se = np.sqrt(np.diag(resid @ resid / (n - 3) * xtx_inv))
    np.testing.assert_allclose(fit.coef, beta, rtol=1e-8)
    np.testing.assert_allclose(fit.se, se, rtol=1e-8)
    self.assertEqual(fit.n, n)

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, ">= 4"):
      stats.log_r_regression([1, 2, 0, -1], [1, 2, 3, 4], [1, 2, 3, 4])
    with self.assertRaisesRegex(ValueError, "rank-deficient"):
      stats.log_r_regression([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [7, 7, 7, 7, 7])


class GatingTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(0)
    full = rng.random(200) < 0.8
    ev = full & (rng.random(200) < 0.6)
    ev[:10] = True  # a few harmful recomputes: evicted right, full wrong
    full[:10] = False
    self.gain = stats.gain_from_correct(full, ev)
    self.n_pos = int((self.gain > 0).sum())

  def test_gain(self):
    np.testing.assert_array_equal(stats.gain_from_correct([1, 1, 0, 0], [1, 0, 1, 0]),
                                  [0, 1, -1, 0])

  def test_oracle_and_random(self):
    g, n = self.gain, len(self.gain)
    b_pos = self.n_pos / n
    oracle = stats.gating_curve(g, "oracle", [0.0, b_pos / 2, b_pos, 1.0])
    self.assertEqual(oracle[0], 0.0)
    self.assertEqual(oracle[2], 1.0)
    self.assertEqual(oracle[3], 1.0)
    budgets = [0.1, 0.25, 0.5, 1.0]
    rand = stats.gating_curve(g, "random", budgets)
    np.testing.assert_allclose(rand, np.array(budgets) * g.sum() / self.n_pos)
    mc = stats.gating_curve(g, "random", budgets, n_draws=400, seed=1)
    np.testing.assert_allclose(mc, rand, atol=0.03)
    # a constant score is random gating, exactly (ties broken in expectation)
    np.testing.assert_allclose(stats.gating_curve(g, np.zeros(n), budgets), rand)
    # scoring by the gain itself is the oracle while positives remain
    np.testing.assert_allclose(stats.gating_curve(g, g, [b_pos]), [1.0])
    ratio = stats.gain_captured_ratio(g, g, [0.1])
    k = int(0.1 * n)
    self.assertAlmostEqual(float(ratio[0]), min(k, self.n_pos) / (k / n * g.sum()))

  def test_oracle_share(self):
    g, n = self.gain, len(self.gain)
    self.assertAlmostEqual(stats.oracle_share(g, g, 0.1), 1.0)  # the gain ranks as the oracle
    b = 0.25
    rand = stats.gating_curve(g, "random", [b])[0] / stats.gating_curve(g, "oracle", [b])[0]
    self.assertAlmostEqual(stats.oracle_share(g, np.zeros(n), b), rand)
    self.assertTrue(np.isnan(stats.oracle_share([0, 0, -1], [1.0, 2.0, 3.0], 0.5)))
    self.assertTrue(np.isnan(stats.oracle_share(g, g, 0.0)))  # k = 0: the oracle gets nothing

  def test_errors_and_nan(self):
    with self.assertRaisesRegex(ValueError, r"budgets .* \[0, 1\]"):
      stats.gating_curve(self.gain, "oracle", [1.5])
    with self.assertRaisesRegex(ValueError, "score"):
      stats.gating_curve(self.gain, "best", [0.5])
    self.assertTrue(np.isnan(stats.gating_curve([0, 0, -1], "oracle", [0.5])[0]))


class VerdictTest(parameterized.TestCase):

  @parameterized.parameters(
      # "higher": the claim holds on [p_lo, +inf).
      ((0.969, 0.977), (0.97, 0.99), "higher", "reproduced"),
      ((0.969, 0.977), (0.98, 0.99), "higher", "reproduced"),  # better than claimed
      ((0.969, 0.977), (0.84, 0.90, 0.93), "higher", "refuted"),
      ((0.969, 0.977), (0.95, 0.97), "higher", "inconclusive"),
      # "lower": the claim holds on (-inf, p_hi].
      ((1.8, 2.2), (1.0, 1.2), "lower", "reproduced"),  # cheaper than claimed
      ((1.8, 2.2), (3.0, 3.5), "lower", "refuted"),
      ((1.8, 2.2), (2.0, 2.5), "lower", "inconclusive"),
      # "two_sided": the claim holds on [p_lo, p_hi].
      ((0.73, 0.75), (0.735, 0.745), "two_sided", "reproduced"),
      ((0.73, 0.75), (0.80, 0.9), "two_sided", "refuted"),
      ((0.73, 0.75), (0.60, 0.70), "two_sided", "refuted"),
      ((0.73, 0.75), (0.70, 0.74), "two_sided", "inconclusive"),
      ((0.73, 0.75), (0.70, 0.80), "two_sided", "inconclusive"),  # covers the whole band
      # The overhead of the issue: "about 2x" (band 1.5-2.5) against two runs.
      ((1.5, 2.5), (1.129, 0.983, 2.236), "two_sided", "inconclusive"),
      ((1.5, 2.5), (1.07, 0.97, 1.27), "two_sided", "refuted"),
  )
  def test_rule(self, paper, ours, direction, want):
    got = stats.verdict(paper, ours, direction)
    self.assertIn(got, stats.VERDICTS)
    self.assertEqual(got, want)

  def test_verdicts(self):
    self.assertEqual(stats.VERDICTS, ("reproduced", "refuted", "inconclusive"))

  @parameterized.parameters("higher", "lower", "two_sided")
  def test_spanning_a_boundary_is_inconclusive(self, direction):
    # Intervals across each finite end of the region (part in, part out): never
    # reproduced, never refuted.
    lo, hi = 1.5, 2.5
    ends = {"higher": (lo,), "lower": (hi,), "two_sided": (lo, hi)}[direction]
    for end in ends:
      for ci in ((end - 0.1, end + 0.1), (end - 1.0, end + 0.01), (end - 0.01, end + 1.0),
                 (1.0, end - 0.2, end + 0.05)):
        self.assertEqual(stats.verdict((lo, hi), ci, direction), "inconclusive",
                         f"{direction} {end} {ci}")
    # Touching the region from outside: one point in, the rest out.
    outside = {"higher": (lo - 0.3, lo), "lower": (hi, hi + 0.3)}
    for d, ci in outside.items():
      self.assertEqual(stats.verdict((lo, hi), ci, d), "inconclusive", f"{d} {ci}")
      self.assertEqual(stats.verdict((lo, hi), ci, "two_sided"), "inconclusive", f"{d} {ci}")
    if direction == "two_sided":  # across both ends at once
      self.assertEqual(stats.verdict((lo, hi), (1.0, 3.0), direction), "inconclusive")

  def test_two_sided_disjoint_on_either_side_is_refuted(self):
    for ci in ((0.5, 1.49), (2.51, 3.0), (1.07, 0.97, 1.27), (3.0, 2.6, 3.4)):
      self.assertEqual(stats.verdict((1.5, 2.5), ci, "two_sided"), "refuted", ci)
    # The same intervals against one-sided claims: the side the claim allows reproduces.
    self.assertEqual(stats.verdict((1.5, 2.5), (0.5, 1.49), "lower"), "reproduced")
    self.assertEqual(stats.verdict((1.5, 2.5), (2.51, 3.0), "higher"), "reproduced")
    self.assertEqual(stats.verdict((1.5, 2.5), (0.5, 1.49), "higher"), "refuted")
    self.assertEqual(stats.verdict((1.5, 2.5), (2.51, 3.0), "lower"), "refuted")

  def test_point_claim(self):
    self.assertEqual(stats.verdict((2.0, 2.0), (2.0, 2.0)), "reproduced")
    self.assertEqual(stats.verdict((2.0, 2.0), (1.9, 2.1)), "inconclusive")
    self.assertEqual(stats.verdict((2.0, 2.0), (2.1, 2.2)), "refuted")

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "direction"):
      stats.verdict((0, 1), (0, 1), "up")
    with self.assertRaisesRegex(ValueError, "paper_range"):
      stats.verdict((1, 0), (0, 1))
    with self.assertRaisesRegex(ValueError, "paper_range"):
      stats.verdict((0, float("inf")), (0, 1))
    with self.assertRaisesRegex(ValueError, "paper_range"):
      stats.verdict((0, 1, 2), (0, 1))
    with self.assertRaisesRegex(ValueError, "ours_ci"):
      stats.verdict((0, 1), (1, 0))
    with self.assertRaisesRegex(ValueError, "ours_ci"):
      stats.verdict((0, 1), (0.5, float("nan"), 1.0))
    with self.assertRaisesRegex(ValueError, "ours_ci"):
      stats.verdict((0, 1), (0.5,))
    with self.assertRaisesRegex(ValueError, "ours_ci"):
      stats.verdict((0, 1), None)


if __name__ == "__main__":
  absltest.main()
