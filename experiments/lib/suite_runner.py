r"""The whole suite (``python -m experiments.run_all``): every experiment of
method, section 8, then ``report.md`` for section 7.

:func:`run_suite` collects the suite's rows once (``experiments.lib.suite.collect``:
one batched evaluation-mode call per (regime, design, run); resumable, rows in
``DIR/rows.jsonl``), runs the Theorem-1 rotation experiment
(``DIR/theorem1_rows.jsonl``) and the overhead timing
(``DIR/overhead_rows.jsonl``), and writes ``DIR/report.md``: for each claim of
method, section 7 the paper's number, ours with a 95% interval and a verdict
(``experiments.lib.stats.verdict``), followed by every experiment's tables and
PNG plots (coverage vs nominal, error vs radius, R audit, ROC, gating,
overhead). A rerun resumes: finished rows are not recomputed.

Quick suite (defaults): tasks passkey, agent_memory and variable_tracking
(SmolLM2-135M answers the first two with the full cache at this length, and
sometimes after eviction, and fails the third: without full-cache failures
attribution has no inherent failures to separate, and without evicted
successes failure prediction has no positives, so the pool is mixed; the mix
confounds failure type with task), 4 examples each (with 2, every evicted
answer of the first committed run was wrong and failure prediction had no
positives), ~160-token contexts,
20 decode steps (variable tracking's answer is ~18 tokens), budgets
12.5/25/50%, designs full / snapkv / poisson_tail (two independent runs) /
attention_proportional, both regimes for poisson_tail (snapkv and
attention_proportional question-aware only: each extra (design, regime) costs
a compile of about a minute on 2 cores); Theorem 1 and the overhead on
passkey prompts; the streaming loss under eviction
(``experiments.lib.streaming_loss``) on ``--text``, by default the built-in
natural-language text ``experiments/data/gpl-3.0.txt`` (the GNU GPL v3, 7.6k
SmolLM2 tokens, which its own terms allow to be copied verbatim): 6 segments
of 256 tokens in chunks of 32, full / snapkv / poisson_tail; and a reduced
validity study (``experiments.lib.validity``: raw vs split-conformal
calibrated coverage on held-out data, 256-token contexts). ``--full``: 24
examples per task, 512-token contexts, every design, three tasks; 12
segments of 512 tokens of the text; the validity study at 256 / 1024 / 2048
tokens.
"""

from __future__ import annotations

import json
import os
import time

from experiments.lib import damage_collect
from experiments.lib import damage_report
from experiments.lib import model_loading
from experiments.lib import overhead
from experiments.lib import results_io
from experiments.lib import streaming_loss_experiment
from experiments.lib import streaming_loss_report
from experiments.lib import suite
from experiments.lib import suite_report
from experiments.lib import suite_settings
from experiments.lib import tasks as tasks_lib
from experiments.lib import theorem1
from experiments.lib import validity
from experiments.lib import validity_collect
from experiments.lib.analyses import assumption2
from experiments.lib.analyses import coverage
from experiments.lib.analyses import failures
from experiments.lib.analyses import regimes

