"""Greedy generation with certkv caches: prefill, eviction, ``lax.scan`` decode.

The pieces, one module each:

* ``certkv_jax.kv.caches`` -- :class:`Caches`, one :class:`certkv_jax.KVCache` per
  (layer, batch row, KV head), stacked or per layer.
* ``models.generation`` -- :class:`GenerationConfig` (what to generate) and
  :class:`Generation` (what comes back), re-exported here.
* ``models.forward`` -- :func:`forward_chunk`: a chunk of tokens through the
  model; every layer appends to its caches, attends and, with a design, folds
  the attention probabilities into the slot statistics.
* ``certkv_jax.attention.certified`` -- a layer's attention with its certificate
  statistics (subsampled by layer / KV head; the truth in evaluation mode).
* ``certkv_jax.eviction`` -- :func:`evict`: the design on every cache.
* ``certkv_jax.designs.budgets`` -- the one place budgets are checked and resolved.

This module holds the two jitted regimes, both with a ``lax.scan`` greedy
decode loop (no recompilation per token) over ragged, right-padded batches:

* :func:`generate` (question-aware): prefill the whole prompt, evict once,
  decode (optionally evicting after every step).
* :func:`generate_streaming`: the context arrives in chunks and is evicted
  down to budget after each chunk, before the question is known; then the
  question is prefilled and the answer decoded.

The ``design`` argument takes one path: its budget arguments are checked once
(``certkv_jax.designs.budgets.check_generation_budgets``, before the jitted call), the
design folds every chunk's statistics (``forward_chunk``), and every eviction
is ``certkv_jax.eviction.evict``, which resolves the budget into each cache's
target (``certkv_jax.designs.budgets.eviction_targets``) and applies the design.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from certkv_jax.designs import allocation as allocation_lib
from certkv_jax.designs import budgets as budgets_lib
from certkv_jax.kv.caches import Caches
from certkv_jax import _validate
from certkv_jax import layer as layer_lib
from models import inputs
from certkv_jax.attention.certified import check_certificate_subsample
from certkv_jax.attention.certified import ChunkStats
from certkv_jax.attention.certified import SIGNAL_FIELDS
from certkv_jax.attention.certified import Subsample
from certkv_jax.designs.budgets import check_budget
from certkv_jax.kv.caches import init_caches
from certkv_jax.kv.caches import shadow_caches
from models.config import LlamaConfig
from certkv_jax.eviction import evict
from certkv_jax.eviction import evict_and_record
from certkv_jax.eviction import init_state
from certkv_jax.eviction import record_inclusion
from models import forward
from models import precision
from models.forward import forward_chunk
from models.generation import Generation
from models.generation import GenerationConfig

Array = jax.Array

__all__ = [
    "ChunkStats",
    "DecodeCarry",
    "decode_from",
    "decode_step",
    "Generation",
    "GenerationConfig",
    "check_budget",
    "check_certificate_subsample",
    "evict",
    "evict_and_record",
    "forward_chunk",
    "generate",
    "generate_streaming",
    "init_caches",
    "record_inclusion",
]


def allocation_args(params, config: LlamaConfig, allocation) -> dict:
  """``eviction.evict``'s ``allocation`` and ``gains`` (``o_proj``'s
  ``kv_head_gains``, only for an allocation that needs them)."""
  gains = None
  if allocation is not None and allocation.needs_gains:
    layers = params["params"]["layers"]
    gain = lambda w: allocation_lib.kv_head_gains(w, config.n_heads, config.n_kv_heads,
                                                  config.head_dim)
    if isinstance(layers, (tuple, list)):  # unstacked: per-layer gains, stacked (small)
      gains = jnp.concatenate([gain(l["o_proj"]["kernel"][None]) for l in layers])
    else:
      gains = gain(layers["o_proj"]["kernel"])
  return dict(allocation=allocation, gains=gains)


def _last_logits(logits, mask):
  """[batch, vocab] logits at each row's last real token."""
  last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)
  return logits[jnp.arange(logits.shape[0]), last]


