"""Cached decoding: a certkv_jax cache per layer and KV head, prefill, scan decode.

Caches are one :class:`certkv_jax.KVCache` per (layer, batch row, KV head),
stacked into one pytree whose leaves are ``[n_layers, batch, n_kv_heads, ...]``:
the single-head cache functions are lifted with ``jax.vmap`` over batch and KV
heads, and layers are a ``lax.scan`` over the stacked layer parameters and
caches. Attention is :func:`certkv_jax.offset_attention` over the kept slots
(Hajek offsets; exactly softmax attention when nothing is evicted), so its
certificate statistics come with every call.

With a ``design``, every chunk's attention probabilities are folded into the
slot statistics (``design.update``; the last ``observation_window`` queries of
a chunk count as SnapKV's observation window) and :func:`evict` applies the
design to every (layer, row, KV head) with independent PRNG keys.

Two jitted regimes, both with a ``lax.scan`` greedy decode loop (no
recompilation per token) over ragged, right-padded batches:

* :func:`generate` (question-aware): prefill the whole prompt, evict once,
  decode (optionally evicting after every step).
* :func:`generate_streaming`: the context arrives in chunks and is evicted
  down to budget after each chunk, before the question is known; then the
  question is prefilled and the answer decoded.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

import certkv_jax
from certkv_jax import cache as cache_lib
from certkv_jax import diagnostics
from certkv_jax import distributed
from certkv_jax.cache import KVCache
from models import budgets as budgets_lib
from models.config import LlamaConfig
from models.llama import Block
from models.llama import LlamaModel

Array = jax.Array


def _vmap2(fn):
  """``fn`` over [batch, kv_head] leading axes."""
  return jax.vmap(jax.vmap(fn))


def init_caches(config: LlamaConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
  """Empty caches, leaves ``[n_layers, batch, n_kv_heads, ...]``."""
  one = certkv_jax.init_cache(capacity, config.head_dim, dtype=dtype)
  lead = (config.n_layers, batch, config.n_kv_heads)
  return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, lead + x.shape), one)


class ChunkStats(NamedTuple):
  """Certificate statistics of one chunk's attention calls (and, in evaluation
  mode, the truth from the shadow full cache)."""

  var_hat: Array  # [n_layers, batch, n_heads, t] float32 (SPEC section 4's V_hat)
  range_hat: Array  # [n_layers, batch, n_heads, t] float32 (b_hat)
  true_error: Optional[Array] = None  # [n_layers, batch, n_heads, t] ||o_hat - o||
  rel_error: Optional[Array] = None  # [n_layers, batch, n_heads, t] ||o_hat - o|| / ||o||
  # Assumption-2 audit (SPEC section 6), from the shadow cache's inclusion record:
  ratio: Optional[Array] = None  # [n_layers, batch, n_heads, t] R = m max_T a_i/(pi_i sum a)
  tail_m: Optional[Array] = None  # [n_layers, batch, n_heads, t] m = sum_T pi_i
  tail_n: Optional[Array] = None  # [n_layers, batch, n_heads, t] |T| (tokens with 0<pi<1)


def _positions(cache: KVCache, valid) -> Array:
  """[batch, t] positions of new tokens: next position of each row, padding skipped."""
  start = cache.n_seen[:, 0]  # [batch], equal across KV heads
  return start[:, None] + jnp.cumsum(valid, axis=1).astype(jnp.int32) - 1


def _certified_heads(qg, cache: KVCache, shadow: Optional[KVCache], positions, heads):
  """Offset attention with certificate statistics on the KV heads ``heads`` (static).

  Returns ``(out [b, h, g, t, d], stats)`` for those heads only; ``stats`` holds
  ``[b, h, g, t]`` arrays (the truth and Assumption-2 audit too in evaluation
  mode, from the shadow full cache).
  """
  take = lambda a: a[:, heads] if heads is not None else a
  qg, cache = take(qg), jax.tree_util.tree_map(take, cache)
  shadow = None if shadow is None else jax.tree_util.tree_map(take, shadow)
  slots = lambda a: a[:, :, None, None]  # [b, h, cap, ...] -> [b, h, 1, 1, cap, ...]
  mask = slots(cache.valid) & (slots(cache.pos) <= positions[:, None, None, :, None])
  res = certkv_jax.offset_attention(qg, slots(cache.k), slots(cache.v), slots(cache.log_pi),
                                    mask)  # out [b, h, g, t, d]
  return res.out, _truth_stats(qg, res.out, shadow, positions,
                                ChunkStats(res.var_hat, res.range_hat))


def _truth_stats(qg, out, shadow: Optional[KVCache], positions, stats: ChunkStats) -> ChunkStats:
  """Evaluation mode: adds the true error of ``out`` and the Assumption-2 audit
  (from the shadow full cache, same KV heads as ``qg``) to ``stats``."""
  if shadow is None:
    return stats
  slots = lambda a: a[:, :, None, None]
  full_mask = slots(shadow.valid) & (slots(shadow.pos) <= positions[:, None, None, :, None])
  full = diagnostics.full_attention(qg, slots(shadow.k), slots(shadow.v), full_mask)
  err = diagnostics.attention_error(out, full)
  # T: context tokens sampled with 0 < pi < 1 in some round (kept or not).
  pi = slots(jnp.exp(shadow.log_pi))
  tail = full_mask & (pi > 0.0) & (pi < 1.0)  # [b, h, 1, t, cap]
  tail_m = jnp.sum(jnp.where(tail, pi, 0.0), axis=-1)
  tail_n = jnp.sum(tail, axis=-1).astype(jnp.float32)
  ratio = diagnostics.assumption2_ratio(qg, slots(shadow.k), full_mask, tail, pi, tail_m)
  grouped = lambda a: jnp.broadcast_to(a, stats.var_hat.shape)
  stats = stats._replace(true_error=err.abs, rel_error=err.rel, ratio=ratio,
                         tail_m=grouped(tail_m), tail_n=grouped(tail_n))
  return stats


def _plain_heads(qg, cache: KVCache, positions, probs, heads):
  """The same Hajek softmax output on KV heads ``heads`` without the certificate's
  per-slot second-order sums (``probs``: all heads' probabilities, or None)."""
  take = lambda a: a[:, heads] if heads is not None else a
  if probs is None:
    slots = lambda a: a[:, :, None, None]
    c = jax.tree_util.tree_map(take, cache)
    mask = slots(c.valid) & (slots(c.pos) <= positions[:, None, None, :, None])
    probs = certkv_jax.attention_probs(take(qg), slots(c.k), slots(c.log_pi), mask)
  else:
    probs = take(probs)
  return jnp.einsum("bhgtn,bhnd->bhgtd", probs, take(cache.v).astype(jnp.float32))


def _nan_stats(shape, evaluation: bool) -> ChunkStats:
  nan = jnp.full(shape, jnp.nan, jnp.float32)
  if not evaluation:
    return ChunkStats(nan, nan)
  return ChunkStats(nan, nan, nan, nan, nan, nan, nan)


def _subsampled_certificate(config, qg, cache, shadow, positions, probs, layer_flag,
                            heads: Optional[tuple]):
  """Attention output of every head, certificate statistics on a subset.

  ``heads`` (static KV-head indices, None = all) get ``offset_attention`` with
  its statistics, the others the plain Hajek softmax; ``layer_flag`` (traced
  bool, or None = True) switches the whole layer between the two with
  ``lax.cond``, so a skipped layer does no second-order work. Statistics that
  were not computed are NaN. Returns ``(out [b, h_kv, g, t, d], stats
  [b, h_kv, g, t])``.
  """
  n_kv = config.n_kv_heads
  shape = qg.shape[:-1]  # [b, h_kv, g, t]
  evaluation = shadow is not None
  rest = None if heads is None else tuple(h for h in range(n_kv) if h not in heads)

  def certified():
    out, stats = _certified_heads(qg, cache, shadow, positions, heads)
    out = out.astype(jnp.float32)  # as the plain branch's
    if heads is None:
      return out, stats
    order = np.argsort(np.asarray(heads + rest))  # back to head order
    if rest:
      out = jnp.concatenate([out, _plain_heads(qg, cache, positions, probs, rest)], axis=1)
    out = out[:, order]
    fill = _nan_stats(shape[:1] + (len(rest),) + shape[2:], evaluation)
    stats = jax.tree_util.tree_map(
        lambda a, f: jnp.concatenate([a, f], axis=1)[:, order], stats, fill)
    return out, stats

  def plain():
    return _plain_heads(qg, cache, positions, probs, None), _nan_stats(shape, evaluation)

  if layer_flag is None and heads is None:  # the unsubsampled certificate, as before
    return _certified_heads(qg, cache, shadow, positions, None)
  if layer_flag is None:
    return certified()
  return jax.lax.cond(layer_flag, certified, plain)


def _layer(config: LlamaConfig, design, observation_window: int, certificate: bool, x, valid,
           layer_params, cache: KVCache, shadow: Optional[KVCache], layer_flag=None,
           certificate_heads: Optional[tuple] = None):
  """One decoder layer on a chunk: append keys/values, offset attention, MLP.

  ``shadow`` (evaluation mode) is a never-evicted cache that receives the same
  keys and values; the same queries attend over it to give the truth ``o``.
  Its ``log_pi`` is not an attention offset but the record of every token's
  cumulative log inclusion probability (:func:`record_inclusion`), from which
  the Assumption-2 ratio ``R`` of each call is computed over the full context.

  ``layer_flag`` (traced bool) and ``certificate_heads`` (static KV-head
  indices) subsample the certificate (see :func:`forward_chunk`).
  """
  c = config
  b, t, _ = x.shape
  block = Block(c)
  variables = {"params": layer_params}
  positions = _positions(cache, valid)
  q, k, v = block.apply(variables, x, positions, method=Block.qkv)
  new_kv = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
            jnp.repeat(valid[:, None], c.n_kv_heads, axis=1))
  sharded = distributed.cache_mesh() is not None  # under jax.set_mesh: sequence-sharded caches
  cache = (distributed.append if sharded else _vmap2(cache_lib.append))(cache, *new_kv)
  if shadow is not None:
    shadow = _vmap2(cache_lib.append)(shadow, *new_kv)
  qg = q.reshape(b, t, c.n_kv_heads, c.group_size, c.head_dim).transpose(0, 2, 3, 1, 4)
  slots = lambda a: a[:, :, None, None]  # [b, h_kv, cap, ...] -> [b, h_kv, 1, 1, cap, ...]
  mask = slots(cache.valid) & (slots(cache.pos) <= positions[:, None, None, :, None])
  heads = lambda a: a.reshape(b, c.n_heads, t)
  probs = None
  if sharded:  # per-device partials merged with the split-K combine (certkv_jax.distributed)
    res = distributed.cache_attention(qg, cache, positions, with_stats=certificate,
                                      with_probs=design is not None or not certificate)
    probs = res.probs
  elif design is not None or not certificate:
    probs = certkv_jax.attention_probs(qg, slots(cache.k), slots(cache.log_pi), mask)
  if certificate and sharded:
    if layer_flag is not None or certificate_heads is not None:
      raise ValueError("certificate_layers / certificate_heads are not supported on a "
                       "sequence-sharded cache")
    out = res.out
    stats = jax.tree_util.tree_map(heads, _truth_stats(
        qg, out, shadow, positions, ChunkStats(res.var_hat, res.range_hat)))
  elif certificate:
    out, stats = _subsampled_certificate(c, qg, cache, shadow, positions, probs, layer_flag,
                                         certificate_heads)
    stats = jax.tree_util.tree_map(heads, stats)
  elif sharded:  # the combined partials without the second-order sums
    out, stats = res.out, None
  else:  # the same Hajek softmax, without the certificate's per-slot statistics
    out = jnp.einsum("bhgtn,bhnd->bhgtd", probs, cache.v.astype(jnp.float32))
    stats = None
  if design is not None:
    cache = _fold_statistics(design, cache, probs, valid, observation_window)
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, c.n_heads, c.head_dim)
  x = block.apply(variables, x, out, method=Block.finish)
  return x, cache, stats, shadow


