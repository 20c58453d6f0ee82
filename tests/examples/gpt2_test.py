"""The GPT-2 example (``examples/gpt2``): a model of one's own with the eviction designs.

The model is written apart from ``models/llama.py`` and reaches the designs
only through the drop-in API (``certkv_jax.layer``, ``caches``, ``eviction``,
``registry``). Checked against references written here in numpy (float64, no
JAX, no certkv code):

1. with a full cache and no design it is GPT-2: whole-prompt prefill and
   token-by-token decoding through the caches give the reference logits;
2. SnapKV and the Poisson tail composed into it keep what their budgets say
   (sinks, window, counts), zero what they evict, and certify as they should
   (SnapKV's variance estimate exactly 0, the Poisson tail's positive);
3. its attention and certificate statistics are the formulas of
   docs/method.md (sections 3-5), and over 200 Poisson draws the
   Horvitz-Thompson numerator and denominator of the Hajek estimate are
   unbiased and the radius at delta 0.05 covers the realised error in all but
   a few percent of the calls.
"""

import math

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import certkv_jax
from certkv_jax.designs import registry
from certkv_jax import eviction
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer
from examples.gpt2 import model as gpt2

CONFIG = gpt2.GPT2Config(vocab_size=97, n_positions=128, hidden=32, n_layers=2, n_heads=4)
BATCH = 2
PROMPT = 96  # long enough that the Poisson tail has m = 23 expected tail tokens at budget 0.5
N_SINK, WINDOW, BUDGET = 2, 4, 0.5
N_STEPS = 3
N_DRAWS = 200
DELTA = 0.05
_PRECISION = []


def setUpModule():
  # The example model's own products (``x @ w``) state no precision, so on a GPU XLA
  # runs its float32 matmuls in TF32 (10-bit mantissa): measured on an H200, logits off
  # by 1.3e-2 and outputs by 2.8e-4. These tests compare float32 arithmetic with a
  # float64 numpy GPT-2, so they ask for full float32 products on every backend.
  _PRECISION.append(jax.default_matmul_precision("highest"))
  _PRECISION[-1].__enter__()


def tearDownModule():
  _PRECISION.pop().__exit__(None, None, None)


def _params():
  return gpt2.init_params(CONFIG, jax.random.PRNGKey(0))


def _tokens(length, seed=1):
  return jax.random.randint(jax.random.PRNGKey(seed), (BATCH, length), 0, CONFIG.vocab_size)


def _design(name):
  return registry.make(name, BUDGET, n_sink=N_SINK, window=WINDOW)


# Jitted: the eager attention would compile each of its many small ops apart.
_attend = jax.jit(layer.attend, static_argnames=("settings",))


def _np_params(params):
  return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)


# ----------------------------------------------------------------- numpy reference


def _np_layer_norm(p, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + 1e-5) * p["g"] + p["b"]


def _np_softmax(s):
  e = np.exp(s - s.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _np_qkv(block, x):
  """[b, t, hidden] -> q, k, v [b, n_heads, t, head_dim]."""
  fused = _np_layer_norm(block["ln_1"], x) @ block["attn"]["c_attn"]["w"]
  fused = fused + block["attn"]["c_attn"]["b"]
  b, t, _ = x.shape
  return [a.reshape(b, t, CONFIG.n_heads, CONFIG.head_dim).transpose(0, 2, 1, 3)
          for a in np.split(fused, 3, axis=-1)]


def _np_embed(p, tokens, start=0):
  tokens = np.asarray(tokens)
  return p["wte"][tokens] + p["wpe"][start + np.arange(tokens.shape[1])]


def _np_gpt2(p, tokens):
  """GPT-2 with plain causal softmax attention over the whole sequence: [b, t, vocab]."""
  x = _np_embed(p, tokens)
  b, t, h = x.shape
  causal = np.tril(np.ones((t, t), bool))
  for block in p["h"]:
    q, k, v = _np_qkv(block, x)
    s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(CONFIG.head_dim), -np.inf)
    out = (_np_softmax(s) @ v).transpose(0, 2, 1, 3).reshape(b, t, h)
    x = x + out @ block["attn"]["c_proj"]["w"] + block["attn"]["c_proj"]["b"]
    u = _np_layer_norm(block["ln_2"], x) @ block["mlp"]["c_fc"]["w"] + block["mlp"]["c_fc"]["b"]
    gelu = 0.5 * u * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))
    x = x + gelu @ block["mlp"]["c_proj"]["w"] + block["mlp"]["c_proj"]["b"]
  return _np_layer_norm(p["ln_f"], x) @ p["wte"].T


