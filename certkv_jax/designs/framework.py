"""Eviction designs: a certainty set composed with a tail rule, under a budget.

A design is a static pytree with ``init``/``update``/``evict`` in the optax
style, written for one KV head (``jax.vmap`` lifts it). ``compose`` keeps the
certainty set and lets a tail rule (:class:`TopK`, :class:`UniformTail`,
:class:`PoissonTail`, :class:`PriorityTail`) fill the remaining slots. A
budget is an int (tokens kept) or a fraction of the tokens seen (method,
sections 3 and 9).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from certkv_jax.designs.parts import as_budget
from certkv_jax.designs.parts import Budget
from certkv_jax.designs.parts import CertaintySet
from certkv_jax.designs.parts import PoissonTail
from certkv_jax.designs.parts import PriorityTail
from certkv_jax.designs.parts import TailRule
from certkv_jax.designs.parts import TopK
from certkv_jax.designs.parts import UniformTail
from certkv_jax.designs import scores
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv.cache import KVCache

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

  ``fold`` is "sum" (:func:`cache.observe`) or "peak" (:func:`cache.observe_peak`).
  The last ``observation_window`` queries of each prompt chunk replace ``obs``;
  a design whose scores read ``obs`` refuses a window of 0. ``min_tail`` keeps a
  sampled tail when the budget is below the certainty set, at the price of up
  to ``min_tail`` tokens over budget; ``spill`` instead lets the window join the tail
  there, so that no token leaves with ``pi = 0`` (method, section 3, "Spill"): its
  ``spill_slots`` oldest slots (0: all of it), the rest of the window staying certain;
  without a window to spill, the sinks.
  """

  name: str
  certain: CertaintySet
  tail: TailRule
  budget: Budget
  fold: str = "sum"
  observation_window: int = 0
  min_tail: int = 0
  spill: bool = False
  spill_slots: int = 0

  def __post_init__(self):
    if self.fold not in FOLDS:
      raise ValueError(f"fold must be one of {sorted(FOLDS)}, got {self.fold!r}")
    for name in ("min_tail", "spill_slots"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
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
            "observation_window": self.observation_window, "min_tail": self.min_tail,
            "spill": self.spill, "spill_slots": self.spill_slots}

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
    # A round that had to evict and whose certainty set alone exceeds the budget (spill
    # below may raise the target to it, so the round would no longer count as triggered).
    over_budget = (n_certain > target) & (cache.n_valid > target)
    if self.spill:  # no slot left for the tail: keep as many, the window's by the tail rule
      tight = target <= n_certain
      target = jnp.maximum(target, n_certain)
      window = max(self.certain.window - self.spill_slots, 0) if self.spill_slots else 0
      spilled = dataclasses.replace(self.certain, window=window)(cache) & valid
      spilled &= jnp.sum(spilled) < target  # no window to spill: the sinks join the tail too
      certain = jnp.where(tight, spilled, certain)
      n_certain = jnp.sum(certain).astype(jnp.int32)
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
        n_over_budget=state.n_over_budget + over_budget.astype(jnp.int32),
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
  """A design from a certainty set, a tail rule and a budget (see :class:`EvictionDesign`)."""
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
TWIN_SHARE = 0.5
# Their sampling weights' floor, relative to the tail's mean weight: no tail token is
# nearly never drawn, so no Horvitz-Thompson term 1 / pi is nearly unbounded. At 1 half
# the sampled weight is spread uniformly (method, section 3, "The floor's size").
TWIN_EPS = 1.0


