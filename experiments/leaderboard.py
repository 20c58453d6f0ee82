r"""A RULER-style leaderboard: every eviction design on RULER's synthetic tasks.

The 11 RULER tasks that need no outside data (``experiments.lib.ruler``;
qa_1 and qa_2 need SQuAD and HotpotQA and are left out), scored with
string_match_all at RULER's maximum generation lengths, for the full cache
and every design at kvpress's compression ratios (the share of the cache
removed), with the question outside the compressed context (``streaming``,
kvpress's default) and inside it (``query_aware``). One prefill serves every
design. Rows go to ``--out/rows.jsonl`` (resumable; progress with an ETA);
when complete, ``--out/report.md``, ``summary.json`` (``score[design][ratio]``)
and ``score.png`` are written (:mod:`experiments.lib.leaderboard`).

  python -m experiments.leaderboard --out=/tmp/lb --tasks=niah_single_1,vt \
      --context_lens=1024 --n_examples=2 --designs=full,snapkv --ratios=0.5 \
      --regimes=streaming

The full leaderboard: every task at 4k tokens, a subset at 8k::

  python -m experiments.leaderboard --out=DIR --context_lens=4096,8192 \
      --tasks_at=8192:niah_single_1+niah_multikey_1+niah_multivalue+vt
"""

import os
import sys
import time

from absl import app
from absl import flags

from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib import ruler
from experiments.lib.leaderboard import experiment
from experiments.lib.leaderboard import rows as rows_lib
from experiments.lib.leaderboard import report

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "Model ('smollm2' or a Hugging "
                    "Face safetensors directory).")
plan_flags.define_flags(experiment.Plan)
flags.DEFINE_bool("report_only", False, "Write the report from the rows on file; run nothing "
                  "(designs without every row are listed as not run).")


def main(argv):
  del argv
  results_io.quiet_library_logs(FLAGS)
  try:  # flag errors before the model loads: one line naming the flag
    plan = plan_flags.plan_from_flags(experiment.Plan).check()
  except ValueError as err:
    sys.exit(f"experiments.leaderboard: {err}")
  t0 = time.time()
  params, config, tok = model_loading.load_model(FLAGS.model, plan.dtype)
  name = model_loading.model_name(FLAGS.model)
  if FLAGS.report_only:
    results = results_io.JsonlResults(os.path.join(FLAGS.out, experiment.ROWS_FILE),
                                      experiment.KEY_FIELDS)
    try:  # the report describes the rows' settings
      rows_lib.check_rows(results, plan, name)
    except ValueError as err:
      sys.exit(f"experiments.leaderboard: {err}")
    rows = results.rows
  else:
    rows = experiment.run(params, config, tok, FLAGS.out, plan, model=name)
  summary = report.write(rows, FLAGS.out, plan, n_kv_heads=config.n_kv_heads, model=name)
  results_io.print_summary(summary, t0)


if __name__ == "__main__":
  app.run(main)
