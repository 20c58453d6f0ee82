"""A generation's static settings (:class:`GenerationConfig`) and result
(:class:`Generation`: tokens and per-step certificate statistics), re-exported by
``models.decode``."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import jax

from certkv_jax import _validate
from certkv_jax.attention import offset
from certkv_jax.kv.caches import Caches

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """How to generate (static: one compile per distinct config)."""

  n_steps: int  # tokens to decode (greedy)
  design: object = None  # an eviction design; None keeps everything
  capacity: Optional[int] = None  # slots per (layer, row, KV head); None: budgets.capacity
  chunk: Optional[int] = None  # context tokens per chunk (streaming generation only)
  evict_each_step: bool = False  # evict while decoding too (method, section 3)
  evict_every: int = 1  # decode steps per eviction (>= 1; not 1 needs evict_each_step)
  return_logits: bool = False  # also return every step's logits
  evaluate: bool = False  # a never-evicted shadow cache: true errors and Assumption-2 audit
  layer_budgets: Optional[tuple] = None  # one budget per layer (all ints or all floats)
  allocation: object = None  # a per-head certkv_jax.designs.allocation applied at every eviction
  certificate_layers: Optional[tuple] = None  # certified layers (None = all; the rest NaN)
  certificate_heads: Optional[tuple] = None  # certified KV heads (None = all; the rest NaN)
  on_token: Optional[Callable] = None  # host on_token(step, tokens), an ordered callback
  # Ids ending a row (EOS); once all rows have one, later steps skip the model
  # and return stop_tokens[0], log-probability 0 and NaN logits and statistics.
  stop_tokens: tuple = ()
  layer_loop: str = "scan"  # decode steps' loop: "scan" or "unrolled" (forward.forward_chunk)
  attention: object = None  # a certkv_jax.AttentionConfig of every attention product, or None

  def __post_init__(self):
    _validate.check_design(self.design, optional=True)
    _validate.check_allocation(self.allocation)
    offset.check_attention_config(self.attention)
    if self.allocation is not None and self.design is None:
      raise ValueError("allocation needs a design: it shares out the design's budget (got "
                       f"design=None, allocation={self.allocation!r})")

  def replace(self, **kw) -> "GenerationConfig":
    return dataclasses.replace(self, **kw)


class Generation(NamedTuple):
  """The result of :func:`generate` / :func:`generate_streaming`."""

  tokens: Array  # [batch, n_steps] int32 generated tokens (greedy)
  logprobs: Array  # [batch, n_steps] float32 log-probability of each generated token
  logits: Optional[Array]  # [batch, n_steps, vocab] float32 if return_logits
  # Statistics of step i (the pass of token i); NaN for calls not certified.
  var_hat: Array  # [n_steps, n_layers, batch, n_heads] float32
  range_hat: Array  # [n_steps, n_layers, batch, n_heads] float32
  caches: Caches  # final caches, stacked (``n_dropped`` counts tokens that found no slot)
  # [batch] int32 tokens that found no slot: nonzero means wrong logits (eager raises).
  n_dropped: Optional[Array] = None
  # The design's counters, leaves [n_layers, batch, n_kv_heads]; None without one.
  design_state: Optional[object] = None
  # [] bool: False for no or a deterministic design (V_hat = 0, no certificate).
  certified: Optional[Array] = None
  # ||o_hat|| of each certified call, [n_steps, n_layers, batch, n_heads].
  out_norm: Optional[Array] = None
  # Evaluation mode only (None otherwise), same steps as var_hat:
  true_error: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] ||o_hat - o||
  rel_error: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] ||o_hat - o||/||o||
  # Assumption-2 audit (method, section 6; evaluation mode); 0 when T is empty.
  ratio: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] R
  tail_m: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] m = sum_T pi_i
  tail_n: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads] |T|
  # Warning signals (evaluation mode; certkv_jax.certificate.signals):
  ess: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads]
  max_tail_weight: Optional[Array] = None
  range_ratio: Optional[Array] = None
  entropy: Optional[Array] = None
  r_hat: Optional[Array] = None
  tail_mass: Optional[Array] = None
