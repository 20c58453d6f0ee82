r"""RULER's synthetic tasks (Hsieh et al., 2024), generated with no outside data.

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

import dataclasses
import math
import os
import random
import re
import string
import uuid
from typing import Callable, Optional, Sequence

from experiments.lib import prompts
from experiments.lib import scoring
from experiments.lib.tasks import Example

# experiments/data/gpl-3.0.txt (this file is experiments/lib/ruler.py)
DEFAULT_HAYSTACK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "data", "gpl-3.0.txt")

# scripts/data/synthetic/constants.py: templates, answer prefixes, tokens_to_generate
TEMPLATES = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make "
             "sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n"
             "{context}\nWhat are all the special magic {type_needle_v} for {query} "
             "mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text "
             "are", 128),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following "
        "text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} "
        "in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: ", 30),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than "
        "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the "
        "10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:", 120),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently "
        "appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words "
        "are:", 50),
}

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

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# np.round(np.linspace(0, 100, num=40)).astype(int), as niah.py and variable_tracking.py
DEPTHS = (0, 3, 5, 8, 10, 13, 15, 18, 21, 23, 26, 28, 31, 33, 36, 38, 41, 44, 46, 49, 51, 54,
          56, 59, 62, 64, 67, 69, 72, 74, 77, 79, 82, 85, 87, 90, 92, 95, 97, 100)
VT_ICL_TOKENS = 500  # variable_tracking.py's few-shot example: max_seq_length=500


def tokens_to_generate(name: str) -> int:
  """RULER's maximum generation length for task ``name``."""
  _check_name(name)
  return TEMPLATES[CONFIGS[name][0]][2]


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


def vocabulary(text: str) -> tuple[str, ...]:
  """The sorted distinct lower-case alphabetic words of 4 letters or more of ``text``."""
  return tuple(sorted({w for w in re.findall(r"[A-Za-z]+", text) if w.islower() and len(w) >= 4}))


@dataclasses.dataclass(frozen=True)
class Haystack:
  """The built-in text: its words (the essay haystack) and its vocabulary."""

  words: tuple
  vocab: tuple

  @classmethod
  def from_text(cls, text: str) -> "Haystack":
    words = tuple(re.sub(r"\s+", " ", text.strip()).split(" "))
    vocab = vocabulary(text)
    if len(words) < 2 or len(vocab) < 20:
      raise ValueError(f"haystack text: needs words and a vocabulary of >= 20 words, got "
                       f"{len(words)} words, {len(vocab)} in the vocabulary")
    return cls(words, vocab)

  def essay(self, n: int) -> str:
    """The first ``n`` words, the text repeated as often as needed (as niah.py)."""
    reps = -(-n // len(self.words))
    return " ".join((self.words * reps)[:n])


def _sentences(text: str) -> list[str]:
  return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


class _Prompt:
  """A rendered example: user content up to the question line, the question line, the
  answer prefix, the answers and the metadata."""

  def __init__(self, body: str, answer_prefix: str, answers, meta: dict):
    cut = body.rfind("\n")
    self.head, self.question = body[:cut], body[cut:]
    self.answer_prefix, self.answers, self.meta = answer_prefix, list(answers), meta


# ----------------------------------------------------------------------------- niah


def _random_value(rng: random.Random, kind: str, vocab) -> str:
  if kind == "numbers":  # generate_random_number(7)
    return str(rng.randint(10 ** 6, 10 ** 7 - 1))
  if kind == "words":  # an adjective-noun pair in RULER
    return f"{rng.choice(vocab)}-{rng.choice(vocab)}"
  return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _insert_lines(rng: random.Random, lines: list, needles: list) -> list:
  """niah.py's noise / needle haystacks: needles at random line indexes."""
  lines = list(lines)
  for index, element in zip(sorted(rng.sample(range(len(lines)), len(needles)), reverse=True),
                            needles):
    lines.insert(index, element)
  return lines


def _insert_sentences(rng: random.Random, text: str, items: list) -> str:
  """niah.py's essay haystack: items between sentences, at depths drawn from DEPTHS."""
  sents = _sentences(text)
  cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in rng.sample(DEPTHS, len(items)))
  cuts.append(len(sents))
  out = []
  for i in range(1, len(cuts)):
    out.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
    if i - 1 < len(items):
      out.append(items[i - 1])
  return " ".join(out)


