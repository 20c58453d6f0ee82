"""No large array computed from no input in the decode step or the prefill (issue 42).

XLA evaluates at compile time every operation whose operands are all
constants. Caches made inside a jitted prefill have a constant ``valid`` mask,
and the free-slot ranks computed from it, a cumulative sum over every slot of
every layer (``s32[30, 1, 3, 8336]`` at SmolLM2's shape and an 8k context),
took XLA minutes on a GPU and 20 s here to fold. ``experiments.lib.bench.constants``
finds such arrays from the jaxpr, without compiling; these tests hold the
benchmark's decode steps (``experiments.lib.bench.decode._step_fn``), its
prefill and ``models.decode.generate`` to none above 64 KiB at SmolLM2's
layer and head counts (30 layers, 9 query heads, 3 KV heads, head_dim 64; a
tiny hidden size, which the check does not depend on) and an 8,192-token
capacity, and check that the checker finds what it should. Nothing is
compiled: each case is a trace of a few seconds.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import pytest

from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from experiments.lib import design_defaults
from experiments.lib.bench import constants
from experiments.lib.bench import decode as bench_decode
from models import decode
from models import forward
from models import llama
from models.config import LlamaConfig

# SmolLM2-135M's layer and head counts; the hidden, MLP and vocabulary sizes are tiny.
CONFIG = LlamaConfig(vocab_size=256, hidden=64, n_layers=30, n_heads=9, n_kv_heads=3,
                     head_dim=64, ffn_dim=128)
CAPACITY = 8192 + 16  # an 8k context and one amortized period's slack
STEPS = 16
BUDGET = 0.125


def _abstract(tree):
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _step_args(layer_loop: str, batch: int = 1):
  """Abstract ``(params, carry, budget)`` of ``_step_fn``'s call."""
  params = jax.eval_shape(lambda: llama.init_params(CONFIG, jax.random.PRNGKey(0)))
  caches = jax.eval_shape(lambda: caches_lib.init_caches(CONFIG, batch, CAPACITY))
  if layer_loop == "unrolled":
    params = jax.eval_shape(lambda p: forward.unstack_layers(p, CONFIG), params)
    caches = jax.eval_shape(lambda c: c.unstack(), caches)
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  carry = (caches, jax.ShapeDtypeStruct((batch, CONFIG.vocab_size), jnp.float32), key)
  return params, carry, jax.ShapeDtypeStruct((), jnp.float32)


def _design(name):
  return design_defaults.make_design(name, 0.5)  # the budget is replaced by the traced one


def _assert_none(test, found):
  if found:
    test.fail(f"arrays over 64 KiB computed from no input:\n{constants.describe(found)}")


class ConstantArraysTest(absltest.TestCase):
  """What the checker reports (sizes well above and below its 64 KiB limit)."""

  def test_finds_a_cumsum_of_constants_with_its_shape_and_line(self):
    f = jax.jit(lambda x: x + jnp.cumsum(jnp.ones((30, 3, 8192, 16), jnp.int32), axis=2)
                [0, 0, :, 0])
    (found,) = constants.constant_arrays(f, jnp.zeros((8192,), jnp.int32))
    self.assertEqual((found.shape, found.dtype, found.primitive),
                     ((30, 3, 8192, 16), "int32", "cumsum"))
    self.assertEqual(found.nbytes, 30 * 3 * 8192 * 16 * 4)
    self.assertIn("decode_constants_test.py", found.source)

  def test_iota_against_an_input_and_small_arrays_pass(self):
    f = jax.jit(lambda n: jnp.sum(jnp.arange(1 << 16) < n) + jnp.cumsum(jnp.ones(1000)).sum())
    self.assertEqual(constants.constant_arrays(f, jnp.int32(5)), [])
    self.assertLen(constants.constant_arrays(f, jnp.int32(5), min_bytes=1000), 1)

  def test_closed_over_literal(self):
    table = jnp.arange(1 << 15, dtype=jnp.float32) * 2.0  # concrete: a literal in the jaxpr
    (found,) = constants.constant_arrays(jax.jit(lambda x: x + table), table)
    self.assertEqual((found.primitive, found.shape), ("literal", (1 << 15,)))

  def test_scan_carry_constant_only_while_the_body_keeps_it(self):
    big = (1 << 15,)

    def kept(x):  # the carry never meets x: constant at every step
      out, _ = jax.lax.scan(lambda c, _: (jnp.cumsum(c), None), jnp.ones(big), None, length=3)
      return out + x

    def mixed(x):  # the carry meets x after the first step: only that step is constant
      out, _ = jax.lax.scan(lambda c, _: (jnp.cumsum(c) + x, None), jnp.ones(big), None,
                            length=3)
      return out

    self.assertLen(constants.constant_arrays(jax.jit(kept), jnp.ones(big)), 1)
    (first,) = constants.constant_arrays(jax.jit(mixed), jnp.ones(big))
    self.assertEqual(first.primitive, "cumsum")  # the first iteration, as when unrolled

  def test_while_trip_count_from_an_input_is_live(self):
    big = (1 << 15,)
    f = jax.jit(lambda n: jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2),
                                             (0, jnp.ones(big)))[1])
    found = constants.constant_arrays(f, jnp.int32(3))
    self.assertEqual([o.primitive for o in found], ["mul"])  # the first iteration only

  def test_bad_arguments_name_them(self):
    with self.assertRaisesRegex(ValueError, "min_bytes"):
      constants.constant_arrays(jax.jit(lambda x: x), 1.0, min_bytes=-1)
    with self.assertRaisesRegex(TypeError, "fn must be"):
      constants.constant_arrays(3)


