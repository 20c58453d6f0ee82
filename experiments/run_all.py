r"""The main command: every experiment of SPEC section 8, then ``report.md`` for section 7.

  python -m experiments.run_all --out=DIR           # quick suite (SmolLM2, 2-core CPU)
  python -m experiments.run_all --out=DIR --full    # the larger version

Collects the suite's rows once (``experiments.lib.suite.collect``: one batched
evaluation-mode call per (regime, design, run); resumable, rows in
``DIR/rows.jsonl``), runs the Theorem-1 rotation experiment
(``DIR/theorem1_rows.jsonl``) and the overhead timing
(``DIR/overhead_rows.jsonl``), and writes ``DIR/report.md``: for each claim of
SPEC section 7 the paper's number, ours with a 95% interval and a verdict
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
(``experiments.exp_perplexity``) on ``--text``, by default the built-in
natural-language text ``experiments/data/gpl-3.0.txt`` (the GNU GPL v3, 7.6k
SmolLM2 tokens, which its own terms allow to be copied verbatim): 6 segments
of 256 tokens in chunks of 32, full / snapkv / poisson_tail. ``--full``: 24
examples per task, 512-token contexts, every design, three tasks; 12
segments of 512 tokens of the text.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app
from absl import flags

from experiments import exp_overhead
from experiments import exp_perplexity
from experiments import exp_theorem1
from experiments.lib import results_io
from experiments.lib import suite
from experiments.lib import suite_report
from experiments.lib import tasks as tasks_lib

FLAGS = flags.FLAGS

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
)
DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpl-3.0.txt")


def run_suite(params, config, tok, out: str, plan: dict, *, model: str, command: str,
              max_units=None, examples_by_task=None, text: str = DEFAULT_TEXT,
              log=print) -> dict:
  """Runs everything in ``plan`` (``QUICK`` or ``FULL``-shaped); writes ``out/report.md``.

  ``plan["theorem1"]`` / ``plan["overhead"]`` / ``plan["perplexity"]`` may be
  None (or absent) to skip those experiments; the streaming loss reads ``text``.

  Returns ``{"report": text, "complete": bool, "rows": n}``; ``complete`` is
  False when ``max_units`` stopped the collection early (no report then).
  """
  t0 = time.time()
  settings = suite.Settings(model=model, **plan["settings"]).check()
  rows = suite.collect(params, config, tok, settings, out, max_units=max_units, log=log,
                       examples_by_task=examples_by_task)
  if len(rows) < suite.expected_row_count(settings):
    log(f"{len(rows)} of {suite.expected_row_count(settings)} rows; rerun to finish")
    return {"report": None, "complete": False, "rows": len(rows)}
  th, theorem1, th_rows = plan.get("theorem1"), None, []
  if th:
    th_examples = (examples_by_task or {}).get(th["task"]) or tasks_lib.make_task(
        th["task"], tok, th["num_examples"], settings.context_len, settings.seed)
    th_rows = exp_theorem1.run_theorem1(
        params, config, list(th_examples)[:th["num_examples"]], list(th["designs"]),
        th["budget"], out, model=model, task=th["task"], context_len=settings.context_len,
        seed=settings.seed, n_draws=th["n_draws"], n_steps=settings.n_steps,
        n_sink=settings.n_sink, window=settings.window, log=log)
    theorem1 = exp_theorem1.summarize(th_rows)
  ov, overhead, ov_rows = plan.get("overhead"), None, []
  if ov:
    ov_examples = (examples_by_task or {}).get(ov["task"]) or tasks_lib.make_task(
        ov["task"], tok, ov["num_examples"], settings.context_len, settings.seed)
    ov_rows = exp_overhead.run_overhead(
        params, config, list(ov_examples)[:ov["num_examples"]], out, model=model,
        budget=ov["budget"], n_steps=ov["n_steps"], repeats=ov["repeats"],
        seed=settings.seed, log=log)
    overhead = exp_overhead.summarize(ov_rows, out, settings.seed)
  pp, ppl_rows = plan.get("perplexity"), []
  sections = [suite_report.coverage_analysis(rows, out),
              suite_report.assumption2_analysis(rows, out),
              suite_report.failure_analysis(rows, out),
              suite_report.regimes_analysis(rows, out)]
  if pp:
    ppl_rows = exp_perplexity.run_perplexity(
        params, config, tok, text, out, model=model, seed=settings.seed,
        n_sink=settings.n_sink, window=settings.window, log=log, **pp)
    sections.append(dict(exp_perplexity.summarize(ppl_rows, out, settings.seed), claims=[]))
  wall = time.time() - t0
  report = suite_report.render_report(
      sections=sections, theorem1=theorem1, overhead=overhead, command=command, wall_s=wall,
      settings=settings,
      extra=[f"Rows: {len(rows)} suite rows (`rows.jsonl`), {len(th_rows)} Theorem-1 rows, "
             f"{len(ov_rows)} overhead rows, {len(ppl_rows)} streaming-loss rows "
             "(`perplexity_rows.jsonl`). Wall time counts this invocation only (a "
             "resumed run does not redo finished rows)."])
  results_io.atomic_write_text(os.path.join(out, "report.md"), report)
  blob = {"sections": [{k: v for k, v in s.items() if k != "md"} for s in sections],
          "theorem1": {k: v for k, v in (theorem1 or {}).items() if k != "md"},
          "overhead": {k: v for k, v in (overhead or {}).items() if k != "md"}, "wall_s": wall}
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


def define_flags():
  flags.DEFINE_string("out", None, "Output directory (rows, report.md, plots).", required=True)
  flags.DEFINE_bool("full", False, "Run the larger suite instead of the quick one.")
  flags.DEFINE_string("model", suite.DEFAULT_MODEL, "'smollm2' or a Hugging Face safetensors "
                      "checkpoint directory with tokenizer.json.")
  flags.DEFINE_integer("num_examples", None, "Override the plan's examples per task (and "
                       "streaming-loss segments), e.g. a --full run at reduced size.")
  flags.DEFINE_integer("context_len", None, "Override the plan's context length in tokens "
                       "(tasks and streaming-loss segments).")
  flags.DEFINE_string("text", DEFAULT_TEXT, "UTF-8 text file of the streaming-loss "
                      "experiment (default: the built-in GPL-3 text).")
  flags.DEFINE_integer("max_units", -1, "Stop the collection after this many units (-1: "
                       "all); a rerun resumes.")


def main(argv):
  del argv
  t0 = time.time()
  params, config, tok = suite.load_model(FLAGS.model)
  print(f"model loaded in {time.time() - t0:.0f}s", flush=True)
  command = "python -m experiments.run_all " + " ".join(sys.argv[1:])
  plan = with_overrides(FULL if FLAGS.full else QUICK, num_examples=FLAGS.num_examples,
                        context_len=FLAGS.context_len)
  res = run_suite(params, config, tok, FLAGS.out, plan,
                  model=suite.model_name(FLAGS.model), command=command,
                  max_units=None if FLAGS.max_units < 0 else FLAGS.max_units,
                  text=FLAGS.text, log=lambda s: print(s, flush=True))
  if res["complete"]:
    print(res["report"])
  print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
  define_flags()
  app.run(main)
