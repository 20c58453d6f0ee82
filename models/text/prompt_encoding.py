"""A prompt as a regime feeds it: chat template, the streaming split into
context and question, and the check that it fits the model's context.

``experiments.generate`` runs these on the tokenizer alone, before the
weights are read, so a prompt that cannot run stops in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# Streaming with a one-line prompt: the question is its last this many tokens.
FALLBACK_QUESTION_TOKENS = 16


def chat_parts(tokenizer, use_chat: bool = True) -> tuple[str, str]:
  """(prefix, suffix) of the tokenizer's chat template around a user message's
  content; ``("", "\\n")`` when there is no template (plain text)."""
  fn = getattr(tokenizer, "apply_chat_template", None) if use_chat else None
  if fn is None:
    return "", "\n"
  try:
    rendered = fn([{"role": "user", "content": "\x00"}])
  except ValueError:  # e.g. models.tokenizer.Tokenizer without a template
    return "", "\n"
  if not isinstance(rendered, str) or rendered.count("\x00") != 1:
    raise ValueError("apply_chat_template must return a str containing the user content once")
  prefix, suffix = rendered.split("\x00")
  return prefix, suffix


def _chat_parts(tokenizer, chat: bool) -> tuple[str, str, bool]:
  """``(prefix, suffix, applied)`` of the chat template around the user's text;
  plain text (``"", ""``) when ``chat`` is off or the tokenizer has no template."""
  if not chat:
    return "", "", False
  prefix, suffix = chat_parts(tokenizer, True)
  if (prefix, suffix) == ("", "\n"):  # chat_parts' answer for "no template"
    return "", "", False
  return prefix, suffix, True


def split_prompt(tokenizer, prompt: str, *, chat: bool, question_tokens: int = 0):
  """The streaming regime's ``(context_ids, question_ids, question_rule, chat_applied)``.

  The question is the prompt's last line when it has several lines and
  ``question_tokens`` is 0; else its last ``question_tokens`` tokens (0: at
  most :data:`FALLBACK_QUESTION_TOKENS`), taken from the prompt's own tokens:
  the chat template's opening stays in the context, which keeps at least one
  token. Trailing whitespace of the prompt is dropped here (question-aware
  feeds the prompt as given), and the context and question are tokenized
  apart, so the two regimes can differ by a token or two where they meet.

  Raises:
    ValueError naming ``question_tokens`` when it leaves no context or reaches
    into the template, or ``prompt`` when it has no token to ask.
  """
  prefix, suffix, applied = _chat_parts(tokenizer, chat)
  body = prompt.rstrip()
  cut = body.rfind("\n")
  if question_tokens == 0 and cut >= 0 and body[:cut].strip():
    context = list(tokenizer.encode(prefix + body[:cut + 1]))
    question = list(tokenizer.encode(body[cut + 1:] + suffix, add_bos=False))
    return context, question, "the prompt's last line", applied
  ids = list(tokenizer.encode(prefix + body))
  opening = list(tokenizer.encode(prefix))  # BOS and the template's opening, if any
  n_fixed = next((i for i, (a, b) in enumerate(zip(ids, opening)) if a != b),
                 min(len(ids), len(opening)))
  room = len(ids) - max(n_fixed, 1)  # the prompt's own tokens, one context token kept
  if room < 1:
    raise ValueError(f"prompt: the streaming regime splits the prompt into a context and a "
                     f"question, which needs at least 2 tokens, one of them the prompt's; "
                     f"got {len(ids)} tokens, {n_fixed} of them before the prompt")
  if question_tokens == 0:
    n_q = min(FALLBACK_QUESTION_TOKENS, room)
    rule = f"the prompt's last {n_q} tokens (it has one line)"
  elif question_tokens <= room:
    n_q = question_tokens
    rule = f"the prompt's last {n_q} tokens (question_tokens)"
  else:
    raise ValueError(f"question_tokens must be in [0, {room}] for this prompt ({room} "
                     f"tokens of its own that the question can take, at least one token "
                     f"staying context), got {question_tokens}")
  question = ids[-n_q:] + (list(tokenizer.encode(suffix, add_bos=False)) if suffix else [])
  return ids[:-n_q], question, rule, applied


@dataclasses.dataclass(frozen=True)
class EncodedPrompt:
  """A prompt as the regime feeds it: ``context`` (question-aware: the whole
  prompt) then ``question`` (streaming only; empty otherwise)."""

  context: list
  question: list
  question_text: Optional[str]
  question_rule: Optional[str]
  chat_applied: bool

  @property
  def n_tokens(self) -> int:
    return len(self.context) + len(self.question)


def encode_prompt(tokenizer, prompt: str, *, regime: str, chat: bool,
                  question_tokens: int = 0) -> EncodedPrompt:
  """Tokenizes ``prompt`` for ``regime`` (the chat template around it when
  ``chat``; streaming: split into context and question, :func:`split_prompt`)."""
  if regime == "question_aware":
    prefix, suffix, applied = _chat_parts(tokenizer, chat)
    return EncodedPrompt(list(tokenizer.encode(prefix + prompt + suffix)), [], None, None,
                         applied)
  ctx, qst, rule, applied = split_prompt(tokenizer, prompt, chat=chat,
                                         question_tokens=question_tokens)
  return EncodedPrompt(ctx, qst, tokenizer.decode(qst), rule, applied)


def check_fits(encoded: EncodedPrompt, *, max_new_tokens: int, max_positions) -> None:
  """Raises a one-line ValueError when the prompt and the answer exceed the
  model's context (``max_positions``; None: no limit)."""
  if max_positions is None:
    return
  need = encoded.n_tokens + max_new_tokens
  if need > max_positions:
    raise ValueError(
        f"prompt: {encoded.n_tokens:,} tokens"
        f"{' with the chat template' if encoded.chat_applied else ''} plus max_new_tokens "
        f"{max_new_tokens} = {need:,} positions, more than the model's context of "
        f"{max_positions:,} tokens; shorten the prompt to at most "
        f"{max(max_positions - max_new_tokens, 0):,} tokens or lower max_new_tokens")
