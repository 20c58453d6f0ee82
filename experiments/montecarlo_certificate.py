r"""Synthetic Monte Carlo: deterministic vs randomized designs, side by side.

For a fixed synthetic attention problem, each design evicts the cache to a
budget, randomized designs over many seeded draws; one JSONL row per
(problem, regime, design, budget): bias, MSE, certificate coverage and
sharpness, the Assumption-2 ratio (:mod:`experiments.lib.montecarlo_certificate`).

  python -m experiments.montecarlo_certificate --out=/tmp/mc

Rows are written atomically as they finish; a rerun skips finished rows.
"""

from absl import app
from absl import flags

from experiments.lib import montecarlo_certificate

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory (rows.jsonl, summary.md).", required=True)
flags.DEFINE_integer("context_len", 512, "Tokens in the synthetic context.")
flags.DEFINE_integer("head_dim", 16, "Key and value dimension.")
flags.DEFINE_list("budgets", ["0.125", "0.25", "0.5"], "Budgets as fractions of the context.")
flags.DEFINE_list("deltas", ["0.01", "0.05", "0.1", "0.2"], "Certificate miss probabilities.")
flags.DEFINE_list("designs", ["sink_window", "h2o", "tova", "snapkv", "key_norm",
                              "uniform_random", "poisson_tail", "poisson_flat",
                              "attention_proportional"], "Designs to run.")
flags.DEFINE_list("problems", ["gaussian", "spike"], "gaussian: i.i.d. keys/values; "
                  "spike: plus a few high-attention outlier tokens.")
flags.DEFINE_list("regimes", ["question_aware", "streaming"],
                  "question_aware: the query's attention is known at eviction; "
                  "streaming: scores come from earlier queries only.")
flags.DEFINE_integer("num_trials", 2000, "Draws per randomized design.")
flags.DEFINE_integer("n_sink", 4, "Sink tokens kept by every design.")
flags.DEFINE_integer("window", 16, "Recent window kept by every design.")
flags.DEFINE_integer("seed", 0, "Seed of the problem and of the draws.")


def main(argv):
  del argv
  plan = montecarlo_certificate.Plan(
      context_len=FLAGS.context_len, head_dim=FLAGS.head_dim, budgets=tuple(FLAGS.budgets),
      deltas=tuple(FLAGS.deltas), designs=tuple(FLAGS.designs),
      problems=tuple(FLAGS.problems), regimes=tuple(FLAGS.regimes),
      num_trials=FLAGS.num_trials, n_sink=FLAGS.n_sink, window=FLAGS.window, seed=FLAGS.seed)
  montecarlo_certificate.run_and_report(plan, out=FLAGS.out)


if __name__ == "__main__":
  app.run(main)
