r"""Experiment 7: time and memory per decode step.

Times the full cache, a deterministic design, ``poisson_tail`` without and
with the certificate, and the certificate subsampled by layer and by KV head
(:mod:`experiments.lib.overhead.experiment`, :data:`~experiments.lib.overhead.experiment.TIMED_CONFIGS`).
Writes ``--out/overhead_rows.jsonl``, ``summary.md`` and ``overhead.png``.

  python -m experiments.overhead --out=/tmp/overhead
"""

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.overhead import experiment as overhead

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", None, "Output directory.", required=True)
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or an HF checkpoint dir.")
  flags.DEFINE_string("task", "passkey", "Task of the prompts.")
  flags.DEFINE_integer("context_len", 256, "Context length (tokens).")
  flags.DEFINE_integer("num_examples", 1, "Batch size.")
  plan_flags.define_flags(overhead.Plan)


def main(argv):
  del argv
  plan = plan_flags.plan_from_flags(overhead.Plan, model=FLAGS.model)
  print(overhead.run_and_report(plan, out=FLAGS.out, task=FLAGS.task,
                                context_len=FLAGS.context_len,
                                num_examples=FLAGS.num_examples))


if __name__ == "__main__":
  define_flags()
  app.run(main)