QUICK = dict(
    settings=dict(tasks=("passkey", "agent_memory", "variable_tracking"), num_examples=4,
                  context_len=160, budgets=(0.125, 0.25, 0.5),
                  designs=("full", "snapkv", "poisson_tail", "attention_proportional"),
                  regimes=("question_aware", "streaming"), n_runs=2, n_steps=20,
                  question_aware_only=("attention_proportional", "snapkv")),
    theorem1=dict(task="passkey", num_examples=2, designs=("snapkv", "poisson_tail"),
                  budget=0.25, n_draws=3),
    overhead=dict(task="passkey", num_examples=1, budget=0.25, n_steps=16, repeats=5),
    perplexity=dict(designs=("full", "snapkv", "poisson_tail"), budgets=(0.125, 0.25, 0.5),
                    context_len=256, chunk=32, num_examples=6, n_runs=1),
    validity=dict(designs=("poisson_tail", "poisson_defensive"), data=("text", "passkey"),
                  context_lens=(256,), num_examples=3, n_steps=4),
    damage=dict(damage_collect.QUICK),
)
FULL = dict(
    settings=dict(tasks=("passkey", "agent_memory", "multi_needle"), num_examples=24,
                  context_len=512, budgets=(0.125, 0.25, 0.5),
                  designs=("full", "sink_window", "h2o", "tova", "snapkv", "key_norm",
                           "uniform_random", "poisson_tail", "attention_proportional"),
                  regimes=("question_aware", "streaming"), n_runs=2, n_steps=10,
                  max_batch=72),
    theorem1=dict(task="passkey", num_examples=4,
                  designs=("sink_window", "h2o", "tova", "snapkv", "key_norm", "poisson_tail"),
                  budget=0.25, n_draws=8),
    overhead=dict(task="passkey", num_examples=4, budget=0.25, n_steps=32, repeats=7),
    perplexity=dict(designs=("full", "sink_window", "h2o", "tova", "snapkv", "key_norm",
                             "uniform_random", "poisson_tail", "attention_proportional"),
                    budgets=(0.125, 0.25, 0.5), context_len=512, chunk=64, num_examples=12,
                    n_runs=2),
    # The committed experiments/results/validity run (method, section 10).
    validity=dict(context_lens=(256, 1024, 2048), num_examples=4,
                  examples_at=((1024, 3), (2048, 2)),
                  designs_at=((1024, ("poisson_tail", "poisson_defensive", "poisson_envelope")),
                              (2048, ("poisson_tail",))),
                  data_at=((2048, ("text", "passkey")),),
                  groups_at=((1024, ("multi_needle", "agent_memory"), ("poisson_tail",)),
                             (2048, ("kv_retrieval", "variable_tracking", "multi_needle",
                                     "agent_memory"), ("poisson_tail",)))),
    # The committed experiments/results/damage run (method, section 11): the Plan defaults.
    damage=dict(),
)
DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                            "gpl-3.0.txt")


def run_suite(params, config, tok, out: str, plan: dict, *, model: str, command: str,
              max_units=None, examples_by_task=None, text: str = DEFAULT_TEXT,
              log=print) -> dict:
  """Runs everything in ``plan`` (``QUICK`` or ``FULL``-shaped); writes ``out/report.md``.

  ``plan["theorem1"]`` / ``plan["overhead"]`` / ``plan["perplexity"]`` /
  ``plan["validity"]`` may be None (or absent) to skip those experiments; the
  streaming loss and the validity study's text examples read ``text``.

  Returns ``{"report": text, "complete": bool, "rows": n}``; ``complete`` is
  False when ``max_units`` stopped the collection early (no report then).
  """
  t0 = time.time()
  settings = suite_settings.Settings(model=model, **plan["settings"]).check()
  rows = suite.collect(params, config, tok, settings, out, max_units=max_units, log=log,
                       examples_by_task=examples_by_task)
  if len(rows) < suite.expected_row_count(settings):
    log(f"{len(rows)} of {suite.expected_row_count(settings)} rows; rerun to finish")
    return {"report": None, "complete": False, "rows": len(rows)}
  th, th_summary, th_rows = plan.get("theorem1"), None, []
  if th:
    th_examples = (examples_by_task or {}).get(th["task"]) or tasks_lib.make_task(
        th["task"], tok, th["num_examples"], settings.context_len, settings.seed)
    th_rows = theorem1.run_theorem1(
        params, config, list(th_examples)[:th["num_examples"]], list(th["designs"]),
        th["budget"], out, model=model, task=th["task"], context_len=settings.context_len,
        seed=settings.seed, n_draws=th["n_draws"], n_steps=settings.n_steps,
        n_sink=settings.n_sink, window=settings.window, log=log)
    th_summary = theorem1.summarize(th_rows)
  ov, ov_summary, ov_rows = plan.get("overhead"), None, []
  if ov:
    ov_examples = (examples_by_task or {}).get(ov["task"]) or tasks_lib.make_task(
        ov["task"], tok, ov["num_examples"], settings.context_len, settings.seed)
    ov_rows = overhead.run_overhead(
        params, config, list(ov_examples)[:ov["num_examples"]], out, model=model,
        budget=ov["budget"], n_steps=ov["n_steps"], repeats=ov["repeats"],
        seed=settings.seed, log=log)
    ov_summary = overhead.summarize(ov_rows, out, settings.seed)
  pp, ppl_rows = plan.get("perplexity"), []
  sections = [coverage.coverage_analysis(rows, out),
              assumption2.assumption2_analysis(rows, out),
              failures.failure_analysis(rows, out),
              regimes.regimes_analysis(rows, out)]
  if pp:
    ppl_rows = streaming_loss_experiment.run_perplexity(
        params, config, tok, text, out, model=model, seed=settings.seed,
        n_sink=settings.n_sink, window=settings.window, log=log, **pp)
    sections.append(dict(streaming_loss_report.summarize(ppl_rows, out, settings.seed),
                         claims=[]))
  va, va_summary = plan.get("validity"), None
  if va:
    with open(text, encoding="utf-8") as f:
      va_text = f.read()
    va_plan = validity_collect.Plan(model=model, seed=settings.seed, **{
        k: tuple(v) if isinstance(v, list) else v for k, v in va.items()})
    va_summary = validity.run(params, config, tok, va_plan, os.path.join(out, "validity"),
                              text=va_text, text_source=text, log=log)
    sections.append(dict(md="\n".join(
        ["## Validity of the certificate, raw and calibrated (`validity/report.md`)", ""]
        + validity.headline_lines(va_summary)), claims=[]))
  dm = plan.get("damage")
  if dm is not None:
    with open(text, encoding="utf-8") as f:
      dm_text = f.read()
    dm_plan = damage_collect.Plan(model=model, seed=settings.seed, **{
        k: tuple(v) if isinstance(v, list) else v for k, v in dm.items()}).check()
    dm_out = os.path.join(out, "damage")
    damage_collect.collect(params, config, tok, dm_plan, dm_out, text=dm_text, log=log)
    dm_summary = damage_report.analyse(dm_out, dm_plan, train=True, log=log)
    sections.append(dict(md="\n".join(
        ["## From radius to output damage (`damage/report.md`)", ""]
        + damage_report.headline_lines(dm_summary)), claims=[]))
  wall = time.time() - t0
  report = suite_report.render_report(
      sections=sections, theorem1=th_summary, overhead=ov_summary, command=command, wall_s=wall,
      settings=settings,
      extra=[f"Rows: {len(rows)} suite rows (`rows.jsonl`), {len(th_rows)} Theorem-1 rows, "
             f"{len(ov_rows)} overhead rows, {len(ppl_rows)} streaming-loss rows "
             "(`perplexity_rows.jsonl`). Wall time counts this invocation only (a "
             "resumed run does not redo finished rows)."])
  results_io.atomic_write_text(os.path.join(out, "report.md"), report)
  blob = {"sections": [{k: v for k, v in s.items() if k != "md"} for s in sections],
          "theorem1": {k: v for k, v in (th_summary or {}).items() if k != "md"},
          "overhead": {k: v for k, v in (ov_summary or {}).items() if k != "md"},
          "wall_s": wall}
  results_io.atomic_write_text(os.path.join(out, "report.json"),
                               json.dumps(results_io.json_safe(blob), indent=1, default=float))
  return {"report": report, "complete": True, "rows": len(rows)}


