"""Bad input (method, section 9, "Bad input"): eager errors, the checked mode, models.

Every bad input either raises an error naming the argument (eagerly, or as a
checkify error in ``certkv_jax.checked``'s checked mode under ``jit``) or gives
the documented result under plain ``jit``; the unchecked jitted path is
unchanged.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax import _validate
from certkv_jax.attention import offset
from certkv_jax import certificate
from certkv_jax import checked
from certkv_jax import designs
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv import caches as caches_lib
from models import decode
from models import inputs
from models import llama
from tests import test_util

N, D, DV = 6, 4, 3
MASK = np.array([True, True, True, True, False, True])


def _problem():
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  return {"q": jax.random.normal(ks[0], (D,)), "k": jax.random.normal(ks[1], (N, D)),
          "v": jax.random.normal(ks[2], (N, DV)),
          "log_pi": jnp.array([0.0, -0.5, -1.0, -0.2, -2.0, 0.0]), "mask": jnp.asarray(MASK)}


def _with(name, index, value):
  args = _problem()
  args[name] = args[name].at[index].set(value)
  return args


# (argument, index on a valid slot, message): one bad entry each.
_BAD = (
    ("q", 0, r"^q has 1 NaN/inf entries; q must be finite everywhere"),
    ("k", (1, 0), r"^k has 1 NaN/inf entries on valid slots \(mask True\)"),
    ("v", (1, 2), r"^v has 1 NaN/inf entries on valid slots \(mask True\)"),
    ("log_pi", 1, r"^log_pi has 1 NaN/inf entries on valid slots \(mask True\)"),
)


def _bad_cases():
  return [(f"{name}_{tag}", name, index, value, msg) for name, index, msg in _BAD
          for tag, value in (("nan", np.nan), ("inf", np.inf), ("neginf", -np.inf))]


class EagerAttentionTest(parameterized.TestCase):

  @parameterized.named_parameters(*_bad_cases())
  def test_nonfinite_raises_naming_the_argument(self, name, index, value, msg):
    with self.assertRaisesRegex(ValueError, msg):
      certkv_jax.offset_attention(**_with(name, index, value))

  def test_positive_log_pi_names_range(self):
    with self.assertRaisesRegex(ValueError, r"log_pi must be <= 0 .*pi in \(0, 1\].*0\.3"):
      certkv_jax.offset_attention(**_with("log_pi", 1, 0.3))

  def test_garbage_on_invalid_slots_is_not_read(self):
    args = _problem()
    clean = certkv_jax.offset_attention(**args)
    for name in ("k", "v", "log_pi"):
      args[name] = args[name].at[4].set(np.nan)  # slot 4 is masked out
    dirty = certkv_jax.offset_attention(**args)
    jax.tree_util.tree_map(np.testing.assert_array_equal, clean, dirty)

  def test_concrete_arrays_closed_over_in_jit(self):
    args = _problem()
    mask = args.pop("mask")
    f = jax.jit(lambda m: certkv_jax.offset_attention(mask=m, **args))
    np.testing.assert_array_equal(f(mask).out, jax.jit(certkv_jax.offset_attention)(
        mask=mask, **args).out)
    args["q"] = args["q"].at[0].set(np.nan)  # concrete: checked while tracing
    with self.assertRaisesRegex(ValueError, r"^q has 1 NaN/inf"):
      jax.jit(lambda m: certkv_jax.offset_attention(mask=m, **args))(mask)

  def test_attention_probs_checks_too(self):
    args = _with("k", (2, 1), np.inf)
    with self.assertRaisesRegex(ValueError, r"^k has 1 NaN/inf entries"):
      certkv_jax.attention_probs(args["q"], args["k"], args["log_pi"], args["mask"])

  def test_nonfinite_count_broadcasts_the_mask(self):
    # Keys shared by 2 query rows: slot 4 counts only if some row's mask reads it.
    k = jnp.ones((N, D)).at[0, 1].set(np.nan).at[4].set(np.nan)
    self.assertEqual(int(_validate.nonfinite_count(k, jnp.array([MASK, MASK]), 1)), 1)
    mask = jnp.array([MASK, ~MASK])
    self.assertEqual(int(_validate.nonfinite_count(k, mask, 1)), 1 + D)
    with self.assertRaisesRegex(ValueError, r"^k has 5 NaN/inf"):
      certkv_jax.offset_attention(jnp.ones((2, D)), k, jnp.ones((N, DV)), jnp.zeros(N), mask)


class CheckedAttentionTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.attend = checked.checked(checked.checked_offset_attention)

  @parameterized.named_parameters(*_bad_cases())
  def test_checked_mode_catches_nonfinite_under_jit(self, name, index, value, msg):
    err, _ = self.attend(**_with(name, index, value))
    self.assertRegex(err.get(), msg)
    with self.assertRaisesRegex(ValueError, msg):
      err.throw()

  def test_checked_mode_catches_positive_log_pi(self):
    err, _ = self.attend(**_with("log_pi", 3, 0.5))
    self.assertRegex(err.get(), r"log_pi must be <= 0 .*found 1 entries > 0, max 0\.5")

  def test_checked_mode_catches_all_false_mask(self):
    args = _problem()
    args["mask"] = jnp.zeros(N, bool)
    err, res = self.attend(**args)
    self.assertRegex(err.get(), r"mask has 1 rows with no valid slot \(all False")
    np.testing.assert_array_equal(res.out, 0.0)  # the defined result, returned as well
    err, _ = checked.checked(lambda *a: checked.checked_offset_attention(
        *a, allow_empty_rows=True))(*args.values())
    self.assertIsNone(err.get())

  def test_checked_mode_under_vmap(self):
    args = _problem()
    batch = {name: jnp.stack([x, x]) for name, x in args.items()}
    batch["v"] = batch["v"].at[1, 0, 0].set(np.nan)
    err, _ = checked.checked(jax.vmap(checked.checked_offset_attention))(**batch)
    self.assertRegex(err.get(), r"^v has 1 NaN/inf entries")

  def test_checked_mode_catches_bad_stored_value_norms(self):
    args = _problem()
    sq = jnp.sum(args["v"] ** 2, axis=-1)
    err, _ = self.attend(**args, value_sqnorm=sq.at[4].set(np.nan))
    self.assertIsNone(err.get())  # slot 4 is masked out: never read
    err, _ = self.attend(**args, value_sqnorm=sq.at[1].set(np.inf))
    self.assertRegex(err.get(), r"^value_sqnorm has 1 NaN/inf entries on valid slots")
    err, _ = self.attend(**args, value_sqnorm=sq.at[2].set(-1.0))
    self.assertRegex(err.get(), r"^value_sqnorm must be >= 0 .*found 1 entries < 0")

  def test_raising_helper(self):
    f = checked.raising(checked.checked_offset_attention)
    f(**_problem())
    with self.assertRaisesRegex(ValueError, r"^q has 1 NaN/inf"):
      f(**_with("q", 1, np.nan))

  def test_unchecked_jitted_path_is_unchanged(self):
    args = _problem()
    plain = jax.jit(certkv_jax.offset_attention)(**args)
    err, checked_res = self.attend(**args)
    self.assertIsNone(err.get())
    jax.tree_util.tree_map(np.testing.assert_array_equal, plain, checked_res)  # bit-identical
    # The eager value checks add nothing to the traced program: it is the same
    # program with them removed.
    jaxpr = str(jax.make_jaxpr(certkv_jax.offset_attention)(**args))
    with mock.patch.object(offset, "_check_values", lambda *a: None):
      self.assertEqual(jaxpr, str(jax.make_jaxpr(certkv_jax.offset_attention)(**args)))
    cache = certkv_jax.init_cache(4, D)
    new = (jnp.ones((2, D)), jnp.ones((2, D)))
    err, checked_cache = checked.checked(checked.checked_append)(cache, *new)
    self.assertIsNone(err.get())
    jax.tree_util.tree_map(np.testing.assert_array_equal, checked_cache,
                           jax.jit(cache_lib.append)(cache, *new))

  def test_plain_jit_results_are_as_documented(self):
    f = jax.jit(certkv_jax.offset_attention)
    res = f(**_with("v", (1, 0), np.nan))  # NaN in v: that component and the stats NaN
    self.assertTrue(np.isnan(res.out[0]) and np.isnan(res.var_hat))
    self.assertTrue(np.all(np.isfinite(res.out[1:])))
    res = f(**_with("k", (1, 0), np.nan))  # NaN logit: the row empties, radius NaN
    np.testing.assert_array_equal(res.out, 0.0)
    self.assertEqual(float(res.lse), -np.inf)
    self.assertTrue(np.isnan(certkv_jax.certificate_radius(res, 0.05)))


class CheckedCertificateTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.res = certkv_jax.offset_attention(**_problem())

  @parameterized.named_parameters(("zero", 0.0), ("one", 1.0), ("above", 1.5),
                                  ("negative", -0.1), ("nan", np.nan))
  def test_traced_delta_outside_range(self, delta):
    radius = checked.checked(checked.checked_certificate_radius)
    err, _ = radius(self.res, jnp.float32(delta))
    self.assertRegex(err.get(), r"^delta must be in \(0, 1\); got 1 entries outside, first")
    err, _ = radius(self.res, jnp.array([0.05, delta, 0.1], jnp.float32))
    self.assertRegex(err.get(), r"^delta must be in \(0, 1\)")

  def test_traced_delta_zero_plain_jit_is_inf(self):
    r = jax.jit(certkv_jax.certificate_radius)(self.res, jnp.float32(0.0))
    self.assertEqual(float(r), np.inf)  # the silent result the checked mode catches

  def test_good_delta_is_bit_identical(self):
    delta = jnp.float32(0.05)
    err, r = checked.checked(checked.checked_certificate_radius)(self.res, delta)
    self.assertIsNone(err.get())
    np.testing.assert_array_equal(r, jax.jit(certkv_jax.certificate_radius)(self.res, delta))
    err, r2 = checked.checked(checked.checked_radius_from_stats)(
        self.res.var_hat, self.res.range_hat, delta)
    self.assertIsNone(err.get())
    np.testing.assert_array_equal(r, r2)

  def test_eager_delta_still_raises(self):
    with self.assertRaisesRegex(ValueError, r"delta must be in \(0, 1\)"):
      certificate.certificate_radius(self.res, 0.0)


class OverflowTest(absltest.TestCase):

  def test_eager_append_names_capacity_and_dropped(self):
    c = cache_lib.append(certkv_jax.init_cache(4, D), jnp.ones((3, D)), jnp.ones((3, D)))
    with self.assertRaisesRegex(ValueError, r"capacity 4\) has 1: 2 tokens would not fit"):
      cache_lib.append(c, jnp.ones((3, D)), jnp.ones((3, D)))

  def test_plain_jit_counts_only(self):
    c = certkv_jax.init_cache(4, D)
    c = jax.jit(cache_lib.append)(c, jnp.ones((6, D)), jnp.ones((6, D)))
    self.assertEqual(int(c.n_dropped), 2)

  def test_checked_append_under_jit(self):
    append = checked.checked(checked.checked_append)
    c = certkv_jax.init_cache(4, D)
    err, c = append(c, jnp.ones((3, D)), jnp.ones((3, D)))
    self.assertIsNone(err.get())
    err, c = append(c, jnp.ones((3, D)), jnp.ones((3, D)),
                    jnp.array([True, True, False]))
    self.assertRegex(err.get(), r"^cache overflow: 1 appended tokens found no free slot "
                     r"\(capacity 4 per head")
    self.assertEqual(int(c.n_dropped), 1)

  def test_model_caches_overflow_is_caught(self):
    config = test_util.tiny_config()
    caches = caches_lib.init_caches(config, 2, 3)
    layer = caches.layer(0)  # [batch, n_kv_heads, ...]
    kv = jnp.ones((2, config.n_kv_heads, 4, config.head_dim))
    valid = jnp.ones((2, config.n_kv_heads, 4), bool).at[0, :, 3].set(False)

    def step(layer, kv, valid):
      return caches_lib.over_heads(checked.checked_append)(layer, kv, kv, valid)

    err, layer = checked.checked(step)(layer, kv, valid)
    self.assertRegex(err.get(), r"^cache overflow: \d+ appended tokens")
    # Row 1 dropped one token on each KV head.
    self.assertEqual(int(jnp.sum(layer.n_dropped)), config.n_kv_heads)
    err, _ = checked.checked(checked.check_no_overflow)(layer)
    self.assertRegex(err.get(), rf"^cache overflow: {config.n_kv_heads} appended tokens")

  @pytest.mark.slow  # 31 s cold on the 2-core CI machine (2026-12-01)
  def test_generation_overflow_is_caught_under_jit(self):
    config = test_util.tiny_config()
    params = test_util.tiny_params(config)
    tokens, mask = jnp.array([[1, 2, 3]]), jnp.ones((1, 3), bool)
    # Evicted to 2 tokens once, then 4 decoded tokens into 4 slots: 2 dropped
    # per (layer, KV head) cache.
    kw = dict(config=config, gen=decode.GenerationConfig(
        n_steps=4, design=designs.sink_window(2, n_sink=1), capacity=4))

    def run(params, tokens, mask, key):
      gen = decode.generate(params, tokens, mask, key, **kw)
      checked.check_no_overflow(gen.caches)
      return gen

    err, gen = checked.checked(run)(params, tokens, mask, jax.random.PRNGKey(0))
    n_caches = config.n_layers * config.n_kv_heads
    self.assertRegex(err.get(), rf"^cache overflow: {2 * n_caches} appended tokens")
    # Eager: an error. Inside an outer jit: counted in the caches and per row in
    # Generation.n_dropped.
    with self.assertRaisesRegex(ValueError, r"capacity \(4\) overflowed: rows \[0\]"):
      decode.generate(params, tokens, mask, jax.random.PRNGKey(0), **kw)
    plain = jax.jit(lambda p, t, m, k: decode.generate(p, t, m, k, **kw))(
        params, tokens, mask, jax.random.PRNGKey(0))
    self.assertEqual(int(jnp.sum(plain.caches.n_dropped)), 2 * n_caches)
    np.testing.assert_array_equal(plain.n_dropped, [2])
    np.testing.assert_array_equal(gen.n_dropped, [2])
    self.assertFalse(bool(plain.certified))  # a deterministic design certifies nothing
    np.testing.assert_array_equal(gen.tokens, plain.tokens)
    np.testing.assert_array_equal(gen.logprobs, plain.logprobs)


class ModelInputsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = test_util.tiny_config()
    cls.tokens = np.array([[1, 2, 3], [4, 5, 0]], np.int32)
    cls.mask = np.array([[True, True, True], [True, True, False]])

  def _check(self, tokens=None, mask=None, **kw):
    kw.setdefault("config", self.config)
    kw.setdefault("n_steps", 2)
    inputs.check_prompt(self.tokens if tokens is None else tokens,
                        self.mask if mask is None else mask, **kw)

  def test_good_prompt_passes(self):
    self._check()
    self._check(max_positions=5)  # longest row 3 + 2 steps

  def test_empty_prompt(self):
    with self.assertRaisesRegex(ValueError, r"tokens is empty \(length 0"):
      self._check(np.zeros((2, 0), np.int32), np.zeros((2, 0), bool))
    with self.assertRaisesRegex(ValueError, r"context has batch size 0"):
      self._check(np.zeros((0, 3), np.int32), np.zeros((0, 3), bool), name="context")

  def test_all_false_row_names_the_row(self):
    mask = self.mask.copy()
    mask[1] = False
    with self.assertRaisesRegex(ValueError, r"^mask row 1 is all False"):
      self._check(mask=mask)
    with self.assertRaisesRegex(ValueError, r"^question_mask row 1 is all False"):
      self._check(mask=mask, name="question")
    self._check(mask=mask, allow_empty_rows=True)

  def test_left_padding_rejected(self):
    mask = np.array([[True, True, True], [False, True, True]])
    with self.assertRaisesRegex(ValueError, r"mask row 1 is not right-padded"):
      self._check(mask=mask)

  def test_token_ids_out_of_range(self):
    tokens = self.tokens.copy()
    tokens[1, 1] = 64
    with self.assertRaisesRegex(ValueError, r"token id 64 at row 1, column 1 .*\[0, 64\)"):
      self._check(tokens)
    tokens[0, 2] = -3
    with self.assertRaisesRegex(ValueError, r"token id -3 at row 0, column 2 .*\[0, 64\)"):
      self._check(tokens)

  def test_prompt_longer_than_context(self):
    with self.assertRaisesRegex(ValueError, r"too long .*longest row 3 \+ n_steps 2 = 5 "
                                r"positions > max_positions 4"):
      self._check(max_positions=4)

  def test_n_steps_and_shapes(self):
    with self.assertRaisesRegex(ValueError, r"n_steps must be an int >= 1, got 0"):
      self._check(n_steps=0)
    with self.assertRaisesRegex(ValueError, r"mask must be bool"):
      self._check(mask=self.mask.astype(np.int32))
    with self.assertRaisesRegex(ValueError, r"tokens must be an int \[batch, len\]"):
      self._check(self.tokens.astype(np.float32))

  def test_decode_check_prompt(self):
    tokens = self.tokens.copy()
    tokens[0, 0] = 99
    with self.assertRaisesRegex(ValueError, r"context holds token id 99"):
      decode._check_prompt(tokens, self.mask, 2, config=self.config, name="context")  # pylint: disable=protected-access

  def test_generate_rejects_empty_prompt_inside_jit(self):
    params = test_util.tiny_params(self.config)
    with self.assertRaisesRegex(ValueError, r"tokens is empty \(length 0"):
      decode.generate(params, jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 0), bool),
                      jax.random.PRNGKey(0), config=self.config,
                      gen=decode.GenerationConfig(n_steps=2, capacity=8))

  @pytest.mark.slow  # 37 s cold on the 2-core CI machine (2026-12-01)
  def test_generate_checks_values_before_its_jitted_call(self):
    params = test_util.tiny_params(self.config)
    kw = dict(config=self.config, gen=decode.GenerationConfig(n_steps=2, capacity=8))
    key = jax.random.PRNGKey(0)
    bad = self.tokens.copy()
    bad[1, 0] = 64
    with self.assertRaisesRegex(ValueError, r"tokens holds token id 64 at row 1"):
      decode.generate(params, bad, self.mask, key, **kw)
    empty_row = self.mask.copy()
    empty_row[1] = False
    with self.assertRaisesRegex(ValueError, r"^mask row 1 is all False"):
      decode.generate(params, self.tokens, empty_row, key, **kw)
    short = self.config.replace(max_positions=4)  # 3 prompt tokens + 2 steps > 4
    with self.assertRaisesRegex(ValueError, r"longest row 3 \+ n_steps 2 = 5 positions > "
                                r"max_positions 4"):
      decode.generate(params, self.tokens, self.mask, key, **dict(kw, config=short))
    question, q_mask = self.tokens[:, :2], self.mask[:, :2]
    skw = dict(config=short, gen=decode.GenerationConfig(n_steps=2, capacity=8, chunk=2))
    with self.assertRaisesRegex(ValueError, r"the longest row's context and question \(5 "
                                r"tokens\) \+ n_steps \(2\) = 7 positions exceed .* "
                                r"max_positions 4"):
      decode.generate_streaming(params, (self.tokens, self.mask), (question, q_mask), key,
                                **skw)
    # Padding takes no position: 3 real context tokens padded to 6 fit max_positions 7
    # (before: refused, counting 6 + 2 + 2 = 10).
    wide = (np.pad(self.tokens, ((0, 0), (0, 3))), np.pad(self.mask, ((0, 0), (0, 3))))
    decode.generate_streaming(params, wide, (question, q_mask), key,
                              **dict(skw, config=self.config.replace(max_positions=7)))
    with self.assertRaisesRegex(ValueError, r"question holds token id 64"):
      decode.generate_streaming(params, (self.tokens, self.mask), (bad[:, :2], q_mask), key,
                                **dict(skw, config=self.config))
    for context in (self.tokens, (self.tokens, self.mask, self.mask)):
      with self.assertRaisesRegex(ValueError, r"context must be a \(tokens, mask\) pair"):
        decode.generate_streaming(params, context, (question, q_mask), key,
                                  **dict(skw, config=self.config))
    with self.assertRaisesRegex(ValueError, "max_positions must be a positive int"):
      self.config.replace(max_positions=0)
    gen = decode.generate(params, self.tokens, self.mask, key, **dict(
        kw, gen=kw["gen"].replace(design=designs.poisson_tail(
            0.5, certain=designs.CertaintySet(n_sink=1, window=1)))))
    self.assertTrue(bool(gen.certified))
    np.testing.assert_array_equal(gen.n_dropped, [0, 0])

  def test_llama_entry_points(self):
    params = test_util.tiny_params(self.config)
    model = llama.LlamaModel(self.config)
    with self.assertRaisesRegex(ValueError, r"tokens is empty \(length 0"):
      model.apply(params, jnp.zeros((1, 0), jnp.int32))
    with self.assertRaisesRegex(ValueError, r"token id 70 at row 0, column 1 .*\[0, 64\)"):
      model.apply(params, jnp.array([[1, 70]]))
    with self.assertRaisesRegex(ValueError, r"seq must be an int >= 1"):
      llama.init_params(self.config, jax.random.PRNGKey(0), seq=0)


if __name__ == "__main__":
  absltest.main()
