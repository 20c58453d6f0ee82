"""``report.md`` of the experiment suite: the claims table of method, section 7, then
every analysis' section (:mod:`experiments.lib.analyses`); and the
``summary.md`` of a single analysis script.

Choices the paper leaves open, fixed here (and printed in the report):

* the certificate's per-example score is the per-step sum of radii at
  ``delta = 0.05`` over layers and heads, averaged over a moving window of 6
  decode steps, maximised over the steps (``cert_score``);
* confidence is the mean log-probability of the generated tokens (its
  suspicion score is its negative);
* two-run disagreement is the fraction of decode positions at which two
  independent ``poisson_tail`` runs (different PRNG keys) generate different
  tokens;
* gating is scored at a recompute budget of 25% of the examples.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from typing import Callable, Optional, Sequence

from experiments.lib import model_loading
from experiments.lib.overhead import experiment as overhead_lib
from experiments.lib import results_io
from experiments.lib.analyses import common
from experiments.lib.suite import regime
from experiments.lib.suite import rows as suite_rows
from experiments.lib.suite import settings as suite_settings

VERDICT_RULE = (
    "Verdict rule (`experiments.lib.stats.verdict`): each claim holds on a region: "
    "[paper lo, +inf) for an \"at least\" claim (coverage, the certificate's attribution "
    "AUC, the gating claims, \"> 0\"), (-inf, paper hi] for an \"at most\" claim (\"~0 "
    "damage\", \"< 1\"), [paper lo, paper hi] for a point claim with a band (the two-run "
    "disagreement's AUC, the overhead's \"about 2x\"). Reproduced if our whole 95% interval "
    "lies in the region, refuted if it lies wholly outside it, inconclusive if it spans a "
    "boundary of the region (part in, part out); inconclusive (not estimable) when there is "
    "no interval (fewer than two examples); inconclusive (untestable here) for a gating "
    "claim that even oracle gating's interval falls short of. Small samples give wide "
    "intervals, hence inconclusive verdicts.")


def overhead_claims(overhead: Optional[dict]) -> list[dict]:
  """The claim row of the measured overhead (``overhead``: ``overhead_lib.summarize``).

  "About 2x" is a point claim: judged two-sided on its band, so a cheaper
  certificate refutes it as much as a dearer one (the note says which side,
  and how noisy the ratio is and how it was timed)."""
  if not overhead or "ratio_cert_vs_deterministic" not in overhead:
    return []
  key = "ratio_cert_vs_deterministic"
  ci = overhead[key]
  ci = None if ci is None else tuple(ci)
  lo, hi = common.PAPER["overhead"]
  v = common.verdict_of(common.PAPER["overhead"], ci, "two_sided")
  note = []
  if v == "refuted":
    note.append(f"cheaper than claimed (whole CI below {lo:g})" if ci[2] < lo else
                f"dearer than claimed (whole CI above {hi:g})")
  info = overhead.get("timing", {}).get(key)
  if v != common.NOT_ESTIMABLE and info:
    note.append(f"noise: +-{100 * overhead_lib.half_width(ci):.0f}% (CI half-width / "
                f"estimate); {overhead_lib.describe_ratio(info)}")
  else:
    note.append("CI over repeated timings")
  return [common.claim("measured overhead: randomized + certificate vs deterministic, per "
                       "decode step", f"about 2x (band {lo:g}-{hi:g})", ci, v, "; ".join(note))]


@dataclasses.dataclass(frozen=True)
class Header:
  """What the report says of the run that made it.

  Attributes:
    command: the command line.
    wall_s: its wall time (this invocation).
    machine: the Machine line's text (None: this machine's).
    out_dir: the report's folder (its links are relative to it; None: a plain path).
    full_accuracy: ``((task, accuracy, n), ...)`` of the full cache
      (:func:`full_cache_accuracy`).
    prompt_tokens: the rows' shortest and longest prompt (``regime.prompt_range``).
  """

  command: str
  wall_s: float
  machine: Optional[str] = None
  out_dir: Optional[str] = None
  full_accuracy: tuple = ()
  prompt_tokens: Optional[tuple] = None


def full_cache_accuracy(rows) -> tuple:
  """``((task, accuracy, n), ...)`` of the full cache's rows, tasks in order of appearance."""
  by = {}
  for r in rows:
    if r["design"] == "full":
      by.setdefault(r["task"], []).append(float(bool(r["correct"])))
  return tuple((t, sum(v) / len(v), len(v)) for t, v in by.items())


def _claims(sections: Sequence[dict], overhead: Optional[dict]) -> list[dict]:
  return [c for s in sections for c in s.get("claims", [])] + overhead_claims(overhead)


