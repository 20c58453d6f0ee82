r"""Seeded long-context tasks with exact answers, for any tokenizer.

Every generator takes a tokenizer with ``encode(text, add_bos=...) ->
list[int]`` and ``decode(ids) -> str``, and optionally
``apply_chat_template(messages) -> str``. With a chat template the user turn
is split around its content (as ``experiments.demo_smollm2.make_examples``
does): the template's text before the content opens the context, the text
after it (end of the user turn and the assistant header) follows the
question. Without one (no method, ``None``, or a template that raises
``ValueError``) the prompt is plain text.

An :class:`Example` holds

* ``context_ids``: chat prefix + instruction + the long context (with the
  tokenizer's default BOS). Its length is at least ``context_len`` tokens of
  the given tokenizer: filler is added until the whole encoded context
  reaches it (it overshoots by about one filler piece);
* ``question_ids``: the question, the end of the user turn, the assistant
  header and an answer prefix (no BOS). ``context_ids + question_ids`` is the
  question-aware prompt; in the streaming regime the context is compressed
  before ``question_ids`` is seen;
* ``answer`` (the canonical answer string), ``answers`` (every accepted
  answer), ``metric`` (the scoring rule's name, see :data:`METRICS`), ``task``
  and ``meta`` (needle depths, hops, ...). ``example.score(text)`` scores a
  generation exactly.

Tasks (:data:`TASKS`, built by :func:`make_task`):

* ``passkey``: a five-digit pass key in repetitive filler; ``depth`` in
  [0, 1] (fraction of the filler before the needle) or None (uniform).
* ``multi_needle``: ``num_needles`` needles "One of the special magic numbers
  for <word> is: <number>." (RULER style). ``query="one"``: the needles have
  distinct words and one is asked for; ``query="all"``: they share the word
  and all numbers are asked for (every one must be produced).
* ``kv_retrieval``: random UUID keys and values (``fmt="json"`` or
  ``"lines"``), the value of one key is asked for.
* ``variable_tracking``: ``VAR ABCDE = 12345`` then ``VAR FGHIJ = VAR
  ABCDE`` ... (``num_hops`` hops) chains, with ``num_chains - 1`` distractor
  chains of other values, in filler; asks which variables equal the target
  value (exact set match).
* ``agent_memory``: a long agent log (tool calls, observations) in which a
  fact needed later (an access code) is stated once, early (``depth`` default
  uniform in [0, 0.2]), with ``num_distractors`` similar facts about other
  services; the question arrives after the log. This is the streaming
  regime's case: the log is compressed before the question is known.

:func:`depth_sweep` makes examples at a list of needle depths.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import string
from typing import Optional, Sequence

from experiments.lib.prompts import chat_parts
from experiments.lib.prompts import check_depth
from experiments.lib.prompts import check_int
from experiments.lib.prompts import encode_question
from experiments.lib.prompts import FILLER
from experiments.lib.prompts import grow_context
from experiments.lib.prompts import insert_at
from experiments.lib.prompts import NEEDLE_WORDS
from experiments.lib.prompts import random_number
from experiments.lib.prompts import random_uuid
from experiments.lib.prompts import SERVICES
from experiments.lib.prompts import TokenLengths
# Scoring rules live in experiments.lib.scoring; re-exported here for task users.
from experiments.lib.scoring import GRADED
from experiments.lib.scoring import METRICS
from experiments.lib.scoring import VAR_NAME_LEN
from experiments.lib.scoring import contains_match  # pylint: disable=unused-import
from experiments.lib.scoring import exact_match  # pylint: disable=unused-import
from experiments.lib.scoring import f1_score  # pylint: disable=unused-import
from experiments.lib.scoring import normalize_answer  # pylint: disable=unused-import
from experiments.lib.scoring import score_digits  # pylint: disable=unused-import
from experiments.lib.scoring import score_exact_prefix  # pylint: disable=unused-import
from experiments.lib.scoring import score_numbers_all  # pylint: disable=unused-import
from experiments.lib.scoring import score_set_exact  # pylint: disable=unused-import
from experiments.lib.scoring import string_match_all  # pylint: disable=unused-import
from experiments.lib.scoring import string_match_part  # pylint: disable=unused-import


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its exact answer(s); see the module docstring."""

  context_ids: list[int]
  question_ids: list[int]
  answer: str
  task: str
  meta: dict
  answers: tuple[str, ...] = ()
  metric: str = "digits"

  def __post_init__(self):
    if self.metric not in METRICS:
      raise ValueError(f"metric must be one of {sorted(METRICS)}, got {self.metric!r}")
    if not self.answers:
      object.__setattr__(self, "answers", (self.answer,))

  def score(self, generated_text: str) -> bool:
    """Whether ``generated_text`` (the text after the answer prefix) is correct."""
    return bool(METRICS[self.metric](generated_text, self.answers))

  def grade(self, generated_text: str) -> float:
    """The per-sample score in [0, 1]: RULER's string match for ``ruler_all`` /
    ``ruler_part`` (the fraction of the answers found / whether any is), else
    :meth:`score` as 1.0 or 0.0."""
    if self.metric in GRADED:
      return float(GRADED[self.metric](generated_text, self.answers))
    return float(self.score(generated_text))


