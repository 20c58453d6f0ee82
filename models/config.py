"""The configuration of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2).

Frozen and hashable: static metadata (a ``jit`` static argument), not a pytree.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

ROPE_LAYOUTS = ("interleaved", "half")
ROPE_SCALINGS = (None, "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyperparameters of a Llama-family decoder."""

  vocab_size: int
  hidden: int  # residual-stream width
  n_layers: int
  n_heads: int  # query heads
  n_kv_heads: int  # key/value heads (GQA); divides n_heads
  head_dim: int  # not necessarily hidden // n_heads
  ffn_dim: int  # SwiGLU inner width
  rope_theta: float = 10000.0
  # RoPE pairs: "half" (x[i], x[i + d/2]), Hugging Face; "interleaved" (x[2i], x[2i+1]), GGUF.
  rope_layout: str = "half"
  rms_eps: float = 1e-5
  tie_embeddings: bool = False  # output projection = transposed token embedding
  qkv_bias: bool = False  # q/k/v projection biases (Qwen2; Llama attention_bias)
  out_bias: bool = False  # attention output projection bias (Llama attention_bias)
  rope_scaling: Optional[str] = None  # None, "linear" or "llama3"; parameters below
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  sliding_window: Optional[int] = None  # most recent keys a query attends, itself included
  # Compute dtype of the matrices and cached keys and values (models.precision).
  dtype: str = "float32"
  max_positions: Optional[int] = None  # context length prompts are checked against; None: unknown

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
    low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
    if self.rope_scaling == "llama3" and not 0 < low < high:
      raise ValueError(f"llama3 rope scaling needs 0 < rope_low_freq_factor < "
                       f"rope_high_freq_factor, got {low!r} and {high!r}")
    if self.sliding_window is not None and (
        isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
        or self.sliding_window <= 0):
      raise ValueError(f"sliding_window must be None or a positive int, got "
                       f"{self.sliding_window!r}")
    if self.dtype not in ("float32", "bfloat16"):  # models.precision.DTYPES
      raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

  @property
  def group_size(self) -> int:
    """Query heads per KV head."""
    return self.n_heads // self.n_kv_heads

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)
