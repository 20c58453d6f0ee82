"""User datasets as :class:`experiments.lib.tasks.Example`: LongBench and RULER JSONL, plain text.

LongBench records (one JSON object a line) need ``input`` (the question),
``context``, ``answers`` (a list of strings) and ``length``; ``_id``,
``dataset`` and ``all_classes`` are optional and kept in ``meta``. The prompt
is LongBench's generic template: ``context_ids`` is the chat prefix, an
instruction and the context; ``question_ids`` the question, the end of the
user turn, the assistant header and ``"Answer:"``. Scoring:
``Example.score`` is :func:`contains_match` (a normalised answer occurs in the
normalised generation; normalisation is SQuAD's: lower case, no punctuation,
no articles, single spaces); :func:`exact_match` and LongBench's token-level
:func:`f1_score` are exposed for reporting (LongBench's own metrics are F1 /
ROUGE / classification accuracy per dataset).

RULER records need ``outputs`` (a list of strings), ``length`` and ``index``,
and either ``context`` + ``query`` or ``input`` (the full prompt, question
included; optional ``answer_prefix``). From ``input`` alone the question is
split off at the last occurrence of ``question_sep`` (default: the last line
break, RULER's templates end with the question on its own line); the split is
recorded in ``meta["split"]``. Scoring: ``metric="all"`` (default) is RULER's
string_match_all (every output occurs in the generation, case-insensitive),
``metric="part"`` its string_match_part (any output does);
:func:`string_match_all` / :func:`string_match_part` give the per-sample
scores RULER averages.

Over-long contexts are never cut silently: with ``max_context_tokens`` set, a
longer ``context_ids`` is an error unless ``truncate="middle"``, which keeps
the head and tail of the context's own tokens (as LongBench does) and records
``meta["truncation"]`` (tokens before, tokens cut, where the cut starts).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from experiments.lib import prompts
from experiments.lib.scoring import contains_match  # pylint: disable=unused-import
from experiments.lib.scoring import exact_match  # pylint: disable=unused-import
from experiments.lib.tasks import Example
from experiments.lib.scoring import f1_score  # pylint: disable=unused-import
from experiments.lib.scoring import normalize_answer  # pylint: disable=unused-import
from experiments.lib.scoring import string_match_all  # pylint: disable=unused-import
from experiments.lib.scoring import string_match_part  # pylint: disable=unused-import

LONGBENCH_FIELDS = ("input", "context", "answers", "length")
RULER_FIELDS = ("outputs", "length", "index")
TRUNCATE = (None, "middle")
LONGBENCH_INSTRUCTION = "Read the following text and answer briefly.\n\n"
LONGBENCH_QUESTION = ("\n\nNow, answer the question based on the above text, only give me the "
                      "answer and do not output any other words.\n\nQuestion: {input}")
LONGBENCH_ANSWER_PREFIX = "Answer:"


def _check_max_examples(max_examples):
  if max_examples is not None and (not isinstance(max_examples, int) or
                                   isinstance(max_examples, bool) or max_examples < 1):
    raise ValueError(f"max_examples must be None or an int >= 1, got {max_examples!r}")


def read_jsonl(path: str, required=(), max_examples: Optional[int] = None) -> list[tuple]:
  """``[(line_number, record)]`` of a JSONL file (blank lines skipped).

  Raises:
    ValueError: unreadable JSON, a line that is not an object, a missing
      required field (naming the file, line and field), or no records.
  """
  _check_max_examples(max_examples)
  if not os.path.isfile(path):
    raise ValueError(f"path {path!r} is not a file")
  out = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{lineno}: invalid JSON ({err.msg})") from err
      if not isinstance(rec, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
      for field in required:
        if field not in rec:
          raise ValueError(f"{path}:{lineno}: missing field {field!r} (required: "
                           f"{list(required)})")
      out.append((lineno, rec))
      if max_examples is not None and len(out) >= max_examples:
        break
  if not out:
    raise ValueError(f"{path}: no records")
  return out


def _string_list(rec, field, path, lineno) -> tuple[str, ...]:
  val = rec[field]
  if (not isinstance(val, list) or not val or
      not all(isinstance(a, str) for a in val)):
    raise ValueError(f"{path}:{lineno}: field {field!r} must be a non-empty list of strings, "
                     f"got {val!r:.80}")
  return tuple(val)


def _string(rec, field, path, lineno) -> str:
  if not isinstance(rec[field], str):
    raise ValueError(f"{path}:{lineno}: field {field!r} must be a string, got "
                     f"{type(rec[field]).__name__}")
  return rec[field]


def _context_ids(tokenizer, head: str, text: str, max_context_tokens, truncate, where):
  """``encode(head) + encode(text)``, middle-truncated or refused when too long."""
  head_ids = list(tokenizer.encode(head))
  text_ids = list(tokenizer.encode(text, add_bos=False))
  n = len(head_ids) + len(text_ids)
  if max_context_tokens is None or n <= max_context_tokens:
    return head_ids + text_ids, None
  if truncate is None:
    raise ValueError(f"{where}: context has {n} tokens > max_context_tokens="
                     f"{max_context_tokens}; pass truncate='middle' to cut its middle")
  keep = max_context_tokens - len(head_ids)
  if keep < 2:
    raise ValueError(f"{where}: max_context_tokens={max_context_tokens} leaves no room for "
                     f"the context after the {len(head_ids)}-token instruction")
  first = keep // 2
  cut = len(text_ids) - keep
  kept = text_ids[:first] + text_ids[first + cut:]
  info = {"n_tokens_before": n, "n_tokens_cut": cut, "cut_start": len(head_ids) + first,
          "mode": "middle"}
  return head_ids + kept, info


def _check_options(max_context_tokens, truncate):
  if max_context_tokens is not None and (not isinstance(max_context_tokens, int) or
                                         max_context_tokens < 1):
    raise ValueError(f"max_context_tokens must be None or an int >= 1, got "
                     f"{max_context_tokens!r}")
  if truncate not in TRUNCATE:
    raise ValueError(f"truncate must be one of {TRUNCATE}, got {truncate!r}")
  if truncate is not None and max_context_tokens is None:
    raise ValueError("truncate='middle' needs max_context_tokens")


def load_longbench(path: str, tokenizer, *, max_examples: Optional[int] = None,
                   max_context_tokens: Optional[int] = None, truncate: Optional[str] = None,
                   use_chat: bool = True) -> list[Example]:
  """LongBench JSONL as examples (see the module docstring).

  Args:
    path: the JSONL file.
    tokenizer: see :mod:`experiments.lib.tasks`.
    max_examples: read at most this many records (None: all).
    max_context_tokens: the longest ``context_ids`` allowed (None: no limit).
    truncate: None (an over-long context is an error) or ``"middle"``.
    use_chat: wrap the prompt in the tokenizer's chat template, if it has one.
  """
  _check_options(max_context_tokens, truncate)
  prefix, suffix = prompts.chat_parts(tokenizer, use_chat)
  out = []
  for lineno, rec in read_jsonl(path, LONGBENCH_FIELDS, max_examples):
    where = f"{path}:{lineno}"
    answers = _string_list(rec, "answers", path, lineno)
    context = _string(rec, "context", path, lineno)
    question = _string(rec, "input", path, lineno)
    ids, trunc = _context_ids(tokenizer, prefix + LONGBENCH_INSTRUCTION, context,
                              max_context_tokens, truncate, where)
    q = LONGBENCH_QUESTION.format(input=question) + suffix + LONGBENCH_ANSWER_PREFIX
    meta = {"line": lineno, "length": rec["length"], "id": rec.get("_id"),
            "dataset": rec.get("dataset"), "all_classes": rec.get("all_classes"),
            "truncation": trunc, "n_context_tokens": len(ids)}
    out.append(Example(ids, list(tokenizer.encode(q, add_bos=False)), answers[0],
                       "longbench" if rec.get("dataset") is None else
                       f"longbench/{rec['dataset']}", meta, answers, "contains"))
  return out


def load_ruler(path: str, tokenizer, *, max_examples: Optional[int] = None,
               max_context_tokens: Optional[int] = None, truncate: Optional[str] = None,
               metric: str = "all", question_sep: str = "\n",
               use_chat: bool = True) -> list[Example]:
  """RULER-style JSONL as examples (see the module docstring), task ``"ruler"``.

  The arguments are :func:`load_longbench`'s, and ``metric``: ``"all"``
  (string_match_all) or ``"part"`` (string_match_part); ``question_sep``: where
  an ``input``-only record is split (its last occurrence).
  """
  _check_options(max_context_tokens, truncate)
  if metric not in ("all", "part"):
    raise ValueError(f"metric must be 'all' or 'part', got {metric!r}")
  if not isinstance(question_sep, str) or not question_sep:
    raise ValueError(f"question_sep must be a non-empty string, got {question_sep!r}")
  prefix, suffix = prompts.chat_parts(tokenizer, use_chat)
  out = []
  for lineno, rec in read_jsonl(path, RULER_FIELDS, max_examples):
    where = f"{path}:{lineno}"
    outputs = _string_list(rec, "outputs", path, lineno)
    if "context" in rec and "query" in rec:
      context, query = _string(rec, "context", path, lineno), _string(rec, "query", path, lineno)
      split = "context+query"
    elif "input" in rec:
      full = _string(rec, "input", path, lineno).rstrip()
      cut = full.rfind(question_sep)
      if cut <= 0 or not full[cut + len(question_sep):].strip():
        raise ValueError(f"{where}: cannot split field 'input' into context and question at "
                         f"question_sep={question_sep!r}")
      context, query = full[:cut], full[cut:]
      split = f"input split at last {question_sep!r}"
    else:
      raise ValueError(f"{where}: missing field 'input' (or both 'context' and 'query')")
    ids, trunc = _context_ids(tokenizer, prefix, context, max_context_tokens, truncate, where)
    answer_prefix = rec.get("answer_prefix", "") or ""
    q = query + suffix + answer_prefix
    meta = {"line": lineno, "index": rec["index"], "length": rec["length"], "split": split,
            "truncation": trunc, "n_context_tokens": len(ids)}
    out.append(Example(ids, list(tokenizer.encode(q, add_bos=False)), outputs[0], "ruler", meta,
                       outputs, "ruler_all" if metric == "all" else "ruler_part"))
  return out


def load_text(path: str) -> str:
  """The text of a UTF-8 file (for streaming perplexity); an error if it is empty."""
  if not os.path.isfile(path):
    raise ValueError(f"path {path!r} is not a file")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if not text.strip():
    raise ValueError(f"path {path!r} is empty (or whitespace only)")
  return text
