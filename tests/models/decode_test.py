"""Cached decoding with certkv caches on the tiny Hugging Face Llama fixture."""


from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax.attention.certified import Subsample
from certkv_jax.designs import budgets
from certkv_jax import layer as layer_lib
from models import decode
from tests import test_util
from models import llama

N_STEPS = 5


class DecodeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.config, cls.tokens, cls.mask = test_util.tiny_llama_prompts()

  def _generate(self, budget=None, **kw):
    """``generate`` with ``GenerationConfig(n_steps=N_STEPS, capacity=16, **kw)``."""
    kw.setdefault("capacity", 16)
    return decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                           config=self.config,
                           gen=decode.GenerationConfig(n_steps=N_STEPS, **kw), budget=budget)

  @pytest.mark.slow  # 40 s cold on the 2-core CI machine (2026-12-01)
  def test_streaming_without_eviction_equals_full_forward(self):
    question = np.array([[5, 6, 7], [8, 9, 0]], np.int32)
    q_mask = np.array([[True, True, True], [True, True, False]])
    gen = decode.generate_streaming(
        self.params, (self.tokens, self.mask), (question, q_mask), jax.random.PRNGKey(0),
        config=self.config,
        gen=decode.GenerationConfig(n_steps=3, capacity=16, chunk=4, return_logits=True,
                                    evaluate=True))
    seqs = np.zeros((2, 16), np.int32)
    lengths = []
    for b in range(2):
      seq = np.concatenate([self.tokens[b][self.mask[b]], question[b][q_mask[b]],
                            gen.tokens[b]])
      seqs[b, :len(seq)] = seq
      lengths.append(len(seq))
    lengths = np.array(lengths)
    full = llama.LlamaModel(self.config).apply(self.params, seqs,
                                               np.arange(16) < lengths[:, None])
    for b, n in enumerate(lengths - 3):
      np.testing.assert_allclose(gen.logits[b], full[b, n - 1:n + 2], atol=1e-5)
    np.testing.assert_array_equal(gen.caches.n_seen[:, :, 0], [lengths] * 2)
    np.testing.assert_array_equal(gen.caches.n_dropped, 0)
    # Evaluation mode: nothing evicted, so the shadow full cache agrees.
    self.assertEqual(gen.true_error.shape, (3, 2, 2, 4))  # [steps, layers, batch, heads]
    self.assertLess(float(jnp.max(gen.true_error)), 1e-5)
    np.testing.assert_array_equal(gen.var_hat, 0.0)

  def test_statistics_folded_per_real_query(self):
    c = self.config
    design = certkv_jax.designs.snapkv(0.5, window=3)
    _, caches, stats, _ = decode.forward_chunk(
        self.params, c, self.tokens, self.mask, decode.init_caches(c, 2, 20),
        settings=layer_lib.Settings(design=design, certificate=False))
    self.assertIsNone(stats)
    n_real = np.array([10, 7])[None, :, None]  # [layers, batch, kv heads]
    # Each real query's probabilities sum to one over the slots.
    np.testing.assert_allclose(caches.acc.sum(-1), np.broadcast_to(n_real, (2, 2, 2)), rtol=1e-5)
    np.testing.assert_allclose(caches.obs.sum(-1), 3.0, rtol=1e-5)
    np.testing.assert_allclose(caches.last.sum(-1), 1.0, rtol=1e-5)
    # The last real query of the short row attends to all 7 of its tokens.
    self.assertTrue((np.asarray(caches.last[:, 1])[np.asarray(caches.valid[:, 1])] > 0).all())
    # A chunk that is all padding for row 1 (ragged streaming) leaves its statistics alone.
    more = np.stack([np.ones(10, bool), np.zeros(10, bool)])
    _, after, _, _ = decode.forward_chunk(
        self.params, c, self.tokens, more, caches,
        settings=layer_lib.Settings(design=design, certificate=False))
    for field in ("acc", "last", "obs", "pos"):
      np.testing.assert_array_equal(getattr(after, field)[:, 1], getattr(caches, field)[:, 1])
    np.testing.assert_allclose(after.acc[:, 0].sum(-1), 20.0, rtol=1e-5)

  def test_capacity_error_names_the_argument(self):
    with self.assertRaisesRegex(ValueError, r"capacity \(12\) must hold the prompt"):
      decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                      config=self.config,
                      gen=decode.GenerationConfig(n_steps=N_STEPS, capacity=12))

  def test_question_aware_snapkv_keeps_budget_and_window(self):
    design = certkv_jax.designs.snapkv(4, window=2)
    gen = decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                          config=self.config,
                          gen=decode.GenerationConfig(n_steps=N_STEPS, design=design,
                                                      capacity=16))
    self.assertIsNone(gen.true_error)  # normal mode keeps no shadow cache
    caches = gen.caches
    np.testing.assert_array_equal(caches.n_valid, 4 + N_STEPS)  # budget, then decoded tokens
    pos = np.asarray(caches.pos)  # [layers, batch, kv heads, cap]
    for b, n in enumerate((10, 7)):
      for layer_heads in pos[:, b].reshape(-1, pos.shape[-1]):
        kept = np.sort(layer_heads[layer_heads >= 0])
        np.testing.assert_array_equal(kept[-2 - N_STEPS:], np.arange(n - 2, n + N_STEPS))
    np.testing.assert_array_equal(caches.log_pi, 0.0)  # deterministic: no offsets
    np.testing.assert_array_equal(gen.var_hat, 0.0)
    self.assertTrue(np.isfinite(np.asarray(gen.logprobs)).all())

  def test_design_state_counts_eviction_rounds(self):
    # Budget 8 tokens, evicting after the prefill and after every decode step.
    # Row 0 (10 tokens): over budget after the prefill and after each step (9
    # tokens), so 1 + N_STEPS rounds. Row 1 (7 tokens): within budget after the
    # prefill and step 0 (8 tokens), over it after steps 1..4: 4 rounds. A
    # round within budget is no round.
    self.assertEqual(N_STEPS, 5)
    gen = self._generate(design=certkv_jax.designs.sink_window(8, n_sink=1),
                         evict_each_step=True)
    state = gen.design_state
    rounds = np.asarray(state.rounds)
    self.assertEqual(rounds.shape, (2, 2, 2))  # [layers, batch, kv heads]
    np.testing.assert_array_equal(rounds[:, 0], 1 + N_STEPS)
    np.testing.assert_array_equal(rounds[:, 1], 4)
    for counter in (state.n_redraws, state.n_dropped, state.n_over_budget):
      np.testing.assert_array_equal(counter, 0)  # deterministic, certainty set of 1
    np.testing.assert_array_equal(gen.caches.n_valid, 8)

  def test_capacity_none_is_sized_so_nothing_is_dropped(self):
    # Question-aware: the 10-token prompt must fit, then the 6 kept tokens plus
    # the N_STEPS decoded ones: max(10, 6 + 5) = 11 slots, all of them used.
    design = certkv_jax.designs.sink_window(6, n_sink=1)
    want = budgets.capacity(design, budgets.Lengths(n_context=self.tokens.shape[1],
                                                    n_steps=N_STEPS))
    self.assertEqual(want, 11)
    gen = self._generate(design=design, capacity=None)
    self.assertEqual(gen.caches.capacity, want)
    np.testing.assert_array_equal(gen.caches.n_dropped, 0)
    np.testing.assert_array_equal(gen.n_dropped, [0, 0])
    np.testing.assert_array_equal(gen.caches.n_valid, 6 + N_STEPS)  # full, none dropped

  @pytest.mark.slow  # 38 s cold on the 2-core CI machine (2026-12-01)
  def test_decode_step_donates_the_caches_and_equals_forward_chunk(self):
    caches = decode.init_caches(self.config, 2, 16)
    _, caches, _, _ = decode.forward_chunk(self.params, self.config, self.tokens, self.mask,
                                           caches, settings=layer_lib.Settings(certificate=False))
    token = jnp.asarray([3, 4], jnp.int32)
    want, want_caches, want_stats, _ = decode.forward_chunk(
        self.params, self.config, token[:, None], jnp.ones((2, 1), bool), caches,
        settings=layer_lib.Settings(observe=False))
    logits, got_caches, stats = decode.decode_step(self.params, caches, token,
                                                   config=self.config)
    np.testing.assert_array_equal(logits, want[:, 0])
    np.testing.assert_array_equal(got_caches.k, want_caches.k)
    np.testing.assert_array_equal(stats.var_hat, want_stats.var_hat[0])
    self.assertTrue(caches.k.is_deleted())  # donated: updated in place

  def test_streaming_snapkv_scores_each_chunk_by_its_window(self):
    # Regression: the streaming regime fed its context chunks with no observation
    # window, so SnapKV's score was 0 everywhere and its kept set was the one a
    # constant score picks (slot order). The chunk's last queries must score it.
    question = np.array([[5, 6], [8, 9]], np.int32)
    gen = decode.GenerationConfig(n_steps=N_STEPS, capacity=4 + 3 + 2 + N_STEPS, chunk=3)
    run = lambda design: decode.generate_streaming(
        self.params, (self.tokens, self.mask), (question, np.ones((2, 2), bool)),
        jax.random.PRNGKey(0), config=self.config, gen=gen.replace(design=design)).caches
    snap = run(certkv_jax.designs.snapkv(4, window=1, pool_size=1, observation_window=2))
    flat = run(certkv_jax.designs.top_k(4, certkv_jax.designs.scores.Uniform(), window=1))
    kept = lambda c: np.sort(np.where(np.asarray(c.valid), np.asarray(c.pos), -1), axis=-1)
    self.assertTrue((kept(snap) != kept(flat)).any(), "SnapKV kept what a flat score keeps")
    self.assertGreater(float(jnp.max(snap.obs)), 0.0)

  @pytest.mark.slow  # 43 s cold on the 2-core CI machine (2026-12-01)
  def test_eager_evict_is_one_jitted_program(self):
    from certkv_jax import eviction  # pylint: disable=g-import-not-at-top
    design = certkv_jax.designs.poisson_tail(
        0.5, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=2))
    _, caches, _, _ = decode.forward_chunk(
        self.params, self.config, self.tokens, self.mask, decode.init_caches(self.config, 2, 12),
        settings=layer_lib.Settings(design=design, certificate=False))
    before = eviction._evict_jit._cache_size()  # pylint: disable=protected-access
    for seed in (0, 1):
      new, _, info, _ = decode.evict(design, caches, jax.random.PRNGKey(seed), budget=0.5)
    self.assertEqual(eviction._evict_jit._cache_size(), before + 1)  # pylint: disable=protected-access
    self.assertTrue((np.asarray(new.n_valid) <= np.asarray(info.target)).all())
    with self.assertRaisesRegex(ValueError, r"budget must be a fraction in \(0, 1\]"):
      decode.evict(design, caches, jax.random.PRNGKey(0), budget=1.5)

  def test_a_design_that_reads_the_window_needs_one(self):
    with self.assertRaisesRegex(ValueError, "observation_window >= 1"):
      certkv_jax.designs.snapkv(0.5, window=0)
    with self.assertRaisesRegex(ValueError, "observation_window >= 1"):
      certkv_jax.designs.top_k(0.5, certkv_jax.designs.scores.ValueAware(
          certkv_jax.designs.scores.WindowAttention()))
    with self.assertRaisesRegex(ValueError, "observation_window must be an int"):
      certkv_jax.designs.snapkv(0.5, observation_window=-1)
    self.assertEqual(certkv_jax.designs.snapkv(0.5, window=8).observation_window, 8)
    self.assertEqual(certkv_jax.designs.h2o(0.5, window=8).observation_window, 0)
    envelope = certkv_jax.designs.registry.make("poisson_envelope", 0.5, n_sink=4, window=16)
    self.assertEqual(envelope.observation_window, 16)

  @pytest.mark.slow  # 56 s cold on the 2-core CI machine (2026-12-01)
  def test_streaming_poisson_design_evicts_with_offsets_and_certificate(self):
    design = certkv_jax.designs.poisson_tail(
        6, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=1), overflow_prob=0.05)
    question = np.array([[5, 6, 7], [8, 9, 10]], np.int32)
    gen = decode.generate_streaming(
        self.params, (self.tokens, self.mask), (question, np.ones((2, 3), bool)),
        jax.random.PRNGKey(0), config=self.config,
        gen=decode.GenerationConfig(n_steps=N_STEPS, design=design, capacity=6 + 3 + N_STEPS,
                                    chunk=3, evaluate=True))
    caches = gen.caches
    np.testing.assert_array_equal(caches.n_seen[:, :, 0], [[10 + 3 + N_STEPS,
                                                            7 + 3 + N_STEPS]] * 2)
    np.testing.assert_array_equal(caches.n_dropped, 0)
    self.assertTrue((np.asarray(caches.n_valid) <= 6 + 3 + N_STEPS).all())
    log_pi = np.asarray(caches.log_pi)[np.asarray(caches.valid)]
    self.assertTrue((log_pi <= 0).all() and (log_pi < 0).any())  # Hajek offsets stored
    self.assertGreater(float(jnp.max(gen.var_hat)), 0.0)  # certificate statistics flow
    self.assertTrue((np.asarray(gen.range_hat) >= 0).all())
    # Evaluation mode: the same queries over the shadow full cache give the truth.
    err = np.asarray(gen.true_error)
    self.assertEqual(err.shape, (N_STEPS, 2, 2, 4))
    self.assertTrue(np.isfinite(err).all() and (err > 1e-4).any())
    self.assertTrue((np.asarray(gen.rel_error) >= 0).all())
    self.assertTrue(np.isfinite(np.asarray(gen.logprobs)).all())

  @pytest.mark.slow  # 82 s cold on the 2-core CI machine (2026-12-01)
  def test_traced_budget_matches_static_budget_with_one_compile(self):
    gen = decode.GenerationConfig(n_steps=N_STEPS, capacity=16, evaluate=True)
    key = jax.random.PRNGKey(3)
    jitted = decode.generate.__wrapped__  # the jitted function under the budget check
    for frac in (0.5, 0.3):
      static = decode.generate(
          self.params, self.tokens, self.mask, key, config=self.config,
          gen=gen.replace(design=certkv_jax.designs.poisson_tail(
              frac, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=2))))
      n_compiled = jitted._cache_size()
      traced = decode.generate(
          self.params, self.tokens, self.mask, key, config=self.config,
          gen=gen.replace(design=certkv_jax.designs.poisson_tail(
              0.9, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=2))),
          budget=frac)
      if frac == 0.3:  # the second budget reuses the first budget's compile
        self.assertEqual(jitted._cache_size(), n_compiled)
      for a, b in zip(jax.tree_util.tree_leaves(static), jax.tree_util.tree_leaves(traced)):
        np.testing.assert_array_equal(a, b)

  def test_budget_errors_name_the_argument(self):
    design = certkv_jax.designs.poisson_tail(0.5)
    call = lambda budget=None, **kw: decode.generate(
        self.params, self.tokens, self.mask, jax.random.PRNGKey(0), config=self.config,
        gen=decode.GenerationConfig(n_steps=2, capacity=16, **kw), budget=budget)
    with self.assertRaisesRegex(ValueError, r"budget must be a fraction in \(0, 1\].*1.5"):
      call(design=design, budget=1.5)
    with self.assertRaisesRegex(ValueError, r"budget must be a fraction in \(0, 1\].*0.0"):
      call(design=design, budget=0.0)
    with self.assertRaisesRegex(ValueError, "budget needs a design"):
      call(budget=0.5)
    with self.assertRaisesRegex(ValueError, "either layer_budgets or budget"):
      call(design=design, budget=0.5, layer_budgets=(0.5, 0.5))

  @pytest.mark.slow  # 51 s cold on the 2-core CI machine (2026-12-01)
  def test_shadow_records_cumulative_inclusion_probabilities(self):
    # Streaming rounds of a Poisson design: every kept token's record in the
    # shadow cache equals its Hajek offset (the product of its rounds' pi); an
    # evicted token's record is the product up to its eviction round (< 0).
    c = self.config
    design = certkv_jax.designs.poisson_tail(
        4, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=1), overflow_prob=0.05)
    caches, shadow = decode.init_caches(c, 2, 8), decode.init_caches(c, 2, 10)
    key = jax.random.PRNGKey(1)
    for start in (0, 4, 8):  # chunks of the (10, 7)-token rows
      toks, valid = self.tokens[:, start:start + 4], self.mask[:, start:start + 4]
      _, caches, _, shadow = decode.forward_chunk(
          self.params, c, toks, valid, caches,
          settings=layer_lib.Settings(design=design, certificate=False), shadow=shadow)
      key, sub = jax.random.split(key)
      caches, _, _, shadow = decode.evict_and_record(design, caches, shadow, sub)
    pos, valid = np.asarray(caches.pos), np.asarray(caches.valid)
    record = np.asarray(shadow.log_pi)
    np.testing.assert_array_equal(np.asarray(shadow.pos)[..., :7],
                                  np.broadcast_to(np.arange(7), (2, 2, 2, 7)))  # slot = pos
    kept = np.zeros(record.shape, bool)
    for idx in np.ndindex(pos.shape[:3]):
      p = pos[idx][valid[idx]]
      kept[idx + (p,)] = True
      np.testing.assert_allclose(record[idx + (p,)], np.asarray(caches.log_pi)[idx][valid[idx]],
                                 rtol=1e-6, atol=1e-6)
    seen = np.asarray(shadow.valid)
    evicted = seen & ~kept
    self.assertTrue(evicted.any())
    self.assertTrue((record[evicted] < 0).all())  # pi < 1 in the round that evicted them
    self.assertTrue((record[kept] <= 0).all())

  @pytest.mark.slow  # 85 s cold on the 2-core CI machine (2026-12-01)
  def test_assumption2_ratio_in_evaluation_mode(self):
    gen = decode.GenerationConfig(n_steps=N_STEPS, capacity=16, evaluate=True)
    poisson = decode.generate(
        self.params, self.tokens, self.mask, jax.random.PRNGKey(0), config=self.config,
        gen=gen.replace(design=certkv_jax.designs.poisson_tail(
            0.5, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=2))))
    ratio, m, n = (np.asarray(x) for x in (poisson.ratio, poisson.tail_m, poisson.tail_n))
    self.assertEqual(ratio.shape, (N_STEPS, 2, 2, 4))
    self.assertTrue(np.isfinite(ratio).all())
    # Row 0 (10 tokens): budget 5 = 1 sink + 2 window + 2 tail slots, so its 7
    # tail tokens were sampled with m <= 2 (the Chernoff capacity rule keeps m
    # well below the free slots). Row 1 (7 tokens): budget 3 leaves no tail
    # slot, m = 0 and every tail token is dropped with pi = 0: nothing is
    # sampled, T is empty and R = 0 (the audit covers sampled tokens only).
    np.testing.assert_array_equal(n[:, :, 0], 7)
    self.assertTrue((m[:, :, 0] > 0).all() and (m[:, :, 0] <= 2.0).all())
    self.assertTrue((ratio[:, :, 0] > 0).all())
    np.testing.assert_array_equal(n[:, :, 1], 0)
    np.testing.assert_array_equal(ratio[:, :, 1], 0.0)
    # R <= m max_T a_i / (eps sum a) <= m / eps.
    self.assertTrue((ratio <= m / 1e-6 * (1 + 1e-4)).all())
    # Deterministic designs sample nothing: T is empty and R = 0.
    snap = decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                           config=self.config,
                           gen=gen.replace(design=certkv_jax.designs.snapkv(0.5, window=2)))
    np.testing.assert_array_equal(snap.ratio, 0.0)
    np.testing.assert_array_equal(snap.tail_n, 0.0)
    # Normal mode: no audit.
    self.assertIsNone(decode.generate(self.params, self.tokens, self.mask,
                                      jax.random.PRNGKey(0), config=self.config,
                                      gen=decode.GenerationConfig(n_steps=2, capacity=16)).ratio)

  @pytest.mark.slow  # 177 s cold on the 2-core CI machine (2026-12-01)
  def test_certificate_subsample_by_layer_and_head(self):
    # The subsample changes no output, and on the chosen (layer, KV head) calls
    # every statistic equals the full certificate's; the rest are NaN.
    c = self.config
    self.assertEqual((c.n_layers, c.n_kv_heads, c.group_size), (2, 2, 2))
    gen = decode.GenerationConfig(
        n_steps=N_STEPS, capacity=16, evaluate=True, return_logits=True, evict_each_step=True,
        design=certkv_jax.designs.poisson_tail(
            0.7, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=1), overflow_prob=0.05))
    key = jax.random.PRNGKey(3)  # a draw that keeps tail tokens in every (layer, KV head)
    ref = decode.generate(self.params, self.tokens, self.mask, key, config=c, gen=gen)
    self.assertTrue((np.asarray(ref.var_hat) > 0).any(axis=(0, 2)).all())  # to compare
    fields = ("var_hat", "range_hat", "true_error", "rel_error", "ratio", "tail_m", "tail_n")
    for layers, heads in (((1,), None), (None, (1,)), ((0,), (1, 0))):
      sub = decode.generate(self.params, self.tokens, self.mask, key, config=c,
                            gen=gen.replace(certificate_layers=layers,
                                            certificate_heads=heads))
      np.testing.assert_array_equal(sub.tokens, ref.tokens)
      np.testing.assert_allclose(sub.logits, ref.logits, atol=2e-6)
      chosen = np.zeros((c.n_layers, c.n_heads), bool)  # [layer, query head]
      for layer in layers or range(c.n_layers):
        for h in heads or range(c.n_kv_heads):
          chosen[layer, h * c.group_size:(h + 1) * c.group_size] = True
      sel = np.broadcast_to(chosen[None, :, None, :], ref.var_hat.shape)
      for f in fields:
        got, want = np.asarray(getattr(sub, f)), np.asarray(getattr(ref, f))
        self.assertTrue(np.isnan(got[~sel]).all(), (f, layers, heads))
        np.testing.assert_allclose(got[sel], want[sel], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{f} {layers} {heads}")

  def test_stop_tokens_skip_the_steps_after_every_row_ended(self):
    design = certkv_jax.designs.snapkv(0.5, window=2)
    ref = self._generate(design=design, evict_each_step=True, return_logits=True)
    first = np.asarray(ref.tokens[:, 0])
    stop = tuple(int(t) for t in first)  # every row ends at step 0 (or later, if shared)
    got = self._generate(design=design, evict_each_step=True, return_logits=True,
                         stop_tokens=stop)
    toks = np.asarray(ref.tokens)
    ended = [int(np.flatnonzero(np.isin(row, stop))[0]) for row in toks]
    last = max(ended)  # the step at which the last row ended
    self.assertLess(last, N_STEPS - 1)  # some steps are skipped
    live, idle = slice(0, last + 1), slice(last + 1, None)
    np.testing.assert_array_equal(got.tokens[:, live], toks[:, live])
    np.testing.assert_allclose(got.logprobs[:, live], ref.logprobs[:, live], atol=1e-6)
    np.testing.assert_allclose(got.logits[:, live], ref.logits[:, live], atol=1e-6)
    np.testing.assert_allclose(got.var_hat[live], ref.var_hat[live], atol=1e-6)
    np.testing.assert_array_equal(got.tokens[:, idle], stop[0])
    np.testing.assert_array_equal(got.logprobs[:, idle], 0.0)
    self.assertTrue(np.isnan(np.asarray(got.logits[:, idle])).all())
    self.assertTrue(np.isnan(np.asarray(got.var_hat[idle])).all())
    # The caches stop growing with the last live step.
    np.testing.assert_array_equal(got.caches.n_seen, ref.caches.n_seen - (N_STEPS - 1 - last))
    with self.assertRaisesRegex(ValueError, r"stop_tokens must be a tuple of token ids in"):
      self._generate(stop_tokens=(self.config.vocab_size,))
    with self.assertRaisesRegex(ValueError, r"stop_tokens must be a tuple"):
      self._generate(stop_tokens=[1])

  def test_certificate_subsample_errors_name_the_argument(self):
    call = lambda **kw: decode.generate(
        self.params, self.tokens, self.mask, jax.random.PRNGKey(0), config=self.config,
        gen=decode.GenerationConfig(n_steps=2, capacity=16, **kw))
    with self.assertRaisesRegex(ValueError, r"certificate_layers must be .* in \[0, 2\).*5"):
      call(certificate_layers=(5,))
    with self.assertRaisesRegex(ValueError, r"certificate_heads must be .*KV head"):
      call(certificate_heads=(0, 0))
    with self.assertRaisesRegex(ValueError, "certificate_layers must be"):
      call(certificate_layers=())
    # forward_chunk takes a subsample as Settings(certificate=Subsample(...)), which
    # certifies; the check itself still refuses heads without the certificate.
    with self.assertRaisesRegex(ValueError, "certificate_heads needs certificate=True"):
      decode.check_certificate_subsample(self.config, False, None, (0,))
    with self.assertRaisesRegex(ValueError, r"certificate_layers must be .* in \[0, 2\).*5"):
      decode.forward_chunk(self.params, self.config, self.tokens, self.mask,
                           decode.init_caches(self.config, 2, 16),
                           settings=layer_lib.Settings(certificate=Subsample(layers=(5,))))


if __name__ == "__main__":
  absltest.main()
