"""Every product of the kernels and of the certificate's XLA path states its precision.

A float32 product left at the default precision is computed in TF32 on a GPU
(operands rounded to 10 mantissa bits: errors of 1e-4 to 1e-2 against
float32 references), which CPU tests cannot see numerically. These tests read
the traced programs instead: every ``dot_general``, inside the ``pallas_call``
and in the jnp path, must either take float32 operands at ``HIGHEST`` or take
bfloat16/float16 operands with float32 accumulation.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax._src import source_info_util  # the user frame of an equation

import certkv_jax
from certkv_jax.attention import certified
from certkv_jax.kv.cache import KVCache
from pallas_kernels import offset_decode as od
from tests import test_util

_HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
_LOW = (jnp.bfloat16, jnp.float16)


def products(jaxpr):
  """``(where, dot_general equation)`` for every product in ``jaxpr`` and the
  jaxprs it calls (pallas kernels, scans, conds, pjit)."""
  return [(w, e) for w, e in test_util.equations(jaxpr) if e.primitive.name == "dot_general"]


def imprecise(fn, *args):
  """The products of ``fn(*args)`` that state no precision that loses nothing."""
  bad, n = [], 0
  for where, eqn in products(jax.make_jaxpr(fn)(*args).jaxpr):
    n += 1
    dtypes = {v.aval.dtype for v in eqn.invars}
    prec = eqn.params["precision"]
    if dtypes == {jnp.dtype(jnp.float32)}:
      ok = prec == _HIGHEST or prec == jax.lax.DotAlgorithmPreset.F32_F32_F32
    elif len(dtypes) == 1 and dtypes.pop() in _LOW:
      ok = prec is not None and eqn.params["preferred_element_type"] == jnp.float32
    else:
      ok = False  # mixed operands: the product's arithmetic is whatever promotion gives
    if not ok:
      bad.append(f"{'/'.join(where)}: {[str(v.aval) for v in eqn.invars]} precision={prec} "
                 f"at {source_info_util.summarize(eqn.source_info)}")
  return bad, n


def _kernel_args(dtype, batch=2, groups=4, n=512, d=64):
  s = jax.ShapeDtypeStruct
  return (s((batch, groups, d), dtype), s((batch, n, d), dtype), s((batch, n, d), dtype),
          s((batch, n), jnp.float32))


class KernelPrecisionTest(parameterized.TestCase):

  @parameterized.product(backend=od.BACKENDS, dtype=(jnp.float32, jnp.bfloat16),
                         with_stats=(True, False), split_values=(False, True))
  def test_decode_kernel(self, backend, dtype, with_stats, split_values):
    bs = od.BlockSizes(128, 2)
    fn = functools.partial(od.offset_decode_attention, with_stats=with_stats,
                           config=od.KernelConfig(backend=backend, block_sizes=bs,
                                                  interpret=True, split_values=split_values))
    bad, n = imprecise(fn, *_kernel_args(dtype))
    in_kernel = [w for w, _ in products(jax.make_jaxpr(fn)(*_kernel_args(dtype)).jaxpr)
                 if "pallas_call" in w]
    self.assertGreaterEqual(len(in_kernel), 2)  # the walk reaches inside the kernel
    self.assertEqual(bad, [], f"{len(bad)} of {n} products")

  @parameterized.parameters(*od.BACKENDS)
  def test_chunk_kernel(self, backend):
    s = jax.ShapeDtypeStruct
    args = [s(x, jnp.float32) for x in
            ((2, 4, 2, 64), (2, 256, 64), (2, 256, 64), (2, 256), (2, 4, 64), (2, 4, 64))]
    fn = lambda q, k, v, off, kc, vc: od.offset_chunk_attention(
        q, k, v, off, od.ChunkKV(kc, vc), config=od.KernelConfig(
            backend=backend, block_sizes=od.BlockSizes(128, 1), interpret=True))
    bad, _ = imprecise(fn, *args)
    self.assertEqual(bad, [])

  def test_walker_catches_a_default_precision_product(self):
    fn = lambda a, b: jnp.maximum(a @ b, 0.0)
    bad, n = imprecise(fn, jnp.ones((4, 4)), jnp.ones((4, 4)))
    self.assertEqual((len(bad), n), (1, 1))


class XlaPathPrecisionTest(parameterized.TestCase):

  @parameterized.parameters(jnp.float32, jnp.bfloat16)
  def test_offset_attention_and_probs(self, dtype):
    q = jnp.ones((2, 3, 4, 64), dtype)
    k = jnp.ones((2, 3, 1, 40, 64), dtype)
    log_pi = jnp.zeros((2, 3, 1, 40))
    mask = jnp.ones((2, 3, 1, 40), bool)
    for config in (certkv_jax.AttentionConfig(),
                   certkv_jax.AttentionConfig(block_size=16),
                   certkv_jax.AttentionConfig(range_mode="bound")):
      fn = lambda q, k, lp, m: certkv_jax.offset_attention(q, k, k, lp, m, config=config)
      self.assertEqual(imprecise(fn, q, k, log_pi, mask)[0], [], config)
    fn = lambda q, k, lp, m: certkv_jax.attention_probs(q, k, lp, m)
    self.assertEqual(imprecise(fn, q, k, log_pi, mask)[0], [])

  def test_split_values_read_bfloat16_values_as_stored(self):
    # Every product over the values takes them in bfloat16 (no float32 copy: on a GPU
    # that copy is written and read again, 5x the values' bytes); without the option
    # they are converted first. n = 40 slots, dv = 48 (no other axis has either).
    q = jnp.ones((2, 3, 4, 64), jnp.bfloat16)
    k = jnp.ones((2, 3, 1, 40, 64), jnp.bfloat16)
    v = jnp.ones((2, 3, 1, 40, 48), jnp.bfloat16)
    log_pi, mask = jnp.zeros((2, 3, 1, 40)), jnp.ones((2, 3, 1, 40), bool)
    sq = certkv_jax.attention.offset.reference.StoredNorms(jnp.ones((2, 3, 1, 40)),
                                                           jnp.zeros((2, 3, 1, 48)))

    def value_products(split, range_mode):
      config = certkv_jax.AttentionConfig(implementation="xla", range_mode=range_mode,
                                          split_values=split)
      fn = lambda q, k, v: certkv_jax.offset_attention(q, k, v, log_pi, mask, config=config,
                                                       value_sqnorm=sq)
      return [{str(x.aval.dtype) for x in e.invars}
              for _, e in products(jax.make_jaxpr(fn)(q, k, v).jaxpr)
              if any(x.aval.shape[-2:] in ((40, 48), (48, 40)) for x in e.invars)]

    for range_mode in ("exact", "bound"):
      split = value_products(True, range_mode)
      self.assertNotEqual(split, [])
      self.assertTrue(all(d == {"bfloat16"} for d in split), (range_mode, split))
      self.assertIn({"float32"}, value_products(False, range_mode))
      self.assertEqual(imprecise(
          lambda q, k, v: certkv_jax.offset_attention(
              q, k, v, log_pi, mask, value_sqnorm=sq, config=certkv_jax.AttentionConfig(
                  implementation="xla", range_mode=range_mode, split_values=True)),
          q, k, v)[0], [])

  @parameterized.product(certificate=(True, False), evaluation=(True, False),
                         dtype=(jnp.float32, jnp.bfloat16))
  def test_layer_attention(self, certificate, evaluation, dtype):
    b, h, g, t, cap, d = 1, 2, 3, 1, 32, 64
    cache = certkv_jax.kv.caches.init_caches(certkv_jax.kv.caches.CacheSpec(1, h, d), b, cap, dtype)
    cache = cache.layer(0)
    cache = cache._replace(valid=cache.valid.at[:, :, :20].set(True),
                           pos=cache.pos.at[:, :, :20].set(jnp.arange(20)))
    shadow = cache if evaluation else None
    qg = jnp.ones((b, h, g, t, d), dtype)
    fn = lambda qg, cache, shadow: certified.attend(
        qg, cache, shadow, jnp.full((b, t), 20, jnp.int32), certificate=certificate,
        with_probs=True)
    self.assertIsInstance(cache, KVCache)
    bad, n = imprecise(fn, qg, cache, shadow)
    self.assertGreater(n, 0)
    self.assertEqual(bad, [])


class BfloatModelTest(parameterized.TestCase):
  """A bfloat16 model's decode step: what its products over the caches read."""

  @parameterized.product(loop=("scan", "unrolled"), design=(None, "snapkv"))
  def test_split_values_read_the_caches_as_stored(self, loop, design):
    # The model's queries are float32 and its caches bfloat16: without the option both
    # the keys and the values are copied to float32 for every product over them.
    from experiments.lib import design_defaults  # pylint: disable=import-outside-toplevel
    from models import forward, llama  # pylint: disable=import-outside-toplevel
    from models.config import LlamaConfig  # pylint: disable=import-outside-toplevel
    config = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=16, ffn_dim=48, dtype="bfloat16")
    cap = 37  # no other axis has this size
    params = jax.eval_shape(lambda: llama.init_params(config, jax.random.PRNGKey(0)))
    caches = jax.eval_shape(lambda: certkv_jax.kv.caches.init_caches(config, 1, cap,
                                                                     jnp.bfloat16))
    if loop == "unrolled":
      params = jax.eval_shape(lambda p: forward.unstack_layers(p, config), params)
      caches = jax.eval_shape(lambda c: c.unstack(), caches)
    design = None if design is None else design_defaults.make_design(design, 0.5)

    def operands(split):
      settings = certkv_jax.layer.Settings(
          design=design, observe=False, certificate=design is not None,
          attention=certkv_jax.AttentionConfig(split_values=split))
      fn = lambda p, c: forward.forward_chunk(p, config, jnp.zeros((1, 1), jnp.int32),
                                              jnp.ones((1, 1), bool), c, settings=settings,
                                              layer_loop=loop)
      return [{str(x.aval.dtype) for x in e.invars if cap in x.aval.shape}
              for _, e in products(jax.make_jaxpr(fn)(params, caches).jaxpr)
              if any(cap in x.aval.shape and x.aval.ndim >= 3 and x.aval.shape[-1] == 16
                     for x in e.invars)]

    split = operands(True)
    self.assertNotEqual(split, [])
    self.assertTrue(all(d == {"bfloat16"} for d in split), split)
    self.assertTrue(all(d == {"float32"} for d in operands(False)))


