"""The answer as text: where it ends (stop ids) and how it is shown (whole characters).

Byte-level tokens can split a character, so :class:`WholeChars` shows each one
with the token that completes it.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import numpy as np

# End strings that stop generation when they are single tokens (beside eos_id).
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>",
               "</s>")


def stop_ids(tokenizer) -> tuple:
  """The ids that end an answer: ``eos_id`` and each :data:`END_OF_TURN` string that
  is one token of the vocabulary."""
  ids = set()
  eos = getattr(tokenizer, "eos_id", None)
  if eos is not None:
    ids.add(int(eos))
  backend = getattr(tokenizer, "backend", None)
  if backend is not None and hasattr(backend, "token_to_id"):
    for s in END_OF_TURN:
      i = backend.token_to_id(s)
      if i is not None:
        ids.add(int(i))
  return tuple(sorted(ids))


def truncate_at_stop(tokens, stops: Sequence[int]) -> tuple[np.ndarray, bool, Optional[int]]:
  """``(tokens before the first stop id, whether one occurred, that id)`` for
  ``tokens`` [n] (empty ``stops`` cut nothing)."""
  tokens = np.asarray(tokens).reshape(-1)
  hits = np.flatnonzero(np.isin(tokens, np.asarray(list(stops), tokens.dtype)))
  if hits.size == 0:
    return tokens, False, None
  j = int(hits[0])
  return tokens[:j], True, int(tokens[j])


def answer(tokenizer, tokens) -> str:
  """The text of ``tokens`` before the first of :func:`stop_ids`: what a task scores
  (a fixed-length generation runs on past the end of its turn)."""
  ids, _, _ = truncate_at_stop(tokens, stop_ids(tokenizer))
  return tokenizer.decode(ids.tolist())


class WholeChars:
  """Incremental decoding into whole characters: :meth:`push` a token, get the
  text it completes (``""`` while a character is still open)."""

  def __init__(self, tokenizer):
    self._tok, self._ids, self._done = tokenizer, [], ""

  def push(self, token) -> str:
    self._ids.append(int(token))
    text = self._tok.decode(self._ids)
    if text.endswith("\ufffd") or not text.startswith(self._done):
      return ""  # inside a character: shown with the token that completes it
    piece, self._done = text[len(self._done):], text
    return piece


def text_pieces(tokenizer, ids) -> tuple:
  """Per token, the whole characters it completes (they join to :func:`whole_text`)."""
  chars = WholeChars(tokenizer)
  return tuple(chars.push(t) for t in ids)


def whole_text(tokenizer, ids) -> str:
  """``tokenizer.decode(ids)`` without a character cut off at the end."""
  return "".join(text_pieces(tokenizer, ids))


class TokenStream:
  """Prints an answer's whole characters as decoded, up to the first stop id
  (``generate_text(on_token=...)``); ``enabled = False`` silences it."""

  def __init__(self, tokenizer, stops: Sequence[int], write=None):
    self._tok, self._stops = tokenizer, set(int(s) for s in stops)
    self._write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    self.enabled = True
    self.reset()

  def reset(self):
    self._chars, self._stopped = WholeChars(self._tok), False

  def __call__(self, step, tokens):
    del step
    if not self.enabled or self._stopped:
      return
    token = int(np.asarray(tokens).reshape(-1)[0])
    if token in self._stops:
      self._stopped = True
      return
    piece = self._chars.push(token)
    if piece:
      self._write(piece)
