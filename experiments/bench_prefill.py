r"""Prefill benchmark: peak memory and time of the chunked prefill against the one-shot one.

Every (context, mode) is measured in a fresh child process, so that its peak
resident memory is its own (:mod:`experiments.lib.bench.prefill`). Writes
``--out/results.json`` (rows as they finish; a rerun skips them),
``summary.json`` (``peak_rss_mib[mode][context]``, ``tokens_per_s[mode][context]``)
and ``report.md``.

  python -m experiments.bench_prefill --out=/tmp/bench_prefill
  python -m experiments.bench_prefill --out=/tmp/bp --contexts=1024,8192 --chunks=256,512
"""

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib.bench import prefill as bench_prefill

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                    "safetensors directory with tokenizer.json.")
plan_flags.define_flags(bench_prefill.Plan)
flags.DEFINE_string("_child", None, "Internal: measure this JSON spec in this process and "
                    "print the row.")


def main(argv):
  del argv
  results_io.quiet_library_logs(FLAGS)
  if FLAGS._child:  # pylint: disable=protected-access
    bench_prefill.child_main(FLAGS._child)  # pylint: disable=protected-access
    return
  if not FLAGS.out:
    raise app.UsageError("--out is required")
  bench_prefill.run(bench_prefill.plan_from_flags(FLAGS), FLAGS.out, model=FLAGS.model)


if __name__ == "__main__":
  app.run(main)
