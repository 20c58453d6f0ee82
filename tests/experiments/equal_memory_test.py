"""The equal-memory experiment (experiments/equal_memory.py) on the tiny Llama fixture.

Three source files of a character-level text, segments of 32 tokens in chunks
of 8; a deterministic variant, a certified variant with the
certificate-targeted allocation and one with AdaKV. Checks the rows (equal
memory, nothing dropped, evaluation-mode calls), resuming, the report's
paired differences and calibrated coverage, and the streaming core's
evaluation mode (no eviction, no error).
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certkv_jax.kv import memory
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import results_io
from experiments.lib.equal_memory import experiment
from experiments.lib.equal_memory import report
from experiments.lib.streaming_loss import core as streaming_loss_core
from tests import test_util

CHARS = "abcdefghijklmnopqrstuvwxyz .,\n"
TEXT = ("it was the best of times, it was the worst of times, it was the age of wisdom, "
        "it was the age of foolishness.\n")
VARIANTS = ("snapkv", "priority_floor+cert", "priority_tail+adakv")


class CoverageIntervalTest(absltest.TestCase):

  def test_the_interval_resamples_segments(self):
    """Ten segments of 150 calls covering shares 0, 0.1, ..., 0.9: pooled 0.45;
    the segments' shares have sd 0.287, so the mean's 95% interval is about
    +-0.18 (1.96 x 0.287 / sqrt(10)), far wider than the +-0.025 of 1,500
    independent calls."""
    evals = [np.where(np.arange(150).reshape(50, 1, 3) < 15 * i, 0.5, 2.0) for i in range(10)]
    calib = [np.full((40, 1, 3), 0.5)]  # every head's scale: 0.5
    cell = report.coverage(calib, evals, n_kv_heads=3)
    self.assertAlmostEqual(cell["raw"], 0.45)
    self.assertAlmostEqual(cell["calibrated"], 0.45)
    for k in ("raw_ci", "calibrated_ci"):
      lo, hi = cell[k]
      self.assertTrue(0.2 < lo < 0.35 and 0.55 < hi < 0.7, cell[k])
    self.assertEqual(cell["n_segments"], 10)

  def test_sharpness_by_hand(self):
    # covered calls with an error: scores 0.5 and 0.25 at scale 1 (ratios 2 and 4); 2.0 is
    # missed, 0.0 has no error; at scale 4 the 2.0 call is covered too (ratio 2)
    ev = np.array([0.5, 2.0, 0.0, 0.25]).reshape(4, 1, 1)
    self.assertEqual(report.sharpness([(ev, 1.0)]), 3.0)
    self.assertEqual(report.sharpness([(ev, 1.0), (ev, 4.0)]), 4.0)  # 2, 4 and 8, 2, 16
    self.assertIsNone(report.sharpness([(ev, 0.1)]))
    self.assertIsNone(report.sharpness([(ev, np.inf)]))  # an infinite scale: no guarantee
    self.assertEqual(report.coverage(None, [ev], n_kv_heads=1)["raw_sharpness"], 3.0)

  def test_a_twin_is_paired_with_its_own_design(self):
    """Hand-made rows: the twin's paired difference is its mean difference from
    its own design on the same segments, keyed by that design."""
    root = test_util.temp_dir(self)
    src = os.path.join(root, "a.txt")
    with open(src, "w", encoding="utf-8") as f:
      f.write(TEXT)
    plan = experiment.Plan(sources=(src,), context_lens=(32,), memories=(0.5,), n_eval=3,
                           n_calib=0, chunk=8, variants=("h2o", "snapkv",
                                                         "snapkv_cert:top_share=0.5",
                                                         "snapkv_cert:top_share=0.75"))
    nll = {"h2o": (0.5, 0.5, 0.5), "snapkv": (0.1, 0.2, 0.3),
           "snapkv_cert:top_share=0.5": (0.05, 0.3, 0.1),
           "snapkv_cert:top_share=0.75": (0.1, 0.2, 0.4)}
    rows = [dict(seed=0, context_len=32, split="eval", segment=s, unit_seconds=1.0,
                 variant=v, memory=0.5, delta_nll=d[s], held_memory=0.5)
            for v, d in nll.items() for s in range(3)]
    rows += [dict(seed=0, context_len=32, split="eval", segment=s, unit_seconds=1.0,
                  variant="full", memory=1.0, delta_nll=0.0, held_memory=1.0) for s in range(3)]
    s = report.summarize(rows, root, plan)
    twin = s["paired_twin"]["snapkv"]["0.5"]
    self.assertAlmostEqual(twin["value"], (-0.05 + 0.1 - 0.2) / 3, places=12)
    self.assertEqual((twin["twin"], twin["wins"], twin["n"]),
                     ("snapkv_cert:top_share=0.5", 2, 3))
    # h2o has no twin here; snapkv's second twin is keyed by its own name, and the
    # report names the design it is paired with, not the twin twice.
    self.assertEqual(list(s["paired_twin"]), ["snapkv", "snapkv_cert:top_share=0.75"])
    self.assertEqual(s["paired_twin"]["snapkv_cert:top_share=0.75"]["0.5"]["design"], "snapkv")
    self.assertIn("| snapkv | snapkv_cert:top_share=0.5 |", s["md"])
    self.assertIn("| snapkv | snapkv_cert:top_share=0.75 |", s["md"])
    self.assertEqual(s["paired_twin_by_quarter"], {})  # rows without chunk_nll

  def test_rows_of_another_segment_split_are_refused(self):
    """Calibration segment 0 is the file after the evaluation ones: rows made under
    --n_eval=2 name another file than --n_eval=3 gives it, and a resume must not mix them."""
    root = test_util.temp_dir(self)
    results = results_io.JsonlResults(os.path.join(root, "rows.jsonl"), experiment.KEY_FIELDS)
    base = dict(seed=0, context_len=32, variant="full", memory=1.0)
    results.add_many([dict(base, split="eval", segment=0, source="a.txt"),
                      dict(base, split="eval", segment=1, source="b.txt"),
                      dict(base, split="calib", segment=0, source="c.txt")])
    names = {32: ["a.txt", "b.txt", "c.txt", "d.txt"]}
    plan = lambda n_eval, n_calib: experiment.Plan(sources=("x",), context_lens=(32,),
                                                   n_eval=n_eval, n_calib=n_calib)
    experiment.check_segments(results, plan(2, 1), names)  # the run's own counts
    experiment.check_segments(results, plan(2, 0), names)  # calibration rows not in the plan
    with self.assertRaisesRegex(ValueError, "calib segment 0 at 32 tokens was made from c.txt, "
                                "which is d.txt under --n_eval=3"):
      experiment.check_segments(results, plan(3, 1), names)

  def test_scores_read_only_the_plans_segments(self):
    root = test_util.temp_dir(self)
    os.makedirs(os.path.join(root, "calls"))
    calls = {f"m0.5_s{s}": np.ones((2, 1, 1)) for s in range(3)}  # a run with 3 segments
    np.savez(os.path.join(root, "calls", "32_snapkv_cert_eval_0_seed0.npz"), **calls)
    plan = experiment.Plan(sources=("x",), context_lens=(32,), n_eval=2, n_calib=0)
    self.assertLen(report._scores(root, 32, "snapkv_cert", "eval", 0.5, plan), 2)  # pylint: disable=protected-access

  def test_stored_scores_keep_inf_for_radius_zero_only(self):
    got = experiment.stored_scores(np.array([0.5, 7e4, np.inf, 0.0]))
    self.assertEqual(got.dtype, np.float16)
    np.testing.assert_array_equal(got, np.array([0.5, 65504.0, np.inf, 0.0], np.float16))
    # Rounded up: a miss by less than float16's spacing at 1 (2^-10) stays a miss; a
    # score float16 holds exactly stays as it is.
    got = experiment.stored_scores(np.array([1.0004, 1.0, 1.1]))
    self.assertGreater(float(got[0]), 1.0)
    self.assertEqual(float(got[1]), 1.0)
    self.assertGreaterEqual(float(got[2]), 1.1)

  def test_coverage_starts_at_the_first_eviction(self):
    """Chunks of 8 over 40 tokens: a cache of 12 first drops tokens after chunk 1 (16
    seen), so calls from position 16 on count; one that keeps every token has none."""
    self.assertEqual(experiment.first_evicted([8, 12, 12, 12, 12], 8, 40), 16)
    self.assertEqual(experiment.first_evicted([2, 4, 6, 8, 10], 8, 40), 8)  # seen share
    self.assertEqual(experiment.first_evicted([8, 16, 24, 32, 40], 8, 40), 40)
    plan = experiment.Plan(sources=("unused",), context_lens=(40,), n_eval=2, chunk=8)
    calls = np.arange(31.0)  # stored from position 8 on: 39 scored positions - 8
    row = dict(segment=0, n_scored=39, kept_per_chunk=[8, 12, 12, 12, 12])
    np.testing.assert_array_equal(report._from_first_eviction(calls, row, 40, plan),
                                  np.arange(8.0, 31.0))  # positions 16 ... 38
    with self.assertRaisesRegex(ValueError, "5 calls stored for segment 0, fewer than the 23"):
      report._from_first_eviction(calls[:5], row, 40, plan)

  def test_a_twin_is_paired_by_quarter_of_the_stream(self):
    """Nine chunks: chunk 0 (never evicted) is left out and the other eight make
    four quarters of two; the twin loses 0.4 then 0.2 per token in the first
    quarter on every segment and nothing after it."""
    root = test_util.temp_dir(self)
    src = os.path.join(root, "a.txt")
    with open(src, "w", encoding="utf-8") as f:
      f.write(TEXT)
    plan = experiment.Plan(sources=(src,), context_lens=(72,), memories=(0.5,), n_eval=2,
                           n_calib=0, chunk=8, variants=("snapkv", "snapkv_cert"))
    design = [9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    twin = [5.0, 1.4, 1.2, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    kept = [8, 8, 8, 12, 16, 20, 24, 28, 32]
    rows = [dict(seed=0, context_len=72, split="eval", segment=s, unit_seconds=1.0,
                 variant=v, memory=0.5, delta_nll=0.1, held_memory=0.5, chunk_nll=c,
                 kept_per_chunk=kept)
            for v, c in (("snapkv", design), ("snapkv_cert", twin)) for s in range(2)]
    rows += [dict(seed=0, context_len=72, split="eval", segment=s, unit_seconds=1.0,
                  variant="full", memory=1.0, delta_nll=0.0, held_memory=1.0) for s in range(2)]
    q = report.summarize(rows, root, plan)["paired_twin_by_quarter"]["snapkv"]["0.5"]
    self.assertEqual(q["chunks"], [[1, 2], [3, 4], [5, 6], [7, 8]])
    self.assertEqual([round(d["value"], 12) for d in q["delta"]], [0.3, 0.0, 0.0, 0.0])
    self.assertEqual(q["delta"][0]["n"], 2)
    self.assertEqual(q["design_kept"], [8, 12, 20, 28])  # the cache its last chunk read

  def test_robust_scale_is_the_largest_segment_quantile(self):
    """Calibration segment A scores 0.5 everywhere; B has 7% of its calls at
    1.5. B's own conformal quantile (rank ceil(301 x 0.95) = 286 of 300, past
    its 279 low calls) is 1.5; pooled with A only 3.5% are high (rank 571 of
    600, within 579 low), so the pooled scale is 0.5. An evaluation segment
    like B is covered 0.93 by the pooled scale and fully by the robust one."""
    a = np.full((100, 1, 3), 0.5)
    b = np.where(np.arange(300).reshape(100, 1, 3) < 21, 1.5, 0.5)
    cell = report.coverage([a, b], [b.copy()], n_kv_heads=1)
    self.assertAlmostEqual(cell["median_scale"], 0.5)
    self.assertAlmostEqual(cell["median_robust_scale"], 1.5)
    self.assertAlmostEqual(cell["calibrated"], 0.93)
    self.assertAlmostEqual(cell["robust"], 1.0)
    self.assertAlmostEqual(cell["raw"], 0.93)
    self.assertAlmostEqual(cell["robust_sharpness"], 3.0)  # 279 calls at 1.5 / 0.5

  def test_worst_heads(self):
    """Two layers, two KV heads of two query heads: only layer 1, KV head 0
    misses (half its calls)."""
    e = np.full((10, 2, 4), 0.5)
    e[::2, 1, 0:2] = 2.0
    cell = report.coverage([np.full((20, 2, 4), 0.5)], [e], n_kv_heads=2)
    self.assertEqual(cell["raw_worst_heads"][0], [1, 0, 0.5])
    self.assertEqual(cell["raw_worst_heads"][1][2], 1.0)
    self.assertAlmostEqual(cell["raw_heads_below"], 0.25)

  def test_smoothed_coverage(self):
    """The smoothed radius's scores are reported uncalibrated beside the raw:
    one of two segments covered at 0.5, the other at 1.0."""
    e = [np.full((10, 1, 3), 2.0), np.full((10, 1, 3), 2.0)]
    w = [np.where(np.arange(30).reshape(10, 1, 3) < 15, 0.25, 2.0), np.full((10, 1, 3), 0.5)]
    cell = report.coverage([np.full((40, 1, 3), 0.5)], e, n_kv_heads=1, smoothed=w)
    self.assertEqual(cell["raw"], 0.0)
    self.assertAlmostEqual(cell["smoothed"], 0.75)
    self.assertAlmostEqual(cell["smoothed_sharpness"], 2.0)  # 1 / 0.5 is the median of 4, 2
    self.assertEqual(cell["smoothed_heads_below"], 1.0)
    with self.assertRaisesRegex(ValueError, "smoothed must hold one array per"):
      report.coverage([np.full((40, 1, 3), 0.5)], e, n_kv_heads=1, smoothed=w[:1])

  def test_raw_coverage_without_calibration_segments(self):
    """No calibration segments (``--n_calib=0``): raw coverage only, no scales."""
    e = np.full((10, 1, 3), 0.5)
    e[:3] = 2.0  # 9 of 30 calls missed
    cell = report.coverage(None, [e], n_kv_heads=1)
    self.assertAlmostEqual(cell["raw"], 0.7)
    self.assertAlmostEqual(cell["raw_sharpness"], 2.0)  # 1 / 0.5 on the covered calls
    self.assertNotIn("calibrated", cell)
    self.assertNotIn("median_scale", cell)

  def test_scores_must_be_three_dimensional(self):
    with self.assertRaisesRegex(ValueError, "evals must be a list of"):
      report.coverage([np.ones((4, 1, 3))], np.ones((4, 3)), n_kv_heads=1)


class SourcesTest(absltest.TestCase):

  def test_globs_keep_their_order(self):
    root = test_util.temp_dir(self)
    for name in ("a_1.txt", "a_2.txt", "b_1.txt", "a_toc.txt"):
      with open(os.path.join(root, name), "w") as f:
        f.write("x")
    got = experiment.default_sources(f"{root}/b_*.txt, {root}/a_*.txt")
    self.assertEqual([os.path.basename(p) for p in got], ["b_1.txt", "a_1.txt", "a_2.txt"])
    with self.assertRaisesRegex(ValueError, "--sources: files listed more than once"):
      experiment.default_sources(f"{root}/a_1.txt,{root}/a_*.txt")
    with self.assertRaisesRegex(ValueError, r"--sources: '.*/c_\*.txt' matches no file"):
      experiment.default_sources(f"{root}/a_*.txt,{root}/c_*.txt")
    with self.assertRaisesRegex(ValueError, "matches no file"):
      experiment.default_sources(f"{root}/a_toc.txt")  # tables of contents are left out

  def test_default_sources_are_shipped_with_their_licence(self):
    """The default corpus is in the package (found from any working directory), the
    files the committed runs read (their recorded sha256), with the licence beside it."""
    got = experiment.default_sources(experiment.DEFAULT_SOURCES)
    self.assertLen(got, 35)
    self.assertEqual(os.path.basename(got[0]), "usr_01.txt")
    for name in ("README.md", "OPL-1.0.txt", "uganda.txt", "editing.txt"):
      self.assertTrue(os.path.exists(os.path.join(experiment.DATA_DIR, name)), name)
    summary = os.path.join(test_util.ROOT, "experiments", "results", "equal_memory",
                           "summary.json")
    with open(summary, encoding="utf-8") as f:
      plan = json.load(f)["plan"]
    self.assertEqual([os.path.basename(p) for p in got], plan["sources"])
    self.assertEqual(experiment.sources_sha256(got), plan["sources_sha256"])

  def test_by_quarter_skips_unscored_chunks_and_short_streams(self):
    plan = experiment.Plan(sources=("unused",), n_eval=2)
    row = lambda nll: {"chunk_nll": nll, "kept_per_chunk": [8.0] * len(nll)}
    # chunk 0 (never evicted) and a last chunk of one token (no target: None) left out
    ref = {s: row([5.0, 5.0, 5.0, 5.0, 5.0, None]) for s in range(2)}
    seg = {s: row([5.0, 5.1, 5.2, 5.3, 5.4 + s / 10, None]) for s in range(2)}
    q = report._by_quarter(seg, ref, plan)  # pylint: disable=protected-access
    self.assertEqual(q["chunks"], [[1, 1], [2, 2], [3, 3], [4, 4]])
    np.testing.assert_allclose([d["value"] for d in q["delta"]], [0.1, 0.2, 0.3, 0.45])
    # fewer than 4 chunks after chunk 0: no quarters (the report said nothing, not crashed)
    short = lambda rows: {s: row(rows) for s in range(2)}
    self.assertIsNone(report._by_quarter(  # pylint: disable=protected-access
        short([5.0, 5.2, 5.3]), short([5.0, 5.0, 5.0]), plan))

  def test_empty_lists_and_max_units_are_refused(self):
    for kw, msg in ((dict(memories=()), "--memories: none given"),
                    (dict(variants=()), "--variants: none given"),
                    (dict(context_lens=()), "--context_lens: none given"),
                    (dict(max_units=-1), "--max_units must be an int >= 1")):
      with self.assertRaisesRegex(ValueError, msg):
        experiment.Plan(sources=("unused",), **kw).check()

  def test_a_bad_flag_is_one_line(self):
    for flag, msg in (("--sources=/nonexistent/*.txt", "--sources: '/nonexistent/*.txt' "
                       "matches no file"),
                      ("--variants=snapkv+nope", "--variants: unknown allocation 'nope'"),
                      ("--memories=half", "--memories entries must be floats")):
      done = subprocess.run([sys.executable, "-m", "experiments.equal_memory", "--out=unused",
                             flag], cwd=test_util.temp_dir(self), capture_output=True,
                            text=True, timeout=300, check=False,
                            env=dict(os.environ, PYTHONPATH=test_util.ROOT))
      lines = done.stderr.strip().splitlines()
      self.assertEqual(done.returncode, 1, done.stderr)
      self.assertLen(lines, 1, done.stderr)
      self.assertStartsWith(lines[0], f"experiments.equal_memory: {msg}")


@pytest.mark.slow
class EqualMemoryTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    test_util.ensure_flags_parsed()
    cls.root = test_util.temp_dir(cls)
    model_dir = os.path.join(cls.root, "tiny_char")
    os.makedirs(model_dir)
    test_util.tiny_hf_dir(model_dir, CHARS)
    cls.params, cls.config, cls.tok = model_loading.load_model(model_dir)
    sources = []
    for i in range(3):
      sources.append(os.path.join(cls.root, f"src_{i}.txt"))
      with open(sources[-1], "w", encoding="utf-8") as f:
        f.write(TEXT[i:] + TEXT)
    cls.plan = experiment.Plan(sources=tuple(sources), context_lens=(32,), variants=VARIANTS,
                               memories=(0.5,), n_eval=2, n_calib=1, chunk=8, group=2,
                               n_sink=1, window=2)
    cls.out = os.path.join(cls.root, "out")
    cls.logs = []
    cls.rows = experiment.run(cls.params, cls.config, cls.tok, cls.out, cls.plan,
                              model="tiny", log=cls.logs.append)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.root, ignore_errors=True)
    super().tearDownClass()

  def test_rows(self):
    # full: 2 eval + 1 calib; each variant 2 eval; randomized ones 1 calib more
    self.assertLen(self.rows, 3 + 2 + 3 + 3)
    head_dim = self.config.head_dim
    for r in self.rows:
      self.assertEqual(r["n_dropped"], 0)
      if r["variant"] == "full":
        self.assertEqual(r["delta_nll"], 0.0)
        continue
      design, alloc, frac = experiment.make_variant(r["variant"], head_dim, 0.5, 1, 2)
      self.assertAlmostEqual(r["budget_fraction"], frac)
      self.assertEqual(r["slot_bytes"], memory.slot_bytes(design, head_dim, allocation=alloc))
      # equal memory: kept bytes per token seen = 0.5 x the full cache's K/V bytes
      self.assertAlmostEqual(frac * r["slot_bytes"], 0.5 * 2 * head_dim * 4, places=6)
      self.assertEqual("coverage" in r, r["randomized"])
      if r["variant"] == "priority_tail+adakv":  # fixed size, no floor: held <= nominal
        self.assertLessEqual(r["held_memory"], 0.5 + 1e-9)

  def test_fixed_cache(self):
    """--cache=fixed: each memory's share of the 32 tokens is the design's budget; the
    cache keeps every token until it holds that many, then exactly that many."""
    plan = dataclasses.replace(self.plan, cache="fixed", variants=("snapkv", "snapkv_cert"),
                               memories=(0.5, 0.75), n_calib=0, coverage=False)
    out = os.path.join(self.root, "fixed")
    rows = experiment.run(self.params, self.config, self.tok, out, plan, model="tiny",
                          log=lambda _: None)
    self.assertLen(rows, 2 + 2 * 2 * 2)  # full 2 segments; 2 variants x 2 memories x 2
    for r in rows:
      self.assertEqual((r["cache"], r["n_dropped"]), ("fixed", 0))
      if r["variant"] == "full":
        continue
      frac = experiment.make_variant(r["variant"], self.config.head_dim, r["memory"], 1, 2)[2]
      budget = int(np.floor(frac * 32))
      self.assertEqual(r["budget_tokens"], budget)
      seen = 8 * np.arange(1, 5)
      np.testing.assert_array_equal(r["kept_per_chunk"], np.minimum(seen, budget), str(r))
    with self.assertRaisesRegex(ValueError, "--cache=seen, but .* holds rows of --cache=fixed"):
      experiment.run(self.params, self.config, self.tok, out,
                     dataclasses.replace(plan, cache="seen"), model="tiny")
    design = experiment.make_variant("snapkv", self.config.head_dim, 0.5, 4, 16)[0]
    with self.assertRaisesRegex(ValueError, "--memories: 0.05 of 64 tokens keeps 6 tokens "
                                r"of 'snapkv', fewer than its sinks and window \(20\)"):
      experiment.fixed_budget(design, 0.1, 64, "snapkv", 0.05)

  def test_resume_runs_nothing(self):
    logs = []
    rows = experiment.run(self.params, self.config, self.tok, self.out, self.plan,
                          model="tiny", log=logs.append)
    self.assertEqual(len(rows), len(self.rows))
    self.assertIn("0 of", logs[0])

  def test_report(self):
    s = report.write(self.rows, self.out, self.plan, n_kv_heads=self.config.n_kv_heads)
    with open(os.path.join(self.out, "summary.json")) as f:
      disk = json.load(f)
    self.assertTrue(os.path.exists(os.path.join(self.out, "delta_nll.png")))
    self.assertEqual(disk["best_deterministic"], {"0.5": "snapkv"})
    paired = s["paired_vs_best_deterministic"]
    self.assertEqual(paired["snapkv"]["0.5"]["value"], 0.0)
    for v in VARIANTS:
      d = s["delta_nll"][v]["0.5"]
      self.assertLessEqual(d["ci"][0], d["value"])
      self.assertLessEqual(d["value"], d["ci"][1])
      by_seg = {r["segment"]: r["delta_nll"] for r in self.rows
                if r["variant"] == v and r["split"] == "eval"}
      ref = {r["segment"]: r["delta_nll"] for r in self.rows
             if r["variant"] == "snapkv" and r["split"] == "eval"}
      want = np.mean([by_seg[k] - ref[k] for k in ref])
      self.assertAlmostEqual(paired[v]["0.5"]["value"], want, places=12)
    for v in VARIANTS[1:]:
      cov = s["contexts"]["32"]["coverage"][v]["0.5"]
      for k in ("raw", "calibrated"):
        self.assertTrue(0.0 <= cov[k] <= 1.0)
        lo, hi = cov[k + "_ci"]  # a bootstrap over the 2 evaluation segments
        self.assertTrue(0.0 <= lo <= cov[k] + 1e-12 and cov[k] - 1e-12 <= hi <= 1.0, cov)
      self.assertEqual(cov["n_segments"], self.plan.n_eval)
      self.assertGreater(cov["n_calls"], 0)
      # the smoothed radius is never below the raw one, so it covers at least as often
      self.assertGreaterEqual(cov["smoothed"], cov["raw"])
    self.assertNotIn("snapkv", s["contexts"]["32"]["coverage"])

  def test_report_without_calls_keeps_the_stored_coverage(self):
    """calls/ is not committed: a report rewritten without it reads coverage.json,
    and a plan of another seed gets none of it."""
    out = os.path.join(self.root, "no_calls")
    shutil.copytree(self.out, out, ignore=shutil.ignore_patterns("calls"))
    with_calls = report.write(self.rows, self.out, self.plan,
                              n_kv_heads=self.config.n_kv_heads)["contexts"]["32"]["coverage"]
    shutil.copy(os.path.join(self.out, report.COVERAGE_FILE), out)
    without = report.write(self.rows, out, self.plan,
                           n_kv_heads=self.config.n_kv_heads)["contexts"]["32"]["coverage"]
    self.assertEqual(without, results_io.json_safe(with_calls))  # inf is stored as null
    self.assertTrue(without)
    other = dataclasses.replace(self.plan, seed=1)
    self.assertEqual(report.load_coverage(out, other), {})

  def test_bad_variant(self):
    with self.assertRaisesRegex(ValueError, "unknown allocation 'nope'"):
      experiment.parse_variant("snapkv+nope")
    with self.assertRaisesRegex(ValueError, "unknown design 'nope'"):
      experiment.parse_variant("nope")
    with self.assertRaisesRegex(ValueError, "'heavy_share' in .* must be name=number"):
      experiment.variant_settings("priority_floor:heavy_share+cert")
    with self.assertRaisesRegex(ValueError, "heavy_share must be a float in"):
      dataclasses.replace(self.plan, variants=("priority_floor:heavy_share=1.5",)).check()
    with self.assertRaisesRegex(ValueError, "takes no setting 'nope'"):
      dataclasses.replace(self.plan, variants=("h2o:nope=1",)).check()

  def test_variant_settings(self):
    v = "priority_floor:heavy_share=0.5:min_tail=8+cert"
    self.assertEqual(experiment.parse_variant(v), ("priority_floor", "cert"))
    self.assertEqual(experiment.variant_settings(v), {"heavy_share": 0.5, "min_tail": 8})
    design, alloc, _ = experiment.make_variant(v, 64, 0.25, 4, 16)
    self.assertEqual((design.tail.heavy_share, design.min_tail), (0.5, 8))
    self.assertIs(alloc, experiment.ALLOCATIONS["cert"])
    self.assertTrue(experiment.is_randomized(v))

  def test_evaluation_mode_without_eviction_has_no_error(self):
    toks = jnp.asarray(np.asarray([experiment.source_segments(
        self.tok, self.plan.sources, 32, 1)[1][0]], np.int32))
    design = design_defaults.make_design("priority_tail", 1.0, 1, 2)
    stream = streaming_loss_core.StreamConfig(chunk=8, design=design, evaluate=True)
    res = streaming_loss_core.streaming_nll(self.params, toks, jnp.ones(toks.shape, bool),
                                            jax.random.PRNGKey(0), config=self.config,
                                            stream=stream)
    L, H = self.config.n_layers, self.config.n_heads
    self.assertEqual(res.calls.error.shape, (1, 32, L, H))
    np.testing.assert_allclose(np.asarray(res.calls.error), 0.0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(res.calls.radius), 0.0)

  def test_loss_only_run_has_the_same_losses(self):
    # certificate=False (--nocoverage) drops the certificate statistics, not the
    # offsets: a randomized design's losses equal the certified run's.
    toks = jnp.asarray(np.asarray([experiment.source_segments(
        self.tok, self.plan.sources, 32, 1)[1][0]], np.int32))
    design = design_defaults.make_design("priority_tail", 0.25, 1, 2, heavy_share=0.5)
    out = {}
    for cert in (True, False):
      stream = streaming_loss_core.StreamConfig(chunk=8, design=design, certificate=cert)
      out[cert] = streaming_loss_core.streaming_nll(
          self.params, toks, jnp.ones(toks.shape, bool), jax.random.PRNGKey(0),
          config=self.config, stream=stream)
    np.testing.assert_allclose(out[False].logprob, out[True].logprob, atol=1e-5)
    self.assertGreater(float(np.asarray(out[True].radius).max()), 0.0)
    np.testing.assert_array_equal(np.asarray(out[False].radius), 0.0)
    with self.assertRaisesRegex(ValueError, "evaluate needs certificate=True"):
      streaming_loss_core.StreamConfig(chunk=8, design=design, capacity=16, evaluate=True,
                                       certificate=False).check(toks)
    with self.assertRaisesRegex(ValueError, "smooth_window must be an int >= 1, got 0"):
      streaming_loss_core.StreamConfig(chunk=8, design=design, capacity=16,
                                       smooth_window=0).check(toks)

  def test_evaluation_mode_smooths_each_heads_calls_over_positions(self):
    """Calls.smoothed is the radius of certificate.smoothed_variance along the
    stream's positions (across chunks), computed from the same statistics."""
    toks = jnp.asarray(np.asarray([experiment.source_segments(
        self.tok, self.plan.sources, 32, 1)[1][0]], np.int32))
    design = design_defaults.make_design("priority_tail", 0.25, 1, 2, heavy_share=0.5)
    res = {}
    for w in (1, 4):
      stream = streaming_loss_core.StreamConfig(chunk=8, design=design, evaluate=True,
                                                smooth_window=w)
      res[w] = streaming_loss_core.streaming_nll(
          self.params, toks, jnp.ones(toks.shape, bool), jax.random.PRNGKey(0),
          config=self.config, stream=stream).calls
    np.testing.assert_array_equal(res[1].smoothed, res[1].radius)  # window 1: the raw radius
    np.testing.assert_array_equal(res[4].radius, res[1].radius)
    raw, smooth = np.asarray(res[4].radius), np.asarray(res[4].smoothed)
    self.assertTrue(np.all(smooth >= raw - 1e-6))
    self.assertTrue(np.any(smooth > raw * 1.01))


if __name__ == "__main__":
  absltest.main()
