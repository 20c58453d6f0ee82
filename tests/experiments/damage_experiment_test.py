"""The damage study (experiments.damage, experiments.lib.damage) on the tiny model."""

import json
import os
import subprocess
import sys

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from certkv_jax.calibration import damage_predictor
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib.damage import analysis as damage_analysis
from experiments.lib.damage import collect as damage_collect
from experiments.lib.damage import report as damage_report
from experiments.lib.damage import tokens as damage_tokens
from experiments.lib.streaming_loss.core import StreamConfig
from tests import test_util

TEXT = ("the quick brown fox jumps over the lazy dog. " * 80)


class TokenDamageTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model_dir = test_util.tiny_hf_dir(test_util.temp_dir(cls, "damage_model_"))
    cls.params, cls.config, cls.tok = model_loading.load_model(cls.model_dir)
    cls.tokens = jax.random.randint(jax.random.PRNGKey(0), (1, 96), 3, 30)
    cls.mask = jnp.ones(cls.tokens.shape, bool)

  def _run(self, budget):
    design = design_defaults.make_design("poisson_floor", budget, 2, 4)
    return damage_tokens.token_damage(self.params, self.tokens, self.mask,
                                      jax.random.PRNGKey(1), config=self.config,
                                      stream=StreamConfig(chunk=16, design=design, capacity=96))

  def test_no_eviction_is_no_damage(self):
    # Budget 1.0 keeps everything: the evicted model is the full model (KL and the NLL
    # change at float32 rounding, 1e-5 is ~100x the rounding seen) and no radius.
    out = self._run(1.0)
    self.assertLess(float(jnp.max(jnp.abs(out.kl))), 1e-5)
    self.assertLess(float(jnp.max(jnp.abs(out.dnll))), 1e-4)
    self.assertEqual(float(jnp.max(out.radius)), 0.0)
    self.assertEqual(int(out.n_dropped[0]), 0)

  def test_eviction_damages_after_the_first_chunk_only(self):
    out = self._run(0.25)
    kl = np.asarray(out.kl[0])
    self.assertLess(np.max(np.abs(kl[:16])), 1e-5)  # the first chunk sees everything
    self.assertGreater(kl[32:].mean(), 1e-4)
    r = np.asarray(out.radius[0]).sum(axis=(1, 2))
    self.assertGreater(r[32:-1].min(), 0.0)  # the floor keeps a sampled tail (the last token
    # has no next token: not scored)
    self.assertEqual(out.radius.shape, (1, 96, self.config.n_layers, self.config.n_heads))
    self.assertEqual(out.signals["tail_mass"].shape, (1, 96, self.config.n_layers))
    # Certified calls cover their truth most of the time (a loose sanity check, not the
    # validity study: at delta 0.05 a coverage under 0.5 would mean a broken radius).
    err = np.asarray(out.true_error[0])[32:]
    rad = np.asarray(out.radius[0])[32:]
    self.assertGreater(np.mean(err <= rad), 0.5)

  def test_projection_bound_on_the_tiny_model(self):
    # The tiny model's own W_o: for random per-head errors of norm r, the brute-force
    # ||e_h W_o^h|| never exceeds ||W_o^h||_2 r (to float32 rounding), and the RMS gain is
    # never above the spectral one.
    from certkv_jax.certificate import damage  # pylint: disable=g-import-not-at-top
    c = self.config
    norms = damage_collect.head_norms(self.params, c)
    w_o = self.params["params"]["layers"]["o_proj"]["kernel"]
    e = jax.random.normal(jax.random.PRNGKey(3), (64, c.n_layers, c.n_heads, c.head_dim))
    r = jnp.linalg.norm(e, axis=-1)
    brute = np.asarray(damage.projected_error(e, w_o, c.n_heads, c.head_dim))
    bound = norms["spectral"] * np.asarray(r)
    self.assertTrue(np.all(brute <= bound * (1 + 1e-5)))
    self.assertTrue(np.all(norms["rms"] <= norms["spectral"] * (1 + 1e-6)))
    total = np.asarray(damage.damage_score(r, norms["spectral"]))
    np.testing.assert_allclose(total, bound.sum(axis=(1, 2)), rtol=1e-5)

  def test_bad_arguments(self):
    key = jax.random.PRNGKey(0)
    with self.assertRaisesRegex(ValueError, "design must be"):
      damage_tokens.token_damage(self.params, self.tokens, self.mask, key, config=self.config,
                                 stream=StreamConfig(chunk=16, capacity=96))
    design = design_defaults.make_design("poisson_floor", 0.25, 2, 4)
    with self.assertRaisesRegex(ValueError, "chunk must be"):
      damage_tokens.token_damage(self.params, self.tokens, self.mask, key, config=self.config,
                                 stream=StreamConfig(chunk=0, design=design, capacity=96))
    with self.assertRaisesRegex(ValueError, "delta must be"):
      damage_tokens.token_damage(self.params, self.tokens, self.mask, key, config=self.config,
                                 stream=StreamConfig(chunk=16, design=design, capacity=96,
                                                     delta=0.0))


