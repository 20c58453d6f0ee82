"""The prefill benchmark (experiments/bench_prefill.py, experiments/lib/bench/prefill.py) on
the tiny model.

The bookkeeping, not the numbers: one-shot and chunked rows and the summary's
tables, a rerun that skips finished rows and retries failed ones, bad flags
failing with the flag's name, and (slow) one configuration in a child process.
"""

import json
import os

from absl.testing import absltest
import pytest

from experiments.lib.bench import prefill as bench_prefill
from tests import test_util

TINY = dict(contexts=(24,), chunks=(16,), oneshot_max=24, repeats=2)
SUMMARY_KEYS = {"model", "device", "batch", "complete", "modes", "contexts", "peak_rss_mib",
                "working_mib", "load_rss_mib", "process_peak_rss_mib", "tokens_per_s",
                "median_s", "compile_s", "failed"}


def _read(out, name):
  with open(os.path.join(out, name)) as f:
    return json.load(f)


def _fail(spec):
  raise RuntimeError(f"not expected: {spec}")


class PlanTest(absltest.TestCase):

  def test_configurations(self):
    plan = bench_prefill.Plan(contexts=(32, 64), chunks=(16, 64), oneshot_max=32).check()
    self.assertEqual(plan.configurations(), [(32, "oneshot", None), (32, "chunked_16", 16),
                                             (64, "chunked_16", 16)])

  def test_bad_flags_name_the_flag(self):
    for kw, flag in ((dict(contexts=()), "--contexts"), (dict(chunks=(0,)), "--chunks"),
                     (dict(contexts=(9000,)), "--contexts"), (dict(repeats=0), "--repeats"),
                     (dict(oneshot_max=-1), "--oneshot_max"), (dict(batch=0), "--batch"),
                     (dict(max_seconds=-1.0), "--max_seconds")):
      with self.assertRaisesRegex(ValueError, flag):
        bench_prefill.Plan(**kw).check(max_positions=8192)


class RunTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = test_util.tiny_hf_dir(test_util.temp_dir(cls, "bench_prefill_model_"))

  def test_in_process_rows_summary_and_resume(self):
    out = test_util.temp_dir(self, "bench_prefill_out_")
    plan = bench_prefill.Plan(**TINY).check()
    summary = bench_prefill.run(plan, out, model=self.model, runner=bench_prefill.measure,
                                log=lambda s: None)
    self.assertEqual(set(summary), SUMMARY_KEYS)
    self.assertEqual(summary, _read(out, "summary.json"))
    self.assertTrue(summary["complete"])
    self.assertEqual(summary["modes"], ["oneshot", "chunked_16"])
    for table in ("peak_rss_mib", "tokens_per_s", "working_mib", "median_s"):
      self.assertEqual(set(summary[table]), {"oneshot", "chunked_16"})
      for per_context in summary[table].values():
        self.assertEqual(set(per_context), {"24"})
        if table != "working_mib":  # a tiny model's can be < 0: see below
          self.assertGreater(per_context["24"], 0)
    rows = _read(out, "results.json")["rows"]
    for r in rows:
      # In this process the resident set can shrink between the load's reading and the
      # peak's reset by more than a 24-token prefill of a tiny model needs (-0.14 MiB seen)
      self.assertEqual(r["working_mib"], r["peak_rss_mib"] - r["load_rss_mib"])
      self.assertEqual(summary["working_mib"][r["mode"]]["24"], r["working_mib"])
    self.assertEqual([(r["mode"], r["chunk"]) for r in rows], [("oneshot", None),
                                                              ("chunked_16", 16)])
    for r in rows:
      self.assertLen(r["samples_s"], 2)
      self.assertGreaterEqual(r["process_peak_rss_mib"], r["load_rss_mib"])
    with open(os.path.join(out, "report.md")) as f:
      self.assertIn("| 24 | chunked_16 |", f.read())
    # A rerun measures nothing: every row is there.
    again = bench_prefill.run(plan, out, model=self.model, runner=_fail, log=lambda s: None)
    self.assertEqual(again, summary)

  def test_failed_row_recorded_and_retried(self):
    out = test_util.temp_dir(self, "bench_prefill_out_")
    plan = bench_prefill.Plan(**TINY).check()
    fake = lambda spec: dict({k: spec[k] for k in bench_prefill.KEY_FIELDS}, chunk=spec["chunk"],
                             peak_rss_mib=2.0, working_mib=1.0, load_rss_mib=1.0,
                             process_peak_rss_mib=3.0, tokens_per_s=5.0, median_s=1.0,
                             compile_s=1.0, samples_s=[1.0], device="fake")

    def oneshot_fails(spec):
      if spec["mode"] == "oneshot":
        raise RuntimeError("child exited with -9")
      return fake(spec)

    summary = bench_prefill.run(plan, out, model=self.model, runner=oneshot_fails,
                                log=lambda s: None)
    self.assertFalse(summary["complete"])
    self.assertEqual(summary["failed"], [dict(context=24, mode="oneshot")])
    self.assertEqual(summary["modes"], ["chunked_16"])
    summary = bench_prefill.run(plan, out, model=self.model, runner=fake, log=lambda s: None)
    self.assertTrue(summary["complete"])
    self.assertEqual(summary["modes"], ["oneshot", "chunked_16"])

  @pytest.mark.slow  # a child process that imports jax and compiles: 27 s on the shared 2 cores
  def test_child_process(self):
    plan = bench_prefill.Plan(**TINY).check()
    row = bench_prefill.in_child(bench_prefill.child_spec(plan, self.model, 24, "chunked_16", 16),
                                 timeout=300)
    self.assertEqual((row["context"], row["mode"], row["chunk"]), (24, "chunked_16", 16))
    self.assertGreaterEqual(row["peak_rss_mib"], row["load_rss_mib"])
    self.assertTrue(row["peak_reset"])


if __name__ == "__main__":
  absltest.main()
