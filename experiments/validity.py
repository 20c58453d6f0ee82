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
from experiments.lib.validity import collect as collect_lib
from experiments.lib.validity import run as validity_run

FLAGS = flags.FLAGS
_P = collect_lib.Plan()
QUICK = dict(designs=("poisson_tail", "poisson_defensive"), data=("text", "passkey"),
             context_lens=(256,), num_examples=3, n_steps=4)

flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                    "safetensors directory with tokenizer.json.")
flags.DEFINE_list("designs", list(_P.designs), "Randomized designs.")
flags.DEFINE_list("regimes", list(_P.regimes), "Regimes.")
flags.DEFINE_list("budgets", [str(b) for b in _P.budgets], "Budgets (fractions in (0, 1)).")
flags.DEFINE_list("data", list(_P.data), "Data sources: 'text' and/or task names.")
flags.DEFINE_list("context_lens", [str(c) for c in _P.context_lens], "Context lengths.")
flags.DEFINE_integer("num_examples", _P.num_examples, "Examples per data source.")
flags.DEFINE_list("examples_at", [], "Fewer examples at some contexts: CONTEXT:N entries.")
flags.DEFINE_list("designs_at", [], "A subset of designs at some contexts: CONTEXT:D1+D2.")
flags.DEFINE_list("data_at", [], "A subset of data sources at some contexts: CONTEXT:S1+S2.")
flags.DEFINE_list("groups_at", [], "Further units padded among themselves (so that adding "
                  "them keeps a finished run's units): CONTEXT:DATA1+DATA2:DESIGN1+DESIGN2.")
flags.DEFINE_integer("n_steps", _P.n_steps, "Decode steps per example.")
flags.DEFINE_integer("seed", _P.seed, "Seed of tasks and designs.")
flags.DEFINE_integer("max_batch", 0, "Rows per call (0: a unit's whole batch).")
flags.DEFINE_string("text", collect_lib.DEFAULT_TEXT, "Natural text file for 'text'.")
flags.DEFINE_string("default_design", "poisson_tail", "Design of the default certified setting.")
flags.DEFINE_integer("calib_context", 0, "Context length the calibrations are fitted at "
                     "(0: the largest planned context <= 1024).")
flags.DEFINE_integer("max_units", -1, "Stop after this many units (-1: all); rerun resumes.")
flags.DEFINE_string("transfer_calibration", None, "A calibration artifact made by another "
                    "study (e.g. experiments/results/validity/calibration), scored unchanged on "
                    "this study's calls: the shift to other contexts or texts.")
flags.DEFINE_bool("quick", False, f"The reduced plan {QUICK} (flags not given keep it).")


def _ints(name, values):
  try:
    return tuple(int(v) for v in values)
  except ValueError as err:
    raise ValueError(f"--{name} must be integers, got {values}") from err


def plan_from_flags(fv) -> collect_lib.Plan:
  """The checked :class:`Plan` of the flags (``--quick`` replaces the defaults)."""
  try:
    budgets = tuple(float(b) for b in fv.budgets)
  except ValueError as err:
    raise ValueError(f"--budgets must be numbers, got {fv.budgets}") from err
  at = []
  for entry in fv.examples_at:
    parts = entry.split(":")
    if len(parts) != 2:
      raise ValueError(f"--examples_at entries must be CONTEXT:N, got {entry!r}")
    at.append(_ints("examples_at", parts))
  subsets = {}
  for name in ("designs_at", "data_at"):
    pairs = []
    for entry in fv[name].value:
      c, sep, rest = entry.partition(":")
      if not sep or not rest:
        raise ValueError(f"--{name} entries must be CONTEXT:A+B, got {entry!r}")
      pairs.append((_ints(name, [c])[0], tuple(rest.split("+"))))
    subsets[name] = tuple(pairs)
  groups = []
  for entry in fv.groups_at:
    parts = entry.split(":")
    if len(parts) != 3 or not all(parts):
      raise ValueError(f"--groups_at entries must be CONTEXT:DATA1+DATA2:DESIGN1+DESIGN2, got "
                       f"{entry!r}")
    groups.append((_ints("groups_at", [parts[0]])[0], tuple(parts[1].split("+")),
                   tuple(parts[2].split("+"))))
  kw = dict(designs=tuple(fv.designs), regimes=tuple(fv.regimes), budgets=budgets,
            data=tuple(fv.data), context_lens=_ints("context_lens", fv.context_lens),
            num_examples=fv.num_examples, examples_at=tuple(at), **subsets, groups_at=tuple(groups),
            n_steps=fv.n_steps,
            seed=fv.seed, max_batch=fv.max_batch, model=model_loading.model_name(fv.model),
            max_units=None if fv.max_units < 0 else fv.max_units,
            default_design=fv.default_design, calib_context=fv.calib_context or None,
            transfer=fv.transfer_calibration)
  if fv.quick:
    kw.update({k: v for k, v in QUICK.items() if not fv[k].present})
  return collect_lib.Plan(**kw).check()


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every step of a save at INFO
  plan = plan_from_flags(FLAGS)
  params, config, tok = model_loading.load_model(FLAGS.model)
  with open(FLAGS.text, encoding="utf-8") as f:
    text = f.read()
  validity_run.run(params, config, tok, plan, FLAGS.out, text=text, text_source=FLAGS.text)


if __name__ == "__main__":
  app.run(main)
