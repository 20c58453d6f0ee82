r"""The whole suite (``python -m experiments.run_all``): every experiment of
method, section 8, then ``report.md`` for section 7.

:func:`run_suite` collects the suite's rows once (``experiments.lib.suite.rows.collect``:
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
examples per task, 512-token contexts, the designs of FULL, three tasks; 12
segments of 512 tokens of the text; the validity study at 256 / 1024 / 2048
tokens.

Progress: one line for the whole job (:class:`experiments.lib.suite.progress.JobProgress`:
stage i of n, the stage's units, the job's elapsed time and ETA over every stage
still to come). At the end ``run_all`` prints what ran, what its verdicts can say
and the claims table, with the committed longer-context runs beside the claims
(:mod:`experiments.lib.suite.regime`), and the report's path; the report opens
the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Optional

from experiments.lib import design_defaults
from experiments.lib import loaders
from experiments.lib import model_loading
from experiments.lib.overhead import experiment as overhead
from experiments.lib import results_io
from experiments.lib import tasks as tasks_lib
from experiments.lib.theorem1 import experiment as theorem1
from experiments.lib.analyses import assumption2
from experiments.lib.analyses import coverage
from experiments.lib.analyses import failures
from experiments.lib.analyses import regimes
from experiments.lib.damage import collect as damage_collect
from experiments.lib.damage import report as damage_report
from experiments.lib.streaming_loss import experiment as streaming_loss_experiment
from experiments.lib.streaming_loss import report as streaming_loss_report
from experiments.lib.suite import progress as suite_progress
from experiments.lib.suite import regime
from experiments.lib.suite import report as suite_report
from experiments.lib.suite import rows as suite_rows
from experiments.lib.suite import settings as suite_settings
from experiments.lib.validity import collect as validity_collect
from experiments.lib.validity import run as validity_run

QUICK = dict(
    settings=dict(tasks=("passkey", "agent_memory", "variable_tracking"), num_examples=4,
                  context_len=160, budgets=(0.125, 0.25, 0.5),
                  designs=("full", "snapkv", "poisson_tail", "attention_proportional"),
                  regimes=("question_aware", "streaming"), n_runs=2, n_steps=20,
                  question_aware_only=("attention_proportional", "snapkv")),
    theorem1=dict(task="passkey", num_examples=2, designs=("snapkv", "poisson_tail"),
                  budget=0.25, n_draws=3),
    # 7 interleaved rounds: the order-statistic interval of a ratio covers >= 95% from 6.
    overhead=dict(task="passkey", num_examples=1, budget=0.25, n_steps=16, repeats=7),
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
# The stages of run_suite in the order they run, each with a rough share of the quick
# plan's time on a 2-core CPU: the job's ETA weighs the stages by it (the pace itself is
# measured as the job runs, so only the shares' proportions matter).
STAGES = (("suite rows", 0.45), ("Theorem 1", 0.05), ("overhead", 0.05),
          ("streaming loss", 0.12), ("validity", 0.18), ("damage", 0.15))
# experiments/data/gpl-3.0.txt (this file is experiments/lib/suite/runner.py)
DEFAULT_TEXT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data",
    "gpl-3.0.txt")


@dataclasses.dataclass(frozen=True)
class Invocation:
  """How :func:`run_suite` runs a plan.

  Attributes:
    model: the model's name in the rows (``model_loading.model_name``).
    command: the command line the report names.
    text: the UTF-8 text of the streaming loss and of the validity and damage
      studies' text examples.
    max_units: stop the collection after this many units (None: all); a rerun
      resumes.
    examples_by_task: prebuilt examples per task (tests); the rest are made by
      ``tasks.make_task``.
  """

  model: str
  command: str
  text: str = DEFAULT_TEXT
  max_units: Optional[int] = None
  examples_by_task: Optional[dict] = None


def run_suite(params, config, tok, out: str, plan: dict, run: Invocation, *,
              log=print) -> dict:
  """Runs everything in ``plan`` (``QUICK`` or ``FULL``-shaped); writes ``out/report.md``.

  ``plan["theorem1"]`` / ``plan["overhead"]`` / ``plan["perplexity"]`` /
  ``plan["validity"]`` may be None (or absent) to skip those experiments.

  Progress goes to ``log`` as one line for the whole job (:func:`stages`).

  Returns ``{"report": text, "terminal": text, "complete": bool, "rows": n}``
  (``terminal``: what ran, the claims table and the report's path,
  ``suite_report.render_terminal``); ``complete`` is False when ``run.max_units``
  stopped the collection early (no report then).
  """
  model, text, examples_by_task = run.model, run.text, run.examples_by_task
  t0 = time.time()
  settings = suite_settings.Settings(model=model, **plan["settings"]).check()
  job = suite_progress.JobProgress(stages(plan), log)
  rows = suite_rows.collect(params, config, tok, settings, out, max_units=run.max_units,
                            log=job.stage("suite rows"), examples_by_task=examples_by_task)
  if len(rows) < suite_rows.expected_row_count(settings):
    log(f"{len(rows)} of {suite_rows.expected_row_count(settings)} rows; rerun to finish")
    return {"report": None, "complete": False, "rows": len(rows)}
  th, th_summary, th_rows = plan.get("theorem1"), None, []
  if th:
    th_examples = (examples_by_task or {}).get(th["task"]) or tasks_lib.make_task(
        th["task"], tok, th["num_examples"], settings.context_len, settings.seed)
    th_plan = theorem1.Plan(
        designs=tuple(th["designs"]), budget=th["budget"], model=model, task=th["task"],
        context_len=settings.context_len, seed=settings.seed, n_draws=th["n_draws"],
        n_steps=settings.n_steps, n_sink=settings.n_sink, window=settings.window)
    th_rows = theorem1.run_theorem1(params, config, list(th_examples)[:th["num_examples"]],
                                    out, th_plan, log=job.stage("Theorem 1"))
    th_summary = theorem1.summarize(th_rows)
  ov, ov_summary, ov_rows = plan.get("overhead"), None, []
  if ov:
    ov_examples = (examples_by_task or {}).get(ov["task"]) or tasks_lib.make_task(
        ov["task"], tok, ov["num_examples"], settings.context_len, settings.seed)
    ov_plan = overhead.Plan(model=model, budget=ov["budget"], n_steps=ov["n_steps"],
                            repeats=ov["repeats"], seed=settings.seed)
    ov_rows = overhead.run_overhead(params, config, list(ov_examples)[:ov["num_examples"]],
                                    out, ov_plan, log=job.stage("overhead"))
    ov_summary = overhead.summarize(ov_rows, out, settings.seed)
  pp, ppl_rows = plan.get("perplexity"), []
  sections = _analyses(rows, out)
  if pp:
    pp_plan = streaming_loss_experiment.Plan(model=model, seed=settings.seed,
                                             n_sink=settings.n_sink, window=settings.window,
                                             **pp)
    ppl_rows = streaming_loss_experiment.run_perplexity(params, config, tok, text, out, pp_plan,
                                                        log=job.stage("streaming loss"))
    sections.append(dict(streaming_loss_report.summarize(ppl_rows, out, settings.seed),
                         claims=[]))
  va, va_summary = plan.get("validity"), None
  if va:
    with open(text, encoding="utf-8") as f:
      va_text = f.read()
    va_plan = validity_collect.Plan(model=model, seed=settings.seed, **{
        k: tuple(v) if isinstance(v, list) else v for k, v in va.items()})
    va_summary = validity_run.run(params, config, tok, va_plan, os.path.join(out, "validity"),
                                  text=va_text, text_source=text, log=job.stage("validity"))
    sections.append(_study_section("validity", va_summary))
  dm = plan.get("damage")
  if dm is not None:
    with open(text, encoding="utf-8") as f:
      dm_text = f.read()
    dm_plan = damage_collect.Plan(model=model, seed=settings.seed, **{
        k: tuple(v) if isinstance(v, list) else v for k, v in dm.items()}).check()
    dm_out = os.path.join(out, "damage")
    dm_log = job.stage("damage")
    damage_collect.collect(params, config, tok, dm_plan, dm_out, text=dm_text, log=dm_log)
    dm_summary = damage_report.analyse(dm_out, dm_plan, train=True, log=dm_log)
    sections.append(_study_section("damage", dm_summary))
  header = suite_report.Header(command=run.command, wall_s=time.time() - t0, out_dir=out,
                               full_accuracy=suite_report.full_cache_accuracy(rows),
                               prompt_tokens=regime.prompt_range(rows))
  report = _write_report(out, settings, sections=sections, theorem1=th_summary,
                         overhead=ov_summary, counts=(rows, th_rows, ov_rows, ppl_rows),
                         header=header)
  terminal = suite_report.render_terminal(sections=sections, overhead=ov_summary,
                                          settings=settings, header=header,
                                          path=os.path.join(out, "report.md"))
  return {"report": report, "terminal": terminal, "complete": True, "rows": len(rows)}


def stages(plan: dict) -> tuple:
  """``(name, weight)`` of the stages of :data:`STAGES` that ``plan`` runs (as
  :func:`run_suite`: validity when its plan is truthy, damage when not None)."""
  runs = {"suite rows": True, "Theorem 1": bool(plan.get("theorem1")),
          "overhead": bool(plan.get("overhead")), "streaming loss": bool(plan.get("perplexity")),
          "validity": bool(plan.get("validity")), "damage": plan.get("damage") is not None}
  return tuple((name, w) for name, w in STAGES if runs[name])


def _study_section(name: str, summary: dict) -> dict:
  """The report's section of the validity or damage study (its headline table)."""
  if name == "validity":
    return dict(md="\n".join(
        ["## Validity of the certificate, raw and calibrated (`validity/report.md`)", ""]
        + validity_run.headline_lines(summary)), claims=[])
  return dict(md="\n".join(["## From radius to output damage (`damage/report.md`)", ""]
                           + damage_report.headline_lines(summary)), claims=[])


