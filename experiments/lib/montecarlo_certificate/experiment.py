r"""Synthetic Monte Carlo: deterministic vs randomized designs, side by side.

For a fixed synthetic attention problem, each design evicts the cache to a
budget; randomized designs are re-run over many seeded draws. Per (problem,
regime, design, budget) it writes one JSONL row: bias, mean squared error,
E[V_hat] / E||e||^2, certificate coverage and sharpness per delta, kept tokens
and the Assumption-2 ratio R. Deterministic designs have no randomness: their
certificate statistics are identically zero (Theorem 1: the retained state
cannot see the error), so their "coverage" is that of a zero radius.

The command: ``python -m experiments.montecarlo_certificate --out=/tmp/mc``.
Rows are written atomically as they finish; a rerun skips finished rows.
"""

import dataclasses
import os
import time

from absl import logging
import jax

from certkv_jax.certificate import montecarlo
from experiments.lib import design_defaults
from experiments.lib import plan_flags
from experiments.lib import results_io


def make_design(name: str, budget: int, n_sink: int, window: int):
  try:
    return design_defaults.make_design(name, budget, n_sink, window)
  except ValueError as err:
    raise ValueError(f"--designs: {err}") from err


def _fractions(values, flag):
  out = []
  for v in values:
    f = float(v)
    if not 0.0 < f < 1.0:
      raise ValueError(f"--{flag} entries must be in (0, 1), got {v}")
    out.append(f)
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run_and_report` runs (each setting a flag of
  ``experiments/montecarlo_certificate.py``). ``budgets`` and ``deltas``: fractions in
  (0, 1) (strings or numbers)."""

  context_len: int = plan_flags.setting(512, "Tokens in the synthetic context.")
  head_dim: int = plan_flags.setting(16, "Key and value dimension.")
  budgets: tuple = plan_flags.setting((0.125, 0.25, 0.5), "Budgets as fractions of the context.")
  deltas: tuple = plan_flags.setting((0.01, 0.05, 0.1, 0.2), "Certificate miss probabilities.")
  designs: tuple = plan_flags.setting(
      ("sink_window", "h2o", "tova", "snapkv", "key_norm", "uniform_random", "poisson_tail",
       "poisson_flat", "attention_proportional"), "Designs to run.")
  problems: tuple = plan_flags.setting(
      ("gaussian", "spike"), "gaussian: i.i.d. keys/values; spike: plus a few high-attention "
      "outlier tokens.")
  regimes: tuple = plan_flags.setting(
      ("question_aware", "streaming"), "question_aware: the query's attention is known at "
      "eviction; streaming: scores come from earlier queries only.")
  num_trials: int = plan_flags.setting(2000, "Draws per randomized design.")
  n_sink: int = plan_flags.setting(design_defaults.N_SINK, "Sink tokens kept by every design.")
  window: int = plan_flags.setting(design_defaults.WINDOW, "Recent window kept by every design.")
  seed: int = plan_flags.setting(0, "Seed of the problem and of the draws.")


def run_and_report(plan: Plan, *, out: str) -> str:
  """The command: one row per (problem, regime, design, budget) of ``plan`` not yet in
  ``out/rows.jsonl``, then ``out/summary.md`` of the plan's rows; prints and returns the
  summary. A file holding rows of other settings (``context_len``, ``head_dim``, ``seed``,
  ``num_trials``, ``n_sink``, ``window``) is refused: ValueError."""
  budgets = _fractions(plan.budgets, "budgets")
  deltas = _fractions(plan.deltas, "deltas")
  context_len, head_dim, seed = plan.context_len, plan.head_dim, plan.seed
  for p in plan.problems:
    if p not in ("gaussian", "spike"):
      raise ValueError(f"--problems: unknown problem {p!r}")
  for r in plan.regimes:
    if r not in ("question_aware", "streaming"):
      raise ValueError(f"--regimes: unknown regime {r!r}")
  results = results_io.JsonlResults(os.path.join(out, "rows.jsonl"),
                                    ("problem", "regime", "design", "budget"))
  settings = dict(context_len=context_len, head_dim=head_dim, seed=seed,
                  num_trials=plan.num_trials, n_sink=plan.n_sink, window=plan.window)
  results_io.check_settings(results, {f: (f, v) for f, v in settings.items()})
  units = [(p, r, d, b) for p in plan.problems for r in plan.regimes
           for d in plan.designs for b in budgets]
  todo = [u for u in units if not results.has(problem=u[0], regime=u[1], design=u[2],
                                              budget=u[3])]
  progress = results_io.Progress(len(units), len(units) - len(todo))
  logging.info("%d rows to run, %d already in %s", len(todo), len(units) - len(todo),
               results.path)
  key = jax.random.PRNGKey(seed)
  for problem_name, regime, design_name, frac in todo:
    problem = montecarlo.synthetic_problem(
        jax.random.fold_in(key, 0), n=context_len, d=head_dim, dv=head_dim,
        q_scale=1.0, spikes=3 if problem_name == "spike" else 0, n_history=8)
    budget = int(frac * context_len)
    design = make_design(design_name, budget, plan.n_sink, plan.window)
    n = plan.num_trials if design.randomized else 1
    keys = jax.random.split(jax.random.fold_in(key, 1), n)
    t0 = time.time()
    o, trials = montecarlo.run_trials(problem, design, keys,
                                      question_aware=regime == "question_aware")
    s = montecarlo.summarize(o, trials, deltas=deltas)
    row = {
        "problem": problem_name, "regime": regime, "design": design_name, "budget": frac,
        "budget_tokens": budget, "randomized": design.randomized, "n_trials": n,
        "mean_kept": s.mean_kept, "bias_norm": s.bias_norm, "bias_se": s.bias_se,
        "mse": s.mse, "mean_var_hat": s.mean_var_hat, "var_ratio": s.var_ratio,
        "coverage": {str(d): c for d, c in s.coverage.items()},
        "sharpness": {str(d): c for d, c in s.sharpness.items()},
        "median_R": s.median_r, "seconds": round(time.time() - t0, 2), **settings,
    }
    results.add(row)
    logging.info("%s %s/%s/%s@%.3f: mse %.4g cov(0.05) %.3f R %.3g", progress.step(),
                 problem_name, regime, design_name, frac, s.mse,
                 s.coverage.get(0.05, float("nan")), s.median_r)
  planned = set(units)
  summary = render_summary([r for r in results.rows if (r["problem"], r["regime"], r["design"],
                                                        r["budget"]) in planned], deltas)
  results_io.atomic_write_text(os.path.join(out, "summary.md"), summary)
  print(summary)
  return summary


def _fmt(x, spec):
  return "n/a" if x is None else format(x, spec)


def render_summary(rows, deltas) -> str:
  head = ("| problem | regime | design | budget | kept | MSE | bias/MC | E[V_hat]/MSE | "
          + " | ".join(f"cov@{d}" for d in deltas) + " | sharp@0.05 | median R |")
  lines = ["# Synthetic Monte Carlo: certificate by design", "", head,
           "|" + "---|" * (10 + len(deltas))]
  for r in sorted(rows, key=lambda r: (r["problem"], r["regime"], r["budget"],
                                       r["randomized"], r["design"])):
    cov = " | ".join(_fmt(r["coverage"].get(str(d)), ".3f") for d in deltas)
    se = r.get("bias_se")
    z = r["bias_norm"] / se if se else None  # None: one trial (deterministic)
    lines.append(
        f"| {r['problem']} | {r['regime']} | {r['design']} | {r['budget']} | "
        f"{r['mean_kept']:.1f} | {_fmt(r['mse'], '.4g')} | {_fmt(z, '.2f')} | "
        f"{_fmt(r['var_ratio'], '.3f')} | "
        f"{cov} | {_fmt(r['sharpness'].get('0.05'), '.2f')} | {_fmt(r['median_R'], '.3g')} |")
  lines += ["", "kept: mean tokens kept of the budget; MSE: E||o_hat - o||^2; bias/MC: "
            "||mean(o_hat) - o|| over its Monte Carlo scale sqrt(sum of the mean's squared "
            "standard errors), about 1 (chi_dv / sqrt(dv)) for an unbiased design, n/a for one "
            "trial; cov@delta: "
            "fraction of draws with ||e|| <= r(delta) (Bernstein radius); sharp: median "
            "r/||e|| over covered draws; R: Assumption-2 ratio (method, section 6). "
            "Deterministic designs have V_hat = 0, hence radius 0."]
  return "\n".join(lines) + "\n"
