"""Task scores pooled over seeds (experiments/pool_tasks.py, .lib.leaderboard.pooled).

Hand-made rows: the paired difference and its counts, strata by (seed,
task), examples only one design ran left out, disagreeing duplicates and
disjoint designs rejected, and the command's files.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

from experiments.lib.leaderboard import pooled
from tests import test_util

ROOT = test_util.ROOT


def _row(design, seed, task, example, score, ratio=0.75):
  return dict(design=design, seed=seed, context_len=1024, regime="query_aware", task=task,
              example=example, score=score, ratio=ratio)


# Seed 0: a wins one, loses two of four; seed 2: a and b tie on two.
ROWS = ([_row("b", 0, "t1", e, s) for e, s in enumerate((1, 1, 0, 0))]
        + [_row("a", 0, "t1", e, s) for e, s in enumerate((0, 0, 1, 0))]
        + [_row("b", 2, "t1", e, s) for e, s in enumerate((1, 0))]
        + [_row("a", 2, "t1", e, s) for e, s in enumerate((1, 0))]
        + [_row("a", 2, "t2", 0, 1)])  # b never ran t2: left out


class PooledTest(absltest.TestCase):

  def test_paired_difference_and_counts(self):
    p = pooled.paired(ROWS, "a", "b", 0.75)
    self.assertEqual(p["n"], 6)
    self.assertEqual(p["seeds"], [0, 2])
    self.assertEqual((p["wins"], p["losses"]), (1, 2))
    self.assertAlmostEqual(p["value"], 100.0 * (1 - 2) / 6)
    self.assertAlmostEqual(p["score"]["value"], 100.0 * 2 / 6)
    self.assertAlmostEqual(p["against_score"]["value"], 100.0 * 3 / 6)
    lo, hi = p["ci"]
    self.assertLessEqual(lo, p["value"])
    self.assertGreaterEqual(hi, p["value"])

  def test_a_stratum_with_no_difference_adds_no_spread(self):
    # seed 2 ties on every example, so its resamples all add 0: the interval
    # is seed 0's spread scaled by 4/6, never wider than seed 0 alone.
    only0 = pooled.paired([r for r in ROWS if r["seed"] == 0], "a", "b", 0.75)
    both = pooled.paired(ROWS, "a", "b", 0.75)
    self.assertAlmostEqual(both["ci"][0], only0["ci"][0] * 4 / 6)
    self.assertAlmostEqual(both["ci"][1], only0["ci"][1] * 4 / 6)

  def test_rows_that_disagree_are_an_error(self):
    with self.assertRaisesRegex(ValueError, "rows disagree"):
      pooled.example_scores(ROWS + [_row("a", 0, "t1", 0, 1)], "a", 0.75)

  def test_no_shared_example_is_an_error(self):
    with self.assertRaisesRegex(ValueError, "share no example"):
      pooled.paired(ROWS, "a", "b", 0.5)

  def test_rows_at_two_context_lengths_are_an_error(self):
    longer = [dict(r, context_len=2048) for r in ROWS]
    for pool in (lambda rows: pooled.paired(rows, "a", "b", 0.75),
                 lambda rows: pooled.summarize(rows, against="b")):
      with self.assertRaisesRegex(ValueError, r"2 \(context_len, regime\) settings"):
        pool(ROWS + longer)

  def test_runs_of_other_settings_are_an_error(self):
    seed2 = lambda r: r["seed"] == 2
    for change, pattern in ((dict(model="other"), "2 values of model"),
                            (dict(equal_memory=True), "2 values of equal_memory"),
                            (dict(use_chat=False), "2 values of use_chat"),
                            (dict(max_new_tokens=30), "more than one max_new_tokens")):
      mixed = [dict(r, **change) if seed2(r) else dict(r, model="m") for r in ROWS]
      with self.assertRaisesRegex(ValueError, pattern):
        pooled.summarize(mixed, against="b")
    # A field that older rows lack and that has no assumed value is compared where held.
    pooled.summarize([dict(r, model="m") if seed2(r) else r for r in ROWS], against="b")

  def test_summarize_defaults_and_markdown(self):
    s = pooled.summarize(ROWS + [_row("full", 0, "t1", 0, 1, ratio=0.0)], against="b")
    self.assertEqual(list(s["paired"]), ["a"])
    self.assertEqual(list(s["paired"]["a"]), ["0.75"])
    self.assertIn("| a | 0.75 | 0, 2 | 6 |", pooled.markdown(s))


class CommandTest(absltest.TestCase):
  """The command in its own process (its absl flags would clash with other scripts')."""

  def _run(self, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "experiments.pool_tasks", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)

  def test_writes_summary_and_report(self):
    with tempfile.TemporaryDirectory() as root:
      runs = []
      for seed in (0, 2):
        run = os.path.join(root, f"seed{seed}")
        os.makedirs(run)
        with open(os.path.join(run, "rows.jsonl"), "w") as f:
          f.writelines(json.dumps(r) + "\n" for r in ROWS if r["seed"] == seed)
        runs.append(run)
      out = os.path.join(root, "pooled")
      proc = self._run(f"--out={out}", f"--runs={','.join(runs)}", "--against=b")
      self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
      with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
      self.assertEqual(s["paired"]["a"]["0.75"]["n"], 6)
      self.assertEqual(s["runs"], runs)
      self.assertTrue(os.path.exists(os.path.join(out, "report.md")))
      for args, flag in (((f"--runs={os.path.join(root, 'none')}",), "--runs"),
                         ((f"--runs={','.join(runs)}", "--against=zzz"), "--against")):
        proc = self._run(f"--out={out}", *args)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn(flag, proc.stderr)


if __name__ == "__main__":
  absltest.main()
