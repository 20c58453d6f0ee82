"""A Llama-family decoder in flax.linen: RMSNorm, RoPE, GQA attention, SwiGLU.

Llama 1-3, Mistral, Qwen2, SmolLM2: ``LlamaModel(config).apply(params, tokens)``.
Parameters (``{"params": ...}``, layers stacked on a leading axis by ``nn.scan``)::

    embed/embedding                       [vocab, hidden]
    layers/attn_norm/scale                [L, hidden]
    layers/{q,k,v}_proj/kernel            [L, hidden, heads * head_dim]   (+ bias)
    layers/o_proj/kernel                  [L, n_heads * head_dim, hidden] (+ bias)
    layers/mlp_norm/scale                 [L, hidden]
    layers/mlp/{gate,up}_proj/kernel      [L, hidden, ffn_dim]
    layers/mlp/down_proj/kernel           [L, ffn_dim, hidden]
    final_norm/scale                      [hidden]
    lm_head/kernel                        [hidden, vocab]   (absent if tied)

:meth:`Block.qkv` and :meth:`Block.finish` are a block's two halves, so that
cached decoding can put a KV cache between them. Matrix products take operands
in ``config.dtype`` and accumulate in float32; everything else is float32
(:mod:`models.precision`).
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
from flax.linen import dtypes as flax_dtypes
import jax
import jax.numpy as jnp

from certkv_jax import _validate
from models import inputs
from models import precision
from models import rope
from models.config import LlamaConfig

Array = jax.Array
_NEG = -1e30  # masked logit: finite, so a fully masked row cannot produce NaN
# Up to this many rows the tied output projection reads the embedding in place.
_FEW_ROWS = 64


def _dot_f32(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """``lax.dot_general`` of narrow operands accumulating in float32 (a Flax ``dot_general``)."""
  del precision, preferred_element_type
  return jax.lax.dot_general(lhs, rhs, dimension_numbers,
                             precision=jax.lax.Precision.DEFAULT,
                             preferred_element_type=jnp.float32)


def _promote_keep_bias(inputs, kernel, bias, dtype=None, inexact=True):
  """Flax's ``promote_dtype`` for narrow operands: inputs and kernel in ``dtype``, the
  (float32) bias left as it is, so it is added to the float32 product unrounded."""
  inputs, kernel = flax_dtypes.promote_dtype(inputs, kernel, dtype=dtype, inexact=inexact)
  return inputs, kernel, bias


def _dense_kw(dtype) -> dict:
  """Flax ``Dense`` arguments: operands in ``dtype``, float32 accumulation and bias if
  narrower; float32 products at ``HIGHEST`` (a GPU's default is TF32)."""
  kw = dict(dtype=dtype, param_dtype=jnp.float32)
  if precision.is_low_precision(dtype):
    kw["dot_general"] = _dot_f32
    kw["promote_dtype"] = _promote_keep_bias
  else:
    kw["precision"] = jax.lax.Precision.HIGHEST
  return kw


class RMSNorm(nn.Module):
  """``x / rms(x) * scale``, computed in float32."""

  eps: float = 1e-5

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


class SwiGLU(nn.Module):
  """``down(silu(gate(x)) * up(x))``."""

  hidden: int
  ffn_dim: int
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x):
    dense = lambda n, name: nn.Dense(n, use_bias=False, name=name, **_dense_kw(self.dtype))
    return dense(self.hidden, "down_proj")(
        nn.silu(dense(self.ffn_dim, "gate_proj")(x)) * dense(self.ffn_dim, "up_proj")(x))


def attention_mask(positions, token_mask, sliding_window: Optional[int] = None) -> Array:
  """[batch, seq, seq] bool: query ``i`` may attend key ``j`` (causal, real keys,
  within ``sliding_window`` if set)."""
  qp, kp = positions[:, :, None], positions[:, None, :]
  allowed = (kp <= qp) & token_mask[:, None, :]
  if sliding_window is not None:
    allowed &= kp > qp - sliding_window
  return allowed


