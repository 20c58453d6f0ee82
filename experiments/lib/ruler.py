r"""RULER's synthetic tasks (Hsieh et al., 2024), generated with no outside data.

This module holds the task settings, the sizing and the scoring; the prompt
bodies, one builder per task kind, are in :mod:`experiments.lib.ruler_text`.

Follows NVIDIA/RULER: the generators of ``scripts/data/synthetic/``
(``niah.py``, ``variable_tracking.py``, ``common_words_extraction.py``,
``freq_words_extraction.py``) with the task settings of
``scripts/synthetic.yaml``, the templates, answer prefixes and
``tokens_to_generate`` of ``scripts/data/synthetic/constants.py`` and the
scoring of ``scripts/eval/synthetic/constants.py`` (:data:`TASKS`)::

  niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery
  vt (variable tracking), cwe (common words), fwe (frequent words)

``qa_1`` (SQuAD) and ``qa_2`` (HotpotQA) are left out (:data:`LEFT_OUT`):
they need outside data sets. Every task is scored by string_match_all
(:func:`task_score`; :meth:`Example.grade` per sample).

Sizing, as RULER: the haystack is the largest for which the prompt
(template, context, question and answer prefix, in tokens of the given
tokenizer) plus the task's ``tokens_to_generate`` fits in ``context_len``.
An :class:`experiments.lib.tasks.Example` splits the prompt where RULER's
template puts the question on its own line: ``context_ids`` is the chat
prefix and everything before that line break, ``question_ids`` the question
line, the end of the user turn and RULER's answer prefix.

Where this differs from RULER, and why:

* The essay haystack is the built-in text (default
  ``experiments/data/gpl-3.0.txt``, or any text given), not Paul Graham's
  essays (outside data), cut into sentences after ``.``, ``!`` or ``?`` and
  white space (RULER: nltk's ``sent_tokenize``).
* Words (niah keys ``w1-w2``, cwe's word list) come from the built-in text's
  vocabulary, its lower-case alphabetic words of 4 letters or more
  (:func:`vocabulary`), not from wonderwords' adjective and noun lists.
* cwe's few-shot example opens the user turn (RULER puts it before the
  model's chat template); vt's opens it as in RULER, sized to
  ``min(500, context_len // 4)`` tokens (RULER: 500).
* niah's singular rewrite ("Some" -> "A", "are" -> "is", ...) touches the
  task template only, never the chat template; distractor needles never
  reuse a real key (RULER does not check).
* Each example has its own ``random.Random`` (seeded from the task, seed and
  index), so one example never depends on another's haystack search. The
  context length is not in the seed: a seed gives the same keys and values
  (at other depths) at every length, so runs of one seed at two lengths share
  their examples and are not independent samples.
"""

from __future__ import annotations

import os
import random
import re
import string
from typing import Callable, Optional, Sequence

from experiments.lib import prompts
from experiments.lib import ruler_text
from experiments.lib import scoring
from experiments.lib.tasks import Example

# experiments/data/gpl-3.0.txt (this file is experiments/lib/ruler.py)
DEFAULT_HAYSTACK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "data", "gpl-3.0.txt")

# scripts/synthetic.yaml
_NIAH = dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
             num_needle_k=1, num_needle_v=1, num_needle_q=1)