def with_overrides(plan: dict, *, num_examples=None, context_len=None) -> dict:
  """``plan`` with its examples per task / context length replaced where given (also the
  streaming-loss segments and their length). Values are checked by the experiments."""
  plan = {k: dict(v) if isinstance(v, dict) else v for k, v in plan.items()}
  for name, value in (("num_examples", num_examples), ("context_len", context_len)):
    if value is None:
      continue
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"--{name} must be a positive int, got {value!r}")
    plan["settings"][name] = value
    if plan.get("perplexity"):
      plan["perplexity"][name] = value
  return plan


def run_command(*, model: str, out: str, full: bool, command: str, num_examples=None,
                context_len=None, text: str = DEFAULT_TEXT, max_units: int = -1,
                validity: bool = True, damage: bool = True) -> dict:
  """``python -m experiments.run_all``: loads ``model``, runs the quick (or ``full``) plan
  with its overrides (``validity=False``: without the validity study) into ``out`` and
  prints the report; returns :func:`run_suite`'s dict."""
  t0 = time.time()
  params, config, tok = model_loading.load_model(model)
  print(f"model loaded in {time.time() - t0:.0f}s", flush=True)
  plan = with_overrides(FULL if full else QUICK, num_examples=num_examples,
                        context_len=context_len)
  if not validity:
    plan = dict(plan, validity=None)
  if not damage:
    plan = dict(plan, damage=None)
  res = run_suite(params, config, tok, out, plan, model=model_loading.model_name(model),
                  command=command, max_units=None if max_units < 0 else max_units,
                  text=text, log=lambda s: print(s, flush=True))
  if res["complete"]:
    print(res["report"])
  print(f"total {time.time() - t0:.0f}s")
  return res
