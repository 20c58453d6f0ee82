"""docs/results.md is generated from the committed summaries (experiments/lib/results_doc/).

The committed document must equal the rendering of the committed summaries, so its numbers
cannot drift from them; a number edited in a summary must show up in the rendering (so that
the first check can fail); and ``--check`` must fail on a stale document with one line.
"""

import json
import os
import shutil
import subprocess
import sys

from absl.testing import absltest

from experiments.lib import results_doc
from tests import test_util

RESULTS = os.path.join(test_util.ROOT, "experiments", "results")
DOC = os.path.join(test_util.ROOT, "docs", "results.md")
# What render() does not read (the validity units alone are ~60 MB).
_NOT_READ = shutil.ignore_patterns("units", "calibration", "predictor", "*.png")


def _edit_json(path, edit):
  with open(path, encoding="utf-8") as f:
    blob = json.load(f)
  edit(blob)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(blob, f)


class ResultsDocTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.rendered = results_doc.render(RESULTS)

  def setUp(self):
    super().setUp()
    self.tmp = test_util.temp_dir(self)
    self.copy = os.path.join(self.tmp, "results")
    shutil.copytree(RESULTS, self.copy, ignore=_NOT_READ)

  def test_committed_doc_is_the_rendering(self):
    with open(DOC, encoding="utf-8") as f:
      committed = f.read()
    self.assertMultiLineEqual(
        committed, self.rendered,
        "docs/results.md differs from the committed summaries: run "
        "`python -m experiments.results_doc` and commit the result")

  def test_an_edited_summary_number_appears(self):
    self.assertEqual(results_doc.render(self.copy), self.rendered)  # location-independent
    old_sharp, new_sharp = "at median sharpness 3.87 (", "at median sharpness 1.23 ("
    old_ms, new_ms = "| 4,096 | 75.7 |", "| 4,096 | 987.7 |"
    self.assertTrue(old_sharp in self.rendered and old_ms in self.rendered)

    def sharpness(d):
      d["sharpness_floor"]["sharpness_median"] = 1.2345

    def full_ms(d):
      d["full_ms"]["4096"] = 987.654
    _edit_json(os.path.join(self.copy, "validity", "summary.json"), sharpness)
    _edit_json(os.path.join(self.copy, "bench_decode", "summary.json"), full_ms)
    edited = results_doc.render(self.copy)
    self.assertNotEqual(edited, self.rendered)
    for old, new in ((old_sharp, new_sharp), (old_ms, new_ms)):
      self.assertTrue(new in edited and old not in edited, f"{old!r} -> {new!r}")

  def test_in_sample_coverage_at_another_length_is_marked_a_shift(self):
    # The shipped artifact was fitted at 1,024 tokens: a failing cell at 2,048 is not
    # in-sample, and the reading counts only the cells at 1,024.
    self.assertIn("| 2,048 | 0.933 | 0.948 (shift) |", self.rendered)
    self.assertIn("6 of the 6 of these cells at the calibration's own context (1,024 "
                  "tokens) reach 0.95", self.rendered)

  def test_a_twin_that_loses_is_bold(self):
    row = "| keydiff | keydiff_cert | -3.6 [-11.2, +3.9] |"
    self.assertIn(row, self.rendered)

    def loses(d):
      d["cells"]["4096/streaming"]["paired_twin"]["keydiff"]["0.25"].update(
          value=-3.0, ci=[-5.0, -1.0])
    _edit_json(os.path.join(self.copy, "leaderboard", "summary.json"), loses)
    self.assertIn("| keydiff | keydiff_cert | **-3.0 [-5.0, -1.0]** |",
                  results_doc.render(self.copy))

  def test_write_and_check(self):
    out = os.path.join(self.tmp, "docs", "results.md")
    self.assertIn("does not exist", results_doc.check(out, self.copy))
    text = results_doc.write(out, self.copy)
    self.assertEqual(text, self.rendered)
    self.assertIsNone(results_doc.check(out, self.copy))
    with open(out, "a", encoding="utf-8") as f:
      f.write("hand edit\n")
    problem = results_doc.check(out, self.copy)
    self.assertIn("differs", problem)
    self.assertNotIn("\n", problem)

  def test_check_flag_fails_on_a_stale_doc(self):
    out = os.path.join(self.tmp, "results.md")
    with open(out, "w", encoding="utf-8") as f:
      f.write(self.rendered.replace("1,425,600", "1,425,601"))
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.results_doc", "--check", f"--out={out}",
         f"--results_dir={self.copy}"], cwd=test_util.ROOT, capture_output=True, text=True,
        timeout=300, check=False)
    self.assertNotEqual(proc.returncode, 0, proc.stdout + proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "differs" in line]
    self.assertLen(lines, 1, proc.stderr)
    self.assertIn("run `python -m experiments.results_doc", lines[0])


if __name__ == "__main__":
  absltest.main()
