"""The experiment suite end to end on the tiny Llama fixture: schema, resume, report.

The model is ``tests/fixtures/tiny_llama`` (random weights, vocabulary 128);
prompts come from a character-level stub tokenizer, so every script runs in
seconds (its accuracy is meaningless: the suite's numbers come from
``python -m experiments.run_all``).
"""

import dataclasses
import json
import os
import types
from unittest import mock

from absl.testing import absltest
import numpy as np
import pytest

from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib.montecarlo_certificate import experiment as montecarlo_experiment
from experiments.lib.overhead import experiment as overhead
from experiments.lib import results_io
from experiments.lib import stats
from experiments.lib import tasks
from experiments.lib.theorem1 import experiment as theorem1
from experiments.lib.analyses import assumption2
from experiments.lib.analyses import common
from experiments.lib.analyses import coverage
from experiments.lib.analyses import failures
from experiments.lib.analyses import regimes
from experiments.lib.suite import report as suite_report
from experiments.lib.suite import rows as suite_rows
from experiments.lib.suite import runner as suite_runner
from experiments.lib.suite import settings as suite_settings
from models import hf_loader
from tests import test_util

FIXTURE = test_util.TINY_LLAMA

ROW_KEYS = set(suite_rows.KEY_FIELDS) | {
    "randomized", "n_steps", "n_prompt_tokens", "answer", "text", "tokens", "correct",
    "mean_logprob", "min_logprob", "unit_seconds", "batch_size", "n_calls", "coverage",
    "sharpness", "mean_err", "max_err", "mean_rel_err", "mean_radius", "err_step_sum_mean",
    "cert_score", "cert_mean", "cert_sub_mean", "cov_layer", "cov_head", "err_layer",
    "R_frac_tail", "R_median", "R_p90", "R_max", "m_mean", "n_tail_mean", "sample",
    "chunk", "n_sink", "window", "deltas", "subsample_fraction", "n_sample_calls"}


class CharTokenizer:
  """Characters as ids (mod 128, 0-2 reserved): enough to build the tasks' prompts."""

  bos_id = 1

  def encode(self, text, add_bos=True):
    return ([self.bos_id] if add_bos else []) + [3 + ord(c) % 125 for c in text]

  def decode(self, ids):
    return "".join(chr(i - 3 + 32) if 3 <= i < 98 else " " for i in ids)


def _setup():
  params, config = hf_loader.load_hf_checkpoint(FIXTURE)
  tok = CharTokenizer()
  return params, config, tok


PLAN = dict(
    settings=dict(tasks=("passkey", "agent_memory"), num_examples=2, context_len=24,
                  budgets=(0.25, 0.5), designs=("full", "poisson_tail"),
                  regimes=("question_aware", "streaming"), n_runs=2, n_steps=3, chunk=32,
                  n_sink=2, window=4),
    theorem1=None,  # tested on its own below (each design costs three compiles)
    overhead=None,
    # the full-cache pass only (one compile); designs are tested in perplexity_test
    perplexity=dict(designs=("full",), budgets=(0.5,), context_len=24, chunk=8,
                    num_examples=2, n_runs=1),
    # One (design, regime): one compile; the study itself is tested in validity_test.
    validity=dict(designs=("poisson_tail",), regimes=("question_aware",), budgets=(0.5,),
                  data=("text", "passkey"), context_lens=(24,), num_examples=2, n_steps=2,
                  question_len=4, n_sink=2, window=4, chunk=8),
)


class SuiteTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    test_util.ensure_flags_parsed()
    cls.params, cls.config, cls.tok = _setup()

  def _examples(self, n=2):
    s = PLAN["settings"]
    return {t: tasks.make_task(t, self.tok, n, s["context_len"], 0) for t in s["tasks"]}

  @pytest.mark.slow  # the whole suite (collection, streaming loss, report, plots)
  def test_run_all_schema_resume_and_report(self):
    out = self.create_tempdir().full_path
    plan = json.loads(json.dumps(PLAN))
    plan["settings"] = {k: tuple(v) if isinstance(v, list) else v
                        for k, v in plan["settings"].items()}
    settings = suite_settings.Settings(model="tiny", **plan["settings"]).check()
    n_units = len(suite_rows._units(settings))  # pylint: disable=protected-access
    self.assertEqual(n_units, 1 + 2 + 2)  # full; poisson_tail x2 in each regime
    expected = suite_rows.expected_row_count(settings)
    logs = []
    text = os.path.join(out, "text.txt")
    with open(text, "w") as f:
      f.write("The quick brown fox jumps over the lazy dog. " * 4)
    run = suite_runner.Invocation(model="tiny", command="test", text=text,
                                  examples_by_task=self._examples())
    kw = dict(log=logs.append)
    # Interrupted after 2 units: partial rows, no report.
    res = suite_runner.run_suite(self.params, self.config, self.tok, out, plan,
                                 dataclasses.replace(run, max_units=2), **kw)
    self.assertFalse(res["complete"])
    partial = results_io.read_rows(os.path.join(out, "rows.jsonl"))
    self.assertTrue(0 < len(partial) < expected)
    # Drop the last row (a unit killed half-way), then resume.
    lines = open(os.path.join(out, "rows.jsonl")).read().splitlines(keepends=True)
    results_io.atomic_write_text(os.path.join(out, "rows.jsonl"), "".join(lines[:-1]))
    res = suite_runner.run_suite(self.params, self.config, self.tok, out, plan, run, **kw)
    self.assertTrue(res["complete"])
    rows = results_io.read_rows(os.path.join(out, "rows.jsonl"))
    self.assertLen(rows, expected)
    keys = [results_io.row_key(r, suite_rows.KEY_FIELDS) for r in rows]
    self.assertLen(set(keys), expected)  # no duplicates
    # The rows of the first run survived unchanged (same key, same draws).
    by_key = dict(zip(keys, rows))
    for r in partial[:-1]:
      self.assertEqual(by_key[results_io.row_key(r, suite_rows.KEY_FIELDS)], r)
    # A resume with another decode length would mix rows of two settings: refused.
    with self.assertRaisesRegex(ValueError, "--n_steps=4 in this run, but"):
      suite_rows.collect(self.params, self.config, self.tok,
                         dataclasses.replace(settings, n_steps=4), out,
                         examples_by_task=self._examples())
    for r in rows:
      self.assertEqual(set(r), ROW_KEYS, r["design"])
      self.assertEqual(set(r["coverage"]), {str(d) for d in suite_settings.DELTAS})
      self.assertLen(r["cov_layer"], self.config.n_layers)
      self.assertLen(r["cov_head"], self.config.n_heads)
      self.assertLen(r["tokens"], 3)
      self.assertEqual(r["n_calls"], 3 * self.config.n_layers * self.config.n_heads)
      if r["design"] == "full":
        self.assertLess(r["mean_err"], 1e-5)
    # One progress line for the whole job: stage i of n, the job's ETA.
    self.assertTrue(any(line.startswith("[stage 1/3 suite rows: ") and "| job " in line
                        and ", ETA ~" in line for line in logs), logs)
    self.assertTrue(any(line.startswith("[stage 3/3 validity") for line in logs), logs)
    # The terminal gets what ran, the claims table and the report's path, not the report.
    self.assertStartsWith(res["terminal"], "**What ran.**")
    self.assertIn("| coverage of realised error", res["terminal"])
    self.assertIn(os.path.join(out, "report.md"), res["terminal"])
    self.assertNotIn("## Streaming loss under eviction", res["terminal"])
    # Every unit of the rerun was skipped on a third call.
    logs.clear()
    suite_runner.run_suite(self.params, self.config, self.tok, out, plan, run, **kw)
    self.assertIn("0 of 5 units to run", logs[0])
    self.assertLen(results_io.read_rows(os.path.join(out, "rows.jsonl")), expected)
    report = open(os.path.join(out, "report.md")).read()
    self.assertIn("**What ran.** Model tiny; 2 tasks", report.splitlines()[2])
    self.assertIn("## Streaming loss under eviction", report)
    self.assertIn("## Validity of the certificate, raw and calibrated", report)
    self.assertTrue(os.path.exists(os.path.join(out, "validity", "summary.json")))
    self.assertLen(results_io.read_rows(os.path.join(out, "perplexity_rows.jsonl")), 2)
    for claim in ("coverage of realised error", "attribution AUC, certificate",
                  "attribution AUC, two-run disagreement", "failure prediction",
                  "question-aware eviction", "gated recomputation (streaming)"):
      self.assertIn(claim, report)
    table = [line for line in report.splitlines() if line.startswith("| coverage of")]
    self.assertNotEmpty(table)
    for line in table:
      self.assertTrue(any(f"| {v}" in line for v in stats.VERDICTS), line)
    for png in ("coverage.png", "error_vs_radius.png", "r_audit_poisson_tail.png"):
      self.assertTrue(os.path.exists(os.path.join(out, png)), png)

  @pytest.mark.slow  # 126 s cold on the 2-core CI machine (2026-12-01)
  def test_max_batch_slices_give_the_same_rows(self):
    # Deterministic designs: slicing a unit's 8 rows into calls of 3 (padded to
    # 3 rows and to the unit's lengths: one compile) changes no row.
    kw = dict(tasks=("passkey", "agent_memory"), num_examples=2, context_len=24,
              budgets=(0.25, 0.5), designs=("full", "snapkv"), regimes=("question_aware",),
              n_steps=3, n_sink=2, window=4, model="tiny")
    rows = {}
    for mb in (0, 3):
      out = self.create_tempdir().full_path
      got = suite_rows.collect(self.params, self.config, self.tok,
                               suite_settings.Settings(max_batch=mb, **kw), out,
                               examples_by_task=self._examples(), log=lambda s: None)
      rows[mb] = {results_io.row_key(r, suite_rows.KEY_FIELDS): r for r in got}
    self.assertLen(rows[3], 2 * 2 * (1 + 2))
    self.assertEqual(set(rows[0]), set(rows[3]))
    for k, r in rows[0].items():
      s = rows[3][k]
      self.assertEqual(r["tokens"], s["tokens"], k)
      self.assertAlmostEqual(r["mean_err"], s["mean_err"], delta=1e-5)
      self.assertAlmostEqual(r["mean_logprob"], s["mean_logprob"], delta=1e-4)
    with self.assertRaisesRegex(ValueError, "--max_batch"):
      suite_settings.Settings(max_batch=-1).check()

  def test_theorem1_deterministic_is_blind(self):
    out = self.create_tempdir().full_path
    exs = self._examples(1)["passkey"]
    plan = theorem1.Plan(designs=("snapkv",), budget=0.5, model="tiny", task="passkey",
                         context_len=24, n_draws=1, n_steps=2, n_sink=2, window=4)
    rows = theorem1.run_theorem1(self.params, self.config, exs, out, plan, log=lambda s: None)
    self.assertLen(rows, 1)
    r = rows[0]
    self.assertGreater(r["n_perturbed"], 0)
    self.assertTrue(r["kept_set_identical"] and r["retained_identical"]
                    and r["tokens_identical"] and r["radius_identical"], r)
    self.assertNotEqual(r["err_orig"], r["err_pert"])  # ... while the truth moved
    again = theorem1.run_theorem1(self.params, self.config, exs, out, plan,
                                  log=lambda s: None)
    self.assertEqual(again, rows)  # resumed: nothing redone
    self.assertIn("snapkv", theorem1.summarize(rows)["md"])

  @pytest.mark.slow  # 57 s cold on the 2-core CI machine (2026-12-01)
  def test_overhead_rows(self):
    out = self.create_tempdir().full_path
    exs = self._examples(1)["passkey"]
    plan = overhead.Plan(model="tiny", budget=0.5, n_steps=2, repeats=2,
                         configs=("full", "randomized+certificate",
                                  "randomized+certificate/layers+heads"))
    rows = overhead.run_overhead(self.params, self.config, exs, out, plan, log=lambda s: None)
    self.assertEqual([r["config"] for r in rows], ["full", "randomized+certificate",
                                                   "randomized+certificate/layers+heads"])
    full, cert, sub = rows
    # The tiny model: layer 0 of 2 and KV head 0 of 2 carry the certificate.
    self.assertEqual((cert["certificate_fraction"], sub["certificate_fraction"]), (1.0, 0.25))
    self.assertEqual(sub["capacity"], cert["capacity"])
    self.assertLess(cert["capacity"], full["capacity"])
    self.assertLess(cert["cache_bytes"]["kv"], full["cache_bytes"]["kv"])
    self.assertLen(cert["per_step_ms"], 2)
    # Timed in the same interleaved rounds: element r of every per_step_ms is round r.
    self.assertEqual({r["timing"] for r in rows}, {"interleaved"})
    self.assertLen({r["timing_session"] for r in rows}, 1)
    self.assertTrue(overhead.interleaved(cert, full))
    with self.assertRaisesRegex(ValueError, "configs"):
      overhead.run_overhead(self.params, self.config, exs, out,
                            overhead.Plan(model="tiny", configs=("nope",)))
    with self.assertRaisesRegex(ValueError, "repeats"):
      overhead.run_overhead(self.params, self.config, exs, out,
                            overhead.Plan(model="tiny", repeats=0))

  def test_script_flags_and_errors(self):
    with self.assertRaisesRegex(ValueError, "--designs"):
      suite_settings.Settings(designs=("nope",)).check()
    with self.assertRaisesRegex(ValueError, "--budgets"):
      suite_settings.Settings(budgets=(1.5,)).check()
    with self.assertRaisesRegex(ValueError, "--task"):
      suite_settings.Settings(tasks=("nope",)).check()
    with self.assertRaisesRegex(ValueError, "tokenizer.json"):
      model_loading.load_model(FIXTURE)  # the fixture has no tokenizer
    with self.assertRaisesRegex(ValueError, "--model"):
      model_loading.load_model("/nonexistent/dir")
    plan = suite_runner.with_overrides(suite_runner.FULL, num_examples=8, context_len=256)
    self.assertEqual((plan["settings"]["num_examples"], plan["settings"]["context_len"]),
                     (8, 256))
    self.assertEqual((plan["perplexity"]["num_examples"], plan["perplexity"]["context_len"]),
                     (8, 256))
    self.assertEqual(suite_runner.FULL["settings"]["num_examples"], 24)  # the plan is not mutated
    self.assertEqual(suite_runner.with_overrides(suite_runner.QUICK), suite_runner.QUICK)
    with self.assertRaisesRegex(ValueError, "--context_len must be a positive int"):
      suite_runner.with_overrides(suite_runner.QUICK, context_len=0)

  def test_hf_directory_with_tokenizer_json(self):
    d = test_util.tiny_hf_dir(self.create_tempdir().full_path, test_util.LOWER_CHARS)
    n_vocab = 2 + len(test_util.LOWER_CHARS)  # <s>, <unk>, the characters
    params, config, tok = model_loading.load_model(d)
    self.assertEqual(config.n_layers, self.config.n_layers)
    self.assertIsNotNone(params)
    ids = tok.encode("pass key 123.")
    self.assertEqual(ids[0], 0)
    self.assertEqual(tok.decode(ids[1:]), "pass key 123.")
    self.assertEqual(model_loading.model_name(d + "/"), os.path.basename(d))
    ex = tasks.make_task("passkey", tok, 1, 32, 0)[0]  # no chat template: plain prompt
    self.assertTrue(all(0 <= i < n_vocab for i in ex.context_ids))

  def test_analyses_on_known_rows(self):
    def row(design, run, ex, correct, tokens, cert, lp, budget=0.25, regime="streaming"):
      return dict(task="t", example=ex, design=design, run=run, regime=regime, budget=budget,
                  correct=correct, tokens=tokens, cert_score=cert, cert_sub_mean=cert,
                  mean_logprob=lp, err_step_sum_mean=cert, randomized=design != "full")
    rows = []
    full = [True, True, False, True, False, True]
    ev = [False, True, False, False, False, True]
    for i in range(6):
      rows.append(row("full", 0, i, full[i], [1, 2], 0.0, -0.1, budget=1.0,
                      regime="question_aware"))
      rows.append(row("poisson_tail", 0, i, ev[i], [1, 2], float(i), -float(i)))
      rows.append(row("poisson_tail", 1, i, ev[i], [1, 2] if i % 2 else [1, 3], 0.0, 0.0))
    dis = failures.disagreement(rows)
    self.assertEqual(dis[("streaming", 0.25, "t", 0)], 0.5)
    self.assertEqual(dis[("streaming", 0.25, "t", 1)], 0.0)
    sel, a = failures._failure_table(rows)  # pylint: disable=protected-access
    self.assertLen(sel, 6)
    np.testing.assert_array_equal(a["full"], full)
    out = failures.failure_analysis(rows)
    # failure AUC of cert = i: failures at 0, 2, 3, 4 vs successes at 1, 5.
    from experiments.lib import stats  # pylint: disable=g-import-not-at-top
    self.assertAlmostEqual(out["failure_auc"]["certificate"][0],
                           stats.roc_auc(np.arange(6.0), ~np.asarray(ev)))
    self.assertAlmostEqual(out["attribution_auc"]["certificate"][0],
                           stats.attribution_auc(np.arange(6.0), full, ev))
    self.assertIn("gating_streaming", out)
    verdicts = {c["claim"]: c["verdict"] for c in out["claims"]}
    for claim, v in verdicts.items():
      self.assertIn(v, stats.VERDICTS + (common.NOT_ESTIMABLE, failures.UNTESTABLE), claim)
    # confidence / random < 1 goes through stats.verdict (region (-inf, 1)).
    below = [c for c in out["claims"] if "below random" in c["claim"]][0]
    self.assertEqual(below["verdict"], common.verdict_of(failures.BELOW_RANDOM, below["ci"],
                                                         "lower"))

  def test_coverage_assumption2_and_regimes_on_known_rows(self):
    # The three analyses the (slow) run_all test reaches through real rows, on
    # hand-made rows whose answers are known.
    plot_dir = self.create_tempdir().full_path
    rng = np.random.default_rng(0)
    rows = []
    for budget in (0.25, 0.5):
      for ex in range(4):
        err = rng.uniform(0.0, 1.0, 5)
        rows.append(dict(
            task="t", example=ex, design="poisson_tail", run=0, randomized=True,
            regime="streaming", budget=budget, coverage={"0.05": float(ex % 2), "0.1": 1.0},
            sharpness=1.5, mean_err=0.1, mean_radius=0.2, cov_layer=[1.0, 0.5],
            cov_head=[0.5, 1.0], sample=dict(err=err.tolist(), radius=[0.5] * 5,
                                             R=rng.uniform(0.5, 4.0, 5).tolist(),
                                             m=[2.0] * 5, n_tail=[6.0] * 5)))
    cov = coverage.coverage_analysis(rows, plot_dir)
    by = {(b["budget"], b["delta"]): b["coverage"][0] for b in cov["by"]}
    self.assertEqual(by, {(0.25, 0.05): 0.5, (0.25, 0.1): 1.0, (0.5, 0.05): 0.5,
                          (0.5, 0.1): 1.0})
    self.assertAlmostEqual(cov["claims"][0]["ci"][0], 0.5)
    self.assertLen(cov["claims"], 3)  # all budgets, then each budget
    self.assertIn("| poisson_tail | 1.00 0.50 | 0.500 |", cov["md"])  # per layer
    a2 = assumption2.assumption2_analysis(rows, plot_dir)["designs"]["poisson_tail"]
    r_all = np.concatenate([r["sample"]["R"] for r in rows])
    hit = np.concatenate([np.asarray(r["sample"]["err"]) <= 0.5 for r in rows])
    self.assertEqual(a2["n_calls"], 40)
    self.assertAlmostEqual(a2["R_max"], float(r_all.max()))
    self.assertEqual(a2["coverage_by_R"]["count"], [40])  # 40 calls: one bin
    self.assertAlmostEqual(a2["coverage_by_R"]["coverage"][0], float(hit.mean()))
    for png in ("coverage.png", "error_vs_radius.png", "r_audit_poisson_tail.png"):
      self.assertTrue(os.path.exists(os.path.join(plot_dir, png)), png)
    # Regimes: damage = full-cache correctness - evicted correctness, per example.
    full, qa, st = [1, 1, 0, 1], [1, 0, 0, 1], [0, 0, 0, 1]
    rows = [dict(task="t", example=i, design="full", run=0, regime="question_aware",
                 budget=1.0, correct=bool(full[i])) for i in range(4)]
    for regime, ok in (("question_aware", qa), ("streaming", st)):
      rows += [dict(task="t", example=i, design="snapkv", run=0, regime=regime, budget=0.5,
                    correct=bool(ok[i])) for i in range(4)]
    reg = regimes.regimes_analysis(rows)
    damage = {e["regime"]: e["damage"][0] for e in reg["table"]}
    self.assertEqual(damage, {"question_aware": 0.25, "streaming": 0.5})
    self.assertEqual([c["ci"][0] for c in reg["claims"]], [0.25, 0.25])  # qa; streaming - qa


