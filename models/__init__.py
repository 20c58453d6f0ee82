"""Flax decoder models that run a certkv_jax design in every attention layer
(through the drop-in ``certkv_jax.layer.attend``).

* :mod:`models.config` -- :class:`LlamaConfig`, the frozen hyperparameters.
* :mod:`models.rope` -- rotary embeddings, interleaved and rotate-half layouts.
* :mod:`models.llama` -- the Llama-family decoder (:class:`LlamaModel`).
* :mod:`models.decode` -- question-aware and streaming generation (prefill,
  eviction, ``lax.scan`` decode) under a frozen ``GenerationConfig``;
  ``decode_step`` for a caller's own loop (caches donated).
* :mod:`models.forward` -- a chunk of tokens through the model and its caches.
* :mod:`models.prefill` -- a long prompt into the caches chunk by chunk, in bounded memory.
* :mod:`models.memory` -- bytes of a run's caches (K/V, metadata) vs. the full cache.
* :mod:`models.param_tree` -- the parameter tree from per-layer tensors (loaders).
* :mod:`models.precision` -- the dtype option: float32 or bfloat16 weights and caches.
* :mod:`models.hf_loader` -- Hugging Face safetensors checkpoints (Llama, Mistral, Qwen2).
* :mod:`models.gguf_loader` -- GGUF files; the default model SmolLM2-135M-Instruct.
* :mod:`models.gguf_reader` -- opening a GGUF file and reading its metadata.
* :mod:`models.tokenizer` -- byte-level BPE tokenizer from GGUF metadata.
* :mod:`models.text` -- text in, answer and certificate out (``generate_text``).
"""

from models import config
from models import decode
from models import forward
from models import gguf_loader
from models import gguf_reader
from models import hf_loader
from models import llama
from models import memory
from models import param_tree
from models import precision
from models import prefill
from models import rope
from models import tokenizer
from certkv_jax.budgets import pyramid_budgets
from models.config import LlamaConfig
from models.decode import forward_chunk
from models.decode import generate
from models.decode import generate_streaming
from models.decode import init_caches
from models.gguf_loader import load_gguf
from models.gguf_loader import load_smollm2
from models.hf_loader import load_hf_checkpoint
from models.llama import LlamaModel
from models.llama import init_params

__all__ = [
    "LlamaConfig",
    "LlamaModel",
    "config",
    "decode",
    "forward",
    "forward_chunk",
    "generate",
    "generate_streaming",
    "gguf_loader",
    "gguf_reader",
    "hf_loader",
    "init_caches",
    "init_params",
    "llama",
    "memory",
    "param_tree",
    "precision",
    "prefill",
    "pyramid_budgets",
    "load_gguf",
    "load_hf_checkpoint",
    "load_smollm2",
    "rope",
    "tokenizer",
]
