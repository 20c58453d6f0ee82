"""certkv_jax.designs.parts: budgets, the certainty set and the top-k tail, by hand."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax.designs import parts
from certkv_jax.designs import scores
from certkv_jax.kv import cache as cache_lib


def _cache(acc):
  c = cache_lib.init_cache(capacity=8, head_dim=2)
  c = cache_lib.append(c, jnp.ones((len(acc), 2)), jnp.ones((len(acc), 2)))
  return c._replace(acc=c.acc.at[:len(acc)].set(jnp.array(acc)))


class BudgetTest(absltest.TestCase):

  def test_targets(self):
    c = _cache([0.] * 8)  # 8 tokens seen
    self.assertEqual(int(parts.Budget(tokens=3).target(c)), 3)
    self.assertEqual(int(parts.Budget(fraction=0.3).target(c)), 2)  # floor(0.3 x 8)
    self.assertEqual(int(parts.Budget(fraction=0.25).target(c)), 2)
    self.assertEqual(parts.as_budget(5), parts.Budget(tokens=5))
    self.assertEqual(parts.as_budget(0.5), parts.Budget(fraction=0.5))

  def test_bad_budgets_say_how_to_write_them(self):
    with self.assertRaisesRegex(ValueError, "write budget=1.0"):
      parts.as_budget(1)
    with self.assertRaisesRegex(ValueError, "write the int 4"):
      parts.Budget(fraction=4.0)
    with self.assertRaisesRegex(TypeError, "budget must be"):
      parts.as_budget(True)


class CertaintySetTest(absltest.TestCase):

  def test_sinks_window_and_heavy(self):
    c = _cache([0.9, 0.1, 0.5, 0.05, 0.3, 0.2, 0.0, 0.4])  # positions 0..7
    np.testing.assert_array_equal(parts.CertaintySet(n_sink=2, window=2)(c),
                                  [1, 1, 0, 0, 0, 0, 1, 1])
    # one heavy hitter among 2..5: position 2 (acc 0.5).
    np.testing.assert_array_equal(parts.CertaintySet(n_sink=2, window=2, heavy=1)(c),
                                  [1, 1, 1, 0, 0, 0, 1, 1])
    self.assertEqual(parts.CertaintySet(n_sink=2, window=2, heavy=1).size, 5)

  def test_heavy_hitters_fill_their_count_when_scores_are_minus_inf(self):
    # log(acc) is -inf at positions 3 and 5: two heavy hitters among 2..5 are still two.
    log_acc = lambda cache: jnp.log(cache.acc)
    c = _cache([0.9, 0.1, 0.5, 0.0, 0.3, 0.0, 0.0, 0.4])
    got = parts.CertaintySet(n_sink=2, window=2, heavy=3, heavy_score=log_acc)(c)
    self.assertEqual(int(got.sum()), 2 + 2 + 3)


class TopKTest(absltest.TestCase):

  def test_keeps_the_highest_scores_of_the_tail(self):
    c = _cache([0.9, 0.1, 0.5, 0.05, 0.3, 0.2])
    tail = jnp.array([0, 1, 1, 1, 1, 0, 0, 0], bool)  # positions 1..4
    choice = parts.TopK(scores.AccumulatedAttention()).select(c, tail, jnp.int32(2),
                                                             jax.random.PRNGKey(0))
    np.testing.assert_array_equal(choice.keep, [0, 0, 1, 0, 1, 0, 0, 0])  # acc 0.5 and 0.3
    np.testing.assert_array_equal(np.asarray(choice.pi)[[2, 4]], [1.0, 1.0])

  def test_a_tail_score_of_minus_inf_or_nan_still_fills_every_slot(self):
    # A score such as log(acc) is -inf on tokens never attended: before, those tied with
    # the slots off the tail (also -inf), lost to them on index and were not kept, so
    # fewer than `slots` tokens stayed, with nothing recorded.
    class LogAcc:
      def __call__(self, cache):
        return jnp.log(cache.acc).at[3].set(jnp.nan)  # -inf where never attended

    c = _cache([0.9, 0.0, 0.5, 0.0, 0.0, 0.2])  # -inf at positions 1 and 4, NaN at 3
    tail = jnp.array([0, 1, 1, 1, 1, 1, 0, 0], bool)
    choice = parts.TopK(LogAcc()).select(c, tail, jnp.int32(4), jax.random.PRNGKey(0))
    self.assertEqual(int(choice.keep.sum()), 4)
    np.testing.assert_array_equal(np.asarray(choice.keep)[[2, 5]], [1, 1])  # the finite ones
    self.assertFalse(bool((choice.keep & ~tail).any()))


if __name__ == "__main__":
  absltest.main()
