r"""The validity study: where the certificate covers, raw and calibrated (method, section 10).

Runs evaluation-mode generation (shadow full cache: the true error of every
decode call) for randomized designs on natural text and on retrieval tasks,
fits split-conformal calibrations on text and tests them on the tasks (and
the reverse), scores the online warning signals, and writes
``--out/report.md``, ``summary.json``, ``coverage.png`` and the default
calibration artifact ``--out/calibration`` (orbax). Unit files are written as
they finish (``--out/units``); a rerun resumes.

  python -m experiments.validity --out=/tmp/validity              # the full study
  python -m experiments.validity --out=/tmp/validity --quick      # a small version

``--transfer_calibration=DIR`` also scores a calibration artifact fitted by another
study (say, at 1k tokens) on this study's calls, unchanged.
"""

from absl import app
from absl import flags
from absl import logging

from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.validity import collect as collect_lib
from experiments.lib.validity import run as validity_run

FLAGS = flags.FLAGS
QUICK = dict(designs=("poisson_tail", "poisson_defensive"), data=("text", "passkey"),
             context_lens=(256,), num_examples=3, n_steps=4)


def define_flags(flag_values=FLAGS):
  """The script's flags: output, model and input files, ``--quick``, then one per setting
  of :class:`experiments.lib.validity.collect.Plan`."""
  fv = dict(flag_values=flag_values)
  flags.DEFINE_string("out", None, "Output directory.", required=True, **fv)
  flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                      "safetensors directory with tokenizer.json.", **fv)
  flags.DEFINE_string("text", collect_lib.DEFAULT_TEXT, "Natural text file for 'text'.", **fv)
  flags.DEFINE_string("transfer_calibration", None, "A calibration artifact made by another "
                      "study (e.g. experiments/results/validity/calibration), scored unchanged "
                      "on this study's calls: the shift to other contexts or texts.", **fv)
  flags.DEFINE_bool("quick", False, f"The reduced plan {QUICK} (flags not given keep it).",
                    **fv)
  plan_flags.define_flags(collect_lib.Plan, flag_values)


def plan_from_flags(fv) -> collect_lib.Plan:
  """The checked :class:`Plan` of the flags (``--quick`` replaces the defaults)."""
  quick = {k: v for k, v in QUICK.items() if not fv[k].present} if fv.quick else {}
  return plan_flags.plan_from_flags(collect_lib.Plan, fv, **quick,
                                    model=model_loading.model_name(fv.model),
                                    transfer=fv.transfer_calibration)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every step of a save at INFO
  plan = plan_from_flags(FLAGS)
  params, config, tok = model_loading.load_model(FLAGS.model)
  with open(FLAGS.text, encoding="utf-8") as f:
    text = f.read()
  validity_run.run(params, config, tok, plan, FLAGS.out, text=text, text_source=FLAGS.text)


if __name__ == "__main__":
  define_flags()
  app.run(main)
