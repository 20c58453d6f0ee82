r"""Experiment 7: time and memory per decode step.

Times the full cache, a deterministic design, ``poisson_tail`` without and
with the certificate, and the certificate subsampled by layer and by KV head
(:mod:`experiments.lib.overhead`, :data:`~experiments.lib.overhead.TIMED_CONFIGS`).
Writes ``--out/overhead_rows.jsonl``, ``summary.md`` and ``overhead.png``.

  python -m experiments.overhead --out=/tmp/overhead
"""

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import overhead

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or an HF checkpoint dir.")
  flags.DEFINE_string("task", "passkey", "Task of the prompts.")
  flags.DEFINE_integer("context_len", 256, "Context length (tokens).")
  flags.DEFINE_list("budgets", ["0.25"], "Budget (the first entry is used).")
  flags.DEFINE_string("deterministic", "snapkv", "The deterministic design.")
  flags.DEFINE_integer("num_examples", 1, "Batch size.")
  flags.DEFINE_integer("n_steps", 16, "Decode steps per timed call.")
  flags.DEFINE_integer("repeats", 5, "Timed calls.")
  flags.DEFINE_integer("seed", 0, "Seed.")


def main(argv):
  del argv
  plan = overhead.Plan(model=FLAGS.model, budget=float(FLAGS.budgets[0]),
                       deterministic=FLAGS.deterministic, n_steps=FLAGS.n_steps,
                       repeats=FLAGS.repeats, seed=FLAGS.seed)
  print(overhead.run_and_report(plan, out=FLAGS.out, task=FLAGS.task,
                                context_len=FLAGS.context_len,
                                num_examples=FLAGS.num_examples))


if __name__ == "__main__":
  define_flags()
  app.run(main)
