r"""Experiment 1: permutation / rotation (Theorem 1) on a real model's cache.

Rotates the values of the evicted tokens and evicts again with the same key:
what each design keeps, decodes and certifies is compared before and after
(:mod:`experiments.lib.theorem1`). Writes ``--out/theorem1_rows.jsonl`` and
``summary.md``.

  python -m experiments.theorem1 --out=/tmp/thm1
"""

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import theorem1

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or an HF checkpoint dir.")
  flags.DEFINE_string("task", "passkey", "Task.")
  flags.DEFINE_integer("context_len", 192, "Context length (tokens).")
  flags.DEFINE_list("budgets", ["0.25"], "Budget (the first entry is used).")
  flags.DEFINE_list("designs", ["snapkv", "h2o", "poisson_tail"], "Designs.")
  flags.DEFINE_integer("num_examples", 2, "Examples.")
  flags.DEFINE_integer("n_draws", 4, "Draws of the randomized designs.")
  flags.DEFINE_integer("seed", 0, "Seed.")


def main(argv):
  del argv
  plan = theorem1.Plan(designs=tuple(FLAGS.designs), budget=float(FLAGS.budgets[0]),
                       model=FLAGS.model, task=FLAGS.task, context_len=FLAGS.context_len,
                       seed=FLAGS.seed, n_draws=FLAGS.n_draws)
  print(theorem1.run_and_report(plan, out=FLAGS.out, num_examples=FLAGS.num_examples))


if __name__ == "__main__":
  define_flags()
  app.run(main)