def grouped_attention(q, k, v, allowed) -> Array:
  """Float32 softmax attention with grouped KV heads: q [batch, seq_q, n_heads, d],
  k, v [batch, seq_k, n_kv_heads, d], allowed [batch, seq_q, seq_k] -> like q."""
  b, s, h, d = q.shape
  h_kv = k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, s, h_kv, h // h_kv, d)
  hp = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32),
                      precision=hp) / math.sqrt(d)
  logits = jnp.where(allowed[:, None, None], logits, _NEG)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(jnp.float32), precision=hp)
  return out.reshape(b, s, h, d)


class Block(nn.Module):
  """One pre-norm decoder block."""

  config: LlamaConfig

  def setup(self):
    c = self.config
    dense = lambda n, bias, name: nn.Dense(n, use_bias=bias, name=name, **_dense_kw(c.dtype))
    self.attn_norm = RMSNorm(c.rms_eps)
    self.q_proj = dense(c.n_heads * c.head_dim, c.qkv_bias, "q_proj")
    self.k_proj = dense(c.n_kv_heads * c.head_dim, c.qkv_bias, "k_proj")
    self.v_proj = dense(c.n_kv_heads * c.head_dim, c.qkv_bias, "v_proj")
    self.qkv_proj = nn.DenseGeneral((c.n_kv_heads, _group(c) + 2, c.head_dim),
                                    use_bias=c.qkv_bias, name="qkv_proj",
                                    **_dense_kw(c.dtype))
    self.o_proj = dense(c.hidden, c.out_bias, "o_proj")
    self.mlp_norm = RMSNorm(c.rms_eps)
    self.mlp = SwiGLU(c.hidden, c.ffn_dim, c.dtype)

  def qkv(self, x, positions):
    """q [b, s, n_heads, head_dim], k and v [b, s, n_kv_heads, head_dim] of ``x``
    [b, s, hidden] after RoPE, fused ``qkv_proj`` (:func:`fuse_qkv`) or not."""
    c = self.config
    b, s, _ = x.shape
    h = self.attn_norm(x)
    if self.has_variable("params", "qkv_proj"):  # fused (fuse_qkv): one product, not three
      g = _group(c)
      out = self.qkv_proj(h)  # [b, s, n_kv_heads, g + 2, head_dim]
      q = out[..., :g, :].reshape(b, s, c.n_heads, c.head_dim)
      k, v = out[..., g, :], out[..., g + 1, :]
    else:
      q = self.q_proj(h).reshape(b, s, c.n_heads, c.head_dim)
      k = self.k_proj(h).reshape(b, s, c.n_kv_heads, c.head_dim)
      v = self.v_proj(h).reshape(b, s, c.n_kv_heads, c.head_dim)
    return rope.apply_rope(q, positions, c), rope.apply_rope(k, positions, c), v

  def finish(self, x, attn):
    """Residual stream after the block, given attention outputs [b, s, n_heads, head_dim]."""
    b, s = x.shape[:2]
    x = x + self.o_proj(attn.reshape(b, s, -1).astype(x.dtype))
    return x + self.mlp(self.mlp_norm(x))

  def __call__(self, x, positions, allowed):
    """``(x, None)``: the scan-carry form (``nn.scan`` over layers)."""
    q, k, v = self.qkv(x, positions)
    return self.finish(x, grouped_attention(q, k, v, allowed)), None


