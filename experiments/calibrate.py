r"""Makes a split-conformal calibration of the certificate (method, section 10).

Runs evaluation-mode generation of one randomized design on the calibration
data (natural text and/or tasks; the shadow full cache gives the true error of
every decode call), fits the calibration and saves it with orbax to
``--out/calibration``, with the model, design, budgets, regimes and data it
was made for; applying it to anything else is an error naming the field.

``--scheme=binned`` (default; :mod:`certkv_jax.calibration.robust`): per
regime, budget and delta, bins of the raw radius, each with the largest of the
per-source conformal scales -- give it several sources (``--data``).
``--scheme=per_head`` (:mod:`certkv_jax.calibration.store`): one scale per
(budget, delta, layer, KV head), all sources pooled. Unit files go to
``--out/units`` (a rerun resumes).

  python -m experiments.calibrate --out=/tmp/calib --design=poisson_tail \
      --data=text,passkey,kv_retrieval,variable_tracking

The artifact records the range of prompt tokens (context + question) of the
calls it was fitted on and its sources; applying it outside that range is
refused or warned about (:meth:`certkv_jax.calibration.robust.BinnedCalibration.radius`).

``--from_units`` fits from the unit files already in ``--out/units`` (e.g. a
validity study's) without loading the model or running anything: the units of
``--design``, ``--regimes``, ``--data`` at ``--context_len``. The shipped
calibration is re-made that way from the committed units::

  python -m experiments.calibrate --from_units --out=experiments/results/validity \
      --design=poisson_tail --context_len=1024 --overwrite \
      --data=agent_memory,kv_retrieval,multi_needle,passkey,text,variable_tracking
"""

import glob
import os

from absl import app
from absl import logging
import numpy as np
from absl import flags

from certkv_jax.calibration import robust
from certkv_jax.calibration import store
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.validity import calibrate as calibrate_lib
from experiments.lib.validity import calls as calls_lib
from experiments.lib.validity import collect as collect_lib

FLAGS = flags.FLAGS

flags.DEFINE_string("out", None, "Output directory (units/, calibration/).", required=True)
flags.DEFINE_string("model", model_loading.DEFAULT_MODEL, "'smollm2' or a Hugging Face "
                    "safetensors directory with tokenizer.json.")
flags.DEFINE_string("text", collect_lib.DEFAULT_TEXT, "Natural text file for 'text'.")
flags.DEFINE_bool("overwrite", False, "Replace an existing --out/calibration.")
flags.DEFINE_bool("from_units", False, "Fit from the unit files in --out/units (no model, "
                  "no collection): those of --design, --regimes, --data at --context_len.")
plan_flags.define_flags(calibrate_lib.Plan)


def _existing_units(out: str, design: str, regimes, data, context_len: int) -> list:
  """The unit files under ``out/units`` of ``design`` x ``regimes`` x ``data`` at
  ``context_len`` (sorted); every requested (regime, data source) must be there."""
  paths, found = [], set()
  for p in sorted(glob.glob(os.path.join(out, "units", "*.npz"))):
    meta = collect_lib.unit_meta(p)
    if (meta["design"] == design and meta["regime"] in regimes and meta["data"] in data
        and meta["context_len"] == context_len):
      paths.append(p)
      found.add((meta["regime"], meta["data"]))
  missing = sorted({(r, s) for r in regimes for s in data} - found)
  if missing:
    raise ValueError(f"--from_units: no unit file in {out}/units for design {design!r} at "
                     f"context {context_len} and (regime, data) {missing}")
  return paths


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every step of a save at INFO
  cal = plan_flags.plan_from_flags(calibrate_lib.Plan, FLAGS)
  plan = cal.collect_plan(model_loading.model_name(FLAGS.model))
  target = os.path.join(os.path.abspath(FLAGS.out), "calibration")
  if os.path.exists(target) and not FLAGS.overwrite:
    raise ValueError(f"--out: {target} exists; pass --overwrite to replace it")
  if FLAGS.from_units:
    paths = _existing_units(FLAGS.out, cal.design, cal.regimes, cal.data, cal.context_len)
  else:
    params, config, tok = model_loading.load_model(FLAGS.model)
    with open(FLAGS.text, encoding="utf-8") as f:
      text = f.read()
    paths = collect_lib.collect(params, config, tok, plan, FLAGS.out, text=text,
                                text_source=FLAGS.text)
  calls = calls_lib.load_calls(paths)
  kw = dict(design=cal.design, data=cal.data, context_len=cal.context_len,
            budgets=cal.budgets, deltas=cal.deltas)
  if cal.scheme == "binned":
    calib = calls_lib.fit_binned(calls, n_bins=cal.n_bins, **kw)
    robust.save(target, calib, overwrite=FLAGS.overwrite)
  else:
    calib = calls_lib.fit_fold(calls, **kw)
    store.save(target, calib, overwrite=FLAGS.overwrite)
  finite = calib.scales[np.isfinite(calib.scales)]
  where = (f"{calib.fitted_on()}" if cal.scheme == "binned"
           else f"sources {', '.join(cal.data)}")
  print(f"{cal.scheme} calibration of {cal.design} on {where} "
        f"({len(calls)} calls) saved to {target}: scales median "
        f"{float(np.median(finite)) if finite.size else float('nan'):.3f}, max "
        f"{float(calib.scales.max()):.3f}, {100 * float(np.mean(np.isinf(calib.scales))):.1f}% "
        "infinite (too few calls)")


if __name__ == "__main__":
  app.run(main)