def _analyses(rows, plot_dir: str) -> list[dict]:
  """The sections of the suite's rows (plots into ``plot_dir``)."""
  return [coverage.coverage_analysis(rows, plot_dir),
          assumption2.assumption2_analysis(rows, plot_dir),
          failures.failure_analysis(rows, plot_dir),
          regimes.regimes_analysis(rows, plot_dir)]


def _write_report(out: str, settings, *, sections, theorem1, overhead, counts,
                  header: suite_report.Header, extra=()) -> str:
  """Writes ``out/report.md`` and ``out/report.json``; returns the report."""
  rows, th_rows, ov_rows, ppl_rows = (len(x) for x in counts)
  report = suite_report.render_report(
      sections=sections, theorem1=theorem1, overhead=overhead, settings=settings,
      header=header,
      extra=[f"Rows: {rows} suite rows (`rows.jsonl`), {th_rows} Theorem-1 rows, "
             f"{ov_rows} overhead rows, {ppl_rows} streaming-loss rows "
             "(`perplexity_rows.jsonl`). Wall time counts this invocation only (a "
             "resumed run does not redo finished rows)."] + list(extra))
  results_io.atomic_write_text(os.path.join(out, "report.md"), report)
  blob = {"sections": [{k: v for k, v in s.items() if k != "md"} for s in sections],
          "theorem1": {k: v for k, v in (theorem1 or {}).items() if k != "md"},
          "overhead": {k: v for k, v in (overhead or {}).items() if k != "md"},
          "wall_s": header.wall_s}
  results_io.atomic_write_text(os.path.join(out, "report.json"),
                               json.dumps(results_io.json_safe(blob), indent=1, default=float))
  return report


