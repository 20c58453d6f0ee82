r"""From attention radius to output damage: attribution, gating and per-token damage.

  python -m experiments.damage --out=/tmp/damage                # the full plan (~1 h CPU)
  python -m experiments.damage --out=/tmp/damage --quick        # a small version
  python -m experiments.damage --out=/tmp/damage --stage=train  # (re)fit the predictor only

Collects resumable units (``experiments.lib.damage.collect``: text segments
streamed through the full and the evicted model, and task settings generated
with the full cache and twice with the design), fits the learned damage
predictor (``certkv_jax.damage_predictor``) on the training text segments and
saves it with orbax under ``OUT/predictor``, then writes ``OUT/summary.json``,
``OUT/report.md`` and plots (``experiments.lib.damage.report``). Stages:
``collect``, ``train`` (fit and save the predictor from collected units),
``report`` (analysis with the saved predictor), ``all``.
"""


from absl import app
from absl import flags
from absl import logging

from experiments.lib import model_loading
from experiments.lib.damage import collect as collect_lib
from experiments.lib.damage import report as damage_report
from experiments.lib.validity import collect as validity_collect

_P = collect_lib.Plan()
QUICK = collect_lib.QUICK
STAGES = ("all", "collect", "train", "report")

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                    "checkpoint directory.")
flags.DEFINE_string("design", _P.design, "Randomized design (certkv_jax.registry).")
flags.DEFINE_float("budget", _P.budget, "Budget: fraction in (0, 1) of the tokens seen.")
flags.DEFINE_integer("context_len", _P.context_len, "Context length in tokens.")
flags.DEFINE_integer("chunk", _P.chunk, "Streaming chunk (tokens per eviction).")
flags.DEFINE_integer("n_steps", _P.n_steps, "Decode steps per task example.")
flags.DEFINE_integer("text_segments", _P.text_segments, "Text segments (built-in text).")
flags.DEFINE_integer("train_segments", _P.train_segments, "Segments the predictor is fitted "
                     "on (the first ones); the rest are held out.")
flags.DEFINE_list("settings", list(_P.settings), "Task settings: "
                  f"{sorted(collect_lib.TASK_SETTINGS)}.")
flags.DEFINE_integer("num_examples", _P.num_examples, "Examples per task setting.")
flags.DEFINE_integer("max_batch", _P.max_batch, "Rows per generation call.")
flags.DEFINE_integer("seed", _P.seed, "Seed of tasks and designs.")
flags.DEFINE_string("text", validity_collect.DEFAULT_TEXT, "Natural text file.")
flags.DEFINE_enum("stage", "all", STAGES, "What to run.")
flags.DEFINE_integer("max_units", -1, "Stop after this many units (-1: all); rerun resumes.")
flags.DEFINE_bool("quick", False, f"The reduced plan {QUICK} (flags not given keep it).")


def plan_from_flags(fv) -> collect_lib.Plan:
  """The checked :class:`Plan` of the flags (``--quick`` replaces the defaults)."""
  names = ("design", "budget", "context_len", "chunk", "n_steps", "text_segments",
           "train_segments", "settings", "num_examples", "max_batch", "seed")
  kw = {k: fv[k].value for k in names}
  if fv.quick:
    kw.update({k: v for k, v in QUICK.items() if not fv[k].present})
  kw["settings"] = tuple(kw["settings"])
  return collect_lib.Plan(model=model_loading.model_name(fv.model), **kw).check()


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
