r"""Streaming language-model loss under eviction: the jitted core.

:func:`streaming_nll` streams a batch of token sequences through the model
``chunk`` tokens at a time (one jitted ``lax.scan`` over chunks): every chunk
is run with the kept cache (``models.forward.forward_chunk``, certificate
statistics on for a randomized design), each token's log-probability of the NEXT token of the stream
is scored, and then the design evicts down to its budget
(``certkv_jax.eviction.evict``) before the next chunk arrives. So the first chunk
never sees eviction, and every later token is predicted from a cache that has
been evicted after every earlier chunk: the streaming regime of method, section 8
on natural text instead of a task (the experiment:
:mod:`experiments.lib.streaming_loss.experiment`).

Budgets are fractions of the tokens seen so far (``floor(b * n_seen)``, the
repo's convention), so the kept cache grows with the stream. 'full' is no
eviction (the whole segment in the cache) and is the reference: its pass
equals the one-shot forward pass (:func:`one_shot_logprob`, tested), and it
always runs first, so that every other row carries its NLL increase over
the full cache on the same segment.

Per-token certificate summary: the Bernstein radius of method, section 5 at
``delta = 0.05`` (``certkv_jax.certificate.radius_from_stats``) of each
attention call of the token's query, SUMMED over layers and query heads (the
per-step aggregate the suite uses: a bound on the summed attention-error
norms, by the triangle inequality and a union bound). It is 0 for the full
cache and for every design without Hajek offsets (deterministic designs,
``uniform_random``): they have no certificate (Theorem 1). A token's radius
is paired with its NLL increase over the full cache on the same segment: both
describe the forward pass of that token's query, which produces the
distribution of the next token. A Poisson design's radius is also 0 on a
call whose kept set holds no sampled tail token (``V_hat`` is computed from
the kept tokens only), e.g. while the budget does not exceed the certainty
set (``--n_sink`` sinks + ``--window`` recent tokens).

Designs run with the suite's certainty set (``--n_sink``, ``--window``). In
this streaming setting SnapKV's observation window is the last ``--window``
queries of each chunk, reset before every chunk (so each eviction ranks by
the window just before it, as SnapKV does at the end of a prompt); the other
designs' statistics (accumulated and latest attention) do not depend on it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import certificate
from certkv_jax.designs import budgets
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from experiments.lib import stats
from experiments.lib.suite import settings as suite_settings
from models import decode
from models import forward
from models.llama import LlamaModel

DELTA = suite_settings.PRIMARY_DELTA  # the certificate's miss probability (per call)
SMOOTH_WINDOW = certificate.SMOOTHING_WINDOW


@dataclasses.dataclass(frozen=True)
class StreamConfig:
  """How a text streams through the model (static: one compile per distinct config).

  Attributes:
    chunk: tokens per chunk (>= 1); the sequence is padded to a multiple of it
      (padding takes no slot and is not scored).
    design: a ``certkv_jax`` eviction design, or None (nothing is evicted). Its
      ``observation_window`` last queries of each chunk are its observation
      window (SnapKV: the window before each eviction).
    capacity: cache slots per (layer, row, KV head): the kept tokens plus one
      chunk; without a design, the whole sequence. None sizes them with
      ``certkv_jax.designs.budgets.capacity`` from the design and the budget. Tokens
      that find no slot are counted in ``n_dropped``.
    delta: miss probability of the per-call radius, in (0, 1).
    allocation: optional per-head allocation (``certkv_jax.designs.allocation``),
      applied at every eviction; capacities are sized for its largest target.
    evaluate: evaluation mode: a never-evicted shadow cache gives every
      attention call's true error beside its radius (``StreamingNLL.calls``).
    certificate: False runs a randomized design without its certificate
      statistics (the same logits, radius 0): a loss-only run, several times
      faster. Evaluation mode needs it.
    smooth_window: calls per head in the smoothed radius that evaluation mode
      reports beside the raw one (``certkv_jax.certificate.smoothed_variance``).
  """

  chunk: int
  design: object = None
  capacity: Optional[int] = None
  delta: float = DELTA
  allocation: object = None
  evaluate: bool = False
  certificate: bool = True
  smooth_window: int = SMOOTH_WINDOW

  def sized(self, n: int, budget=None, config=None) -> "StreamConfig":
    """This config with its capacity set (``certkv_jax.designs.budgets.capacity`` for ``n``
    tokens at the largest of ``budget``; with an allocation, for its largest
    per-head target under ``config``'s heads and layers) where it is None."""
    if self.capacity is not None:
      return self
    cap = budgets.capacity(self.design, budgets.Lengths(n_context=n, chunk=self.chunk),
                           budget=None if self.design is None else budget,
                           allocation=self.allocation, config=config)
    return dataclasses.replace(self, capacity=cap)

  def check(self, tokens) -> None:
    """Raises ValueError naming the field that does not fit ``tokens`` [batch, n]."""
    if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
      raise ValueError(f"chunk must be an int >= 1, got {self.chunk!r}")
    if not isinstance(self.capacity, int) or self.capacity < self.chunk:
      raise ValueError(f"capacity must be an int >= chunk ({self.chunk}), got "
                       f"{self.capacity!r}")
    if self.design is None and self.capacity < tokens.shape[1]:
      raise ValueError(f"capacity ({self.capacity}) must hold the whole sequence "
                       f"({tokens.shape[1]} tokens) without a design")
    if self.evaluate and not self.certificate:
      raise ValueError("evaluate needs certificate=True (the radius beside each error)")
    w = self.smooth_window
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
      raise ValueError(f"smooth_window must be an int >= 1, got {w!r}")
    d = self.delta
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d < 1.0:
      raise ValueError(f"delta must be a float in (0, 1), got {d!r}")


class StreamingNLL(NamedTuple):
  """Output of :func:`streaming_nll` (``n`` = the input's length)."""

  logprob: jax.Array  # [b, n] float32 log p(token i+1 | tokens <= i, kept cache); 0 unscored
  scored: jax.Array  # [b, n] bool: position i has a real next token (not the last, not pad)
  radius: jax.Array  # [b, n] float32 sum over layers, heads of the radius at delta; 0 unscored
  kept: jax.Array  # [b, n_chunks] float32 mean kept slots (layers, KV heads) after each chunk
  n_dropped: jax.Array  # [b] int32 tokens that found no free slot (should be 0)
  calls: Optional["Calls"] = None  # evaluation mode only


class Calls(NamedTuple):
  """Every attention call of a stream in evaluation mode, ``[b, n, n_layers, n_heads]``."""

  radius: jax.Array  # float32 raw radius at delta (0 for the first chunk's calls)
  error: jax.Array  # float32 true error ||o_hat - o|| against the shadow full cache
  # float32 the radius with V_hat smoothed over each head's last smooth_window calls
  # (the stream's positions, across chunks: certificate.smoothed_variance)
  smoothed: Optional[jax.Array] = None


def chunked_targets(tokens, mask, chunk: int):
  """A sequence cut for a scan over chunks, with its next-token targets.

  Position i predicts token i + 1; it is scored when both are real (the last
  real token has no target). Returns ``(xs, scored, n_chunks)``: ``xs`` is
  ``(tokens, mask, targets, scored)``, each ``[n_chunks, b, chunk]`` (padded
  to whole chunks), and ``scored`` is ``[b, n]``.
  """
  b, n = tokens.shape
  targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
  scored = mask & jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
  n_chunks = -(-n // chunk)
  pad = ((0, 0), (0, n_chunks * chunk - n))
  as_chunks = lambda x: jnp.pad(x, pad).reshape(b, n_chunks, chunk).swapaxes(0, 1)
  return tuple(as_chunks(x) for x in (tokens, mask, targets, scored)), scored, n_chunks


@functools.partial(jax.jit, static_argnames=("config", "stream"))
def _streaming_nll(params, tokens, mask, key, budget, *, config,
                   stream: StreamConfig) -> StreamingNLL:
  chunk, design, delta = stream.chunk, stream.design, stream.delta
  b, n = tokens.shape
  xs, scored, n_chunks = chunked_targets(tokens, mask, chunk)
  # A deterministic design has no offsets: its radius is 0 (Theorem 1), and the plain
  # softmax path gives the same logits without the certificate's per-slot work.
  with_cert = design is not None and design.randomized and stream.certificate
  per_head = decode.allocation_args(params, config, stream.allocation)

  def step(carry, x):
    caches, shadow, key = carry
    toks, valid, tgt, sc = x
    # With a design that has an observation window (SnapKV), the chunk's last
    # design.observation_window queries replace its statistic: the window before
    # this eviction, not every earlier chunk's (models.forward.forward_chunk).
    logits, caches, st, shadow = forward.forward_chunk(
        params, config, toks, valid, caches,
        settings=layer_lib.Settings(design=design, certificate=with_cert), shadow=shadow)
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    lp = jnp.where(sc, lp, 0.0)
    calls = None
    if with_cert:  # [t, layers, b, heads] -> [b, t]
      r_call = certificate.radius_from_stats(st.var_hat, st.range_hat, delta)
      r = jnp.where(sc, jnp.sum(r_call, axis=(1, 3)).T, 0.0)
      if shadow is not None:  # [t, layers, b, heads] -> [b, t, layers, heads]
        calls = tuple(jnp.transpose(a, (2, 0, 1, 3))
                      for a in (r_call, st.true_error, st.var_hat, st.range_hat))
    else:
      r = jnp.zeros(lp.shape, jnp.float32)
    if design is not None:
      key, sub = jax.random.split(key)
      caches, _, _, shadow = eviction.evict_and_record(design, caches, shadow, sub, budget=budget,
                                                    **per_head)
    kept = jnp.mean(jnp.sum(caches.valid, axis=-1).astype(jnp.float32), axis=(0, 2))  # [b]
    return (caches, shadow, key), (lp, r, kept, calls)

  caches = caches_lib.init_caches(config, b, stream.capacity)
  shadow = caches_lib.shadow_caches(config, b, n_chunks * chunk) if stream.evaluate else None
  (caches, _, _), (lp, r, kept, calls) = jax.lax.scan(step, (caches, shadow, key), xs)
  unchunk = lambda a: a.swapaxes(0, 1).reshape((b, n_chunks * chunk) + a.shape[3:])[:, :n]
  n_dropped = jnp.sum(caches.n_dropped, axis=(0, 2)).astype(jnp.int32)
  if calls is not None:  # [b, n, layers, heads]
    radius, error, var_hat, range_hat = (unchunk(a) for a in calls)
    smoothed = certificate.smoothed_radius(var_hat, range_hat, delta, stream.smooth_window,
                                           axis=1)
    calls = Calls(radius, error, smoothed)
  return StreamingNLL(unchunk(lp), scored, unchunk(r), kept.T, n_dropped, calls)


def streaming_nll(params, tokens, mask, key, *, config, stream: StreamConfig,
                  budget=None) -> StreamingNLL:
  """Streams ``tokens`` through the model ``stream.chunk`` tokens at a time, evicting
  after each.

  One jitted ``lax.scan`` over chunks. Each chunk runs through
  ``models.forward.forward_chunk`` with the caches so far (with
  ``certificate=True`` when the design is randomized), every real token's
  log-probability of the next real token is taken from its logits, and then
  ``stream.design`` (if any) evicts every (layer, row, KV head) cache down to
  its budget with an independent PRNG key. Without a design nothing is evicted
  and the result equals the one-shot forward pass (:func:`one_shot_logprob`).

  Args:
    params: model parameters.
    tokens: [batch, n] int token ids, right-padded rows.
    mask: [batch, n] bool, True on real tokens.
    key: PRNG key of the randomized designs' draws.
    config: the model config (static).
    stream: a :class:`StreamConfig` (static): chunk, design, capacity, delta.
    budget: optional fraction in (0, 1] of the tokens seen (a float, ``[]``
      or ``[batch]``: one budget per row), traced, so one compile serves
      every budget; replaces the design's budget. Needs a design.

  Returns:
    A :class:`StreamingNLL`.
  """
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  if tokens.ndim != 2 or mask.shape != tokens.shape or mask.dtype != jnp.bool_:
    raise ValueError(f"tokens must be [batch, n] with a bool mask of the same shape; got "
                     f"tokens {tokens.shape}, mask {mask.dtype} {mask.shape}")
  if budget is not None and stream.design is None:
    raise ValueError("budget needs a design (without one nothing is evicted)")
  budget = budgets.check_budget(budget, tokens.shape[0])
  if stream.evaluate and stream.design is None:
    raise ValueError("evaluate needs a design (the full cache has no error to measure)")
  if isinstance(stream.chunk, int) and stream.chunk >= 1:
    stream = stream.sized(tokens.shape[1], budget, config)
  stream.check(tokens)
  return _streaming_nll(params, tokens, mask, key, budget, config=config,
                        stream=dataclasses.replace(stream, delta=float(stream.delta)))


@functools.partial(jax.jit, static_argnames=("config",))
def one_shot_logprob(params, tokens, mask, *, config):
  """``[b, n]`` log p(token i+1) from one full forward pass (``LlamaModel.__call__``)
  over the whole sequence; 0 where position i has no real next token. The
  reference that the full-cache :func:`streaming_nll` must equal."""
  logits = LlamaModel(config).apply(params, tokens, mask)
  logp = jax.nn.log_softmax(logits, axis=-1)
  targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
  scored = mask & jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
  lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.where(scored, lp, 0.0)


# ----------------------------------------------------------------------------- rows


def mean_or_none(x) -> Optional[float]:
  return float(np.mean(x)) if np.size(x) else None


def spearman(x, y) -> Optional[float]:
  """Spearman's rank correlation (Pearson on tie-averaged ranks); None when
  fewer than 3 values or either side is constant (undefined)."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
    return None
  rx = stats.average_ranks(x)
  ry = stats.average_ranks(y)
  return float(np.corrcoef(rx, ry)[0, 1])


def row_summary(lp, scored, radius, kept, n_dropped, chunk: int, full_nll=None) -> dict:
  """Summary of one batch row: losses overall, after the first chunk, per chunk,
  and against the full cache's per-token NLL ``full_nll`` ([n], None for the
  full row itself)."""
  n = len(lp)
  nll = -np.asarray(lp, np.float64)
  sc = np.asarray(scored, bool)
  rad = np.asarray(radius, np.float64)
  pos = np.arange(n)
  late = sc & (pos >= chunk)  # tokens predicted from an evicted cache
  n_chunks = -(-n // chunk)
  in_chunk = [sc & (pos // chunk == k) for k in range(n_chunks)]
  out = dict(
      n_scored=int(sc.sum()), mean_nll=float(nll[sc].mean()),
      perplexity=float(np.exp(nll[sc].mean())),
      mean_nll_after_first_chunk=mean_or_none(nll[late]),
      chunk_nll=[mean_or_none(nll[m]) for m in in_chunk],
      chunk_radius=[mean_or_none(rad[m]) for m in in_chunk],
      mean_radius=mean_or_none(rad[late]),
      kept_per_chunk=[round(float(k), 3) for k in kept],
      n_dropped=int(n_dropped))
  if full_nll is None:
    out.update(delta_nll=0.0, delta_nll_after_first_chunk=0.0, spearman_radius_increase=None)
    out["token_nll"] = [round(float(v), 6) if s else None for v, s in zip(nll[:-1], sc[:-1])]
    return out
  full = np.asarray([np.nan if v is None else v for v in full_nll], np.float64)
  if len(full) != n - 1:
    raise ValueError(f"full_nll has {len(full)} tokens, expected {n - 1}")
  full = np.append(full, np.nan)
  inc = nll - full
  out.update(delta_nll=float(np.mean(inc[sc])),
             delta_nll_after_first_chunk=mean_or_none(inc[late]),
             spearman_radius_increase=spearman(rad[late], inc[late]))
  return out
