r"""Synthetic Monte Carlo: deterministic vs randomized designs, side by side.

For a fixed synthetic attention problem, each design evicts the cache to a
budget, randomized designs over many seeded draws; one JSONL row per
(problem, regime, design, budget): bias, MSE, certificate coverage and
sharpness, the Assumption-2 ratio (:mod:`experiments.lib.montecarlo_certificate.experiment`).

  python -m experiments.montecarlo_certificate --out=/tmp/mc

Rows are written atomically as they finish; a rerun skips finished rows.
"""

from absl import app
from absl import flags

from experiments.lib.montecarlo_certificate import experiment as montecarlo_certificate
from experiments.lib import plan_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory (rows.jsonl, summary.md).", required=True)
plan_flags.define_flags(montecarlo_certificate.Plan)


def main(argv):
  del argv
  plan = plan_flags.plan_from_flags(montecarlo_certificate.Plan)
  montecarlo_certificate.run_and_report(plan, out=FLAGS.out)


if __name__ == "__main__":
  app.run(main)
