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
from experiments.lib import plan_flags
from experiments.lib import results_io
from models.text import generate
from models.text import report as generate_report

FLAGS = flags.FLAGS


def define_flags():
  """The command-line flags (the prompt, model, trace and dtype, then one per field of
  ``models.text.generate.TextSettings``, chat on by default); defined only when run as a
  script, so that importing this module (tests, other scripts) defines no flags."""
  flags.DEFINE_string("prompt", None, "The prompt text (or --prompt_file).")
  flags.DEFINE_string("prompt_file", None, "A UTF-8 file holding the prompt (or --prompt).")
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL,
                      "'smollm2' or a Hugging Face safetensors directory with tokenizer.json.")
  flags.DEFINE_string("profile_dir", None, "Write a jax.profiler trace of one generate call "
                      "(after a warm-up call) to this directory.")
  model_loading.define_dtype_flag()
  plan_flags.define_flags(generate.TextSettings, defaults={"chat": True})


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; pass the text with --prompt")
  results_io.quiet_library_logs(FLAGS)
  settings = plan_flags.plan_from_flags(generate.TextSettings, FLAGS)
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
