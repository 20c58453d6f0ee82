"""The RULER leaderboard (experiments/leaderboard.py) on the tiny Llama fixture.

A character-level tokenizer, two tasks at 1,024 characters, the full cache and
one randomized design at one ratio, both regimes: the rows, resuming, the
report and summary.json; that the shared prefill gives what the design's own
``generate`` / ``generate_streaming`` call gives; and the plan's checks.
"""

import dataclasses
import json
import os
import shutil

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certkv_jax.kv import memory
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import results_io
from experiments.lib import variants
from experiments.lib.equal_memory import report as equal_memory_report
from experiments.lib.leaderboard import experiment
from experiments.lib.leaderboard import rows as rows_lib
from experiments.lib.leaderboard import report
from models import decode
from models.text import certificate as certificate_lib
from tests import test_util

TASKS = ("niah_single_1", "fwe")
PLAN = dict(tasks=TASKS, context_lens=(1024,), n_examples=2, designs=("poisson_tail",),
            ratios=(0.5,), group=2, max_new_tokens=4, n_sink=1, window=2)


def _tiny_model(root):
  model_dir = os.path.join(root, "tiny_char")
  os.makedirs(model_dir)
  test_util.tiny_hf_dir(model_dir, test_util.MIXED_CASE_CHARS)
  return model_loading.load_model(model_dir)


