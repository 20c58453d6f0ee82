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
from experiments.lib.bench import decode as bench_decode

FLAGS = flags.FLAGS
_P = bench_decode.Plan()

flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                    "safetensors directory with tokenizer.json.")
flags.DEFINE_list("designs", list(_P.designs), "Designs (the full cache is always timed).")
flags.DEFINE_list("budgets", [str(b) for b in _P.budgets], "Budgets (fractions in (0, 1)).")
flags.DEFINE_list("contexts", [str(c) for c in _P.contexts], "Context lengths (prompt tokens).")
flags.DEFINE_list("batches", [str(b) for b in _P.batches], "Batch sizes.")
flags.DEFINE_list("evict_every", [str(k) for k in _P.evict_every], "Decode steps per eviction "
                  "(1: after every step; k > 1: amortized eviction into k slack slots, timed "
                  "as calls of k steps, reported per step).")
flags.DEFINE_integer("repeats", _P.repeats, "Timed calls per configuration (>= 6 for a 95% "
                     "interval).")
flags.DEFINE_enum("certificate", _P.certificate, list(bench_decode.CERTIFICATE),
                  "Time the designs with the certificate statistics, without, or both.")
flags.DEFINE_enum("capacity", _P.capacity, list(bench_decode.CAPACITY),
                  "'compact': caches hold the kept tokens (a deployment); 'full': the "
                  "generate() layout, the prompt's capacity at every budget.")
flags.DEFINE_integer("n_sink", _P.n_sink, "Sink tokens of every design.")
flags.DEFINE_integer("window", _P.window, "Recent window of every design.")
flags.DEFINE_integer("seed", _P.seed, "Seed of the prompts and the eviction draws.")
flags.DEFINE_float("max_seconds", _P.max_seconds, "Start no new cell after this many seconds "
                   "(0: no limit); the outputs then hold the finished cells.")
flags.DEFINE_list("layer_loop", list(_P.layer_loop), "Layer loops to time, interleaved: "
                  "'scan' (lax.scan over stacked weights and caches) and/or 'unrolled' "
                  "(per-layer weights and caches read in place); both: the report gives "
                  "their ratio.")
flags.DEFINE_bool("plain_prefill", _P.plain_prefill, "Also time the plain one-shot forward "
                  "beside the cached prefill (its dense softmax grows with the square of "
                  "the context: most of a 4k cell's time).")
model_loading.define_dtype_flag()
flags.DEFINE_bool("quick", False, f"The reduced plan {bench_decode.QUICK} (flags not given "
                  "keep it).")


def main(argv):
  del argv
  bench_decode.run_and_report(plan=bench_decode.plan_from_flags(FLAGS), model=FLAGS.model,
                              out=FLAGS.out)


if __name__ == "__main__":
  app.run(main)
