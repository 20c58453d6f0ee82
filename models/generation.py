"""What :mod:`models.decode` is asked to do and what it returns.

:class:`GenerationConfig` holds the static settings of a generation (one compile
per distinct config); :class:`Generation` is the result, tokens beside the
certificate statistics of every decode step. ``models.decode`` re-exports both.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import jax

from certkv_jax.cache import KVCache

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """How to generate (static: one compile per distinct config).

  Attributes:
    n_steps: tokens to decode (greedy).
    design: an eviction design, or None to keep everything.
    capacity: cache slots per (layer, row, KV head); None sizes them with
      ``certkv_jax.budgets.capacity`` from the design and the prompt.
    chunk: context tokens per chunk (streaming generation only).
    evict_each_step: evict during decoding too, after every ``evict_every``-th
      step (amortized eviction: ``evict_every`` slots of slack, the
      certificate exact for the rounds run; method, section 3).
    evict_every: decode steps per eviction (>= 1; not 1 needs evict_each_step).
    return_logits: also return every step's logits.
    evaluate: evaluation mode: a never-evicted shadow cache gives every decode
      call's true error and Assumption-2 audit.
    layer_budgets: one budget per layer (all ints or all floats; PyramidKV),
      replacing the design's budget layer by layer.
    allocation: a per-head allocation (``certkv_jax.allocation``: AdaKV,
      CertificateTargeted, TargetRadius, Pyramid) applied at every eviction;
      capacities are sized for its largest per-head target.
    certificate_layers, certificate_heads: layer / KV-head indices whose decode
      steps are certified (None = all); the rest report NaN, the tokens do not
      change.
    on_token: host function ``on_token(step, tokens)`` called as each step's
      ``[batch]`` tokens are chosen (an ordered ``jax.debug.callback``).
    stop_tokens: token ids that end a row's answer (EOS). Once every row has
      emitted one, the remaining steps skip the model (a ``lax.cond``): they
      return ``stop_tokens[0]`` with log-probability 0 and NaN logits and
      statistics. Everything up to that step equals the run without it.
    layer_loop: the decode steps' loop over the layers
      (``models.forward.forward_chunk``): "scan", or "unrolled" (per-layer
      weights and caches read in place; the caches are split before the decode
      loop and stacked after it, and stacked params sliced once per call:
      pass ``forward.unstack_layers(params, config)`` to skip that). The prefill scans.
  """

  n_steps: int
  design: object = None
  capacity: Optional[int] = None
  chunk: Optional[int] = None
  evict_each_step: bool = False
  evict_every: int = 1
  return_logits: bool = False
  evaluate: bool = False
  layer_budgets: Optional[tuple] = None
  allocation: object = None
  certificate_layers: Optional[tuple] = None
  certificate_heads: Optional[tuple] = None
  on_token: Optional[Callable] = None
  stop_tokens: tuple = ()
  layer_loop: str = "scan"

  def replace(self, **kw) -> "GenerationConfig":
    return dataclasses.replace(self, **kw)


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
  # The design's counters (rounds, redraws, dropped tokens, rounds over budget),
  # leaves [n_layers, batch, n_kv_heads]; None without a design.
  design_state: Optional[object] = None
  # [] bool: whether var_hat / range_hat certify anything. False without a
  # design or with a deterministic one: their V_hat is 0 by construction, and
  # a radius of 0 then means "no certificate", not "no error" (Theorem 1).
  certified: Optional[Array] = None
  # ||o_hat|| of every certified call, the scale a radius is read against
  # (NaN where not certified); [n_steps, n_layers, batch, n_heads] float32.
  out_norm: Optional[Array] = None
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
  # certkv_jax.certified_attention.ChunkStats and certkv_jax.signals):
  ess: Optional[Array] = None  # [n_steps, n_layers, batch, n_heads]
  max_tail_weight: Optional[Array] = None
  range_ratio: Optional[Array] = None
  entropy: Optional[Array] = None
  r_hat: Optional[Array] = None
  tail_mass: Optional[Array] = None
