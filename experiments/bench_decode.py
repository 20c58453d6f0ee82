r"""Decode benchmark: ms per decode step of the full cache and of each design.

Times, side by side in one run (configurations interleaved round-robin), one
jitted decode step (``forward_chunk`` of one token + ``evict`` with the traced
budget) of the full cache and of each design at each budget, with and without
the certificate, evicting after every step or every ``--evict_every`` steps,
with each ``--layer_loop``, for each context and batch size, beside this
machine's streaming-read bandwidth (each step's floor); and the model's cached
prefill against its plain one-shot forward (:mod:`experiments.lib.bench.decode`).
Writes ``--out/results.json`` (every measurement), ``summary.json``
(``ratio_vs_full[budget][context]``, ``floor_multiple[design][budget][context]``,
``bandwidth_gbps``, ``layer_loop_ratio``), ``report.md`` and ``decode_ms.png``.

  python -m experiments.bench_decode --out=/tmp/bench_decode
  python -m experiments.bench_decode --out=/tmp/bench_decode --quick   # a small plan
  python -m experiments.bench_decode --out=/tmp/bd --contexts=2048 --batches=1 \
      --layer_loop=scan,unrolled --noplain_prefill
  python -m experiments.bench_decode --out=/tmp/bd --dtype=bfloat16   # weights and caches
"""

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.bench import decode as bench_decode

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                    "safetensors directory with tokenizer.json.")
plan_flags.define_flags(bench_decode.Plan)
flags.DEFINE_bool("quick", False, f"The reduced plan {bench_decode.QUICK} (flags not given "
                  "keep it).")


def main(argv):
  del argv
  bench_decode.run_and_report(plan=bench_decode.plan_from_flags(FLAGS), model=FLAGS.model,
                              out=FLAGS.out)


if __name__ == "__main__":
  app.run(main)