# ----------------------------------------------------------------------------- tasks


def passkey(tokenizer, rng: random.Random, context_len: int, *, depth: Optional[float] = None,
            digits: int = 5, use_chat: bool = True) -> Example:
  """A pass key hidden in repetitive filler (metric ``digits``)."""
  check_depth(depth)
  check_int(digits, "digits", 1, 20)
  prefix, suffix = chat_parts(tokenizer, use_chat)
  key = random_number(rng, digits)
  d = rng.random() if depth is None else float(depth)
  needle = f"The pass key is {key}. Remember it. {key} is the pass key."
  head = prefix + ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
                   "remember it.\n\n")
  realised = []

  def render(pieces):
    body, r = insert_at(pieces, [(d, needle)])
    realised[:] = r
    return head + " ".join(body)
  ids, pieces = grow_context(tokenizer, context_len, render, lambda: rng.choice(FILLER))
  render(pieces)
  question = "\n\nWhat is the pass key?" + suffix + "The pass key is"
  return Example(ids, encode_question(tokenizer, question), key, "passkey",
                 {"depth": realised[0], "n_pieces": len(pieces), "n_context_tokens": len(ids)},
                 metric="digits")


def multi_needle(tokenizer, rng: random.Random, context_len: int, *, num_needles: int = 4,
                 query: str = "one", depths: Optional[Sequence[float]] = None,
                 digits: int = 7, use_chat: bool = True) -> Example:
  """``num_needles`` magic numbers; one asked for (``digits``) or all (``numbers_all``)."""
  check_int(num_needles, "num_needles", 1, len(NEEDLE_WORDS))
  check_int(digits, "digits", 1, 20)
  if query not in ("one", "all"):
    raise ValueError(f"query must be 'one' or 'all', got {query!r}")
  if depths is not None:
    if len(depths) != num_needles:
      raise ValueError(f"depths must have num_needles={num_needles} entries, got {len(depths)}")
    for x in depths:
      check_depth(x, "depths[i]")
  prefix, suffix = chat_parts(tokenizer, use_chat)
  values = []
  while len(values) < num_needles:  # distinct numbers
    v = random_number(rng, digits)
    if v not in values:
      values.append(v)
  if query == "one":
    words = rng.sample(NEEDLE_WORDS, num_needles)
    target = rng.randrange(num_needles)
  else:
    words = [rng.choice(NEEDLE_WORDS)] * num_needles
    target = None
  ds = [rng.random() for _ in range(num_needles)] if depths is None else list(depths)
  needles = [(ds[i], f"One of the special magic numbers for {words[i]} is: {values[i]}.")
             for i in range(num_needles)]
  head = prefix + ("Some special magic numbers are hidden within the following text. Make sure "
                   "to memorize it. I will quiz you about the numbers afterwards.\n\n")
  realised = []

  def render(pieces):
    body, r = insert_at(pieces, needles)
    realised[:] = r
    return head + " ".join(body)
  ids, pieces = grow_context(tokenizer, context_len, render, lambda: rng.choice(FILLER))
  render(pieces)
  if query == "one":
    question = (f"\n\nWhat is the special magic number for {words[target]} mentioned in the "
                f"provided text?" + suffix +
                f"The special magic number for {words[target]} mentioned in the provided text is")
    answer, answers, metric = values[target], (values[target],), "digits"
  else:
    question = (f"\n\nWhat are all the special magic numbers for {words[0]} mentioned in the "
                f"provided text?" + suffix +
                f"The special magic numbers for {words[0]} mentioned in the provided text are")
    answer, answers, metric = ", ".join(values), tuple(values), "numbers_all"
  meta = {"depths": realised, "num_needles": num_needles, "query": query, "target": target,
          "n_pieces": len(pieces), "n_context_tokens": len(ids)}
  return Example(ids, encode_question(tokenizer, question), answer, "multi_needle", meta,
                 answers, metric)


