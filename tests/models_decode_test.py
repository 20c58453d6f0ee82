"""Cached decoding with certkv caches on the tiny Hugging Face Llama fixture."""

import os

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import certkv_jax
from models import decode
from models import hf_loader
from models import llama

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_llama")
N_STEPS = 5


class DecodeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.config = hf_loader.load_hf_checkpoint(FIXTURE)
    ref = np.load(os.path.join(FIXTURE, "reference.npz"))
    cls.tokens, cls.mask = ref["tokens"][:, :10], ref["mask"][:, :10]  # lengths 10 and 7

  def _generate(self, **kw):
    return decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                           config=self.config, capacity=16, n_steps=N_STEPS, **kw)

  def test_streaming_without_eviction_equals_full_forward(self):
    question = np.array([[5, 6, 7], [8, 9, 0]], np.int32)
    q_mask = np.array([[True, True, True], [True, True, False]])
    gen = decode.generate_streaming(
        self.params, self.tokens, self.mask, question, q_mask, jax.random.PRNGKey(0),
        config=self.config, capacity=16, n_steps=3, chunk=4, return_logits=True,
        evaluate=True)
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
    _, caches, stats, _ = decode.forward_chunk(self.params, c, self.tokens, self.mask,
                                            decode.init_caches(c, 2, 20), design=design,
                                            observation_window=3, certificate=False)
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
    _, after, _, _ = decode.forward_chunk(self.params, c, self.tokens, more, caches,
                                          design=design, observation_window=3,
                                          certificate=False)
    for field in ("acc", "last", "obs", "pos"):
      np.testing.assert_array_equal(getattr(after, field)[:, 1], getattr(caches, field)[:, 1])
    np.testing.assert_allclose(after.acc[:, 0].sum(-1), 20.0, rtol=1e-5)

  def test_capacity_error_names_the_argument(self):
    with self.assertRaisesRegex(ValueError, r"capacity \(12\) must hold the prompt"):
      decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                      config=self.config, capacity=12, n_steps=N_STEPS)

  def test_question_aware_snapkv_keeps_budget_and_window(self):
    design = certkv_jax.designs.snapkv(4, window=2)
    gen = decode.generate(self.params, self.tokens, self.mask, jax.random.PRNGKey(0),
                          config=self.config, capacity=16, n_steps=N_STEPS, design=design,
                          observation_window=2)
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

  def test_streaming_poisson_design_evicts_with_offsets_and_certificate(self):
    design = certkv_jax.designs.poisson_tail(6, n_sink=1, window=1, overflow_prob=0.05)
    question = np.array([[5, 6, 7], [8, 9, 10]], np.int32)
    gen = decode.generate_streaming(
        self.params, self.tokens, self.mask, question, np.ones((2, 3), bool),
        jax.random.PRNGKey(0), config=self.config, capacity=6 + 3 + N_STEPS, n_steps=N_STEPS,
        chunk=3, design=design, evaluate=True)
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


if __name__ == "__main__":
  absltest.main()