def _previous_header(out: str) -> dict:
  """Command, wall time and machine of an existing ``out/report.md`` (those it has; the
  wall time from ``report.json`` when there)."""
  path = os.path.join(out, "report.md")
  if not os.path.exists(path):
    return {}
  got = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.rstrip()
      m = re.fullmatch(r"Command: `(.*)`", line)
      if m:
        got["command"] = m.group(1)
      m = re.fullmatch(r"Wall time: ([0-9.]+) s", line)
      if m:
        got["wall_s"] = float(m.group(1))
      m = re.fullmatch(r"Machine: (.*)", line)
      if m:
        got["machine"] = m.group(1)
      if line.startswith("Verdict rule") or line.startswith("|"):
        break
  path = os.path.join(out, "report.json")
  if os.path.exists(path):  # the unrounded wall time
    with open(path, encoding="utf-8") as f:
      wall_s = json.load(f).get("wall_s")
    if isinstance(wall_s, (int, float)):
      got["wall_s"] = float(wall_s)
  return got


def rerender_report(out: str, plan: dict, *, model: str, text: str = DEFAULT_TEXT,
                    plot_dir=None, log=print) -> str:
  """Rewrites ``out/report.md`` and ``report.json`` from the rows already in ``out``,
  without a model (e.g. after a change to the verdict rule or an analysis).

  ``plan`` and ``model`` are those of the run that made the rows (e.g.
  ``experiments/results/suite_full_n8_c256``, made by ``--full --num_examples=8
  --context_len=256 --novalidity`` before the damage study existed:
  ``dict(with_overrides(FULL, num_examples=8, context_len=256), validity=None,
  damage=None)``).
  Every row the plan asks for must be there (suite, Theorem 1, overhead,
  streaming loss), and the validity / damage studies' ``summary.json`` when the
  plan has them: otherwise ``ValueError`` says what is missing (``run_all``
  resumes it, with the model). The command, wall time and machine lines are
  kept from the existing ``report.md`` (they describe the run that made the
  rows). Plots and ``perplexity.md`` go to ``plot_dir`` (default ``out``).

  ``python -c "from experiments.lib.suite import runner as s;
  s.rerender_report('experiments/results/suite_quick', dict(s.QUICK, validity=None,
  damage=None), model='smollm2')"`` (that run predates both studies).
  """
  plot_dir = plot_dir or out
  settings = suite_settings.Settings(model=model, **plan["settings"]).check()
  missing = []
  rows = suite_rows.select(results_io.read_rows(os.path.join(out, "rows.jsonl")), settings)
  if len(rows) != suite_rows.expected_row_count(settings):
    missing.append(f"rows.jsonl has {len(rows)} of {suite_rows.expected_row_count(settings)} "
                   "suite rows")
  th, th_rows = plan.get("theorem1"), []
  if th:  # the rows run_theorem1 returns
    th_rows = [r for r in results_io.read_rows(os.path.join(out, "theorem1_rows.jsonl"))
               if r["design"] in th["designs"] and r["model"] == model
               and r["task"] == th["task"] and r["budget"] == float(th["budget"])
               and r["seed"] == settings.seed and r["context_len"] == settings.context_len
               and r["example"] < th["num_examples"]
               and r["draw"] < (th["n_draws"] if design_defaults.is_randomized(r["design"])
                                else 1)]
    want = sum(th["num_examples"] * (th["n_draws"] if design_defaults.is_randomized(d) else 1)
               for d in th["designs"])
    if len(th_rows) < want:
      missing.append(f"theorem1_rows.jsonl has {len(th_rows)} of {want} rows")
  ov, ov_rows = plan.get("overhead"), []
  if ov:
    ov_rows = [r for r in results_io.read_rows(os.path.join(out, "overhead_rows.jsonl"))
               if r["model"] == model and r["budget"] == float(ov["budget"])
               and r["n_steps"] == ov["n_steps"] and r["seed"] == settings.seed]
    if sorted(r["config"] for r in ov_rows) != sorted(overhead.ALL_CONFIGS):
      missing.append(f"overhead_rows.jsonl has configs {sorted(r['config'] for r in ov_rows)}"
                     f", not each of {sorted(overhead.ALL_CONFIGS)} once")
  pp, ppl_rows = plan.get("perplexity"), []
  if pp:
    pp_plan = streaming_loss_experiment.Plan(model=model, seed=settings.seed,
                                             n_sink=settings.n_sink, window=settings.window,
                                             **pp)
    ppl_rows = streaming_loss_experiment.select(
        results_io.read_rows(os.path.join(out, streaming_loss_experiment.ROWS_FILE)), pp_plan,
        streaming_loss_experiment.text_sha256(loaders.load_text(text)))
    want = streaming_loss_experiment.expected_row_count(
        tuple(pp["designs"]), tuple(pp["budgets"]), pp["num_examples"], pp["n_runs"])
    if len(ppl_rows) != want:
      missing.append(f"{streaming_loss_experiment.ROWS_FILE} has {len(ppl_rows)} of {want} "
                     "rows")
  studies = {}
  for name in ("validity", "damage"):
    path = os.path.join(out, name, "summary.json")
    # as run_suite: validity runs when its plan is truthy, damage when it is not None
    if (plan.get(name) if name == "validity" else plan.get(name) is not None):
      if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
          studies[name] = json.load(f)
      else:
        missing.append(f"{path} (the {name} study; drop it from the plan if the run had none)")
  head = _previous_header(out)
  if "command" not in head:
    missing.append("report.md with the Command line of the run that made the rows")
  if missing:
    raise ValueError(f"{out}: cannot re-render without running the model: "
                     + "; ".join(missing))
  th_summary = theorem1.summarize(th_rows) if th else None
  ov_summary = overhead.summarize(ov_rows, plot_dir, settings.seed) if ov else None
  sections = _analyses(rows, plot_dir)
  if pp:
    sections.append(dict(streaming_loss_report.summarize(ppl_rows, plot_dir, settings.seed),
                         claims=[]))
  sections += [_study_section(name, summary) for name, summary in studies.items()]
  header = suite_report.Header(command=head["command"], wall_s=head.get("wall_s", float("nan")),
                               machine=head.get("machine"), out_dir=out,
                               full_accuracy=suite_report.full_cache_accuracy(rows),
                               prompt_tokens=regime.prompt_range(rows))
  report = _write_report(
      out, settings, sections=sections, theorem1=th_summary, overhead=ov_summary,
      counts=(rows, th_rows, ov_rows, ppl_rows), header=header,
      extra=["", "Re-rendered from these rows by `experiments.lib.suite.runner."
             "rerender_report` (no model run); Command, Wall time and Machine are those of "
             "the run that made them."])
  log(f"re-rendered {os.path.join(out, 'report.md')} from {len(rows)} suite rows")
  return report


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