def _fold_statistics(design, cache: KVCache, probs, valid,
                     observation_window: int) -> KVCache:
  """Folds a chunk's attention probabilities [b, h_kv, g, t, cap] into the slot
  statistics with ``design.update`` (per KV head).

  In order: the non-window real queries, then the last ``observation_window``
  real queries as the observation window, so that the last real query is the
  latest (``last``, TOVA) and ``obs`` holds the window only (SnapKV).
  """
  probs = jnp.where(valid[:, None, None, :, None], probs, 0.0)  # padded queries count 0
  t = valid.shape[1]
  n_real = jnp.sum(valid, axis=1).astype(jnp.int32)
  # Right-aligns each row's real queries, so that the last one is at t - 1.
  probs = jax.vmap(lambda p, n: jnp.roll(p, t - n, axis=-2))(probs, n_real)
  in_window = jnp.arange(t) >= t - observation_window  # [t]

  def fold(cache_h, p, has_real):  # p [g, t, cap]
    state = design.init(cache_h)
    if observation_window == 0:
      new = design.update(cache_h, state, p)[0]
    else:
      w = in_window[None, :, None]
      new, state = design.update(cache_h, state, jnp.where(w, 0.0, p))
      new = design.update(new, state, jnp.where(w, p, 0.0), observation=True)[0]
    # A row whose chunk is all padding (ragged streaming) keeps its statistics.
    return jax.tree_util.tree_map(lambda a, b: jnp.where(has_real, a, b), new, cache_h)

  per_head = jax.vmap(fold, in_axes=(0, 0, None))  # over KV heads; one flag per row
  return jax.vmap(per_head)(cache, probs, n_real > 0)


