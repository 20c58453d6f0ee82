"""Amortized eviction (``evict_every``) on the tiny Hugging Face Llama fixture.

The decode loop with ``evict_every=k`` is checked against a loop written out
step by step here (``forward_chunk`` per token, ``evict_and_record`` after
steps k - 1, 2k - 1, ...): the same tokens, the same kept slots, the same
offsets and certificate statistics. k larger than the number of steps is the
loop that never evicts while decoding, and the tokens decoded since the last
eviction sit in the slack slots as certain tokens (log pi = 0).
"""


from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax import layer as layer_lib
from models import decode
from tests import test_util

N_STEPS = 7
CAPACITY = 16


def _reference(params, config, tokens, mask, key, design, n_steps, every):
  """The decode loop of ``models.decode.generate`` written out one step at a time."""
  batch, plen = tokens.shape
  caches = decode.init_caches(config, batch, CAPACITY)
  shadow = decode.init_caches(config, batch, plen + n_steps)
  logits, caches, _, shadow = decode.forward_chunk(
      params, config, tokens, mask, caches,
      settings=layer_lib.Settings(design=design, certificate=False), shadow=shadow)
  key, sub = jax.random.split(key)
  caches, state, _, shadow = decode.evict_and_record(design, caches, shadow, sub)
  last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)
  step_logits = logits[jnp.arange(batch), last]
  toks, var_hats, n_valid = [], [], []
  for i in range(n_steps):
    token = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
    new_logits, caches, stats, shadow = decode.forward_chunk(
        params, config, token[:, None], jnp.ones((batch, 1), bool), caches,
        settings=layer_lib.Settings(design=design, observe=False), shadow=shadow)
    key, sub = jax.random.split(key)
    if i % every == every - 1:
      caches, state, _, shadow = decode.evict_and_record(design, caches, shadow, sub,
                                                      state=state)
    toks.append(token)
    var_hats.append(stats.var_hat[0])
    n_valid.append(np.asarray(caches.n_valid))
    step_logits = new_logits[:, 0]
  return np.stack(toks, 1), np.stack(var_hats), caches, n_valid, state


class AmortizedEvictionTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.config, cls.tokens, cls.mask = test_util.tiny_llama_prompts()
    # Budget 5 of the tokens seen; 1 sink + 1 window certain, the rest a Poisson tail.
    cls.design = certkv_jax.designs.poisson_tail(
        5, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=1), overflow_prob=0.05)
    cls.key = jax.random.PRNGKey(3)
    cls.runs = {}

  def _generate(self, every):
    """The decode loop's run with ``evict_every=every`` (one compile per value, shared)."""
    if every not in self.runs:
      self.runs[every] = decode.generate(
          self.params, self.tokens, self.mask, self.key, config=self.config,
          gen=decode.GenerationConfig(
              n_steps=N_STEPS, design=self.design, capacity=CAPACITY, evict_each_step=True,
              evict_every=every, evaluate=True))
    return self.runs[every]

  @pytest.mark.slow  # compiles the tiny model's decode loop
  def test_matches_the_loop_written_out(self):
    for every in (1, 3):
      with self.subTest(every=every):
        gen = self._generate(every)
        toks, var_hat, caches, n_valid, state = _reference(
            self.params, self.config, self.tokens, self.mask, self.key, self.design, N_STEPS,
            every)
        np.testing.assert_array_equal(gen.tokens, toks)
        np.testing.assert_array_equal(gen.caches.valid, caches.valid)  # the same kept slots
        np.testing.assert_array_equal(gen.caches.pos, caches.pos)
        np.testing.assert_allclose(gen.caches.log_pi, caches.log_pi, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(gen.var_hat, var_hat, rtol=1e-4, atol=1e-7)
        for a, b in zip(jax.tree_util.tree_leaves(gen.design_state),
                        jax.tree_util.tree_leaves(state)):  # the same counters
          np.testing.assert_array_equal(a, b)
        # Between evictions the cache grows by a token per step, then drops to the budget.
        kept = [int(v.max()) for v in n_valid]
        if every == 1:
          self.assertTrue(all(k <= 5 for k in kept), kept)
        else:
          self.assertEqual(kept[0] + 1, kept[1])
          self.assertLessEqual(kept[2], 5)  # evicted after step 2
          self.assertLessEqual(kept[5], 5)  # and after step 5
          self.assertGreater(kept[1], 5)
        self.assertGreater(float(jnp.max(gen.var_hat)), 0.0)  # a certificate is computed

  @pytest.mark.slow  # compiles the tiny model's decode loop
  def test_every_beyond_the_steps_is_no_decode_eviction(self):
    once = decode.generate(self.params, self.tokens, self.mask, self.key, config=self.config,
                           gen=decode.GenerationConfig(n_steps=N_STEPS, design=self.design,
                                                       capacity=CAPACITY, evaluate=True))
    never = self._generate(N_STEPS + 1)
    for a, b in zip(jax.tree_util.tree_leaves(once), jax.tree_util.tree_leaves(never)):
      np.testing.assert_array_equal(a, b)

  @pytest.mark.slow  # compiles the tiny model's decode loop
  def test_tokens_since_the_last_eviction_are_certain(self):
    gen = self._generate(3)  # evictions after steps 2 and 5; step 6's token in the slack
    caches = gen.caches
    n_seen = np.asarray(caches.n_seen)[0, :, 0]  # [batch]
    for row in range(2):
      newest = np.asarray(caches.pos)[:, row] == n_seen[row] - 1  # [layers, kv, cap]
      self.assertTrue(np.all(newest.sum(-1) == 1))  # kept in every (layer, KV head)
      np.testing.assert_array_equal(np.asarray(caches.log_pi)[:, row][newest], 0.0)
    np.testing.assert_array_equal(caches.n_dropped, 0)

  def test_errors_name_the_argument(self):
    for bad in (0, -2, 1.5, True):
      with self.assertRaisesRegex(ValueError, "evict_every must be an int >= 1"):
        decode.generate(self.params, self.tokens, self.mask, self.key, config=self.config,
                        gen=decode.GenerationConfig(n_steps=2, design=self.design,
                                                    capacity=CAPACITY, evict_each_step=True,
                                                    evict_every=bad))
    with self.assertRaisesRegex(ValueError, "evict_every=2 needs a design and evict_each_step"):
      decode.generate(self.params, self.tokens, self.mask, self.key, config=self.config,
                      gen=decode.GenerationConfig(n_steps=2, design=self.design,
                                                  capacity=CAPACITY, evict_every=2))


if __name__ == "__main__":
  absltest.main()