class DecodeCarry(NamedTuple):
  """What the decode loop carries: caches, the shadow (evaluation mode, or
  None), the design's state (or None) and the PRNG key."""

  caches: Caches
  shadow: Optional[Caches]
  state: Optional[object]
  key: Array


def decode_from(params, carry: DecodeCarry, first_logits, *, config: LlamaConfig,
                gen: GenerationConfig, budget=None) -> Generation:
  """:func:`generate`'s ``lax.scan`` decode loop from caches a caller prepared
  (its own prefill or eviction); ``first_logits`` [batch, vocab] are the last
  prompt token's. Traceable: call it inside ``jax.jit`` with ``config`` and
  ``gen`` static."""
  _check_stop_tokens(gen, config)
  return _decode_loop(params, config, gen, tuple(carry), first_logits, budget)


def _decode_loop(params, config, gen: GenerationConfig, carry, first_logits, budget):
  """Greedy ``lax.scan`` decode from the logits of the last prompt token.

  ``carry`` is ``(caches, shadow, state, key)``. Every step feeds the argmax
  token through :func:`forward_chunk` (with the certificate statistics) and,
  with ``gen.evict_each_step``, evicts after every ``gen.evict_every``-th step.
  That eviction runs at the start of the next step (or after the loop, for the
  last): in one XLA program an eviction after the step's attention would zero
  slots that its statistics still read, and XLA copies the caches to keep them
  apart. A ``lax.cond`` skips it on the other steps. The key is split at every
  step either way.
  """
  design, every = gen.design, gen.evict_every
  evicts = design is not None and gen.evict_each_step
  batch = first_logits.shape[0]
  settings = layer_lib.Settings(
      design, observe=False,
      certificate=Subsample(gen.certificate_layers, gen.certificate_heads),
      attention=gen.attention)
  caches, shadow, state, key = carry
  if gen.layer_loop == "unrolled":  # per-layer weights and caches for the whole loop
    params = forward.unstack_layers(params, config)
    caches = caches.unstack()
    shadow = None if shadow is None else shadow.unstack()

  per_head = allocation_args(params, config, gen.allocation)

  def evict_now(caches, shadow, state, sub):
    new = evict_and_record(design, caches, shadow, sub, state=state,
                           layer_budgets=gen.layer_budgets, budget=budget, **per_head)
    return new.caches, new.shadow, new.state

  def evict_pending(carry):  # the eviction the last live step left due, if any
    caches, shadow, state, logits, key, sub, pending = carry
    if evicts:
      caches, shadow, state = jax.lax.cond(
          pending, evict_now, lambda c, s, st, _: (c, s, st), caches, shadow, state, sub)
    return caches, shadow, state, logits, key, sub, jnp.zeros((), bool)

  def live(carry, i):
    caches, shadow, state, step_logits, key, _, _ = evict_pending(carry)
    logp = jax.nn.log_softmax(step_logits)
    token = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
    token_logp = jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]
    if gen.on_token is not None:
      jax.debug.callback(gen.on_token, i, token, ordered=True)
    new_logits, caches, stats, shadow = forward_chunk(
        params, config, token[:, None], jnp.ones((batch, 1), bool), caches, settings=settings,
        shadow=shadow, layer_loop=gen.layer_loop)
    key, sub = jax.random.split(key)
    pending = jnp.asarray(evicts) & (i % every == every - 1)  # amortized: into the slack
    stats = jax.tree_util.tree_map(lambda a: a[0], stats)  # t = 1
    out = (token, token_logp, step_logits if gen.return_logits else None, stats)
    return (caches, shadow, state, new_logits[:, 0], key, sub, pending), out

  def step(carry, i):
    if not gen.stop_tokens:
      return live(carry, i)
    carry, ended = carry

    def idle(carry, i):  # every row has ended: no model call, the key still advances
      _, out = jax.eval_shape(live, carry, i)
      nan = jax.tree_util.tree_map(
          lambda a: jnp.full(a.shape, jnp.nan if jnp.issubdtype(a.dtype, jnp.floating) else 0,
                             a.dtype), out[2:])
      carry = evict_pending(carry)
      key, sub = jax.random.split(carry[4])
      return carry[:4] + (key, sub, carry[6]), (jnp.full((batch,), stop[0]),
                                                 jnp.zeros((batch,)), *nan)

    carry, out = jax.lax.cond(jnp.all(ended), idle, live, carry, i)
    return (carry, ended | jnp.isin(out[0], stop)), out

  init = (caches, shadow, state, first_logits, key, key, jnp.zeros((), bool))
  if gen.stop_tokens:
    stop = jnp.asarray(gen.stop_tokens, jnp.int32)
    init = (init, jnp.zeros((batch,), bool))
  final, (toks, logps, step_logits, stats) = jax.lax.scan(
      step, init, jnp.arange(gen.n_steps, dtype=jnp.int32))
  caches, _, state, _, _, _, _ = evict_pending(final[0] if gen.stop_tokens else final)
  caches = caches.stack()
  certified = design is not None and design.randomized
  return Generation(
      tokens=toks.T, logprobs=logps.T,
      logits=None if step_logits is None else step_logits.transpose(1, 0, 2),
      var_hat=stats.var_hat, range_hat=stats.range_hat, out_norm=stats.out_norm,
      caches=caches,
      true_error=stats.true_error, rel_error=stats.rel_error, ratio=stats.ratio,
      tail_m=stats.tail_m, tail_n=stats.tail_n,
      n_dropped=jnp.max(caches.n_dropped, axis=(0, 2)).astype(jnp.int32),
      design_state=state, certified=jnp.asarray(certified),
      **{k: getattr(stats, k) for k in SIGNAL_FIELDS})


