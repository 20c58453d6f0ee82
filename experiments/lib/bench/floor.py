"""A decode step's memory floor: the bytes it must read (weights, cache slots with
their metadata), the streaming-read probe that measures this machine's bandwidth,
and two parts of the full cache's step alone: the weights' matrix-vector products
and the attention over the caches (``experiments.lib.bench.decode`` times all four
beside every step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from certkv_jax.attention import certified
from certkv_jax.kv import memory as memory_lib


def weight_bytes(params, config) -> int:
  """Bytes of weights a decode step reads: every parameter, but of an untied
  embedding only one row per token (the tied one is the output projection too)."""
  total = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(params))
  if not config.tie_embeddings:
    emb = params["params"]["embed"]["embedding"]
    total -= int(emb.nbytes) - int(emb.nbytes) // int(emb.shape[0])
  return total


def floor_bytes(params, config, design, capacity: int, batch: int, dtype=jnp.float32,
                certificate=None) -> int:
  """A decode step's floor bytes: :func:`weight_bytes` plus ``capacity`` slots of
  ``certkv_jax.kv.memory.slot_bytes(design, head_dim)`` in each of the
  ``n_layers x batch x n_kv_heads`` caches (``design`` None: the full cache, keys and
  values only). ``certificate`` (None: as the design, randomized designs certify) says
  whether the step reads ``v_sq``, 4 bytes a slot, which only the certificate needs.
  What a design needs, not all this implementation reads: the attention's
  mask also reads ``pos`` and ``valid`` (5 bytes a slot) of every cache, and its offsets
  ``log_pi`` (4 bytes a slot, all 0) for the full cache and deterministic designs."""
  caches = config.n_layers * batch * config.n_kv_heads
  slot = memory_lib.slot_bytes(design, config.head_dim, dtype=dtype)
  if design is not None and certificate is not None and certificate != design.randomized:
    slot += memory_lib.V_SQ_BYTES if certificate else -memory_lib.V_SQ_BYTES
  return weight_bytes(params, config) + caches * capacity * slot


def _looped(body, iters: int):
  """``iters`` calls of ``body(*args) -> float32`` in one ``fori_loop``, each reading its
  arguments again (an ``optimization_barrier`` ties them to the running total, so
  nothing is hoisted out of the loop): a probe timed as a step's call is, its launch
  and dispatch amortized over ``iters``."""

  def run(*args):
    def one(_, total):
      a, t = jax.lax.optimization_barrier((args, total))
      return t + body(*a)
    return jax.lax.fori_loop(0, iters, one, jnp.float32(0.0))
  return run


def _read_fn(iters: int = 1):
  """A jitted streaming read: ``iters`` sums of a float32 buffer (the bandwidth probe);
  its time over ``iters`` is one read's."""
  return jax.jit(_looped(lambda buf: jnp.sum(buf, dtype=jnp.float32), iters))


def _matvec_fn(config, batch: int, iters: int = 1):
  """A jitted chain of ``[batch, in] @ W`` over every weight kernel of per-layer
  params (a kernel of more dims, such as the fused ``qkv_proj``, as ``[in, out]``; the
  tied embedding as the output projection; an untied one, of which a step reads one
  row, skipped; norms summed): the weight reads of a step with nothing else,
  what this backend's matrix-vector products attain against the floor. Each
  product's input is the latest output of its width (RMS-normalized; ones for
  the first), so they run one after another as a step's do: independent
  products would overlap on the CPU's cores, which a step's cannot. ``iters`` chains in
  one call (:func:`_looped`)."""

  def matvecs(params):
    total, latest = jnp.float32(0.0), {}
    for path, w in jax.tree_util.tree_leaves_with_path(params):
      embed = "embed" in jax.tree_util.keystr(path)
      if embed and not config.tie_embeddings:
        continue
      if w.ndim < 2:  # norms
        total += jnp.sum(w)
        continue
      if not embed:  # a kernel [in, ...]: fused projections (qkv_proj) are one product too
        w = w.reshape(w.shape[0], -1)
      width = w.shape[1] if embed else w.shape[0]
      x = latest.get(width, jnp.ones((batch, width), w.dtype))
      y = x @ w.T if embed else x @ w
      latest[y.shape[-1]] = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
      total += jnp.sum(y)
    return total
  return jax.jit(_looped(matvecs, iters))


def matvec_bytes(per_layer_params, config) -> int:
  """Bytes :func:`_matvec_fn` reads: every parameter but an untied embedding."""
  return sum(int(w.nbytes) for path, w in jax.tree_util.tree_leaves_with_path(per_layer_params)
             if config.tie_embeddings or "embed" not in jax.tree_util.keystr(path))


def _attention_fn(iters: int = 1, config=None):
  """A jitted attention of one query per head over every layer's caches, as the
  full cache's decode step attends (``certkv_jax.attention.certified.attend``
  without the certificate, ``config`` the step's ``AttentionConfig``) with nothing
  else: what this backend's attention attains against its floor, the caches' key and
  value bytes (:func:`attention_bytes`). Each layer's output is the next layer's
  query, so the layers attend one after another as in a step, not overlapped;
  ``iters`` passes in one call (:func:`_looped`)."""

  def attention(per_layer_caches, qg, positions):
    total = jnp.float32(0.0)
    for cache in per_layer_caches:
      out, _, _ = certified.attend(qg, cache, None, positions, certificate=False,
                                   with_probs=False, config=config)
      qg = out.astype(qg.dtype)  # [batch, n_kv_heads, group, 1, head_dim], as qg
      total += jnp.sum(out)
    return total
  return jax.jit(_looped(attention, iters))


def attention_inputs(caches, config, context: int, key):
  """:func:`_attention_fn`'s arguments for stacked ``caches``: per-layer copies, one
  random query per head ``[batch, n_kv_heads, group, 1, head_dim]`` and its position
  ``context`` (after every cached token)."""
  batch = caches.k.shape[1]
  group = config.n_heads // config.n_kv_heads
  qg = jax.random.normal(key, (batch, config.n_kv_heads, group, 1, config.head_dim),
                         caches.k.dtype)
  return caches.unstack().layers, qg, jnp.full((batch, 1), context, jnp.int32)


def attention_bytes(caches) -> int:
  """Bytes of the attention's floor: the keys and values of stacked ``caches``
  (the full cache's slot bytes, ``certkv_jax.kv.memory.slot_bytes(None, head_dim)``)."""
  return int(caches.k.nbytes) + int(caches.v.nbytes)