@functools.partial(jax.jit, static_argnames=("config", "design", "observation_window",
                                             "certificate", "certificate_layers",
                                             "certificate_heads"))
def forward_chunk(params, config: LlamaConfig, tokens, valid, caches: KVCache, *,
                  design=None, observation_window: int = 0, certificate: bool = True,
                  shadow: Optional[KVCache] = None,
                  certificate_layers: Optional[tuple] = None,
                  certificate_heads: Optional[tuple] = None):
  """Runs a chunk of new tokens through the model with caches.

  Args:
    params: ``{"params": ...}`` of :class:`models.llama.LlamaModel`.
    config: the model config.
    tokens: [batch, t] int token ids.
    valid: [batch, t] bool, False on (right) padding: padding takes no cache
      slot and no position.
    caches: from :func:`init_caches` (or a previous chunk).
    design: optional ``certkv_jax.EvictionDesign``; its ``update`` folds the
      chunk's attention probabilities into the slot statistics.
    observation_window: the last this many real queries of the chunk are the
      observation window (SnapKV's ``obs`` statistic).
    certificate: compute attention with ``certkv_jax.offset_attention`` and
      return its certificate statistics; False computes the same Hajek
      softmax with ``certkv_jax.attention_probs`` only (cheaper for long
      prefills: no per-slot second-order sums) and returns ``None`` stats.
    shadow: evaluation mode: full caches (never evicted, from
      :func:`init_caches`) that receive the same keys and values; with
      ``certificate`` the stats then include the true error of every call.
    certificate_layers: static tuple of layer indices (None = every layer):
      subsample the certificate by layer. The other layers attend with the
      plain Hajek softmax (a ``lax.cond`` inside the layer scan, so they skip
      the per-slot second-order sums) and their stats are NaN.
    certificate_heads: static tuple of KV-head indices (None = every head):
      subsample the certificate by KV head (all query heads of a KV group);
      the other heads' stats are NaN. Combine with ``certificate_layers`` for
      a (layer, head) subsample. The attention outputs, and so the logits,
      do not depend on either (the same Hajek estimate).

  Returns:
    ``(logits [batch, t, vocab] float32, caches, ChunkStats or None, shadow)``.
  """
  layer_flags = check_certificate_subsample(config, certificate, certificate_layers,
                                            certificate_heads)
  model = LlamaModel(config)
  x = model.apply(params, tokens, method=LlamaModel.embed_tokens)

  def body(x, layer):
    layer_params, cache, shadow_cache, flag = layer
    x, cache, stats, shadow_cache = _layer(config, design, observation_window, certificate, x,
                                           valid, layer_params, cache, shadow_cache, flag,
                                           certificate_heads)
    return x, (cache, stats, shadow_cache)

  x, (caches, stats, shadow) = jax.lax.scan(
      body, x, (params["params"]["layers"], caches, shadow, layer_flags))
  return model.apply(params, x, method=LlamaModel.head), caches, stats, shadow