def _niah(rng: random.Random, n: int, cfg: dict, hay: Haystack, context_len: int) -> _Prompt:
  del context_len
  type_k, type_v = cfg["type_needle_k"], cfg["type_needle_v"]
  num_k = max(cfg["num_needle_k"], cfg["num_needle_q"])
  keys, values, needles = [], [], []
  for _ in range(num_k):
    key = _random_value(rng, type_k, hay.vocab)
    while key in keys:
      key = _random_value(rng, type_k, hay.vocab)
    keys.append(key)
    values.append([])
    for _ in range(cfg["num_needle_v"]):
      values[-1].append(_random_value(rng, type_v, hay.vocab))
      needles.append(NEEDLE.format(type_needle_v=type_v, key=key, value=values[-1][-1]))
  rng.shuffle(needles)
  kind = cfg["type_haystack"]
  if kind == "essay":
    context = _insert_sentences(rng, hay.essay(n), needles)
  else:
    if kind == "noise":
      lines = [NOISE] * n
    else:  # "needle": distractor needles with other keys
      lines = []
      for _ in range(n):
        key = _random_value(rng, type_k, hay.vocab)
        while key in keys:
          key = _random_value(rng, type_k, hay.vocab)
        lines.append(NEEDLE.format(type_needle_v=type_v, key=key,
                                   value=_random_value(rng, type_v, hay.vocab)))
    context = "\n".join(_insert_lines(rng, lines, needles))
  picked = rng.sample(range(num_k), cfg["num_needle_q"])
  queries = [keys[i] for i in picked]
  answers = [a for i in picked for a in values[i]]
  query = (", ".join(queries[:-1]) + ", and " + queries[-1]) if len(queries) > 1 else queries[0]
  template, prefix, _ = TEMPLATES["niah"]
  if cfg["num_needle_q"] * cfg["num_needle_v"] == 1:  # niah.py's singular rewrite
    for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
      template, prefix = template.replace(a, b), prefix.replace(a, b)
    type_v = type_v[:-1]
  fill = dict(type_needle_v=type_v, query=query)
  return _Prompt(template.format(context=context, **fill), prefix.format(**fill), answers,
                 {"keys": queries, "n_needles": len(needles)})


# ----------------------------------------------------------------------------- vt


def _vt_text(rng: random.Random, n: int, num_chains: int, num_hops: int, icl: bool):
  """variable_tracking.py's ``generate_input_output`` (noise haystack): the plain prompt
  with its answer prefix, and the first chain's variables."""
  k = 3 if icl else 5
  hops = min(10, num_hops) if icl else num_hops
  names = []
  while len(names) < (hops + 1) * num_chains:
    name = "".join(rng.choices(string.ascii_uppercase, k=k))
    if name not in names and name != "VAR":
      names.append(name)
  chains = []
  for c in range(num_chains):
    var = names[c * (hops + 1):(c + 1) * (hops + 1)]
    value = "12345" if icl else str(rng.randint(10000, 99998))
    chains.append((var, [f"VAR {var[0]} = {value}"] +
                   [f"VAR {var[j + 1]} = VAR {var[j]} " for j in range(hops)]))
  value = chains[0][1][0].split("=")[-1].strip()
  sentences = [NOISE] * n
  for _, chain in chains:
    at = sorted(rng.sample(range(len(sentences)), len(chain)))
    for p, j in zip(at, range(len(chain))):
      sentences.insert(p + j, chain[j])
  context = "\n".join(sentences).replace(". \n", ".\n")
  template, prefix, _ = TEMPLATES["variable_tracking"]
  fill = dict(query=value, num_v=hops + 1)
  return template.format(context=context, **fill), prefix.format(**fill), chains[0][0]


