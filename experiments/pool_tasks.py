r"""Task scores pooled over leaderboard runs with different seeds, paired.

Reads the ``rows.jsonl`` of each run in ``--runs`` (``experiments.leaderboard``
output directories, e.g. the same tasks drawn with seeds 0, 2 and 4) and
writes, to ``--out``, ``summary.json`` (``paired[design][ratio]``: the score
difference to ``--against`` on the examples both ran, with a bootstrap
interval stratified by seed and task) and ``report.md``
(:mod:`experiments.lib.leaderboard.pooled`). Nothing is run; a second call
rewrites both files.

  python -m experiments.pool_tasks --out=/tmp/pooled --against=snapkv \
      --runs=experiments/results/equal_memory_tasks,experiments/results/equal_memory_tasks_seed2
"""

import json
import os

from absl import app
from absl import flags

from experiments.lib import results_io
from experiments.lib.leaderboard import experiment
from experiments.lib.leaderboard import pooled

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_list("runs", None, "Leaderboard output directories to pool.", required=True)
flags.DEFINE_string("against", "snapkv", "The design every other is paired against.")
flags.DEFINE_list("designs", [], "Designs to compare (default: every design in the rows).")
flags.DEFINE_list("ratios", [], "Compression ratios (default: every ratio in the rows).")


def main(argv):
  del argv
  rows = []
  for run in FLAGS.runs:
    path = os.path.join(run, experiment.ROWS_FILE)
    if not os.path.exists(path):
      raise ValueError(f"--runs: {run!r} has no {experiment.ROWS_FILE}")
    rows += results_io.read_rows(path)
  try:
    ratios = [float(r) for r in FLAGS.ratios]
  except ValueError as err:
    raise ValueError(f"--ratios must be numbers, got {FLAGS.ratios}") from err
  summary = pooled.summarize(rows, against=FLAGS.against, designs=FLAGS.designs,
                             ratios=ratios)
  if not summary["paired"]:
    raise ValueError(f"--against={FLAGS.against!r} shares no ratio with the designs in --runs")
  summary["runs"] = list(FLAGS.runs)
  os.makedirs(FLAGS.out, exist_ok=True)
  md = "# Task scores pooled over seeds\n\nRuns: " + ", ".join(
      f"`{r}`" for r in FLAGS.runs) + "\n\n" + pooled.markdown(summary)
  results_io.atomic_write_text(os.path.join(FLAGS.out, "summary.json"),
                               json.dumps(summary, indent=1, sort_keys=True) + "\n")
  results_io.atomic_write_text(os.path.join(FLAGS.out, "report.md"), md)
  print(md)


if __name__ == "__main__":
  app.run(main)