def _timed_rows(ms_by_config, session="s1"):
  """Overhead rows timed in the interleaved rounds of one session (ms/step per round)."""
  return [dict(config=c, design=c, capacity=8, per_step_ms=[float(x) for x in ms],
               median_ms=float(np.median(ms)), batch=1, prompt_len=10, n_steps=2, budget=0.5,
               cache_bytes={"kv": 1, "metadata": 1}, timing="interleaved",
               timing_session=session) for c, ms in ms_by_config.items()]


def _gating_rows(full, evicted, cert):
  """Streaming failure-analysis rows, an example per entry: the design's two runs (the same
  answers) and the full cache's."""
  return [dict(task="t", example=i, design="poisson_tail", run=run, regime="streaming",
               budget=0.25, correct=bool(e), tokens=[1], cert_score=float(c),
               cert_sub_mean=float(c), mean_logprob=-float(c), err_step_sum_mean=float(c),
               randomized=True) for run in (0, 1)
          for i, (e, c) in enumerate(zip(evicted, cert))] + [
          dict(task="t", example=i, design="full", run=0, regime="streaming", budget=1.0,
               correct=bool(f), tokens=[1], cert_score=0.0, cert_sub_mean=0.0,
               mean_logprob=0.0, err_step_sum_mean=0.0, randomized=False)
          for i, f in enumerate(full)]


