"""RULER's synthetic prompt bodies (NVIDIA/RULER, scripts/data/synthetic/): the task
templates, the haystacks (noise lines, the essay text, distractor needles), and one builder
per task kind (niah, variable tracking, common and frequent words extraction).

A builder ``(rng, n, cfg, hay, context_len) -> Prompt`` renders one example with a
haystack of ``n`` units; :mod:`experiments.lib.ruler` searches the largest ``n`` that
fits a context length, wraps the prompt in the chat template and scores the answers.
Where these differ from RULER is listed there.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import string
import uuid

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

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# np.round(np.linspace(0, 100, num=40)).astype(int), as niah.py and variable_tracking.py
DEPTHS = (0, 3, 5, 8, 10, 13, 15, 18, 21, 23, 26, 28, 31, 33, 36, 38, 41, 44, 46, 49, 51, 54,
          56, 59, 62, 64, 67, 69, 72, 74, 77, 79, 82, 85, 87, 90, 92, 95, 97, 100)

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


class Prompt:
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


def _niah(rng: random.Random, n: int, cfg: dict, hay: Haystack, context_len: int) -> Prompt:
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
  return Prompt(template.format(context=context, **fill), prefix.format(**fill), answers,
                 {"keys": queries, "n_needles": len(needles)})


# ----------------------------------------------------------------------------- vt


def vt_text(rng: random.Random, n: int, num_chains: int, num_hops: int, icl: bool):
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


def _vt(rng, n, cfg, hay, context_len, icl=""):
  del hay, context_len
  body, prefix, answer = vt_text(rng, n, cfg["num_chains"], cfg["num_hops"], icl=False)
  return Prompt(icl + "\n" + body if icl else body, prefix, answer, {})


# ----------------------------------------------------------------------------- cwe


def _cwe_list(rng: random.Random, vocab, num_words: int, common: int, uncommon: int,
              num_cw: int):
  """common_words_extraction.py's ``get_example``: the numbered list and its common words."""
  words = rng.sample(vocab, num_words)
  top, rest = words[:num_cw], words[num_cw:]
  listed = top * common + rest * uncommon
  rng.shuffle(listed)
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top


class TooFewWords(Exception):
  """A cwe list longer than the vocabulary (the haystack search steps back)."""


def _cwe(rng, n, cfg, hay, context_len):
  num_cw = cfg["num_cw"]
  if n > len(hay.vocab):
    raise TooFewWords()
  small = context_len < 4096  # RULER's fewer repeats below 4k tokens
  shot = (20, 3, 1) if small else (40, 10, 3)
  freq = (6, 1) if small else (cfg["freq_cw"], cfg["freq_ucw"])
  template, prefix, _ = TEMPLATES["common_words_extraction"]
  ctx, top = _cwe_list(rng, hay.vocab, *shot, num_cw)
  few_shot = (template.format(context=ctx) + prefix + " " +
              " ".join(f"{i + 1}. {w}" for i, w in enumerate(top)))
  ctx, top = _cwe_list(rng, hay.vocab, n, *freq, num_cw)
  return Prompt(few_shot + "\n" + template.format(context=ctx), prefix, top, {})


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
  return Prompt(template.format(context=" ".join(words)), prefix, vocab[1:4],
                 {"vocab_size": vocab_size})


BUILDERS = {"niah": _niah, "variable_tracking": _vt, "common_words_extraction": _cwe,
             "freq_words_extraction": _fwe}