def _check_step(test, name, every, layer_loop):
  design = None if name == "full" else _design(name)
  step = bench_decode._step_fn(CONFIG, design, design is not None, every, STEPS, layer_loop)
  _assert_none(test, constants.constant_arrays(step, *_step_args(layer_loop)))


class DecodeStepTest(parameterized.TestCase):
  """The benchmark's decode step at SmolLM2's shape: no constant array over 64 KiB."""

  @parameterized.product(name=("full", "poisson_tail", "snapkv"), every=(16,),
                         layer_loop=("unrolled", "scan"))
  def test_no_large_constant(self, name, every, layer_loop):
    _check_step(self, name, every, layer_loop)

  def test_an_injected_constant_is_caught(self):
    # The test above can fail: an eviction that adds a cumulative sum over a constant
    # [30, 3, 8192, 16] array (a schedule built from shapes alone) is reported.
    real = eviction.evict

    def evict(design, caches, key, **kw):
      waste = jnp.cumsum(jnp.ones((30, 3, 8192, 16), jnp.int32), axis=2).sum()
      new = real(design, caches, key, **kw)
      return new._replace(state=new.state._replace(rounds=new.state.rounds + 0 * waste))

    with mock.patch.object(eviction, "evict", evict):
      step = bench_decode._step_fn(CONFIG, _design("poisson_tail"), True, 16, STEPS,
                                   "unrolled")
      found = constants.constant_arrays(step, *_step_args("unrolled"))
    self.assertEqual([(o.primitive, o.shape) for o in found],
                     [("cumsum", (30, 3, 8192, 16))])


class OtherDesignsTest(parameterized.TestCase):
  """The other designs' decode steps, evicting every step and every 16th."""

  pytestmark = pytest.mark.slow  # about 20 s for the 8 traces

  @parameterized.product(name=("h2o", "tova", "keydiff", "priority_focus"), every=(1, 16))
  def test_no_large_constant(self, name, every):
    _check_step(self, name, every, "unrolled")


class PrefillTest(parameterized.TestCase):
  """Prefills into caches made inside the jitted function: their constant ``valid``
  mask must not make the slot assignment constant (``cache.slot_assignment``)."""

  @parameterized.parameters("full", "poisson_tail")
  def test_bench_prefill(self, name):
    design = None if name == "full" else _design(name)
    prefill = bench_decode._prefill_fn(CONFIG, design, CAPACITY + 128)
    params = jax.eval_shape(lambda: llama.init_params(CONFIG, jax.random.PRNGKey(0)))
    tokens = jax.ShapeDtypeStruct((1, 8192), jnp.int32)
    _assert_none(self, constants.constant_arrays(prefill, params, tokens,
                                                 jax.ShapeDtypeStruct((1, 8192), bool)))

  @parameterized.parameters("scan", "unrolled")
  def test_generate(self, layer_loop):
    gen = decode.GenerationConfig(n_steps=STEPS, design=_design("snapkv"), capacity=CAPACITY,
                                  evict_each_step=True, evict_every=STEPS,
                                  layer_loop=layer_loop)
    params = jax.eval_shape(lambda: llama.init_params(CONFIG, jax.random.PRNGKey(0)))
    found = constants.constant_arrays(
        decode.generate, params, jax.ShapeDtypeStruct((1, 8192), jnp.int32),
        jax.ShapeDtypeStruct((1, 8192), bool), jax.eval_shape(lambda: jax.random.PRNGKey(0)),
        config=CONFIG, gen=gen)
    _assert_none(self, found)


if __name__ == "__main__":
  absltest.main()
