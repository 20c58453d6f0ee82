"""Greedy generation with certkv caches: prefill, eviction, ``lax.scan`` decode.

The pieces, one module each:

* ``models.caches`` -- the stacked caches, one :class:`certkv_jax.KVCache` per
  (layer, batch row, KV head), leaves ``[n_layers, batch, n_kv_heads, ...]``.
* ``models.forward`` -- :func:`forward_chunk`: a chunk of tokens through the
  model; every layer appends to its caches, attends and, with a design, folds
  the attention probabilities into the slot statistics.
* ``models.certified_attention`` -- a layer's attention with its certificate
  statistics (subsampled by layer / KV head; the truth in evaluation mode).
* ``models.eviction`` -- :func:`evict`: the design on every cache.
* ``models.budgets`` -- the one place budgets are checked and resolved.

This module holds the two jitted regimes, both with a ``lax.scan`` greedy
decode loop (no recompilation per token) over ragged, right-padded batches:

* :func:`generate` (question-aware): prefill the whole prompt, evict once,
  decode (optionally evicting after every step).
* :func:`generate_streaming`: the context arrives in chunks and is evicted
  down to budget after each chunk, before the question is known; then the
  question is prefilled and the answer decoded.

The ``design`` argument takes one path: its budget arguments are checked once
(``models.budgets.check_generation_budgets``, before the jitted call), the
design folds every chunk's statistics (``forward_chunk``), and every eviction
is ``models.eviction.evict``, which resolves the budget into each cache's
target (``models.budgets.eviction_targets``) and applies the design.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from certkv_jax.cache import KVCache
from models import budgets as budgets_lib
from models import inputs
from models.budgets import check_budget
from models.caches import init_caches
from models.certified_attention import ChunkStats
from models.certified_attention import SIGNAL_FIELDS
from models.certified_attention import check_certificate_subsample
from models.config import LlamaConfig
from models.eviction import evict
from models.eviction import evict_and_record
from models.eviction import record_inclusion
from models.forward import forward_chunk

Array = jax.Array

__all__ = [
    "ChunkStats",
    "Generation",
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

# The name tests and experiments/demo_smollm2.py use for evict_and_record.
_evict = evict_and_record


class Generation(NamedTuple):
  """The result of :func:`generate` / :func:`generate_streaming`."""

  tokens: Array  # [batch, n_steps] int32 generated tokens (greedy)
  logprobs: Array  # [batch, n_steps] float32 log-probability of each generated token
  logits: Optional[Array]  # [batch, n_steps, vocab] float32 if return_logits
  # Certificate statistics of decode step i: the forward pass of generated token
  # i, whose attention produces the distribution of token i + 1. NaN for the
  # (layer, head) calls left out by ``certificate_layers`` / ``certificate_heads``.
  var_hat: Array  # [n_steps, n_layers, batch, n_heads] float32
  range_hat: Array  # [n_steps, n_layers, batch, n_heads] float32
  caches: KVCache  # final caches (``n_dropped`` counts tokens that found no slot)
  # [batch] int32: tokens of each row that found no cache slot (the max over its
  # (layer, KV head) caches). Nonzero means the capacity was too small and the
  # logits after it are wrong; the eager call raises (see generate), a call
  # inside an outer jit returns it here (and certkv_jax.checked catches it).
  n_dropped: Optional[Array] = None
  # [] bool: whether var_hat / range_hat certify anything. False without a
  # design or with a deterministic one: their V_hat is 0 by construction, and
  # a radius of 0 then means "no certificate", not "no error" (Theorem 1).
  certified: Optional[Array] = None
  # Evaluation mode only (None otherwise), same steps as var_hat:
  true_error: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] ||o_hat - o||
  rel_error: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] ||o_hat - o||/||o||
  # Assumption-2 audit of every decode call (method, section 6; evaluation mode):
  # R = m max_{i in T} a_i / (pi_i sum_C a_j) over the full context C, with
  # pi_i each token's cumulative inclusion probability (up to its eviction)
  # and T the tokens sampled with 0 < pi_i < 1; 0 when T is empty (e.g. any
  # deterministic design: its pi is 0 or 1).
  ratio: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] R
  tail_m: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] m = sum_T pi_i
  tail_n: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] |T|
  # Online warning signals of every decode call (evaluation mode; see
  # models.certified_attention.ChunkStats and certkv_jax.signals):
  ess: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads]
  max_tail_weight: Optional[Array] = None
  range_ratio: Optional[Array] = None
  entropy: Optional[Array] = None
  r_hat: Optional[Array] = None
  tail_mass: Optional[Array] = None


def _last_logits(logits, mask):
  """[batch, vocab] logits at each row's last real token."""
  last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)
  return logits[jnp.arange(logits.shape[0]), last]


