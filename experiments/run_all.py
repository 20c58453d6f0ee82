r"""The main command: every experiment of method, section 8, then ``report.md`` for section 7.

  python -m experiments.run_all --out=DIR           # quick suite (SmolLM2, 2-core CPU)
  python -m experiments.run_all --out=DIR --full    # the larger version

Collects the suite's rows once (resumable, ``DIR/rows.jsonl``), runs the
Theorem-1 rotation, the overhead timing and the streaming loss under eviction
on ``--text``, and writes ``DIR/report.md``: what ran (contexts, examples,
designs) and what its verdicts can and cannot say about the paper, then for
each claim of method, section 7 the paper's number, ours with a 95% interval
and a verdict beside what the project's committed longer-context runs measured
(with links), followed by every experiment's tables and PNG plots. Progress is
one line for the whole job (stage i of n, the job's ETA); at the end the
terminal gets what ran, the claims table and the report's path. The plans
(``QUICK``, ``FULL``) and the run: :mod:`experiments.lib.suite.runner`. A
rerun resumes: finished rows are not recomputed.
"""

import sys

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import results_io
from experiments.lib.suite import runner as suite_runner

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("out", None, "Output directory (rows, report.md, plots).", required=True)
  flags.DEFINE_bool("full", False, "Run the larger suite instead of the quick one.")
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                      "safetensors checkpoint directory with tokenizer.json.")
  flags.DEFINE_integer("num_examples", None, "Override the plan's examples per task (and "
                       "streaming-loss segments), e.g. a --full run at reduced size.")
  flags.DEFINE_integer("context_len", None, "Override the plan's context length in tokens "
                       "(tasks and streaming-loss segments).")
  flags.DEFINE_string("text", suite_runner.DEFAULT_TEXT, "UTF-8 text file of the streaming-loss "
                      "experiment (default: the built-in GPL-3 text).")
  flags.DEFINE_bool("validity", True, "Also run the validity study (validity/); "
                    "--novalidity skips it, e.g. to resume a run made before it existed.")
  flags.DEFINE_bool("damage", True, "Also run the damage study (damage/); --nodamage skips "
                    "it.")
  flags.DEFINE_integer("max_units", -1, "Stop the collection after this many units (-1: "
                       "all); a rerun resumes.")


def main(argv):
  del argv
  results_io.quiet_library_logs(FLAGS)
  suite_runner.run_command(FLAGS, "python -m experiments.run_all " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
  define_flags()
  app.run(main)
