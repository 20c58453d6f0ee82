"""A ``tokenizers`` byte-level BPE tokenizer built from GGUF metadata.

GGUF files carry the vocabulary (``tokenizer.ggml.tokens``), BPE merges
(``tokenizer.ggml.merges``), token types (1 normal, 3 control, 4 user defined),
special ids and the chat template. ``tokenizer.ggml.model == "gpt2"`` is
GPT-2-style byte-level BPE; ``tokenizer.ggml.pre`` names the pre-tokenizer
(llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_*``). For ``"smollm"`` (SmolLM2) that is
Hugging Face's ``Sequence[Digits(individual_digits=True), ByteLevel]``: every
digit is its own piece, then the GPT-2 regex.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from models.gguf_reader import metadata

# llama.cpp pre-tokenizer name -> whether digits are split one by one first.
_PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False, "starcoder": True}
_CONTROL, _USER_DEFINED = 3, 4


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A ``tokenizers.Tokenizer`` with the model's special ids and chat template."""

  backend: object  # tokenizers.Tokenizer
  bos_id: Optional[int]
  eos_id: Optional[int]
  pad_id: Optional[int]
  add_bos: bool
  chat_template: Optional[str]

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
    """Token ids of ``text`` (special-token strings in the text are recognised)."""
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    ids = self.backend.encode(text, add_special_tokens=False).ids
    add = self.add_bos if add_bos is None else add_bos
    return ([self.bos_id] if add and self.bos_id is not None else []) + list(ids)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids],
                               skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict],
                          add_generation_prompt: bool = True) -> str:
    """Renders ``[{"role": ..., "content": ...}, ...]`` with the model's template (jinja2)."""
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template (GGUF tokenizer.chat_template)")
    import jinja2  # pylint: disable=g-import-not-at-top
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt)


def build_bpe_tokenizer(tokens: Sequence[str], merges: Sequence[str],
                        token_types: Optional[Sequence[int]] = None,
                        split_digits: bool = False):
  """A byte-level BPE ``tokenizers.Tokenizer`` from a GGUF-style vocabulary.

  Args:
    tokens: token strings in id order (byte-level alphabet, ``Ġ`` for space).
    merges: ``"a b"`` merge rules in priority order.
    token_types: per-token GGUF type; control tokens (3) become special added
      tokens, user-defined ones (4) plain added tokens.
    split_digits: split every digit into its own piece before byte-level BPE.
  """
  from tokenizers import AddedToken, Tokenizer as HFTokenizer  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError("tokens contains duplicate strings")
  pairs = []
  for m in merges:
    parts = m.split(" ")
    if len(parts) != 2:
      raise ValueError(f"merge rule {m!r} is not two space-separated symbols")
    pairs.append((parts[0], parts[1]))
  tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                        use_regex=True)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                byte_level]) if split_digits else byte_level)
  tok.decoder = decoders.ByteLevel()
  if token_types is not None:
    if len(token_types) != len(tokens):
      raise ValueError(f"token_types has {len(token_types)} entries for {len(tokens)} tokens")
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(token_types) if t == _CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(token_types) if t == _USER_DEFINED]
    if special:
      tok.add_special_tokens(special)
    if user:
      tok.add_tokens(user)
  return tok


def tokenizer_from_gguf(reader) -> Tokenizer:
  """The tokenizer of a GGUF file (``gguf.GGUFReader``)."""
  kind = metadata(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', "
                     "byte-level BPE)")
  pre = metadata(reader, "tokenizer.ggml.pre", "default")
  if pre not in _PRE_TOKENIZERS:
    raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: "
                     f"{sorted(_PRE_TOKENIZERS)}")
  backend = build_bpe_tokenizer(metadata(reader, "tokenizer.ggml.tokens"),
                                metadata(reader, "tokenizer.ggml.merges"),
                                metadata(reader, "tokenizer.ggml.token_type"),
                                split_digits=_PRE_TOKENIZERS[pre])
  opt = lambda key: None if metadata(reader, key) is None else int(metadata(reader, key))
  return Tokenizer(
      backend=backend,
      bos_id=opt("tokenizer.ggml.bos_token_id"),
      eos_id=opt("tokenizer.ggml.eos_token_id"),
      pad_id=opt("tokenizer.ggml.padding_token_id"),
      add_bos=bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
      chat_template=metadata(reader, "tokenizer.chat_template"),
  )