class _TinyModelCase(absltest.TestCase):
  """The tiny character model in a temporary directory, and the test plan."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    test_util.ensure_flags_parsed()
    cls.root = test_util.temp_dir(cls)
    cls.params, cls.config, cls.tok = _tiny_model(cls.root)
    cls.plan = experiment.Plan(**PLAN)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.root, ignore_errors=True)
    super().tearDownClass()


@pytest.mark.slow  # compiles the tiny model's prefill, eviction and decode (~1 min on CPU)
class LeaderboardTest(_TinyModelCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = os.path.join(cls.root, "out")
    cls.logs = []
    cls.rows = experiment.run(cls.params, cls.config, cls.tok, cls.out, cls.plan, model="tiny",
                              log=cls.logs.append)

  def test_rows(self):
    # 2 tasks x 2 regimes x (full at ratio 0, poisson_tail at 0.5) x 2 examples
    self.assertLen(self.rows, 16)
    for r in self.rows:
      self.assertBetween(r["score"], 0.0, 1.0)
      self.assertLessEqual(r["n_prompt_tokens"] + r["max_new_tokens"], 1024)
      self.assertEqual(r["max_new_tokens"], 4)
      self.assertNotEmpty(r["answers"])
      if r["design"] == "full":
        self.assertEqual((r["ratio"], r["kept"], r["randomized"]), (0.0, 1.0, False))
        self.assertNotIn("radius_steps", r)
        continue
      self.assertEqual((r["ratio"], r["budget"], r["randomized"]), (0.5, 0.5, True))
      self.assertBetween(r["kept"], 0.4, 0.55)
      used = min(r["n_generated"] + r["stopped"], 4) - 1
      self.assertLen(r["radius_steps"], used)
      self.assertLen(r["error_steps"], used)
      self.assertEqual(r["n_calls"], used * self.config.n_layers * self.config.n_heads)
      self.assertBetween(r["raw_coverage"], 0.0, 1.0)
      # the smoothed radius is never below the raw one
      self.assertBetween(r["smoothed_coverage"], r["raw_coverage"], 1.0)
    calls = os.listdir(os.path.join(self.out, "calls"))
    self.assertLen(calls, 4)  # poisson_tail: one file per (task, regime)
    self.assertTrue(any("full" in line for line in self.logs))
    self.assertIn("prefill", self.logs[1])  # poisson_tail paid the prefill, full reused it

  def test_resume_runs_nothing(self):
    logs = []
    rows = experiment.run(self.params, self.config, self.tok, self.out, self.plan, model="tiny",
                          log=logs.append)
    self.assertEqual(logs, [f"0 of 8 units to run; rows in "
                            f"{os.path.join(self.out, experiment.ROWS_FILE)}"])
    self.assertLen(rows, 16)

  def test_rows_of_other_settings_are_refused(self):
    # A resume or a --report_only (main calls check_rows before writing the report) with
    # another answer length or window: before, the answer length was taken as it came
    # and a report described the flags, not the rows.
    results = results_io.JsonlResults(os.path.join(self.out, experiment.ROWS_FILE),
                                      experiment.KEY_FIELDS)
    rows_lib.check_rows(results, self.plan, "tiny")
    for change, pattern in ((dict(max_new_tokens=8), r"--max_new_tokens=8 .* max_new_tokens=4"),
                            (dict(window=self.plan.window + 1), r"--window=")):
      with self.assertRaisesRegex(ValueError, pattern):
        rows_lib.check_rows(results, dataclasses.replace(self.plan, **change), "tiny")
    # Rows from before the settings were recorded hold the defaults (as every committed
    # run's): a run with another chat setting or window is refused, not mixed in.
    legacy = results_io.JsonlResults(os.path.join(self.root, "legacy_rows.jsonl"),
                                     experiment.KEY_FIELDS)
    legacy.add_many([{k: v for k, v in r.items() if k not in ("n_sink", "window", "use_chat")}
                     for r in results.rows])
    default = dataclasses.replace(self.plan, n_sink=design_defaults.N_SINK,
                                  window=design_defaults.WINDOW)
    rows_lib.check_rows(legacy, default, "tiny")
    for change in (dict(use_chat=False), dict(window=design_defaults.WINDOW + 1)):
      with self.assertRaisesRegex(ValueError, "holds rows made with"):
        rows_lib.check_rows(legacy, dataclasses.replace(default, **change), "tiny")
    # More ratios: each unit would rerun whole and find its old rows on file; refused
    # before any model work (before: after the unit ran, naming no flag).
    more = dataclasses.replace(self.plan, ratios=(0.5, 0.25))
    with self.assertRaisesRegex(ValueError, r"--ratios / --n_examples / --group: .* holds "
                                "some of the rows of unit"):
      experiment.run(self.params, self.config, self.tok, self.out, more, model="tiny")

  def test_report(self):
    s = report.write(self.rows, self.out, self.plan, n_kv_heads=self.config.n_kv_heads,
                     model="tiny")
    for f in ("report.md", "summary.json", "score.png"):
      self.assertTrue(os.path.exists(os.path.join(self.out, f)), f)
    with open(os.path.join(self.out, "summary.json")) as f:
      summary = json.load(f)
    self.assertEqual(summary["headline"], {"context_len": 1024, "regime": "streaming"})
    self.assertEqual(set(summary["score"]), {"full", "poisson_tail"})
    self.assertEqual(set(summary["score"]["poisson_tail"]), {"0.5"})
    self.assertEqual(set(summary["score"]["full"]), {"0.5"})  # the reference at every ratio
    cell = summary["score"]["poisson_tail"]["0.5"]
    self.assertEqual(set(cell), {"value", "ci", "n"})
    self.assertEqual(cell["n"], 2 * len(TASKS))
    self.assertLessEqual(cell["ci"][0], cell["value"])
    self.assertEqual(set(summary["score_by_task"]["poisson_tail"]["0.5"]), set(TASKS))
    self.assertEqual(summary["n_examples"], {t: 2 for t in TASKS})
    self.assertEqual(summary["not_run"], [])
    self.assertIn("qa_1", summary["left_out"])
    self.assertEqual(set(summary["cells"]), {"1024/streaming", "1024/query_aware"})
    for name, cell in summary["cells"].items():
      rows = [r for r in self.rows if f"{r['context_len']}/{r['regime']}" == name
              and r["design"] == "poisson_tail"]
      want = np.mean([100 * np.mean([r["score"] for r in rows if r["task"] == t]) for t in TASKS])
      self.assertAlmostEqual(cell["score"]["poisson_tail"]["0.5"]["value"], want)  # tasks alike
      cov = cell["coverage"]["poisson_tail"]["0.5"]
      self.assertEqual(cov["n_calls"], sum(r["n_calls"] for r in rows))
      self.assertAlmostEqual(cov["smoothed"], sum(r["smoothed_coverage"] * r["n_calls"]
                                                  for r in rows) / cov["n_calls"])
      self.assertBetween(cov["calibrated"], 0.0, 1.0)  # leave-one-task-out: 2 tasks
      self.assertAlmostEqual(cov["robust"], cov["calibrated"])  # one other task: max = pool
      for k in ("raw", "calibrated", "robust"):  # covered calls: radius >= error
        self.assertGreaterEqual(cov[k + "_sharpness"], 1.0)
      # the same coverage as the equal-memory study's, each task held out in turn
      cell_key = report.Cell(int(name.split("/")[0]), name.split("/")[1], "poisson_tail", 0.5)
      scores = {t: report._scores(report._load_calls(self.out, self.plan, cell_key, t))
                for t in TASKS}
      want = [equal_memory_report.coverage([scores[u] for u in TASKS if u != t], [scores[t]],
                                           self.config.n_kv_heads) for t in TASKS]
      n = [scores[t].size for t in TASKS]
      self.assertAlmostEqual(cov["calibrated"],
                             sum(w["calibrated"] * m for w, m in zip(want, n)) / sum(n))
      self.assertIn("n_sink", cov["shipped_note"])  # fitted with other settings
    self.assertIn("| full (reference) |", s["md"])
    self.assertIn("poisson_tail", s["md"])

  def test_incomplete_designs_are_not_run(self):
    plan = experiment.Plan(**dict(PLAN, designs=("poisson_tail", "h2o")))
    s = report.summarize(self.rows, self.out, plan, n_kv_heads=self.config.n_kv_heads)
    self.assertEqual(s["not_run"], ["h2o"])
    self.assertNotIn("h2o", s["score"])

  def test_calls_are_found_whatever_the_reports_group(self):
    cell = report.Cell(1024, "streaming", "poisson_tail", 0.5)
    made = report._load_calls(self.out, self.plan, cell, TASKS[0])  # pylint: disable=protected-access
    other = report._load_calls(self.out, dataclasses.replace(self.plan, group=1), cell,  # pylint: disable=protected-access
                               TASKS[0])
    self.assertEqual(made[0].shape[0], other[0].shape[0])  # not just the first unit's
    for a, b in zip(made, other):
      np.testing.assert_array_equal(a, b)

  def test_a_report_of_fewer_tasks_counts_only_their_calls(self):
    plan = experiment.Plan(**dict(PLAN, tasks=TASKS[:1]))
    s = report.summarize(self.rows, self.out, plan, n_kv_heads=self.config.n_kv_heads)
    rows = [r for r in self.rows if r["task"] == TASKS[0] and r["design"] == "poisson_tail"
            and r["regime"] == "streaming"]
    cov = s["cells"]["1024/streaming"]["coverage"]["poisson_tail"]["0.5"]
    self.assertEqual(cov["n_calls"], sum(r["n_calls"] for r in rows))  # not the other task's


@pytest.mark.slow  # compiles the prefill, an allocated eviction and decode (~1 min on CPU)
class EqualMemoryTest(absltest.TestCase):
  """Variants with per-head allocations at equal memory, without evaluation mode."""

  def test_rows_and_mixing(self):
    test_util.ensure_flags_parsed()
    root = test_util.temp_dir(self)
    params, config, tok = _tiny_model(root)
    plan = experiment.Plan(**dict(PLAN, tasks=("niah_single_1",), regimes=("streaming",),
                                  designs=("h2o", "h2o+adakv", "priority_floor+cert"),
                                  equal_memory=True, coverage=False))
    out = os.path.join(root, "out")
    rows = experiment.run(params, config, tok, out, plan, model="tiny", log=lambda _: None)
    self.assertLen(rows, 8)  # (full, three variants) x 2 examples
    for r in rows:
      self.assertTrue(r["equal_memory"])
      self.assertNotIn("n_calls", r)  # --nocoverage: no certificate fields
      if r["design"] == "full":
        continue
      design, alloc = experiment.design_of(r["design"], plan)
      self.assertAlmostEqual(r["budget"], memory.token_fraction(0.5, design, config.head_dim,
                                                                allocation=alloc))
      self.assertLess(r["budget"], 0.5)  # metadata costs tokens
      self.assertBetween(r["kept"], 0.3, r["budget"] + 0.05)
    s = report.summarize(rows, out, plan, n_kv_heads=config.n_kv_heads)
    self.assertEqual(s["cells"]["1024/streaming"]["coverage"], {})
    self.assertEqual(s["best_deterministic"], {"0.5": "h2o"})  # uniform budgets only
    self.assertIn("priority_floor+cert", s["paired_vs_best_deterministic"])
    with self.assertRaisesRegex(ValueError, "--equal_memory=False"):
      experiment.run(params, config, tok, out, experiment.Plan(**PLAN), model="tiny")


@pytest.mark.slow  # compiles generate and generate_streaming besides the shared path
class SharedPrefillTest(_TinyModelCase):
  """The shared prefill, one eviction per design and the design-free decode give what
  the design's own generation call gives (the whole context as one chunk)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    from experiments.lib import ruler  # pylint: disable=g-import-not-at-top
    cls.examples = ruler.make_examples("niah_single_1", cls.tok, 2, 1024, 0, max_new_tokens=4)

  def _compare(self, name, regime, batch=None):
    if batch is None:
      batch = experiment._Batch(self.examples, regime, 1024, 4)  # pylint: disable=protected-access
    ratios = (0.25, 0.75)
    key = jax.random.PRNGKey(3)
    got, _, _ = experiment.run_design(self.params, self.config, batch, name, ratios, key,
                                      self.plan)
    design = design_defaults.make_design(name, 0.5, self.plan.n_sink, self.plan.window)
    budget = np.tile([0.75, 0.25], 2).astype(np.float32)
    rep = lambda x: np.repeat(np.asarray(x), 2, axis=0)
    gen = decode.GenerationConfig(n_steps=4, design=design, capacity=batch.capacity,
                                  evaluate=design.randomized)
    if regime == "query_aware":
      want = decode.generate(self.params, *map(rep, batch.prompt), key, config=self.config,
                             gen=gen, budget=budget)
    else:
      want = decode.generate_streaming(
          self.params, tuple(map(rep, batch.prompt)), tuple(map(rep, batch.question)), key,
          config=self.config,
          gen=gen.replace(chunk=batch.prompt[0].shape[1]), budget=budget)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.var_hat, want.var_hat, rtol=1e-4, atol=1e-7)
    if design.randomized:
      np.testing.assert_allclose(got.true_error, want.true_error, rtol=1e-4, atol=1e-6)

  def test_snapkv_streaming(self):
    self._compare("snapkv", "streaming")

  def test_poisson_tail_query_aware(self):
    self._compare("poisson_tail", "query_aware")

  def test_a_design_without_window_reuses_the_window_prefill(self):
    # tova (no window) after snapkv in one batch: snapkv's prefill serves it, holds its
    # own prefill's keys, values and statistics bit for bit (obs aside, which tova does
    # not read), and tova's answers are those of its own generation call.
    batch = experiment._Batch(self.examples, "streaming", 1024, 4)  # pylint: disable=protected-access
    experiment.run_design(self.params, self.config, batch, "snapkv", (0.5,),
                          jax.random.PRNGKey(0), self.plan)
    self.assertEqual(len(batch.prefills), 1)
    self._compare("tova", "streaming", batch=batch)
    self.assertEqual(len(batch.prefills), 1)
    tova = design_defaults.make_design("tova", 0.5, self.plan.n_sink, self.plan.window)
    own = experiment.prefill(self.params, *batch.prompt, config=self.config, design=tova,
                             capacity=batch.capacity)
    shared = next(iter(batch.prefills.values()))
    np.testing.assert_array_equal(shared[0], own[0])
    for f in ("k", "v", "acc", "last", "v_sq", "v_ref", "pos", "valid", "n_seen"):
      np.testing.assert_array_equal(getattr(shared[1], f), getattr(own[1], f), err_msg=f)


