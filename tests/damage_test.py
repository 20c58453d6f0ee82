"""Output damage: the W_o projection bound (certkv_jax.certificate.damage) and the learned
predictor (certkv_jax.calibration.damage_predictor).

The bound is checked against brute force on random output projections of a
tiny model shape; float32 rounding of sums over <= 16 terms is ~1e-6
relative, so "<=" is checked with a 1e-5 relative slack and equality to 1e-4.
The one Monte Carlo check states its tolerance where it is made. The
predictor is fitted on seeded synthetic rows with a known answer.
"""

import math
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from certkv_jax.calibration import damage_predictor
from certkv_jax.certificate import damage
from tests import test_util

L, H, HD, HIDDEN = 2, 3, 4, 16  # tiny model: layers, query heads, head_dim, hidden


def _w_o(seed=0):
  """Random [L, H*HD, HIDDEN] output projection with unequal head scales."""
  rng = np.random.default_rng(seed)
  w = rng.normal(size=(L, H * HD, HIDDEN)) / math.sqrt(H * HD)
  scale = np.repeat(rng.uniform(0.2, 3.0, size=(L, H)), HD, axis=1)  # [L, H*HD]
  return (w * scale[..., None]).astype(np.float32)


def _slice(w, layer, head):
  return np.asarray(w[layer, head * HD:(head + 1) * HD, :], np.float64)  # [HD, HIDDEN]


