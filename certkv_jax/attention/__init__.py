"""Attention over a kept set: offset attention (``offset``) and one layer's attention
over its caches with certificate statistics (``certified``); method, sections 3-4."""

from certkv_jax.attention import certified
from certkv_jax.attention import offset
from certkv_jax.attention.offset import IMPLEMENTATIONS
from certkv_jax.attention.offset import AttentionConfig
from certkv_jax.attention.offset import OffsetAttentionResult
from certkv_jax.attention.offset import offset_attention
from certkv_jax.attention.offset import attention_probs