def _params_loop(params) -> str:
  """The layer loop for params in their form: the scan, unless they are per layer
  (``forward.unstack_layers``)."""
  return "unrolled" if isinstance(params["params"]["layers"], (tuple, list)) else "scan"


def _check_prompt(tokens, mask, n_steps, *, config=None, name="tokens",
                  allow_empty_rows=False):
  """Checks a right-padded ``[batch, len]`` prompt, its bool mask and ``n_steps``
  (:func:`models.inputs.check_prompt`: token ids against ``config.vocab_size``)."""
  inputs.check_prompt(tokens, mask, config=config, n_steps=n_steps, name=name,
                      allow_empty_rows=allow_empty_rows)


def _check_stop_tokens(gen: GenerationConfig, config: LlamaConfig) -> None:
  stops = gen.stop_tokens
  if not isinstance(stops, tuple) or not all(
      isinstance(t, int) and not isinstance(t, bool) and 0 <= t < config.vocab_size
      for t in stops):
    raise ValueError(f"stop_tokens must be a tuple of token ids in [0, {config.vocab_size}), "
                     f"got {stops!r}")


def _check_inputs(given: dict, gen: GenerationConfig) -> None:
  """Every check of the arguments (the prompts' shapes and values, the model's context
  length, ``models.inputs``; the certificate's subsample), on the concrete arguments
  before the jitted call."""
  config, n_steps, every = given["config"], gen.n_steps, gen.evict_every
  if gen.layer_loop not in forward.LAYER_LOOPS:
    raise ValueError(f"layer_loop must be one of {forward.LAYER_LOOPS}, got "
                     f"{gen.layer_loop!r}")
  if not isinstance(every, int) or isinstance(every, bool) or every < 1:
    raise ValueError(f"evict_every must be an int >= 1 (decode steps per eviction), got "
                     f"{every!r}")
  if every != 1 and (gen.design is None or not gen.evict_each_step):
    raise ValueError(f"evict_every={every} needs a design and evict_each_step=True (it says "
                     "how often decoding evicts)")
  _check_stop_tokens(gen, config)
  check_certificate_subsample(config, True, gen.certificate_layers, gen.certificate_heads)
  if "tokens" in given:  # generate
    _check_prompt(given["tokens"], given["mask"], n_steps, config=config)
    return
  ctx, qst = given["context"], given["question"]
  _check_prompt(ctx, given["context_mask"], n_steps, config=config.replace(max_positions=None),
                name="context", allow_empty_rows=True)
  _check_prompt(qst, given["question_mask"], n_steps, config=config.replace(max_positions=None),
                name="question")
  if config.max_positions is not None:  # padding takes no position: the longest real row
    masks = [_validate.concrete_array(given[f"{n}_mask"]) for n in ("context", "question")]
    rows = (jnp.shape(ctx)[1] + jnp.shape(qst)[1] if any(m is None for m in masks)
            else int((masks[0].sum(axis=1) + masks[1].sum(axis=1)).max()))
    need = rows + n_steps
    if need > config.max_positions:
      raise ValueError(f"the longest row's context and question ({rows} tokens) + n_steps "
                       f"({n_steps}) = {need} positions exceed the model's context, "
                       f"max_positions {config.max_positions}")


