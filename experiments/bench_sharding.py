r"""Sharded decoding benchmark: per-device memory and step time for (data, model, seq) meshes.

Runs ``models.sharding.generate`` on a random Llama-family model for each mesh
shape and reports per-device cache and parameter bytes, XLA's per-device
memory, the wall time and the agreement with one device
(:mod:`experiments.lib.bench.sharding`). On fake CPU devices
(``--fake_devices=N``) only the memory accounting and the agreement mean
anything.

  python -m experiments.bench_sharding --fake_devices=8 \
      --out=experiments/results/bench_sharding_cpu.md
"""

import os
import sys


def _early_fake_devices(argv) -> None:
  """XLA reads the device count when jax starts, before absl parses flags."""
  for arg in argv:
    if arg.startswith("--fake_devices="):
      n = int(arg.split("=", 1)[1])
      if n > 0:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
  _early_fake_devices(sys.argv[1:])

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

from experiments.lib import plan_flags
from experiments.lib.bench import sharding as bench_sharding

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Markdown summary path (JSONL rows beside it, resumable).")
plan_flags.define_flags(bench_sharding.Plan)
plan_flags.define_flags(bench_sharding.Model)


def main(argv):
  del argv
  plan = plan_flags.plan_from_flags(bench_sharding.Plan)
  config = plan_flags.plan_from_flags(bench_sharding.Model).config()
  bench_sharding.run_and_report(plan, config, out=FLAGS.out)


if __name__ == "__main__":
  app.run(main)
