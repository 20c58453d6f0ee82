"""Pallas kernels vs the jnp reference and float64 NumPy.

Run twice (as jax's own Pallas tests do): ``KernelTest`` with
``INTERPRET = False`` runs the compiled kernels and skips without a GPU/TPU;
``InterpretKernelTest`` runs the same checks in the Pallas interpreter
everywhere. Lowering tests build the Triton (cuda) and Mosaic (tpu) lowerings
on CPU, which catches block-shape and op-support errors without the hardware.
"""

import functools
import math
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax.attention import certified
from pallas_kernels import offset_decode as od
from tests import test_util


def _inputs(batch, groups, n, d, dtype=jnp.float32, seed=0, p_valid=0.8, max_offset=None):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(ks[0], (batch, groups, d)).astype(dtype)
  k = jax.random.normal(ks[1], (batch, n, d)).astype(dtype)
  v = jax.random.normal(ks[2], (batch, n, d)).astype(dtype)
  off = jax.random.exponential(ks[3], (batch, n)) * 2.0
  certain = jax.random.bernoulli(ks[4], 0.4, (batch, n))
  off = jnp.where(certain, 0.0, off)
  if max_offset is not None:
    off = off.at[:, ::7].set(max_offset)
  off = jnp.where(jax.random.bernoulli(ks[5], p_valid, (batch, n)), off, -jnp.inf)
  return q, k, v, off


def _np_stats(q, k, v, off, lengths):
  """Float64 NumPy of method, section 4 per (b, g): out, var_hat, range_hat, and
  ``scale = sum w p^2 (||v - c||^2 + ||o - c||^2)`` (c: mean of the valid values),
  the size of the terms whose difference the one-pass float32 formula takes:
  its rounding error is a few float32 epsilons of that, not of var_hat."""
  q, k, v, off = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, off))
  batch, groups, d = q.shape
  out = np.zeros((batch, groups, v.shape[-1]))
  var = np.zeros((batch, groups))
  rng = np.zeros((batch, groups))
  scale = np.zeros((batch, groups))
  for b in range(batch):
    valid = np.isfinite(off[b]) & (np.arange(k.shape[1]) < lengths[b])
    if not valid.any():
      continue
    for g in range(groups):
      l = k[b, valid] @ q[b, g] / math.sqrt(d) + off[b, valid]
      p = np.exp(l - l.max())
      p /= p.sum()
      o = p @ v[b, valid]
      w = 1.0 - np.exp(-off[b, valid])
      dev = np.linalg.norm(v[b, valid] - o, axis=-1)
      out[b, g], var[b, g], rng[b, g] = o, np.sum(w * p**2 * dev**2), np.max(w * p * dev)
      c = v[b, valid].mean(0)
      scale[b, g] = np.sum(w * p**2 * (np.sum((v[b, valid] - c)**2, -1) + np.sum((o - c)**2)))
  return out, var, rng, scale


# Tolerances per input dtype (``_check``). The kernel states the precision of
# every product (tests/pallas_kernels/precision_test.py): float32 inputs multiply in IEEE
# float32 and differ from the float32 reference only by float32 rounding in
# another summation order (tiles, splits): a few hundred slots at eps = 1.2e-7
# give 2e-5 on the output, and from float64 the same plus the reference's own
# rounding, 1e-4. bfloat16 inputs multiply exactly with float32 accumulation,
# but by default (KernelConfig.split_values) the float32 weights meet the
# values as two bfloat16 parts of 16 significant bits (relative error < 2^-16):
# the output moves by up to 2^-16 sum_i p_i |v_i| <= 1.5e-5 max|v| (about 4
# here), 6e-5, against the reference's exact products; 1.2e-4 leaves 2x. A
# TF32 product (10-bit mantissa) would miss the float32 bounds by 10-100x, as
# the compiled kernels did on a GPU before precision was stated.
_TOL = {jnp.dtype(jnp.float32): dict(out_ref=2e-5, out_f64=1e-4),
        jnp.dtype(jnp.bfloat16): dict(out_ref=1.2e-4, out_f64=1.2e-4)}