class PlanTest(absltest.TestCase):

  def test_bad_values_name_the_field(self):
    for kw, name in ((dict(train_segments=7), "train_segments"), (dict(budget=1.5), "budget"),
                     (dict(settings=("nope",)), "settings"), (dict(num_examples=1),
                                                              "num_examples"),
                     (dict(design="nope"), "nope")):
      with self.subTest(name=name):
        with self.assertRaisesRegex(ValueError, name):
          damage_collect.Plan(**kw).check()

  def test_spearman(self):
    x = np.arange(10.0)
    self.assertAlmostEqual(damage_report.spearman(x, x ** 3), 1.0)
    self.assertAlmostEqual(damage_report.spearman(x, -x), -1.0)
    self.assertTrue(np.isnan(damage_report.spearman(x, np.ones(10))))


@pytest.mark.slow
class TaskStepAlignmentTest(absltest.TestCase):

  def test_a_steps_kl_meets_the_radius_of_the_pass_that_made_its_logits(self):
    # The generator returns step s's logits from the pass that read token s - 1, whose
    # statistics are its step s - 1; step 0's logits come from the prefill (no radius).
    units, norms = damage_analysis.load_units(os.path.join(
        os.path.dirname(__file__), "..", "..", "experiments", "results", "damage"))
    a = dict(units["task_agent_memory_d5"])
    shape = a["run0_radius"].shape  # [examples, steps, layers, heads]
    for r in (0, 1):  # every radius of step s is s + 1: a row's radius names its step
      a[f"run{r}_radius"] = np.broadcast_to(
          (np.arange(shape[1], dtype=np.float32) + 1)[None, :, None, None], shape)
    table = damage_analysis.token_table({"task_agent_memory_d5": a}, norms, chunk=64)
    rows = []
    for r in (0, 1):
      for e in range(shape[0]):
        step = np.flatnonzero(a[f"run{r}_same_prefix"][e][1:]) + 1
        rows += [(r, e, s) for s in step]
    self.assertLen(table["kl"], len(rows))
    np.testing.assert_array_equal(table["kl"], [a[f"run{r}_kl"][e][s] for r, e, s in rows])
    np.testing.assert_array_equal(table["confidence"],
                                  [-a[f"run{r}_logprobs"][e][s] for r, e, s in rows])
    read = np.round(table["radius"] / (shape[2] * shape[3])) - 1  # the step whose radius
    np.testing.assert_array_equal(read, [s - 1 for _, _, s in rows])
    # Per example: the mean over generated steps 1, ..., S - 1 of the radius behind each
    # (radii 1, ..., S - 1), and the log-probabilities of the same steps.
    ex = damage_analysis.example_scores({"task_agent_memory_d5": a}, norms, None)
    per = np.round(ex["radius"] / (shape[2] * shape[3]), 4)
    np.testing.assert_array_equal(per, np.full(shape[0], np.mean(np.arange(1, shape[1]))))
    np.testing.assert_allclose(ex["confidence"], -a["run0_logprobs"][:, 1:].mean(axis=1))


@pytest.mark.slow  # three runs of the command: in the full suite
class CommandTest(absltest.TestCase):

  def test_runs_resumes_and_reports(self):
    model_dir = test_util.tiny_hf_dir(test_util.temp_dir(self, "damage_cmd_model_"))
    out = test_util.temp_dir(self, "damage_out_")
    text = os.path.join(out, "text.txt")
    with open(text, "w", encoding="utf-8") as f:
      f.write(TEXT)
    cmd = [sys.executable, "-m", "experiments.damage", f"--out={out}", f"--model={model_dir}",
           "--context_len=96", "--chunk=16", "--text_segments=3", "--train_segments=2",
           "--num_examples=4", "--settings=multi_needle_n4,agent_memory_d5", "--n_steps=2",
           "--max_batch=4", f"--text={text}"]
    done = subprocess.run(cmd, cwd=test_util.ROOT, capture_output=True, text=True, timeout=900,
                          check=False)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    self.assertIn("5 of 5 units to run", done.stdout)
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
      s = json.load(f)
    for k in ("attribution_auc_within_task", "attribution_auc_two_run", "gating_vs_random",
              "gating_oracle_share", "spearman_token_damage", "baselines", "goals"):
      self.assertIn(k, s)
    for b in ("damage_bound", "radius", "confidence", "two_run"):
      self.assertIn(b, s["baselines"])
    self.assertTrue(os.path.exists(os.path.join(out, "report.md")))
    info = s["predictor"]
    p = damage_predictor.load(os.path.join(out, "predictor"),
                              expect_features=tuple(info["features"]), design="poisson_floor")
    self.assertEqual(p.spec.model, s["plan"]["model"])
    again = subprocess.run(cmd + ["--stage=report"], cwd=test_util.ROOT, capture_output=True,
                           text=True, timeout=600, check=False)
    self.assertEqual(again.returncode, 0, again.stderr[-3000:])
    collect_again = subprocess.run(cmd + ["--stage=collect"], cwd=test_util.ROOT,
                                   capture_output=True, text=True, timeout=600, check=False)
    self.assertIn("0 of 5 units to run", collect_again.stdout)


if __name__ == "__main__":
  absltest.main()
