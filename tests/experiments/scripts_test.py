"""Every thin experiment script, end to end through its command line, on tiny settings.

Each script runs as ``python -m experiments.<name>`` in a child process (its
absl flags parsed as a user would give them) on a Hugging Face-style directory
holding the tiny Llama fixture and a character-level ``tokenizer.json``. The
four analysis scripts share one output directory and the same settings: the
first collects the rows, the next three resume them (nothing recomputed) and
only add their own summaries, which is also the resume behaviour a user
relies on when running the experiments one after another.
"""

import os
import subprocess
import sys

from absl.testing import absltest
import pytest

from experiments.lib import results_io
from experiments.lib.suite import rows as suite_rows
from tests import test_util

# Child processes (each imports jax and compiles its script): end to end, slow tier.
pytestmark = pytest.mark.slow

ROOT = test_util.ROOT
COMMON = ["--task=passkey,agent_memory", "--num_examples=2", "--context_len=24",
          "--budgets=0.5", "--designs=full,poisson_tail", "--n_runs=2", "--n_steps=3"]


class ExperimentScriptsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    test_util.ensure_flags_parsed()  # create_tempdir under plain pytest

  def setUp(self):
    super().setUp()
    self.model = test_util.tiny_hf_dir(self.create_tempdir().full_path,
                                       test_util.MIXED_CASE_CHARS)

  def _run(self, module: str, *args) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}",
                           f"--model={self.model}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    self.assertEqual(proc.returncode, 0, f"{module} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout

  def test_analysis_scripts_share_and_resume_rows(self):
    out = self.create_tempdir().full_path
    expected = None
    for module, title in (("coverage", "# Certificate coverage"),
                          ("assumption2", "# Assumption-2 audit"),
                          ("failure", "# Failure prediction, attribution"),
                          ("regimes", "# Streaming vs question-aware")):
      stdout = self._run(module, f"--out={out}", *COMMON)
      self.assertIn(title, stdout)
      summary = open(os.path.join(out, "summary.md")).read()
      self.assertTrue(summary.startswith(title), module)
      rows = results_io.read_rows(os.path.join(out, "rows.jsonl"))
      keys = {results_io.row_key(r, suite_rows.KEY_FIELDS) for r in rows}
      self.assertLen(keys, len(rows))  # no duplicates
      if expected is None:
        # 2 tasks x 2 examples x budget 0.5: full once, poisson_tail x 2 runs x 2 regimes
        expected = 2 * 2 * (1 + 2 * 2)
      self.assertLen(rows, expected, module)  # resumed: nothing added or lost
    self.assertTrue(os.path.exists(os.path.join(out, "coverage.png")))
    self.assertTrue(os.path.exists(os.path.join(out, "r_audit_poisson_tail.png")))

  def test_theorem1_and_overhead_scripts(self):
    out = self.create_tempdir().full_path
    stdout = self._run("theorem1", f"--out={out}", "--context_len=24", "--num_examples=1",
                       "--designs=snapkv", "--budget=0.5", "--n_draws=2")
    self.assertIn("Theorem 1", stdout)
    (row,) = results_io.read_rows(os.path.join(out, "theorem1_rows.jsonl"))
    self.assertTrue(row["kept_set_identical"] and row["tokens_identical"])
    stdout = self._run("overhead", f"--out={out}", "--context_len=24", "--num_examples=1",
                       "--n_steps=2", "--repeats=2", "--budget=0.5")
    self.assertIn("Overhead per decode step", stdout)
    rows = results_io.read_rows(os.path.join(out, "overhead_rows.jsonl"))
    from experiments.lib.overhead import experiment as overhead  # pylint: disable=g-import-not-at-top
    self.assertEqual([r["config"] for r in rows], list(overhead.ALL_CONFIGS))
    self.assertIn("ratio_cert_vs_deterministic", open(os.path.join(out, "summary.md")).read())
    # A bad flag fails with the flag's name.
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "experiments.theorem1", f"--out={out}",
                           f"--model={self.model}", "--designs=full"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("--designs", proc.stderr)


if __name__ == "__main__":
  absltest.main()


class OldNamesTest(absltest.TestCase):
  """The scripts' old ``exp_`` names still run the renamed scripts (kept for a release)."""

  def test_old_names_run_the_new_scripts(self):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    for new, title in (("theorem1", "Experiment 1: permutation"),
                       ("perplexity", "Streaming")):
      proc = subprocess.run([sys.executable, "-m", f"experiments.exp_{new}", "--helpshort"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
      self.assertIn(title, proc.stdout, proc.stderr[-2000:])  # absl's help exits 1
      self.assertIn(f"experiments/{new}.py:", proc.stdout)  # the new module's flags