def _decode_loop(params, config, caches, shadow, first_logits, key, n_steps, design,
                 evict_each_step, return_logits, layer_budgets=None,
                 budget=None, certificate_layers=None, certificate_heads=None,
                 evict_every: int = 1, on_token=None) -> Generation:
  """Greedy ``lax.scan`` decode from the logits of the last prompt token.

  Every step feeds the argmax token through :func:`forward_chunk` (with the
  certificate statistics) and, with ``evict_each_step``, evicts again after
  every ``evict_every``-th step (steps ``evict_every - 1``,
  ``2 evict_every - 1``, ...; a ``lax.cond``, so the other steps do no
  eviction work). The key is split at every step either way, so that
  ``evict_every=1`` is today's loop, bit for bit. ``first_logits`` is
  [batch, vocab]; the other arguments are as in :func:`generate`.
  ``on_token(step, tokens)`` is called on the host as each step's tokens are
  chosen (an ordered ``jax.debug.callback``), so a caller can show them while
  the loop runs.
  """
  batch = first_logits.shape[0]

  def evict_now(caches, shadow, sub):
    return evict_and_record(design, caches, shadow, sub, layer_budgets, budget)

  def step(carry, i):
    caches, shadow, step_logits, key = carry
    logp = jax.nn.log_softmax(step_logits)
    token = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
    token_logp = jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]
    if on_token is not None:
      jax.debug.callback(on_token, i, token, ordered=True)
    new_logits, caches, stats, shadow = forward_chunk(
        params, config, token[:, None], jnp.ones((batch, 1), bool), caches, design=design,
        observe=False, shadow=shadow, certificate_layers=certificate_layers,
        certificate_heads=certificate_heads)
    key, sub = jax.random.split(key)
    if design is not None and evict_each_step:
      if evict_every == 1:
        caches, shadow = evict_now(caches, shadow, sub)
      else:  # amortized: one eviction every evict_every steps, into the slack slots
        caches, shadow = jax.lax.cond(i % evict_every == evict_every - 1, evict_now,
                                      lambda c, s, _: (c, s), caches, shadow, sub)
    stats = jax.tree_util.tree_map(lambda a: a[0], stats)  # t = 1
    out = (token, token_logp, step_logits if return_logits else None, stats)
    return (caches, shadow, new_logits[:, 0], key), out

  (caches, _, _, _), (toks, logps, step_logits, stats) = jax.lax.scan(
      step, (caches, shadow, first_logits, key), jnp.arange(n_steps, dtype=jnp.int32))
  certified = design is not None and design.randomized
  return Generation(
      tokens=toks.T, logprobs=logps.T,
      logits=None if step_logits is None else step_logits.transpose(1, 0, 2),
      var_hat=stats.var_hat, range_hat=stats.range_hat, caches=caches,
      true_error=stats.true_error, rel_error=stats.rel_error, ratio=stats.ratio,
      tail_m=stats.tail_m, tail_n=stats.tail_n,
      n_dropped=jnp.max(caches.n_dropped, axis=(0, 2)).astype(jnp.int32),
      certified=jnp.asarray(certified),
      **{k: getattr(stats, k) for k in SIGNAL_FIELDS})


def _check_prompt(tokens, mask, n_steps, *, config=None, name="tokens",
                  allow_empty_rows=False):
  """Checks a right-padded ``[batch, len]`` prompt, its bool mask and ``n_steps``.

  :func:`models.inputs.check_prompt`: shapes, an empty prompt and ``n_steps``
  always; token ids (against ``config.vocab_size``, when ``config`` is given)
  and mask rows only when the arrays are concrete, i.e. when called before the
  jitted function (inside it they are traced and those checks are skipped).
  """
  inputs.check_prompt(tokens, mask, config=config, n_steps=n_steps, name=name,
                      allow_empty_rows=allow_empty_rows)