def certified(design: EvictionDesign, *, top_share: float = TWIN_SHARE,
              eps: float = TWIN_EPS, spill: bool = True, spill_slots: int = 0) -> EvictionDesign:
  """The certified twin ``<name>_cert`` of a deterministic (top-k) design (method, section 3).

  ``top_share`` of the tail slots go by the design's own score with certainty;
  the rest are priority-sampled by that score, with Hajek offsets. ``spill``: where
  the budget leaves no tail slot, the window (its ``spill_slots`` oldest slots; 0: all)
  joins the tail (:class:`EvictionDesign`).

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
  if spill not in (True, False):  # 0 / 1 from a design string
    raise ValueError(f"spill must be a bool (or 0 / 1), got {spill!r}")
  tail = PriorityTail(score=scores.TailShifted(design.tail.score), eps=eps,
                      heavy_share=top_share)
  return dataclasses.replace(design, tail=tail, name=f"{design.name}_cert", spill=bool(spill),
                             spill_slots=spill_slots)


# --------------------------------------------------------------------------- factories


def _maybe_value_aware(score, value_aware: bool):
  if value_aware not in (True, False):  # 0 and 1 too, as a design string writes them
    raise ValueError(f"value_aware must be a bool, got {value_aware!r}")
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
  """SnapKV (question-aware): pooled observation-window attention; the window is kept."""
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
  """The certified design (method, section 3): certainty set + Poisson tail with Hajek offsets."""
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
  """The certified design with a fixed-size, priority-sampled tail (method, section 3).

  ``heavy_share`` of the tail slots go to the top-scored tail tokens.
  """
  return compose(certain, PriorityTail(score=score, eps=eps, heavy_share=heavy_share), budget,
                 "priority_tail", min_tail=min_tail)


def priority_floor(budget, *, certain: CertaintySet = CertaintySet(),
                   score=scores.AccumulatedAttention(), eps: float = 1e-6,
                   min_tail: int = 16, heavy_share: float = 0.0) -> EvictionDesign:
  """:func:`priority_tail` with at least ``min_tail`` sampled tail tokens."""
  return dataclasses.replace(
      priority_tail(budget, certain=certain, score=score, eps=eps, min_tail=min_tail,
                    heavy_share=heavy_share),
      name="priority_floor")


def priority_blend(budget, *, certain: CertaintySet = CertaintySet(),
                   window_weight: float = 0.5, window_share: float = 0.0, pool_size: int = 5,
                   min_tail: int = 16, eps: float = 1e-6,
                   observation_window: Optional[int] = None) -> EvictionDesign:
  """:func:`priority_floor` weighting H2O's and SnapKV's statistics.

  Method, section 3, "Blended weights": ``window_share`` of the tail slots go
  first to the tokens the window attends to most, with certainty.

  Raises:
    ValueError unless ``window_weight`` is in [0, 1] and ``window_share`` in [0, 1).
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

  Raises:
    ValueError unless ``0 <= focused < diffuse <= 1``, the weights are in
    [0, 1] and ``pool_size`` is an odd int >= 1.
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
  """:func:`priority_blend` whose window weight follows how focused the window is.

  Method, section 3 ("Focus-weighted blend", "Focused share", "Window share"):
  ``focus_share`` (scaled by focus) and ``window_share`` of the slots go by the
  window's rank with certainty.

  Raises:
    TypeError unless ``focus`` is a :class:`Focus`; ValueError unless
    ``focus_share`` and ``window_share`` are in [0, 1) and sum below 1.
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
  """:func:`poisson_tail` that always samples at least ``min_tail`` tail slots."""
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
  """The ``pi ∝ a`` variant, for which Assumption 2 holds by construction (method, section 6)."""
  return _poisson("attention_proportional", budget, score=scores.CurrentAttention(),
                  certain=certain, eps=eps, overflow_prob=overflow_prob,
                  max_redraws=max_redraws)


def poisson_defensive(budget, *, certain: CertaintySet = CertaintySet(),
                      uniform_share: float = 0.2, eps: float = 1e-6,
                      overflow_prob: float = 1e-3, max_redraws: int = 3) -> EvictionDesign:
  """:func:`poisson_tail` with a defensive tail score that floors ``pi`` (method, sections 3 and 6).

  Raises:
    ValueError unless ``uniform_share`` is in [0, 1].
  """
  return _poisson("poisson_defensive", budget,
                  score=scores.Defensive(scores.AccumulatedAttention(), uniform_share),
                  certain=certain, eps=eps, overflow_prob=overflow_prob,
                  max_redraws=max_redraws)


def poisson_envelope(budget, *, certain: CertaintySet = CertaintySet(),
                     uniform_share: float = 0.2, eps: float = 1e-6,
                     overflow_prob: float = 1e-3, max_redraws: int = 3,
                     observation_window: Optional[int] = None) -> EvictionDesign:
  """Poisson tail sampled from the window's attention envelope (method, sections 3 and 6).

  Raises:
    ValueError unless ``uniform_share`` is in [0, 1] and ``observation_window`` >= 1.
  """
  obs = _observation_window(certain, observation_window)
  return compose(
      certain,
      PoissonTail(score=scores.Defensive(scores.WindowAttention(1), uniform_share), eps=eps,
                  overflow_prob=overflow_prob, max_redraws=max_redraws),
      budget, "poisson_envelope", fold="peak", observation_window=obs)
