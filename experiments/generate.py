r"""Generate from your own text, with the certificate of every decode step.

Greedy generation on the default model (SmolLM2-135M-Instruct) or a Hugging
Face checkpoint directory, with an eviction design in either regime; prints
the answer (cut at the end-of-turn token) and, per decode step, the median and
max over (layer, head) of the certificate radius (method, section 5), the
calibrated radius where the shipped calibration fits (method, section 10),
and with ``--evaluate`` the true error (:mod:`models.text.generate`,
:mod:`models.text.report`).

  python -m experiments.generate --prompt_file=experiments/data/example_prompt.txt
  python -m experiments.generate --prompt="What is the capital of France?" --budget=0.75
  python -m experiments.generate --prompt_file=doc.txt --regime=streaming --evaluate
  python -m experiments.generate --prompt_file=doc.txt --profile_dir=/tmp/trace
  python -m experiments.generate --prompt_file=doc.txt --dtype=bfloat16   # a GPU's choice

A sampled tail needs room beyond the certainty set (4 sinks + 16 recent
tokens): a one-line question at budget 0.25 keeps only that set and gets no
certificate, and the command says which budget would give one. Library
logging is quiet unless ``--verbosity`` (``-v``) is given.
"""

import sys

from absl import app
from absl import flags

from experiments.lib import model_loading
from experiments.lib import results_io
from models.text import generate
from models.text import report as generate_report

FLAGS = flags.FLAGS


def define_flags():
  """The command-line flags; defined only when run as a script, so that
  importing this module (tests, other scripts) defines no flags."""
  flags.DEFINE_string("prompt", None, "The prompt text (or --prompt_file).")
  flags.DEFINE_string("prompt_file", None, "A UTF-8 file holding the prompt (or --prompt).")
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL,
                      "'smollm2' or a Hugging Face safetensors directory with tokenizer.json.")
  flags.DEFINE_string("design", "poisson_tail",
                      f"Eviction design: {', '.join(generate.design_names())} ('full': none); "
                      "a name may carry settings and a per-head allocation, "
                      "design[:setting=value...][+allocation[:setting=value...]] "
                      "(certkv_jax.designs.registry.parse), e.g. "
                      "priority_focus:diffuse_weight=0.3:focus_share=0.95+cert:min_share=0.95.")
  flags.DEFINE_float("budget", 0.25, "Fraction in (0, 1] of the tokens seen that is kept.")
  flags.DEFINE_integer("max_new_tokens", 64, "Decode steps; the answer stops at end-of-turn.")
  flags.DEFINE_enum("regime", "question_aware", list(generate.REGIMES),
                    "question_aware: prefill the prompt, evict once, decode. streaming: the "
                    "prompt's last line (or --question_tokens) is the question, the rest the "
                    "context, fed in --chunk-token chunks and evicted before the question.")
  flags.DEFINE_float("delta", 0.05, "Certificate miss probability, in (0, 1).")
  flags.DEFINE_integer("seed", 0, "Seed of the randomized designs.")
  flags.DEFINE_bool("chat", True, "Wrap the prompt in the model's chat template (if it has "
                    "one); --nochat feeds the text as it is.")
  flags.DEFINE_integer("question_tokens", 0, "Streaming: the question is the prompt's last "
                       "this many tokens (0: its last line).")
  flags.DEFINE_integer("chunk", generate.CHUNK, "Streaming: context tokens per chunk.")
  flags.DEFINE_integer("n_sink", generate.N_SINK, "Sink tokens kept by every design.")
  flags.DEFINE_integer("window", generate.WINDOW, "Recent / observation window of the designs.")
  flags.DEFINE_string("profile_dir", None, "Write a jax.profiler trace of one generate call "
                      "(after a warm-up call) to this directory.")
  flags.DEFINE_bool("evaluate", False, "Evaluation mode: a shadow full cache gives the true "
                    "error of every call next to its radius.")
  model_loading.define_dtype_flag()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; pass the text with --prompt")
  results_io.quiet_library_logs(FLAGS)
  settings = generate.TextSettings(
      design=FLAGS.design, budget=FLAGS.budget, max_new_tokens=FLAGS.max_new_tokens,
      regime=FLAGS.regime, delta=FLAGS.delta, seed=FLAGS.seed, evaluate=FLAGS.evaluate,
      chat=FLAGS.chat, question_tokens=FLAGS.question_tokens, chunk=FLAGS.chunk,
      n_sink=FLAGS.n_sink, window=FLAGS.window)
  try:  # argument errors before the model is loaded
    prompt = generate_report.read_prompt(FLAGS.prompt, FLAGS.prompt_file)
    generate.check_arguments(prompt, settings)
  except ValueError as err:  # the message names the flag and its allowed values
    sys.exit(f"experiments.generate: {err}")
  try:  # prompt too long for the model: found from the tokenizer, before the weights load
    generate_report.run_and_print(prompt, settings,
                                  lambda: model_loading.ModelSource(FLAGS.model, FLAGS.dtype),
                                  name=model_loading.model_name(FLAGS.model),
                                  profile_dir=FLAGS.profile_dir)
  except ValueError as err:
    sys.exit(f"experiments.generate: {err}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
