"""The Flax Llama-family decoder on small random configurations."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from models import llama
from models import rope
from tests import test_util

TINY = test_util.tiny_config(ffn_dim=48)


def _params(seed=0):
  return test_util.tiny_params(TINY, seed)


@functools.lru_cache(maxsize=None)
def _apply(config):
  """One jitted forward per config (the tests share compilations)."""
  return jax.jit(llama.LlamaModel(config).apply)


def _tokens(b=2, s=9, seed=0):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, s), 0, TINY.vocab_size)


class LlamaTest(parameterized.TestCase):

  @parameterized.parameters("half", "interleaved")
  def test_shapes_dtype_and_causality(self, layout):
    config = TINY.replace(rope_layout=layout)
    params = _params()
    tokens = _tokens()
    logits = _apply(config)(params, tokens)
    chex.assert_shape(logits, (2, 9, config.vocab_size))
    self.assertEqual(logits.dtype, jnp.float32)
    chex.assert_tree_all_finite(logits)
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % config.vocab_size)
    logits2 = _apply(config)(params, changed)
    np.testing.assert_allclose(logits2[:, :6], logits[:, :6], atol=1e-6)
    self.assertGreater(float(jnp.abs(logits2[:, 6:] - logits[:, 6:]).max()), 1e-4)

  def test_tied_embeddings_have_no_head(self):
    config = TINY.replace(tie_embeddings=True, qkv_bias=True, out_bias=True)
    params = jax.eval_shape(functools.partial(llama.init_params, config), jax.random.PRNGKey(0))
    self.assertNotIn("lm_head", params["params"])
    layers = params["params"]["layers"]
    chex.assert_shape(layers["q_proj"]["bias"], (2, 32))
    chex.assert_shape(layers["o_proj"]["bias"], (2, 32))
    chex.assert_shape(layers["k_proj"]["kernel"], (2, 32, 16))

  def test_gqa_equals_mha_with_repeated_kv_heads(self):
    params = _params()
    mha = TINY.replace(n_kv_heads=TINY.n_heads)
    layers = dict(params["params"]["layers"])
    for name in ("k_proj", "v_proj"):
      k = layers[name]["kernel"].reshape(2, 32, TINY.n_kv_heads, 1, TINY.head_dim)
      k = jnp.repeat(k, TINY.group_size, axis=3)  # kv head j serves query heads jg..jg+g-1
      layers[name] = {"kernel": k.reshape(2, 32, -1)}
    mha_params = {"params": {**params["params"], "layers": layers}}
    tokens = _tokens()
    np.testing.assert_allclose(_apply(mha)(mha_params, tokens), _apply(TINY)(params, tokens),
                               atol=1e-5)

  def test_sliding_window(self):
    params = _params()
    tokens = _tokens()
    full = _apply(TINY)(params, tokens)
    wide = _apply(TINY.replace(sliding_window=9))(params, tokens)
    narrow = _apply(TINY.replace(sliding_window=3))(params, tokens)
    np.testing.assert_allclose(wide, full, atol=1e-6)
    np.testing.assert_allclose(narrow[:, :3], full[:, :3], atol=1e-6)
    self.assertGreater(float(jnp.abs(narrow[:, 3:] - full[:, 3:]).max()), 1e-4)
    allowed = llama.attention_mask(jnp.arange(5)[None], jnp.ones((1, 5), bool), 2)
    np.testing.assert_array_equal(allowed[0, 4], [False, False, False, True, True])

  def test_padding_never_attended(self):
    params = _params()
    tokens = _tokens()
    mask = jnp.broadcast_to(jnp.arange(9) < 5, (2, 9))
    a = _apply(TINY)(params, tokens, mask)
    b = _apply(TINY)(params, tokens.at[:, 5:].set(7), mask)
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-6)

  def test_rope_layouts_are_a_permutation_of_each_other(self):
    x = jax.random.normal(jax.random.PRNGKey(5), (1, 4, 2, 8))
    pos = jnp.arange(4)[None] * 3
    perm = rope.half_to_interleaved_rows(1, 8)
    half = rope.apply_rope(x, pos, TINY)
    inter = rope.apply_rope(x[..., perm], pos, TINY.replace(rope_layout="interleaved"))
    np.testing.assert_allclose(inter, half[..., perm], atol=1e-6)
    np.testing.assert_allclose(rope.apply_rope(x, jnp.zeros((1, 4), jnp.int32), TINY), x)

  def test_rope_scaling_frequencies(self):
    base = rope.inverse_frequencies(TINY)
    linear = rope.inverse_frequencies(TINY.replace(rope_scaling="linear", rope_factor=4.0))
    np.testing.assert_allclose(linear, base / 4, rtol=1e-6)
    l3 = rope.inverse_frequencies(TINY.replace(rope_scaling="llama3", rope_factor=8.0,
                                               rope_original_max_positions=64))
    wavelen = 2 * np.pi / base
    np.testing.assert_allclose(l3[wavelen < 16], base[wavelen < 16])  # high freq kept
    np.testing.assert_allclose(l3[wavelen > 64], base[wavelen > 64] / 8, rtol=1e-6)

  def test_bad_input_errors(self):
    with self.assertRaisesRegex(ValueError, "n_heads .* multiple of n_kv_heads"):
      TINY.replace(n_kv_heads=3)
    with self.assertRaisesRegex(ValueError, "rope_layout"):
      TINY.replace(rope_layout="neox")
    with self.assertRaisesRegex(ValueError, "hidden must be a positive int"):
      TINY.replace(hidden=0)
    params = _params()
    model = llama.LlamaModel(TINY)
    with self.assertRaisesRegex(ValueError, "tokens must be an int"):
      model.apply(params, jnp.zeros((4,), jnp.int32))
    with self.assertRaisesRegex(ValueError, "mask must be bool"):
      model.apply(params, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 3), bool))


if __name__ == "__main__":
  absltest.main()
