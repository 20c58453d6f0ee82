"""A small GPT-2-style decoder in plain JAX that evicts its KV cache with certkv_jax.

Written independently of ``models/llama.py`` to show what a model of one's own
needs to use the eviction designs: its attention layer computes q, k, v as
usual and calls :func:`certkv_jax.layer.attend` with its layer's slice of the
caches (``certkv_jax.kv.caches``); the learned position embedding reads
:func:`certkv_jax.layer.positions`, which continue from the tokens each cache
has seen, kept or evicted. Between calls :func:`certkv_jax.eviction.evict`
applies the design, and ``certkv_jax.certificate_radius`` turns each call's
statistics into an error radius. :func:`generate` is the whole loop.

The parameters are a plain dict of arrays; GPT-2's layout (fused ``c_attn``
producing q, k, v; ``c_proj``; pre-LayerNorm blocks; tanh-GELU MLP; output
embedding tied to the token embedding), multi-head attention (no GQA).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import certkv_jax
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """Sizes of the model (frozen and hashable: a static argument of ``jax.jit``).

  Any object with ``n_layers``, ``n_kv_heads`` and ``head_dim`` sizes the
  caches (``certkv_jax.kv.caches.init_caches``); this one has them.
  """

  vocab_size: int = 97
  n_positions: int = 64
  hidden: int = 32
  n_layers: int = 2
  n_heads: int = 4

  def __post_init__(self):
    if self.hidden % self.n_heads:
      raise ValueError(f"hidden ({self.hidden}) must be a multiple of n_heads ({self.n_heads})")

  @property
  def head_dim(self) -> int:
    return self.hidden // self.n_heads

  @property
  def n_kv_heads(self) -> int:
    return self.n_heads  # multi-head attention: one KV head per query head


def init_params(config: GPT2Config, key) -> dict:
  """Random parameters.

  The scales are larger than GPT-2's 0.02 so that a tiny random model has
  attention that is neither uniform nor one-hot (logit spread of a few units)
  and logits that depend on the context. LayerNorms start at gain 1 and bias
  0 as in GPT-2; the linear biases are small random values (GPT-2 starts them
  at 0) so that a reference check exercises them.
  """
  h = config.hidden
  keys = iter(jax.random.split(key, 2 + 8 * config.n_layers))
  normal = lambda shape, std: std * jax.random.normal(next(keys), shape, jnp.float32)
  ln = lambda: {"g": jnp.ones((h,), jnp.float32), "b": jnp.zeros((h,), jnp.float32)}
  dense = lambda n_in, n_out, gain, bias: {"w": normal((n_in, n_out), gain / n_in**0.5),
                                           "b": normal((n_out,), bias)}
  blocks = []
  for _ in range(config.n_layers):
    blocks.append({
        "ln_1": ln(),
        "attn": {"c_attn": dense(h, 3 * h, 1.5, 0.1), "c_proj": dense(h, h, 0.5, 0.02)},
        "ln_2": ln(),
        "mlp": {"c_fc": dense(h, 4 * h, 1.0, 0.02), "c_proj": dense(4 * h, h, 0.5, 0.02)},
    })
  return {"wte": normal((config.vocab_size, h), 1.0), "wpe": normal((config.n_positions, h), 0.5),
          "h": blocks, "ln_f": ln()}


def layer_norm(p, x, eps: float = 1e-5):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["g"] + p["b"]


def linear(p, x):
  return x @ p["w"] + p["b"]


def qkv(block: dict, config: GPT2Config, x):
  """The attention inputs of one block: q, k, v ``[b, t, n_heads, head_dim]``."""
  b, t, _ = x.shape
  fused = linear(block["attn"]["c_attn"], layer_norm(block["ln_1"], x))
  q, k, v = jnp.split(fused, 3, axis=-1)
  heads = lambda a: a.reshape(b, t, config.n_heads, config.head_dim)
  return heads(q), heads(k), heads(v)


@functools.partial(jax.jit, static_argnames=("config", "settings"))
def forward(params, config: GPT2Config, tokens, valid, caches, *,
            settings: layer.Settings = layer.Settings(), shadow=None):
  """A chunk of new tokens (a prompt, or one decode step) through the model and caches.

  Args:
    params: from :func:`init_params`.
    config: the model's sizes.
    tokens: [b, t] int token ids.
    valid: [b, t] bool, False on right padding.
    caches: a ``certkv_jax.kv.caches.Caches``: ``init_caches(config, b, capacity)``
      or the caches of the previous call (``caches.layer(i)`` is layer i's).
      They must have room for the chunk: evict before appending (under ``jit``
      a token that finds no free slot is dropped and counted in each layer's
      ``overflow``; ``settings.checked`` raises through ``checkify``).
      Positions beyond ``n_positions`` are not checked.
    settings: ``certkv_jax.layer.Settings``: the design whose slot statistics
      are folded, ``observe`` (False on decode steps), the certificate.
    shadow: evaluation mode: ``certkv_jax.kv.caches.shadow_caches(config, b, n_tokens)``,
      never evicted; the statistics then hold the true error.

  Returns:
    ``(logits [b, t, vocab] float32, caches, stats, shadow)``: ``stats`` a
    ``ChunkStats`` whose fields are ``[n_layers, b, n_heads, t]`` (None
    without the certificate).
  """
  b, t = tokens.shape
  pos = layer.positions(caches.layer(0), valid)  # every layer has seen the same tokens
  x = params["wte"][tokens] + params["wpe"][pos]
  per_layer = []
  for i, block in enumerate(params["h"]):
    q, k, v = qkv(block, config, x)
    res = layer.attend(q, k, v, caches.layer(i), valid=valid,
                       shadow=None if shadow is None else shadow.layer(i),
                       settings=settings)
    caches = caches.with_layer(i, res.cache)
    if shadow is not None:
      shadow = shadow.with_layer(i, res.shadow)
    per_layer.append(res.stats)
    x = x + linear(block["attn"]["c_proj"], res.out.reshape(b, t, config.hidden))
    hid = jax.nn.gelu(linear(block["mlp"]["c_fc"], layer_norm(block["ln_2"], x)),
                      approximate=True)  # GPT-2's tanh approximation
    x = x + linear(block["mlp"]["c_proj"], hid)
  logits = layer_norm(params["ln_f"], x) @ params["wte"].T
  return logits, caches, layer.stack_stats(per_layer), shadow


def generate(params, config: GPT2Config, tokens, key, *, design, n_steps: int, capacity: int):
  """Greedy decoding with eviction after the prompt and after every step.

  Args:
    tokens: [b, t] prompt token ids (no padding).
    key: PRNG key of the randomized designs' draws.
    design: an eviction design, e.g. ``certkv_jax.designs.registry.make("poisson_tail", 0.5)``.
    n_steps: tokens to generate.
    capacity: cache slots; at least the prompt length, and the design's
      budget plus one (the token appended before each eviction).

  Returns:
    ``(new tokens [b, n_steps], radii [n_steps, n_layers, b, n_heads])``: the
    certificate radius at delta 0.05 of every decode step's attention calls
    (zero under a deterministic design, which cannot certify its error).
  """
  if tokens.shape[1] + n_steps > config.n_positions:
    raise ValueError(f"{tokens.shape[1]} prompt tokens + n_steps={n_steps} exceed "
                     f"n_positions={config.n_positions}")
  caches = caches_lib.init_caches(config, tokens.shape[0], capacity)
  one = jnp.ones(tokens.shape, bool)
  logits, caches, _, _ = forward(params, config, tokens, one, caches,
                                 settings=layer.Settings(design, certificate=False))  # no radius
  evicted = eviction.evict(design, caches, key)
  new, radii = [], []
  for step in range(n_steps):
    new.append(jnp.argmax(logits[:, -1], axis=-1)[:, None])
    logits, caches, stats, _ = forward(params, config, new[-1], one[:, :1], evicted.caches,
                                       settings=layer.Settings(design, observe=False))
    evicted = eviction.evict(design, caches, jax.random.fold_in(key, step + 1),
                             state=evicted.state)
    radii.append(certkv_jax.certificate_radius(stats, 0.05)[..., 0])
  return jnp.concatenate(new, axis=1), jnp.stack(radii)