def _vt_icl(rng: random.Random, tok, budget: int, num_chains: int, num_hops: int) -> str:
  """The few-shot example: the largest ICL prompt within ``budget`` tokens (or the
  smallest, if none fits), its answer appended, then its names and value redrawn
  (``randomize_icl``)."""
  def render(n):
    r = random.Random(seed)
    body, prefix, answer = _vt_text(r, n, num_chains, num_hops, icl=True)
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


def _vt(rng, n, cfg, hay, context_len, icl=""):
  del hay, context_len
  body, prefix, answer = _vt_text(rng, n, cfg["num_chains"], cfg["num_hops"], icl=False)
  return _Prompt(icl + "\n" + body if icl else body, prefix, answer, {})


# ----------------------------------------------------------------------------- cwe


def _cwe_list(rng: random.Random, vocab, num_words: int, common: int, uncommon: int,
              num_cw: int):
  """common_words_extraction.py's ``get_example``: the numbered list and its common words."""
  words = rng.sample(vocab, num_words)
  top, rest = words[:num_cw], words[num_cw:]
  listed = top * common + rest * uncommon
  rng.shuffle(listed)
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top


class _TooFewWords(Exception):
  """A cwe list longer than the vocabulary (the haystack search steps back)."""


def _cwe(rng, n, cfg, hay, context_len):
  num_cw = cfg["num_cw"]
  if n > len(hay.vocab):
    raise _TooFewWords()
  small = context_len < 4096  # RULER's fewer repeats below 4k tokens
  shot = (20, 3, 1) if small else (40, 10, 3)
  freq = (6, 1) if small else (cfg["freq_cw"], cfg["freq_ucw"])
  template, prefix, _ = TEMPLATES["common_words_extraction"]
  ctx, top = _cwe_list(rng, hay.vocab, *shot, num_cw)
  few_shot = (template.format(context=ctx) + prefix + " " +
              " ".join(f"{i + 1}. {w}" for i, w in enumerate(top)))
  ctx, top = _cwe_list(rng, hay.vocab, n, *freq, num_cw)
  return _Prompt(few_shot + "\n" + template.format(context=ctx), prefix, top, {})


# ----------------------------------------------------------------------------- fwe


def _zeta(alpha: float) -> float:
  """Riemann zeta at ``alpha`` > 1 (Euler-Maclaurin after 1,000 terms)."""
  if alpha == 2.0:
    return math.pi ** 2 / 6
  n = 1000
  head = sum(k ** -alpha for k in range(1, n))
  return head + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha + alpha / 12 * n ** (-alpha - 1)


def _fwe(rng, n, cfg, hay, context_len):
  """freq_words_extraction.py: coded words of 6 letters with zeta(alpha) counts; the most
  frequent is '...' (noise) and the next three are the answer."""
  del hay
  gen = TEMPLATES["freq_words_extraction"][2]
  vocab_size = (context_len - gen) // 50
  if vocab_size < 4:
    raise ValueError(f"context_len={context_len}: fwe needs (context_len - {gen}) // 50 >= 4 "
                     "coded words")
  vocab = set()
  while len(vocab) < vocab_size:
    vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
  vocab = sorted(vocab)
  rng.shuffle(vocab)
  vocab[0] = "..."
  alpha = cfg["alpha"]
  z = _zeta(alpha)
  words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(n * k ** -alpha / z))]
  rng.shuffle(words)
  template, prefix, _ = TEMPLATES["freq_words_extraction"]
  return _Prompt(template.format(context=" ".join(words)), prefix, vocab[1:4],
                 {"vocab_size": vocab_size})


_BUILDERS = {"niah": _niah, "variable_tracking": _vt, "common_words_extraction": _cwe,
             "freq_words_extraction": _fwe}


# ----------------------------------------------------------------------------- sizing


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
    ``n_haystack`` (noise lines, essay words, needles, list words or coded words)
    and ``n_prompt_tokens``.
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
  hay = Haystack.from_text(haystack)
  kind, cfg = CONFIGS[name]
  build = _BUILDERS[kind]
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
      except _TooFewWords:
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
