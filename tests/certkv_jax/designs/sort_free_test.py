"""Sort-free slot assignment and top-k selection: bit-for-bit the sorted versions.

The decode path used to sort every eviction round (issue 15): free-slot
assignment argsorted the ``valid`` mask, top-k tail rules argsorted the
scores, and the Poisson overflow fallback ranked with a double argsort. The
references below are those sort-based versions, kept here to pin the new
code to them on seeded inputs with ties, masked (-inf) entries, signed zeros
and NaN; the last test counts the sorts in one compiled decode step.
"""

import os
import re
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certkv_jax import designs
from certkv_jax.designs import registry
from certkv_jax.designs import sampling
from certkv_jax.kv import cache as cache_lib
from certkv_jax import layer as layer_lib
from models import decode
from models import hf_loader
from tests import test_util

FIXTURE = test_util.TINY_LLAMA
CAP = 40


def _ref_rank_desc(score):
  """The former ``design_parts._rank_desc``: rank in a stable descending argsort."""
  order = jnp.argsort(-score, stable=True)
  return jnp.zeros(score.shape, jnp.int32).at[order].set(
      jnp.arange(score.shape[-1], dtype=jnp.int32))


def _ref_top_k_mask(score, k):
  return _ref_rank_desc(jnp.asarray(score)) < k


def _ref_slot_assignment(valid, new_valid):
  """The former ``cache.slot_assignment`` (free slots by a stable argsort)."""
  cap = valid.shape[-1]
  rank_new = (jnp.cumsum(new_valid) - 1).astype(jnp.int32)
  n_new = jnp.sum(new_valid).astype(jnp.int32)
  free_slots = jnp.argsort(valid, stable=True)
  n_free = (cap - jnp.sum(valid)).astype(jnp.int32)
  fits = new_valid & (rank_new < n_free)
  idx = jnp.where(fits, free_slots[jnp.clip(rank_new, 0, cap - 1)], cap).astype(jnp.int32)
  n_stored = jnp.sum(fits).astype(jnp.int32)
  return cache_lib.SlotAssignment(idx, rank_new, n_new, n_stored, n_free)


def _ref_poisson_fallback(key, pi, mask, slots, max_redraws):
  """``sampling.poisson_draw`` with its fallback ranked by a double argsort."""
  u = jax.random.uniform(jax.random.split(key)[0], (max_redraws + 1,) + pi.shape)
  draws = (u < pi) & mask
  counts = jnp.sum(draws, axis=-1)
  fits = counts <= slots
  first = jnp.argmax(fits)
  any_fit = jnp.any(fits)
  prio = jnp.where(pi >= 1.0, 2.0, 0.0) + u[0] / jnp.where(pi > 0, pi, 1.0)
  prio = jnp.where(draws[0], prio, -1.0)
  rank = jnp.argsort(jnp.argsort(-prio))
  fallback = draws[0] & (rank < slots)
  keep = jnp.where(any_fit, draws[first], fallback)
  n_dropped = jnp.where(any_fit, 0, counts[0] - jnp.sum(fallback))
  n_redraws = jnp.where(any_fit, first, max_redraws)
  return sampling.Draw(keep, n_redraws.astype(jnp.int32), n_dropped.astype(jnp.int32))


def _scores(rng, n, kind):
  """Scores with ties, -inf (masked), signed zeros, NaN or none of these."""
  if kind == "distinct":
    return rng.normal(size=n).astype(np.float32)
  if kind == "ties":
    return rng.integers(0, 4, size=n).astype(np.float32)
  if kind == "masked":
    s = rng.integers(0, 3, size=n).astype(np.float32)
    return np.where(rng.random(n) < 0.4, -np.inf, s).astype(np.float32)
  if kind == "all_masked":
    return np.full(n, -np.inf, np.float32)
  if kind == "zeros":  # -0.0 must tie with 0.0
    pool = np.array([0.0, -0.0, 1.0], np.float32)
    return pool[rng.integers(0, len(pool), size=n)]
  if kind == "special":  # +-inf, NaN, signed zeros and ties together
    pool = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -1.0, 1e-30], np.float32)
    return pool[rng.integers(0, len(pool), size=n)]
  raise ValueError(f"unknown kind {kind!r}")