class GatingClaimTest(absltest.TestCase):
  """The gating claims: the certificate against oracle gating at the same recompute budget,
  and a claim that no gating could meet on the rows is untestable, not refuted."""

  def _claims(self, rows):
    out = failures.failure_analysis(rows)
    return {c["claim"].split(": ")[1].split(" at ")[0]: c for c in out["claims"]
            if c["claim"].startswith("gated recomputation")}

  def test_share_of_oracle_gating_at_the_same_budget(self):
    # 16 examples, 8 of them gain from recomputing (full right, evicted wrong); at budget
    # 0.25 (k = 4) the oracle gets 4 of the 8, the certificate ranks 2 of them first: half
    # of what oracle gating gets, a quarter of all the recoverable gain.
    full = [True] * 16
    evicted = [False] * 8 + [True] * 8
    cert = [10, 9] + [0] * 6 + [8, 7] + [0] * 6
    claims = self._claims(_gating_rows(full, evicted, cert))
    share = claims["certificate's gain over oracle gating's"]
    self.assertAlmostEqual(share["ci"][0], 0.5)
    self.assertIn("of all the recoverable gain: certificate 0.250", share["note"])
    self.assertAlmostEqual(stats.oracle_share(np.asarray([1.0] * 8 + [0.0] * 8),
                                              np.asarray(cert, float), 0.25), 0.5)
    # random captures k/n of the 4, the oracle all 4: the 1.7x claim can be tested here
    self.assertNotEqual(claims["certificate / random gating"]["verdict"], failures.UNTESTABLE)

  def test_a_claim_no_gating_can_meet_is_untestable(self):
    # Every example gains: random gating is the oracle, so certificate / random = 1 cannot
    # reach 1.7x whatever the certificate; the verdict says so rather than refuting it.
    rng = np.random.default_rng(0)
    claims = self._claims(_gating_rows([True] * 16, [False] * 16, rng.random(16)))
    ratio = claims["certificate / random gating"]
    self.assertAlmostEqual(ratio["ci"][0], 1.0)
    self.assertEqual(ratio["verdict"], failures.UNTESTABLE)
    self.assertIn("oracle / random: 1.000", ratio["note"])

  def test_one_example_has_no_interval(self):
    ci = common.ci(np.mean, np.asarray([0.98, 0.97]), groups=np.asarray(["t:0", "t:0"]))
    self.assertAlmostEqual(ci[0], 0.975)
    self.assertTrue(np.isnan(ci[1]) and np.isnan(ci[2]))
    self.assertEqual(common.verdict_of((0.969, 0.977), ci, "higher"), common.NOT_ESTIMABLE)


