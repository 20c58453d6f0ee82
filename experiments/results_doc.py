r"""Renders docs/results.md from the committed summaries under experiments/results/.

The results document is generated, never hand-edited, so its numbers cannot drift from the
runs they come from (:mod:`experiments.lib.results_doc`). Run from the repository root:

  python -m experiments.results_doc                 # write docs/results.md
  python -m experiments.results_doc --check         # exit 1 if it is out of date
"""

import sys

from absl import app
from absl import flags

from experiments.lib import results_doc

FLAGS = flags.FLAGS
flags.DEFINE_string("out", results_doc.DEFAULT_OUT, "The results document to write or check.")
flags.DEFINE_string("results_dir", results_doc.DEFAULT_RESULTS,
                    "Directory of the committed summaries.")
flags.DEFINE_bool("check", False, "Write nothing; exit non-zero when --out differs from what "
                  "the summaries give.")


def main(argv):
  del argv
  if FLAGS.check:
    problem = results_doc.check(FLAGS.out, FLAGS.results_dir)
    if problem:
      print(problem, file=sys.stderr)
      return 1
    print(f"{FLAGS.out} is up to date")
    return 0
  results_doc.write(FLAGS.out, FLAGS.results_dir)
  print(f"wrote {FLAGS.out}")
  return 0


if __name__ == "__main__":
  app.run(main)
