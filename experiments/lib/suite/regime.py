"""Where a suite run stands against the paper's setting: the opening of ``report.md``
and, beside each claim, what the project's committed longer runs measured.

The quick plan runs a 135M model on contexts of a few hundred tokens with a few
examples per task, far from the long contexts KV-cache eviction is meant for: its
verdicts say how a claim fares on that small setup, not whether the paper's number
holds where it was measured. :func:`describe` says what a run was and what its
verdicts can say; :func:`evidence` reads the committed summaries of the longer runs
under ``experiments/results`` (the certificate's coverage at 1k-8k tokens, on natural
text at equal memory, task accuracy at 1k-8k tokens, the overhead at 2k-token
prompts) and :func:`beside` picks the entry a claim's row shows. Numbers come from
those files when a report is rendered, never from this module; a file that is not
there (an installed package without the results) leaves its entry out.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Callable, Optional, Sequence

import numpy as np

from experiments.lib.overhead import experiment as overhead_lib
from experiments.lib import results_io

# This file is experiments/lib/suite/regime.py.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
RESULTS = "experiments/results"  # the committed runs, relative to REPO_ROOT
RESULTS_DOC = "docs/results.md"
# The certified design the README puts forward (its equal-memory coverage is quoted).
PUT_FORWARD = "priority_focus:diffuse_weight=0.3:focus_share=0.95+cert:min_share=0.95"
MIN_LONG_CONTEXT = 1024  # validity contexts quoted as "longer"
DELTA = "0.05"  # the claims' certificate level
# Budgets of the question-aware claim (method, section 7: 25-50%), as RULER ratios removed.
QA_RATIOS = ("0.5", "0.75")

Link = Callable[[str], str]


def links(out_dir: Optional[str]) -> Link:
  """How a report names a repository file (a path relative to :data:`REPO_ROOT`): a
  Markdown link relative to ``out_dir`` (the report's folder), labelled by its path
  under :data:`RESULTS`, or with ``out_dir`` None the path in backquotes (the
  terminal)."""
  if out_dir is None:
    return lambda rel: f"`{rel}`"
  start = os.path.abspath(out_dir)

  def link(rel: str) -> str:
    label = rel[len(RESULTS) + 1:] if rel.startswith(RESULTS + "/") else rel
    return f"[`{label}`]({os.path.relpath(os.path.join(REPO_ROOT, rel), start)})"
  return link


def _pct(b) -> str:
  return f"{float(b) * 100:g}%"


def _join(values, spec) -> str:
  return " / ".join(format(v, spec) for v in values)


def describe(settings, full_accuracy: Optional[Sequence] = None,
             link: Link = links(None), *, before: bool = False,
             prompt_tokens: Optional[tuple] = None) -> list[str]:
  """The report's opening: what ran (``settings``: a suite ``Settings``;
  ``full_accuracy``: ``(task, accuracy, n)`` of the full cache; ``prompt_tokens``: the
  rows' shortest and longest prompt, :func:`prompt_range`) and what its verdicts can and
  cannot say, naming where the longer runs are. ``before``: worded for the start of a
  run (what runs; the report to come)."""
  lo, hi = min(settings.budgets), max(settings.budgets)
  if prompt_tokens:  # a budget is a share of the tokens seen: the whole prompt at its end
    p_lo, p_hi = prompt_tokens
    kept = (f"at the prompt's end {math.floor(lo * p_lo)}-{math.floor(hi * p_hi)} of its "
            f"{p_lo}-{p_hi} tokens kept")
    prompts = f" (prompts of {p_lo}-{p_hi} tokens with the question)"
  else:
    kept = (f"of a prompt of {settings.context_len} tokens plus the question: at least "
            f"{math.floor(lo * settings.context_len)}-{math.floor(hi * settings.context_len)} "
            "tokens kept")
    prompts = ""
  ran = (f"**What {'runs' if before else 'ran'}.** Model {settings.model}; "
         f"{len(settings.tasks)} tasks ({', '.join(settings.tasks)}) at "
         f"{settings.context_len}-token contexts{prompts}, "
         f"{settings.num_examples} examples per task, {settings.n_steps} decode steps; "
         f"designs {', '.join(settings.designs)} at budgets "
         f"{' / '.join(_pct(b) for b in settings.budgets)} of the tokens seen ({kept}).")
  failed = []
  if full_accuracy:
    ran += (" Full-cache accuracy: " + ", ".join(f"{t} {a:.2f}" for t, a, _ in full_accuracy)
            + ".")
    failed = [t for t, a, _ in full_accuracy if a == 0]
  can = (f"**What its verdicts can and cannot say.** {settings.context_len}-token contexts "
         "are far shorter than the long contexts KV-cache eviction is meant for, and "
         f"{settings.num_examples} examples per task give wide intervals: "
         f"{'a verdict of the report' if before else 'a verdict below'} says how a claim "
         "fares on this small setup, not whether the paper's number holds at the lengths "
         "and sample sizes it was measured at.")
  if failed:
    can += (f" The full cache already fails {', '.join(failed)} here, so that task's "
            "failures are not the eviction's.")
  if before:
    can += (" The report's claims table quotes the project's committed longer-context runs "
            f"beside the claims they bear on; every committed run is in {link(RESULTS_DOC)}.")
  else:
    can += (" The last column of the claims table quotes the project's committed "
            "longer-context runs on the claims they bear on (read from their summary files "
            f"when this report was written); every committed run is in {link(RESULTS_DOC)}.")
  return [ran, "", can]


def prompt_range(rows) -> Optional[tuple]:
  """``(shortest, longest)`` ``n_prompt_tokens`` of the rows, or None when none records it."""
  n = [int(r["n_prompt_tokens"]) for r in rows if r.get("n_prompt_tokens") is not None]
  return (min(n), max(n)) if n else None


# --- the committed runs -------------------------------------------------------------------

def _read(rel: str):
  path = os.path.join(REPO_ROOT, RESULTS, rel)
  if not os.path.exists(path):
    return None
  if path.endswith(".jsonl"):
    return results_io.read_rows(path)
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _raw_coverage(summary, budget=None) -> list[tuple[int, float]]:
  """``(context, mean raw coverage of poisson_tail's cells)`` at contexts >=
  :data:`MIN_LONG_CONTEXT` (one budget's cells, or all)."""
  out = []
  for ctx in summary["plan"]["context_lens"]:
    cov = [c["coverage"][DELTA] for c in summary["cells"]
           if c["design"] == "poisson_tail" and c["radius"] == "raw"
           and c["context_len"] == ctx and (budget is None or c["budget"] == budget)]
    if ctx >= MIN_LONG_CONTEXT and cov:
      out.append((ctx, float(np.mean(cov))))
  return out


def _coverage(link: Link, budget=None) -> Optional[str]:
  """The coverage claims' entry (all budgets, or one)."""
  parts, cells, files = [], [], []
  for rel in ("validity", "validity_long"):
    s = _read(f"{rel}/summary.json")
    if s:
      got = _raw_coverage(s, budget)
      cells += got
      files += [link(f"{RESULTS}/{rel}/summary.json")] if got else []
  if cells:
    parts.append(f"`poisson_tail`, raw radius, mean over cells: "
                 f"{_join([c for _, c in cells], '.3f')} at {_join([n for n, _ in cells], ',')} "
                 f"tokens ({', '.join(files)})")
  s = _read("equal_memory/summary.json")
  cov = s and s.get("contexts", {}).get("1024", {}).get("coverage", {}).get(PUT_FORWARD)
  if cov:
    rel = link(f"{RESULTS}/equal_memory/summary.json")
    if budget is None:
      vals = [cov[m]["raw"] for m in sorted(cov, key=float)]
      parts.append(f"on natural text at equal memory (1,024 tokens), the design put forward "
                   f"`{PUT_FORWARD}`: {min(vals):.3f}-{max(vals):.3f} at "
                   f"{' / '.join(_pct(m) for m in sorted(cov, key=float))} memory ({rel})")
    elif str(budget) in cov:
      c = cov[str(budget)]
      parts.append(f"the design put forward on natural text at {_pct(budget)} memory "
                   f"(1,024 tokens): {c['raw']:.3f} [{c['raw_ci'][0]:.3f}, "
                   f"{c['raw_ci'][1]:.3f}] ({rel})")
  return "; ".join(parts) or None


def _ruler_cells(rel: str) -> dict:
  """``{(context, regime): (loss, examples)}`` of a leaderboard-style summary: the best
  deterministic design's loss against the full cache at 50% / 25% kept, in RULER score
  points, and how many examples it rests on."""
  s = _read(f"{rel}/summary.json")
  out = {}
  for key, cell in (s or {}).get("cells", {}).items():
    ctx, _, regime = key.partition("/")
    loss = cell.get("paired_vs_best_deterministic", {}).get("full", {})
    if not all(r in loss for r in QA_RATIOS):
      continue
    vals = []
    for r in QA_RATIOS:
      v, (lo, hi) = loss[r]["value"], loss[r]["ci"]
      vals.append(f"{v:.1f}" + (f" [{lo:.1f}, {hi:.1f}]" if lo is not None and hi is not None
                                and hi > lo else ""))
    n = sorted(set(cell["n_examples"].values()))
    examples = (f"{'/'.join(map(str, n))} example{'s' if n != [1] else ''} x "
                f"{len(cell['n_examples'])} tasks"
                + (", at equal memory" if s["plan"].get("equal_memory") else ""))
    out[(int(ctx), regime)] = (" / ".join(vals), examples)
  return out


def _question_aware(link: Link) -> Optional[str]:
  parts = []
  for rel in ("equal_memory_tasks", "leaderboard_smoke", "leaderboard_8k"):
    for (ctx, regime), (loss, examples) in sorted(_ruler_cells(rel).items()):
      if regime == "query_aware":
        parts.append(f"{loss} at {ctx:,} tokens ({examples}; "
                     f"{link(f'{RESULTS}/{rel}/summary.json')})")
  if not parts:
    return None
  return ("RULER, question inside the compressed context: the best deterministic design "
          "loses, against the full cache, in score points (of 100) at 50% / 25% kept, "
          + "; ".join(parts))


def _streaming(link: Link) -> Optional[str]:
  parts = []
  for rel in ("leaderboard_smoke", "leaderboard_8k"):
    cells = _ruler_cells(rel)
    for ctx in sorted({c for c, _ in cells}):
      if (ctx, "streaming") in cells and (ctx, "query_aware") in cells:
        (st, examples), (qa, _) = cells[(ctx, "streaming")], cells[(ctx, "query_aware")]
        parts.append(f"{st} streaming against {qa} question-aware at {ctx:,} tokens "
                     f"({examples}; {link(f'{RESULTS}/{rel}/summary.json')})")
  if not parts:
    return None
  return ("RULER: the best deterministic design loses, against the full cache, in score "
          "points at 50% / 25% kept, " + "; ".join(parts))


def _overhead(link: Link) -> Optional[str]:
  rows = _read("overhead_long/overhead_rows.jsonl")
  if not rows:
    return None
  ratio = overhead_lib.summarize(rows).get("ratio_cert_vs_deterministic")
  if not ratio:
    return None
  r = rows[0]
  return (f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}] at {r['prompt_len']:,}-token "
          f"prompts, batch {r['batch']}, budget {_pct(r['budget'])} "
          f"({link(f'{RESULTS}/overhead_long/overhead_rows.jsonl')})")


def evidence(link: Link = links(None)) -> dict:
  """What the committed longer runs measured, by claim: keys ``coverage`` (all
  budgets), ``("coverage", budget)``, ``question_aware``, ``streaming``, ``overhead``;
  an entry is absent where its files are."""
  out = {"coverage": _coverage(link), "question_aware": _question_aware(link),
         "streaming": _streaming(link), "overhead": _overhead(link)}
  for b in (0.125, 0.25, 0.5):
    out[("coverage", b)] = _coverage(link, b)
  return {k: v for k, v in out.items() if v}


def beside(claim: str, found: dict) -> str:
  """The entry of :func:`evidence` for the claim named ``claim`` ("-" when none)."""
  key = None
  if claim.startswith("coverage of realised error"):
    m = re.search(r"budget ([0-9.]+)", claim)
    key = ("coverage", float(m.group(1))) if m else "coverage"
  elif claim.startswith("question-aware eviction"):
    key = "question_aware"
  elif claim.startswith("the damage is in streaming"):
    key = "streaming"
  elif claim.startswith("measured overhead"):
    key = "overhead"
  return found.get(key, "-")
