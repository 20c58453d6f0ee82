"""Bad input to the public API fails at the call with an error naming the argument.

Each case was a review's reproducer: a design given by name, an attention setting as a
string, an allocation without a design, attention probabilities with a bad scale or
shape, an out-of-range layer index, an integer cache dtype, a non-finite Pyramid beta
and capacity budgets outside (0, 1] were accepted or failed deep inside JAX.
"""

from absl.testing import absltest
import jax
import jax.numpy as jnp

from certkv_jax import eviction
from certkv_jax import layer
from certkv_jax.attention import offset
from certkv_jax.designs import allocation
from certkv_jax.designs import budgets
from certkv_jax.designs import registry
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv import caches as caches_lib
from models.config import LlamaConfig
from models.generation import GenerationConfig

CONFIG = LlamaConfig(vocab_size=16, hidden=8, n_layers=2, n_heads=2, n_kv_heads=1,
                     head_dim=4, ffn_dim=8)


class BadInputTest(absltest.TestCase):

  def test_designs_and_settings_by_name_are_refused(self):
    caches = caches_lib.init_caches(CONFIG, 1, 8)
    key = jax.random.PRNGKey(0)
    with self.assertRaisesRegex(TypeError, "design must be an eviction design .*got str 'h2o'"):
      eviction.evict("h2o", caches, key)
    with self.assertRaisesRegex(TypeError, "design must be an eviction design .*NoneType"):
      eviction.evict(None, caches, key)
    with self.assertRaisesRegex(TypeError, "allocation must be None or a certkv_jax.designs"):
      eviction.evict(registry.make("h2o", 0.5), caches, key, allocation="adakv")
    with self.assertRaisesRegex(TypeError, "design must be an eviction design"):
      layer.Settings(design="h2o")
    with self.assertRaisesRegex(TypeError, "attention must be None or a certkv_jax.Attention"):
      layer.Settings(attention="xla")
    with self.assertRaisesRegex(TypeError, "design must be an eviction design"):
      GenerationConfig(n_steps=2, design="h2o")
    with self.assertRaisesRegex(TypeError, "attention must be None"):
      GenerationConfig(n_steps=2, attention="xla")
    with self.assertRaisesRegex(ValueError, "allocation needs a design"):
      GenerationConfig(n_steps=2, allocation=allocation.AdaKV())
    # what they should be still works
    layer.Settings(design=registry.make("h2o", 0.5), attention=offset.AttentionConfig())
    GenerationConfig(n_steps=2, design=registry.make("h2o", 0.5), allocation=allocation.AdaKV())

  def test_attention_probs_checks_as_offset_attention_does(self):
    q, k = jnp.ones((2, 8)), jnp.ones((2, 5, 8))
    log_pi, mask = jnp.zeros((2, 5)), jnp.ones((2, 5), bool)
    self.assertEqual(offset.attention_probs(q, k, log_pi, mask).shape, (2, 5))
    for scale in (-1.0, float("nan"), True):
      with self.assertRaisesRegex(ValueError, "scale must be a finite float > 0"):
        offset.attention_probs(q, k, log_pi, mask, scale=scale)
    with self.assertRaisesRegex(ValueError, "k's last dim \\(7\\) must equal q's last dim"):
      offset.attention_probs(q, jnp.ones((2, 5, 7)), log_pi, mask)
    with self.assertRaisesRegex(ValueError, "log_pi must have n=5 slots"):
      offset.attention_probs(q, k, jnp.zeros((2, 4)), mask)
    with self.assertRaisesRegex(TypeError, "mask must be bool"):
      offset.attention_probs(q, k, log_pi, jnp.ones((2, 5), jnp.int32))

  def test_layer_index_out_of_range(self):
    caches = caches_lib.init_caches(CONFIG, 1, 8)
    for form in (caches, caches.unstack()):
      for i in (2, 5, -1):
        with self.assertRaisesRegex(IndexError, f"layer index must be in \\[0, 2\\), got {i}"):
          form.layer(i)
        with self.assertRaisesRegex(IndexError, "layer index must be in"):
          form.with_layer(i, form.layer(0))
      self.assertEqual(form.layer(1).k.shape, (1, 1, 8, 4))

  def test_cache_dtype_must_be_floating(self):
    with self.assertRaisesRegex(TypeError, "dtype must be a floating dtype .*int8"):
      cache_lib.init_cache(4, 2, dtype=jnp.int8)
    with self.assertRaisesRegex(TypeError, "dtype must be a floating dtype .*'bf16'"):
      caches_lib.init_caches(CONFIG, 1, 4, dtype="bf16")
    self.assertEqual(cache_lib.init_cache(4, 2, dtype=jnp.bfloat16).k.dtype, jnp.bfloat16)

  def test_pyramid_beta_must_be_finite(self):
    for beta in (float("nan"), float("inf"), 1.0):
      with self.assertRaisesRegex(ValueError, "beta must be a finite number > 1"):
        allocation.Pyramid(beta=beta)

  def test_capacity_checks_its_budgets(self):
    design, lengths = registry.make("h2o", 0.25), budgets.Lengths(n_context=100, n_steps=10)
    for b in (1.5, -0.5, 5.0):
      with self.assertRaisesRegex(ValueError, "budget must be a fraction in \\(0, 1\\]"):
        budgets.capacity(design, lengths, budget=b)
    with self.assertRaisesRegex(ValueError, "give budget or layer_budgets, not both"):
      budgets.capacity(design, lengths, budget=0.5, layer_budgets=(0.5, 0.5))
    with self.assertRaisesRegex(ValueError, "layer_budgets"):
      budgets.capacity(design, lengths, layer_budgets=(0.5, 1.5))
    self.assertGreaterEqual(budgets.capacity(design, lengths, budget=1.0), 110)  # keeps all


if __name__ == "__main__":
  absltest.main()