class LlamaModel(nn.Module):
  """The decoder: ``apply(params, tokens[, mask, positions])`` -> float32 logits."""

  config: LlamaConfig

  def setup(self):
    c = self.config
    self.embed = nn.Embed(c.vocab_size, c.hidden, dtype=c.dtype, param_dtype=jnp.float32,
                          embedding_init=nn.initializers.normal(0.02))
    self.layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=(nn.broadcast, nn.broadcast), length=c.n_layers)(c)
    self.final_norm = RMSNorm(c.rms_eps)
    if not c.tie_embeddings:
      self.lm_head = nn.Dense(c.vocab_size, use_bias=False, **_dense_kw(c.dtype))

  def embed_tokens(self, tokens):
    """[batch, seq] int -> [batch, seq, hidden] float32 (the residual stream)."""
    return self.embed(tokens).astype(jnp.float32)

  def head(self, x):
    """Final norm and output projection: [..., hidden] -> float32 [..., vocab]."""
    h = self.final_norm(x).astype(jnp.float32)
    if self.config.tie_embeddings:
      emb, rows = self.embed.embedding, math.prod(h.shape[:-1])
      if precision.is_low_precision(emb.dtype):  # bf16 x bf16 -> f32: no f32 copy of it
        h, dot = h.astype(emb.dtype), dict(preferred_element_type=jnp.float32)
        if rows == 1:  # XLA's CPU bf16 matrix-vector product is fast only this way round
          return jnp.matmul(h, emb.T, **dot)
      else:
        emb, dot = emb.astype(jnp.float32), dict(precision=jax.lax.Precision.HIGHEST)
      if rows <= _FEW_ROWS:  # decode: the embedding as it lies, no copy
        return jnp.einsum("vd,...d->...v", emb, h, **dot)
      return jnp.matmul(h, emb.T, **dot)
    return self.lm_head(h).astype(jnp.float32)

  def __call__(self, tokens, mask=None, positions=None):
    """Full forward pass.

    Args:
      tokens: [batch, seq] int token ids in ``[0, vocab_size)``, seq >= 1.
      mask: optional [batch, seq] bool, False on (right) padding, never attended
        to; an all-False row gives finite, meaningless logits.
      positions: optional [batch, seq] int positions; default ``0..seq-1``.

    Returns:
      [batch, seq, vocab] float32 logits (rows at padding are not meaningful).

    Raises:
      ValueError naming the argument: ``tokens`` not a non-empty int [batch, seq]
      array or (when concrete) with an id out of range; ``mask`` or
      ``positions`` of the wrong shape or dtype.
    """
    c = self.config
    tokens = jnp.asarray(tokens)
    inputs.check_tokens(tokens, config=c)
    if mask is None:
      mask = jnp.ones(tokens.shape, bool)
    mask = jnp.asarray(mask)
    if mask.shape != tokens.shape or mask.dtype != jnp.bool_:
      raise ValueError(f"mask must be bool {tokens.shape}, got {mask.dtype} {mask.shape}")
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    positions = jnp.asarray(positions)
    if positions.shape != tokens.shape:
      raise ValueError(f"positions must be {tokens.shape}, got {positions.shape}")
    allowed = attention_mask(positions, mask, c.sliding_window)
    x, _ = self.layers(self.embed_tokens(tokens), positions, allowed)
    return self.head(x)


def init_params(config: LlamaConfig, key, seq: int = 8):
  """Random parameters ``{"params": ...}``; ``seq`` (int >= 1) is the length of the
  dummy prompt traced, which they do not depend on."""
  seq = _validate.check_positive_int("seq", seq)
  return LlamaModel(config).init(key, jnp.zeros((1, seq), jnp.int32))


def _group(config: LlamaConfig) -> int:
  return config.n_heads // config.n_kv_heads


_QKV = ("q_proj", "k_proj", "v_proj")


def fuse_qkv(layer, config: LlamaConfig) -> dict:
  """One layer's params with q, k, v projections replaced by ``qkv_proj``, kernel
  ``[hidden, n_kv_heads, group + 2, head_dim]`` (each KV head's queries, key, value)."""
  if "qkv_proj" in layer:
    return layer
  g, n_kv, d = _group(config), config.n_kv_heads, config.head_dim
  heads = lambda w, n: w.reshape(w.shape[:-1] + (n_kv, n, d))
  fused = {name: jnp.concatenate([heads(layer[p][name], n) for p, n in zip(_QKV, (g, 1, 1))],
                                 axis=-2)
           for name in layer["q_proj"]}
  return {**{k: v for k, v in layer.items() if k not in _QKV}, "qkv_proj": fused}


def unfuse_qkv(layer) -> dict:
  """The inverse of :func:`fuse_qkv` (params without ``qkv_proj`` returned as they are)."""
  if "qkv_proj" not in layer:
    return layer
  fused = layer["qkv_proj"]
  g = fused["kernel"].shape[-2] - 2
  split = {name: jnp.split(w, [g, g + 1], axis=-2) for name, w in fused.items()}
  parts = {p: {name: ws[j].reshape(ws[j].shape[:-3] + (-1,)) for name, ws in split.items()}
           for j, p in enumerate(_QKV)}
  return {**{k: v for k, v in layer.items() if k != "qkv_proj"}, **parts}


def layer_params(params, i: int):
  """Layer ``i``'s parameters (a slice of the stacked ``layers`` subtree)."""
  return jax.tree_util.tree_map(lambda x: x[i], params["params"]["layers"])
