"""What ``python -m experiments.calibrate`` fits: the settings of one calibration.

Each setting of :class:`Plan` is a flag of the command; :meth:`Plan.collect_plan` is
the validity study's plan of the units it runs (or reads with ``--from_units``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from certkv_jax.calibration import robust
from experiments.lib import plan_flags
from experiments.lib.validity import calls as calls_lib
from experiments.lib.validity import collect as collect_lib

_COLLECT = collect_lib.Plan()


@dataclasses.dataclass(frozen=True)
class Plan:
  """One calibration: of ``design`` on ``data`` at ``context_len``. Validated by
  :meth:`check` (errors name the flag)."""

  design: str = plan_flags.setting("poisson_tail", "The randomized design to calibrate.")
  data: tuple = plan_flags.setting(("text", "passkey", "kv_retrieval", "variable_tracking"),
                                   "Calibration data: 'text' and/or task names.")
  scheme: str = plan_flags.setting("binned", "Calibration scheme.",
                                   choices=("binned", "per_head"))
  n_bins: int = plan_flags.setting(robust.DEFAULT_BINS, "Radius bins (binned).")
  regimes: tuple = plan_flags.setting(_COLLECT.regimes, "Regimes pooled in the calibration.")
  budgets: tuple = plan_flags.setting(_COLLECT.budgets, "Budgets (fractions in (0, 1)).")
  deltas: tuple = plan_flags.setting(calls_lib.DELTAS, "Miss probabilities.")
  context_len: int = plan_flags.setting(1024, "Context length in tokens.")
  num_examples: int = plan_flags.setting(_COLLECT.num_examples, "Examples per data source.")
  n_steps: int = plan_flags.setting(_COLLECT.n_steps, "Decode steps per example.")
  seed: int = plan_flags.setting(
      1, "Seed (use another than the evaluation's). It draws the tasks' examples and the "
      "designs' samples only: natural-text prompts are the text's first segments whatever "
      "the seed, so calibrating on 'text' from the evaluation's --text fits on its prompts "
      "(pass another --text).")
  max_batch: Optional[int] = plan_flags.setting(
      None, "Rows per call (unset: a unit's whole batch).")

  def collect_plan(self, model: str = _COLLECT.model) -> collect_lib.Plan:
    """The validity plan of the units this calibration is fitted on."""
    return collect_lib.Plan(designs=(self.design,), regimes=self.regimes,
                            budgets=self.budgets, data=self.data,
                            context_lens=(self.context_len,), num_examples=self.num_examples,
                            n_steps=self.n_steps, seed=self.seed, max_batch=self.max_batch,
                            model=model, question_aware_only=())

  def check(self) -> "Plan":
    self.collect_plan().check()
    return self
