r"""Experiment 2: certificate coverage by design, budget, regime, task, delta, layer, head.

Coverage of the realised attention error (true error from the shadow full
cache <= the Bernstein radius at each ``--deltas``), with sharpness next to
it (method, section 5), from the rows of ``experiments.lib.suite.rows.collect`` (one
JSONL row per (task, regime, design, budget, example, run), resumable).
Writes ``--out/rows.jsonl``, ``summary.md``, ``summary.json``,
``coverage.png`` and ``error_vs_radius.png``.

  python -m experiments.coverage --out=/tmp/coverage
"""

from absl import app
from absl import flags

from experiments.lib.analyses import coverage
from experiments.lib.suite import report as suite_report
from experiments.lib.suite import settings as suite_settings

FLAGS = flags.FLAGS


def main(argv):
  del argv
  print(suite_report.run_analyses(FLAGS, [coverage.coverage_analysis], "Certificate coverage"))


if __name__ == "__main__":
  suite_settings.define_common_flags(flags, designs=["poisson_tail", "attention_proportional",
                                                     "uniform_random"])
  app.run(main)
