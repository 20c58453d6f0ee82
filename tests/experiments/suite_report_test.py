"""The main job's report and terminal say its regime first, with the committed longer
runs beside the claims they bear on; its progress is one line for the whole job."""

import json
import os

from absl.testing import absltest
import numpy as np

from experiments.lib.analyses import common
from experiments.lib.suite import progress
from experiments.lib.suite import regime
from experiments.lib.suite import report as suite_report
from experiments.lib.suite import runner as suite_runner
from experiments.lib.suite import settings as suite_settings

QUICK = suite_settings.Settings(model="smollm2", **suite_runner.QUICK["settings"]).check()
RESULTS = os.path.join(regime.REPO_ROOT, regime.RESULTS)


class FakeClock:

  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


class JobProgressTest(absltest.TestCase):

  def test_one_line_for_the_job_with_an_eta_over_every_stage(self):
    clock, lines = FakeClock(), []
    job = progress.JobProgress((("rows", 1.0), ("text", 3.0)), lines.append, clock=clock)
    log = job.stage("rows")
    log("2 of 2 units to run")
    clock.t = 10.0
    log("[1/2] elapsed 10s, ETA 10s full/run0: 4 rows in 10s")
    # a quarter of the job's weight is stage 1; half of it took 10 s: 70 s to go
    self.assertEqual(lines, ["[stage 1/2 rows] 2 of 2 units to run",
                             "[stage 1/2 rows: 1/2] full/run0: 4 rows in 10s | job 10 s, "
                             "ETA ~1 min 10 s"])
    clock.t = 20.0
    log = job.stage("text")
    self.assertAlmostEqual(job.fraction(), 0.25)
    self.assertAlmostEqual(job.eta(), 60.0)
    clock.t = 50.0
    log("[3/4] elapsed 30s, ETA 10s full: 1 rows")  # a resumed stage: 2 units were on file
    # this run did 1/4 of "text" (0.1875 of the job) and all of "rows" (0.25) in 50 s
    self.assertAlmostEqual(job.fraction(), 0.25 + 0.75 * 0.75)
    self.assertAlmostEqual(job.eta(), 50.0 / (0.25 + 0.1875) * (1 - job.fraction()))
    self.assertStartsWith(lines[-1], "[stage 2/2 text: 3/4] full: 1 rows | job 50 s, ETA ~")

  def test_no_pace_yet_and_bad_stages(self):
    job = progress.JobProgress((("a", 1.0),), lambda s: None, clock=FakeClock())
    self.assertTrue(np.isnan(job.eta()))
    self.assertEqual(progress.duration(float("nan")), "?")
    self.assertEqual(progress.duration(59.4), "59 s")
    self.assertEqual(progress.duration(3600), "60 min 0 s")
    with self.assertRaisesRegex(ValueError, "stages"):
      progress.JobProgress((("a", 0.0),), print)

  def test_stages_follow_the_plan(self):
    names = lambda plan: [n for n, _ in suite_runner.stages(plan)]
    self.assertEqual(names(suite_runner.QUICK), ["suite rows", "Theorem 1", "overhead",
                                                 "streaming loss", "validity", "damage"])
    self.assertEqual(names(dict(suite_runner.QUICK, validity=None, damage=None,
                                theorem1=None)),
                     ["suite rows", "overhead", "streaming loss"])
    self.assertEqual(names(dict(suite_runner.QUICK, damage={})), names(suite_runner.QUICK))


