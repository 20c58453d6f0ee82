"""Streaming loss under eviction (experiments/perplexity.py) on the tiny Llama fixture.

The model is ``tests/fixtures/tiny_llama`` (random weights, vocabulary 128)
with a character-level stub tokenizer (a ``tokenizer.json`` written by the
test, so the script loads it like any Hugging Face directory). Every call
uses the same shapes (2 segments of 24 tokens, chunks of 8; batches of 2 for
the full cache and 4 = 2 budgets x 2 segments for poisson_tail) and the same
static arguments as the script run, so the whole file compiles the streaming
pass twice (full, poisson_tail) and the one-shot forward once.
"""

import os
import shutil

from absl import flags
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from experiments import perplexity
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import results_io
from experiments.lib.streaming_loss import core as streaming_loss_core
from experiments.lib.streaming_loss import experiment as ppl
from experiments.lib.streaming_loss import report as streaming_loss_report
from tests import test_util

# A certainty set of 1 sink + 2 recent tokens, so that a 50% budget leaves tail slots
# for Poisson sampling (a radius > 0) from the first eviction on.
CTX, CHUNK, N_SEG, N_SINK, WINDOW = 24, 8, 2, 1, 2
BUDGETS = (0.5, 1.0)  # 1.0 must reproduce the full cache
# Float32 tolerance of streaming (cached, chunked, offset attention) vs one-shot
# softmax attention on the same tokens: different summation orders only.
ATOL = 1e-4
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it "
        "was the age of foolishness, it was the epoch of belief, it was the epoch of "
        "incredulity, it was the season of light, it was the season of darkness.\n")
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;?!'\n"

ROW_KEYS = set(ppl.KEY_FIELDS) | {
    "text", "randomized", "delta", "unit_seconds", "batch_size", "n_scored", "mean_nll",
    "perplexity", "mean_nll_after_first_chunk", "chunk_nll", "chunk_radius", "mean_radius",
    "kept_per_chunk", "n_dropped", "delta_nll", "delta_nll_after_first_chunk",
    "spearman_radius_increase"}


class PerplexityTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    test_util.ensure_flags_parsed()
    cls.root = test_util.temp_dir(cls)
    cls.model_dir = os.path.join(cls.root, "tiny_char")  # the rows' model name
    os.makedirs(cls.model_dir)
    test_util.tiny_hf_dir(cls.model_dir, CHARS, lowercase=True)  # TEXT is mixed case
    cls.params, cls.config, cls.tok = model_loading.load_model(cls.model_dir)
    cls.text_path = os.path.join(cls.root, "text.txt")
    with open(cls.text_path, "w", encoding="utf-8") as f:
      f.write(TEXT)
    cls.segs = ppl.make_segments(cls.tok, TEXT, N_SEG, CTX, cls.text_path)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.root, ignore_errors=True)
    super().tearDownClass()

  def _full(self, tokens, mask):
    stream = streaming_loss_core.StreamConfig(chunk=CHUNK)  # capacity: the whole segment
    return streaming_loss_core.streaming_nll(self.params, tokens, mask, jax.random.PRNGKey(0),
                                             config=self.config, stream=stream)

  def test_segments(self):
    self.assertLen(self.segs, N_SEG)
    for s in self.segs:
      self.assertLen(s, CTX)
      self.assertEqual(s[0], 0)  # BOS, then text
    body = self.tok.encode(TEXT, add_bos=False)
    self.assertEqual(self.segs[0][1:] + self.segs[1][1:], body[:2 * (CTX - 1)])

  def test_full_cache_equals_one_shot_forward(self):
    tokens = jnp.asarray(self.segs, jnp.int32)
    mask = np.ones(tokens.shape, bool)
    mask[1, -5:] = False  # a ragged (right-padded) row; CTX is not a chunk multiple here
    mask = jnp.asarray(mask)
    res = self._full(tokens, mask)
    ref = np.asarray(streaming_loss_core.one_shot_logprob(self.params, tokens, mask,
                                                          config=self.config))
    want_scored = np.asarray(mask) & np.pad(np.asarray(mask)[:, 1:], ((0, 0), (0, 1)))
    np.testing.assert_array_equal(np.asarray(res.scored), want_scored)
    self.assertEqual(int(want_scored[0].sum()), CTX - 1)  # last token: no target
    lp = np.asarray(res.logprob)
    self.assertTrue(np.all(lp[want_scored] < 0))
    np.testing.assert_allclose(lp, ref, atol=ATOL, rtol=0)
    self.assertTrue(np.all(np.asarray(res.radius) == 0))
    np.testing.assert_array_equal(np.asarray(res.n_dropped), 0)
    np.testing.assert_array_equal(np.asarray(res.kept)[:, -1], [CTX, CTX - 5])

  def test_budget_one_equals_full_and_small_budget_differs(self):
    tokens = jnp.asarray(self.segs, jnp.int32)
    ones = jnp.ones(tokens.shape, bool)
    full = np.asarray(self._full(tokens, ones).logprob)
    ref = np.asarray(streaming_loss_core.one_shot_logprob(self.params, tokens, ones,
                                                          config=self.config))
    np.testing.assert_allclose(full, ref, atol=ATOL, rtol=0)
    # The script's layout: rows (budget, segment) = (0.5, 0), (0.5, 1), (1.0, 0), (1.0, 1).
    design = design_defaults.make_design("poisson_tail", max(BUDGETS), N_SINK, WINDOW)
    stream = streaming_loss_core.StreamConfig(chunk=CHUNK, design=design)  # sized to 1.0
    rows = jnp.concatenate([tokens, tokens])
    budget = jnp.asarray([0.5, 0.5, 1.0, 1.0], jnp.float32)
    res = streaming_loss_core.streaming_nll(self.params, rows, jnp.ones(rows.shape, bool),
                                            jax.random.PRNGKey(3), config=self.config,
                                            stream=stream, budget=budget)
    lp, rad = np.asarray(res.logprob), np.asarray(res.radius)
    np.testing.assert_allclose(lp[2:], full, atol=1e-5, rtol=0)  # budget 1.0 = full cache
    np.testing.assert_array_equal(rad[2:], 0.0)  # nothing sampled: no uncertainty
    np.testing.assert_allclose(lp[:2, :CHUNK], full[:, :CHUNK], atol=1e-5)  # chunk 1: no eviction
    self.assertGreater(np.max(np.abs(lp[:2] - full)), 1e-3)  # 50%: a different loss
    self.assertTrue(np.any(rad[:2, CHUNK:-1] > 0))  # a sampled tail: a certificate
    np.testing.assert_array_equal(rad[:, :CHUNK], 0.0)  # nothing evicted yet
    np.testing.assert_array_equal(np.asarray(res.n_dropped), 0)
    kept = np.asarray(res.kept)
    np.testing.assert_array_equal(kept[2:, -1], CTX)
    self.assertTrue(np.all(kept[:2] < [[8, 16, 24]]))
    self.assertTrue(np.all(kept[:2, -1] <= 0.5 * CTX))

  def test_script_schema_resume_and_summary(self):
    out = self.create_tempdir().full_path
    fv = flags.FlagValues()
    perplexity.define_flags(fv)
    args = ["prog", f"--out={out}", f"--text={self.text_path}", f"--model={self.model_dir}",
            f"--context_len={CTX}", f"--chunk={CHUNK}", f"--num_examples={N_SEG}",
            f"--budgets={','.join(str(b) for b in BUDGETS)}", "--designs=full,poisson_tail",
            "--n_runs=2", f"--n_sink={N_SINK}", f"--window={WINDOW}"]
    logs = []
    path = os.path.join(out, ppl.ROWS_FILE)
    # Stopped after 2 units (full, poisson_tail run 0): rows but no summary.
    fv(args + ["--max_units=2"])
    self.assertIsNone(ppl.run_from_flags(fv, log=logs.append))
    partial = results_io.read_rows(path)
    self.assertLen(partial, N_SEG + len(BUDGETS) * N_SEG)
    self.assertFalse(os.path.exists(os.path.join(out, streaming_loss_report.SUMMARY_FILE)))
    # A unit killed half-way: its last row is lost; the rerun redoes the unit.
    lines = open(path).read().splitlines(keepends=True)
    results_io.atomic_write_text(path, "".join(lines[:-1]))
    fv.unparse_flags()
    fv(args)
    s = ppl.run_from_flags(fv, log=logs.append)
    rows = results_io.read_rows(path)
    want = ppl.expected_row_count(("full", "poisson_tail"), BUDGETS, N_SEG, 2)
    self.assertEqual(want, N_SEG * (1 + 2 * len(BUDGETS)))
    self.assertLen(rows, want)
    keys = [results_io.row_key(r, ppl.KEY_FIELDS) for r in rows]
    self.assertLen(set(keys), want)  # no duplicates
    by_key = dict(zip(keys, rows))
    for r in partial[:-1]:  # same key, same draws: unchanged
      k = results_io.row_key(r, ppl.KEY_FIELDS)
      self.assertEqual({f: v for f, v in by_key[k].items() if f != "unit_seconds"},
                       {f: v for f, v in r.items() if f != "unit_seconds"})
    n_chunks = -(-CTX // CHUNK)
    for r in rows:
      extra = {"token_nll"} if r["design"] == "full" else set()
      self.assertEqual(set(r), ROW_KEYS | extra, r["design"])
      self.assertEqual(r["model"], "tiny_char")
      self.assertEqual(r["text"], "text.txt")
      self.assertEqual(r["n_scored"], CTX - 1)
      self.assertLen(r["chunk_nll"], n_chunks)
      self.assertLen(r["chunk_radius"], n_chunks)
      self.assertLen(r["kept_per_chunk"], n_chunks)
      self.assertAlmostEqual(r["perplexity"], float(np.exp(r["mean_nll"])), places=5)
      self.assertEqual(r["n_dropped"], 0)
      if r["design"] == "full" or r["budget"] == 1.0:
        self.assertLess(abs(r["delta_nll"]), 1e-5)
        self.assertIsNone(r["spearman_radius_increase"])  # radius 0: no certificate
      else:
        self.assertGreater(abs(r["delta_nll"]), 1e-4)
        full = by_key[results_io.row_key(dict(r, design="full", budget=1.0, run=0),
                                         ppl.KEY_FIELDS)]
        self.assertAlmostEqual(r["chunk_nll"][0], full["chunk_nll"][0], places=5)  # no eviction
        self.assertGreaterEqual(r["mean_radius"], 0.0)
        if r["spearman_radius_increase"] is not None:
          self.assertBetween(r["spearman_radius_increase"], -1.0, 1.0)
    self.assertLen([r for r in rows if r["design"] == "full"][0]["token_nll"], CTX - 1)
    evicted = [r for r in rows if r["design"] == "poisson_tail" and r["budget"] == 0.5]
    self.assertTrue(any(r["spearman_radius_increase"] is not None for r in evicted))
    # The summary: every design x budget, written atomically.
    md = open(os.path.join(out, streaming_loss_report.SUMMARY_FILE)).read()
    self.assertEqual(md.strip(), s["md"].strip())
    table = {(e["design"], e["budget"]): e for e in s["table"]}
    self.assertEqual(set(table), {("full", 1.0), ("poisson_tail", 0.5),
                                  ("poisson_tail", 1.0)})
    self.assertAlmostEqual(table[("full", 1.0)]["ppl_ratio"], 1.0)
    self.assertAlmostEqual(table[("poisson_tail", 1.0)]["ppl_ratio"], 1.0, places=4)
    e = table[("poisson_tail", 0.5)]
    self.assertEqual((e["n_segments"], e["n_rows"]), (N_SEG, 2 * N_SEG))
    est, lo, hi = e["delta_nll"]
    self.assertTrue(lo <= est <= hi)
    self.assertIsNotNone(e["spearman"])
    self.assertIn("| poisson_tail | 0.5 | 2 x 2 |", md)
    # A third run finds nothing to do and leaves the file as it was.
    logs.clear()
    plan = ppl.Plan(model="tiny_char", designs=("full", "poisson_tail"), budgets=BUDGETS,
                    context_len=CTX, chunk=CHUNK, num_examples=N_SEG, n_runs=2, n_sink=N_SINK,
                    window=WINDOW)
    again = ppl.run_perplexity(self.params, self.config, self.tok, self.text_path, out, plan,
                               log=logs.append)
    self.assertIn("0 of 3 units to run", logs[0])
    self.assertEqual(again, rows)

  def test_text_too_short(self):
    with self.assertRaisesRegex(ValueError, r"--text=.*--num_examples=50.*--context_len=24"):
      ppl.make_segments(self.tok, TEXT, 50, CTX, self.text_path)
    with self.assertRaisesRegex(ValueError, r"the text has \d+ tokens"):
      ppl.run_perplexity(self.params, self.config, self.tok, self.text_path,
                         self.create_tempdir().full_path,
                         ppl.Plan(model="tiny", num_examples=50, context_len=CTX, chunk=CHUNK))
    empty = os.path.join(self.create_tempdir().full_path, "empty.txt")
    open(empty, "w").close()
    with self.assertRaisesRegex(ValueError, "empty"):
      ppl.run_perplexity(self.params, self.config, self.tok, empty,
                         self.create_tempdir().full_path, ppl.Plan(model="tiny"))

  def test_bad_arguments(self):
    ok = dict(designs=("full", "poisson_tail"), budgets=BUDGETS, context_len=CTX, chunk=CHUNK,
              num_examples=N_SEG, n_runs=1, n_sink=N_SINK, window=WINDOW)
    ppl.Plan(**ok).check()
    for change, flag in ((dict(chunk=0), "--chunk"), (dict(chunk=CTX), "--chunk"),
                         (dict(budgets=(1.5,)), "--budgets"), (dict(budgets=(0.0,)), "--budgets"),
                         (dict(budgets=()), "--budgets"), (dict(designs=("nope",)), "--designs"),
                         (dict(context_len=1), "--context_len"),
                         (dict(num_examples=0), "--num_examples"), (dict(n_runs=0), "--n_runs"),
                         (dict(max_units=-1), "--max_units"), (dict(max_batch=0), "--max_batch")):
      with self.assertRaisesRegex(ValueError, flag):
        ppl.Plan(**dict(ok, **change)).check()
    tokens = jnp.asarray(self.segs, jnp.int32)
    ones = jnp.ones(tokens.shape, bool)
    design = design_defaults.make_design("poisson_tail", 0.5, N_SINK, WINDOW)
    stream = streaming_loss_core.StreamConfig
    key = jax.random.PRNGKey(0)
    with self.assertRaisesRegex(ValueError, "chunk"):
      streaming_loss_core.streaming_nll(self.params, tokens, ones, key, config=self.config,
                                        stream=stream(chunk=0, capacity=CTX))
    for bad in (1.5, 0.0, [0.5, -0.1]):
      with self.assertRaisesRegex(ValueError, "budget"):
        streaming_loss_core.streaming_nll(self.params, tokens, ones, key, config=self.config,
                                          stream=stream(chunk=CHUNK, design=design,
                                                        capacity=CTX), budget=bad)
    with self.assertRaisesRegex(ValueError, "budget needs a design"):
      streaming_loss_core.streaming_nll(self.params, tokens, ones, key, config=self.config,
                                        stream=stream(chunk=CHUNK, capacity=CTX), budget=0.5)
    with self.assertRaisesRegex(ValueError, "capacity"):
      streaming_loss_core.streaming_nll(self.params, tokens, ones, key, config=self.config,
                                        stream=stream(chunk=CHUNK, capacity=CTX - 1))

  def test_spearman_and_row_summary(self):
    self.assertIsNone(streaming_loss_core.spearman([0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]))
    self.assertAlmostEqual(
        streaming_loss_core.spearman([1.0, 2.0, 3.0, 4.0], [1.0, 4.0, 9.0, 16.0]), 1.0)
    self.assertAlmostEqual(
        streaming_loss_core.spearman([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]), -1.0)
    lp = -np.arange(1.0, 7.0)  # 6 tokens, chunk 2; last not scored
    sc = np.array([True] * 5 + [False])
    full = streaming_loss_core.row_summary(lp, sc, np.zeros(6), [2, 4, 6], 0, 2)
    self.assertEqual(full["n_scored"], 5)
    self.assertAlmostEqual(full["mean_nll"], 3.0)
    self.assertEqual(full["chunk_nll"], [1.5, 3.5, 5.0])
    self.assertEqual(full["mean_nll_after_first_chunk"], 4.0)
    self.assertEqual(full["token_nll"], [1.0, 2.0, 3.0, 4.0, 5.0])
    ev = streaming_loss_core.row_summary(lp - np.array([0, 0, 1, 2, 3, 0.0]), sc,
                                         np.array([0, 0, 1, 2, 3, 0.0]), [2, 3, 3], 0, 2,
                                         full["token_nll"])
    self.assertAlmostEqual(ev["delta_nll"], 6.0 / 5)
    self.assertAlmostEqual(ev["delta_nll_after_first_chunk"], 2.0)
    self.assertAlmostEqual(ev["spearman_radius_increase"], 1.0)
    self.assertNotIn("token_nll", ev)


if __name__ == "__main__":
  absltest.main()
