r"""Experiment 8: streaming vs question-aware eviction.

Accuracy and damage (full-cache accuracy minus evicted accuracy, on the same
examples) per regime, design, task and budget. Writes ``--out/rows.jsonl``,
``summary.md`` and ``summary.json``.

  python -m experiments.regimes --out=/tmp/regimes
"""

from absl import app
from absl import flags

from experiments.lib.analyses import regimes
from experiments.lib.suite import report as suite_report
from experiments.lib.suite import settings as suite_settings

FLAGS = flags.FLAGS


def main(argv):
  del argv
  print(suite_report.run_analyses(FLAGS, [regimes.regimes_analysis], "Streaming vs question-aware"))


if __name__ == "__main__":
  suite_settings.define_common_flags(flags, designs=["full", "snapkv", "h2o", "poisson_tail"],
                                     task=["passkey", "agent_memory"], n_runs=1)
  app.run(main)