def claims_lines(sections: Sequence[dict], overhead: Optional[dict], settings,
                 header: Header, *, link: regime.Link) -> tuple[list[str], list[str]]:
  """The report's opening (what ran, what its verdicts can say) and the claims table,
  with the committed longer runs beside the claims they bear on (``link`` names files:
  ``regime.links``): what the terminal shows of the report."""
  found = regime.evidence(link)
  lines = regime.describe(settings, header.full_accuracy, link,
                          prompt_tokens=header.prompt_tokens) + [""]
  return lines, common.table(
      ["claim", "paper", "ours (95% CI)", "verdict", "note",
       "the committed longer-context runs"],
      [[c["claim"], c["paper"], c["ours"], c["verdict"], c["note"],
        regime.beside(c["claim"], found)] for c in _claims(sections, overhead)])


def render_report(*, sections: Sequence[dict], theorem1: Optional[dict],
                  overhead: Optional[dict], settings, header: Header,
                  extra: Sequence[str] = ()) -> str:
  """``report.md``: what ran and what its verdicts can say, the claims table, then each
  section."""
  import jax  # pylint: disable=g-import-not-at-top
  machine = header.machine
  if machine is None:
    machine = (f"{platform.platform()}, {os.cpu_count()} CPUs, jax {jax.__version__}, "
               f"python {platform.python_version()}")
  opening, table = claims_lines(sections, overhead, settings, header,
                                link=regime.links(header.out_dir))
  lines = ["# certkv_jax: the paper's claims (method, section 7) on this setup", ""]
  lines += opening
  lines += [f"Command: `{header.command}`  ", f"Wall time: {header.wall_s:.0f} s  ",
            f"Machine: {machine}  ",
            f"Settings: model {settings.model}, tasks {list(settings.tasks)}, context_len "
            f"{settings.context_len}, {settings.num_examples} examples per task, budgets "
            f"{list(settings.budgets)}, designs {list(settings.designs)}, regimes "
            f"{list(settings.regimes)} ({list(settings.question_aware_only)} question-aware "
            f"only; 'full' once), {settings.n_runs} runs of {list(settings.multi_run_designs)}, "
            f"{settings.n_steps} decode steps, seed {settings.seed}"
            + (f", at most {settings.max_batch} rows per call" if settings.max_batch else ""),
            "", VERDICT_RULE, ""]
  lines += table
  lines += ["", __doc__.split("Choices the paper leaves open, fixed here (and printed in the "
                              "report):")[1].strip().replace("\n\n", "\n"), ""]
  if theorem1:
    lines += [theorem1.get("md", ""), ""]
  if overhead:
    lines += [overhead.get("md", ""), ""]
  for s in sections:
    lines += [s["md"], ""]
  lines += list(extra)
  return "\n".join(lines) + "\n"


def render_terminal(*, sections: Sequence[dict], overhead: Optional[dict], settings,
                    header: Header, path: str) -> str:
  """What ``run_all`` prints at the end: what ran and what its verdicts can say, the
  claims table and where the whole report is (``path``)."""
  opening, table = claims_lines(sections, overhead, settings, header,
                                link=regime.links(None))
  return "\n".join(
      opening + table + ["", f"The whole report (the verdict rule, every experiment's tables "
                             f"and plots): {path}; wall time {header.wall_s:.0f} s."]) + "\n"


def write_summary(out_dir: str, sections: Sequence[dict], title: str) -> str:
  """``out_dir/summary.md`` (the sections and a claims table) and ``summary.json``."""
  claims = [c for s in sections for c in s.get("claims", [])]
  lines = [f"# {title}", ""]
  if claims:
    lines += common.table(["claim", "paper", "ours (95% CI)", "verdict"],
                          [[c["claim"], c["paper"], c["ours"], c["verdict"]]
                           for c in claims]) + ["", VERDICT_RULE, ""]
  lines += [s["md"] for s in sections]
  text = "\n".join(lines) + "\n"
  results_io.atomic_write_text(os.path.join(out_dir, "summary.md"), text)
  blob = [{k: v for k, v in s.items() if k != "md"} for s in sections]
  results_io.atomic_write_text(os.path.join(out_dir, "summary.json"),
                               json.dumps(results_io.json_safe(blob), indent=1, default=float))
  return text


def run_analyses(flag_values, analyses: Sequence[Callable[..., dict]], title: str,
                 **settings_overrides) -> str:
  """What a suite analysis script does on its parsed flags
  (:func:`experiments.lib.suite.settings.define_common_flags`): collect the rows,
  run ``analyses``, write ``--out/summary.md`` and ``summary.json``; returns the summary."""
  settings = suite_settings.settings_from_flags(flag_values, **settings_overrides)
  params, config, tok = model_loading.load_model(flag_values.model)
  rows = suite_rows.collect(params, config, tok, settings, flag_values.out,
                            max_units=None if flag_values.max_units < 0 else flag_values.max_units)
  return write_summary(flag_values.out, [fn(rows, flag_values.out) for fn in analyses], title)
