"""The synthetic training script: the loss falls, and kill-and-resume is exact."""

import os

from absl import flags
from absl.testing import absltest
import jax
import numpy as np
import pytest

from experiments.lib import results_io
from experiments.lib.train_synthetic import experiment as train_synthetic

# One learning-rate schedule: one compile for all tests.
SMALL = train_synthetic.Settings(batch=16, n_pairs=4, n_keys=16, n_values=16, layers=2,
                                 hidden=32, heads=4, kv_heads=2, lr=1e-2, checkpoint_every=5,
                                 log_every=1, seed=3, schedule_steps=40)


class TrainSyntheticTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if not flags.FLAGS.is_parsed():  # under pytest (create_tempdir reads --test_tmpdir)
      flags.FLAGS.mark_as_parsed()

  def test_batch(self):
    tokens, answer = train_synthetic.make_batch(jax.random.PRNGKey(0), 8, 4, 16, 16)
    tokens, answer = np.asarray(tokens), np.asarray(answer)
    self.assertEqual(tokens.shape, (8, 10))
    for row, a in zip(tokens, answer):
      keys, values = row[0:8:2], row[1:8:2]
      self.assertLen(set(keys), 4)
      self.assertEqual(row[8], train_synthetic.QUERY)
      self.assertEqual(a, values[list(keys).index(row[9])])

  def test_loss_decreases(self):
    out = self.create_tempdir().full_path
    train_synthetic.train(out, 40, SMALL)
    rows = results_io.read_rows(os.path.join(out, "loss.jsonl"))
    self.assertEqual([r["step"] for r in rows], list(range(1, 41)))
    first = np.mean([r["loss"] for r in rows[:5]])
    last = np.mean([r["loss"] for r in rows[-5:]])
    self.assertLess(last, first - 0.2, (first, last))

  @pytest.mark.slow  # 35 s cold on the 2-core CI machine (2026-12-01)
  def test_kill_and_resume_equals_one_run(self):
    n = 6
    one = train_synthetic.train(self.create_tempdir().full_path, 2 * n, SMALL)
    out = self.create_tempdir().full_path
    half = train_synthetic.train(out, 2 * n, SMALL, stop_after=n)  # "killed" after n steps
    self.assertEqual(int(half["step"]), n)
    resumed = train_synthetic.train(out, 2 * n, SMALL)  # restores step n, runs n more
    self.assertEqual(int(resumed["step"]), 2 * n)
    rows = results_io.read_rows(os.path.join(out, "loss.jsonl"))
    self.assertEqual([r["step"] for r in rows], list(range(1, 2 * n + 1)))  # none lost/repeated
    for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(resumed)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


if __name__ == "__main__":
  absltest.main()
