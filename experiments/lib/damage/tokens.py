"""Per-token output damage of streaming eviction, with every per-call statistic beside it.

:func:`token_damage` streams a text through two copies of the model in one
jitted ``lax.scan`` over chunks: one with a never-evicted cache (the full
model) and one whose caches ``design`` evicts after every chunk (evaluation
mode: a shadow cache gives each call's true attention error and the Assumption-2
audit). For every position it returns the true change of the next-token
distribution, ``KL(p_full || p_evicted)``, and the increase of the next
token's negative log-likelihood, next to what is known online: each (layer,
query head)'s certificate radius and the warning signals of
:mod:`certkv_jax.certificate.signals`, and the evicted model's own predictive entropy (the
confidence baseline). Both copies read the same tokens (teacher forcing), so
the comparison is defined at every position.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from certkv_jax.attention.certified import SIGNAL_FIELDS
from certkv_jax import certificate
from certkv_jax.designs import budgets
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from experiments.lib.streaming_loss.core import StreamConfig
from experiments.lib.streaming_loss.core import chunked_targets
from models import forward


class TokenDamage(NamedTuple):
  """Output of :func:`token_damage` (``n`` = the input's length, ``L`` layers, ``H``
  query heads). Positions that are not scored hold 0."""

  kl: jax.Array  # [b, n] KL(p_full || p_evicted) of the next-token distribution (nats)
  dnll: jax.Array  # [b, n] NLL increase of the real next token (evicted - full)
  scored: jax.Array  # [b, n] bool: position i has a real next token
  entropy_evicted: jax.Array  # [b, n] entropy of p_evicted (the confidence baseline)
  radius: jax.Array  # [b, n, L, H] certificate radius at ``delta`` per (layer, head)
  true_error: jax.Array  # [b, n, L, H] ||o_hat - o|| per (layer, head) (shadow truth)
  signals: dict  # name -> [b, n, L] head-mean of each warning signal (SIGNAL_FIELDS)
  n_dropped: jax.Array  # [b] tokens that found no slot (must be 0)


@functools.partial(jax.jit, static_argnames=("config", "stream"))
def _token_damage(params, tokens, mask, key, budget, *, config,
                  stream: StreamConfig) -> TokenDamage:
  chunk, design, delta = stream.chunk, stream.design, stream.delta
  b, n = tokens.shape
  xs, scored, n_chunks = chunked_targets(tokens, mask, chunk)

  def step(carry, x):
    caches, full, shadow, state, key = carry
    toks, valid, tgt, sc = x
    f_logits, full, _, _ = forward.forward_chunk(
        params, config, toks, valid, full,
        settings=layer_lib.Settings(design=None, certificate=False))
    logits, caches, st, shadow = forward.forward_chunk(
        params, config, toks, valid, caches,
        settings=layer_lib.Settings(design=design, certificate=True), shadow=shadow)
    lf = jax.nn.log_softmax(f_logits.astype(jnp.float32), axis=-1)
    le = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(lf) * (lf - le), axis=-1)
    ent = -jnp.sum(jnp.exp(le) * le, axis=-1)
    pick = lambda lp: jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]
    dnll = pick(lf) - pick(le)
    zero = lambda a: jnp.where(sc, a, 0.0)
    # forward_chunk's stats are [t, L, b, H]; to [b, t, L, H].
    per_call = lambda a: jnp.where(sc[..., None, None], jnp.transpose(a, (2, 0, 1, 3)), 0.0)
    r = certificate.radius_from_stats(st.var_hat, st.range_hat, delta)
    sig = {k: jnp.mean(per_call(getattr(st, k)), axis=-1) for k in SIGNAL_FIELDS}
    key, sub = jax.random.split(key)
    caches, state, _, shadow = eviction.evict_and_record(design, caches, shadow, sub, state=state,
                                                      budget=budget)
    return (caches, full, shadow, state, key), (zero(kl), zero(dnll), zero(ent), per_call(r),
                                                per_call(st.true_error), sig)

  caches = caches_lib.init_caches(config, b, stream.capacity)
  full = caches_lib.init_caches(config, b, n_chunks * chunk)
  shadow = caches_lib.shadow_caches(config, b, n_chunks * chunk)
  state = eviction.init_state(design, caches)
  (caches, _, _, _, _), out = jax.lax.scan(step, (caches, full, shadow, state, key), xs)
  kl, dnll, ent, r, err, sig = out
  unchunk = lambda a: jnp.swapaxes(a, 0, 1).reshape((b, n_chunks * chunk) + a.shape[3:])[:, :n]
  n_dropped = jnp.sum(caches.n_dropped, axis=(0, 2)).astype(jnp.int32)
  return TokenDamage(unchunk(kl), unchunk(dnll), scored, unchunk(ent), unchunk(r),
                     unchunk(err), {k: unchunk(v) for k, v in sig.items()}, n_dropped)


def token_damage(params, tokens, mask, key, *, config, stream: StreamConfig,
                 budget=None) -> TokenDamage:
  """Per-token damage of streaming ``stream.design`` against the full cache (module doc).

  Args:
    params: model parameters.
    tokens: [batch, n] int token ids, right-padded rows; ``mask`` [batch, n] bool.
    key: PRNG key of the design's draws.
    config: the model config (static).
    stream: an ``experiments.lib.streaming_loss.core.StreamConfig`` (static): the
      chunk, the design (not None), the evicted caches' capacity (the kept
      tokens plus one chunk; None sizes it) and the radius' ``delta``.
    budget: optional traced fraction in (0, 1] replacing the design's.

  Returns:
    A :class:`TokenDamage`.
  """
  if stream.design is None:
    raise ValueError("design must be an eviction design (the full cache is the reference)")
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  if tokens.ndim != 2 or mask.shape != tokens.shape or mask.dtype != jnp.bool_:
    raise ValueError(f"tokens must be [batch, n] with a bool mask of the same shape; got "
                     f"tokens {tokens.shape}, mask {mask.dtype} {mask.shape}")
  budget = budgets.check_budget(budget, tokens.shape[0])
  if isinstance(stream.chunk, int) and stream.chunk >= 1:
    stream = stream.sized(tokens.shape[1], budget)
  stream.check(tokens)
  return _token_damage(params, tokens, mask, key, budget, config=config,
                       stream=dataclasses.replace(stream, delta=float(stream.delta)))
