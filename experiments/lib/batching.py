"""Batched evaluation-mode calls the studies share: padding, last logits, one unit's call.

A *unit* (:class:`UnitCall`) is one (design, regime) whose rows run as batched
``models.decode`` calls with the same padded shapes, so that every slice of it
shares a compile (method, section 8).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from certkv_jax.designs import budgets
from experiments.lib import design_defaults
from models import decode


def pad_batch(seqs, length: Optional[int] = None):
  """Right-padded ``(ids [n, max_len] int32, mask [n, max_len] bool)`` of token lists
  (``length``: pad to this many columns instead, >= the longest)."""
  n = max(len(s) for s in seqs)
  if length is not None:
    if length < n:
      raise ValueError(f"length ({length}) must be >= the longest sequence ({n})")
    n = length
  ids = np.zeros((len(seqs), n), np.int32)
  mask = np.zeros((len(seqs), n), bool)
  for i, s in enumerate(seqs):
    ids[i, :len(s)], mask[i, :len(s)] = s, True
  return jnp.asarray(ids), jnp.asarray(mask)


def last_logits(logits, mask):
  """[batch, vocab] logits at each row's last real token (``mask`` [batch, len] bool, each
  row right-padded with at least one real token), as generation reads them."""
  last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)
  return logits[jnp.arange(logits.shape[0]), last]


def pad_shape(examples) -> dict:
  """The padded lengths of a batch of ``examples`` (see :func:`run_batch`)."""
  return dict(prompt=max(len(e.context_ids) + len(e.question_ids) for e in examples),
              context=max(len(e.context_ids) for e in examples),
              question=max(len(e.question_ids) for e in examples))


@dataclasses.dataclass(frozen=True)
class UnitCall:
  """What every call of one unit shares (:func:`run_batch`).

  Attributes:
    design: a name of ``experiments.lib.design_defaults.names()`` ('full': no eviction).
    regime: 'question_aware' or 'streaming'.
    n_steps: decode steps.
    chunk: streaming context chunk.
    n_sink, window: the design's sinks and recent / observation window.
    shape: :func:`pad_shape` of the unit's examples (None: of each call's own),
      so that every slice of a unit has the same padded shapes.
    max_budget: the unit's largest budget (None: each call's largest): the
      static design's budget and the one that sizes the caches.
    return_logits: also return each step's logits.
    capacity: cache slots; None sizes them with ``certkv_jax.designs.budgets.capacity``.
  """

  design: str
  regime: str
  n_steps: int
  chunk: int
  n_sink: int = design_defaults.N_SINK
  window: int = design_defaults.WINDOW
  shape: Optional[dict] = None
  max_budget: Optional[float] = None
  return_logits: bool = False
  capacity: Optional[int] = None


def run_batch(params, config, examples, row_budgets, key, unit: UnitCall) -> decode.Generation:
  """One evaluation-mode call over ``examples`` (one per batch row), row ``i`` at budget
  ``row_budgets[i]`` (ignored for 'full'); returns the ``decode.Generation`` (with
  each step's logits if ``unit.return_logits``).

  ``unit.shape`` and ``unit.max_budget`` fix the padded shapes, the static
  design and the caches' capacity (``certkv_jax.designs.budgets.capacity`` at the
  largest budget), so that every slice of one unit shares a compile.
  """
  shape = unit.shape or pad_shape(examples)
  max_budget = max(row_budgets) if unit.max_budget is None else unit.max_budget
  design = design_defaults.make_design(unit.design, max_budget, unit.n_sink, unit.window)
  budget = None if design is None else jnp.asarray(row_budgets, jnp.float32)
  sizing = None if design is None else max_budget
  gen = decode.GenerationConfig(n_steps=unit.n_steps, design=design, evaluate=True,
                                return_logits=unit.return_logits)
  if unit.regime == "question_aware":
    prompt, p_mask = pad_batch([e.context_ids + e.question_ids for e in examples],
                               shape["prompt"])
    capacity = unit.capacity or budgets.capacity(
        design, budgets.Lengths(n_context=shape["prompt"], n_steps=unit.n_steps), budget=sizing)
    return decode.generate(params, prompt, p_mask, key, config=config,
                           gen=gen.replace(capacity=capacity), budget=budget)
  ctx, c_mask = pad_batch([e.context_ids for e in examples], shape["context"])
  qst, q_mask = pad_batch([e.question_ids for e in examples], shape["question"])
  # the kept tokens plus one chunk, then the question and the answer
  capacity = unit.capacity or budgets.capacity(
      design, budgets.Lengths(n_context=shape["context"], n_question=shape["question"],
                              n_steps=unit.n_steps, chunk=unit.chunk), budget=sizing)
  return decode.generate_streaming(params, (ctx, c_mask), (qst, q_mask), key, config=config,
                                   gen=gen.replace(capacity=capacity, chunk=unit.chunk),
                                   budget=budget)