def _var_atol(scale):
  # 100 float32 epsilons (1.2e-5) of the cancelled terms: summation over a few
  # hundred slots plus the expanded square. See test_common_mode_values.
  return 1e-5 * scale


class KernelTest(parameterized.TestCase):
  INTERPRET = False

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and jax.default_backend() not in ("gpu", "tpu"):
      self.skipTest("compiled Pallas kernels need a GPU or TPU")
    self.backend = "mosaic" if jax.default_backend() == "tpu" else "triton"

  def _check(self, q, k, v, off, lengths=None, block_sizes=None, backends=None):
    tol = _TOL[jnp.dtype(k.dtype)]
    rtol = tol["out_ref"]
    lens = np.full(q.shape[0], k.shape[1]) if lengths is None else np.asarray(lengths)
    out, var, rng, scale = _np_stats(q, k, v, off, lens)
    ref = od.offset_decode_reference(q, k, v, off, lengths)
    for backend in backends or ([self.backend] if not self.INTERPRET else od.BACKENDS):
      bs = block_sizes or od.BlockSizes(block_k=128, num_splits=2)
      if backend == "triton" and block_sizes is None:
        bs = od.BlockSizes(block_k=32, num_splits=3)
      got = od.offset_decode_attention(q, k, v, off, lengths, config=od.KernelConfig(
          backend=backend, interpret=self.INTERPRET, block_sizes=bs))
      for field in (got.out, got.var_hat, got.range_hat):
        self.assertTrue(bool(jnp.all(jnp.isfinite(field))), backend)
      self.assertFalse(bool(jnp.any(jnp.isnan(got.lse))), backend)  # -inf for empty rows
      # vs the jnp reference (same float32 formula, different summation order)
      np.testing.assert_allclose(got.out, ref.out, rtol=rtol, atol=rtol, err_msg=backend)
      self.assertTrue(np.all(np.abs(np.asarray(got.var_hat) - np.asarray(ref.var_hat))
                             <= 1e-4 * np.asarray(ref.var_hat) + 2 * _var_atol(scale) + 1e-12),
                      backend)
      # The range term differences v_i - o inherit the float32 error of o.
      range_atol = 1e-4 * float(np.max(rng)) + 1e-7
      np.testing.assert_allclose(got.range_hat, ref.range_hat, rtol=1e-3, atol=range_atol,
                                 err_msg=backend)
      # vs float64 NumPy
      np.testing.assert_allclose(got.out, out, rtol=tol["out_f64"], atol=tol["out_f64"],
                                 err_msg=backend)
      self.assertTrue(np.all(np.abs(np.asarray(got.var_hat) - var)
                             <= 1e-4 * var + _var_atol(scale) + 1e-12), backend)
      np.testing.assert_allclose(got.range_hat, rng, rtol=1e-3, atol=range_atol,
                                 err_msg=backend)

  @parameterized.product(groups=(1, 4, 8), d=(64, 128))
  def test_gqa_groups_and_head_dims(self, groups, d):
    self._check(*_inputs(2, groups, 300, d))  # 300: not a multiple of any block

  @pytest.mark.slow  # 30 s cold on the 2-core CI machine (2026-12-01)
  def test_ragged_lengths_and_empty_rows(self):
    q, k, v, off = _inputs(4, 4, 256, 64, seed=1)
    lengths = jnp.array([256, 130, 1, 0], jnp.int32)
    self._check(q, k, v, off, lengths)
    res = od.offset_decode_attention(q, k, v, off, lengths, config=od.KernelConfig(
        backend=self.backend, interpret=self.INTERPRET))
    np.testing.assert_array_equal(res.out[3], 0.0)  # no valid slot: defined, not NaN
    np.testing.assert_array_equal(res.lse[3], -np.inf)
    np.testing.assert_array_equal(res.var_hat[3], 0.0)

  def test_fully_masked_blocks(self):
    q, k, v, off = _inputs(2, 4, 384, 64, seed=2)
    off = off.at[:, 128:256].set(-jnp.inf).at[1, :].set(-jnp.inf)
    self._check(q, k, v, off, block_sizes=od.BlockSizes(128, 1))

  @pytest.mark.slow  # 38 s cold on the 2-core CI machine (2026-12-01)
  def test_bfloat16_inputs(self):
    q, k, v, off = _inputs(2, 4, 200, 64, dtype=jnp.bfloat16, seed=3)
    self._check(q, k, v, off)  # float32 accumulation, weights in two bf16 parts (_TOL)

  def test_split_values(self):
    # bfloat16 values as stored, the float32 weights in two bfloat16 parts
    # (hi + lo: relative error < 2^-16 = 1.5e-5 per weight): the output moves by
    # at most that times sum_i p_i |v_i| <= max |v| (about 4 here), 6e-5; the
    # statistics by the same relative amount. The tolerances leave 2x of that.
    q, k, v, off = _inputs(2, 4, 300, 64, dtype=jnp.bfloat16, seed=12)
    bs = od.BlockSizes(128, 1) if self.backend == "mosaic" else od.BlockSizes(32, 3)
    run = lambda split: od.offset_decode_attention(q, k, v, off, config=od.KernelConfig(
        backend=self.backend, interpret=self.INTERPRET, block_sizes=bs, split_values=split))
    plain, split = run(False), run(True)
    np.testing.assert_allclose(split.out, plain.out, rtol=1.2e-4, atol=1.2e-4)
    np.testing.assert_allclose(split.lse, plain.lse, rtol=1e-6)  # keys: the same product
    np.testing.assert_allclose(split.var_hat, plain.var_hat, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(split.range_hat, plain.range_hat, rtol=1e-3, atol=1e-6)

  def test_offsets_up_to_floor(self):
    # -log(1e-6) = 13.8: the largest offset the default floor allows.
    self._check(*_inputs(2, 4, 200, 64, seed=4, max_offset=-math.log(1e-6)))

  def test_an_offset_rounded_below_zero_is_a_kept_slot(self):
    # A certain token whose pi rounds a hair above 1 has -log pi = -1e-7: before, the
    # kernel read any offset below 0 (and NaN) as an empty slot and dropped it.
    q, k, v, off = _inputs(2, 4, 200, 64, seed=5)
    self._check(q, k, v, jnp.where(off == 0.0, -1e-7, off))

  def test_common_mode_values(self):
    # Values with a large common offset (as LLM value channels have): the
    # centred sums keep the error at the scale of ||v - mean||^2, which a
    # sum of raw ||v||^2 (offset 20 -> 400x larger) would not.
    q, k, v, off = _inputs(2, 4, 256, 64, seed=11)
    self._check(q, k, v + 20.0, off)

  def test_split_k_matches_single_split(self):
    q, k, v, off = _inputs(2, 4, 512, 64, seed=5)
    backend = self.backend
    bk = 128 if backend == "mosaic" else 32
    one = od.offset_decode_attention(q, k, v, off, config=od.KernelConfig(
        backend=backend, interpret=self.INTERPRET, block_sizes=od.BlockSizes(bk, 1)))
    many = od.offset_decode_attention(q, k, v, off, config=od.KernelConfig(
        backend=backend, interpret=self.INTERPRET, block_sizes=od.BlockSizes(bk, 4)))
    jax.tree_util.tree_map(  # every field the kernel returns (probs: None in both)
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), one, many)

  def test_range_bound_mode(self):
    q, k, v, off = _inputs(2, 4, 200, 64, seed=6)
    exact = od.offset_decode_attention(q, k, v, off, config=od.KernelConfig(
        backend=self.backend, interpret=self.INTERPRET))
    bound = od.offset_decode_attention(q, k, v, off, config=od.KernelConfig(
        backend=self.backend, interpret=self.INTERPRET, range_mode="bound"))
    self.assertTrue(bool(jnp.all(bound.range_hat >= exact.range_hat * (1 - 1e-5))))
    np.testing.assert_allclose(bound.var_hat, exact.var_hat)

  def test_chunk_variant(self):
    batch, t, groups, n, d = 2, 6, 2, 160, 64
    q, k, v, off = _inputs(batch, t * groups, n, d, seed=7)
    q = q.reshape(batch, t, groups, d)
    kc = jax.random.normal(jax.random.PRNGKey(8), (batch, t, d))
    vc = jax.random.normal(jax.random.PRNGKey(9), (batch, t, d))
    got = od.offset_chunk_attention(q, k, v, off, od.ChunkKV(kc, vc), config=od.KernelConfig(
        backend=self.backend, interpret=self.INTERPRET))
    for i in range(t):  # row i sees the cache and chunk tokens 0..i (certain)
      kk = jnp.concatenate([k, kc[:, :i + 1]], 1)
      vv = jnp.concatenate([v, vc[:, :i + 1]], 1)
      oo = jnp.concatenate([off, jnp.zeros((batch, i + 1))], 1)
      out, var, rng, scale = _np_stats(q[:, i], kk, vv, oo, np.full(batch, n + i + 1))
      np.testing.assert_allclose(got.out[:, i], out, rtol=1e-4, atol=1e-4)
      self.assertTrue(np.all(np.abs(np.asarray(got.var_hat[:, i]) - var)
                             <= 1e-4 * var + _var_atol(scale) + 1e-12))
      np.testing.assert_allclose(got.range_hat[:, i], rng, rtol=1e-3, atol=1e-8)

  def test_dispatch_from_core(self):
    b, h_kv, g, n, d = 2, 3, 4, 70, 64
    ks = jax.random.split(jax.random.PRNGKey(10), 5)
    q = jax.random.normal(ks[0], (b, h_kv, g, d))
    k = jax.random.normal(ks[1], (b, h_kv, 1, n, d))
    v = jax.random.normal(ks[2], (b, h_kv, 1, n, d))
    log_pi = -jax.random.exponential(ks[3], (b, h_kv, 1, n))
    mask = jax.random.bernoulli(ks[4], 0.8, (b, h_kv, 1, n))
    impl = lambda name: certkv_jax.attention.AttentionConfig(implementation=name,
                                                             with_probs=True)
    run = lambda name: certkv_jax.offset_attention(q, k, v, log_pi, mask, config=impl(name))
    xla, pal, auto = run("xla"), run("pallas"), run("auto")
    for a, p, u in zip(xla, pal, auto):  # out, lse, var_hat, range_hat, probs
      np.testing.assert_allclose(a, p, rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(a, u, rtol=1e-4, atol=1e-5)
    self.assertEqual(pal.out.shape, (b, h_kv, g, d))


class InterpretKernelTest(KernelTest):
  INTERPRET = True


class LoweringTest(parameterized.TestCase):
  """Lowers the default configuration for both backends on CPU."""

  @parameterized.product(platform=("tpu", "cuda"), groups=(1, 4, 8), d=(64, 128))
  def test_decode_lowers(self, platform, groups, d):
    backend = "mosaic" if platform == "tpu" else "triton"
    q, k, v, off = (jax.ShapeDtypeStruct(s, t) for s, t in (
        ((4, groups, d), jnp.bfloat16), ((4, 4096, d), jnp.bfloat16),
        ((4, 4096, d), jnp.bfloat16), ((4, 4096), jnp.float32)))
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    f = functools.partial(od.offset_decode_attention,
                          config=od.KernelConfig(backend=backend, range_mode="bound"))
    lowered = jax.jit(f).trace(q, k, v, off, lengths).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    self.assertIn("certkv_offset_decode", text)

  @parameterized.parameters("tpu", "cuda")
  def test_split_values_lowers(self, platform):
    backend = "mosaic" if platform == "tpu" else "triton"
    s = jax.ShapeDtypeStruct
    args = (s((4, 4, 128), jnp.bfloat16), s((4, 4096, 128), jnp.bfloat16),
            s((4, 4096, 128), jnp.bfloat16), s((4, 4096), jnp.float32))
    for with_stats in (False, True):
      f = functools.partial(od.offset_decode_attention, with_stats=with_stats,
                            config=od.KernelConfig(backend=backend, range_mode="bound",
                                                   split_values=True))
      text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
      self.assertIn("certkv_offset_decode", text)

  @parameterized.parameters("tpu", "cuda")
  def test_chunk_lowers(self, platform):
    backend = "mosaic" if platform == "tpu" else "triton"
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
            ((2, 8, 4, 64), (2, 1024, 64), (2, 1024, 64), (2, 1024), (2, 8, 64), (2, 8, 64))]
    f = lambda q, k, v, off, kc, vc: od.offset_chunk_attention(
        q, k, v, off, od.ChunkKV(kc, vc),
        config=od.KernelConfig(backend=backend, range_mode="bound"))
    jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))


