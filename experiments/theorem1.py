r"""Experiment 1: permutation / rotation (Theorem 1) on a real model's cache.

Rotates the values of the evicted tokens and evicts again with the same key:
what each design keeps, decodes and certifies is compared before and after
(:mod:`experiments.lib.theorem1.experiment`). Writes ``--out/theorem1_rows.jsonl`` and
``summary.md``.

  python -m experiments.theorem1 --out=/tmp/thm1
"""

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.theorem1 import experiment as theorem1

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or an HF checkpoint dir.")
  flags.DEFINE_integer("num_examples", 2, "Examples.")
  plan_flags.define_flags(theorem1.Plan)


def main(argv):
  del argv
  plan = plan_flags.plan_from_flags(theorem1.Plan, model=FLAGS.model)
  print(theorem1.run_and_report(plan, out=FLAGS.out, num_examples=FLAGS.num_examples))


if __name__ == "__main__":
  define_flags()
  app.run(main)
