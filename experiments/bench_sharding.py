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

from experiments.lib.bench import sharding as bench_sharding
from models.config import LlamaConfig

FLAGS = flags.FLAGS
flags.DEFINE_integer("fake_devices", 0, "Fake CPU devices (0: the real devices).", lower_bound=0)
flags.DEFINE_list("meshes", ["1x1x1", "8x1x1", "2x4x1", "1x2x4", "1x1x8"],
                  "Mesh shapes data x model x seq.")
flags.DEFINE_integer("n_layers", 4, "Decoder layers.", lower_bound=1)
flags.DEFINE_integer("hidden", 256, "Residual width.", lower_bound=1)
flags.DEFINE_integer("n_heads", 8, "Query heads.", lower_bound=1)
flags.DEFINE_integer("n_kv_heads", 8, "KV heads.", lower_bound=1)
flags.DEFINE_integer("head_dim", 32, "Head dimension.", lower_bound=2)
flags.DEFINE_integer("ffn_dim", 512, "MLP width.", lower_bound=1)
flags.DEFINE_integer("vocab", 512, "Vocabulary size.", lower_bound=2)
flags.DEFINE_integer("batch", 8, "Prompts.", lower_bound=1)
flags.DEFINE_integer("prompt_len", 192, "Prompt tokens.", lower_bound=1)
flags.DEFINE_integer("capacity", 256, "Cache slots per (layer, row, KV head).", lower_bound=1)
flags.DEFINE_integer("n_steps", 8, "Decode steps.", lower_bound=1)
flags.DEFINE_string("design", "poisson_tail", "Design name (certkv_jax.designs.registry).")
flags.DEFINE_float("budget", 0.5, "Budget fraction.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("repeats", 3, "Timed repetitions (median).", lower_bound=1)
flags.DEFINE_string("out", None, "Markdown summary path (JSONL rows beside it, resumable).")


def main(argv):
  del argv
  config = LlamaConfig(vocab_size=FLAGS.vocab, hidden=FLAGS.hidden, n_layers=FLAGS.n_layers,
                       n_heads=FLAGS.n_heads, n_kv_heads=FLAGS.n_kv_heads,
                       head_dim=FLAGS.head_dim, ffn_dim=FLAGS.ffn_dim)
  plan = bench_sharding.Plan(meshes=tuple(FLAGS.meshes), batch=FLAGS.batch,
                             prompt_len=FLAGS.prompt_len, capacity=FLAGS.capacity,
                             n_steps=FLAGS.n_steps, design=FLAGS.design, budget=FLAGS.budget,
                             repeats=FLAGS.repeats, fake_devices=FLAGS.fake_devices)
  bench_sharding.run_and_report(plan, config, out=FLAGS.out)


if __name__ == "__main__":
  app.run(main)
