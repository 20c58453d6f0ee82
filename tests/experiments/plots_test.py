"""experiments.lib.plots: every figure is written as a valid PNG, atomically."""

import os

from absl import flags
from absl.testing import absltest
import numpy as np

from experiments.lib import plots
from experiments.lib import stats

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def setUpModule():
  if not flags.FLAGS.is_parsed():  # under pytest (create_tempdir reads --test_tmpdir)
    flags.FLAGS.mark_as_parsed()


class PlotsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = self.create_tempdir().full_path

  def _check(self, path):
    with open(path, "rb") as f:
      head = f.read(8)
    self.assertEqual(head, PNG_SIGNATURE)
    self.assertGreater(os.path.getsize(path), 1000)

  def test_all_figures(self):
    rng = np.random.default_rng(0)
    err = np.abs(rng.normal(0, 1, 300))
    radius = np.abs(rng.normal(0, 2, 300)) + 1e-3
    y = rng.random(300) < 0.3
    score = y + rng.normal(0, 1, 300)
    gain = rng.integers(-1, 2, 300).astype(float)
    budgets = np.linspace(0, 1, 6)
    roc = stats.roc_curve(score, y)
    paths = [
        plots.plot_coverage([0.5, 0.8, 0.95], {"poisson": [0.52, 0.79, 0.9], "h2o": [0, 0, 0]},
                            os.path.join(self.dir, "coverage.png"),
                            intervals={"poisson": ([0.5, 0.77, 0.88], [0.54, 0.81, 0.92])}),
        plots.plot_error_vs_radius(err, radius, os.path.join(self.dir, "err.png")),
        plots.plot_r_audit(np.exp(rng.normal(1, 1, 300)), err <= radius,
                           os.path.join(self.dir, "sub", "r.png")),
        plots.plot_roc({"certificate": (roc.fpr, roc.tpr, stats.roc_auc(score, y)),
                        "logprob": roc}, os.path.join(self.dir, "roc.png")),
        plots.plot_gating({k: (budgets, stats.gating_curve(gain, k, budgets))
                           for k in ("oracle", "random")}, os.path.join(self.dir, "gate.png")),
        plots.plot_overhead({"full": 10.0, "snapkv": 8.0, "poisson+cert": 19.5},
                            os.path.join(self.dir, "overhead.png"), errors={"full": 0.5}),
    ]
    for p in paths:
      self._check(p)
    # only the figures, no temporary files left behind
    self.assertCountEqual(os.listdir(self.dir), ["coverage.png", "err.png", "sub", "roc.png",
                                                 "gate.png", "overhead.png"])

  def test_degenerate_inputs_and_errors(self):
    self._check(plots.plot_error_vs_radius([0.0, 0.0], [0.0, 1.0],
                                           os.path.join(self.dir, "empty.png")))
    with self.assertRaisesRegex(ValueError, "must end with .png"):
      plots.plot_overhead({"a": 1.0}, os.path.join(self.dir, "x.jpg"))
    with self.assertRaisesRegex(ValueError, "curves must be a non-empty dict"):
      plots.plot_roc({}, os.path.join(self.dir, "roc.png"))
    self.assertEqual(os.listdir(self.dir), ["empty.png"])


if __name__ == "__main__":
  absltest.main()