class StudyResumeTest(absltest.TestCase):
  """A study resumed into a folder of rows made with other settings refuses them, and
  reports only the rows its plan asks for. Rows are written by hand: no model runs."""

  def setUp(self):
    super().setUp()
    test_util.ensure_flags_parsed()
    self.out = self.create_tempdir().full_path
    self.examples = [types.SimpleNamespace(context_ids=[1, 2, 3], question_ids=[4])] * 2

  def test_theorem1(self):
    res = results_io.JsonlResults(os.path.join(self.out, "theorem1_rows.jsonl"),
                                  theorem1.KEY_FIELDS)
    common = dict(model="smollm2", task="passkey", budget=0.25, seed=0, context_len=160)
    res.add_many([dict(common, design="poisson_tail", example=i, draw=k, n_steps=8, n_sink=4,
                       window=16, err_orig=1.0) for i in range(3) for k in range(4)])
    plan = theorem1.Plan(designs=("poisson_tail",), n_draws=2, n_steps=8, n_sink=4, window=16,
                         **common)
    rows = theorem1.run_theorem1(None, None, self.examples, self.out, plan, log=lambda _: None)
    self.assertEqual(sorted((r["example"], r["draw"]) for r in rows),
                     [(0, 0), (0, 1), (1, 0), (1, 1)])  # 2 examples x 2 draws, not all 12
    with self.assertRaisesRegex(ValueError, "--n_steps=20 in this run, .* n_steps=8"):
      theorem1.run_theorem1(None, None, self.examples, self.out,
                            dataclasses.replace(plan, n_steps=20), log=lambda _: None)

  def test_overhead(self):
    res = results_io.JsonlResults(os.path.join(self.out, "overhead_rows.jsonl"),
                                  overhead.KEY_FIELDS)
    res.add_many([dict(model="smollm2", config=c, budget=0.25, batch=2, prompt_len=4,
                       n_steps=16, seed=0, per_step_ms=[10.0] * 5, median_ms=10.0,
                       design={"full": "full", "deterministic": "snapkv"}.get(c, "poisson_tail"))
                  for c in overhead.ALL_CONFIGS])  # as written before the fields were recorded
    plan = overhead.Plan(model="smollm2", repeats=5, configs=("full", "deterministic"))
    rows = overhead.run_overhead(None, None, self.examples, self.out, plan, log=print)
    self.assertEqual(sorted(r["config"] for r in rows), ["deterministic", "full"])
    with self.assertRaisesRegex(ValueError, "--deterministic=h2o .* deterministic=snapkv"):
      overhead.run_overhead(None, None, self.examples, self.out,
                            dataclasses.replace(plan, deterministic="h2o"), log=print)
    with self.assertRaisesRegex(ValueError, "--repeats=9 .* repeats=5"):
      overhead.run_overhead(None, None, self.examples, self.out,
                            dataclasses.replace(plan, repeats=9), log=print)

  def test_montecarlo(self):
    res = results_io.JsonlResults(os.path.join(self.out, "rows.jsonl"),
                                  ("problem", "regime", "design", "budget"))
    res.add_many([dict(problem="gaussian", regime="streaming", design=d, budget=0.5,
                       randomized=d == "poisson_tail", mean_kept=32.0, mse=1.0, var_ratio=1.0,
                       coverage={"0.05": 0.9}, sharpness={"0.05": 2.0}, median_R=1.0,
                       context_len=64, head_dim=8, seed=0)
                  for d in ("poisson_tail", "h2o")])  # no num_trials, n_sink, window: older
    plan = montecarlo_experiment.Plan(
        context_len=64, head_dim=8, budgets=(0.5,), deltas=(0.05,), designs=("poisson_tail",),
        problems=("gaussian",), regimes=("streaming",), seed=0)
    with mock.patch("builtins.print"):
      summary = montecarlo_experiment.run_and_report(plan, out=self.out)
    self.assertIn("| poisson_tail |", summary)
    self.assertNotIn("| h2o |", summary)  # on file, but not in this plan
    with self.assertRaisesRegex(ValueError, "--context_len=128 .* context_len=64"):
      montecarlo_experiment.run_and_report(dataclasses.replace(plan, context_len=128),
                                           out=self.out)


