"""The Monte Carlo experiment script end to end, and its resumable output."""

import json
import os

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
import pytest

from experiments import montecarlo_certificate
from experiments.lib import results_io

FLAGS = flags.FLAGS


class ResultsIoTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if not FLAGS.is_parsed():
      FLAGS.mark_as_parsed()

  def test_rows_persist_and_duplicates_are_refused(self):
    path = os.path.join(self.create_tempdir().full_path, "rows.jsonl")
    res = results_io.JsonlResults(path, ("a", "b"))
    res.add({"a": 1, "b": 0.5, "x": "y"})
    res.add({"a": 2, "b": 0.5})
    with self.assertRaisesRegex(ValueError, "already"):
      res.add({"a": 1, "b": 0.5})
    again = results_io.JsonlResults(path, ("a", "b"))
    self.assertTrue(again.has(a=1, b=0.5))
    self.assertFalse(again.has(a=1, b=0.25))
    self.assertLen(again.rows, 2)
    self.assertEqual([f for f in os.listdir(os.path.dirname(path))], ["rows.jsonl"])


class MonteCarloScriptTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if not FLAGS.is_parsed():
      FLAGS.mark_as_parsed()

  def _run(self, out, designs):
    with flagsaver.flagsaver(out=out, context_len=96, head_dim=8, budgets=["0.25"],
                             deltas=["0.05"], designs=designs, problems=["gaussian"],
                             regimes=["question_aware"], num_trials=64, window=4):
      montecarlo_certificate.main([])

  @pytest.mark.slow  # 32 s cold on the 2-core CI machine (2026-12-01)
  def test_end_to_end_and_resume(self):
    out = self.create_tempdir().full_path
    self._run(out, ["h2o", "poisson_tail"])
    rows = results_io.read_rows(os.path.join(out, "rows.jsonl"))
    self.assertEqual(sorted(r["design"] for r in rows), ["h2o", "poisson_tail"])
    for r in rows:
      for field in ("mse", "var_ratio", "coverage", "sharpness", "median_R", "mean_kept"):
        self.assertIn(field, r)
    det = next(r for r in rows if r["design"] == "h2o")
    self.assertEqual(det["n_trials"], 1)
    self.assertEqual(det["mean_var_hat"], 0.0)  # Theorem 1: nothing to see
    rnd = next(r for r in rows if r["design"] == "poisson_tail")
    self.assertEqual(rnd["n_trials"], 64)
    self.assertGreater(rnd["mean_var_hat"], 0.0)
    # Resume: a rerun with one more design adds exactly that row.
    self._run(out, ["h2o", "poisson_tail", "tova"])
    rows2 = results_io.read_rows(os.path.join(out, "rows.jsonl"))
    self.assertLen(rows2, 3)
    self.assertEqual(rows2[:2], rows)
    with open(os.path.join(out, "summary.md"), encoding="utf-8") as f:
      self.assertIn("| gaussian | question_aware | tova | 0.25 |", f.read())
    json.dumps(rows2)

  def test_bad_flags(self):
    out = self.create_tempdir().full_path
    with self.assertRaisesRegex(ValueError, "--designs: unknown design"):
      self._run(out, ["h3o"])
    with flagsaver.flagsaver(out=out, budgets=["1.5"]):
      with self.assertRaisesRegex(ValueError, "--budgets"):
        montecarlo_certificate.main([])


if __name__ == "__main__":
  absltest.main()
