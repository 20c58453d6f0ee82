"""The Flax Llama-family decoder on small random configurations."""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import certkv_jax
from models import decode
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


# --------------------------------------------------------------------------
# An independent reference: the Hugging Face Llama forward pass written in
# float64 numpy from the parameter tree (layout in models/llama.py's docstring),
# sharing no code with models/ or certkv_jax/.


def _rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta, layout):
  """x [seq, heads, d] rotated by positions * theta^(-2i/d), i < d/2.

  "half" is HF's ``x * cos + rotate_half(x) * sin`` with ``cos = cat(c, c)``
  and ``rotate_half(x) = cat(-x[d/2:], x[:d/2])``: pair i is (x[i], x[i+d/2]).
  "interleaved" (Meta / GGUF) rotates the pairs (x[2i], x[2i+1]).
  """
  d = x.shape[-1]
  angle = positions[:, None, None] * theta ** (-np.arange(0, d, 2) / d)  # [seq, 1, d/2]
  if layout == "half":
    cos = np.cos(np.concatenate([angle, angle], -1))
    sin = np.sin(np.concatenate([angle, angle], -1))
    return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin
  out = np.empty_like(x)
  x1, x2 = x[..., 0::2], x[..., 1::2]
  out[..., 0::2] = x1 * np.cos(angle) - x2 * np.sin(angle)
  out[..., 1::2] = x2 * np.cos(angle) + x1 * np.sin(angle)
  return out