def kv_retrieval(tokenizer, rng: random.Random, context_len: int, *,
                 depth: Optional[float] = None, fmt: str = "json",
                 use_chat: bool = True) -> Example:
  """Random UUID key-value pairs; the value of one key is asked for (``exact_prefix``)."""
  check_depth(depth)
  if fmt not in ("json", "lines"):
    raise ValueError(f"fmt must be 'json' or 'lines', got {fmt!r}")
  prefix, suffix = chat_parts(tokenizer, use_chat)
  d = rng.random() if depth is None else float(depth)
  target = (random_uuid(rng), random_uuid(rng))
  seen = {target[0]}

  def next_pair():
    while True:
      k = random_uuid(rng)
      if k not in seen:
        seen.add(k)
        return (k, random_uuid(rng))
  head = prefix + ("Extract the value corresponding to the specified key in the "
                   + ("JSON object" if fmt == "json" else "list") + " below.\n\n")
  fmt_pair = (lambda p: f'"{p[0]}": "{p[1]}"') if fmt == "json" else (
      lambda p: f"{p[0]}: {p[1]}")
  realised = []

  def render(pairs):
    all_pairs, r = insert_at(pairs, [(d, target)])
    realised[:] = r
    lines = [fmt_pair(p) for p in all_pairs]
    if fmt == "json":
      return head + "JSON data:\n{" + ", ".join(lines) + "}"
    return head + "\n".join(lines)
  joiner = ", " if fmt == "json" else "\n"
  lengths = TokenLengths(tokenizer)
  # Pairs are objects, not strings: estimate each from its formatted text.
  pairs = []
  ids = tokenizer.encode(render(pairs))
  est = len(ids)
  while len(ids) < context_len:
    while est < context_len:
      p = next_pair()
      pairs.append(p)
      est += lengths(joiner + fmt_pair(p))
    ids = list(tokenizer.encode(render(pairs)))
    est = len(ids)
  render(pairs)
  quoted = f'"{target[0]}"' if fmt == "json" else target[0]
  question = (f"\n\nKey: {quoted}\nWhat is the value associated with the specified key?" + suffix +
              "The value associated with the specified key is:")
  meta = {"depth": realised[0], "num_pairs": len(pairs) + 1, "key": target[0], "fmt": fmt,
          "n_pieces": len(pairs), "n_context_tokens": len(ids)}
  return Example(list(ids), encode_question(tokenizer, question), target[1], "kv_retrieval",
                 meta, metric="exact_prefix")


def _var_name(rng: random.Random, taken: set) -> str:
  while True:
    name = "".join(rng.choice(string.ascii_uppercase) for _ in range(VAR_NAME_LEN))
    if name not in taken and name != "VALUE":
      taken.add(name)
      return name