def check_certificate_subsample(config: LlamaConfig, certificate: bool,
                                certificate_layers: Optional[tuple],
                                certificate_heads: Optional[tuple]):
  """Checks the static certificate subsample; returns the per-layer flags
  (``[n_layers]`` bool, or None when every layer is certified)."""
  for name, value, n, what in (("certificate_layers", certificate_layers, config.n_layers,
                                "layer"),
                               ("certificate_heads", certificate_heads, config.n_kv_heads,
                                "KV head")):
    if value is None:
      continue
    if not certificate:
      raise ValueError(f"{name} needs certificate=True")
    if (not isinstance(value, tuple) or not value
        or not all(isinstance(i, int) and 0 <= i < n for i in value)
        or len(set(value)) != len(value)):
      raise ValueError(f"{name} must be a non-empty tuple of distinct {what} indices in "
                       f"[0, {n}), got {value!r}")
  if certificate_layers is None:
    return None
  return jnp.asarray([i in certificate_layers for i in range(config.n_layers)])


def evict(design, caches: KVCache, key, layer_budgets=None, budget=None):
  """Applies ``design.evict`` to every (layer, row, KV head) cache.

  ``layer_budgets`` (optional, static): one budget per layer, all ints
  (tokens) or all floats (fractions), e.g. ``models.budgets.pyramid_budgets``;
  it replaces the design's own budget, layer by layer.

  ``budget`` (optional, may be traced): a fraction in (0, 1] of the tokens
  seen, a scalar or one per batch row (``[batch]``), that replaces the
  design's budget in every layer, so that one compiled program serves every
  budget (the design is a static argument; its static budget would otherwise
  force one compile per budget), and one batch can run several budgets.
  Checked by :func:`check_budget` where it is concrete.

  Returns:
    ``(caches, info)`` with ``info`` the design's ``EvictionInfo`` of this
    round, leaves ``[n_layers, batch, n_kv_heads, ...]``. (The design's
    running ``DesignState`` counters are not carried between rounds; the
    per-round ``info`` and the caches' ``n_dropped`` report what happened.)
  """
  lead = caches.n_seen.shape
  keys = jax.random.split(key, lead[0] * lead[1] * lead[2])
  keys = keys.reshape(lead + keys.shape[1:])

  if layer_budgets is None and budget is None:
    def one(cache, k):
      new, _, info = design.evict(cache, design.init(cache), k)
      return new, info

    return _map_heads(design, jax.vmap(_vmap2(one)), caches, keys)

  if layer_budgets is not None and budget is not None:
    raise ValueError("give either layer_budgets or budget, not both")
  if layer_budgets is not None:
    layer_budgets = budgets_lib.check_layer_budgets(layer_budgets, lead[0])
    targets = budgets_lib.layer_targets(layer_budgets, caches.n_seen)  # [layers, batch, kv]
  else:
    frac = check_budget(budget, lead[1])
    frac = frac if frac.ndim == 0 else frac[None, :, None]  # rows -> [layers, batch, kv]
    targets = budgets_lib.fraction_targets(frac, caches.n_seen)

  def one_target(cache, k, target):
    d = budgets_lib.with_target(design, target)
    new, _, info = d.evict(cache, d.init(cache), k)
    return new, info

  return _map_heads(design, jax.vmap(jax.vmap(jax.vmap(one_target))), caches, keys, targets)