class ProjectionBoundTest(parameterized.TestCase):

  def test_spectral_norms_match_numpy(self):
    w = _w_o()
    norms = np.asarray(damage.head_output_norms(w, H, HD))
    self.assertEqual(norms.shape, (L, H))
    want = np.array([[np.linalg.norm(_slice(w, l, h), 2) for h in range(H)] for l in range(L)])
    np.testing.assert_allclose(norms, want, rtol=1e-5)

  def test_random_errors_within_bound(self):
    w = _w_o(1)
    norms = np.asarray(damage.head_output_norms(w, H, HD))  # [L, H]
    rng = np.random.default_rng(2)
    n = 500
    r = rng.uniform(0.1, 2.0, size=(n, L, H))
    u = rng.normal(size=(n, L, H, HD))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    e = u * (r * rng.uniform(0.0, 1.0, size=(n, L, H)))[..., None]  # ||e_h|| <= r_h
    got = np.asarray(damage.projected_error(e.astype(np.float32), w, H, HD))  # [n, L, H]
    self.assertEqual(got.shape, (n, L, H))
    self.assertTrue(np.all(got <= norms * r * (1 + 1e-5)))
    # The layer's total (all heads summed before the norm) is within projected_radius.
    w_h = np.asarray(w, np.float64).reshape(L, H, HD, HIDDEN)
    total = np.linalg.norm(np.einsum("nlhd,lhdk->nlk", e, w_h), axis=-1)  # [n, L]
    per_layer = np.asarray(damage.projected_radius(r.astype(np.float32), norms))
    self.assertTrue(np.all(total <= per_layer * (1 + 1e-5)))

  def test_equality_on_top_left_singular_vector(self):
    # e_h multiplies W_o^h from the left, so ||u W|| is largest for the top
    # LEFT singular vector u of the [head_dim, hidden] slice.
    w = _w_o(3)
    norms = np.asarray(damage.head_output_norms(w, H, HD))
    r = np.random.default_rng(4).uniform(0.5, 2.0, size=(L, H))
    e = np.zeros((L, H, HD))
    for l in range(L):
      for h in range(H):
        e[l, h] = r[l, h] * np.linalg.svd(_slice(w, l, h))[0][:, 0]
    got = np.asarray(damage.projected_error(e.astype(np.float32), w, H, HD))
    np.testing.assert_allclose(got, norms * r, rtol=1e-4)

  def test_frobenius_rms_is_rms_gain_of_random_direction(self):
    w = _w_o(5)
    rms = np.asarray(damage.head_output_norms(w, H, HD, kind="frobenius_rms"))
    spectral = np.asarray(damage.head_output_norms(w, H, HD))
    self.assertTrue(np.all(rms <= spectral * (1 + 1e-6)))
    u = np.random.default_rng(6).normal(size=(4000, HD))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    for l in range(L):
      for h in range(H):
        g2 = np.sum((u @ _slice(w, l, h)) ** 2, axis=-1)  # [4000] ||u W||^2
        # ||u W||^2 lies in [s_min^2, s_max^2] (s_min > 0: HD < HIDDEN), so its
        # coefficient of variation here is below ~1 and the relative standard
        # error of the mean of 4000 draws is below 1/sqrt(4000) ~ 1.6%; of its
        # square root, below ~0.8%. 5% is over 6 standard errors.
        self.assertLess(np.std(g2) / np.mean(g2) / math.sqrt(4000) / 2, 0.05 / 6)
        np.testing.assert_allclose(math.sqrt(np.mean(g2)), rms[l, h], rtol=0.05)
        np.testing.assert_allclose(rms[l, h], np.linalg.norm(_slice(w, l, h)) / math.sqrt(HD),
                                   rtol=1e-5)

  def test_projected_radius_and_damage_score(self):
    norms = np.asarray(damage.head_output_norms(_w_o(7), H, HD))
    r = np.random.default_rng(8).uniform(0.0, 1.0, size=(5, L, H)).astype(np.float32)
    per_layer = np.asarray(damage.projected_radius(r, norms))
    self.assertEqual(per_layer.shape, (5, L))
    np.testing.assert_allclose(per_layer, np.sum(norms * r, axis=-1), rtol=1e-5)
    score = np.asarray(damage.damage_score(r, norms))
    self.assertEqual(score.shape, (5,))
    np.testing.assert_allclose(score, np.sum(norms * r, axis=(-2, -1)), rtol=1e-5)

  def test_nan_radius_propagates(self):
    norms = np.asarray(damage.head_output_norms(_w_o(9), H, HD))
    r = np.ones((4, L, H), np.float32)
    r[1, 0, 2] = np.nan  # one uncertified head: its layer and its step are NaN
    per_layer = np.asarray(damage.projected_radius(r, norms))
    self.assertTrue(np.isnan(per_layer[1, 0]))
    self.assertEqual(int(np.isnan(per_layer).sum()), 1)
    score = np.asarray(damage.damage_score(r, norms))
    np.testing.assert_array_equal(np.isnan(score), [False, True, False, False])
    norms0 = norms.copy()
    norms0[0, 2] = 0.0
    self.assertTrue(np.isnan(np.asarray(damage.projected_radius(r, norms0))[1, 0]))

  def test_infinite_radius_on_zero_norm_head_contributes_zero(self):
    norms = np.ones((L, H), np.float32)
    norms[1, 1] = 0.0
    r = np.ones((L, H), np.float32)
    r[1, 1] = np.inf
    np.testing.assert_allclose(np.asarray(damage.projected_radius(r, norms)), [H, H - 1])
    r[0, 0] = np.inf
    self.assertEqual(float(damage.projected_radius(r, norms)[0]), np.inf)

  def test_projected_error_without_layer_axis(self):
    w = _w_o(10)[0]  # [H*HD, HIDDEN]
    e = np.random.default_rng(11).normal(size=(7, H, HD)).astype(np.float32)
    got = np.asarray(damage.projected_error(e, w, H, HD))
    want = np.linalg.norm(np.einsum("nhd,hdk->nhk", e, np.asarray(w, np.float64).reshape(
        H, HD, HIDDEN)), axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-5)

  @parameterized.named_parameters(
      ("w_o_rows", lambda: damage.head_output_norms(np.ones((L, H * HD + 1, HIDDEN)), H, HD),
       "w_o must have shape"),
      ("w_o_1d", lambda: damage.head_output_norms(np.ones(H * HD), H, HD), "w_o must have shape"),
      ("kind", lambda: damage.head_output_norms(_w_o(), H, HD, kind="max"), "kind must be one of"),
      ("n_heads", lambda: damage.head_output_norms(_w_o(), 0, HD), "n_heads must be an int >= 1"),
      ("w_o_nan", lambda: damage.head_output_norms(np.full((H * HD, HIDDEN), np.nan), H, HD),
       "w_o must be finite"),
      ("radius_shape", lambda: damage.projected_radius(np.ones((L, H + 1)), np.ones((L, H))),
       "radius must have shape"),
      ("norms_ndim", lambda: damage.projected_radius(np.ones((L, H)), np.ones(H)),
       "norms must be"),
      ("radius_negative", lambda: damage.projected_radius(-np.ones((L, H)), np.ones((L, H))),
       "radius must be in"),
      ("norms_negative", lambda: damage.damage_score(np.ones((L, H)), -np.ones((L, H))),
       "norms must be in"),
      ("e_shape", lambda: damage.projected_error(np.ones((L, H, HD + 1)), _w_o(), H, HD),
       "e must have shape"),
      ("e_lead", lambda: damage.projected_error(np.ones((L + 1, H, HD)), _w_o(), H, HD),
       "does not broadcast"),
  )
  def test_bad_input(self, call, message):
    with self.assertRaisesRegex(ValueError, message):
      call()


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
