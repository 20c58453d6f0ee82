"""Loads Hugging Face safetensors checkpoints of Llama / Mistral / Qwen2 models.

A checkpoint directory holds ``config.json`` and either ``model.safetensors``
or shards ``model-0000i-of-0000n.safetensors`` listed in
``model.safetensors.index.json``. Tensors are read with the ``safetensors``
numpy backend (bfloat16 through ``ml_dtypes``); torch is never imported.

Hugging Face's Q/K rows are in the ``"half"`` (rotate-half) RoPE layout, which
is what the returned config says; weights are transposed to Flax's
``[in, out]`` kernels and stacked over layers (see ``models.llama``).
``dtype="bfloat16"`` stores the matrices in bfloat16 and returns a config that
computes in it (:mod:`models.precision`).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
from safetensors import safe_open

from models import param_tree
from models import precision
from models.config import LlamaConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Hugging Face name inside a layer -> (our path inside `layers`, transpose?)
_LAYER_NAMES = {
    "input_layernorm.weight": (("attn_norm", "scale"), False),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), False),
    "self_attn.q_proj.weight": (("q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("o_proj", "kernel"), True),
    "self_attn.q_proj.bias": (("q_proj", "bias"), False),
    "self_attn.k_proj.bias": (("k_proj", "bias"), False),
    "self_attn.v_proj.bias": (("v_proj", "bias"), False),
    "self_attn.o_proj.bias": (("o_proj", "bias"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True),
}


def _rope_fields(cfg: dict) -> dict:
  """RoPE settings from either ``rope_theta``/``rope_scaling`` (transformers 4)
  or ``rope_parameters`` (transformers 5)."""
  params = dict(cfg.get("rope_parameters") or {})
  scaling = dict(cfg.get("rope_scaling") or {})
  kinds = [d.get("rope_type", d.get("type", "default")) for d in (params, scaling)]
  clash = [k for k in set(params) & set(scaling) if params[k] != scaling[k]]
  if params and scaling and (kinds[0] != kinds[1] or clash):
    raise ValueError(f"config.json: rope_parameters ({kinds[0]!r}) and rope_scaling "
                     f"({kinds[1]!r}) disagree{' on ' + str(sorted(clash)) if clash else ''}; "
                     "keep one")
  theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
  merged = {**scaling, **params}
  kind = merged.get("rope_type", merged.get("type", "default"))
  out: dict[str, Any] = {"rope_theta": float(theta)}
  if kind in ("default", None):
    return out
  def field(key):
    if key not in merged:
      raise ValueError(f"config.json: rope_scaling.{key} is missing (rope type {kind!r})")
    return merged[key]

  if kind == "linear":
    return {**out, "rope_scaling": "linear", "rope_factor": float(field("factor"))}
  if kind == "llama3":
    return {**out, "rope_scaling": "llama3", "rope_factor": float(field("factor")),
            "rope_low_freq_factor": float(field("low_freq_factor")),
            "rope_high_freq_factor": float(field("high_freq_factor")),
            "rope_original_max_positions": int(field("original_max_position_embeddings"))}
  raise ValueError(f"config.json: rope type {kind!r} is not supported "
                   "(supported: default, linear, llama3)")


def config_from_hf(cfg: dict) -> LlamaConfig:
  """A :class:`LlamaConfig` from the dict of a Hugging Face ``config.json``.

  Raises:
    ValueError naming the field for an unsupported architecture or option.
  """
  archs = cfg.get("architectures") or []
  family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if family is None:
    raise ValueError(f"config.json: architectures {archs!r} (model_type "
                     f"{cfg.get('model_type')!r}) is not supported; supported: "
                     f"{sorted(ARCHITECTURES)}")
  act = cfg.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
  if cfg.get("mlp_bias", False):
    raise ValueError("config.json: mlp_bias=true is not supported")
  n_heads = int(cfg["num_attention_heads"])
  hidden = int(cfg["hidden_size"])
  head_dim = cfg.get("head_dim") or hidden // n_heads
  sliding = None
  if family == "mistral":
    sliding = cfg.get("sliding_window")
  elif family == "qwen2" and cfg.get("use_sliding_window", False):
    raise ValueError("config.json: Qwen2 use_sliding_window=true (per-layer windows) is "
                     "not supported")
  attention_bias = bool(cfg.get("attention_bias", False))
  return LlamaConfig(
      vocab_size=int(cfg["vocab_size"]),
      hidden=hidden,
      n_layers=int(cfg["num_hidden_layers"]),
      n_heads=n_heads,
      n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
      head_dim=int(head_dim),
      ffn_dim=int(cfg["intermediate_size"]),
      rope_layout="half",
      rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      qkv_bias=family == "qwen2" or attention_bias,
      out_bias=attention_bias,
      sliding_window=None if sliding is None else int(sliding),
      max_positions=(int(cfg["max_position_embeddings"])
                     if cfg.get("max_position_embeddings") else None),
      **_rope_fields(cfg),
  )


def _weight_files(path: str) -> list[str]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(os.path.join(path, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    raise FileNotFoundError(f"checkpoint {path!r} has neither model.safetensors nor "
                            "model.safetensors.index.json")
  missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
  if missing:
    raise FileNotFoundError(f"checkpoint {path!r}: shard files {missing} listed in the "
                            "index are missing")
  return [os.path.join(path, f) for f in files]


def params_from_tensors(tensors: dict, config: LlamaConfig, dtype=None) -> dict:
  """Our ``{"params": ...}`` tree from Hugging Face tensor names -> numpy arrays, its
  matrices in ``dtype`` ("float32" or "bfloat16"; None: ``config.dtype``), the rest
  float32.

  Raises:
    ValueError naming the tensor for an unexpected name, a wrong shape, or a
    missing tensor; naming ``dtype`` and its allowed values.
  """
  c = config
  dtype = precision.check_dtype(c.dtype if dtype is None else dtype)
  shapes = param_tree.layer_shapes(c)
  layers = [dict() for _ in range(c.n_layers)]
  top: dict = {}
  for name, x in tensors.items():
    if _IGNORED.search(name):
      continue
    m = _LAYER.match(name)
    if m:
      i, rest = int(m.group(1)), m.group(2)
      if rest not in _LAYER_NAMES or i >= c.n_layers:
        raise ValueError(f"unexpected tensor {name!r} for this config (n_layers={c.n_layers})")
      path, transpose = _LAYER_NAMES[rest]
      if path not in shapes:
        raise ValueError(f"unexpected tensor {name!r}: config.json says no such bias")
      x = np.asarray(x)
      layers[i][path] = param_tree.check_shape(name, x.T if transpose else x, shapes[path])
    elif name == "model.embed_tokens.weight":
      top[("embed", "embedding")] = param_tree.check_shape(name, np.asarray(x),
                                                           (c.vocab_size, c.hidden))
    elif name == "model.norm.weight":
      top[("final_norm", "scale")] = param_tree.check_shape(name, np.asarray(x), (c.hidden,))
    elif name == "lm_head.weight":
      x = param_tree.check_shape(name, np.asarray(x), (c.vocab_size, c.hidden))
      if not c.tie_embeddings:  # tied checkpoints may still store a copy
        top[("lm_head", "kernel")] = x.T
    else:
      raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
  return param_tree.assemble(top, layers, c, dtype)


def load_hf_checkpoint(path: str, dtype="float32") -> tuple[dict, LlamaConfig]:
  """Loads a Hugging Face Llama / Mistral / Qwen2 checkpoint directory.

  Args:
    path: directory with ``config.json`` and ``model*.safetensors``.
    dtype: "float32" (default) or "bfloat16": the matrices' dtype and the
      config's ``dtype`` (:mod:`models.precision`).

  Returns:
    ``(params, config)`` for ``models.llama.LlamaModel(config).apply(params, tokens)``.

  Raises:
    ValueError naming ``dtype`` and its allowed values (before anything is read).
  """
  dtype = precision.check_dtype(dtype)
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"checkpoint {path!r} has no config.json")
  with open(cfg_path) as f:
    config = config_from_hf(json.load(f)).replace(dtype=dtype)
  tensors = {}
  for file in _weight_files(path):
    with safe_open(file, framework="np") as f:
      for name in f.keys():
        if name in tensors:  # the index names one file; a second copy would overwrite it
          raise ValueError(f"checkpoint {path!r}: tensor {name!r} is stored in more than one "
                           "shard file")
        tensors[name] = f.get_tensor(name)
  return params_from_tensors(tensors, config), config
