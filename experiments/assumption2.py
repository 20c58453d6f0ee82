r"""Experiment 3: Assumption-2 audit (method, section 6).

Distribution of ``R = m max_T a_i / (pi_i sum_j a_j)`` per decode call,
regression of ``log R`` on ``log m`` and ``n_tail``, coverage as a function of
``R``, for ``poisson_tail`` and, side by side, ``attention_proportional``
(``pi ∝ a`` on the tail: the assumption holds by construction; question-aware
only). Writes ``--out/rows.jsonl``, ``summary.md``, ``summary.json`` and the
``r_audit_*.png`` plots.

  python -m experiments.assumption2 --out=/tmp/assumption2
"""

from absl import app
from absl import flags

from experiments.lib.analyses import assumption2
from experiments.lib.suite import report as suite_report
from experiments.lib.suite import settings as suite_settings

FLAGS = flags.FLAGS


def main(argv):
  del argv
  print(suite_report.run_analyses(FLAGS, [assumption2.assumption2_analysis], "Assumption-2 audit"))


if __name__ == "__main__":
  suite_settings.define_common_flags(flags, designs=["poisson_tail", "attention_proportional"],
                                     n_runs=1)
  app.run(main)
