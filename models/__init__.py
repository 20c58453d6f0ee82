"""Flax decoder models that run a certkv_jax design in every attention layer
(through ``certkv_jax.layer.attend``).

:mod:`models.llama` (the decoder), :mod:`models.decode` (generation),
:mod:`models.forward` and :mod:`models.prefill` (chunks through the caches),
loaders (:mod:`models.hf_loader`, :mod:`models.gguf_loader`), the tokenizer
and :mod:`models.text` (text in, answer and certificate out).
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
from certkv_jax.designs.budgets import pyramid_budgets
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