def _np_offset_attention(q, k, v, log_pi, valid):
  """method, sections 3-5, for one query over one cache's slots (numpy float64).

  Returns ``o_hat`` (softmax over the kept slots with logits ``s_i - log pi_i``),
  ``V_hat``, ``b_hat`` and the Horvitz-Thompson sums ``N_hat``, ``Y_hat``
  (scaled by ``exp(-max s)``, as the full sums of :func:`_np_full` are).
  """
  q, k, v, log_pi = (np.asarray(a, np.float64) for a in (q, k, v, log_pi))
  valid = np.asarray(valid)
  s = k[valid] @ q / math.sqrt(q.shape[-1])
  pi = np.exp(log_pi[valid])
  w = np.exp(s - s.max()) / pi
  p = w / w.sum()
  o_hat = p @ v[valid]
  dist = np.linalg.norm(v[valid] - o_hat, axis=-1)
  var_hat = np.sum((1.0 - pi) * p**2 * dist**2)
  tail = pi < 1.0
  range_hat = np.max(((1.0 - pi) * p * dist)[tail]) if tail.any() else 0.0
  return o_hat, var_hat, range_hat, s.max(), w.sum(), w @ v[valid]


def _np_full(q, k, v, shift):
  """Full softmax attention of one query: ``o``, ``N`` and ``Y = N o`` scaled by
  ``exp(-shift)``."""
  a = np.exp(k @ q / math.sqrt(q.shape[-1]) - shift)
  return a @ v / a.sum(), a.sum(), a @ v


def _layer0(caches):
  """Layer 0 of stacked caches as numpy arrays, leaves [batch, heads, cap, ...]."""
  return jax.tree_util.tree_map(lambda a: np.asarray(a[0]), caches)


# ----------------------------------------------------------------- 1. full cache = GPT-2


class FullCacheTest(absltest.TestCase):
  """Without eviction, the caches change nothing: GPT-2's logits."""

  # float32 against a float64 reference, in units of the largest |logit| (~35):
  # measured 2.2e-7 (about 2 float32 epsilons) for prefill and decoding alike;
  # the tolerance, 2e-6 (17 epsilons), leaves 10x for XLA's summation order.
  TOL = 2e-6

  def test_prefill_and_token_by_token_decoding_match_numpy_gpt2(self):
    params, length = _params(), 24
    tokens = _tokens(length, seed=2)
    want = _np_gpt2(_np_params(params), tokens)
    atol = self.TOL * np.abs(want).max()
    caches = caches_lib.init_caches(CONFIG, BATCH, capacity=length)
    logits, full, stats, _ = gpt2.forward(params, CONFIG, tokens, jnp.ones(tokens.shape, bool),
                                       caches)
    np.testing.assert_allclose(logits, want, rtol=0, atol=atol)
    self.assertEqual(stats.var_hat.shape, (CONFIG.n_layers, BATCH, CONFIG.n_heads, length))
    np.testing.assert_array_equal(stats.var_hat, 0.0)  # nothing evicted, nothing uncertain
    np.testing.assert_array_equal(full.n_valid, length)

    one = jnp.ones((BATCH, 1), bool)
    steps = []
    for i in range(length):
      step, caches, _, _ = gpt2.forward(params, CONFIG, tokens[:, i:i + 1], one, caches)
      steps.append(step[:, 0])
    np.testing.assert_allclose(np.stack(steps, axis=1), want, rtol=0, atol=atol)
    np.testing.assert_array_equal(caches.pos, full.pos)  # positions continue from n_seen


# ----------------------------------------------------------------- 2. designs composed in


def _run(params, tokens, design, key):
  """The loop of ``gpt2.generate``, keeping what the checks read."""
  caches = caches_lib.init_caches(CONFIG, BATCH, capacity=PROMPT + 1)
  one = jnp.ones(tokens.shape, bool)
  logits, caches, _, _ = gpt2.forward(params, CONFIG, tokens, one, caches,
                                      settings=layer.Settings(design=design, certificate=False))
  caches, state, info, _ = eviction.evict(design, caches, key)
  run = {"evicted": [caches], "infos": [info], "stats": [], "tokens": []}
  for step in range(N_STEPS):
    run["tokens"].append(jnp.argmax(logits[:, -1], axis=-1)[:, None])
    logits, caches, stats, _ = gpt2.forward(params, CONFIG, run["tokens"][-1], one[:, :1], caches,
                                         settings=layer.Settings(design=design, observe=False))
    caches, state, info, _ = eviction.evict(design, caches, jax.random.fold_in(key, step + 1),
                                         state=state)
    run["evicted"].append(caches)
    run["infos"].append(info)
    run["stats"].append(stats)
  return run


class DesignsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = _params()
    cls.tokens = _tokens(PROMPT)
    cls.runs = {name: _run(cls.params, cls.tokens, _design(name), jax.random.PRNGKey(3))
                for name in ("snapkv", "poisson_tail")}

  def _kept_positions(self, caches):
    """Per (layer, row, head): the sorted positions kept."""
    pos = np.asarray(caches.pos).reshape(-1, caches.pos.shape[-1])
    return [np.sort(p[p >= 0]) for p in pos]

  def test_snapkv_keeps_budget_sinks_and_window(self):
    run = self.runs["snapkv"]
    for step, (caches, info) in enumerate(zip(run["evicted"], run["infos"])):
      n_seen = PROMPT + step
      target = math.floor(BUDGET * n_seen)
      np.testing.assert_array_equal(info.target, target)
      np.testing.assert_array_equal(caches.n_valid, target)  # every (layer, row, head)
      for kept in self._kept_positions(caches):
        np.testing.assert_array_equal(kept[:N_SINK], np.arange(N_SINK))
        np.testing.assert_array_equal(kept[-WINDOW:], np.arange(n_seen - WINDOW, n_seen))
    np.testing.assert_array_equal(run["evicted"][-1].log_pi, 0.0)  # no offsets

  def test_poisson_tail_keeps_certainty_set_and_a_tail_within_budget(self):
    run = self.runs["poisson_tail"]
    for step, (caches, info) in enumerate(zip(run["evicted"], run["infos"])):
      n_seen = PROMPT + step
      target = math.floor(BUDGET * n_seen)
      np.testing.assert_array_equal(info.target, target)
      n_valid = np.asarray(caches.n_valid)
      self.assertTrue((n_valid <= target).all() and (n_valid >= N_SINK + WINDOW).all())
      # The sample uses m < target - |H| slots on average (its overflow margin),
      # so a round triggers only once the tokens seen since exceed the budget.
      triggered = np.asarray(info.triggered)
      self.assertEqual(triggered.all(), step == 0)
      certain = np.asarray(info.certain)
      np.testing.assert_array_equal(certain.sum(-1)[triggered], N_SINK + WINDOW)
      np.testing.assert_array_equal(np.asarray(info.kept)[certain], True)
      # Eq. 2: the tail's inclusion probabilities add up to m.
      tail = np.asarray(info.evicted | info.kept) & ~certain
      np.testing.assert_allclose(np.where(tail, info.pi, 0.0).sum(-1)[triggered],
                                 np.asarray(info.m)[triggered], rtol=1e-4)
      for kept in self._kept_positions(caches):
        np.testing.assert_array_equal(kept[:N_SINK], np.arange(N_SINK))
        np.testing.assert_array_equal(kept[-WINDOW:], np.arange(n_seen - WINDOW, n_seen))
      # The kept tail carries its offsets log pi < 0; the certainty set none.
      log_pi, pos = np.asarray(caches.log_pi), np.asarray(caches.pos)
      in_h = np.asarray(caches.valid) & ((pos < N_SINK) | (pos >= n_seen - WINDOW))
      np.testing.assert_array_equal(log_pi[in_h], 0.0)
      self.assertTrue((log_pi[np.asarray(caches.valid)] <= 0.0).all())
      self.assertTrue((log_pi < 0.0).any())
    self.assertGreater(len(np.unique(np.asarray(run["evicted"][0].n_valid))), 1)  # random

  def test_evicted_slots_hold_nothing(self):
    for run in self.runs.values():
      for caches in run["evicted"]:
        free = ~np.asarray(caches.valid)
        self.assertTrue(free.any())
        for field in (caches.k, caches.v):
          np.testing.assert_array_equal(np.asarray(field)[free], 0.0)
        np.testing.assert_array_equal(np.asarray(caches.v_sq)[free], 0.0)

  def test_deterministic_design_has_no_certificate_and_poisson_tail_has_one(self):
    for name in ("snapkv", "poisson_tail"):
      stats = self.runs[name]["stats"]
      var_hat = np.stack([s.var_hat for s in stats])  # [steps, layers, batch, heads, 1]
      self.assertEqual(var_hat.shape, (N_STEPS, CONFIG.n_layers, BATCH, CONFIG.n_heads, 1))
      radii = np.stack([certkv_jax.certificate_radius(s, DELTA) for s in stats])
      self.assertTrue(np.isfinite(radii).all() and (radii >= 0).all(), name)
      if name == "snapkv":
        np.testing.assert_array_equal(var_hat, 0.0)
        np.testing.assert_array_equal(radii, 0.0)
      else:
        self.assertTrue((var_hat > 0).any())
        self.assertTrue((radii > 0).all())  # every call has a sampled tail

  def test_generate_is_the_same_loop(self):
    for name, run in self.runs.items():
      new, radii = gpt2.generate(self.params, CONFIG, self.tokens, jax.random.PRNGKey(3),
                                 design=_design(name), n_steps=N_STEPS, capacity=PROMPT + 1)
      np.testing.assert_array_equal(new, np.concatenate(run["tokens"], axis=1))
      want = np.stack([certkv_jax.certificate_radius(s, DELTA)[..., 0] for s in run["stats"]])
      np.testing.assert_array_equal(radii, want)