_STATIC = ("config", "capacity", "n_steps", "design", "evict_each_step", "evict_every",
           "return_logits", "evaluate", "layer_budgets", "certificate_layers",
           "certificate_heads", "on_token")


def _check_inputs(given: dict) -> None:
  """The prompt checks that need values (token ids, mask rows, the model's context
  length; ``models.inputs``), run on the concrete arguments before the jitted call."""
  config, n_steps = given["config"], given.get("n_steps")
  every = given.get("evict_every", 1)
  if not isinstance(every, int) or isinstance(every, bool) or every < 1:
    raise ValueError(f"evict_every must be an int >= 1 (decode steps per eviction), got "
                     f"{every!r}")
  if every != 1 and (given.get("design") is None or not given.get("evict_each_step")):
    raise ValueError(f"evict_every={every} needs a design and evict_each_step=True (it says "
                     "how often decoding evicts)")
  if "tokens" in given:  # generate
    _check_prompt(given["tokens"], given["mask"], n_steps, config=config)
    return
  ctx, qst = given["context"], given["question"]
  _check_prompt(ctx, given["context_mask"], n_steps, config=config.replace(max_positions=None),
                name="context", allow_empty_rows=True)
  _check_prompt(qst, given["question_mask"], n_steps, config=config.replace(max_positions=None),
                name="question")
  if config.max_positions is not None:
    need = jnp.shape(ctx)[1] + jnp.shape(qst)[1] + n_steps
    if need > config.max_positions:
      raise ValueError(f"context ({jnp.shape(ctx)[1]}) + question ({jnp.shape(qst)[1]}) + "
                       f"n_steps ({n_steps}) = {need} positions exceed the model's context, "
                       f"max_positions {config.max_positions}")


def _raise_on_overflow(gen: "Generation", given: dict) -> None:
  """Raises when an eager call dropped tokens (a concrete ``n_dropped`` > 0): the
  logits after the first dropped token are wrong. Inside an outer ``jit`` the
  count is traced and is returned in ``Generation.n_dropped`` instead."""
  if isinstance(gen.n_dropped, jax.core.Tracer):
    return
  dropped = jax.device_get(gen.n_dropped)
  if dropped.any():
    rows = [int(i) for i in dropped.nonzero()[0]]
    raise ValueError(f"capacity ({given['capacity']}) overflowed: rows {rows[:8]} dropped up "
                     f"to {int(dropped.max())} tokens that found no cache slot, so their "
                     "logits are wrong; raise capacity to hold the kept tokens plus every "
                     "token appended between evictions (the prompt or a chunk, the question "
                     "and the decoded tokens)")


def _checking_budgets(jitted):
  """Checks the prompts (:func:`_check_inputs`), the design and the budget
  arguments before the jitted call.

  ``models.budgets.check_generation_budgets`` runs here, where a ``budget`` is
  still concrete (inside the jitted call it is traced, so only its shape
  could be checked), and ``layer_budgets`` is passed on as a tuple.
  """
  signature = inspect.signature(jitted)
  rows = list(signature.parameters)[1]  # tokens / context, [batch, ...]

  @functools.wraps(jitted)
  def wrapper(*args, **kwargs):
    given = signature.bind(*args, **kwargs).arguments  # the arguments passed
    _check_inputs(given)
    layer_budgets = budgets_lib.check_generation_budgets(
        given.get("design"), given.get("layer_budgets"), given.get("budget"),
        n_layers=given["config"].n_layers, capacity=given["capacity"],
        batch=jnp.shape(given[rows])[0])
    if "layer_budgets" in kwargs:
      kwargs["layer_budgets"] = layer_budgets
    out = jitted(*args, **kwargs)
    _raise_on_overflow(out, given)
    return out

  return wrapper


