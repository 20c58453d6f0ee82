"""The calibration artifact: fit, save/load through orbax, checked use.

Everything here is deterministic (seeded synthetic calls, exact comparisons);
no Monte Carlo tolerance is involved.
"""

import json
import math
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from certkv_jax import calibration
from certkv_jax.calibration import store
from certkv_jax import certificate
from tests import test_util

L, H = 2, 3  # layers, KV heads
BUDGETS = (0.125, 0.25)
DELTAS = (0.05, 0.1)
META = dict(model="smollm2-135m", design="poisson_tail")


def _calls(seed=0, per_group=30):
  """Flat per-call arrays over budgets x layers x heads; head (1, 2) has 5 calls."""
  rng = np.random.default_rng(seed)
  lay, hd, bud = [], [], []
  for b in BUDGETS:
    for layer in range(L):
      for head in range(H):
        count = 5 if (layer, head) == (1, 2) else per_group
        lay += [layer] * count
        hd += [head] * count
        bud += [b] * count
  lay, hd, bud = np.array(lay), np.array(hd), np.array(bud)
  var_hat = rng.exponential(0.01, lay.size)
  range_hat = rng.exponential(0.05, lay.size)
  radii = store.bernstein_radii(var_hat, range_hat, DELTAS)  # [n_deltas, n_calls]
  errors = radii[0] * rng.exponential(1.0 + lay + 0.3 * hd)
  return errors, radii, lay, hd, bud


OTHER = store.Provenance("other", "poisson_tail", ("streaming",), ("passkey",))


def _fit(**kw):
  return _fit_calls(*_calls(), **kw)


def _fit_calls(errors, radii, lay, hd, bud, **kw):
  args = dict(deltas=DELTAS, budgets=BUDGETS, shape=(L, H),
              provenance=store.Provenance(
                  META["model"], META["design"], ("streaming",), ("passkey", "agent_memory")))
  calls = store.GroupCalls(errors, radii, lay, hd, bud)
  return store.fit(calls, **{**args, **kw})


