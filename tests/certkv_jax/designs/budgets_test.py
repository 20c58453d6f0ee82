"""certkv_jax.designs.budgets: schedules and fractions resolved into targets, by hand."""

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

from certkv_jax.designs import budgets


class TargetsTest(absltest.TestCase):

  def test_fraction_targets_floor_with_a_rounding_guard(self):
    # 0.3 x 10 is 2.9999999 in float32: the guard makes it 3.
    np.testing.assert_array_equal(budgets.fraction_targets(0.3, jnp.array([10, 7, 1])),
                                  [3, 2, 0])

  def test_layer_targets(self):
    n_seen = jnp.full((2, 1, 1), 20)  # [layers, batch, kv heads]
    np.testing.assert_array_equal(budgets.layer_targets((4, 6), n_seen)[:, 0, 0], [4, 6])
    np.testing.assert_array_equal(budgets.layer_targets((0.25, 0.5), n_seen)[:, 0, 0], [5, 10])

  def test_eviction_targets_take_one_of_the_two(self):
    n_seen = jnp.full((2, 3, 1), 8)
    self.assertIsNone(budgets.eviction_targets(n_seen))
    got = budgets.eviction_targets(n_seen, budget=jnp.array([0.5, 0.25, 1.0]))
    np.testing.assert_array_equal(got[0, :, 0], [4, 2, 8])  # one fraction per batch row
    with self.assertRaisesRegex(ValueError, "either layer_budgets or budget"):
      budgets.eviction_targets(n_seen, layer_budgets=(4, 4), budget=0.5)

  def test_pyramid_budgets_average_to_the_mean(self):
    got = budgets.pyramid_budgets(4, 100)
    self.assertLen(got, 4)
    self.assertGreater(got[0], got[-1])  # wide at the bottom, narrow at the top
    self.assertAlmostEqual(sum(got) / 4, 100, delta=1)
    # A small token mean floors the last layers at 2, not 1, which the schedule check
    # refuses as ambiguous (before: (19, 13, 6, 1), refused by every eviction).
    small = budgets.pyramid_budgets(4, 10)
    self.assertEqual(small, (19, 13, 6, 2))
    self.assertEqual(budgets.check_layer_budgets(small, 4), small)
    with self.assertRaisesRegex(ValueError, "mean token budget must be >= 2"):
      budgets.pyramid_budgets(4, 1)


if __name__ == "__main__":
  absltest.main()