def _map_heads(design, fn, caches: KVCache, *head_args):
  """``fn(caches, *head_args)``; on sequence-sharded caches (traced under a mesh,
  ``certkv_jax.distributed``) each device runs it on its heads' gathered slot
  metadata and keeps its own slots, with the same result as one device."""
  if distributed.cache_mesh() is None:
    return fn(caches, *head_args)
  return distributed.map_evict(design, fn, caches, *head_args)


def check_budget(budget, batch: Optional[int] = None):
  """A traced-or-concrete budget fraction (scalar or ``[batch]``) as float32.

  Checks the shape always and the range (0, 1] where the value is concrete.
  """
  if budget is None:
    return None
  b = jnp.asarray(budget, jnp.float32)
  if b.ndim > 1 or (b.ndim == 1 and batch is not None and b.shape[0] != batch):
    raise ValueError(f"budget must be a scalar fraction or one per batch row ([{batch}]), "
                     f"got shape {b.shape}")
  if not isinstance(b, jax.core.Tracer):
    bad = [float(x) for x in np.ravel(np.asarray(b)) if not 0.0 < float(x) <= 1.0]
    if bad:
      raise ValueError(f"budget must be a fraction in (0, 1] of the tokens seen, got {bad}")
  return b


def record_inclusion(shadow: KVCache, before: KVCache, info) -> KVCache:
  """Evaluation mode: adds one eviction round's ``log pi`` to the shadow cache's record.

  The shadow cache holds every token at slot = position (it is never
  evicted and padding takes no slot), and its ``log_pi`` accumulates each
  token's log inclusion probability over the rounds it took part in: a kept
  token's total equals its offset in the evicted cache; an evicted token's
  total stops at the round that evicted it (the product up to that round is
  all that is defined for it). ``before`` is the cache the round was applied
  to (``info`` is per slot of it). Leaves ``[n_layers, batch, n_kv_heads, ...]``.
  """
  def one(sh, cache, pi):
    log_pi = jnp.log(jnp.where(cache.valid, pi, 1.0))
    idx = jnp.where(cache.valid, cache.pos, sh.log_pi.shape[0])  # invalid -> dropped
    return sh._replace(log_pi=sh.log_pi.at[idx].add(log_pi, mode="drop"))

  return jax.vmap(_vmap2(one))(shadow, before, info.pi)