CONFIGS = {
    "niah_single_1": ("niah", dict(_NIAH, type_haystack="noise")),
    "niah_single_2": ("niah", dict(_NIAH)),
    "niah_single_3": ("niah", dict(_NIAH, type_needle_v="uuids")),
    "niah_multikey_1": ("niah", dict(_NIAH, num_needle_k=4)),
    "niah_multikey_2": ("niah", dict(_NIAH, type_haystack="needle")),
    "niah_multikey_3": ("niah", dict(_NIAH, type_haystack="needle", type_needle_k="uuids",
                                     type_needle_v="uuids")),
    "niah_multivalue": ("niah", dict(_NIAH, num_needle_v=4)),
    "niah_multiquery": ("niah", dict(_NIAH, num_needle_q=4)),
    "vt": ("variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
}
TASKS = tuple(CONFIGS)
LEFT_OUT = {"qa_1": "needs SQuAD (an outside data set)",
            "qa_2": "needs HotpotQA (an outside data set)"}
METRIC = "ruler_all"  # string_match_all (scripts/eval/synthetic/constants.py), every task here

VT_ICL_TOKENS = 500  # variable_tracking.py's few-shot example: max_seq_length=500


def tokens_to_generate(name: str) -> int:
  """RULER's maximum generation length for task ``name``."""
  _check_name(name)
  return ruler_text.TEMPLATES[CONFIGS[name][0]][2]


def postprocess(text: str) -> str:
  """RULER's ``postprocess_pred``: strip, control characters to line breaks, strip."""
  return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def task_score(preds: Sequence[str], refs: Sequence[Sequence[str]], metric: str = "all") -> float:
  """RULER's task score in percent, rounded to 2 places: the mean over samples of
  string_match_all (``"all"``: the fraction of a sample's references that occur in
  its prediction, lower-cased) or string_match_part (``"part"``: whether any does)."""
  if metric not in ("all", "part"):
    raise ValueError(f"metric must be 'all' or 'part', got {metric!r}")
  if not preds or len(preds) != len(refs):
    raise ValueError(f"preds and refs must be non-empty and of one length, got {len(preds)} "
                     f"and {len(refs)}")
  one = scoring.string_match_all if metric == "all" else scoring.string_match_part
  return round(sum(one(p, r) for p, r in zip(preds, refs)) / len(preds) * 100, 2)


# ----------------------------------------------------------------------------- sizing


def _vt_icl(rng: random.Random, tok, budget: int, num_chains: int, num_hops: int) -> str:
  """The few-shot example: the largest ICL prompt within ``budget`` tokens (or the
  smallest, if none fits), its answer appended, then its names and value redrawn
  (``randomize_icl``)."""
  def render(n):
    r = random.Random(seed)
    body, prefix, answer = ruler_text.vt_text(r, n, num_chains, num_hops, icl=True)
    return body + prefix + " " + " ".join(answer) + "\n"

  seed = rng.getrandbits(64)
  lo = min(10, num_hops) + 1
  fits = lambda n: len(tok.encode(render(n), add_bos=False)) <= budget
  n = _largest(fits, lo, "vt", 0, budget) if fits(lo) else lo  # else: the smallest one
  text = render(n)
  for name in text.strip().split()[-min(10, num_hops) - 1:]:
    new = "".join(rng.choices(string.ascii_uppercase, k=len(name)))
    text = text.replace(name, new)
  return text.replace("12345", str(rng.randint(10000, 99998)))


def _smallest_haystack(kind: str, cfg: dict) -> int:
  """The fewest haystack units a task is built from (lines, words or coded words)."""
  if kind == "niah":
    return max(cfg["num_needle_k"], cfg["num_needle_q"]) * cfg["num_needle_v"]
  if kind == "variable_tracking":
    return cfg["num_hops"] + 1
  if kind == "common_words_extraction":
    return cfg["num_cw"] + 1
  return 32  # fwe: the 4th coded word needs 32 / (4^2 zeta(2)) >= 1 copy


def _largest(fits: Callable[[int], bool], lo: int, name: str, gen: int,
             context_len: int) -> int:
  """The largest ``n >= lo`` with ``fits(n)`` (doubling, then bisection, as RULER's
  binary search)."""
  if not fits(lo):
    raise ValueError(f"context_len={context_len} is too small for task {name!r}: its prompt "
                     f"with the smallest haystack and {gen} tokens to generate does not fit")
  hi = lo
  while fits(hi * 2):
    hi *= 2
  good, bad = hi, hi * 2
  while bad - good > 1:
    mid = (good + bad) // 2
    good, bad = (mid, bad) if fits(mid) else (good, mid)
  return good


def _check_name(name):
  if name not in CONFIGS:
    why = f" ({LEFT_OUT[name]})" if name in LEFT_OUT else ""
    raise ValueError(f"name must be one of {TASKS}, got {name!r}{why}")


def make_examples(name: str, tokenizer, num_examples: int, context_len: int, seed: int, *,
                  haystack: Optional[str] = None, use_chat: bool = True,
                  max_new_tokens: Optional[int] = None) -> list[Example]:
  """``num_examples`` seeded examples of RULER task ``name`` at ``context_len`` tokens.

  Args:
    name: one of :data:`TASKS`.
    tokenizer: ``encode(text, add_bos=...)``, ``decode(ids)`` and optionally
      ``apply_chat_template`` (see :mod:`experiments.lib.tasks`).
    num_examples: int >= 1.
    context_len: int >= 64: prompt tokens plus ``max_new_tokens``, at most.
    seed: int; the same arguments give the same examples.
    haystack: the essay text and word source (None: :data:`DEFAULT_HAYSTACK`).
    use_chat: wrap the prompt in the tokenizer's chat template, if it has one.
    max_new_tokens: the generation budget the prompt leaves room for (None:
      RULER's ``tokens_to_generate`` of the task).

  Returns:
    Examples with ``metric="ruler_all"``; ``meta`` has ``max_new_tokens``,
    ``n_haystack`` (the size the length search settled on: noise lines, essay words,
    needles, list words, or for fwe the ``num_words`` asked for, of which the coded
    words in the context may be fewer) and ``n_prompt_tokens``.
  """
  _check_name(name)
  prompts.check_int(num_examples, "num_examples", 1)
  prompts.check_int(context_len, "context_len", 64)
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ValueError(f"seed must be an int, got {seed!r}")
  gen = tokens_to_generate(name) if max_new_tokens is None else max_new_tokens
  prompts.check_int(gen, "max_new_tokens", 1, context_len - 1)
  if haystack is None:
    with open(DEFAULT_HAYSTACK, encoding="utf-8") as f:
      haystack = f.read()
  hay = ruler_text.Haystack.from_text(haystack)
  kind, cfg = CONFIGS[name]
  build = ruler_text.BUILDERS[kind]
  prefix, suffix = prompts.chat_parts(tokenizer, use_chat)
  if (prefix, suffix) == ("", "\n"):  # no chat template: RULER's 'base' template
    suffix = ""
  out = []
  for i in range(num_examples):
    rng = random.Random(f"ruler:{name}:{seed}:{i}")
    extra = {}
    if kind == "variable_tracking":
      extra["icl"] = _vt_icl(rng, tokenizer, min(VT_ICL_TOKENS, context_len // 4),
                             cfg["num_chains"], cfg["num_hops"])
    example_seed = rng.getrandbits(64)

    def render(n):
      return build(random.Random(example_seed), n, cfg, hay, context_len, **extra)

    def encode(p):
      ctx = list(tokenizer.encode(prefix + p.head))
      qst = list(tokenizer.encode(p.question + suffix + p.answer_prefix, add_bos=False))
      return ctx, qst

    def fits(n):
      try:
        ctx, qst = encode(render(n))
      except ruler_text.TooFewWords:
        return False
      return len(ctx) + len(qst) + gen <= context_len

    n = _largest(fits, _smallest_haystack(kind, cfg), name, gen, context_len)
    if kind == "common_words_extraction" and n == len(hay.vocab):
      raise ValueError(f"context_len={context_len}: cwe needs more distinct words than the "
                       f"{len(hay.vocab)} of the haystack text's vocabulary")
    p = render(n)
    ctx, qst = encode(p)
    meta = dict(p.meta, n_haystack=n, max_new_tokens=gen, n_context_tokens=len(ctx),
                n_prompt_tokens=len(ctx) + len(qst), context_len=context_len, index=i)
    out.append(Example(ctx, qst, ", ".join(p.answers), name, meta, tuple(p.answers), METRIC))
  return out