def _pair(pair, name: str):
  """``(tokens, mask)`` from ``pair``; a ValueError naming ``name`` unless it is a
  tuple or list of two arrays."""
  if isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
      hasattr(x, "shape") for x in pair):
    return tuple(pair)
  kind = lambda x: f"{type(x).__name__}{tuple(x.shape) if hasattr(x, 'shape') else ''}"
  got = (f"{type(pair).__name__} of {len(pair)}: ({', '.join(map(kind, pair))})"
         if isinstance(pair, (tuple, list)) else kind(pair))
  raise ValueError(f"{name} must be a (tokens, mask) pair of two arrays, got {got}")


def _sized(gen: GenerationConfig, given: dict) -> GenerationConfig:
  """``gen`` with its capacity set by ``certkv_jax.designs.budgets.capacity`` when None."""
  if gen.capacity is not None:
    return gen
  budget = given.get("budget")
  if isinstance(budget, jax.core.Tracer):
    raise ValueError("a traced budget needs an explicit GenerationConfig.capacity")
  if "tokens" in given:
    lengths = budgets_lib.Lengths(n_context=jnp.shape(given["tokens"])[1], n_steps=gen.n_steps)
  else:
    lengths = budgets_lib.Lengths(n_context=jnp.shape(given["context"])[1],
                                  n_question=jnp.shape(given["question"])[1],
                                  n_steps=gen.n_steps, chunk=gen.chunk)
  return gen.replace(capacity=budgets_lib.capacity(
      gen.design, lengths, budget=budget, layer_budgets=gen.layer_budgets,
      allocation=gen.allocation, config=given["config"]))


def _raise_on_overflow(gen: "Generation", given: dict) -> None:
  """Raises when an eager call dropped tokens (a concrete ``n_dropped`` > 0): the
  logits after the first dropped token are wrong. Inside an outer ``jit`` the
  count is traced and is returned in ``Generation.n_dropped`` instead."""
  if isinstance(gen.n_dropped, jax.core.Tracer):
    return
  dropped = jax.device_get(gen.n_dropped)
  if dropped.any():
    rows = [int(i) for i in dropped.nonzero()[0]]
    raise ValueError(f"capacity ({given['gen'].capacity}) overflowed: rows {rows[:8]} dropped up "
                     f"to {int(dropped.max())} tokens that found no cache slot, so their "
                     "logits are wrong; raise capacity to hold the kept tokens plus every "
                     "token appended between evictions (the prompt or a chunk, the question "
                     "and the decoded tokens)")