def _evict(design, caches, shadow, key, layer_budgets, budget):
  """:func:`evict`, and in evaluation mode the shadow's inclusion record."""
  new, info = evict(design, caches, key, layer_budgets, budget)
  if shadow is not None:
    shadow = record_inclusion(shadow, caches, info)
  return new, shadow


class Generation(NamedTuple):
  tokens: Array  # [batch, n_steps] int32 generated tokens (greedy)
  logprobs: Array  # [batch, n_steps] float32 log-probability of each generated token
  logits: Optional[Array]  # [batch, n_steps, vocab] float32 if return_logits
  # Certificate statistics of decode step i: the forward pass of generated token
  # i, whose attention produces the distribution of token i + 1. NaN for the
  # (layer, head) calls left out by ``certificate_layers`` / ``certificate_heads``.
  var_hat: Array  # [n_steps, n_layers, batch, n_heads] float32
  range_hat: Array  # [n_steps, n_layers, batch, n_heads] float32
  caches: KVCache  # final caches (``n_dropped`` counts tokens that found no slot)
  # Evaluation mode only (None otherwise), same steps as var_hat:
  true_error: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] ||o_hat - o||
  rel_error: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] ||o_hat - o||/||o||
  # Assumption-2 audit of every decode call (SPEC section 6; evaluation mode):
  # R = m max_{i in T} a_i / (pi_i sum_C a_j) over the full context C, with
  # pi_i each token's cumulative inclusion probability (up to its eviction)
  # and T the tokens sampled with 0 < pi_i < 1; 0 when T is empty (e.g. any
  # deterministic design: its pi is 0 or 1).
  ratio: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] R
  tail_m: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] m = sum_T pi_i
  tail_n: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] |T|


def _last_logits(logits, mask):
  """[batch, vocab] logits at each row's last real token."""
  last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)
  return logits[jnp.arange(logits.shape[0]), last]


def _decode_loop(params, config, caches, shadow, first_logits, key, n_steps, design,
                 evict_each_step, return_logits, layer_budgets=None,
                 budget=None, certificate_layers=None, certificate_heads=None) -> Generation:
  """Greedy ``lax.scan`` decode from the logits of the last prompt token."""
  batch = first_logits.shape[0]

  def step(carry, _):
    caches, shadow, step_logits, key = carry
    logp = jax.nn.log_softmax(step_logits)
    token = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
    token_logp = jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]
    new_logits, caches, stats, shadow = forward_chunk(
        params, config, token[:, None], jnp.ones((batch, 1), bool), caches, design=design,
        shadow=shadow, certificate_layers=certificate_layers,
        certificate_heads=certificate_heads)
    key, sub = jax.random.split(key)
    if design is not None and evict_each_step:
      caches, shadow = _evict(design, caches, shadow, sub, layer_budgets, budget)
    stats = jax.tree_util.tree_map(lambda a: a[..., 0], stats)  # t = 1
    out = (token, token_logp, step_logits if return_logits else None, stats)
    return (caches, shadow, new_logits[:, 0], key), out

  (caches, _, _, _), (toks, logps, step_logits, stats) = jax.lax.scan(
      step, (caches, shadow, first_logits, key), None, length=n_steps)
  return Generation(
      tokens=toks.T, logprobs=logps.T,
      logits=None if step_logits is None else step_logits.transpose(1, 0, 2),
      var_hat=stats.var_hat, range_hat=stats.range_hat, caches=caches,
      true_error=stats.true_error, rel_error=stats.rel_error, ratio=stats.ratio,
      tail_m=stats.tail_m, tail_n=stats.tail_n)


def _check_prompt(tokens, mask, n_steps):
  if tokens.ndim != 2 or mask.shape != tokens.shape or mask.dtype != jnp.bool_:
    raise ValueError(f"tokens must be [batch, len] with a bool mask of the same shape; got "
                     f"tokens {tokens.shape}, mask {mask.dtype} {mask.shape}")
  if n_steps < 1:
    raise ValueError(f"n_steps must be >= 1, got {n_steps}")


