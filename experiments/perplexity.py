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

from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.streaming_loss import experiment as streaming_loss_experiment

FLAGS = flags.FLAGS


def define_flags(flag_values=FLAGS):
  """The script's flags: the output, text and model, then one per setting of
  :class:`experiments.lib.streaming_loss.experiment.Plan`."""
  fv = dict(flag_values=flag_values)
  flags.DEFINE_string("out", None, "Output directory (perplexity_rows.jsonl, perplexity.md).",
                      required=True, **fv)
  flags.DEFINE_string("text", None, "UTF-8 text file to stream.", required=True, **fv)
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' (SmolLM2-135M-Instruct "
                      "from its GGUF package) or a Hugging Face safetensors directory "
                      "(Llama/Mistral/Qwen2) holding tokenizer.json.", **fv)
  plan_flags.define_flags(streaming_loss_experiment.Plan, flag_values)


def main(argv):
  del argv
  streaming_loss_experiment.run_from_flags(FLAGS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
