"""certkv_jax.kv.memory: bytes per kept token, worked by hand at head_dim 64, float32."""

from absl.testing import absltest
import jax.numpy as jnp

from certkv_jax import designs
from certkv_jax.designs import registry
from certkv_jax.kv import memory


class MemoryTest(absltest.TestCase):

  def test_slot_bytes(self):
    self.assertEqual(memory.slot_bytes(None, 64), 512)  # (64 + 64) x 4, no metadata
    # H2O reads acc: pos 4 + valid 1 + acc 4.
    self.assertEqual(memory.slot_bytes(designs.h2o(0.5), 64), 512 + 9)
    # A randomized design adds log_pi and v_sq (8 bytes) to what its score reads.
    self.assertEqual(memory.slot_bytes(designs.poisson_tail(0.5), 64), 512 + 5 + 4 + 8)
    self.assertEqual(memory.slot_bytes(None, 64, dtype=jnp.bfloat16), 256)
    # A certificate-targeted allocation reads the window's obs and v_sq: H2O with it pays
    # 4 + 4 more, a randomized design only the obs (its v_sq is counted already).
    cert = registry.ALLOCATIONS["cert"]
    self.assertEqual(memory.slot_bytes(designs.h2o(0.5), 64, allocation=cert), 512 + 9 + 8)
    self.assertEqual(memory.slot_bytes(designs.poisson_tail(0.5), 64, allocation=cert),
                     512 + 5 + 4 + 8 + 4)

  def test_token_fraction_and_kept_bytes(self):
    # 25% of the full cache's bytes, at 521 bytes a token: 0.25 x 512 / 521 of the tokens.
    self.assertAlmostEqual(memory.token_fraction(0.25, designs.h2o(0.5), 64), 128 / 521)
    self.assertEqual(float(memory.kept_bytes(10, designs.h2o(0.5), 64)), 5210.0)

  def test_bad_memory_names_the_argument(self):
    for bad in (0, 1.5, True):
      with self.assertRaisesRegex(ValueError, "memory must be a fraction in"):
        memory.token_fraction(bad, None, 64)


if __name__ == "__main__":
  absltest.main()