_STATIC = ("config", "capacity", "n_steps", "design", "observation_window", "evict_each_step",
           "return_logits", "evaluate", "layer_budgets", "certificate_layers",
           "certificate_heads")


def _check_layer_budgets(design, layer_budgets, config, capacity, budget=None):
  if budget is not None:
    if design is None:
      raise ValueError("budget needs a design (the design's budget is what it replaces)")
    if layer_budgets is not None:
      raise ValueError("give either layer_budgets or budget, not both")
  if layer_budgets is None:
    return None
  if design is None:
    raise ValueError("layer_budgets needs a design (the design's budget is what they replace)")
  return budgets_lib.check_layer_budgets(layer_budgets, config.n_layers, capacity)


def _checking_budget(jitted):
  """Checks a concrete ``budget`` before the jitted call (inside, it is traced)."""
  @functools.wraps(jitted)
  def wrapper(*args, budget=None, **kwargs):
    batch = jnp.shape(args[1])[0] if len(args) > 1 else None
    check_budget(budget, batch)
    return jitted(*args, budget=budget, **kwargs)

  return wrapper


@_checking_budget
@functools.partial(jax.jit, static_argnames=_STATIC)
def generate(params, tokens, mask, key, *, config: LlamaConfig, capacity: int, n_steps: int,
             design=None, observation_window: int = 0, evict_each_step: bool = False,
             return_logits: bool = False, evaluate: bool = False,
             layer_budgets: Optional[tuple] = None, budget=None,
             certificate_layers: Optional[tuple] = None,
             certificate_heads: Optional[tuple] = None) -> Generation:
  """Question-aware greedy generation: prefill, evict once, ``lax.scan`` decode.

  The whole prompt (context and question) is prefilled, the design (if any)
  evicts once down to its budget, then ``n_steps`` tokens are decoded (and,
  with ``evict_each_step``, evicted again after every step). Decode steps
  attend with ``certkv_jax.offset_attention`` and report its certificate
  statistics; the prefill, which sees the full cache, skips them.

  Args:
    params: model parameters.
    tokens: [batch, prompt_len] int right-padded prompts.
    mask: [batch, prompt_len] bool, True on real prompt tokens (>= 1 per row).
    key: PRNG key for randomized designs.
    config, capacity, n_steps: static; ``capacity`` slots per (layer, row,
      KV head) must hold the prompt, and the tokens kept after eviction plus
      those appended before the next one.
    design: optional eviction design; None keeps everything.
    observation_window: prompt queries that form the observation window.
    evict_each_step: evict after every decode step too.
    return_logits: also return the full logits of every step.
    evaluate: evaluation mode: keep a shadow full cache (``prompt_len +
      n_steps`` slots, never evicted) and report every decode call's true
      error. Normal mode never allocates it.
    layer_budgets: optional static tuple, one budget per layer (all ints =
      tokens, or all floats = fractions; see ``models.budgets``), replacing
      the design's budget layer by layer (PyramidKV-style).
    budget: optional fraction in (0, 1] of the tokens seen, a traced argument
      (a float, or float32 ``[]`` or ``[batch]`` for one budget per row):
      replaces the design's budget in every layer, so one compile serves
      every budget (see :func:`evict`). Its range is checked where it is
      concrete (outside an enclosing ``jax.jit``).
    certificate_layers, certificate_heads: optional static tuples of layer /
      KV-head indices: compute the decode steps' certificate statistics (and
      in evaluation mode the truth) only there, NaN elsewhere (see
      :func:`forward_chunk`); the generated tokens do not change.

  Returns:
    A :class:`Generation`.
  """
  _check_prompt(tokens, mask, n_steps)
  check_certificate_subsample(config, True, certificate_layers, certificate_heads)
  layer_budgets = _check_layer_budgets(design, layer_budgets, config, capacity, budget)
  batch, prompt_len = tokens.shape
  need = prompt_len + (n_steps if design is None else 0)
  if capacity < need:
    raise ValueError(f"capacity ({capacity}) must hold the prompt ({prompt_len} tokens)"
                     f"{'' if design is not None else f' plus {n_steps} decoded tokens'}")
  caches = init_caches(config, batch, capacity)
  shadow = init_caches(config, batch, prompt_len + n_steps) if evaluate else None
  logits, caches, _, shadow = forward_chunk(
      params, config, tokens, mask, caches, design=design,
      observation_window=observation_window, certificate=False, shadow=shadow)
  key, sub = jax.random.split(key)
  if design is not None:
    caches, shadow = _evict(design, caches, shadow, sub, layer_budgets, budget)
  return _decode_loop(params, config, caches, shadow, _last_logits(logits, mask), key, n_steps,
                      design, evict_each_step, return_logits, layer_budgets, budget,
                      certificate_layers, certificate_heads)