class RegimeTest(absltest.TestCase):

  def test_describe_says_what_ran_and_what_it_cannot_say(self):
    text = "\n".join(regime.describe(QUICK, (("passkey", 1.0, 24),
                                             ("variable_tracking", 0.0, 24))))
    self.assertStartsWith(text, "**What ran.** Model smollm2; 3 tasks")
    for phrase in ("160-token contexts, 4 examples per task",
                   "of the tokens seen (of a prompt of 160 tokens plus the question: at least "
                   "20-80 tokens kept)",
                   "snapkv, poisson_tail, attention_proportional",
                   "Full-cache accuracy: passkey 1.00, variable_tracking 0.00",
                   "far shorter than the long contexts", "not whether the paper's number holds",
                   "already fails variable_tracking", "`docs/results.md`"):
      self.assertIn(phrase, text)
    # From the rows: a budget is a share of the whole prompt, question included.
    rows = [dict(n_prompt_tokens=n) for n in (190, 178, 242)] + [dict(design="x")]
    self.assertEqual(regime.prompt_range(rows), (178, 242))
    self.assertIsNone(regime.prompt_range([dict(design="x")]))
    ran = regime.describe(QUICK, prompt_tokens=regime.prompt_range(rows))[0]
    self.assertIn("160-token contexts (prompts of 178-242 tokens with the question), 4 "
                  "examples per task", ran)
    self.assertIn("of the tokens seen (at the prompt's end 22-121 of its 178-242 tokens "
                  "kept)", ran)
    before = "\n".join(regime.describe(QUICK, before=True))  # printed as the job starts
    self.assertStartsWith(before, "**What runs.**")
    self.assertIn("a verdict of the report says how a claim fares", before)

  def test_links_are_relative_to_the_report(self):
    link = regime.links(os.path.join(RESULTS, "suite_quick"))
    self.assertEqual(link("experiments/results/validity_long/summary.json"),
                     "[`validity_long/summary.json`](../validity_long/summary.json)")
    self.assertEqual(regime.links(None)("docs/results.md"), "`docs/results.md`")

  def test_evidence_is_read_from_the_committed_summaries(self):
    found = regime.evidence()
    with open(os.path.join(RESULTS, "validity_long", "summary.json")) as f:
      long = json.load(f)
    at_8k = np.mean([c["coverage"]["0.05"] for c in long["cells"]
                     if c["design"] == "poisson_tail" and c["radius"] == "raw"
                     and c["context_len"] == 8000])
    self.assertIn(f"{at_8k:.3f}", found["coverage"])
    self.assertIn("8,000 tokens", found["coverage"])
    self.assertIn(regime.PUT_FORWARD, found["coverage"])
    for b in (0.125, 0.25, 0.5):
      self.assertIn(f"at {b * 100:g}% memory", found[("coverage", b)])
    self.assertIn("equal_memory_tasks/summary.json", found["question_aware"])
    self.assertIn("leaderboard_8k/summary.json", found["streaming"])
    self.assertIn("2,072-token prompts", found["overhead"])
    self.assertEqual(regime.beside("coverage of realised error (poisson_tail, budget 0.25, "
                                   "delta 0.05, both regimes)", found),
                     found[("coverage", 0.25)])
    self.assertEqual(regime.beside("attribution AUC, certificate", found), "-")


class ReportTest(absltest.TestCase):

  def _sections(self):
    claim = common.claim("coverage of realised error (poisson_tail, all budgets, delta 0.05)",
                         "0.969-0.977", (0.65, 0.62, 0.68), "refuted")
    return [dict(md="## A section\n\nbody", claims=[claim])]

  def test_report_and_terminal_open_with_the_regime(self):
    header = suite_report.Header(command="c", wall_s=3.0, machine="m",
                                 out_dir=os.path.join(RESULTS, "suite_quick"),
                                 full_accuracy=(("passkey", 1.0, 4),))
    report = suite_report.render_report(sections=self._sections(), theorem1=None,
                                        overhead=None, settings=QUICK, header=header)
    lines = report.splitlines()
    self.assertStartsWith(lines[2], "**What ran.**")
    self.assertStartsWith(lines[4], "**What its verdicts can and cannot say.**")
    self.assertLess(report.index("**What ran.**"), report.index("Command: `c`"))
    row = next(line for line in lines if line.startswith("| coverage of realised error"))
    self.assertIn("](../validity_long/summary.json)", row)
    self.assertIn("## A section", report)
    terminal = suite_report.render_terminal(sections=self._sections(), overhead=None,
                                            settings=QUICK, header=header, path="OUT/report.md")
    self.assertStartsWith(terminal, "**What ran.**")
    self.assertIn("`experiments/results/validity_long/summary.json`", terminal)
    self.assertIn("| coverage of realised error", terminal)
    self.assertIn("The whole report (the verdict rule, every experiment's tables and plots): "
                  "OUT/report.md", terminal)
    self.assertNotIn("## A section", terminal)
    self.assertNotIn("Verdict rule", terminal)

  def test_committed_quick_report_opens_with_its_regime(self):
    with open(os.path.join(RESULTS, "suite_quick", "report.md"), encoding="utf-8") as f:
      lines = f.read().splitlines()
    self.assertStartsWith(lines[2], "**What ran.** Model smollm2; 3 tasks")
    self.assertIn("160-token contexts (prompts of 178-242 tokens with the question), 4 "
                  "examples per task", lines[2])
    self.assertIn("| the committed longer-context runs |",
                  next(line for line in lines if line.startswith("| claim |")))

  def test_full_cache_accuracy(self):
    rows = [dict(design="full", task="a", correct=True), dict(design="full", task="a",
                                                              correct=False),
            dict(design="snapkv", task="a", correct=True), dict(design="full", task="b",
                                                                correct=False)]
    self.assertEqual(suite_report.full_cache_accuracy(rows), (("a", 0.5, 2), ("b", 0.0, 1)))


if __name__ == "__main__":
  absltest.main()
