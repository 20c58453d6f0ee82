r"""Trains a small Llama-family model from scratch on synthetic key-value retrieval.

A controlled testbed for the eviction designs: the model learns to answer a
key-value lookup; the whole training state is checkpointed with orbax and a
rerun with the same ``--out`` resumes exactly (:mod:`experiments.lib.train_synthetic`).
The loss curve goes to ``--out/loss.jsonl``.

  python -m experiments.train_synthetic --out=/tmp/kv_train --steps=2000
"""

from absl import app
from absl import flags

from experiments.lib import train_synthetic

FLAGS = flags.FLAGS


def define_flags():
  """The command-line flags; defined only when run as a script, so that
  importing this module (tests, other scripts) defines no flags."""
  flags.DEFINE_string("out", None, "Output directory (checkpoints/, loss.jsonl).", required=True)
  flags.DEFINE_integer("steps", 2000, "Total training steps (a rerun resumes up to this).")
  flags.DEFINE_integer("batch", 32, "Sequences per step.")
  flags.DEFINE_integer("n_pairs", 8, "Key-value pairs per sequence.")
  flags.DEFINE_integer("n_keys", 64, "Key vocabulary size.")
  flags.DEFINE_integer("n_values", 64, "Value vocabulary size.")
  flags.DEFINE_integer("layers", 2, "Decoder layers.")
  flags.DEFINE_integer("hidden", 64, "Residual width.")
  flags.DEFINE_integer("heads", 4, "Query heads.")
  flags.DEFINE_integer("kv_heads", 2, "KV heads (GQA).")
  flags.DEFINE_float("lr", 3e-3, "Peak learning rate (adamw, warmup-cosine).")
  flags.DEFINE_float("weight_decay", 0.01, "adamw weight decay.")
  flags.DEFINE_integer("checkpoint_every", 200, "Save a checkpoint every this many steps.")
  flags.DEFINE_integer("log_every", 50, "Log and record the loss every this many steps.")
  flags.DEFINE_integer("seed", 0, "Seed of the initialisation and of the data.")


def main(argv):
  del argv
  settings = train_synthetic.Settings(
      batch=FLAGS.batch, n_pairs=FLAGS.n_pairs, n_keys=FLAGS.n_keys, n_values=FLAGS.n_values,
      layers=FLAGS.layers, hidden=FLAGS.hidden, heads=FLAGS.heads, kv_heads=FLAGS.kv_heads,
      lr=FLAGS.lr, weight_decay=FLAGS.weight_decay,
      checkpoint_every=FLAGS.checkpoint_every, log_every=FLAGS.log_every, seed=FLAGS.seed)
  train_synthetic.train_and_report(FLAGS.out, FLAGS.steps, settings)


if __name__ == "__main__":
  define_flags()
  app.run(main)
