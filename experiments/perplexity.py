r"""Streaming language-model loss under eviction on long natural text.

Cuts ``--text`` into ``--num_examples`` segments of ``--context_len`` tokens,
streams each through the model ``--chunk`` tokens at a time, evicting after
every chunk, and scores every next token (the core:
:mod:`experiments.lib.streaming_loss.core`; the rows:
:mod:`experiments.lib.streaming_loss.experiment`; the table:
:mod:`experiments.lib.streaming_loss.report`). Writes
``--out/perplexity_rows.jsonl`` (resumable), ``perplexity.md`` and
``perplexity.json``.

  python -m experiments.perplexity --text=/usr/share/common-licenses/GPL-3 \
      --out=/tmp/ppl --num_examples=2 --context_len=256 --chunk=32 \
      --budgets=0.25,0.5 --designs=full,snapkv,poisson_tail
"""

from absl import app
from absl import flags

from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib.streaming_loss import experiment as streaming_loss_experiment

FLAGS = flags.FLAGS


def define_flags(flag_values=FLAGS):
  """The script's flags (named and defaulted as
  ``experiments.lib.suite.settings.define_common_flags`` and ``Settings`` where they mean
  the same thing)."""
  fv = dict(flag_values=flag_values)
  flags.DEFINE_string("out", None, "Output directory (perplexity_rows.jsonl, perplexity.md).",
                      required=True, **fv)
  flags.DEFINE_string("text", None, "UTF-8 text file to stream.", required=True, **fv)
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' (SmolLM2-135M-Instruct "
                      "from its GGUF package) or a Hugging Face safetensors directory "
                      "(Llama/Mistral/Qwen2) holding tokenizer.json.", **fv)
  flags.DEFINE_integer("context_len", 512, "Tokens per segment (BOS included).", **fv)
  flags.DEFINE_integer("chunk", 64, "Tokens per streaming chunk; the design evicts after "
                       "each chunk.", **fv)
  flags.DEFINE_list("budgets", ["0.125", "0.25", "0.5"], "Budgets: fractions in (0, 1] of "
                    "the tokens seen.", **fv)
  flags.DEFINE_list("designs", ["full", "snapkv", "poisson_tail"], f"Designs, from "
                    f"{', '.join(design_defaults.names())} ('full' = no eviction, the "
                    "reference; always run).", **fv)
  flags.DEFINE_integer("num_examples", 4, "Non-overlapping segments of the tokenized text.",
                       **fv)
  flags.DEFINE_integer("seed", 0, "Seed of the randomized designs.", **fv)
  flags.DEFINE_integer("n_runs", 2, "Independent runs of each randomized design.", **fv)
  flags.DEFINE_integer("n_sink", design_defaults.N_SINK, "Sink tokens every design keeps.",
                       **fv)
  flags.DEFINE_integer("window", design_defaults.WINDOW, "Recent tokens every design keeps "
                       "(and SnapKV's observation window).", **fv)
  flags.DEFINE_integer("max_units", -1, "Stop after this many units (batched calls) this run "
                       "(-1: all); a rerun resumes.", **fv)
  flags.DEFINE_integer("max_batch", 0, "At most this many rows per call (0: a unit's whole "
                       "batch, budgets x segments).", **fv)


def main(argv):
  del argv
  streaming_loss_experiment.run_from_flags(FLAGS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