@_checking_budget
@functools.partial(jax.jit, static_argnames=_STATIC + ("chunk",))
def generate_streaming(params, context, context_mask, question, question_mask, key, *,
                       config: LlamaConfig, capacity: int, n_steps: int, chunk: int,
                       design=None, observation_window: int = 0,
                       evict_each_step: bool = False, return_logits: bool = False,
                       evaluate: bool = False,
                       layer_budgets: Optional[tuple] = None, budget=None,
                       certificate_layers: Optional[tuple] = None,
                       certificate_heads: Optional[tuple] = None) -> Generation:
  """Streaming greedy generation: the context arrives in chunks, then the question.

  The context is fed ``chunk`` tokens at a time (a ``lax.scan`` over chunks);
  after each chunk the design evicts down to its budget, before the question
  is known. Then the question is prefilled (its last ``observation_window``
  queries are the observation window) and ``n_steps`` tokens are decoded as
  in :func:`generate`.

  Args:
    params: model parameters.
    context: [batch, n_context] int context tokens, right-padded per row.
    context_mask: [batch, n_context] bool.
    question: [batch, n_question] int question tokens, right-padded per row.
    question_mask: [batch, n_question] bool (>= 1 real token per row).
    key: PRNG key.
    config, capacity, n_steps: as in :func:`generate`; ``capacity`` must hold
      the kept tokens plus one chunk, and then plus the question and the
      decoded tokens (overflow is counted in the caches' ``n_dropped``).
    chunk: context tokens per chunk (static); the context is padded to a
      multiple of it.
    design, observation_window, evict_each_step, return_logits, evaluate,
      layer_budgets, budget, certificate_layers, certificate_heads: as in
      :func:`generate` (the shadow cache holds the whole padded context, the
      question and the decoded tokens).

  Returns:
    A :class:`Generation`.
  """
  _check_prompt(context, context_mask, n_steps)
  check_certificate_subsample(config, True, certificate_layers, certificate_heads)
  _check_prompt(question, question_mask, n_steps)
  layer_budgets = _check_layer_budgets(design, layer_budgets, config, capacity, budget)
  if context.shape[0] != question.shape[0]:
    raise ValueError(f"context and question batch sizes differ: {context.shape[0]} vs "
                     f"{question.shape[0]}")
  if not isinstance(chunk, int) or chunk < 1 or chunk > capacity:
    raise ValueError(f"chunk must be an int in [1, capacity={capacity}], got {chunk!r}")
  batch, n_context = context.shape
  n_chunks = -(-n_context // chunk)
  pad = n_chunks * chunk - n_context
  context = jnp.pad(context, ((0, 0), (0, pad)))
  context_mask = jnp.pad(context_mask, ((0, 0), (0, pad)))
  as_chunks = lambda x: x.reshape(batch, n_chunks, chunk).swapaxes(0, 1)  # [n_chunks, b, c]

  def feed(carry, xs):
    caches, shadow, key = carry
    toks, valid = xs
    _, caches, _, shadow = forward_chunk(params, config, toks, valid, caches, design=design,
                                         certificate=False, shadow=shadow)
    key, sub = jax.random.split(key)
    if design is not None:
      caches, shadow = _evict(design, caches, shadow, sub, layer_budgets, budget)
    return (caches, shadow, key), None

  caches = init_caches(config, batch, capacity)
  shadow = None
  if evaluate:
    shadow = init_caches(config, batch, n_chunks * chunk + question.shape[1] + n_steps)
  (caches, shadow, key), _ = jax.lax.scan(feed, (caches, shadow, key),
                                          (as_chunks(context), as_chunks(context_mask)))
  logits, caches, _, shadow = forward_chunk(
      params, config, question, question_mask, caches, design=design,
      observation_window=observation_window, certificate=False, shadow=shadow)
  return _decode_loop(params, config, caches, shadow, _last_logits(logits, question_mask), key,
                      n_steps, design, evict_each_step, return_logits, layer_budgets, budget,
                      certificate_layers, certificate_heads)