class ModelPrecisionTest(parameterized.TestCase):
  """The model around the attention, the designs' scores and the allocations: no float32
  product at the default precision (TF32 on a GPU), in float32 and in bfloat16 models."""

  @parameterized.product(dtype=("float32", "bfloat16"), loop=("scan", "unrolled"))
  def test_forward_and_a_decode_step_with_keydiff_and_the_certificate(self, dtype, loop):
    from experiments.lib import design_defaults  # pylint: disable=import-outside-toplevel
    from models import forward, llama  # pylint: disable=import-outside-toplevel
    from models.config import LlamaConfig  # pylint: disable=import-outside-toplevel
    config = LlamaConfig(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=16, ffn_dim=48, dtype=dtype)
    params = jax.eval_shape(lambda: llama.init_params(config, jax.random.PRNGKey(0)))
    tokens = jnp.zeros((1, 5), jnp.int32)
    bad, n = imprecise(lambda p: llama.LlamaModel(config).apply(p, tokens), params)
    self.assertGreater(n, 0)
    self.assertEqual(bad, [])
    caches = jax.eval_shape(lambda: certkv_jax.kv.caches.init_caches(
        config, 1, 9, jnp.dtype(dtype)))
    if loop == "unrolled":
      params = jax.eval_shape(lambda p: forward.unstack_layers(p, config), params)
      caches = jax.eval_shape(lambda c: c.unstack(), caches)
    design = design_defaults.make_design("keydiff", 0.5, n_sink=1, window=2)
    settings = certkv_jax.layer.Settings(design=design, observe=False, certificate=True)
    step = lambda p, c: forward.forward_chunk(p, config, jnp.zeros((1, 1), jnp.int32),
                                              jnp.ones((1, 1), bool), c, settings=settings,
                                              layer_loop=loop)
    bad, n = imprecise(step, params, caches)
    self.assertGreater(n, 0)
    self.assertEqual(bad, [])
    evict = lambda c: certkv_jax.eviction.evict(design, c, jax.random.PRNGKey(0)).caches
    self.assertEqual(imprecise(evict, caches)[0], [])  # the KeyDiff score

  def test_certificate_targeted_allocation(self):
    from certkv_jax.designs import allocation  # pylint: disable=import-outside-toplevel
    from experiments.lib import design_defaults  # pylint: disable=import-outside-toplevel
    spec = certkv_jax.kv.caches.CacheSpec(n_layers=2, n_kv_heads=2, head_dim=8)
    caches = jax.eval_shape(lambda: certkv_jax.kv.caches.init_caches(spec, 1, 16))
    design = design_defaults.make_design("snapkv_cert", 0.5, n_sink=1, window=2)
    gains = jnp.ones((2, 2), jnp.float32)
    evict = lambda c: certkv_jax.eviction.evict(
        design, c, jax.random.PRNGKey(0), allocation=allocation.CertificateTargeted(),
        gains=gains).caches
    bad, n = imprecise(evict, caches)
    self.assertGreater(n, 0)
    self.assertEqual(bad, [])


  def test_damage_predictor(self):
    from certkv_jax.calibration import damage_predictor  # pylint: disable=import-outside-toplevel
    params = {"w_hidden": jnp.ones((3, 4)), "b_hidden": jnp.ones(4),
              "w_out": jnp.ones(4), "b_out": jnp.ones(())}
    bad, n = imprecise(lambda p, z: damage_predictor._forward(p, z, "tanh"), params,
                       jnp.ones((5, 3)))
    self.assertEqual((bad, n), ([], 2))


