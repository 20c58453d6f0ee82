"""The configuration of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2).

A frozen, hashable dataclass: it is static metadata (a ``jit`` static argument
or a Flax module attribute), never a pytree of arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

ROPE_LAYOUTS = ("interleaved", "half")
ROPE_SCALINGS = (None, "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyperparameters of a Llama-family decoder.

  Attributes:
    vocab_size: number of token ids.
    hidden: residual-stream width.
    n_layers: decoder blocks.
    n_heads: query heads.
    n_kv_heads: key/value heads (GQA); divides ``n_heads``.
    head_dim: per-head width (not necessarily ``hidden // n_heads``).
    ffn_dim: SwiGLU inner width.
    rope_theta: RoPE base.
    rope_layout: how RoPE pairs the dimensions of a head: ``"interleaved"``
      rotates ``(x[2i], x[2i+1])`` (GGUF's Q/K layout, llama.cpp permutes the
      Hugging Face weights into it); ``"half"`` rotates ``(x[i], x[i + d/2])``
      (Hugging Face's ``rotate_half``).
    rms_eps: RMSNorm epsilon.
    tie_embeddings: the output projection is the transposed token embedding.
    qkv_bias: q/k/v projections have biases (Qwen2; Llama ``attention_bias``).
    out_bias: the attention output projection has a bias (Llama ``attention_bias``).
    rope_scaling: ``None``, ``"linear"`` (positions divided by
      ``rope_factor``) or ``"llama3"`` (Llama 3.1 frequency-dependent scaling).
    rope_factor, rope_low_freq_factor, rope_high_freq_factor,
    rope_original_max_positions: parameters of ``rope_scaling``.
    sliding_window: if set, a query attends to at most this many most recent
      keys, itself included (Mistral).
    max_positions: the model's context length (HF ``max_position_embeddings``,
      GGUF ``{arch}.context_length``), if known: ``models.decode`` refuses a
      prompt plus decoded tokens longer than this. None: unknown, unchecked.
    dtype: the compute dtype name (``"float32"`` default; ``"bfloat16"``): the
      matrix products' operands (the loaders store the matrices in it) and the
      cached keys and values (:mod:`models.precision`). Products accumulate in
      float32; the residual stream, norms, attention softmax and logits are float32.
  """

  vocab_size: int
  hidden: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  rope_layout: str = "half"
  rms_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  out_bias: bool = False
  rope_scaling: Optional[str] = None
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  sliding_window: Optional[int] = None
  dtype: str = "float32"
  max_positions: Optional[int] = None

  def __post_init__(self):
    for name in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "ffn_dim", "rope_original_max_positions"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    mp = self.max_positions
    if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp <= 0):
      raise ValueError(f"max_positions must be a positive int or None, got {mp!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                       f"({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.rope_layout not in ROPE_LAYOUTS:
      raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(f"rope_scaling must be one of {ROPE_SCALINGS}, got "
                       f"{self.rope_scaling!r}")
    for name in ("rope_theta", "rms_eps", "rope_factor"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
    if self.sliding_window is not None and (
        isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
        or self.sliding_window <= 0):
      raise ValueError(f"sliding_window must be None or a positive int, got "
                       f"{self.sliding_window!r}")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")

  @property
  def group_size(self) -> int:
    """Query heads per KV head."""
    return self.n_heads // self.n_kv_heads

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)
