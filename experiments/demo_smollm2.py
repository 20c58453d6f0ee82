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

from experiments.lib.demo import experiment as demo
from experiments.lib import design_defaults

FLAGS = flags.FLAGS


def define_flags():
  """The command-line flags; defined only when run as a script, so that
  importing this module (tests, other scripts) defines no flags."""
  flags.DEFINE_string("out", None, "Output directory (rows.jsonl, summary.md).", required=True)
  flags.DEFINE_list("designs", ["snapkv", "poisson_tail"],
                    f"Designs, from {', '.join(design_defaults.names())}; 'full' keeps "
                    "everything (the reference); 'all' = every one of them.")
  flags.DEFINE_list("budgets", ["0.125", "0.25", "0.5"], "Budgets, fractions of the tokens seen.")
  flags.DEFINE_enum("regime", "question_aware", ["question_aware", "streaming", "both"],
                    "Eviction regime; 'both' runs question_aware then streaming.")
  flags.DEFINE_integer("context_len", 256, "Filler tokens around the pass key (approximately).")
  flags.DEFINE_integer("num_examples", 4, "Examples (one batch).")
  flags.DEFINE_float("delta", 0.05, "Certificate miss probability.")
  flags.DEFINE_integer("seed", 0, "Seed of the task and of the randomized designs.")
  flags.DEFINE_integer("n_sink", design_defaults.N_SINK, "Sink tokens kept by every design.")
  flags.DEFINE_integer("window", design_defaults.WINDOW, "Recent window / observation window "
                       "kept by every design.")
  flags.DEFINE_integer("chunk", 64, "Streaming: context tokens per chunk.")


def main(argv):
  del argv
  plan = demo.Plan(designs=tuple(FLAGS.designs), budgets=tuple(FLAGS.budgets),
                   regime=FLAGS.regime, context_len=FLAGS.context_len,
                   num_examples=FLAGS.num_examples, delta=FLAGS.delta, seed=FLAGS.seed,
                   n_sink=FLAGS.n_sink, window=FLAGS.window, chunk=FLAGS.chunk)
  demo.run_and_report(plan, out=FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
