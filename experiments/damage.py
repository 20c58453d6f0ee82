r"""From attention radius to output damage: attribution, gating and per-token damage.

  python -m experiments.damage --out=/tmp/damage                # the full plan (~1 h CPU)
  python -m experiments.damage --out=/tmp/damage --quick        # a small version
  python -m experiments.damage --out=/tmp/damage --stage=train  # (re)fit the predictor only

Collects resumable units (``experiments.lib.damage.collect``: text segments
streamed through the full and the evicted model, and task settings generated
with the full cache and twice with the design), fits the learned damage
predictor (``certkv_jax.calibration.damage_predictor``) on the training text segments and
saves it with orbax under ``OUT/predictor``, then writes ``OUT/summary.json``,
``OUT/report.md`` and plots (``experiments.lib.damage.report``). Stages:
``collect``, ``train`` (fit and save the predictor from collected units),
``report`` (analysis with the saved predictor), ``all``.
"""


from absl import app
from absl import flags
from absl import logging

from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.damage import collect as collect_lib
from experiments.lib.damage import report as damage_report
from experiments.lib.validity import collect as validity_collect

QUICK = collect_lib.QUICK
STAGES = ("all", "collect", "train", "report")

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                    "checkpoint directory.")
plan_flags.define_flags(collect_lib.Plan)
flags.DEFINE_string("text", validity_collect.DEFAULT_TEXT, "Natural text file.")
flags.DEFINE_enum("stage", "all", STAGES, "What to run.")
flags.DEFINE_integer("max_units", -1, "Stop after this many units (-1: all); rerun resumes.")
flags.DEFINE_bool("quick", False, f"The reduced plan {QUICK} (flags not given keep it).")


def plan_from_flags(fv) -> collect_lib.Plan:
  """The checked :class:`Plan` of the flags (``--quick`` replaces the defaults)."""
  quick = {k: v for k, v in QUICK.items() if not fv[k].present} if fv.quick else {}
  return plan_flags.plan_from_flags(collect_lib.Plan, fv,
                                    model=model_loading.model_name(fv.model), **quick)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every step of a save at INFO
  plan = plan_from_flags(FLAGS)
  if FLAGS.stage in ("all", "collect"):
    params, config, tok = model_loading.load_model(FLAGS.model)
    with open(FLAGS.text, encoding="utf-8") as f:
      text = f.read()
    collect_lib.collect(params, config, tok, plan, FLAGS.out, text=text,
                        max_units=None if FLAGS.max_units < 0 else FLAGS.max_units,
                        log=lambda s: print(s, flush=True))
  if FLAGS.stage in ("all", "train", "report"):
    damage_report.analyse(FLAGS.out, plan, train=FLAGS.stage != "report",
                          log=lambda s: print(s, flush=True))


if __name__ == "__main__":
  app.run(main)
