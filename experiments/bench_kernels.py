r"""Decode-attention benchmark: achieved bandwidth, and what the certificate statistics cost.

Times plain attention, offset attention, the certificate's fused statistics and
(on a GPU or TPU, or with --pallas) the Pallas kernel, with and without its
statistics, side by side for each cache length and head dim, each call looped
inside one jitted loop so that launches are amortized, beside the device's
streaming-read bandwidth measured the same way (:mod:`experiments.lib.bench.kernels`);
compare ratios and fractions of that bandwidth, not absolute times.

  python -m experiments.bench_kernels --out=experiments/results/bench_cpu.md
  python -m experiments.bench_kernels --out=/tmp/bk.md --splits=1,2,4,8  # a GPU
"""

from absl import app
from absl import flags

from experiments.lib.bench import kernels as bench_kernels

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", None, "Cache lengths (default: 4096,32768 on a GPU/TPU; "
                  "1024,4096,16384,32768 on CPU).")
flags.DEFINE_list("head_dims", None, "Head dimensions (default 64,128).")
flags.DEFINE_integer("batch", None, "Rows of (sequence, KV head) (default: 64 on a GPU/TPU, "
                     "8 on CPU).")
flags.DEFINE_integer("groups", 4, "Query heads per KV head (GQA group).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "K/V/Q dtype.")
flags.DEFINE_integer("repeats", 7, "Timed repetitions (median reported).")
flags.DEFINE_list("splits", [], "num_splits values of the Pallas kernel to sweep, beside its "
                  "default tiling (e.g. 1,2,4,8).")
flags.DEFINE_integer("iters", 0, "Attention calls per timed loop (0: enough to read 8 GB on a "
                     "GPU/TPU, 250 MB on CPU).")
flags.DEFINE_float("probe_mb", None, "MiB of the read-bandwidth probe's buffer (default: 1024 "
                   "on a GPU/TPU, 64 on CPU).")
flags.DEFINE_float("max_seconds", 0.0, "Start no new cell after this many seconds (0: no "
                   "limit); the outputs then hold the finished cells.")
flags.DEFINE_string("profile_dir", None, "If set, write a jax.profiler trace there.")
flags.DEFINE_string("out", None, "Markdown table path (JSON rows beside it).")
flags.DEFINE_bool("pallas", None, "Include the Pallas kernel (default: on GPU/TPU only; "
                  "interpreted, slowly, on CPU).")


def main(argv):
  del argv
  tup = lambda x: None if x is None else tuple(x)
  plan = bench_kernels.Plan(lengths=tup(FLAGS.lengths), head_dims=tup(FLAGS.head_dims),
                            batch=FLAGS.batch, groups=FLAGS.groups, dtype=FLAGS.dtype,
                            repeats=FLAGS.repeats, pallas=FLAGS.pallas,
                            splits=tuple(FLAGS.splits), iters=FLAGS.iters,
                            probe_mb=FLAGS.probe_mb, max_seconds=FLAGS.max_seconds)
  bench_kernels.run_and_report(plan, out=FLAGS.out, profile_dir=FLAGS.profile_dir)


if __name__ == "__main__":
  app.run(main)