class TheoremAndOverheadTest(absltest.TestCase):

  def test_summaries(self):
    rows = [dict(design="snapkv", retained_identical=True, kept_set_identical=True,
                 tokens_identical=True,
                 radius_identical=True, err_orig=0.1, err_pert=0.3, mean_radius=0.0,
                 coverage_orig=0.0, coverage_pert=0.0)]
    s = theorem1.summarize(rows)
    self.assertAlmostEqual(s["designs"]["snapkv"]["rel_err_change"], 2.0)
    ov = [dict(config=c, design=c, capacity=8, per_step_ms=[m, m], median_ms=m, batch=1,
               prompt_len=10, n_steps=2, budget=0.5, cache_bytes={"kv": 1, "metadata": 1})
          for c, m in zip(overhead.ALL_CONFIGS, (1.0, 2.0, 3.0, 4.0, 3.5, 3.2, 3.1))]
    s = overhead.summarize(ov)
    self.assertAlmostEqual(s["ratio_cert_vs_deterministic"][0], 2.0)
    self.assertAlmostEqual(s["ratio_randomized+certificate/layers_vs_randomized"][0], 3.5 / 3)
    self.assertIn("randomized+certificate/layers+heads", s["md"])
    del ov[-1]  # a missing subsampled configuration is left out, not an error
    self.assertNotIn("randomized+certificate/layers+heads", overhead.summarize(ov)["md"])
    self.assertEqual(suite_report.overhead_claims(s)[0]["verdict"], "reproduced")
    # These rows carry no timing session: timed one after another, bootstrap interval.
    self.assertEqual(s["timing"]["ratio_cert_vs_deterministic"]["method"], "sequential")
    self.assertIn("one configuration after another", s["md"])

  def test_overhead_ratio_is_the_median_of_per_round_ratios(self):
    # The machine drifts 7x over the rounds; within a round the certificate costs 2.2x
    # the deterministic design. Per-round ratios see 2.2 exactly; medians of the two
    # configurations' own timings, resampled apart, see the drift.
    drift = np.arange(1.0, 8.0) * 10.0
    ms = {c: drift * f for c, f in zip(overhead.ALL_CONFIGS,
                                        (1.0, 1.0, 1.5, 2.2, 1.8, 1.9, 1.6))}
    s = overhead.summarize(_timed_rows(ms))
    np.testing.assert_allclose(s["ratio_cert_vs_deterministic"], [2.2, 2.2, 2.2])
    np.testing.assert_allclose(s["ratio_cert_vs_randomized"], [2.2 / 1.5] * 3)
    info = s["timing"]["ratio_cert_vs_deterministic"]
    self.assertEqual((info["method"], info["rounds"]), ("interleaved", 7))
    self.assertGreaterEqual(info["level"], 0.95)
    self.assertIn("median of 7 per-round ratios (interleaved rounds in one run)", s["md"])
    self.assertIn("- ratio_cert_vs_deterministic: 2.20 [2.20, 2.20] (+-0%)", s["md"])
    claim = suite_report.overhead_claims(s)[0]
    self.assertEqual(claim["verdict"], "reproduced")
    self.assertIn("noise: +-0%", claim["note"])
    self.assertIn("7 per-round ratios", claim["note"])
    # The same timings from two timing sessions do not pair: the bootstrap of the
    # medians spans the drift and the verdict is inconclusive.
    rows = _timed_rows({c: m for c, m in ms.items() if c != "deterministic"}, "s1")
    rows += _timed_rows({"deterministic": ms["deterministic"]}, "s2")
    s = overhead.summarize(rows)
    self.assertEqual(s["timing"]["ratio_cert_vs_deterministic"]["method"], "sequential")
    self.assertEqual(s["timing"]["ratio_cert_vs_randomized"]["method"], "interleaved")
    lo, hi = s["ratio_cert_vs_deterministic"][1:]
    self.assertTrue(lo < 1.5 and hi > 2.5, (lo, hi))
    self.assertEqual(suite_report.overhead_claims(s)[0]["verdict"], "inconclusive")
    self.assertIn("one configuration after another", s["md"])  # said per ratio

  def test_overhead_claim_is_two_sided(self):
    base = np.asarray([10.0, 11.0, 9.0, 10.5, 10.2, 9.8, 10.1])
    for factor, verdict, side in ((1.05, "refuted", "cheaper than claimed"),
                                  (2.0, "reproduced", None),
                                  (3.0, "refuted", "dearer than claimed")):
      ms = {c: base * (factor if c == "randomized+certificate" else 1.0)
            for c in overhead.ALL_CONFIGS}
      claim = suite_report.overhead_claims(overhead.summarize(_timed_rows(ms)))[0]
      self.assertEqual(claim["verdict"], verdict, factor)
      self.assertEqual(claim["paper"], "about 2x (band 1.5-2.5)")
      if side:
        self.assertIn(side, claim["note"])
      else:
        self.assertNotIn("than claimed", claim["note"])
    # No interval: not estimable.
    claim = suite_report.overhead_claims({"ratio_cert_vs_deterministic": None})[0]
    self.assertEqual(claim["verdict"], "inconclusive (not estimable)")

  def test_report_states_the_rule(self):
    settings = suite_settings.Settings(model="tiny").check()
    report = suite_report.render_report(sections=[], theorem1=None, overhead=None,
                                        settings=settings,
                                        header=suite_report.Header(command="c", wall_s=1.0,
                                                                   machine="m"))
    self.assertIn(suite_report.VERDICT_RULE, report)
    self.assertIn("Machine: m", report)
    for phrase in ("reproduced if our whole 95% interval lies in the region",
                   "refuted if it lies wholly outside it", "inconclusive if it spans a "
                   "boundary"):
      self.assertIn(phrase.lower(), report.lower())
    self.assertNotIn("not reproduced", report)