def variable_tracking(tokenizer, rng: random.Random, context_len: int, *, num_hops: int = 4,
                      num_chains: int = 2, digits: int = 5,
                      use_chat: bool = True) -> Example:
  """Multi-hop assignment chains in filler; which variables equal the value (``set_exact``)."""
  check_int(num_hops, "num_hops", 1, 50)
  check_int(num_chains, "num_chains", 1, 20)
  check_int(digits, "digits", 1, 20)
  prefix, suffix = chat_parts(tokenizer, use_chat)
  taken, vals, chains = set(), [], []
  for _ in range(num_chains):
    v = random_number(rng, digits)
    while v in vals:
      v = random_number(rng, digits)
    vals.append(v)
    names = [_var_name(rng, taken) for _ in range(num_hops + 1)]
    stmts = [f"VAR {names[0]} = {v}."] + [f"VAR {names[i + 1]} = VAR {names[i]}."
                                          for i in range(num_hops)]
    chains.append((names, stmts))
  # Statement j of every chain sits at a random depth inside the j-th slice of
  # the context, so each chain's assignments appear in order.
  inserts, owner = [], []
  slot = 1.0 / (num_hops + 1)
  for c, (_, stmts) in enumerate(chains):
    for j, s in enumerate(stmts):
      inserts.append(((j + rng.random()) * slot, s))
      owner.append(c)
  head = prefix + ("Memorize and track the chain(s) of variable assignment hidden in the "
                   "following text.\n\n")

  def render(pieces):
    body, _ = insert_at(pieces, inserts)
    return head + " ".join(body)
  ids, pieces = grow_context(tokenizer, context_len, render, lambda: rng.choice(FILLER))
  names = chains[0][0]
  question = (f"\n\nQuestion: Find all variables that are assigned the value {vals[0]} in the "
              f"text above." + suffix +
              f"Answer: According to the chain(s) of variable assignment in the text above, "
              f"{len(names)} variables are assigned the value {vals[0]}, they are:")
  meta = {"num_hops": num_hops, "num_chains": num_chains, "value": vals[0],
          "depths": [d for (d, _), o in zip(inserts, owner) if o == 0],
          "n_pieces": len(pieces), "n_context_tokens": len(ids)}
  return Example(ids, encode_question(tokenizer, question), " ".join(names),
                 "variable_tracking", meta, tuple(names), "set_exact")


_FILES = ("utils.py", "main.py", "config.yaml", "README.md", "server.go", "index.ts", "Makefile",
          "schema.sql", "app.js", "notes.txt")
_CITIES = ("Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Perth", "Dakar", "Seoul", "Rome")


def _log_line(rng: random.Random) -> str:
  kind = rng.randrange(6)
  if kind == 0:
    return (f"Tool call: read_file('{rng.choice(_FILES)}') -> {rng.randrange(10, 900)} lines, "
            f"{rng.randrange(1, 40)} functions.")
  if kind == 1:
    return (f"Tool call: search('weather in {rng.choice(_CITIES)}') -> "
            f"{rng.randrange(1, 50)} results; top result says {rng.randrange(-5, 35)} degrees.")
  if kind == 2:
    return f"Observation: the test suite ran with {rng.randrange(0, 12)} failures."
  if kind == 3:
    return (f"Thought: I should check {rng.choice(_FILES)} next, then summarise the "
            f"findings.")
  if kind == 4:
    return (f"Tool call: list_dir('src/') -> {rng.randrange(3, 60)} entries; the largest is "
            f"{rng.choice(_FILES)}.")
  return f"Observation: the build took {rng.randrange(2, 600)} seconds and succeeded."