class PlanTest(absltest.TestCase):

  def test_prefill_groups(self):
    keys = {experiment.stats_key(design_defaults.make_design(d, 0.5))
            for d in design_defaults.names()}
    self.assertEqual(keys, {None, ("sum", 16), ("peak", 16)})

  def test_units_put_the_window_designs_first(self):
    plan = experiment.Plan(tasks=("vt",), n_examples=1, designs=("h2o", "snapkv", "tova"),
                           regimes=("streaming",)).check()
    self.assertEqual([u[-1] for u in plan.units()], ["snapkv", "h2o", "tova", "full"])

  def test_units(self):
    plan = experiment.Plan(tasks=("vt",), n_examples=3, group=2, designs=("h2o", "full"),
                           regimes=("streaming",))
    self.assertEqual(plan.units(), [(4096, "vt", "streaming", 0, "h2o"),
                                    (4096, "vt", "streaming", 0, "full"),
                                    (4096, "vt", "streaming", 2, "h2o"),
                                    (4096, "vt", "streaming", 2, "full")])
    sub = experiment.Plan(tasks=("vt", "cwe"), context_lens=(4096, 8192),
                          tasks_at=((8192, ("vt",)),)).check()
    self.assertEqual(sub.tasks_for(8192), ("vt",))
    self.assertEqual(sub.tasks_for(4096), ("vt", "cwe"))

  def test_token_budgets(self):
    plan = experiment.Plan(ratios=(0.5, 0.875))
    design, alloc = experiment.design_of("priority_floor+cert", plan)
    self.assertEqual(experiment.token_budgets(plan, design, alloc, plan.ratios, 64), [0.5, 0.125])
    plan = dataclasses.replace(plan, equal_memory=True)
    got = experiment.token_budgets(plan, design, alloc, plan.ratios, 64)
    self.assertEqual(got, [memory.token_fraction(m, design, 64, allocation=alloc)
                           for m in (0.5, 0.125)])
    h2o = experiment.token_budgets(plan, *experiment.design_of("h2o", plan), plan.ratios, 64)
    self.assertLess(got[0], h2o[0])  # more metadata per slot: fewer tokens
    self.assertLess(h2o[0], 0.5)
    self.assertEqual(experiment.token_budgets(plan, None, None, (0.0,), 64), [1.0])
    # bfloat16 keys and values: the same metadata is a larger share of a slot, so fewer
    # tokens (before, float32's count: 1.7% over the byte share for h2o at 0.5).
    bf16 = experiment.token_budgets(plan, *experiment.design_of("h2o", plan), plan.ratios, 64,
                                    jnp.bfloat16)
    self.assertEqual(bf16, [memory.token_fraction(m, experiment.design_of("h2o", plan)[0], 64,
                                                  dtype=jnp.bfloat16) for m in (0.5, 0.125)])
    self.assertLess(bf16[0], h2o[0])

  def test_shipped_calibration_reads_the_rows_budget_and_both_prompt_ends(self):
    # The shipped artifact (poisson_tail, prompts of 1,040-1,156 tokens) applied at the
    # budget the rows ran at (with --equal_memory below 1 - ratio), and out of range when
    # the shortest prompt is, though the longest is not.
    shipped = report._shipped  # pylint: disable=protected-access
    plan = experiment.Plan(n_sink=4, window=16, chunk=64)
    cell = report.Cell(1024, "streaming", "poisson_tail", 0.875)
    rng = np.random.default_rng(0)
    calls = {"vt": (rng.uniform(0, 0.1, (4, 2, 3)), rng.uniform(0.05, 0.2, (4, 2, 3)))}
    budgets = []
    real = certificate_lib.calibrated

    def recording(raw, run, **kw):
      budgets.append(run.budget)
      return real(raw, run, **kw)
    self.enter_context(absltest.mock.patch.object(certificate_lib, "calibrated", recording))
    rows = [dict(n_prompt_tokens=1100, budget=0.121), dict(n_prompt_tokens=1150, budget=0.121)]
    out = shipped(calls, plan, cell, rows, "smollm2")
    self.assertEqual(set(budgets), {0.121})
    self.assertNotIn("shipped", out)  # 0.121 lies below the fitted budgets: not applied
    rows = [dict(n_prompt_tokens=600, budget=0.125), dict(n_prompt_tokens=1100, budget=0.125)]
    out = shipped(calls, plan, cell, rows, "smollm2")
    self.assertFalse(out["shipped_in_range"])
    self.assertIn("WARNING", out["shipped_note"])
    out = shipped(calls, plan, cell, rows[1:], "smollm2")
    self.assertTrue(out["shipped_in_range"])
    mixed = [dict(n_prompt_tokens=1100, budget=0.125), dict(n_prompt_tokens=1100, budget=0.25)]
    with self.assertRaisesRegex(ValueError, "expected one"):
      shipped(calls, plan, cell, mixed, "smollm2")

  def test_paired_scores(self):
    plan = experiment.Plan(tasks=("vt", "cwe"), n_examples=3, ratios=(0.5,),
                           designs=("h2o", "snapkv", "priority_floor+cert"))
    hits = {"h2o": [1, 1, 0, 1, 0, 0], "snapkv": [1, 0, 0, 0, 0, 0],
            "priority_floor+cert": [1, 1, 1, 1, 0, 1], "full": [1] * 6}
    rows = _hit_rows(hits)
    rows.append(dict(design="h2o", ratio=0.5, task="niah_single_1", example=0, score=1.0))
    got = report.paired_scores(rows, plan, list(hits), plan.tasks, seed=0)  # drops that row
    self.assertEqual(got["best_deterministic"], {"0.5": "h2o"})
    p = got["paired_vs_best_deterministic"]["priority_floor+cert"]["0.5"]
    self.assertAlmostEqual(p["value"], 100 * 2 / 6)
    self.assertLessEqual(p["ci"][0], p["value"])
    self.assertLessEqual(p["value"], p["ci"][1])
    self.assertEqual(got["paired_vs_best_deterministic"]["h2o"]["0.5"],
                     {"value": 0.0, "ci": [0.0, 0.0]})
    self.assertAlmostEqual(got["score"]["snapkv"]["0.5"]["value"], 100 / 6)
    self.assertEqual(got["score"]["snapkv"]["0.5"]["n"], 6)
    self.assertEqual(got["paired_twin"], {})  # no twin ran

  def test_rows_past_n_examples_ties_and_one_example_tasks(self):
    plan = experiment.Plan(tasks=("vt", "cwe"), n_examples=3, ratios=(0.5,),
                           designs=("h2o", "snapkv"))
    hits = {"h2o": [1, 0, 0, 1, 0, 0], "snapkv": [0, 1, 1, 0, 0, 0], "full": [1] * 6}
    rows = _hit_rows(hits)
    # rows a larger earlier run left in the folder (example 3) are not this plan's
    rows += [dict(design=d, ratio=0.5, task=t, example=3, score=1.0 if d == "h2o" else 0.0)
             for d in ("h2o", "snapkv") for t in ("vt", "cwe")]
    got = report.paired_scores(rows, plan, list(hits), plan.tasks, seed=0)
    self.assertEqual(got["score"]["h2o"]["0.5"]["n"], 6)
    self.assertAlmostEqual(got["score"]["h2o"]["0.5"]["value"], 100 * 2 / 6)
    # h2o and snapkv tie (2 of 6 each): the first is taken and the tie is recorded
    self.assertEqual(got["best_deterministic"], {"0.5": "h2o"})
    self.assertEqual(got["best_tied"], {"0.5": ["snapkv"]})
    # one example per task: resamples within a task never vary, so no interval
    one = dataclasses.replace(plan, n_examples=1)
    got = report.paired_scores(rows, one, list(hits), one.tasks, seed=0)
    self.assertEqual(got["score"]["h2o"]["0.5"]["n"], 2)
    self.assertTrue(np.isnan(got["score"]["h2o"]["0.5"]["ci"]).all())
    self.assertIn("no CI", report._fmt_ci(got["score"]["h2o"]["0.5"]))  # pylint: disable=protected-access

  def test_summary_tables_leave_out_rows_past_n_examples(self):
    plan = experiment.Plan(tasks=("vt", "cwe"), n_examples=2, ratios=(0.5,), designs=("h2o",),
                           context_lens=(1024,), regimes=("streaming",), coverage=False)
    rows = [dict(design=d, ratio=r, task=t, example=e, seed=plan.seed, context_len=1024,
                 regime="streaming", score=1.0 if e < 2 else 0.0, unit_seconds=1.0,
                 unit_rows=1, prefill_seconds=0.0)
            for d, r in (("full", 0.0), ("h2o", 0.5)) for t in ("vt", "cwe")
            for e in range(4)]  # examples 2 and 3: an earlier --n_examples=4 run's
    s = report.summarize(rows, test_util.temp_dir(self, "leaderboard_rows_"), plan)
    self.assertEqual(s["score"]["h2o"]["0.5"]["value"], 100.0)
    self.assertEqual(s["score_by_task"]["h2o"]["0.5"], {"vt": 100.0, "cwe": 100.0})

  def test_the_report_names_the_design_taken_from_a_tie_first(self):
    plan = experiment.Plan(tasks=("vt",), n_examples=2, ratios=(0.5,),
                           designs=("h2o", "snapkv", "tova"), context_lens=(1024,),
                           regimes=("streaming",), coverage=False)
    scores = {"full": (1, 1), "h2o": (0, 1), "snapkv": (1, 1), "tova": (1, 1)}
    rows = [dict(design=d, ratio=0.0 if d == "full" else 0.5, task="vt", example=e,
                 seed=plan.seed, context_len=1024, regime="streaming", score=float(v[e]),
                 unit_seconds=1.0, unit_rows=1, prefill_seconds=0.0)
            for d, v in scores.items() for e in range(2)]
    s = report.summarize(rows, test_util.temp_dir(self, "leaderboard_tie_"), plan)
    self.assertEqual((s["best_deterministic"], s["best_tied"]),
                     ({"0.5": "snapkv"}, {"0.5": ["tova"]}))
    self.assertIn("tied for best, the bold one taken: 0.5: snapkv, tova:", s["md"])

  def test_a_twin_is_paired_with_its_own_design(self):
    plan = experiment.Plan(tasks=("vt", "cwe"), n_examples=3, ratios=(0.5,),
                           designs=("h2o", "snapkv", "snapkv_cert"))
    hits = {"h2o": [1, 1, 1, 1, 1, 1], "snapkv": [1, 0, 0, 1, 0, 0],
            "snapkv_cert": [1, 1, 0, 0, 0, 0], "full": [1] * 6}
    rows = _hit_rows(hits)
    got = report.paired_scores(rows, plan, list(hits), plan.tasks, seed=0)
    self.assertEqual(list(got["paired_twin"]), ["snapkv"])  # keyed by the design, not h2o
    p = got["paired_twin"]["snapkv"]["0.5"]
    self.assertAlmostEqual(p["value"], 0.0)  # one example gained, one lost
    self.assertEqual((p["n"], p["twin"]), (6, "snapkv_cert"))
    self.assertLess(p["ci"][0], 0.0)
    self.assertGreater(p["ci"][1], 0.0)

  def test_twins_keep_their_keys_at_every_ratio(self):
    # Two ratios and two twins of one design: the first twin stays keyed by the design
    # at both ratios, the second by its own name (not by the design at one ratio only).
    twin2 = "snapkv_cert:top_share=0.25"
    plan = experiment.Plan(tasks=("vt", "cwe"), n_examples=3, ratios=(0.5, 0.75),
                           designs=("snapkv", "snapkv_cert", twin2))
    hits = {"snapkv": [1, 0, 0, 1, 0, 0], "snapkv_cert": [1, 1, 0, 1, 0, 0],
            twin2: [0, 0, 0, 1, 0, 0], "full": [1] * 6}
    rows = [dict(r, ratio=ratio) for ratio in plan.ratios for r in _hit_rows(hits)
            if r["design"] != "full"] + [r for r in _hit_rows(hits) if r["design"] == "full"]
    got = report.paired_scores(rows, plan, list(hits), plan.tasks, seed=0)["paired_twin"]
    self.assertEqual(sorted(got), sorted(["snapkv", twin2]))
    for key, twin, value in (("snapkv", "snapkv_cert", 100 / 6), (twin2, twin2, -100 / 6)):
      self.assertEqual(sorted(got[key]), ["0.5", "0.75"])
      for per in got[key].values():
        self.assertEqual(per["twin"], twin)
        self.assertAlmostEqual(per["value"], value)

  def test_score_panels_pair_each_twin_with_its_design(self):
    plan = experiment.Plan(tasks=("vt", "cwe"), n_examples=3, ratios=(0.5, 0.75),
                           designs=("snapkv", "snapkv_cert", "h2o"))
    hits = {"snapkv": [1, 0, 0, 1, 0, 0], "snapkv_cert": [1, 1, 0, 1, 0, 0],
            "h2o": [0, 0, 0, 1, 0, 0], "full": [1] * 6}
    rows = [dict(r, ratio=ratio) for ratio in plan.ratios for r in _hit_rows(hits)
            if r["design"] != "full"] + [r for r in _hit_rows(hits) if r["design"] == "full"]
    cell = report.paired_scores(rows, plan, list(hits), plan.tasks, seed=0)
    panels = report._score_panels({"4096/streaming": cell}, plan)  # pylint: disable=protected-access
    self.assertEqual(list(panels), ["4096 tokens, streaming: snapkv"])  # h2o has no twin
    lines = panels["4096 tokens, streaming: snapkv"]
    self.assertEqual(list(lines), ["full", "design", "certified twin"])
    xs, ys, (lo, hi) = lines["certified twin"]
    self.assertEqual((xs, ys), ([0.5, 0.75], [50.0, 50.0]))
    self.assertTrue(all(l <= y <= h for l, y, h in zip(lo, ys, hi)))
    self.assertEqual(lines["design"][1], [100 / 3, 100 / 3])
    self.assertEqual(lines["full"], ([0.5, 0.75], [100.0, 100.0]))
    no_full = dict(cell, score={d: v for d, v in cell["score"].items() if d != "full"})
    panels = report._score_panels({"4096/streaming": no_full}, plan)  # pylint: disable=protected-access
    self.assertEqual(list(panels["4096 tokens, streaming: snapkv"]), ["design", "certified twin"])
    del cell["paired_twin"]["snapkv"]  # no twin: one panel with every design
    panels = report._score_panels({"4096/streaming": cell}, plan)  # pylint: disable=protected-access
    self.assertEqual(list(panels), ["4096 tokens, streaming"])
    self.assertEqual(sorted(panels["4096 tokens, streaming"]), sorted(hits))

  def test_twin_base_drops_the_twin_settings_only(self):
    self.assertEqual(variants.twin_base("snapkv_cert:top_share=0.5:spill=1"), "snapkv")
    self.assertEqual(variants.twin_base("keydiff_cert:eps=0.2:window=8"), "keydiff:window=8")
    self.assertEqual(variants.twin_base("h2o_cert:window=8:spill=0+adakv"), "h2o:window=8+adakv")
    self.assertIsNone(variants.twin_base("priority_floor+cert"))

  def test_checks(self):
    for kw, msg in ((dict(tasks=("qa_1",)), "SQuAD"), (dict(designs=("nope",)), "--designs"),
                    (dict(designs=("h2o+nope",)), "--designs: unknown allocation"),
                    (dict(ratios=(1.0,)), r"--ratios entries must be fractions in \(0, 1\)"),
                    (dict(regimes=("aware",)), "--regimes"),
                    (dict(group=0), "--group must be an int >= 1"),
                    (dict(context_lens=(32,)), "--context_lens"),
                    (dict(tasks_at=((8192, ("vt",)),)), "--tasks_at"),
                    # an empty list runs no unit: refused before the model loads
                    (dict(regimes=()), "--regimes: none given"),
                    (dict(designs=()), "--designs: none given"),
                    (dict(ratios=()), "--ratios: none given"),
                    (dict(context_lens=()), "--context_lens: none given"),
                    (dict(max_units=0), "--max_units must be an int >= 1"),
                    (dict(max_units=-5), "--max_units must be an int >= 1")):
      with self.assertRaisesRegex(ValueError, msg):
        experiment.Plan(**kw).check()


def _hit_rows(hits):
  """Rows of designs' 0/1 scores on 3 examples of vt and cwe (the full cache at ratio 0)."""
  return [dict(design=d, ratio=0.0 if d == "full" else 0.5, task=t, example=e,
               score=float(v[2 * e + i]))
          for d, v in hits.items() for e in range(3) for i, t in enumerate(("vt", "cwe"))]


if __name__ == "__main__":
  absltest.main()
