r"""Eviction designs compared at equal memory: streaming loss and the certificate.

Every variant (design + per-head allocation) keeps the same key, value and
metadata bytes (``certkv_jax.kv.memory``); natural-text segments (one per source
file) stream through the model, evicted after every chunk; the NLL increase
over the full cache is paired by segment against the best deterministic
design with uniform budgets, and the randomized variants' raw and calibrated
(fitted on separate sources) coverage is reported with sharpness. Rows go to
``--out/rows.jsonl`` (resumable; progress with an ETA); when complete,
``--out/report.md``, ``summary.json`` and ``delta_nll.png`` are written
(:mod:`experiments.lib.equal_memory`). The default sources are the Vim user
manual shipped in ``experiments/data/vim`` (its README gives source and licence).
Variants are design strings of ``certkv_jax.designs.registry.parse``, as in ``generate``
and the leaderboard. A bad flag ends in one line naming it.

  python -m experiments.equal_memory --out=/tmp/eqm --context_lens=1024 \
      --n_eval=2 --n_calib=1 --variants=snapkv,priority_tail+cert --memories=0.25
"""

import os
import sys
import time

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib.equal_memory import experiment
from experiments.lib.equal_memory import report

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "Model ('smollm2' or a Hugging "
                    "Face safetensors directory).")
flags.DEFINE_string("sources", experiment.DEFAULT_SOURCES, "Comma-separated "
                    "globs of UTF-8 text files, one segment each, each glob sorted, the globs "
                    "in order (default: the Vim user manual shipped in experiments/data/vim, "
                    "natural English prose; the validity study at 4k-8k tokens reads its "
                    "editing.txt, no other study these files).")
plan_flags.define_flags(experiment.Plan)
flags.DEFINE_integer("skip_sources", 0, "Leave out the first this many files of --sources "
                     "(a tuning run on files the default evaluation and calibration never "
                     "read at up to 2,048 tokens: --skip_sources=20; at longer contexts files "
                     "too short are passed over and the default sets reach further).",
                     lower_bound=0)
flags.DEFINE_bool("report_only", False, "Write the report from the rows on file; run nothing "
                  "(variants without every row are listed as not run).")


def plan_from_flags(fv) -> experiment.Plan:
  """The checked :class:`experiment.Plan` of the parsed flags ``fv``.

  Raises:
    ValueError naming the flag.
  """
  sources = experiment.default_sources(fv.sources)
  if fv.skip_sources >= len(sources):
    raise ValueError(f"--skip_sources={fv.skip_sources} leaves none of the {len(sources)} "
                     f"files of --sources")
  return plan_flags.plan_from_flags(experiment.Plan, fv,
                                    sources=sources[fv.skip_sources:])


def main(argv):
  del argv
  results_io.quiet_library_logs(FLAGS)
  try:  # flag errors before the model loads: one line naming the flag
    plan = plan_from_flags(FLAGS)
  except ValueError as err:
    sys.exit(f"experiments.equal_memory: {err}")
  t0 = time.time()
  params, config, tok = model_loading.load_model(FLAGS.model)
  if FLAGS.report_only:
    results = results_io.JsonlResults(os.path.join(FLAGS.out, experiment.ROWS_FILE),
                                      experiment.KEY_FIELDS)
    try:  # the report describes the rows' settings and segments
      experiment.check_rows(results, plan, model_loading.model_name(FLAGS.model))
      experiment.check_segments(results, plan, {
          c: experiment.source_segments(tok, plan.sources, c, plan.n_eval + plan.n_calib)[0]
          for c in plan.context_lens})
    except ValueError as err:
      sys.exit(f"experiments.equal_memory: {err}")
    rows = results.rows
  else:
    try:
      rows = experiment.run(params, config, tok, FLAGS.out, plan,
                            model=model_loading.model_name(FLAGS.model))
    except ValueError as err:  # e.g. too few --sources files long enough for the segments
      if not str(err).startswith("--"):
        raise
      sys.exit(f"experiments.equal_memory: {err}")
  results_io.print_summary(report.write(rows, FLAGS.out, plan, n_kv_heads=config.n_kv_heads),
                           t0)


if __name__ == "__main__":
  app.run(main)