class TopKMaskTest(parameterized.TestCase):

  @parameterized.product(kind=("distinct", "ties", "masked", "all_masked", "zeros", "special"),
                         n=(1, 7, 33))
  def test_equals_stable_argsort_rank(self, kind, n):
    rng = np.random.default_rng(n)
    s = jnp.asarray(np.stack([_scores(rng, n, kind) for _ in range(3)]))
    k = jnp.arange(-1, n + 2, dtype=jnp.int32)  # every k, from none to all
    every_k = lambda f: jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None))
    np.testing.assert_array_equal(every_k(sampling.top_k_mask)(s, k),
                                  every_k(_ref_top_k_mask)(s, k), err_msg=f"{kind} s={s}")

  def test_traced_k_under_jit_and_vmap(self):
    rng = np.random.default_rng(0)
    s = jnp.asarray(np.stack([_scores(rng, CAP, "masked") for _ in range(6)]))
    k = jnp.asarray(rng.integers(-1, CAP + 2, size=6), jnp.int32)
    got = jax.jit(jax.vmap(sampling.top_k_mask))(s, k)
    want = jax.vmap(_ref_top_k_mask)(s, k)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(sampling.top_k_mask(s, k), want)  # batched [..., n] too

  def test_other_dtypes(self):
    rng = np.random.default_rng(1)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int32):
      s = jnp.asarray(rng.integers(-3, 3, size=CAP)).astype(dtype)
      for k in (0, 5, CAP):
        np.testing.assert_array_equal(sampling.top_k_mask(s, k), _ref_top_k_mask(s, k))

  def test_more_slots_than_a_16_bit_key_counts(self):
    # bfloat16 scores have 16-bit sort keys, and more slots than 2^16 tie among 3 values.
    rng = np.random.default_rng(2)
    n = (1 << 16) + 5
    s = jnp.asarray(rng.integers(0, 3, size=n)).astype(jnp.bfloat16)
    for k in (1, 40_000, n - 2):
      np.testing.assert_array_equal(sampling.top_k_mask(s, k), _ref_top_k_mask(s, k))

  def test_bad_score(self):
    with self.assertRaisesRegex(ValueError, "score"):
      sampling.top_k_mask(jnp.float32(1.0), 1)


class SlotAssignmentTest(parameterized.TestCase):

  @parameterized.parameters(0.0, 0.3, 0.7, 1.0)
  def test_equals_argsort_assignment(self, p_valid):
    rng = np.random.default_rng(int(p_valid * 10))
    for t in (1, 3, CAP, CAP + 5):
      for p_new in (0.0, 0.5, 1.0):
        valid = jnp.asarray(rng.random(CAP) < p_valid)
        new_valid = jnp.asarray(rng.random(t) < p_new)
        got = cache_lib.slot_assignment(valid, new_valid)
        want = _ref_slot_assignment(valid, new_valid)
        for field, a, b in zip(got._fields, got, want):
          np.testing.assert_array_equal(a, b, err_msg=f"{field} p={p_valid} t={t}")

  def test_append_sequence_equals_reference(self):
    # Appends and evictions in turn: every write lands where the argsort put it.
    rng = np.random.default_rng(3)
    c = cache_lib.init_cache(CAP, 4)
    for step in range(12):
      t = int(rng.integers(1, 9))
      new_valid = jnp.asarray(rng.random(t) < 0.8)
      want = _ref_slot_assignment(c.valid, new_valid)
      np.testing.assert_array_equal(cache_lib.slot_assignment(c.valid, new_valid).idx,
                                    want.idx, err_msg=f"step {step}")
      c = cache_lib.write_slots(c, want, want.idx, jnp.ones((t, 4)), jnp.ones((t, 4)))
      c = cache_lib.keep_only(c, jnp.asarray(rng.random(CAP) < 0.6), jnp.zeros(CAP))


