"""certkv_jax.calibration.robust: radius-binned, source-robust conformal scales.

Synthetic calls with a known law: the error is ``radius * |N(0, sigma^2)|``
with ``sigma`` depending on the source and on the radius bin, so that the
exact scale that covers each (source, bin) at 1 - delta is known:
``sigma * z`` with ``z`` the (1 - delta / 2) normal quantile.
"""

import dataclasses
import math
import os
import tempfile

from absl.testing import absltest
import numpy as np
from scipy import stats as sp_stats

from certkv_jax.calibration import robust as rc
DELTA = 0.05
Z = sp_stats.norm.ppf(1 - DELTA / 2)  # |N(0,1)| quantile at 1 - delta


def _calls(rng, n, sigma_small, sigma_large, source):
  """n calls: radius log-uniform on [0.1, 10]; sigma_small below radius 1, else sigma_large."""
  radius = np.exp(rng.uniform(np.log(0.1), np.log(10.0), n))
  sigma = np.where(radius < 1.0, sigma_small, sigma_large)
  err = radius * np.abs(rng.normal(size=n)) * sigma
  return err, radius, np.full(n, source)


class RobustScalesTest(absltest.TestCase):

  def test_max_over_sources_covers_each_source_per_bin(self):
    # Two sources with different laws; bins split at radius 1 (edges given).
    rng = np.random.default_rng(0)
    n = 4000  # per source; 2000 per bin
    e1, r1, s1 = _calls(rng, n, 0.5, 1.0, "a")
    e2, r2, s2 = _calls(rng, n, 1.5, 0.3, "b")
    scales, counts = rc.robust_scales(np.r_[e1, e2], np.r_[r1, r2], np.r_[s1, s2], [1.0], DELTA)
    self.assertEqual(counts.shape, (2, 2))
    # Exact scales: bin 0 -> max(0.5, 1.5) z, bin 1 -> max(1.0, 0.3) z. The conformal
    # quantile of 2000 draws of |N| has sd about sqrt(p(1-p)/n)/f(z) * sigma ~ 0.05 sigma
    # (p = 0.95, f = 2 phi(z) = 0.117): 4 sd = 0.2 sigma, relative 0.1.
    np.testing.assert_allclose(scales, [1.5 * Z, 1.0 * Z], rtol=0.1)
    # Held out: fresh draws of each source are covered at >= 1 - delta in each bin
    # (binomial sd of coverage over 20000 draws: 0.0015; the conformal level exceeds
    # 1 - delta; allow 4 sd below).
    for sig_s, sig_l in ((0.5, 1.0), (1.5, 0.3)):
      e, r, _ = _calls(rng, 40000, sig_s, sig_l, "x")
      covered = e <= scales[(r >= 1.0).astype(int)] * r
      for b in (0, 1):
        m = (r >= 1.0) == b
        self.assertGreaterEqual(covered[m].mean(), 1 - DELTA - 4 * 0.0015)
    # Power: a single pooled scale (no bins, no max) under-covers source b's small bin.
    pooled = np.quantile(np.r_[e1, e2] / np.r_[r1, r2], 1 - DELTA)
    e, r, _ = _calls(rng, 40000, 1.5, 0.3, "x")
    m = r < 1.0
    self.assertLess(np.mean(e[m] <= pooled * r[m]), 1 - DELTA - 0.05)

  def test_mixture_of_sources_is_covered(self):
    rng = np.random.default_rng(1)
    e1, r1, s1 = _calls(rng, 3000, 0.5, 1.0, "a")
    e2, r2, s2 = _calls(rng, 3000, 1.5, 0.3, "b")
    edges = rc.bin_edges(np.r_[r1, r2], 4)
    scales, _ = rc.robust_scales(np.r_[e1, e2], np.r_[r1, r2], np.r_[s1, s2], edges, DELTA)
    # A 30/70 mixture of fresh draws: coverage >= 1 - delta - 4 sd (sd 0.0015).
    ea, ra, _ = _calls(rng, 6000, 0.5, 1.0, "a")
    eb, rb, _ = _calls(rng, 14000, 1.5, 0.3, "b")
    e, r = np.r_[ea, eb], np.r_[ra, rb]
    bins = np.searchsorted(edges, r, side="right")
    self.assertGreaterEqual(np.mean(e <= scales[bins] * r), 1 - DELTA - 4 * 0.0015)

  def test_too_few_calls_give_infinite_scale_not_a_guess(self):
    e = np.ones(10)
    r = np.ones(10)
    scales, counts = rc.robust_scales(e, r, np.array(["a"] * 10), [], DELTA)  # 10 < 19
    self.assertTrue(np.isinf(scales).all())
    self.assertEqual(counts.tolist(), [[10]])

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "one length"):
      rc.robust_scales(np.ones(3), np.ones(4), np.array(["a"] * 3), [], DELTA)
    with self.assertRaisesRegex(ValueError, "radii"):
      rc.bin_edges([np.nan, 1.0], 2)
    with self.assertRaisesRegex(ValueError, "n_bins"):
      rc.bin_edges([1.0, 2.0], 0)


