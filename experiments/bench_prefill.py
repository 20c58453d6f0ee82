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
from experiments.lib import results_io
from experiments.lib.bench import prefill as bench_prefill

FLAGS = flags.FLAGS
_P = bench_prefill.Plan()

flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                    "safetensors directory with tokenizer.json.")
flags.DEFINE_list("contexts", [str(c) for c in _P.contexts], "Prompt lengths (tokens).")
flags.DEFINE_list("chunks", [str(c) for c in _P.chunks], "Chunk sizes of the chunked "
                  "prefill (those shorter than a context are measured at it).")
flags.DEFINE_integer("oneshot_max", _P.oneshot_max, "Largest context also measured "
                     "one-shot (one-shot at 8k may exhaust memory).")
flags.DEFINE_integer("batch", _P.batch, "Prompts per call.")
flags.DEFINE_integer("repeats", _P.repeats, "Timed calls per configuration.")
flags.DEFINE_float("max_seconds", _P.max_seconds, "No more timed calls of a configuration "
                   "after this many seconds of them (at least one; 0: no limit).")
flags.DEFINE_integer("seed", _P.seed, "Seed of the random prompts.")
flags.DEFINE_float("child_timeout", _P.child_timeout, "Seconds a configuration's process "
                   "may run (0: no limit).")
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