def _checking_budgets(jitted):
  """Checks the prompts (:func:`_check_inputs`), sizes the caches
  (:func:`_sized`) and checks the design and budget arguments before the
  jitted call, where a ``budget`` is still concrete."""
  signature = inspect.signature(jitted)
  rows = list(signature.parameters)[1]  # tokens / context, [batch, ...]

  @functools.wraps(jitted)
  def wrapper(*args, **kwargs):
    given = signature.bind(*args, **kwargs).arguments  # the arguments passed
    for name in ("context", "question"):  # generate_streaming's (tokens, mask) pairs
      if name in given:
        given[name], given[f"{name}_mask"] = _pair(given[name], name)
    gen = given["gen"]
    if not isinstance(gen, GenerationConfig):
      raise TypeError(f"gen must be a GenerationConfig, got {type(gen).__name__}")
    _check_inputs(given, gen)
    gen = _sized(gen, given)
    layer_budgets = budgets_lib.check_generation_budgets(
        gen.design, gen.layer_budgets, given.get("budget"),
        n_layers=given["config"].n_layers, capacity=gen.capacity,
        batch=jnp.shape(given[rows])[0])
    given["gen"] = gen = gen.replace(layer_budgets=layer_budgets)
    kwargs["gen"] = gen
    out = jitted(*args, **kwargs)
    _raise_on_overflow(out, given)
    return out

  return wrapper


@_checking_budgets
@functools.partial(jax.jit, static_argnames=("config", "gen"))
def generate(params, tokens, mask, key, *, config: LlamaConfig, gen: GenerationConfig,
             budget=None) -> Generation:
  """Question-aware greedy generation: prefill, evict once, ``lax.scan`` decode.

  The whole prompt (context and question) is prefilled, ``gen.design`` (if
  any) evicts once down to its budget, then ``gen.n_steps`` tokens are
  decoded (evicting again during decoding with ``gen.evict_each_step``).
  Decode steps attend with ``certkv_jax.offset_attention`` and report its
  certificate statistics; the prefill, which sees the full cache, skips them.

  Args:
    params: model parameters.
    tokens: [batch, prompt_len] int right-padded prompts.
    mask: [batch, prompt_len] bool, True on real prompt tokens (>= 1 per row).
    key: PRNG key for randomized designs.
    config: the model config (static).
    gen: a :class:`GenerationConfig` (static).
    budget: optional fraction in (0, 1] of the tokens seen, traced (a float,
      or float32 ``[]`` or ``[batch]``): replaces the design's budget in every
      layer, so one compile serves every budget; checked where concrete.

  Returns:
    A :class:`Generation`.
  """
  batch, prompt_len = tokens.shape
  design, capacity = gen.design, gen.capacity
  need = prompt_len + (gen.n_steps if design is None else 0)
  if capacity < need:
    raise ValueError(f"capacity ({capacity}) must hold the prompt ({prompt_len} tokens)"
                     f"{'' if design is not None else f' plus {gen.n_steps} decoded tokens'}")
  kv_dtype = precision.cache_dtype(config)  # keys and values; the statistics are float32
  caches = init_caches(config, batch, capacity, kv_dtype)
  shadow = (shadow_caches(config, batch, prompt_len + gen.n_steps, kv_dtype)
            if gen.evaluate else None)
  state = None if design is None else init_state(design, caches)
  logits, carry = _prompt_chunk(params, config, gen, budget, (caches, shadow, state, key),
                                (tokens, mask))
  return _decode_loop(params, config, gen, carry, _last_logits(logits, mask), budget)


def _prompt_chunk(params, config: LlamaConfig, gen: GenerationConfig, budget, carry, chunk):
  """A prompt chunk ``(tokens, mask)`` through the model (no certificate), then the
  design's eviction; returns ``(logits, carry)``, ``carry = (caches, shadow, state, key)``."""
  caches, shadow, state, key = carry
  per_head = allocation_args(params, config, gen.allocation)
  logits, caches, _, shadow = forward_chunk(
      params, config, *chunk, caches,
      settings=layer_lib.Settings(gen.design, certificate=False, attention=gen.attention),
      shadow=shadow, layer_loop=_params_loop(params))
  key, sub = jax.random.split(key)
  if gen.design is not None:
    caches, state, _, shadow = evict_and_record(gen.design, caches, shadow, sub, state=state,
                                                layer_budgets=gen.layer_budgets, budget=budget,
                                                **per_head)
  return logits, (caches, shadow, state, key)


