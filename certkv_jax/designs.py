"""Eviction designs: a certainty set composed with a tail rule, under a budget.

A design is a frozen dataclass of hyperparameters with three pure functions,
in the optax style (``init``/``update`` there, ``init``/``update``/``evict``
here)::

    state = design.init(cache)
    cache, state = design.update(cache, state, probs)        # fold in a query
    cache, state, info = design.evict(cache, state, key)     # down to budget

It is a static pytree (no array leaves), so it can be passed as an argument to
``jax.jit``; everything that varies at run time lives in the cache and state.
Designs work on one KV head's cache; ``jax.vmap`` lifts them over heads,
batch and layers (split the PRNG key per head).

Composition (like ``optax.chain``): ``compose(certain, tail, budget)`` keeps
the certainty set ``H`` (sinks, recent window, heavy hitters) and lets a tail
rule choose among the rest ``T`` for the remaining slots. Deterministic tail
rules (:class:`TopK`) keep the highest scores; :class:`UniformTail` keeps a
uniformly random subset with no offset (an ablation); :class:`PoissonTail` is
method, section 3's randomized design with Hajek offsets.

The certified factories (``poisson_*``, ``priority_*``,
:func:`attention_proportional`) take their certainty set as one
:class:`CertaintySet`, ``poisson_tail(0.25, certain=CertaintySet(n_sink=4,
window=16))``; the registry also reads its fields by name
(``registry.make("poisson_tail", 0.25, n_sink=4, window=16)``). The
deterministic baselines, which keep no heavy hitters, take ``n_sink`` and
``window``.

Two variants aim at a more valid raw certificate (method, sections 3 and 6):
:func:`poisson_defensive` mixes the tail score with the uniform score
(:class:`scores.Defensive`), which floors ``pi`` and bounds the Assumption-2
ratio ``R`` for any query; :func:`poisson_envelope` also folds the
observation window as an attention envelope (``fold="peak"``,
:func:`cache.observe_peak`) and samples the tail from its defensive mixture.

Budget: ``int`` = tokens kept after eviction; ``float`` in (0, 1] = fraction of
the tokens seen so far, ``floor(fraction * n_seen)`` (kvpress's convention).
Eviction triggers only when more tokens are valid than the budget allows.
Every design fills at most ``budget`` slots; :class:`PoissonTail` reserves its
tail slots for a random count (see ``sampling.expected_tail_count``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from certkv_jax import cache as cache_lib
from certkv_jax import scores
from certkv_jax.cache import KVCache
# The building blocks, part of this module's public API (designs.CertaintySet, ...).
from certkv_jax.design_parts import AMBIGUOUS_ONE  # pylint: disable=unused-import  # noqa: F401
from certkv_jax.design_parts import as_budget
from certkv_jax.design_parts import Budget
from certkv_jax.design_parts import CertaintySet  # pylint: disable=unused-import
from certkv_jax.design_parts import PoissonTail  # pylint: disable=unused-import
from certkv_jax.design_parts import PriorityTail
from certkv_jax.design_parts import TailChoice  # pylint: disable=unused-import
from certkv_jax.design_parts import TailRule
from certkv_jax.design_parts import TopK
from certkv_jax.design_parts import UniformTail  # pylint: disable=unused-import

Array = jax.Array


# --------------------------------------------------------------------------- the design


class DesignState(NamedTuple):
  rounds: Array  # [] int32 eviction rounds that evicted something
  n_redraws: Array  # [] int32 total Poisson redraws after an overflow
  n_dropped: Array  # [] int32 tokens dropped by the overflow fallback (expected 0)
  n_over_budget: Array  # [] int32 rounds whose certainty set alone exceeded the budget


class EvictionInfo(NamedTuple):
  """What one ``evict`` call did (per slot, before compaction)."""

  kept: Array  # [cap] bool, kept after this round
  evicted: Array  # [cap] bool, valid before and removed now
  certain: Array  # [cap] bool, in the certainty set H this round
  pi: Array  # [cap] float32 this round's inclusion probability (1 = certain; 0 if invalid)
  m: Array  # [] float32 expected kept tail count
  n_tail: Array  # [] int32 size of the tail T
  target: Array  # [] int32 budget in tokens
  triggered: Array  # [] bool, whether eviction happened


# How ``EvictionDesign.update`` folds attention into the cache statistics.
FOLDS = {"sum": cache_lib.observe, "peak": cache_lib.observe_peak}


@dataclasses.dataclass(frozen=True)
class EvictionDesign:
  """A certainty set composed with a tail rule under a budget (static pytree).

  ``fold`` chooses how :meth:`update` folds attention into the slot
  statistics: "sum" (:func:`cache.observe`: ``obs`` sums the window queries'
  group-mean attention) or "peak" (:func:`cache.observe_peak`: ``obs`` is the
  max over window queries and group heads). ``acc`` and ``last`` are the same
  under both.

  ``observation_window`` belongs to the design, because the design knows
  which statistics it scores with: when a prompt chunk is folded
  (``models.forward.forward_chunk``), its last ``observation_window`` real
  queries are the observation window and ``obs`` is replaced by their
  attention (SnapKV: the window before each eviction; in streaming, each
  chunk's). ``min_tail`` (default 0) raises the target to at least the
  certainty set plus ``min_tail`` tokens, so that a budget smaller than the
  certainty set (early streaming chunks) still leaves a sampled tail: with
  none, every tail token is evicted with ``pi = eps``, a deterministic deletion
  the certificate cannot see. The price: up to ``min_tail`` tokens above the
  budget while it is that small. A design whose scores read ``obs``
  (:func:`scores.reads_observation`) needs a window of at least 1 and refuses 0: with no window its score
  would be zero everywhere and its choice would silently fall back to slot
  order.
  """

  name: str
  certain: CertaintySet
  tail: TailRule
  budget: Budget
  fold: str = "sum"
  observation_window: int = 0
  min_tail: int = 0

  def __post_init__(self):
    if self.fold not in FOLDS:
      raise ValueError(f"fold must be one of {sorted(FOLDS)}, got {self.fold!r}")
    if isinstance(self.min_tail, bool) or not isinstance(self.min_tail, int) or self.min_tail < 0:
      raise ValueError(f"min_tail must be an int >= 0, got {self.min_tail!r}")
    w = self.observation_window
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
      raise ValueError(f"observation_window must be an int >= 0, got {w!r}")
    if w == 0 and self.needs_observation:
      raise ValueError(f"design {self.name!r} scores with the observation-window statistic "
                       "(WindowAttention) and needs observation_window >= 1, got 0")

  @property
  def reads(self) -> frozenset:
    """What the design's scores read of the cache (``scores.READS``)."""
    used = [getattr(self.tail, "score", None), getattr(self.tail, "heavy_score", None)]
    if self.certain.heavy:
      used.append(self.certain.heavy_score)
    return frozenset().union(*(scores.reads_of(x) for x in used if x is not None))

  @property
  def needs_observation(self) -> bool:
    """Whether the design's scores read the observation-window statistic ``obs``."""
    return "obs" in self.reads

  @property
  def randomized(self) -> bool:
    return bool(self.tail.randomized)

  @property
  def hparams(self) -> dict:
    return {"name": self.name, "budget": self.budget, "certain": self.certain,
            "tail": self.tail, "fold": self.fold,
            "observation_window": self.observation_window, "min_tail": self.min_tail}

  def init(self, cache: KVCache) -> DesignState:
    """Checks the cache against the design and returns a fresh state."""
    cap = cache.capacity
    if cap < self.certain.size:
      raise ValueError(f"capacity {cap} is smaller than the certainty set of design "
                       f"{self.name!r} (n_sink + window + heavy = {self.certain.size})")
    if self.budget.tokens is not None and self.budget.tokens > cap:
      raise ValueError(f"budget ({self.budget.tokens} tokens) exceeds the cache capacity "
                       f"({cap}); use capacity >= budget + tokens appended between evictions")
    z = jnp.zeros((), jnp.int32)
    return DesignState(rounds=z, n_redraws=z, n_dropped=z, n_over_budget=z)

  def update(self, cache: KVCache, state: DesignState, probs, *,
             observation=False) -> tuple[KVCache, DesignState]:
    """Folds the attention probabilities of new queries into the cache statistics.

    Args:
      probs: [cap], [q, cap] or [g, q, cap] probabilities over the slots.
      observation: True for observation-window queries (SnapKV).
    """
    return FOLDS[self.fold](cache, probs, observation=observation), state

  def evict(self, cache: KVCache, state: DesignState, key) -> tuple[KVCache, DesignState,
                                                                    EvictionInfo]:
    """Evicts down to the budget (a no-op when the cache is within budget)."""
    valid = cache.valid
    certain = self.certain(cache) & valid
    n_certain = jnp.sum(certain).astype(jnp.int32)
    target = self.budget.target(cache)
    if self.min_tail:  # never fewer than min_tail tail slots beside the certainty set
      target = jnp.maximum(target, n_certain + self.min_tail)
    triggered = cache.n_valid > target
    slots = jnp.maximum(target - n_certain, 0)
    tail = valid & ~certain
    choice = self.tail.select(cache, tail, slots, key)
    keep = jnp.where(triggered, certain | choice.keep, valid)
    round_log_pi = jnp.where(triggered, choice.log_pi, 0.0)
    new_cache = cache_lib.rebase_if_needed(cache_lib.keep_only(cache, keep, round_log_pi))
    pi = jnp.where(certain, 1.0, choice.pi)
    pi = jnp.where(triggered, pi, 1.0)
    info = EvictionInfo(
        kept=keep,
        evicted=valid & ~keep,
        certain=jnp.where(triggered, certain, valid),
        pi=jnp.where(valid, pi, 0.0).astype(jnp.float32),
        m=jnp.where(triggered, choice.m, 0.0),
        n_tail=jnp.where(triggered, jnp.sum(tail), 0).astype(jnp.int32),
        target=target,
        triggered=triggered,
    )
    t = triggered.astype(jnp.int32)
    new_state = DesignState(
        rounds=state.rounds + t,
        n_redraws=state.n_redraws + t * choice.n_redraws,
        n_dropped=state.n_dropped + t * choice.n_dropped,
        n_over_budget=state.n_over_budget + t * (n_certain > target).astype(jnp.int32),
    )
    return new_cache, new_state, info


jax.tree_util.register_static(EvictionDesign)


def _check_budget_vs_certain(budget: Budget, certain: CertaintySet, name: str):
  if budget.tokens is not None and budget.tokens < certain.size:
    raise ValueError(f"budget ({budget.tokens} tokens) is smaller than the certainty set of "
                     f"{name!r} (n_sink + window + heavy = {certain.size})")


def compose(certain: CertaintySet, tail, budget, name: str = "custom",
            fold: str = "sum", observation_window: int = 0,
            min_tail: int = 0) -> EvictionDesign:
  """A design from a certainty set, a tail rule and a budget (``fold``,
  ``observation_window`` and ``min_tail``: see :class:`EvictionDesign`)."""
  budget = as_budget(budget)
  if not isinstance(certain, CertaintySet):
    raise TypeError(f"certain must be a CertaintySet, got {type(certain).__name__}")
  if not hasattr(tail, "select"):
    raise TypeError(f"tail must be a tail rule (TopK, UniformTail, PoissonTail), got {tail!r}")
  _check_budget_vs_certain(budget, certain, name)
  return EvictionDesign(name=name, certain=certain, tail=tail, budget=budget, fold=fold,
                        observation_window=observation_window, min_tail=min_tail)


# The share of a certified twin's tail slots kept by its score's rank (method, section 3,
# "Certified twins"); the rest are sampled.
TWIN_SHARE = 0.75
# Their sampling weights' floor, relative to the tail's mean weight: no tail token is
# nearly never drawn, so no Horvitz-Thompson term 1 / pi is nearly unbounded.
TWIN_EPS = 0.05


def certified(design: EvictionDesign, *, top_share: float = TWIN_SHARE,
              eps: float = TWIN_EPS) -> EvictionDesign:
  """The certified twin of a deterministic (top-k) design (method, section 3,
  "Certified twins"): the same certainty set, budget, fold and observation
  window; ``floor(top_share * slots)`` of the tail slots kept by the design's
  own score with certainty, the others filled by a priority sample weighted by
  that score (shifted to be non-negative on the tail) plus ``eps`` times its
  tail mean, with Hajek offsets and the certificate. Named ``<name>_cert``.

  Raises:
    TypeError unless ``design`` has a :class:`TopK` tail; ValueError unless
    ``top_share`` is in [0, 1).
  """
  if not isinstance(design, EvictionDesign) or not isinstance(design.tail, TopK):
    raise TypeError("certified needs a deterministic top-k design (a TopK tail), got "
                    f"{getattr(design, 'name', design)!r}")
  if isinstance(top_share, bool) or not isinstance(top_share, (int, float)) or not (
      0.0 <= top_share < 1.0):
    raise ValueError(f"top_share must be a float in [0, 1), got {top_share!r}")
  tail = PriorityTail(score=scores.TailShifted(design.tail.score), eps=eps,
                      heavy_share=top_share)
  return dataclasses.replace(design, tail=tail, name=f"{design.name}_cert")


# --------------------------------------------------------------------------- factories


def _maybe_value_aware(score, value_aware: bool):
  return scores.ValueAware(score) if value_aware else score


def sink_window(budget, *, n_sink: int = 4) -> EvictionDesign:
  """StreamingLLM: the first ``n_sink`` tokens plus the most recent ones."""
  return compose(CertaintySet(n_sink=n_sink), TopK(scores.Recency()), budget, "sink_window")


def top_k(budget, score, *, n_sink: int = 0, window: int = 0, value_aware: bool = False,
          name: str = "top_k", observation_window: int = 0) -> EvictionDesign:
  """Sinks + recent window + the highest-scoring tokens (deterministic)."""
  return compose(CertaintySet(n_sink=n_sink, window=window),
                 TopK(_maybe_value_aware(score, value_aware)), budget, name,
                 observation_window=observation_window)


def h2o(budget, *, n_sink: int = 0, window: int = 0, value_aware: bool = False):
  """H2O: accumulated attention mass (heavy hitters) + recent window."""
  return top_k(budget, scores.AccumulatedAttention(), n_sink=n_sink, window=window,
               value_aware=value_aware, name="h2o")


def tova(budget, *, n_sink: int = 0, window: int = 0, value_aware: bool = False):
  """TOVA: attention of the current query."""
  return top_k(budget, scores.CurrentAttention(), n_sink=n_sink, window=window,
               value_aware=value_aware, name="tova")


def snapkv(budget, *, window: int = 64, pool_size: int = 5, n_sink: int = 0,
           value_aware: bool = False, observation_window: Optional[int] = None):
  """SnapKV (question-aware): observation-window attention, pooled; the window
  itself is kept. ``observation_window`` (default: ``window``, >= 1) is the
  number of last prompt queries whose attention scores the tokens."""
  obs = window if observation_window is None else observation_window
  return top_k(budget, scores.WindowAttention(pool_size), n_sink=n_sink, window=window,
               value_aware=value_aware, name="snapkv", observation_window=obs)


def key_norm(budget, *, n_sink: int = 0, window: int = 0, value_aware: bool = False):
  """Knorm: keep the keys with the smallest L2 norm."""
  return top_k(budget, scores.KeyNorm(), n_sink=n_sink, window=window,
               value_aware=value_aware, name="key_norm")


def uniform_random(budget, *, n_sink: int = 0, window: int = 0) -> EvictionDesign:
  """Ablation: uniform random tail with no Hajek offset (biased on purpose)."""
  return compose(CertaintySet(n_sink=n_sink, window=window), UniformTail(), budget,
                 "uniform_random")


def poisson_tail(budget, *, certain: CertaintySet = CertaintySet(),
                 score=scores.AccumulatedAttention(), eps: float = 1e-6,
                 overflow_prob: float = 1e-3, max_redraws: int = 3,
                 min_tail: int = 0) -> EvictionDesign:
  """The certified design (method, section 3): the certainty set ``certain``
  (sinks, window, heavy hitters by accumulated attention) + a Poisson-sampled
  tail with Hajek offsets. ``min_tail``: see :class:`EvictionDesign`."""
  return _poisson("poisson_tail", budget, score=score, certain=certain, eps=eps,
                  overflow_prob=overflow_prob, max_redraws=max_redraws, min_tail=min_tail)


def _poisson(name, budget, *, score, certain=CertaintySet(), eps=1e-6, overflow_prob=1e-3,
             max_redraws=3, min_tail=0) -> EvictionDesign:
  return compose(
      certain,
      PoissonTail(score=score, eps=eps, overflow_prob=overflow_prob, max_redraws=max_redraws),
      budget, name, min_tail=min_tail)


def priority_tail(budget, *, certain: CertaintySet = CertaintySet(),
                  score=scores.AccumulatedAttention(), eps: float = 1e-6,
                  min_tail: int = 0, heavy_share: float = 0.0) -> EvictionDesign:
  """The certified design with a fixed-size tail: the certainty set of
  :func:`poisson_tail` and a priority-sampled tail (:class:`PriorityTail`) that
  fills every slot the certainty set leaves (method, section 3, "Fixed-size
  tail"); ``heavy_share`` of those slots go to the top-scored tail tokens."""
  return compose(certain, PriorityTail(score=score, eps=eps, heavy_share=heavy_share), budget,
                 "priority_tail", min_tail=min_tail)


def priority_floor(budget, *, certain: CertaintySet = CertaintySet(),
                   score=scores.AccumulatedAttention(), eps: float = 1e-6,
                   min_tail: int = 16, heavy_share: float = 0.0) -> EvictionDesign:
  """:func:`priority_tail` with at least ``min_tail`` sampled tail tokens beside the
  certainty set (:class:`EvictionDesign`'s ``min_tail``), as :func:`poisson_floor`."""
  return dataclasses.replace(
      priority_tail(budget, certain=certain, score=score, eps=eps, min_tail=min_tail,
                    heavy_share=heavy_share),
      name="priority_floor")


def priority_blend(budget, *, certain: CertaintySet = CertaintySet(),
                   window_weight: float = 0.5, window_share: float = 0.0, pool_size: int = 5,
                   min_tail: int = 16, eps: float = 1e-6,
                   observation_window: Optional[int] = None) -> EvictionDesign:
  """:func:`priority_floor` with SnapKV's statistic beside H2O's: the tail's
  weights are ``scores.Blend`` of accumulated attention (weight
  ``1 - window_weight``) and the observation window's pooled attention
  (``window_weight``), and ``window_share`` of the tail slots are first filled
  with the tokens the window attends to most (SnapKV's choice, kept with
  certainty), so a token only the question points at is kept even when the
  history never looked at it (method, section 3, "Blended weights").
  ``observation_window`` defaults to ``max(certain.window, 1)`` queries.

  Raises:
    ValueError naming ``window_weight`` unless it is in [0, 1], or
    ``window_share`` unless it is in [0, 1).
  """
  ww = window_weight
  if isinstance(ww, bool) or not isinstance(ww, (int, float)) or not 0.0 <= ww <= 1.0:
    raise ValueError(f"window_weight must be a float in [0, 1], got {ww!r}")
  f = window_share
  if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
    raise ValueError(f"window_share must be a float in [0, 1), got {f!r}")
  obs = _observation_window(certain, observation_window)
  snap = scores.WindowAttention(pool_size)
  score = scores.Blend((scores.AccumulatedAttention(), snap), (1.0 - ww, ww))
  return compose(certain,
                 PriorityTail(score=score, eps=eps, heavy_share=window_share,
                              heavy_score=snap), budget,
                 "priority_blend", observation_window=obs, min_tail=min_tail)


def _observation_window(certain, observation_window: Optional[int]) -> int:
  """``observation_window``, or ``max(certain.window, 1)`` when None."""
  if observation_window is not None:
    return observation_window
  return max(getattr(certain, "window", 0), 1)  # compose checks the type of certain


@dataclasses.dataclass(frozen=True)
class Focus:
  """How :func:`priority_focus`'s blend follows the window (``scores.FocusBlend``).

  The window weight is ``focused_weight`` where the window's effective share
  over the tail is ``focused`` or less, ``diffuse_weight`` at ``diffuse`` or
  more, linear between; the window's attention is pooled over ``pool_size``
  neighbouring positions. The defaults are ``scores.FocusBlend()``'s.

  Raises:
    ValueError naming the setting unless ``0 <= focused < diffuse <= 1``, the
    weights are in [0, 1] and ``pool_size`` is an odd int >= 1.
  """

  focused: float = 0.05
  diffuse: float = 0.2
  focused_weight: float = 1.0
  diffuse_weight: float = 0.5
  pool_size: int = 5

  def __post_init__(self):
    self.score()  # the score's own checks, each naming its setting

  def score(self) -> scores.FocusBlend:
    """The blended score: H2O's accumulated attention against SnapKV's pooled window."""
    return scores.FocusBlend(scores.AccumulatedAttention(),
                             scores.WindowAttention(self.pool_size), self.focused,
                             self.diffuse, self.focused_weight, self.diffuse_weight)


def priority_focus(budget, *, certain: CertaintySet = CertaintySet(), focus: Focus = Focus(),
                   min_tail: int = 16, eps: float = 1e-6, focus_share: float = 0.0,
                   window_share: float = 0.0,
                   observation_window: Optional[int] = None) -> EvictionDesign:
  """:func:`priority_blend` whose window weight follows the window: per head
  and eviction, ``scores.FocusBlend`` (built from ``focus``) weighs SnapKV's
  statistic by how concentrated the observation window's attention over the
  tail is (a question pointing at a fact) against H2O's (running text), both
  normalised over the tail (method, section 3, "Focus-weighted blend").
  ``focus_share`` of the slots, scaled by how focused the window is (0 at
  ``focus.diffuse``, 1 at ``focus.focused``), go by rank of the window's score
  with certainty (:class:`PriorityTail`; method, section 3, "Focused share").
  ``window_share`` of the slots go by that rank at every eviction, focused or
  not (method, section 3, "Window share"): a question whose attention is
  broad still keeps the span it ranks first, as SnapKV does.
  ``observation_window`` defaults to ``max(certain.window, 1)`` queries.

  Raises:
    TypeError unless ``focus`` is a :class:`Focus`; ValueError naming the
    argument unless ``focus_share`` and ``window_share`` are in [0, 1) and
    their sum is below 1 (``focus``'s own ranges: :class:`Focus`).
  """
  if not isinstance(focus, Focus):
    raise TypeError(f"focus must be a designs.Focus, got {focus!r}")
  f = window_share
  if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
    raise ValueError(f"window_share must be a float in [0, 1), got {f!r}")
  if f and isinstance(focus_share, (int, float)) and f + focus_share >= 1.0:
    raise ValueError("window_share + focus_share must be below 1 (a slot left to sample), "
                     f"got {f!r} + {focus_share!r}")
  obs = _observation_window(certain, observation_window)
  score = focus.score()
  tail = PriorityTail(score=score, eps=eps, focus_share=focus_share, heavy_share=window_share,
                      heavy_score=score.window if window_share else None)
  return compose(certain, tail, budget, "priority_focus",
                 observation_window=obs, min_tail=min_tail)


def poisson_floor(budget, *, certain: CertaintySet = CertaintySet(),
                  score=scores.AccumulatedAttention(), eps: float = 1e-6,
                  overflow_prob: float = 1e-3, max_redraws: int = 3,
                  min_tail: int = 16) -> EvictionDesign:
  """:func:`poisson_tail` that always samples at least ``min_tail`` tail slots,
  so early streaming chunks are sampled rather than evicted whole."""
  return _poisson("poisson_floor", budget, score=score, certain=certain, eps=eps,
                  overflow_prob=overflow_prob, max_redraws=max_redraws, min_tail=min_tail)


def poisson_flat(budget, *, certain: CertaintySet = CertaintySet(), eps: float = 1e-6,
                 overflow_prob: float = 1e-3, max_redraws: int = 3,
                 min_tail: int = 0) -> EvictionDesign:
  """:func:`poisson_tail` with uniform scores (flat inclusion probabilities)."""
  return _poisson("poisson_flat", budget, score=scores.Uniform(), certain=certain, eps=eps,
                  overflow_prob=overflow_prob, max_redraws=max_redraws, min_tail=min_tail)


def attention_proportional(budget, *, certain: CertaintySet = CertaintySet(),
                           eps: float = 1e-6, overflow_prob: float = 1e-3,
                           max_redraws: int = 3) -> EvictionDesign:
  """The ``pi ∝ a`` variant (method, section 6): tail probabilities proportional
  to the current query's attention, for which Assumption 2 holds by construction."""
  return _poisson("attention_proportional", budget, score=scores.CurrentAttention(),
                  certain=certain, eps=eps, overflow_prob=overflow_prob,
                  max_redraws=max_redraws)


def poisson_defensive(budget, *, certain: CertaintySet = CertaintySet(),
                      uniform_share: float = 0.2, eps: float = 1e-6,
                      overflow_prob: float = 1e-3, max_redraws: int = 3) -> EvictionDesign:
  """:func:`poisson_tail` with the defensive tail score
  ``Defensive(AccumulatedAttention(), uniform_share)``, which floors ``pi`` on
  the tail and bounds the Assumption-2 ratio (method, sections 3 and 6;
  :class:`scores.Defensive`).

  Raises:
    ValueError naming ``uniform_share`` unless it is in [0, 1].
  """
  return _poisson("poisson_defensive", budget,
                  score=scores.Defensive(scores.AccumulatedAttention(), uniform_share),
                  certain=certain, eps=eps, overflow_prob=overflow_prob,
                  max_redraws=max_redraws)


def poisson_envelope(budget, *, certain: CertaintySet = CertaintySet(),
                     uniform_share: float = 0.2, eps: float = 1e-6,
                     overflow_prob: float = 1e-3, max_redraws: int = 3,
                     observation_window: Optional[int] = None) -> EvictionDesign:
  """Poisson tail sampled from the question's attention envelope (method,
  sections 3 and 6): the observation window is folded as a running max
  (``fold="peak"``) and the tail score is its defensive mixture
  ``Defensive(WindowAttention(1), uniform_share)``. ``observation_window``
  defaults to ``max(certain.window, 1)`` queries.

  Raises:
    ValueError naming ``uniform_share`` unless it is in [0, 1], or
    ``observation_window`` unless it is >= 1.
  """
  obs = _observation_window(certain, observation_window)
  return compose(
      certain,
      PoissonTail(score=scores.Defensive(scores.WindowAttention(1), uniform_share), eps=eps,
                  overflow_prob=overflow_prob, max_redraws=max_redraws),
      budget, "poisson_envelope", fold="peak", observation_window=obs)
