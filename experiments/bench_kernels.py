r"""Decode-attention benchmark: what do the certificate statistics cost?

Times plain attention, offset attention and the certificate's fused statistics
(and, on a GPU or TPU, the Pallas kernel) side by side for each cache length
and head dim (:mod:`experiments.lib.bench.kernels`); compare ratios, not
absolute times.

  python -m experiments.bench_kernels --out=experiments/results/bench_cpu.md
"""

from absl import app
from absl import flags

from experiments.lib.bench import kernels as bench_kernels

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["1024", "4096", "16384", "32768"], "Cache lengths.")
flags.DEFINE_list("head_dims", ["64", "128"], "Head dimensions.")
flags.DEFINE_integer("batch", 8, "Rows of (sequence, KV head).")
flags.DEFINE_integer("groups", 4, "Query heads per KV head (GQA group).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "K/V/Q dtype.")
flags.DEFINE_integer("repeats", 7, "Timed repetitions (median reported).")
flags.DEFINE_string("profile_dir", None, "If set, write a jax.profiler trace there.")
flags.DEFINE_string("out", None, "Markdown table path (JSON rows beside it).")
flags.DEFINE_bool("pallas", None, "Include the Pallas kernel (default: on GPU/TPU only).")


def main(argv):
  del argv
  plan = bench_kernels.Plan(lengths=tuple(FLAGS.lengths), head_dims=tuple(FLAGS.head_dims),
                            batch=FLAGS.batch, groups=FLAGS.groups, dtype=FLAGS.dtype,
                            repeats=FLAGS.repeats, pallas=FLAGS.pallas)
  bench_kernels.run_and_report(plan, out=FLAGS.out, profile_dir=FLAGS.profile_dir)


if __name__ == "__main__":
  app.run(main)
