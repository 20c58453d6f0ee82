"""certkv_jax.calibration.damage_predictor: a small learned map from per-step features to
output damage, fitted on seeded synthetic rows with a known answer."""

import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from certkv_jax.calibration import damage_predictor
from tests import test_util


FEATURES = ("f0", "f1", "f2", "f3", "f4")
W_TRUE = np.array([1.0, -2.0, 0.5, 0.0, 3.0])


def _spec(hidden=0, **kw):
  args = dict(feature_names=FEATURES, hidden=hidden, model="tiny", design="poisson_tail",
              budget="0.25", target="log_kl")
  return damage_predictor.PredictorSpec(**{**args, **kw})


def _linear_rows(seed, n=2000):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 5))
  return x, x @ W_TRUE + 0.5 + 0.05 * rng.normal(size=n)


def _nonlinear_rows(seed, n=2000):
  x = np.random.default_rng(seed).normal(size=(n, 5))
  return x, np.sin(x[:, 0]) + x[:, 1] ** 2


def _r2(pred, y):
  return 1.0 - np.mean((np.asarray(pred) - y) ** 2) / np.var(y)


class PredictorTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # Two fits shared by the tests (each ~3-7 s on CPU, mostly compilation).
    cls.linear = damage_predictor.fit(_spec(0), *_linear_rows(0), seed=0)
    cls.mlp = damage_predictor.fit(_spec(16), *_nonlinear_rows(1), seed=1)

  def test_linear_recovers_known_map(self):
    x, y = _linear_rows(100)  # fresh rows, not seen in the fit
    self.assertGreater(_r2(self.linear.predict(x), y), 0.98)
    p = {k: np.asarray(v, np.float64) for k, v in self.linear.params.items()}
    w = p["y_std"] * p["w_out"] / p["x_std"]  # undo both standardizations
    b = p["y_mean"] + p["y_std"] * (p["b_out"] - np.sum(p["w_out"] * p["x_mean"] / p["x_std"]))
    np.testing.assert_allclose(w, W_TRUE, atol=0.05)
    self.assertAlmostEqual(b, 0.5, delta=0.05)
    # Noise variance 0.05^2 = 0.0025 is the best achievable MSE.
    self.assertLess(self.linear.val_loss, 0.004)
    self.assertBetween(self.linear.best_step, 1, 2000)

  def test_mlp_fits_nonlinear_map(self):
    x, y = _nonlinear_rows(101)
    self.assertGreater(_r2(self.mlp.predict(x), y), 0.9)
    self.assertEqual(self.mlp.predict(x).shape, (2000,))

  def test_save_load_round_trip(self):
    path = os.path.join(test_util.temp_dir(self, "damage_test-"), "pred")
    damage_predictor.save(self.mlp, path)
    back = damage_predictor.load(path, expect_features=FEATURES, model="tiny",
                                 design="poisson_tail", budget="0.25", target="log_kl")
    self.assertEqual(back.spec, self.mlp.spec)
    self.assertEqual((back.train_loss, back.val_loss, back.best_step),
                     (self.mlp.train_loss, self.mlp.val_loss, self.mlp.best_step))
    x, _ = _nonlinear_rows(102, n=50)
    np.testing.assert_array_equal(np.asarray(back.predict(x)), np.asarray(self.mlp.predict(x)))
    with self.assertRaises(FileExistsError):
      damage_predictor.save(self.mlp, path)
    damage_predictor.save(self.linear, path, overwrite=True)
    self.assertEqual(damage_predictor.load(path).spec.hidden, 0)

  @parameterized.named_parameters(
      ("design", dict(design="snapkv"),
       "predictor was trained for design 'poisson_tail', not 'snapkv'"),
      ("model", dict(model="llama"), "predictor was trained for model 'tiny', not 'llama'"),
      ("budget", dict(budget="0.5"), "predictor was trained for budget '0.25', not '0.5'"),
      ("features", dict(expect_features=("f0", "f1", "f2", "f4", "f3")),
       r"predictor was trained for features \['f0', 'f1', 'f2', 'f3', 'f4'\], not"),
  )
  def test_load_refuses_mismatch(self, expect, message):
    path = os.path.join(test_util.temp_dir(self, "damage_test-"), "pred")
    damage_predictor.save(self.linear, path)
    with self.assertRaisesRegex(ValueError, message):
      damage_predictor.load(path, **expect)

  def test_load_missing_and_foreign(self):
    tmp = test_util.temp_dir(self, "damage_test-")
    with self.assertRaises(FileNotFoundError):
      damage_predictor.load(os.path.join(tmp, "nothing"))
    with self.assertRaisesRegex(ValueError, "is not a damage predictor"):
      damage_predictor.load(tmp)

  @parameterized.named_parameters(
      ("x_nan", lambda x, y: (np.where(np.arange(5) == 2, np.nan, x), y), {},
       "x must be finite"),
      ("x_width", lambda x, y: (x[:, :4], y), {}, r"x must have shape \[n, 5\]"),
      ("y_shape", lambda x, y: (x, y[:-1]), {}, "y must have shape"),
      ("y_inf", lambda x, y: (x, np.where(np.arange(len(y)) == 0, np.inf, y)), {},
       "y must be finite"),
      ("few_rows", lambda x, y: (x[:9], y[:9]), {}, "at least 10 rows"),
      ("constant_feature", lambda x, y: (np.where(np.arange(5) == 3, 1.0, x), y), {},
       r"features \['f3'\] are constant"),
      ("val_fraction", lambda x, y: (x, y), dict(val_fraction=0.0), "val_fraction must be in"),
      ("val_too_small", lambda x, y: (x[:10], y[:10]), dict(val_fraction=0.01),
       "leaves 0 validation"),
      ("steps", lambda x, y: (x, y), dict(steps=0), "steps must be an int >= 1"),
      ("learning_rate", lambda x, y: (x, y), dict(learning_rate=-1.0),
       "learning_rate must be in"),
      ("weight_decay", lambda x, y: (x, y), dict(weight_decay=float("nan")),
       "weight_decay must be in"),
  )
  def test_fit_bad_input(self, edit, kw, message):
    x, y = edit(*_linear_rows(3, n=40))
    with self.assertRaisesRegex(ValueError, message):
      damage_predictor.fit(_spec(0), x, y, **kw)

  def test_predict_bad_input(self):
    x, _ = _linear_rows(4, n=8)
    with self.assertRaisesRegex(ValueError, r"x must have shape \[n, 5\]"):
      self.linear.predict(x[:, :3])
    x[0, 0] = np.nan
    with self.assertRaisesRegex(ValueError, "x must be finite"):
      self.linear.predict(x)

  @parameterized.named_parameters(
      ("hidden", dict(hidden=-1), "hidden must be an int >= 0"),
      ("hidden_bool", dict(hidden=True), "hidden must be an int >= 0"),
      ("features_empty", dict(feature_names=()), "feature_names must be a non-empty"),
      ("features_dup", dict(feature_names=("a", "a")), "feature_names must be distinct"),
      ("design", dict(design=""), "design must be a non-empty str"),
      ("activation", dict(activation="relu"), "activation must be one of"),
  )
  def test_spec_bad_input(self, kw, message):
    with self.assertRaisesRegex(ValueError, message):
      _spec(**kw)


if __name__ == "__main__":
  absltest.main()