@_checking_budgets
@functools.partial(jax.jit, static_argnames=_STATIC)
def generate(params, tokens, mask, key, *, config: LlamaConfig, capacity: int, n_steps: int,
             design=None, evict_each_step: bool = False, evict_every: int = 1,
             return_logits: bool = False, evaluate: bool = False,
             layer_budgets: Optional[tuple] = None, budget=None,
             certificate_layers: Optional[tuple] = None,
             certificate_heads: Optional[tuple] = None, on_token=None) -> Generation:
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
    design: optional eviction design; None keeps everything. Its
      ``observation_window`` last prompt queries are the observation window
      (SnapKV's statistic; the window belongs to the design).
    evict_each_step: evict during decoding too: after every ``evict_every``-th
      decode step.
    evict_every: static int >= 1 (default 1: after every step): amortized
      eviction. The tokens decoded between two evictions stay in the cache
      (certain, ``pi = 1``) and are scored with the rest at the next one, so
      ``capacity`` needs ``evict_every`` slots of slack above the kept
      tokens, and eviction's per-step work is paid once per ``evict_every``
      steps. The certificate stays exact for the rounds actually run
      (method, section 3, "Amortized eviction"). 1 is the per-step loop bit
      for bit; a value other than 1 needs ``evict_each_step``.
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
    on_token: optional static host function ``on_token(step, tokens)``, called
      with each decode step's index and its ``[batch]`` tokens as they are
      chosen (for streaming them to a user); the outputs do not change.

  Returns:
    A :class:`Generation`.
  """
  _check_prompt(tokens, mask, n_steps)
  check_certificate_subsample(config, True, certificate_layers, certificate_heads)
  batch, prompt_len = tokens.shape
  need = prompt_len + (n_steps if design is None else 0)
  if capacity < need:
    raise ValueError(f"capacity ({capacity}) must hold the prompt ({prompt_len} tokens)"
                     f"{'' if design is not None else f' plus {n_steps} decoded tokens'}")
  caches = init_caches(config, batch, capacity)
  shadow = init_caches(config, batch, prompt_len + n_steps) if evaluate else None
  logits, caches, _, shadow = forward_chunk(
      params, config, tokens, mask, caches, design=design, certificate=False, shadow=shadow)
  key, sub = jax.random.split(key)
  if design is not None:
    caches, shadow = evict_and_record(design, caches, shadow, sub, layer_budgets, budget)
  return _decode_loop(params, config, caches, shadow, _last_logits(logits, mask), key, n_steps,
                      design, evict_each_step, return_logits, layer_budgets, budget,
                      certificate_layers, certificate_heads, evict_every, on_token)


@_checking_budgets
@functools.partial(jax.jit, static_argnames=_STATIC + ("chunk",))
def generate_streaming(params, context, context_mask, question, question_mask, key, *,
                       config: LlamaConfig, capacity: int, n_steps: int, chunk: int,
                       design=None, evict_each_step: bool = False, evict_every: int = 1,
                       return_logits: bool = False,
                       evaluate: bool = False,
                       layer_budgets: Optional[tuple] = None, budget=None,
                       certificate_layers: Optional[tuple] = None,
                       certificate_heads: Optional[tuple] = None,
                       on_token=None) -> Generation:
  """Streaming greedy generation: the context arrives in chunks, then the question.

  The context is fed ``chunk`` tokens at a time (a ``lax.scan`` over chunks);
  after each chunk the design evicts down to its budget, before the question
  is known; each chunk's last ``design.observation_window`` queries are the
  observation window that scores that eviction (SnapKV). Then the question is
  prefilled (its last queries are the window) and ``n_steps`` tokens are
  decoded as in :func:`generate`.

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
    design, evict_each_step, evict_every, return_logits, evaluate,
      layer_budgets, budget, certificate_layers, certificate_heads, on_token: as in
      :func:`generate` (the shadow cache holds the whole padded context, the
      question and the decoded tokens).

  Returns:
    A :class:`Generation`.
  """
  _check_prompt(context, context_mask, n_steps, name="context", allow_empty_rows=True)
  check_certificate_subsample(config, True, certificate_layers, certificate_heads)
  _check_prompt(question, question_mask, n_steps, name="question")
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
      caches, shadow = evict_and_record(design, caches, shadow, sub, layer_budgets, budget)
    return (caches, shadow, key), None

  caches = init_caches(config, batch, capacity)
  shadow = None
  if evaluate:
    shadow = init_caches(config, batch, n_chunks * chunk + question.shape[1] + n_steps)
  (caches, shadow, key), _ = jax.lax.scan(feed, (caches, shadow, key),
                                          (as_chunks(context), as_chunks(context_mask)))
  logits, caches, _, shadow = forward_chunk(
      params, config, question, question_mask, caches, design=design, certificate=False,
      shadow=shadow)
  return _decode_loop(params, config, caches, shadow, _last_logits(logits, question_mask), key,
                      n_steps, design, evict_each_step, return_logits, layer_budgets, budget,
                      certificate_layers, certificate_heads, evict_every, on_token)