class BinnedCalibrationTest(absltest.TestCase):

  def _fit(self):
    rng = np.random.default_rng(2)
    e1, r1, s1 = _calls(rng, 2000, 0.5, 1.0, "text")
    e2, r2, s2 = _calls(rng, 2000, 1.5, 0.3, "passkey")
    e, r, s = np.r_[e1, e2], np.r_[r1, r2], np.r_[s1, s2]
    n = e.size
    regimes = np.where(np.arange(n) % 2 == 0, "streaming", "question_aware")
    budgets = np.where(np.arange(n) % 3 == 0, 0.25, 0.5)
    radii = np.stack([r, 1.3 * r])
    # Prompt lengths 1040-1156 (as the shipped artifact's); the chat calls (a regime
    # the calibration is not made for) are longer and shorter and must not count.
    context = 1040 + (np.arange(n) * 7) % 117
    regimes = np.where(np.arange(n) % 50 == 7, "chat", regimes)
    context = np.where(regimes == "chat", np.where(np.arange(n) % 100 == 7, 300, 4000), context)
    calls = rc.FitCalls(e, radii, regimes_per_call=regimes, budgets_per_call=budgets,
                        sources_per_call=s, context_tokens_per_call=context)
    return rc.fit(calls, regimes=("question_aware", "streaming"), budgets=(0.25, 0.5),
                  deltas=(0.05, 0.1), model="m", design="poisson_tail", n_bins=4)

  def test_one_bin_is_refused_before_fitting(self):  # its empty edges cannot be saved
    calls = rc.FitCalls(np.ones(4), np.ones((1, 4)), regimes_per_call=["q"] * 4,
                        budgets_per_call=[0.5] * 4, sources_per_call=["a"] * 4,
                        context_tokens_per_call=[10] * 4)
    with self.assertRaisesRegex(ValueError, "n_bins must be an int >= 2"):
      rc.fit(calls, regimes=("q",), budgets=(0.5,), deltas=(0.05,), model="m",
             design="poisson_tail", n_bins=1)

  def test_round_trip_and_radius(self):
    cal = self._fit()
    self.assertEqual(cal.scales.shape, (2, 2, 2, 4))
    self.assertEqual(cal.edges.shape, (2, 2, 2, 3))
    self.assertEqual(cal.data, ("passkey", "text"))
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "cal")
      rc.save(path, cal)
      with self.assertRaises(FileExistsError):
        rc.save(path, cal)
      back = rc.load(path)
    for k in ("scales", "edges", "n_calls"):
      np.testing.assert_array_equal(getattr(back, k), getattr(cal, k))
    for k in ("regimes", "budgets", "deltas", "data", "context_range", "model", "design",
              "created"):
      self.assertEqual(getattr(back, k), getattr(cal, k))
    self.assertEqual(back.context_range, (1040, 1156))  # the chat calls' 300 / 4000 left out
    self.assertEqual(back.metadata()["context_range"], [1040, 1156])
    self.assertEqual(back.format_version, 2)
    raw = np.array([0.05, 0.5, 5.0, 50.0])
    got = np.asarray(back.radius(raw, rc.Calls("m", "poisson_tail", "streaming", 0.25,
                                                  0.05)))
    edges, scales = cal.edges[1, 0, 0], cal.scales[1, 0, 0]
    want = scales[np.searchsorted(edges, raw, side="right")] * raw
    np.testing.assert_allclose(got, want, rtol=1e-6)

  def test_context_len_outside_the_fitted_range_is_refused_or_warned(self):
    cal = self._fit()
    calls = rc.Calls(model="m", design="poisson_tail", regime="streaming", budget=0.25,
                     delta=0.05)
    raw = np.array([0.05, 0.5, 5.0, 50.0])
    unchecked = np.asarray(cal.radius(raw, calls))
    for inside in (1040, 1100, 1156):
      np.testing.assert_array_equal(np.asarray(cal.radius(raw, calls, context_len=inside)),
                                    unchecked)
      self.assertTrue(cal.covers_context(inside))
    for outside in (272, 1039, 1157, 2064):
      with self.subTest(context_len=outside):
        self.assertFalse(cal.covers_context(outside))
        with self.assertRaisesRegex(
            ValueError, rf"context_len: this calibration was fitted on contexts of 1040-1156 "
                        rf"tokens from sources passkey, text, got context_len={outside}"):
          cal.radius(raw, calls, context_len=outside)
        # The explicit opt-in returns the same radius; warning is the caller's job.
        np.testing.assert_array_equal(
            np.asarray(cal.radius(raw, calls, context_len=outside, outside_range="warn")),
            unchecked)
    with self.assertRaisesRegex(ValueError, "outside_range"):
      cal.radius(raw, calls, context_len=1100, outside_range="ignore")
    with self.assertRaisesRegex(ValueError, "context_len must be an int"):
      cal.radius(raw, calls, context_len=1100.0)
    # fit needs the prompt lengths, one int per call.
    axes = dict(regimes=("streaming",), budgets=(0.25,), deltas=(0.05,), model="m", design="d")

    def calls(context):
      return rc.FitCalls(np.ones(40), np.ones((1, 40)), np.array(["streaming"] * 40),
                         np.full(40, 0.25), np.array(["a"] * 40), context)

    with self.assertRaisesRegex(ValueError, "context_tokens_per_call must be"):
      rc.fit(calls(np.full(39, 100)), **axes)
    with self.assertRaisesRegex(ValueError, "context_tokens_per_call must be ints"):
      rc.fit(calls(np.full(40, 100.0)), **axes)
    self.assertEqual(rc.fit(calls(np.full(40, 64)), **axes).fitted_on(),
                     "contexts of 64 tokens from sources a")
    with self.assertRaisesRegex(ValueError, "context_range"):
      rc.BinnedCalibration(**{**cal.__dict__, "context_range": (1200, 1100)})

  def test_dtype_is_recorded_and_defaults_to_float32_for_older_artifacts(self):
    from certkv_jax.calibration import store  # pylint: disable=g-import-not-at-top
    cal = self._fit()
    self.assertEqual(cal.dtype, "float32")
    half = dataclasses.replace(cal, dtype="bfloat16")
    with self.assertRaisesRegex(ValueError, "dtype must be one of"):
      dataclasses.replace(cal, dtype="float16")
    old = cal.metadata()
    del old["dtype"]  # written before the field existed (float32-only studies)
    with tempfile.TemporaryDirectory() as d:
      rc.save(os.path.join(d, "half"), half)
      self.assertEqual(rc.load(os.path.join(d, "half")).dtype, "bfloat16")
      store.write_checkpoint(os.path.join(d, "old"), {
          "scales": cal.scales, "edges": cal.edges, "n_calls": cal.n_calls}, old)
      self.assertEqual(rc.load(os.path.join(d, "old")).dtype, "float32")

  def test_old_format_is_refused_with_how_to_refit(self):
    from certkv_jax.calibration import store  # pylint: disable=g-import-not-at-top
    cal = self._fit()
    meta = cal.metadata()
    del meta["context_range"]
    meta["format_version"] = 1
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "v1")
      store.write_checkpoint(
          path, {"scales": cal.scales, "edges": cal.edges, "n_calls": cal.n_calls}, meta)
      with self.assertRaisesRegex(ValueError, r"format_version: .* has version 1; this code "
                                  r"reads version 2\. .*context lengths.*--from_units"):
        rc.load(path)

  def test_budget_between_fitted_ones_mixes_their_radii_in_log_budget(self):
    cal = self._fit()  # fitted at budgets 0.25 and 0.5
    raw = np.array([0.05, 0.5, 5.0, 50.0])
    kw = dict(model="m", design="poisson_tail", regime="streaming", delta=0.05)
    at = lambda b: np.asarray(cal.radius(raw, rc.Calls(budget=b, **kw)), np.float64)
    lo, hi = at(0.25), at(0.5)
    # 0.25 * sqrt(2) is halfway in log budget: the mean of the two calibrated radii.
    np.testing.assert_allclose(at(0.25 * math.sqrt(2.0)), 0.5 * (lo + hi), rtol=1e-6)
    np.testing.assert_allclose(at(0.3), (1 - math.log(1.2) / math.log(2.0)) * lo
                               + math.log(1.2) / math.log(2.0) * hi, rtol=1e-6)
    self.assertEqual(cal.budget_neighbours(0.5), ((1, 1.0),))
    for outside in (0.125, 0.75):
      self.assertIsNone(cal.budget_neighbours(outside))
      with self.assertRaisesRegex(ValueError, r"budget: .*outside \[0.25, 0.5\]"):
        cal.radius(raw, rc.Calls(budget=outside, **kw))

  def test_misuse_names_the_field(self):
    cal = self._fit()
    ok = dict(model="m", design="poisson_tail", regime="streaming", budget=0.25, delta=0.05)
    for field, bad in (("model", "other"), ("design", "snapkv"), ("regime", "chat"),
                       ("budget", 0.125), ("delta", 0.01)):
      with self.subTest(field=field):
        with self.assertRaisesRegex(ValueError, field):
          cal.radius(np.ones(2), rc.Calls(**dict(ok, **{field: bad})))
    with self.assertRaisesRegex(ValueError, "regime 'streaming', budget 0.125"):
      rc.fit(rc.FitCalls(np.ones(40), np.ones((1, 40)), np.array(["streaming"] * 40),
                         np.full(40, 0.25), np.array(["a"] * 40), np.full(40, 100)),
             regimes=("streaming",), budgets=(0.125,), deltas=(0.05,), model="m", design="d")

  def test_load_rejects_other_artifacts(self):
    from certkv_jax.calibration import store  # pylint: disable=g-import-not-at-top
    with tempfile.TemporaryDirectory() as d:
      with self.assertRaises(FileNotFoundError):
        rc.load(os.path.join(d, "missing"))
      path = os.path.join(d, "percall")
      store.write_checkpoint(path, {"x": np.zeros(2)},
                                         {"kind": "something else", "format_version": 1})
      with self.assertRaisesRegex(ValueError, "robust_calibration"):
        rc.load(path)
    self.assertTrue(math.isfinite(Z))


if __name__ == "__main__":
  absltest.main()