def _suite_rows(settings):
  """Hand-made rows of every (unit, budget, task, example) of ``settings``."""
  rng = np.random.default_rng(0)
  rows = []
  for regime, design, run in suite_rows._units(settings):  # pylint: disable=protected-access
    for budget in suite_rows.unit_budgets(settings, design):
      for task in settings.tasks:
        for ex in range(settings.num_examples):
          err = rng.uniform(0.0, 1.0, 5)
          row = suite_rows.row_fields(settings, task, regime, design, budget, run, ex)
          row.update(
              randomized=design_defaults.is_randomized(design), correct=bool((ex + run) % 2),
              tokens=[1, 2 + (ex + run) % 2], cert_score=float(ex), cert_sub_mean=float(ex),
              mean_logprob=-float(ex), err_step_sum_mean=float(ex),
              coverage={str(d): float(ex % 2) for d in settings.deltas}, sharpness=1.5,
              mean_err=0.1, mean_radius=0.2, cov_layer=[1.0, 0.5], cov_head=[0.5, 1.0],
              sample=dict(err=err.tolist(), radius=[0.5] * 5,
                          R=rng.uniform(0.5, 4.0, 5).tolist(), m=[2.0] * 5,
                          n_tail=[6.0] * 5))
          rows.append(row)
  return rows


class RerenderTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    test_util.ensure_flags_parsed()  # create_tempdir reads --test_tmpdir

  def test_rerender_from_rows_without_a_model(self):
    out = self.create_tempdir().full_path
    plan = dict(settings=dict(tasks=("passkey",), num_examples=4, budgets=(0.25, 0.5),
                              designs=("full", "poisson_tail"), n_runs=2, seed=0),
                theorem1=None, overhead=dict(budget=0.5, n_steps=2), perplexity=None,
                validity=None, damage=None)
    settings = suite_settings.Settings(model="tiny", **plan["settings"]).check()
    rows = _suite_rows(settings)
    self.assertLen(rows, suite_rows.expected_row_count(settings))
    with self.assertRaisesRegex(ValueError, r"rows.jsonl has 0 of \d+ suite rows.*overhead"):
      suite_runner.rerender_report(out, plan, model="tiny", log=lambda s: None)
    for r in rows:
      results_io.JsonlResults(os.path.join(out, "rows.jsonl"), suite_rows.KEY_FIELDS).add(r)
    ms = {c: np.arange(1.0, 8.0) * f for c, f in zip(overhead.ALL_CONFIGS,
                                                     (1.0, 1.0, 1.5, 1.2, 1.1, 1.1, 1.1))}
    for r in _timed_rows(ms):
      r.update(model="tiny", seed=0)
      results_io.JsonlResults(os.path.join(out, "overhead_rows.jsonl"),
                              overhead.KEY_FIELDS).add(r)
    with open(os.path.join(out, "report.md"), "w") as f:
      f.write("# old\n\nCommand: `python -m experiments.run_all --out=x`  \nWall time: 12 s  \n"
              "Machine: the old machine  \n\nVerdict rule: old\n")
    report = suite_runner.rerender_report(out, plan, model="tiny", log=lambda s: None)
    self.assertEqual(report, open(os.path.join(out, "report.md")).read())
    self.assertIn("Command: `python -m experiments.run_all --out=x`", report)
    self.assertIn("Wall time: 12 s", report)
    self.assertIn("Machine: the old machine", report)
    self.assertIn(suite_report.VERDICT_RULE, report)
    self.assertIn("Re-rendered from these rows", report)
    overhead_line = [line for line in report.splitlines()
                     if line.startswith("| measured overhead")][0]
    self.assertIn("| 1.200 [1.200, 1.200] | refuted | cheaper than claimed", overhead_line)
    blob = json.load(open(os.path.join(out, "report.json")))
    self.assertEqual(blob["wall_s"], 12.0)
    self.assertEqual(blob["overhead"]["timing"]["ratio_cert_vs_deterministic"]["method"],
                     "interleaved")
    for s in blob["sections"]:
      for c in s.get("claims", []):
        self.assertIn(c["verdict"], stats.VERDICTS + (common.NOT_ESTIMABLE,), c["claim"])
    # A plan asking for what the folder lacks: an error, not a model run.
    with self.assertRaisesRegex(ValueError, "theorem1_rows.jsonl has 0 of 2 rows"):
      suite_runner.rerender_report(
          out, dict(plan, theorem1=dict(task="passkey", num_examples=2, designs=("snapkv",),
                                        budget=0.25, n_draws=3)), model="tiny")
    with self.assertRaisesRegex(ValueError, "validity"):
      suite_runner.rerender_report(out, dict(plan, validity=dict(num_examples=1)),
                                   model="tiny")
    with self.assertRaisesRegex(ValueError, "damage"):
      suite_runner.rerender_report(out, dict(plan, damage={}), model="tiny")


if __name__ == "__main__":
  absltest.main()
