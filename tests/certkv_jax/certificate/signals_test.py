"""Online warning signals from the kept set (certkv_jax.certificate.signals).

All comparisons are deterministic (seeded inputs, no Monte Carlo): the
tolerances only absorb float32 rounding of sums over <= 32 slots (relative
error ~ n * 6e-8 ~ 2e-6; we use rtol 2e-5, and 1e-4 where the variance is an
expanded square that cancels).
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import numpy as np

import certkv_jax
from certkv_jax.certificate import signals


N, D, DV = 24, 8, 6  # one shape everywhere: each new shape is an XLA compile


def _inputs(seed, lead=()):
  """Random kept set (numpy, float32): q, k, v, log_pi, mask.

  60% of the slots in the tail, 80% valid (slot 0 always), values with a
  common offset of 3 like channel means.
  """
  rng = np.random.default_rng(seed)
  q = rng.normal(size=lead + (D,))
  k = 2.0 * rng.normal(size=lead + (N, D))
  v = rng.normal(size=lead + (N, DV)) + 3.0
  log_pi = np.where(rng.uniform(size=lead + (N,)) < 0.6, -rng.exponential(size=lead + (N,)), 0.0)
  mask = rng.uniform(size=lead + (N,)) < 0.8
  mask[..., 0] = True
  return tuple(x.astype(np.float32) for x in (q, k, v, log_pi)) + (mask,)


def _call(seed, lead=()):
  """p, pi, mask, v, o_hat of a random call, computed directly in float64."""
  q, k, v, log_pi, mask = _inputs(seed, lead)
  logits = np.einsum("...d,...nd->...n", q.astype(np.float64), k) / math.sqrt(D) - log_pi
  logits = np.where(mask, logits, -np.inf)
  e = np.exp(logits - logits.max(axis=-1, keepdims=True))
  p = e / e.sum(axis=-1, keepdims=True)
  o_hat = np.einsum("...n,...nd->...d", p, v)
  return (p.astype(np.float32), np.exp(log_pi), mask, v, o_hat.astype(np.float32))


@jax.jit
def _attend(q, k, v, log_pi, mask):
  """(p, offset_attention result) of the library (compiled: eager dispatch is slow)."""
  return (certkv_jax.attention_probs(q, k, log_pi, mask),
          certkv_jax.offset_attention(q, k, v, log_pi, mask))


def _numpy_signals(p, pi, mask, v, o_hat):
  """Direct float64 computation of every signal of one call."""
  p, pi, v, o = (np.asarray(x, np.float64) for x in (p, pi, v, o_hat))
  mask = np.asarray(mask)
  p = np.where(mask, p, 0.0)
  tail = mask & (pi < 1)
  w = np.where(mask, 1 - pi, 0.0)
  dev = np.linalg.norm(v - o, axis=-1)
  var = np.sum(w * p ** 2 * dev ** 2)
  rng = np.max(np.where(tail, w * p * dev, 0.0), initial=0.0)
  pos = p > 0
  return dict(
      ess=1 / np.sum(p ** 2),
      max_tail_weight=np.max(np.where(tail, w * p, 0.0), initial=0.0),
      range_ratio=rng / math.sqrt(var) if var > 0 else 0.0,
      entropy=-np.sum(p[pos] * np.log(p[pos])),
      r_hat=tail.sum() * np.max(np.where(tail, p, 0.0), initial=0.0),
      tail_mass=np.sum(np.where(tail, p, 0.0)),
      var_hat=var,
      range_hat=rng,
  )


class SignalsTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2, 3)
  def test_matches_numpy(self, seed):
    p, pi, mask, v, o_hat = _call(seed)
    got = signals.signals(p, pi, mask, v, o_hat)
    want = _numpy_signals(p, pi, mask, v, o_hat)
    for name, value in want.items():
      rtol = 1e-4 if name in ("var_hat", "range_ratio") else 2e-5
      np.testing.assert_allclose(float(getattr(got, name)), value, rtol=rtol, atol=1e-7,
                                 err_msg=name)

  @parameterized.parameters(0, 1, 2)
  def test_consistent_with_offset_attention(self, seed):
    q, k, v, log_pi, mask = _inputs(seed, lead=(2, 3))
    p, res = _attend(q, k, v, log_pi, mask)
    sig = signals.signals_batched(p, np.exp(log_pi), mask, v, res.out)
    # Same formula (pallas_kernels.reference) on the same inputs: the only
    # difference is 1 - pi here versus the kernel's tanh form of 1 - exp(log_pi).
    np.testing.assert_allclose(sig.var_hat, res.var_hat, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(sig.range_hat, res.range_hat, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(sig.range_ratio, np.asarray(res.range_hat) / np.sqrt(res.var_hat),
                               rtol=1e-4)
    self.assertTrue(np.all(np.asarray(sig.range_ratio) <= 1.0 + 1e-5))
    self.assertTrue(np.all(np.asarray(sig.max_tail_weight) >= 0))

  def test_uniform_weights(self):
    valid = 7
    mask = np.arange(N) < valid
    p = np.where(mask, 1.0 / valid, 0.0).astype(np.float32)
    pi = np.where(np.arange(N) < 3, 1.0, 0.5).astype(np.float32)  # kept tail: slots 3..6
    v = np.arange(N * DV, dtype=np.float32).reshape(N, DV)
    o_hat = p @ v
    sig = signals.signals(p, pi, mask, v, o_hat)
    self.assertAlmostEqual(float(sig.ess), valid, places=4)
    self.assertAlmostEqual(float(sig.entropy), math.log(valid), places=5)
    self.assertAlmostEqual(float(sig.tail_mass), 4 / valid, places=6)
    self.assertAlmostEqual(float(sig.r_hat), 4 * (1 / valid), places=6)  # m_hat = 4 kept tail
    self.assertAlmostEqual(float(sig.max_tail_weight), 0.5 / valid, places=6)

  def test_r_hat_by_hand(self):
    # Four valid slots (the rest invalid, with pi < 1 there: ignored).
    p = np.zeros(N, np.float32)
    p[:4] = [0.5, 0.3, 0.15, 0.05]
    pi = np.full(N, 0.1, np.float32)
    pi[:4] = [1.0, 0.2, 0.9, 0.5]
    mask = np.arange(N) < 4
    v = np.random.default_rng(0).normal(size=(N, DV)).astype(np.float32)
    sig = signals.signals(p, pi, mask, v, p @ v)
    self.assertAlmostEqual(float(sig.r_hat), 3 * 0.3, places=6)  # 3 kept tail slots
    self.assertAlmostEqual(float(sig.tail_mass), 0.5, places=6)
    self.assertAlmostEqual(float(sig.max_tail_weight), 0.8 * 0.3, places=6)

  def test_no_tail(self):
    p, _, mask, v, o_hat = _call(4)
    sig = signals.signals(p, np.ones_like(p), mask, v, o_hat)
    for name in ("max_tail_weight", "range_ratio", "r_hat", "tail_mass", "var_hat",
                 "range_hat"):
      self.assertEqual(float(getattr(sig, name)), 0.0, name)
    self.assertGreater(float(sig.ess), 1.0)

  def test_empty_call_is_defined(self):
    sig = signals.signals(np.zeros(N, np.float32), np.ones(N, np.float32), np.zeros(N, bool),
                          np.ones((N, DV), np.float32), np.zeros(DV, np.float32))
    for name, value in sig._asdict().items():
      self.assertEqual(float(value), 0.0, name)

  def test_batched_shapes_jit_and_per_call_equality(self):
    p, pi, mask, v, o_hat = _call(5, lead=(2, 3))
    sig = jax.jit(signals.signals_batched)(p, pi, mask, v, o_hat)
    chex.assert_shape(list(sig), (2, 3))
    sig = jax.tree_util.tree_map(np.asarray, sig)
    p, pi, mask, v, o_hat = (np.asarray(x) for x in (p, pi, mask, v, o_hat))
    for i in range(2):
      for j in range(3):
        one = signals.signals(p[i, j], pi[i, j], mask[i, j], v[i, j], o_hat[i, j])
        chex.assert_trees_all_close(jax.tree_util.tree_map(lambda x: x[i, j], sig), one,
                                    rtol=1e-5, atol=1e-7)

  def test_batched_broadcasts_shared_values(self):
    # A GQA group: 4 query rows share the values of one KV head.
    p, pi, mask, v, o_hat = _call(6)
    p4 = np.stack([p] * 4)
    sig = signals.signals_batched(p4, pi, mask, v, np.stack([o_hat] * 4))
    chex.assert_shape(list(sig), (4,))
    np.testing.assert_allclose(sig.var_hat, signals.signals(p, pi, mask, v, o_hat).var_hat,
                               rtol=1e-6)

  def test_bad_inputs_name_the_argument(self):
    p, pi, mask, v, o_hat = _call(7)
    ok = dict(p=p, pi=pi, mask=mask, v=v, o_hat=o_hat)
    cases = [
        (dict(mask=mask.astype(np.float32)), "mask must be bool"),
        (dict(pi=np.where(mask, 0.0, pi)), r"pi must be in \(0, 1\]"),
        (dict(pi=pi + 0.5), r"pi must be in \(0, 1\]"),
        (dict(p=-p), r"p must be in \[0, 1\]"),
        (dict(v=v[:-1]), "v must have n="),
        (dict(o_hat=o_hat[:-1]), "o_hat must have dv="),
        (dict(pi=pi[:-1]), "pi must have n="),
        (dict(p=p[None]), "p must have exactly 1 dims"),
        (dict(v=v.astype(np.int32)), "v must be a floating dtype"),
    ]
    for change, pattern in cases:
      with self.subTest(pattern=pattern), self.assertRaisesRegex(ValueError, pattern):
        signals.signals(**{**ok, **change})
    with self.assertRaisesRegex(ValueError, "leading dims must broadcast"):
      signals.signals_batched(np.stack([p] * 2), np.stack([pi] * 3), mask, v, o_hat)


if __name__ == "__main__":
  absltest.main()
