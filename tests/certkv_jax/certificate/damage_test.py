"""Output damage: the W_o projection bound (certkv_jax.certificate.damage).

The bound is checked against brute force on random output projections of a
tiny model shape; float32 rounding of sums over <= 16 terms is ~1e-6
relative, so "<=" is checked with a 1e-5 relative slack and equality to 1e-4.
The one Monte Carlo check states its tolerance where it is made.
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from certkv_jax.certificate import damage

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


if __name__ == "__main__":
  absltest.main()
