r"""Trains a small Llama-family model from scratch on synthetic key-value retrieval.

A controlled testbed for the eviction designs: the model learns to answer a
key-value lookup; the whole training state is checkpointed with orbax and a
rerun with the same ``--out`` resumes exactly (:mod:`experiments.lib.train_synthetic.experiment`).
The loss curve goes to ``--out/loss.jsonl``.

  python -m experiments.train_synthetic --out=/tmp/kv_train --steps=2000
"""

from absl import app
from absl import flags

from experiments.lib import plan_flags
from experiments.lib.train_synthetic import experiment as train_synthetic

FLAGS = flags.FLAGS


def define_flags():
  """The command-line flags; defined only when run as a script, so that
  importing this module (tests, other scripts) defines no flags."""
  flags.DEFINE_string("out", None, "Output directory (checkpoints/, loss.jsonl).", required=True)
  flags.DEFINE_integer("steps", 2000, "Total training steps (a rerun resumes up to this).")
  plan_flags.define_flags(train_synthetic.Settings)


def main(argv):
  del argv
  settings = plan_flags.plan_from_flags(train_synthetic.Settings)
  train_synthetic.train_and_report(FLAGS.out, FLAGS.steps, settings)


if __name__ == "__main__":
  define_flags()
  app.run(main)