# ----------------------------------------------------------------- 3. the shared statistics


class StatisticsTest(absltest.TestCase):
  """The statistics are the method's formulas, whoever's model calls them."""

  def test_full_attention_over_a_filled_cache_is_softmax_attention(self):
    # A fixed random cache state: PROMPT random keys and values, then one query
    # token through the drop-in attention (no design, the cache as its own shadow).
    rng = np.random.default_rng(0)
    h, d, n = CONFIG.n_heads, CONFIG.head_dim, PROMPT
    q = rng.normal(size=(BATCH, 1, h, d)).astype(np.float32)
    k, v = (rng.normal(size=(BATCH, n + 1, h, d)).astype(np.float32) for _ in range(2))
    cache = caches_lib.init_caches(CONFIG, BATCH, n + 1).layer(0)
    cache = jax.jit(caches_lib.append)(cache, k[:, :n].transpose(0, 2, 1, 3),
                                       v[:, :n].transpose(0, 2, 1, 3), np.ones((BATCH, h, n), bool))
    np.testing.assert_array_equal(layer.positions(cache, np.ones((BATCH, 1), bool)), n)
    out, _, _, stats, _, _ = _attend(q, k[:, n:], v[:, n:], cache, shadow=cache)
    s = np.einsum("bhd,bnhd->bhn", q[:, 0], k) / math.sqrt(d)
    want = np.einsum("bhn,bnhd->bhd", np.asarray(jax.nn.softmax(jnp.asarray(s), axis=-1)), v)
    np.testing.assert_allclose(out[:, 0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(stats.var_hat, 0.0)  # nothing evicted: no uncertainty
    np.testing.assert_allclose(stats.true_error, 0.0, atol=1e-5)

  def test_offset_attention_and_certificate_are_the_method_formulas(self):
    # The GPT-2 layer 0 after the prompt and a Poisson-tail eviction; one decode
    # query attends over it with a never-evicted shadow cache.
    params, tokens = _params(), _tokens(PROMPT)
    design = _design("poisson_tail")
    caches = caches_lib.init_caches(CONFIG, BATCH, capacity=PROMPT + 1)
    _, caches, _, _ = gpt2.forward(params, CONFIG, tokens, jnp.ones(tokens.shape, bool), caches,
                                settings=layer.Settings(design=design, certificate=False))
    evicted, _, _, _ = eviction.evict(design, caches, jax.random.PRNGKey(5))
    cache = evicted.layer(0)
    shadow = caches.layer(0)  # full: nothing evicted yet
    nxt = jnp.full((BATCH, 1), 7)
    x = params["wte"][nxt] + params["wpe"][PROMPT]
    q, k, v = gpt2.qkv(params["h"][0], CONFIG, x)
    out, cache, shadow, stats, _, _ = _attend(q, k, v, cache, shadow=shadow)
    p = _np_params(params)
    qf, kf, vf = _np_qkv(p["h"][0], np.concatenate([_np_embed(p, tokens),
                                                    _np_embed(p, nxt, PROMPT)], axis=1))
    c = jax.tree_util.tree_map(np.asarray, cache)
    for b in range(BATCH):
      for h in range(CONFIG.n_heads):
        o_hat, var_hat, range_hat, shift, _, _ = _np_offset_attention(
            qf[b, h, -1], c.k[b, h], c.v[b, h], c.log_pi[b, h], c.valid[b, h])
        o, _, _ = _np_full(qf[b, h, -1], kf[b, h], vf[b, h], shift)
        np.testing.assert_allclose(out[b, 0, h], o_hat, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(stats.var_hat[b, h, 0], var_hat, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(stats.range_hat[b, h, 0], range_hat, rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(stats.true_error[b, h, 0], np.linalg.norm(o_hat - o),
                                   rtol=1e-3, atol=1e-4)
    self.assertTrue((np.asarray(stats.var_hat) > 0).all())

  def test_poisson_tail_over_draws_unbiased_numerator_and_covering_radius(self):
    # Monte Carlo over N_DRAWS eviction keys, one prompt batch: the prompt is
    # folded once; each draw evicts it and decodes one token through the
    # model. Layer 0's decode queries do not depend on the draw, so its 8
    # calls (2 rows x 4 heads) have a fixed truth.
    params, tokens = _params(), _tokens(PROMPT)
    design = _design("poisson_tail")
    caches = caches_lib.init_caches(CONFIG, BATCH, capacity=PROMPT + 1)
    one = jnp.ones(tokens.shape, bool)
    logits, caches, _, _ = gpt2.forward(params, CONFIG, tokens, one, caches,
                                        settings=layer.Settings(design=design, certificate=False))
    nxt = jnp.argmax(logits[:, -1], axis=-1)[:, None]
    p = _np_params(params)
    qf, kf, vf = _np_qkv(p["h"][0], np.concatenate([_np_embed(p, tokens),
                                                    _np_embed(p, nxt, PROMPT)], axis=1))
    calls = [(b, h) for b in range(BATCH) for h in range(CONFIG.n_heads)]
    n_hat, y_hat, errors, radii = [], [], [], []
    for key in jax.random.split(jax.random.PRNGKey(11), N_DRAWS):
      evicted, _, _, _ = eviction.evict(design, caches, key)
      _, step, stats, _ = gpt2.forward(params, CONFIG, nxt, one[:, :1], evicted,
                                       settings=layer.Settings(design=design, observe=False))
      c = _layer0(step)
      radius = np.asarray(certkv_jax.certificate_radius(stats, DELTA))[0, :, :, 0]
      row_n, row_y = [], []
      for b, h in calls:
        o_hat, _, _, _, n, y = _np_offset_attention(qf[b, h, -1], c.k[b, h], c.v[b, h],
                                                    c.log_pi[b, h], c.valid[b, h])
        shift = (kf[b, h] @ qf[b, h, -1]).max() / math.sqrt(CONFIG.head_dim)
        o, _, _ = _np_full(qf[b, h, -1], kf[b, h], vf[b, h], shift)
        errors.append(np.linalg.norm(o_hat - o))
        radii.append(radius[b, h])
        # Rescale the HT sums to the shift of the full sums.
        kept_shift = (c.k[b, h][c.valid[b, h]] @ qf[b, h, -1]).max() / math.sqrt(CONFIG.head_dim)
        row_n.append(n * math.exp(kept_shift - shift))
        row_y.append(y * math.exp(kept_shift - shift))
      n_hat.append(row_n)
      y_hat.append(row_y)
    n_hat, y_hat = np.asarray(n_hat), np.asarray(y_hat)  # [draws, calls], [draws, calls, d]
    n_true, y_true = zip(*[_np_full(qf[b, h, -1], kf[b, h], vf[b, h],
                                    (kf[b, h] @ qf[b, h, -1]).max() / math.sqrt(CONFIG.head_dim)
                                    )[1:] for b, h in calls])
    # Horvitz-Thompson (method, section 3): E[N_hat] = N and E[Y_hat] = N o exactly
    # (up to the redraws of an overflowing sample, probability <= 1e-3 each).
    # 72 estimates (8 N, 64 components of Y), each a mean of 200 draws: a
    # |z| of 4.5 has probability ~5e-4 of being exceeded by any of them by
    # chance (measured max |z|: 1.1-3.4 over 18 prompt batches and key seeds).
    for est, true in ((n_hat, np.asarray(n_true)), (y_hat, np.asarray(y_true))):
      se = est.std(axis=0, ddof=1) / math.sqrt(N_DRAWS)
      z = np.abs(est.mean(axis=0) - true) / se
      self.assertLess(z.max(), 4.5)
    # The certificate is approximate (method, section 5) and its raw radius is
    # not valid call by call: a call whose decode query wants tokens that the
    # prompt's accumulated attention scored low (Assumption 2, section 6)
    # misses more often (here the worst of the 8 calls misses in 11% of the
    # draws). Pooled over the 8 calls the miss rate measured 0.0225 (0.02-0.035
    # with 6 other key seeds; 0.019-0.079 for 11 other prompt batches of this
    # model). Asserted: <= 2 delta = 0.10; the Monte Carlo standard error of
    # the pooled rate (1,600 calls) is ~0.004.
    errors, radii = np.asarray(errors), np.asarray(radii)
    miss = np.mean(errors > radii)
    self.assertLess(miss, 2 * DELTA)
    self.assertGreater(np.median(errors), 0.0)  # the errors are real, not trivially covered


if __name__ == "__main__":
  absltest.main()