@_checking_budgets
@functools.partial(jax.jit, static_argnames=("config", "gen"))
def generate_streaming(params, context, question, key, *, config: LlamaConfig,
                       gen: GenerationConfig, budget=None) -> Generation:
  """Streaming greedy generation: the context arrives in chunks, then the question.

  The context is fed ``gen.chunk`` tokens at a time (a ``lax.scan`` over
  chunks); after each chunk the design evicts down to its budget, before the
  question is known; each chunk's last ``design.observation_window`` queries
  are the observation window that scores that eviction (SnapKV). Then the
  question is prefilled and ``gen.n_steps`` tokens are decoded as in
  :func:`generate`.

  Args:
    params: model parameters.
    context: ``(tokens, mask)``: [batch, n_context] int tokens, right-padded per
      row, and their [batch, n_context] bool mask.
    question: ``(tokens, mask)``: [batch, n_question] int tokens, right-padded
      per row, and their [batch, n_question] bool mask (>= 1 real token per row).
    key: PRNG key.
    config, gen, budget: as in :func:`generate`; ``gen.chunk`` is required.

  Returns:
    A :class:`Generation`.
  """
  (context, context_mask), (question, question_mask) = context, question  # checked pairs
  design, capacity, chunk = gen.design, gen.capacity, gen.chunk
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
    return _prompt_chunk(params, config, gen, budget, carry, xs)[1], None

  kv_dtype = precision.cache_dtype(config)
  caches = init_caches(config, batch, capacity, kv_dtype)
  state = None if design is None else init_state(design, caches)
  shadow = None
  if gen.evaluate:
    n_tokens = n_chunks * chunk + question.shape[1] + gen.n_steps
    shadow = shadow_caches(config, batch, n_tokens, kv_dtype)
  (caches, shadow, state, key), _ = jax.lax.scan(
      feed, (caches, shadow, state, key), (as_chunks(context), as_chunks(context_mask)))
  logits, caches, _, shadow = forward_chunk(
      params, config, question, question_mask, caches,
      settings=layer_lib.Settings(design=design, certificate=False, attention=gen.attention),
      shadow=shadow,
      layer_loop=_params_loop(params))
  return _decode_loop(params, config, gen, (caches, shadow, state, key),
                      _last_logits(logits, question_mask), budget)


@functools.partial(jax.jit, static_argnames=("config", "design", "layer_loop"),
                   donate_argnames=("caches",))
def decode_step(params, caches: Caches, tokens, *, config: LlamaConfig, design=None,
                layer_loop: Optional[str] = None):
  """One decode step for a caller's own loop: ``tokens`` [batch] through the
  model with certificate statistics. The caches are donated (updated in place);
  evict between steps with ``certkv_jax.eviction.evict``.

  The fastest step takes ``forward.unstack_layers(params, config)`` and
  ``caches.unstack()`` (both once, before the loop): every layer's
  weights and caches are then read in place (``layer_loop="unrolled"``, which
  ``None`` picks for them; stacked params and caches: ``"scan"``).

  Returns:
    ``(logits [batch, vocab], caches, stats)``, ``stats`` a ``ChunkStats`` of
    ``[n_layers, batch, n_heads]`` arrays; the caches in the form given.
  """
  if layer_loop is None:
    per_layer = caches.per_layer or _params_loop(params) == "unrolled"
    layer_loop = "unrolled" if per_layer else "scan"
  valid = jnp.ones((tokens.shape[0], 1), bool)
  logits, caches, stats, _ = forward_chunk(
      params, config, tokens[:, None], valid, caches,
      settings=layer_lib.Settings(design=design, observe=False), layer_loop=layer_loop)
  return logits[:, 0], caches, jax.tree_util.tree_map(lambda a: a[0], stats)