def _reference_logits(params, config, tokens, mask, positions):
  """[batch, seq, vocab] float64 logits: RMSNorm, RoPE, GQA causal attention
  (query head h reads KV head h // group, as HF's repeat_kv), SwiGLU."""
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params["params"])
  c = config
  group = c.n_heads // c.n_kv_heads
  out = []
  for b in range(tokens.shape[0]):
    x = p["embed"]["embedding"][tokens[b]]
    n = x.shape[0]
    pos = positions[b].astype(np.float64)
    allowed = (positions[b][None, :] <= positions[b][:, None]) & mask[b][None, :]
    for i in range(c.n_layers):
      layer = jax.tree_util.tree_map(lambda a, i=i: a[i], p["layers"])

      def dense(name, h, layer=layer):
        y = h @ layer[name]["kernel"]
        return y + layer[name]["bias"] if "bias" in layer[name] else y

      h = _rms_norm(x, layer["attn_norm"]["scale"], c.rms_eps)
      q = _rope(dense("q_proj", h).reshape(n, c.n_heads, c.head_dim), pos, c.rope_theta,
                c.rope_layout)
      k = _rope(dense("k_proj", h).reshape(n, c.n_kv_heads, c.head_dim), pos, c.rope_theta,
                c.rope_layout)
      v = dense("v_proj", h).reshape(n, c.n_kv_heads, c.head_dim)
      heads = []
      for hq in range(c.n_heads):
        logit = q[:, hq] @ k[:, hq // group].T / np.sqrt(c.head_dim)
        logit = np.where(allowed, logit, -np.inf)
        w = np.exp(logit - logit.max(-1, keepdims=True))
        heads.append((w / w.sum(-1, keepdims=True)) @ v[:, hq // group])
      x = x + dense("o_proj", np.concatenate(heads, -1))
      h = _rms_norm(x, layer["mlp_norm"]["scale"], c.rms_eps)
      gate = h @ layer["mlp"]["gate_proj"]["kernel"]
      silu = gate / (1.0 + np.exp(-gate))
      up = h @ layer["mlp"]["up_proj"]["kernel"]
      x = x + (silu * up) @ layer["mlp"]["down_proj"]["kernel"]
    h = _rms_norm(x, p["final_norm"]["scale"], c.rms_eps)
    head = p["embed"]["embedding"].T if c.tie_embeddings else p["lm_head"]["kernel"]
    out.append(h @ head)
  return np.stack(out)


def _perturbed_params(config, seed=0):
  """Random parameters with norm scales 1 + 0.3 N(0, 1) and biases 0.1 N(0, 1)
  (init leaves them 1 and 0, where a missing scale or bias would not show)."""
  rng = np.random.default_rng(seed)

  def perturb(path, a):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return jnp.asarray(1.0 + 0.3 * rng.normal(size=a.shape), jnp.float32)
    if "bias" in name:
      return jnp.asarray(0.1 * rng.normal(size=a.shape), jnp.float32)
    return a

  return jax.tree_util.tree_map_with_path(perturb, test_util.tiny_params(config, seed))


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

  @parameterized.named_parameters(
      # TINY: RoPE base 10000, HF's "half" layout, positions 0..8.
      ("default", {}, 9, None),
      # Another RoPE base, Meta's / GGUF's layout, biases, tied head, positions
      # 40, 43, ..., 85 (angles up to 85 rad at inv_freq 1).
      ("custom", dict(rope_theta=500.0, rope_layout="interleaved", qkv_bias=True, out_bias=True,
                      tie_embeddings=True), 16, 40),
  )
  def test_logits_match_numpy_reference(self, changes, seq, first_position):
    config = TINY.replace(**changes)
    params = _perturbed_params(config)
    tokens = np.asarray(_tokens(s=seq))
    n_real = seq - 3
    mask = np.stack([np.ones(seq, bool), np.arange(seq) < n_real])  # row 1 right-padded
    if first_position is None:  # the model's default positions
      positions = np.broadcast_to(np.arange(seq), (2, seq)).astype(np.int32)
      got = _apply(config)(params, tokens, mask)
    else:
      positions = np.broadcast_to(first_position + 3 * np.arange(seq), (2, seq)).astype(np.int32)
      got = _apply(config)(params, tokens, mask, positions)
    got = np.asarray(got, np.float64)
    want = _reference_logits(params, config, tokens, mask, positions)
    # float32 model against float64 numpy: unit roundoff 6e-8, dot products of
    # <= 48 terms, two layers; measured max error 6e-7 of max |logit| in both
    # cases. Tolerance 1e-5 of max |logit|; a RoPE base off by a factor 2 moves
    # the logits by 2.9% (default, positions <= 8) and 87% (custom) of it.
    atol = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=atol)
    np.testing.assert_allclose(got[1, :n_real], want[1, :n_real], rtol=0, atol=atol)
    wrong_base = _reference_logits(params, config.replace(rope_theta=2 * config.rope_theta),
                                   tokens, mask, positions)
    self.assertGreater(np.abs(wrong_base - want).max(), 1000 * atol)  # the check can fail

  def test_eviction_zeroes_evicted_slots_of_the_model_caches(self):
    # The model's stacked caches [layers, batch, kv heads, cap] filled by hand:
    # row 0 holds 12 tokens, row 1 holds 9 (then free slots); random keys,
    # values and statistics, and offsets as an earlier random round would have
    # left them (a deterministic round adds 0 to the kept ones). SnapKV then
    # keeps 6 tokens per cache.
    rng = np.random.default_rng(0)
    lead, cap = (TINY.n_layers, 2, TINY.n_kv_heads), 12
    valid = np.broadcast_to((np.arange(cap) < np.array([12, 9])[:, None])[None, :, None],
                            lead + (cap,))
    k = rng.normal(size=lead + (cap, TINY.head_dim)) * valid[..., None]
    v = rng.normal(size=lead + (cap, TINY.head_dim)) * valid[..., None]
    stat = lambda: np.where(valid, rng.uniform(0.01, 1.0, size=valid.shape), 0.0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    ref = v[..., 0, :]  # the reference of v_sq: the value of the oldest token (a sink here)
    caches = decode.init_caches(TINY, 2, cap).replace(
        k=f32(k), v=f32(v), v_sq=f32(np.sum((v - ref[..., None, :]) ** 2, -1) * valid),
        v_ref=f32(ref), valid=jnp.asarray(valid),
        pos=jnp.asarray(np.where(valid, np.arange(cap), -1), jnp.int32),
        acc=f32(stat()), last=f32(stat()), obs=f32(stat()),
        log_pi=f32(np.where(valid, -0.5, 0.0)),
        n_seen=jnp.asarray(valid.sum(-1), jnp.int32))
    design = certkv_jax.designs.snapkv(6, window=2, pool_size=3, n_sink=1)
    out = decode.evict(design, caches, jax.random.PRNGKey(0))
    new, info = out.caches, out.info
    evicted = np.asarray(info.evicted)
    kept = np.asarray(new.valid)
    # Row 0 has 12 real tokens, row 1 has 9: 6 and 3 evicted in every cache.
    np.testing.assert_array_equal(evicted.sum(-1),
                                  np.broadcast_to(np.array([6, 3])[None, :, None], (2, 2, 2)))
    np.testing.assert_array_equal(evicted, np.asarray(caches.valid) & ~kept)
    for field in ("k", "v", "acc", "last", "obs", "v_sq", "log_pi"):
      before = np.asarray(getattr(caches, field))
      after = np.asarray(getattr(new, field))
      self.assertTrue((before[evicted] != 0).any(axis=None), field)  # something to erase
      np.testing.assert_array_equal(after[evicted], 0.0, err_msg=field)
      np.testing.assert_array_equal(after[kept], before[kept], err_msg=field)
    np.testing.assert_array_equal(np.asarray(new.pos)[evicted], -1)
    np.testing.assert_array_equal(np.asarray(new.n_seen), np.asarray(caches.n_seen))

  def test_bad_input_errors(self):
    with self.assertRaisesRegex(ValueError, "n_heads .* multiple of n_kv_heads"):
      TINY.replace(n_kv_heads=3)
    with self.assertRaisesRegex(ValueError, "rope_layout"):
      TINY.replace(rope_layout="neox")
    with self.assertRaisesRegex(ValueError, "hidden must be a positive int"):
      TINY.replace(hidden=0)
    # llama3 rope factors: before, 0 divided by zero when the model ran and a reversed
    # pair gave other frequencies without an error; float16 passed here, then failed
    # in the loaders.
    for low, high in ((0.0, 4.0), (-1.0, 4.0), (4.0, 1.0), (2.0, 2.0)):
      with self.assertRaisesRegex(ValueError, "0 < rope_low_freq_factor < rope_high"):
        TINY.replace(rope_scaling="llama3", rope_low_freq_factor=low,
                     rope_high_freq_factor=high)
    with self.assertRaisesRegex(ValueError, "dtype must be 'float32' or 'bfloat16'"):
      TINY.replace(dtype="float16")
    params = _params()
    model = llama.LlamaModel(TINY)
    with self.assertRaisesRegex(ValueError, "tokens must be an int"):
      model.apply(params, jnp.zeros((4,), jnp.int32))
    with self.assertRaisesRegex(ValueError, "mask must be bool"):
      model.apply(params, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 3), bool))


if __name__ == "__main__":
  absltest.main()
