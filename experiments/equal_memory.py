r"""Eviction designs compared at equal memory: streaming loss and the certificate.

Every variant (design + per-head allocation) keeps the same key, value and
metadata bytes (``certkv_jax.memory``); natural-text segments (one per source
file) stream through the model, evicted after every chunk; the NLL increase
over the full cache is paired by segment against the best deterministic
design with uniform budgets, and the randomized variants' raw and calibrated
(fitted on separate sources) coverage is reported with sharpness. Rows go to
``--out/rows.jsonl`` (resumable; progress with an ETA); when complete,
``--out/report.md``, ``summary.json`` and ``delta_nll.png`` are written
(:mod:`experiments.lib.equal_memory`).

  python -m experiments.equal_memory --out=/tmp/eqm --context_lens=1024 \
      --n_eval=2 --n_calib=1 --variants=snapkv,priority_tail+cert --memories=0.25
"""

import os
import time

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import results_io
from experiments.lib.equal_memory import experiment
from experiments.lib.equal_memory import report

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "Model ('smollm2' or a Hugging "
                    "Face safetensors directory).")
flags.DEFINE_string("sources", "/usr/share/vim/vim90/doc/usr_[0-9]*.txt", "Comma-separated "
                    "globs of UTF-8 text files, one segment each, each glob sorted, the globs "
                    "in order (default: the Vim user manual, natural English prose used "
                    "nowhere else in this project).")
flags.DEFINE_list("context_lens", ["1024"], "Tokens per segment (BOS included).")
flags.DEFINE_list("variants", list(experiment.DEFAULT_VARIANTS), "design[+allocation]: "
                  f"allocations {list(experiment.ALLOCATIONS)}; aliases "
                  f"{list(experiment.ALIASES)}. The full cache always runs.")
flags.DEFINE_list("memories", ["0.125", "0.25", "0.5"], "Kept bytes as fractions of the full "
                  "cache's key/value bytes.")
flags.DEFINE_integer("n_eval", 16, "Evaluation segments (the first files).")
flags.DEFINE_integer("n_calib", 4, "Calibration segments (the next files), for the conformal "
                     "scales only.")
flags.DEFINE_integer("chunk", 64, "Tokens per streaming chunk (evict after each).")
flags.DEFINE_integer("group", 8, "Segments per unit (one jitted call per memory x group).")
flags.DEFINE_integer("seed", 0, "Seed of the randomized designs.")
flags.DEFINE_integer("max_units", -1, "Stop after this many units (-1: all); rerun resumes.")
flags.DEFINE_integer("skip_sources", 0, "Leave out the first this many files of --sources "
                     "(a tuning run on files the default evaluation and calibration never "
                     "read: --skip_sources=20).", lower_bound=0)
flags.DEFINE_bool("coverage", True, "Run the randomized variants with their certificate in "
                  "evaluation mode (true error beside every radius: coverage); without it "
                  "only the streaming loss is measured (the same losses, much faster).")
flags.DEFINE_bool("report_only", False, "Write the report from the rows on file; run nothing "
                  "(variants without every row are listed as not run).")


def main(argv):
  del argv
  results_io.quiet_library_logs(FLAGS)
  plan = experiment.Plan(
      sources=experiment.default_sources(FLAGS.sources)[FLAGS.skip_sources:],
      context_lens=tuple(int(c) for c in FLAGS.context_lens),
      variants=tuple(FLAGS.variants), memories=tuple(float(m) for m in FLAGS.memories),
      n_eval=FLAGS.n_eval, n_calib=FLAGS.n_calib, chunk=FLAGS.chunk, seed=FLAGS.seed,
      group=FLAGS.group, max_units=None if FLAGS.max_units < 0 else FLAGS.max_units,
      coverage=FLAGS.coverage).check()
  t0 = time.time()
  params, config, tok = model_loading.load_model(FLAGS.model)
  if FLAGS.report_only:
    rows = results_io.read_rows(os.path.join(FLAGS.out, experiment.ROWS_FILE))
  else:
    rows = experiment.run(params, config, tok, FLAGS.out, plan,
                          model=model_loading.model_name(FLAGS.model))
  summary = report.write(rows, FLAGS.out, plan, n_kv_heads=config.n_kv_heads)
  if summary is None:
    print("rows incomplete; rerun to finish (no report yet)")
  else:
    print(summary["md"])
  print(f"wall time {time.time() - t0:.0f}s")


if __name__ == "__main__":
  app.run(main)