class FitTest(parameterized.TestCase):

  def test_matches_fit_scales_and_falls_back_to_layer(self):
    cal = _fit()
    self.assertEqual(cal.scales.shape, (2, 2, L, H))
    errors, radii, lay, hd, bud = _calls()
    for b, budget in enumerate(BUDGETS):
      for d, delta in enumerate(DELTAS):
        sel = bud == budget
        want = calibration.fit_scales(errors[sel], radii[d, sel], lay[sel] * H + hd[sel], L * H,
                                      delta, fallback_groups=np.arange(L * H) // H)
        np.testing.assert_array_equal(cal.scales[b, d].ravel(), want.scales)
        np.testing.assert_array_equal(cal.n_calls[b, d].ravel(), want.n_calls)
        # Only (layer 1, head 2) with 5 calls (< 19 or 9) falls back, to layer 1.
        expect_fb = np.zeros((L, H), bool)
        expect_fb[1, 2] = True
        np.testing.assert_array_equal(cal.fell_back[b, d], expect_fb)
        scores = errors[sel] / radii[d, sel]
        self.assertEqual(cal.scales[b, d, 1, 2],
                         calibration.conformal_quantile(scores[lay[sel] == 1], delta))
    pooled = _fit(fallback="pooled")
    self.assertNotEqual(pooled.scales[0, 0, 1, 2], cal.scales[0, 0, 1, 2])
    self.assertEqual(cal.radius_form, "bernstein")
    self.assertEqual(cal.format_version, 1)

  def test_budgets_stored_in_float32_match(self):
    # The validity study's unit files keep each call's budget as float32: 0.1 comes back
    # as 0.10000000149, which must still match the fit's 0.1 (as the binned fit does).
    errors, radii, lay, hd, bud = _calls()
    bud = np.where(bud == 0.125, 0.1, 0.3)
    stored = bud.astype(np.float32).astype(np.float64)
    self.assertFalse(np.any(stored == bud))
    got = _fit_calls(errors, radii, lay, hd, stored, budgets=(0.1, 0.3))
    want = _fit_calls(errors, radii, lay, hd, bud, budgets=(0.1, 0.3))
    np.testing.assert_array_equal(got.scales, want.scales)

  def test_bernstein_radii_is_radius_from_stats(self):
    r = store.bernstein_radii([0.04, 0.01], [0.1, 0.2], (0.05, 0.2))
    for j, delta in enumerate((0.05, 0.2)):
      np.testing.assert_array_equal(
          r[j], np.asarray(certificate.radius_from_stats(np.array([0.04, 0.01]),
                                                         np.array([0.1, 0.2]), delta)))

  def test_fit_bad_inputs(self):
    errors, radii, lay, hd, bud = _calls()
    base = dict(deltas=DELTAS, budgets=BUDGETS, shape=(L, H),
                provenance=store.Provenance(META["model"], META["design"], ("s",),
                                                        ("t",)))
    with self.assertRaisesRegex(ValueError, r"budgets_per_call must each be one of budgets"):
      _fit_calls(errors, radii, lay, hd, np.where(bud == 0.25, 0.3, bud), **base)
    with self.assertRaisesRegex(ValueError, "budgets: no calibration calls for budget 0.5"):
      _fit_calls(errors, radii, lay, hd, bud, **{**base, "budgets": (0.125, 0.25, 0.5)})
    with self.assertRaisesRegex(ValueError, r"radii must have shape \[n_deltas=2"):
      _fit_calls(errors, radii[:1], lay, hd, bud, **base)
    with self.assertRaisesRegex(ValueError, r"layers must be integers in \[0, n_layers=2\)"):
      _fit_calls(errors, radii, lay + 1, hd, bud, **base)
    with self.assertRaisesRegex(ValueError, "heads"):
      _fit_calls(errors, radii, lay, hd[:-1], bud, **base)
    with self.assertRaisesRegex(ValueError, "fallback must be one of"):
      _fit_calls(errors, radii, lay, hd, bud, fallback="head", **base)


class StoreTest(parameterized.TestCase):

  def test_round_trip(self):
    cal = _fit()
    path = os.path.join(test_util.temp_dir(self, "calibration_store_test-"), "cal")
    self.assertEqual(store.save(path, cal), path)
    back = store.load(path)
    for name in ("scales", "n_calls", "fell_back"):
      np.testing.assert_array_equal(getattr(back, name), getattr(cal, name), err_msg=name)
      self.assertEqual(getattr(back, name).dtype, getattr(cal, name).dtype, name)
    for name in ("budgets", "deltas", "model", "design", "regimes", "data", "created",
                 "radius_form", "format_version"):
      self.assertEqual(getattr(back, name), getattr(cal, name), name)
    self.assertIsInstance(back.budgets, tuple)
    # No temporary directory is left beside the artifact.
    self.assertEqual(os.listdir(os.path.dirname(path)), ["cal"])

  def test_infinite_scale_round_trips(self):
    cal = _fit(min_calls=10_000)  # every group falls back to a pooled quantile
    scales = np.array(cal.scales)
    scales[0, 0, 0, 0] = math.inf
    cal = store.Calibration(**{**cal.__dict__, "scales": scales})
    path = os.path.join(test_util.temp_dir(self, "calibration_store_test-"), "cal")
    store.save(path, cal)
    self.assertEqual(store.load(path).scales[0, 0, 0, 0], math.inf)

  def test_overwrite(self):
    path = os.path.join(test_util.temp_dir(self, "calibration_store_test-"), "cal")
    store.save(path, _fit())
    with self.assertRaisesRegex(FileExistsError, "overwrite=True"):
      store.save(path, _fit(provenance=OTHER))
    self.assertEqual(store.load(path).model, META["model"])
    store.save(path, _fit(provenance=OTHER), overwrite=True)
    self.assertEqual(store.load(path).model, "other")
    self.assertEqual(os.listdir(os.path.dirname(path)), ["cal"])

  def test_failed_write_leaves_nothing_behind(self):
    parent = test_util.temp_dir(self, "calibration_store_test-")
    with self.assertRaisesRegex(ValueError, r"arrays\['edges'\] has no elements"):
      store.write_checkpoint(os.path.join(parent, "cal"), {"edges": np.zeros((1, 0))},
                             {"kind": "x"})
    self.assertEqual(os.listdir(parent), [])  # refused before orbax's writer started

  def test_load_errors(self):
    tmp = test_util.temp_dir(self, "calibration_store_test-")
    with self.assertRaisesRegex(FileNotFoundError, "no calibration at"):
      store.load(os.path.join(tmp, "missing"))
    os.makedirs(os.path.join(tmp, "empty"))
    with self.assertRaisesRegex(ValueError, "not a certkv_jax calibration"):
      store.load(os.path.join(tmp, "empty"))

  def test_unknown_format_version(self):
    path = os.path.join(test_util.temp_dir(self, "calibration_store_test-"), "cal")
    store.save(path, _fit())
    meta_file = os.path.join(path, "metadata", "metadata")
    with open(meta_file, encoding="utf-8") as f:
      meta = json.load(f)
    meta["format_version"] = 2
    with open(meta_file, "w", encoding="utf-8") as f:
      json.dump(meta, f)
    with self.assertRaisesRegex(ValueError, "format_version: .* has version 2; this code reads "
                                "version 1"):
      store.load(path)
    with self.assertRaisesRegex(ValueError, "format_version"):
      store.Calibration(**{**_fit().__dict__, "format_version": 2})


class ScaleForTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.cal = _fit()
    cls.ok = dict(model=META["model"], design=META["design"], regime="streaming", budget=0.25,
                  delta=0.1, n_layers=L, n_kv_heads=H)

  def test_exact_and_tolerant_match(self):
    np.testing.assert_array_equal(self.cal.scale_for(**self.ok), self.cal.scales[1, 1])
    near = {**self.ok, "budget": 0.25 + 1e-12, "delta": 0.1 - 1e-12}
    np.testing.assert_array_equal(self.cal.scale_for(**near), self.cal.scales[1, 1])

  @parameterized.parameters(
      ("model", "llama-7b", "model: this calibration was made for 'smollm2-135m', got "
                            "'llama-7b'"),
      ("design", "snapkv", "design: this calibration was made for 'poisson_tail', got "
                           "'snapkv'"),
      ("regime", "question_aware", r"regime: this calibration was made for regimes "
                                   r"\('streaming',\), got 'question_aware'"),
      ("n_layers", 3, "n_layers: this calibration was made for 2, got 3"),
      ("n_kv_heads", 4, "n_kv_heads: this calibration was made for 3, got 4"),
      ("budget", 0.3, r"budget: this calibration was made for budgets \(0.125, 0.25\), got 0.3"),
      ("delta", 0.05 + 1e-6, r"delta: this calibration was made for deltas \(0.05, 0.1\)"),
  )
  def test_mismatch_names_the_field(self, field, value, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      self.cal.scale_for(**{**self.ok, field: value})

  def test_apply(self):
    kw = {k: v for k, v in self.ok.items() if k not in ("n_layers", "n_kv_heads")}
    radii = np.random.default_rng(1).exponential(size=(5, 4, L, H)).astype(np.float32)
    out = self.cal.apply(radii, **kw)
    self.assertEqual(out.shape, (5, 4, L, H))
    np.testing.assert_allclose(out, radii * self.cal.scales[1, 1], rtol=1e-6)
    with self.assertRaisesRegex(ValueError, "n_kv_heads: this calibration was made for 3"):
      self.cal.apply(np.ones((L, H + 1)), **kw)
    with self.assertRaisesRegex(ValueError, r"radii must be \[..., n_layers, n_kv_heads\]"):
      self.cal.apply(np.ones(H), **kw)

  def test_constructor_validates(self):
    fields = dict(self.cal.__dict__)
    cases = [
        ({"scales": fields["scales"][:1]}, "scales must have shape"),
        ({"n_calls": fields["n_calls"][..., :1]}, "n_calls must have the shape of scales"),
        ({"fell_back": fields["fell_back"].astype(int)}, "fell_back must be bool"),
        ({"deltas": (0.05, 1.0)}, "deltas entries must be in"),
        ({"budgets": (0.25, 0.25)}, "budgets entries must be distinct"),
        ({"regimes": "streaming"}, "regimes must be a non-empty sequence of"),
        ({"data": ()}, "data must be a non-empty sequence"),
        ({"created": "yesterday"}, "created must be an ISO-8601"),
        ({"radius_form": "chebyshev"}, "radius_form must be one of"),
        ({"model": ""}, "model must be a non-empty str"),
    ]
    for change, pattern in cases:
      with self.subTest(pattern=pattern), self.assertRaisesRegex(ValueError, pattern):
        store.Calibration(**{**fields, **change})
    with self.assertRaises(Exception):  # frozen
      self.cal.model = "x"
    with self.assertRaisesRegex(ValueError, "read-only"):
      self.cal.scales[0, 0, 0, 0] = 1.0


if __name__ == "__main__":
  absltest.main()
