"""Exact scoring rules of the experiment tasks and loaders (one generation vs answers).

:data:`METRICS` maps a rule's name (``Example.metric`` in
:mod:`experiments.lib.tasks`) to a function ``(generated_text, answers) -> bool``;
LongBench's token F1 and RULER's string matches are here too.
"""

from __future__ import annotations

import re
import string
from typing import Callable, Sequence

_DIGIT_RUN = re.compile(r"\d+")
_NUMBER = re.compile(r"\d(?:[ ,-]?\d)*")  # digits, single spaces, commas or hyphens between
_LIST_MARKER = re.compile(r"^\s*\d+[.)](?=\s)", re.M)
VAR_NAME_LEN = 5  # variable_tracking's names: this many upper-case letters
_VAR_NAME = re.compile(r"\b[A-Z]{%d}\b" % VAR_NAME_LEN)


def normalize_answer(text: str) -> str:
  """SQuAD/LongBench normalisation: lower case, no punctuation, no articles, single spaces."""
  text = text.lower()
  text = "".join(ch for ch in text if ch not in set(string.punctuation))
  text = re.sub(r"\b(a|an|the)\b", " ", text)
  return " ".join(text.split())


def score_digits(text: str, answers: Sequence[str]) -> bool:
  """``digits``: the generation's first number, its digits joined across single
  separators (``"1 2 3"``, ``"12,345"``, ``"12-345"``), is exactly the answer's digits; a
  longer number or a list's ``1.`` is wrong."""
  want = "".join(_DIGIT_RUN.findall(answers[0]))
  first = _NUMBER.search(text)
  return bool(want) and first is not None and "".join(_DIGIT_RUN.findall(first[0])) == want


def score_numbers_all(text: str, answers: Sequence[str]) -> bool:
  """``numbers_all``: the first ``len(answers)`` numbers (maximal digit runs) of the
  generation, list markers (a line's ``1.`` or ``2)``) left out, are exactly the
  answers, in any order."""
  got = _DIGIT_RUN.findall(_LIST_MARKER.sub(" ", text))[:len(answers)]
  return sorted(got) == sorted(answers)


def score_exact_prefix(text: str, answers: Sequence[str]) -> bool:
  """``exact_prefix``: after stripping whitespace and opening quotes/backticks and lower
  casing, the generation starts with the (lower-cased) answer."""
  got = text.strip().lstrip("\"'`").lower()
  return any(got.startswith(a.strip().lower()) for a in answers)


def score_set_exact(text: str, answers: Sequence[str]) -> bool:
  """``set_exact``: the set of 5-letter upper-case names on the generation's first
  non-empty line equals the set of answers."""
  lines = [ln for ln in text.strip().splitlines() if ln.strip()]
  got = set(_VAR_NAME.findall(lines[0])) if lines else set()
  return got == set(answers)


def exact_match(text: str, answers: Sequence[str]) -> bool:
  """Normalised generation (:func:`normalize_answer`) equals a normalised answer."""
  got = normalize_answer(text)
  return any(got == normalize_answer(a) for a in answers)


def contains_match(text: str, answers: Sequence[str]) -> bool:
  """A non-empty normalised answer occurs in the normalised generation (on word
  boundaries)."""
  got = f" {normalize_answer(text)} "
  return any(normalize_answer(a) and f" {normalize_answer(a)} " in got for a in answers)


def f1_score(text: str, answers: Sequence[str]) -> float:
  """LongBench/SQuAD token-level F1 (whitespace tokens of the normalised strings), max
  over the answers. English only (LongBench's Chinese datasets use jieba)."""
  pred = normalize_answer(text).split()
  best = 0.0
  for a in answers:
    ref = normalize_answer(a).split()
    common = {}
    for t in ref:
      common[t] = common.get(t, 0) + 1
    same = 0
    for t in pred:
      if common.get(t, 0) > 0:
        common[t] -= 1
        same += 1
    if same:
      precision, recall = same / len(pred), same / len(ref)
      best = max(best, 2 * precision * recall / (precision + recall))
  return best


def string_match_all(text: str, answers: Sequence[str]) -> float:
  """RULER's string_match_all for one sample: the fraction of the answers that occur
  (case-insensitive substring) in the generation."""
  low = text.lower()
  return sum(a.lower() in low for a in answers) / len(answers)


def string_match_part(text: str, answers: Sequence[str]) -> float:
  """RULER's string_match_part for one sample: 1.0 if any answer occurs
  (case-insensitive substring) in the generation, else 0.0."""
  low = text.lower()
  return float(any(a.lower() in low for a in answers))


METRICS: dict[str, Callable[[str, Sequence[str]], bool]] = {
    "digits": score_digits,
    "numbers_all": score_numbers_all,
    "exact_prefix": score_exact_prefix,
    "set_exact": score_set_exact,
    "exact_match": exact_match,
    "contains": contains_match,
    "ruler_all": lambda t, a: string_match_all(t, a) == 1.0,
    "ruler_part": lambda t, a: string_match_part(t, a) == 1.0,
}
# Rules with a graded per-sample score in [0, 1] (RULER averages these, not the pass/fail).
GRADED: dict[str, Callable[[str, Sequence[str]], float]] = {
    "ruler_all": string_match_all,
    "ruler_part": string_match_part,
}