class SplitRoundingTest(absltest.TestCase):
  """The bfloat16 split of a float32 row keeps its low part where XLA may fold a
  float32 -> bfloat16 -> float32 round trip of converts (GPU, excess precision)."""

  def test_bf16_rounded_is_the_round_trip_for_finite_values(self):
    from pallas_kernels import precision  # pylint: disable=import-outside-toplevel
    x = jax.random.normal(jax.random.PRNGKey(0), (4096,)) * jnp.logspace(-40, 38, 4096)
    ties = jnp.asarray([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, 3.3e38, 0.0, -0.0])
    for a in (x, ties, jnp.asarray([jnp.inf, -jnp.inf])):
      want = a.astype(jnp.bfloat16).astype(jnp.float32)
      got = precision.bf16_rounded(a)
      self.assertTrue(bool(jnp.all(jax.lax.bitcast_convert_type(got, jnp.uint32)
                                   == jax.lax.bitcast_convert_type(want, jnp.uint32))))

  def test_no_convert_round_trip_in_the_split_products_or_the_stored_values(self):
    from certkv_jax.kv import cache as cache_lib  # pylint: disable=import-outside-toplevel
    from pallas_kernels import reference  # pylint: disable=import-outside-toplevel
    a = jax.ShapeDtypeStruct((3, 5), jnp.float32)
    v = jax.ShapeDtypeStruct((5, 4), jnp.bfloat16)
    bf16_cache = cache_lib.init_cache(8, 4, dtype=jnp.bfloat16)
    for fn in (lambda a, v: reference.split_matmul(a, v),
               lambda a, v: reference.split_matmul(a, v, stacked=False),
               lambda a, v: reference.split_rows(v, a[:, :4]),
               lambda a, v: cache_lib.slot_kv(bf16_cache, a[:, :4], a[:, :4], True)):
      eqns = [e for _, e in test_util.equations(jax.make_jaxpr(fn)(a, v).jaxpr)]
      made_bf16 = {id(o) for e in eqns if e.primitive.name == "convert_element_type"
                   and e.params["new_dtype"] == jnp.bfloat16 for o in e.outvars}
      back = [e for e in eqns if e.primitive.name == "convert_element_type"
              and e.params["new_dtype"] == jnp.float32
              and any(id(i) in made_bf16 for i in e.invars)]
      self.assertEqual(back, [])


if __name__ == "__main__":
  absltest.main()