def run_command(fv, command: str) -> dict:
  """``python -m experiments.run_all`` on its parsed flags ``fv``: says what will run
  (the plan's regime and stages), loads ``--model``, runs the quick (or ``--full``) plan
  with its overrides (``--novalidity`` / ``--nodamage``: without those studies) into
  ``--out`` with one progress line for the job, then prints what ran, the claims table
  and the report's path (not the whole report); returns :func:`run_suite`'s dict."""
  t0 = time.time()
  plan = with_overrides(FULL if fv.full else QUICK, num_examples=fv.num_examples,
                        context_len=fv.context_len)
  if not fv.validity:
    plan = dict(plan, validity=None)
  if not fv.damage:
    plan = dict(plan, damage=None)
  model = model_loading.model_name(fv.model)
  settings = suite_settings.Settings(model=model, **plan["settings"]).check()
  names = [name for name, _ in stages(plan)]
  print("\n".join(regime.describe(settings, before=True)) + f"\n\n{len(names)} stages: "
        f"{', '.join(names)}; progress is one line for the whole job.\n", flush=True)
  params, config, tok = model_loading.load_model(fv.model)
  print(f"model loaded in {time.time() - t0:.0f}s", flush=True)
  run = Invocation(model=model, command=command, text=fv.text,
                   max_units=None if fv.max_units < 0 else fv.max_units)
  res = run_suite(params, config, tok, fv.out, plan, run, log=lambda s: print(s, flush=True))
  if res["complete"]:
    print("\n" + res["terminal"], end="")
  print(f"total {time.time() - t0:.0f}s")
  return res
