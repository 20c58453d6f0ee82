r"""Side-by-side demo: deterministic vs randomized eviction on SmolLM2, with the certificate.

A seeded pass-key task on SmolLM2-135M-Instruct; every (design, budget) runs
in evaluation mode and reports accuracy, the true attention error, the
certificate's coverage and sharpness, memory and tokens/s
(:mod:`experiments.lib.demo.experiment`).

  python -m experiments.demo_smollm2 --out=/tmp/demo

Rows go to ``--out/rows.jsonl`` atomically as they finish; a rerun skips them.
"""

from absl import app
from absl import flags

from experiments.lib import plan_flags
from experiments.lib.demo import experiment as demo

FLAGS = flags.FLAGS


def define_flags():
  """The output flag and one per setting of :class:`experiments.lib.demo.experiment.Plan`;
  defined only when run as a script, so that importing this module defines no flags."""
  flags.DEFINE_string("out", None, "Output directory (rows.jsonl, summary.md).", required=True)
  plan_flags.define_flags(demo.Plan)


def main(argv):
  del argv
  plan = plan_flags.plan_from_flags(demo.Plan)
  demo.run_and_report(plan, out=FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