def agent_memory(tokenizer, rng: random.Random, context_len: int, *,
                 depth: Optional[float] = None, num_distractors: int = 2, digits: int = 5,
                 use_chat: bool = True) -> Example:
  """An agent log with a fact stated once early; the question comes after it (``digits``)."""
  check_depth(depth)
  check_int(num_distractors, "num_distractors", 0, len(SERVICES) - 1)
  check_int(digits, "digits", 1, 20)
  prefix, suffix = chat_parts(tokenizer, use_chat)
  services = rng.sample(SERVICES, num_distractors + 1)
  codes = []
  while len(codes) < len(services):
    c = random_number(rng, digits)
    if c not in codes:
      codes.append(c)
  d = rng.uniform(0.0, 0.2) if depth is None else float(depth)
  facts = [(d, f"Note from the user: the access code for the {services[0]} server is "
               f"{codes[0]}. You will need it later.")]
  for s, c in zip(services[1:], codes[1:]):
    facts.append((rng.random(), f"Observation: the access code for the {s} server is {c}."))
  head = prefix + ("You are an agent working on a software project. Here is your log so "
                   "far.\n\n")
  realised = []

  def render(lines):
    body, r = insert_at(lines, facts)
    realised[:] = r
    return head + "\n".join(f"[step {i + 1}] {ln}" for i, ln in enumerate(body))
  ids, lines = grow_context(tokenizer, context_len, render, lambda: _log_line(rng),
                    joiner="\n[step 100] ")
  render(lines)
  question = (f"\n\nNew message from the user: what is the access code for the {services[0]} "
              f"server?" + suffix + f"The access code for the {services[0]} server is")
  meta = {"depth": realised[0], "service": services[0], "num_distractors": num_distractors,
          "distractor_depths": realised[1:], "n_pieces": len(lines),
          "n_context_tokens": len(ids)}
  return Example(ids, encode_question(tokenizer, question), codes[0], "agent_memory", meta,
                 metric="digits")


_GENERATORS = {
    "passkey": passkey,
    "multi_needle": multi_needle,
    "kv_retrieval": kv_retrieval,
    "variable_tracking": variable_tracking,
    "agent_memory": agent_memory,
}
TASKS = tuple(_GENERATORS)
MIN_CONTEXT_LEN = 16


def make_task(name: str, tokenizer, num_examples: int, context_len: int, seed: int,
              **kw) -> list[Example]:
  """``num_examples`` seeded examples of task ``name`` (one of :data:`TASKS`).

  Args:
    name: task name.
    tokenizer: see the module docstring.
    num_examples: int >= 1.
    context_len: int >= 16: minimum context length in tokens of ``tokenizer``.
    seed: int; the same arguments give the same examples.
    **kw: the task's options (see its generator), e.g. ``depth=0.5``.

  Returns:
    A list of :class:`Example`.
  """
  if name not in _GENERATORS:
    raise ValueError(f"name must be one of {TASKS}, got {name!r}")
  check_int(num_examples, "num_examples", 1)
  check_int(context_len, "context_len", MIN_CONTEXT_LEN)
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ValueError(f"seed must be an int, got {seed!r}")
  fn = _GENERATORS[name]
  allowed = [p for p in inspect.signature(fn).parameters if p not in ("tokenizer", "rng",
                                                                       "context_len")]
  bad = sorted(set(kw) - set(allowed))
  if bad:
    raise ValueError(f"unknown option(s) {bad} for task {name!r}; allowed: {allowed}")
  rng = random.Random(f"{name}:{seed}")
  return [fn(tokenizer, rng, context_len, **kw) for _ in range(num_examples)]


def depth_sweep(name: str, tokenizer, depths: Sequence[float], num_examples: int,
                context_len: int, seed: int, **kw) -> list[Example]:
  """``num_examples`` examples at each needle depth (tasks with a ``depth`` option), in
  ``depths`` order; depth ``i`` uses seed ``(seed, i)``."""
  if name not in ("passkey", "kv_retrieval", "agent_memory"):
    raise ValueError(f"name must be a task with a depth option ('passkey', 'kv_retrieval', "
                     f"'agent_memory'), got {name!r}")
  if "depth" in kw:
    raise ValueError("pass the depths as depths=, not depth=")
  for d in depths:
    check_depth(d, "depths[i]")
  out = []
  for i, d in enumerate(depths):
    out += make_task(name, tokenizer, num_examples, context_len, seed * 1_000_003 + i,
                     depth=d, **kw)
  return out
