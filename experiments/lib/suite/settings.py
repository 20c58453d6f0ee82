"""What the experiment suite runs (method, section 8): :class:`Settings`, the names it
accepts and the command-line flags that set them.

:func:`define_common_flags` defines the flags the suite's scripts share
(``coverage``, ``assumption2``, ``failure``, ``regimes``) and
:func:`settings_from_flags` turns their parsed values into checked
:class:`Settings`; the rows themselves are collected by
:func:`experiments.lib.suite.rows.collect`.
"""

from __future__ import annotations

import dataclasses

from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import tasks as tasks_lib

REGIMES = ("question_aware", "streaming")
DELTAS = (0.01, 0.05, 0.1, 0.2)
PRIMARY_DELTA = 0.05


@dataclasses.dataclass(frozen=True)
class Settings:
  """What :func:`experiments.lib.suite.rows.collect` runs. Validated by :meth:`check`."""

  tasks: tuple = ("passkey",)
  regimes: tuple = REGIMES
  designs: tuple = ("full", "snapkv", "poisson_tail")
  budgets: tuple = (0.125, 0.25, 0.5)
  context_len: int = 256
  num_examples: int = 8
  seed: int = 0
  n_runs: int = 2  # independent runs of the designs in ``multi_run_designs``
  multi_run_designs: tuple = ("poisson_tail",)
  # Designs run in the question-aware regime only: pi proportional to the
  # current attention needs the question at eviction time (method, section 6).
  question_aware_only: tuple = ("attention_proportional",)
  n_steps: int = 8
  n_sink: int = design_defaults.N_SINK
  window: int = design_defaults.WINDOW
  chunk: int = 64
  deltas: tuple = DELTAS
  n_sample_calls: int = 24  # raw calls kept per row for scatter plots / regression
  subsample_fraction: float = 0.25  # (layer, head) calls in the subsampled certificate
  model: str = model_loading.DEFAULT_MODEL
  # At most this many batch rows per call (0: a unit's whole batch in one call). Every
  # call of a unit is padded to the same shape (one compile); bounds the memory of
  # large plans (the shadow full cache is batch x layers x KV heads x context).
  max_batch: int = 0

  def check(self) -> "Settings":
    for t in self.tasks:
      if t not in tasks_lib.TASKS:
        raise ValueError(f"--task: unknown task {t!r}; choose from {list(tasks_lib.TASKS)}")
    for r in self.regimes:
      if r not in REGIMES:
        raise ValueError(f"--regimes: unknown regime {r!r}; choose from {list(REGIMES)}")
    known = design_defaults.names()
    for d in self.designs:
      if d not in known:
        raise ValueError(f"--designs: unknown design {d!r}; choose from {list(known)}")
    for b in self.budgets:
      if not 0.0 < float(b) <= 1.0:
        raise ValueError(f"--budgets entries must be fractions in (0, 1], got {b}")
    for d in self.deltas:
      if not 0.0 < float(d) < 1.0:
        raise ValueError(f"--deltas entries must be in (0, 1), got {d}")
    if PRIMARY_DELTA not in self.deltas:
      raise ValueError(f"--deltas must include {PRIMARY_DELTA} (the primary delta)")
    for name, v, lo in (("context_len", self.context_len, tasks_lib.MIN_CONTEXT_LEN),
                        ("num_examples", self.num_examples, 1), ("n_runs", self.n_runs, 1),
                        ("n_steps", self.n_steps, 1), ("chunk", self.chunk, 1),
                        ("n_sink", self.n_sink, 0), ("window", self.window, 0),
                        ("max_batch", self.max_batch, 0)):
      if not isinstance(v, int) or v < lo:
        raise ValueError(f"--{name} must be an int >= {lo}, got {v!r}")
    if not 0.0 < self.subsample_fraction <= 1.0:
      raise ValueError(f"subsample_fraction must be in (0, 1], got {self.subsample_fraction}")
    return self


def define_common_flags(flags_module, **defaults):
  """Defines the suite's common flags (call only under ``__main__``).

  ``defaults`` overrides a flag's default, e.g. ``designs=["full", "h2o"]``.
  """
  f = flags_module
  d = dict(model=model_loading.DEFAULT_MODEL, task=["passkey"], context_len=256,
           budgets=["0.125", "0.25", "0.5"], designs=["full", "snapkv", "poisson_tail"],
           regimes=list(REGIMES), num_examples=8, seed=0, n_runs=2, n_steps=8,
           deltas=[str(x) for x in DELTAS], max_units=-1)
  d.update(defaults)
  f.DEFINE_string("out", None, "Output directory (rows.jsonl, summary.md, plots).",
                  required=True)
  f.DEFINE_string("model", d["model"], "'smollm2' (SmolLM2-135M-Instruct from its GGUF "
                  "package) or a Hugging Face safetensors directory (Llama/Mistral/Qwen2) "
                  "holding tokenizer.json.")
  f.DEFINE_list("task", d["task"], f"Tasks, from {', '.join(tasks_lib.TASKS)}.")
  f.DEFINE_integer("context_len", d["context_len"], "Context length in tokens (minimum).")
  f.DEFINE_list("budgets", d["budgets"], "Budgets: fractions in (0, 1] of the tokens seen.")
  f.DEFINE_list("designs", d["designs"], f"Designs, from {', '.join(design_defaults.names())} "
                "('full' = no eviction, the reference).")
  f.DEFINE_list("regimes", d["regimes"], f"Regimes, from {', '.join(REGIMES)}.")
  f.DEFINE_integer("num_examples", d["num_examples"], "Examples per task.")
  f.DEFINE_integer("seed", d["seed"], "Seed of the tasks and of the randomized designs.")
  f.DEFINE_integer("n_runs", d["n_runs"], "Independent runs of poisson_tail (two-run "
                   "disagreement needs 2).")
  f.DEFINE_integer("n_steps", d["n_steps"], "Decode steps per example.")
  f.DEFINE_list("deltas", d["deltas"], "Certificate miss probabilities.")
  f.DEFINE_integer("max_units", d["max_units"], "Stop after this many units (batched calls) "
                   "this run (-1: all); a rerun resumes.")


def settings_from_flags(flags_values, **overrides) -> Settings:
  """A checked :class:`Settings` from the common flags."""
  try:
    budgets = tuple(float(b) for b in flags_values.budgets)
  except ValueError as err:
    raise ValueError(f"--budgets must be numbers, got {flags_values.budgets}") from err
  try:
    deltas = tuple(float(x) for x in flags_values.deltas)
  except ValueError as err:
    raise ValueError(f"--deltas must be numbers, got {flags_values.deltas}") from err
  kw = dict(tasks=tuple(flags_values.task), regimes=tuple(flags_values.regimes),
            designs=tuple(flags_values.designs), budgets=budgets,
            context_len=flags_values.context_len, num_examples=flags_values.num_examples,
            seed=flags_values.seed, n_runs=flags_values.n_runs, n_steps=flags_values.n_steps,
            deltas=deltas, model=model_loading.model_name(flags_values.model))
  kw.update(overrides)
  return Settings(**kw).check()