def _cache(seed, n=32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  c = cache_lib.init_cache(CAP, 8)
  c = cache_lib.append(c, jax.random.normal(ks[0], (n, 8)), jax.random.normal(ks[1], (n, 8)))
  c = cache_lib.keep_only(c, jax.random.uniform(ks[2], (CAP,)) < 0.8, jnp.zeros(CAP))
  c = cache_lib.append(c, jax.random.normal(ks[3], (4, 8)), jnp.ones((4, 8)))
  # Quantised statistics: many ties among the scores.
  acc = jnp.round(jax.random.uniform(ks[4], (CAP,)) * 3.0)
  return c._replace(acc=jnp.where(c.valid, acc, 0.0), last=jnp.where(c.valid, acc / 4, 0.0))


class DesignParityTest(parameterized.TestCase):

  @parameterized.parameters("h2o", "tova", "key_norm", "sink_window", "uniform_random",
                            "snapkv", "poisson_tail", "heavy")
  def test_evict_equals_sorted_evict(self, name):
    if name == "heavy":
      design = designs.poisson_tail(0.5, certain=designs.CertaintySet(n_sink=2, window=3, heavy=5))
    else:
      design = registry.make(name, 0.5, n_sink=2, window=3)
    for seed in range(3):
      c = _cache(seed)
      key = jax.random.PRNGKey(seed)
      got = design.evict(c, design.init(c), key)
      with mock.patch.object(sampling, "top_k_mask", _ref_top_k_mask):
        want = design.evict(c, design.init(c), key)
      for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} seed {seed}")

  def test_poisson_overflow_fallback(self):
    # pi = 0.9 on 50 tokens and 5 slots: every draw overflows, the fallback keeps 5.
    pi = jnp.where(jnp.arange(50) % 7 == 0, 1.0, 0.9)
    mask = jnp.arange(50) < 45
    dropped = 0
    for seed in range(4):
      for slots in (0, 5, 44):
        key = jax.random.PRNGKey(seed)
        got = sampling.poisson_draw(key, pi, mask, slots, max_redraws=2)
        want = _ref_poisson_fallback(key, pi, mask, slots, 2)
        for a, b in zip(got, want):
          np.testing.assert_array_equal(a, b)
        dropped += int(got.n_dropped)
    self.assertGreater(dropped, 0)  # the fallback did run


# Sorts in one compiled decode step (forward_chunk of one token + evict) on the
# tiny model, counted before issue 15: the layer scan's append (argsort of
# valid) plus the tail rule's argsort, plus WindowAttention's position sort
# (snapkv) or the Poisson fallback's double argsort.
SORTS_BEFORE = {"h2o": 2, "tova": 2, "snapkv": 3, "poisson_tail": 3}
# After: snapkv keeps WindowAttention's sort (pooling runs in position order and
# must convolve exactly the same array; ranking positions without a sort costs
# O(cap^2)). The Poisson fallback is a select, not a lax.cond, so it was always
# compiled and computed; now it is sort-free too.
SORTS_AFTER = {"h2o": 0, "tova": 0, "snapkv": 1, "poisson_tail": 0}


class DecodeStepSortsTest(absltest.TestCase):

  @pytest.mark.slow  # 51 s cold on the 2-core CI machine (2026-12-01)
  def test_sorts_in_one_decode_step(self):
    params, config = hf_loader.load_hf_checkpoint(FIXTURE)
    caches = decode.init_caches(config, 2, 24)
    tok = np.zeros((2, 1), np.int32)

    def count(design):
      def step(params, caches, tok, key):
        valid = jnp.ones(tok.shape, bool)
        _, c, stats, _ = decode.forward_chunk(
            params, config, tok, valid, caches,
            settings=layer_lib.Settings(design=design, observe=False))
        return decode.evict(design, c, key)[0], stats
      hlo = jax.jit(step).lower(params, caches, tok, jax.random.PRNGKey(0)).compile().as_text()
      return len(re.findall(r"\bsort\(", hlo))

    got = {name: count(registry.make(name, 0.25, n_sink=4, window=16)) for name in SORTS_AFTER}
    self.assertEqual(got, SORTS_AFTER)
    for name in SORTS_AFTER:
      self.assertLess(SORTS_AFTER[name], SORTS_BEFORE[name])


if __name__ == "__main__":
  absltest.main()
