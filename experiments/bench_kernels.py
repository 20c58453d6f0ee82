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

from experiments.lib import plan_flags
from experiments.lib.bench import kernels as bench_kernels

FLAGS = flags.FLAGS
plan_flags.define_flags(bench_kernels.Plan)
flags.DEFINE_string("profile_dir", None, "If set, write a jax.profiler trace there.")
flags.DEFINE_string("out", None, "Markdown table path (JSON rows beside it).")


def main(argv):
  del argv
  plan = plan_flags.plan_from_flags(bench_kernels.Plan)
  bench_kernels.run_and_report(plan, out=FLAGS.out, profile_dir=FLAGS.profile_dir)


if __name__ == "__main__":
  app.run(main)
