r"""Experiments 4-6: failure prediction, attribution and certificate-gated recomputation.

* failure prediction: ROC AUC (cluster-bootstrap CIs over examples) of the
  certificate score, the negative mean output log-probability and the
  disagreement of two independent ``poisson_tail`` runs, for predicting that
  the evicted run's answer is wrong;
* attribution: AUC of the same scores for separating cache-induced failures
  (full cache right, evicted wrong) from inherent ones (full cache wrong);
* gating: under a recompute budget (fraction of examples re-run with the
  full cache), the fraction of the oracle's recoverable gain captured by
  oracle, random, confidence and certificate gating, as a curve, per regime.

Needs ``full`` and ``poisson_tail`` in ``--designs`` and ``--n_runs=2``.
Writes ``--out/rows.jsonl``, ``summary.md``, ``summary.json``,
``roc_failure.png`` and ``gating_<regime>.png``.

  python -m experiments.failure --out=/tmp/failure
"""

from absl import app
from absl import flags

from experiments.lib.analyses import failures
from experiments.lib.suite import report as suite_report
from experiments.lib.suite import settings as suite_settings

FLAGS = flags.FLAGS


def main(argv):
  del argv
  print(suite_report.run_analyses(FLAGS, [failures.failure_analysis],
                                  "Failure prediction, attribution, gated recomputation"))


if __name__ == "__main__":
  suite_settings.define_common_flags(flags, designs=["full", "poisson_tail"],
                                     task=["passkey", "agent_memory"])
  app.run(main)
