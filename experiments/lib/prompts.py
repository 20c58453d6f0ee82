"""Prompt building blocks shared by the seeded tasks (:mod:`experiments.lib.tasks`)
and the file loaders (:mod:`experiments.lib.loaders`): filler text, the chat
template split around the user turn, growing a context to a token length,
inserting needles at depths, argument checks and random values.
"""

from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

# The chat template split around the user turn (the generation library's own).
from models.text.prompt_encoding import chat_parts  # pylint: disable=unused-import


FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.", "The river flows to the sea.", "Birds sing in the morning.",
    "The road goes on and on.", "Clouds drift over the hills.", "The old clock ticks.",
)
NEEDLE_WORDS = (
    "apple", "river", "falcon", "copper", "meadow", "lantern", "violet", "harbor",
    "canyon", "pepper", "glacier", "orchid", "saddle", "thunder", "walnut", "ember",
)
SERVICES = ("staging", "billing", "analytics", "backup", "mail", "search", "payments",
            "inventory", "auth", "metrics")


class TokenLengths:
  """Cached token counts of pieces (the same filler sentences recur)."""

  def __init__(self, tokenizer):
    self.tok = tokenizer
    self.cache = {}

  def __call__(self, text: str) -> int:
    if text not in self.cache:
      self.cache[text] = len(self.tok.encode(text, add_bos=False))
    return self.cache[text]


def grow_context(tokenizer, context_len: int, render: Callable[[list], str],
          next_piece: Callable[[], str], joiner: str = " ") -> tuple[list[int], list]:
  """Adds pieces until ``len(encode(render(pieces))) >= context_len``.

  Piece lengths are estimated from separate encodings (which, for BPE, are
  no shorter than the joint one), then checked on the full text.
  """
  lengths = TokenLengths(tokenizer)
  pieces = []
  ids = tokenizer.encode(render(pieces))
  est = len(ids)
  while len(ids) < context_len:
    while est < context_len:
      p = next_piece()
      pieces.append(p)
      est += lengths(joiner + p)
    ids = tokenizer.encode(render(pieces))
    est = len(ids)
  return list(ids), pieces


def insert_at(pieces: list, inserts: Sequence[tuple[float, str]]) -> tuple[list, list]:
  """Inserts ``(depth, text)`` pairs at ``round(depth * len(pieces))``; returns the new
  list and each insert's realised depth (index / len(pieces))."""
  n = len(pieces)
  pos = [min(n, max(0, int(round(d * n)))) for d, _ in inserts]
  out, realised = [], []
  order = sorted(range(len(inserts)), key=lambda i: (pos[i], i))
  j = 0
  for idx in range(n + 1):
    while j < len(order) and pos[order[j]] == idx:
      out.append(inserts[order[j]][1])
      j += 1
    if idx < n:
      out.append(pieces[idx])
  for i in range(len(inserts)):
    realised.append(pos[i] / n if n else 0.0)
  return out, realised


def check_depth(depth, name: str = "depth"):
  if depth is not None and not (isinstance(depth, (int, float)) and 0.0 <= depth <= 1.0):
    raise ValueError(f"{name} must be None or a number in [0, 1], got {depth!r}")


def check_int(value, name: str, lo: int, hi: Optional[int] = None):
  if not isinstance(value, int) or isinstance(value, bool) or value < lo or (
      hi is not None and value > hi):
    rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    raise ValueError(f"{name} must be an int {rng}, got {value!r}")


def random_number(rng: random.Random, digits: int) -> str:
  return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def random_uuid(rng: random.Random) -> str:
  groups = (8, 4, 4, 4, 12)
  return "-".join("".join(rng.choice("0123456789abcdef") for _ in range(g)) for g in groups)


def encode_question(tokenizer, text: str) -> list[int]:
  return list(tokenizer.encode(text, add_bos=False))
