"""The leaderboard's rows on file: where a unit's per-call scores go, what every row
records of the run's settings, and the check a resume and a report make against them."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from experiments.lib import design_defaults
from experiments.lib import results_io
from experiments.lib import ruler

if TYPE_CHECKING:
  from experiments.lib.leaderboard.experiment import Plan


def calls_path(out_dir: str, unit, seed: int) -> str:
  c, task, regime, start, design = unit
  return os.path.join(out_dir, "calls", f"{c}_{task}_{regime}_{start}_{design}_seed{seed}.npz")


def haystack_sha256(plan: Plan) -> str:
  return hashlib.sha256(plan.haystack_text().encode("utf-8")).hexdigest()


# What rows written before a setting was recorded were made with (no committed run
# changed these); coverage and the haystack differ between committed runs: not here.
OLDER_ROWS = {"dtype": "float32", "equal_memory": False, "n_sink": design_defaults.N_SINK,
              "window": design_defaults.WINDOW, "use_chat": True}


def row_settings(plan: Plan, model: str) -> dict:
  """``{flag: (row field, value[, value of older rows without the field])}``: what every
  row records of the run's settings besides its key; a resume must match them
  (``results_io.check_settings``)."""
  older = lambda field, value: (field, value, OLDER_ROWS[field])
  return dict(model=("model", model), dtype=older("dtype", plan.dtype),
              chunk=("chunk", plan.chunk),
              equal_memory=older("equal_memory", plan.equal_memory),
              n_sink=older("n_sink", plan.n_sink), window=older("window", plan.window),
              use_chat=older("use_chat", plan.use_chat),
              coverage=("with_coverage", plan.coverage),
              haystack=("haystack_sha256", haystack_sha256(plan)))


def check_rows(results: results_io.JsonlResults, plan: Plan, model: str) -> None:
  """Refuses rows on file made with other settings than ``plan``'s (:func:`row_settings`
  and the answer length), on a resume and before a report."""
  results_io.check_settings(results, row_settings(plan, model))
  for r in results.rows:
    want = plan.max_new_tokens or ruler.tokens_to_generate(r["task"])
    if r.get("max_new_tokens", want) != want:
      raise ValueError(f"--max_new_tokens={plan.max_new_tokens} in this run, but "
                       f"{results.path} holds {r['task']} rows made with max_new_tokens="
                       f"{r['max_new_tokens']}: rerun with the same settings or write to "
                       "another --out")