def _primitives(jaxpr):
  """Names of every primitive in ``jaxpr`` and the jaxprs it calls."""
  return {eqn.primitive.name for _, eqn in test_util.equations(jaxpr)}


class DefaultsTest(parameterized.TestCase):
  """The defaults a GPU gets: split counts and the "auto" implementation."""

  @parameterized.parameters((8192, 1), (8192, 3), (32768, 8), (32768, 64), (8320, 3),
                            (8208, 1), (300, 2), (100_000, 1))
  def test_split_count_covers_the_cores(self, n, rows):
    bs = od.BlockSizes.get_default(n, rows, "triton", cores=132)
    tiles = -(-n // bs.block_k)
    # At least MIN_TILES_PER_SPLIT tiles per split, unless the cache is that short.
    self.assertTrue(bs.num_splits == 1 or tiles // bs.num_splits >= od.MIN_TILES_PER_SPLIT)
    # Enough programs for every core, unless the tiles run out first (a divisor of
    # the tiles, chosen to avoid a padded copy, may give up to half of the target).
    target = min(-(-od.PROGRAMS_PER_CORE * 132 // rows), tiles // od.MIN_TILES_PER_SPLIT)
    self.assertGreaterEqual(2 * bs.num_splits, max(target, 1))
    if n % bs.block_k == 0 and 2 * bs.num_splits < 2 * target:
      self.assertEqual(tiles % bs.num_splits, 0)

  def test_more_cores_more_splits(self):
    small = od.BlockSizes.get_default(65536, 64, "triton", cores=16)
    large = od.BlockSizes.get_default(65536, 64, "triton", cores=132)
    self.assertEqual((small.block_k, small.num_splits, large.num_splits), (64, 2, 16))
    self.assertEqual(od.BlockSizes.get_default(65536, 1, "mosaic").num_splits, 1)

  def _attend_primitives(self, t):
    b, h, g, cap, d = 1, 2, 3, 256, 64
    cache = certkv_jax.kv.caches.init_caches(certkv_jax.kv.caches.CacheSpec(1, h, d), b, cap)
    cache = cache.layer(0)
    fn = lambda qg, cache: certified.attend(
        qg, cache, None, jnp.zeros((b, t), jnp.int32), certificate=True, with_probs=False)
    return _primitives(jax.make_jaxpr(fn)(jnp.ones((b, h, g, t, d)), cache).jaxpr)

  def test_auto_picks_the_kernel_for_decode_on_a_tpu_only(self):
    self.assertNotIn("pallas_call", self._attend_primitives(1))  # CPU: XLA
    with mock.patch.object(jax, "default_backend", return_value="tpu"):
      self.assertIn("pallas_call", self._attend_primitives(1))  # one query per row
      # A chunk's queries see different slots (causal): the keys would be copied per
      # query, so "auto" stays on XLA.
      self.assertNotIn("pallas_call", self._attend_primitives(4))
    # On a GPU the Triton kernel measured 50x slower than the XLA path (H200): XLA.
    with mock.patch.object(jax, "default_backend", return_value="gpu"):
      self.assertNotIn("pallas_call", self._attend_primitives(1))

  def test_auto_with_a_kernel_tiling_runs_the_xla_path_on_a_cpu(self):
    # A config written for a GPU: "auto" with the kernel's tiling. Before, on a CPU it
    # raised about block_sizes, an option meant for the kernel "auto" did not pick.
    q, k, v, off = _inputs(1, 4, 256, 64)
    args = (q[0], k[0], v[0], jnp.where(jnp.isfinite(off[0]), -off[0], 0.0),
            jnp.isfinite(off[0]))
    config = certkv_jax.attention.AttentionConfig
    got = certkv_jax.offset_attention(*args, config=config(
        implementation="auto", block_sizes=od.BlockSizes(block_k=128, num_splits=2)))
    want = certkv_jax.offset_attention(*args, config=config(implementation="xla"))
    np.testing.assert_array_equal(got.out, want.out)


class KernelErrorTest(absltest.TestCase):

  def test_bad_block_sizes(self):
    q, k, v, off = _inputs(1, 4, 256, 64)
    with self.assertRaisesRegex(ValueError, "power of two >= 16"):
      od.offset_decode_attention(q, k, v, off, config=od.KernelConfig(
          backend="triton", interpret=True, block_sizes=od.BlockSizes(24, 1)))
    with self.assertRaisesRegex(ValueError, "multiple of 128"):
      od.offset_decode_attention(q, k, v, off, config=od.KernelConfig(
          backend="mosaic", interpret=True, block_sizes=od.BlockSizes(64, 1)))
    with self.assertRaisesRegex(ValueError, "num_splits"):
      od.offset_decode_attention(q, k, v, off, config=od.KernelConfig(
          backend="triton", interpret=True, block_sizes=od.BlockSizes(32, 0)))

  def test_bad_shapes_and_backend(self):
    q, k, v, off = _inputs(2, 4, 256, 64)
    with self.assertRaisesRegex(ValueError, "offset must be"):
      od.offset_decode_attention(q, k, v, off[:, :10], config=od.KernelConfig(interpret=True))
    with self.assertRaisesRegex(ValueError, "lengths must be"):
      od.offset_decode_attention(q, k, v, off, jnp.zeros(3, jnp.int32),
                                 config=od.KernelConfig(interpret=True))
    for bad in (jnp.array([-5, 10]), jnp.array([10, 1000]), jnp.array([2.9, 32.0])):
      # before: clipped to [0, n] or truncated, silently
      with self.assertRaisesRegex(ValueError, "lengths must be"):
        od.offset_decode_attention(q, k, v, off, bad, config=od.KernelConfig(interpret=True))
    with self.assertRaisesRegex(ValueError, "backend"):
      od.offset_decode_attention(q, k, v, off,
                                 config=od.KernelConfig(backend="cuda", interpret=True))
    with self.assertRaisesRegex(ValueError, r"at least one slot \(n >= 1\)"):
      certkv_jax.offset_attention(q[0, 0], k[0, :0], v[0, :0], jnp.zeros(0), jnp.ones(0, bool))
    with self.assertRaisesRegex(ValueError, "implementation"):
      certkv_jax.offset_attention(
          q[0, 0], k[0], v[0], jnp.zeros(256), jnp.ones(256, bool),
          config=certkv_jax.attention.AttentionConfig(implementation="triton"))


if __name__ == "__main__":
  absltest.main()
