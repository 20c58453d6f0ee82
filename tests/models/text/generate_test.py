"""models.text.generate (with its certificate and report modules) and the generate
command, on the tiny Llama fixture."""

import json
import os
import subprocess
import sys

from absl.testing import absltest
import jax
import numpy as np
import pytest

from certkv_jax import eviction
from certkv_jax.designs import registry
from experiments.lib import model_loading
from models import decode
from models import prefill as prefill_lib
from models.text import answer_text
from models.text import certificate as generate_certificate
from models.text import generate
from models.text import hint
from models.text import prompt_encoding
from models.text import report as generate_report
from tests import test_util

# 118 characters of context (one token each) and a one-line question.
CONTEXT = "the quick brown fox jumps over the lazy dog. " * 2 + "the fox sleeps under a tree."
PROMPT = CONTEXT + "\nwhere does the fox sleep?"
STEPS = 6


def _tiny_dir(owner, **tokenizer_config):
  """A tiny HF directory, removed when ``owner`` (a test or test class) finishes;
  ``tokenizer_config`` entries are added to its tokenizer_config.json."""
  directory = test_util.tiny_hf_dir(test_util.temp_dir(owner, "generate_model_"))
  if tokenizer_config:
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
      cfg = json.load(f)
    cfg.update(tokenizer_config)
    with open(path, "w") as f:
      json.dump(cfg, f)
  return directory


def _shipped_run(**settings):
  """A run the shipped artifact was made for (poisson_tail, delta 0.05, the validity
  study's n_sink / window / chunk) with ``settings`` (regime, budget)."""
  return generate_certificate.Run(model_name="smollm2", design_name="poisson_tail",
                                  delta=0.05, n_sink=4, window=16, chunk=64, **settings)


SHIPPED = generate_certificate.DEFAULT_CALIBRATION


class GenerateTextTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model_dir = _tiny_dir(cls)
    cls.params, cls.config, cls.tok = model_loading.load_model(cls.model_dir)
    cls.model = dict(params=cls.params, config=cls.config, tokenizer=cls.tok)

  def _run(self, prompt=PROMPT, **kw):
    kw.setdefault("max_new_tokens", STEPS)
    return generate.generate_text(prompt, **self.model, settings=generate.TextSettings(**kw),
                                  model_name=model_loading.model_name(self.model_dir))

  def _check_shapes(self, res, steps=STEPS):
    shape = (steps, self.config.n_layers, self.config.n_heads)
    answer, cert = res.answer, res.certificate
    self.assertEqual(answer.steps, steps)
    self.assertEqual(answer.token_ids.shape, (steps,))
    self.assertEqual(cert.radius.shape, shape)
    self.assertEqual(cert.radius_summary.median.shape, (steps,))
    self.assertEqual(cert.radius_summary.max.shape, (steps,))
    np.testing.assert_allclose(cert.radius_summary.max, cert.radius.reshape(steps, -1).max(1))
    self.assertEqual(cert.smoothed_radius.shape, shape)
    self.assertTrue(np.all(cert.smoothed_radius >= cert.radius - 1e-6))
    np.testing.assert_allclose(cert.smoothed_radius[0], cert.radius[0], rtol=1e-6)  # step 0: itself
    self.assertIsInstance(answer.text, str)
    self.assertEqual(answer.text, self.tok.decode(answer.token_ids))
    self.assertEqual(res.run.n_dropped, 0)

  def test_poisson_tail_question_aware(self):
    res = self._run()
    self._check_shapes(res)
    self.assertFalse(res.answer.stopped_at_eos)  # the tiny vocabulary has no end-of-turn token
    self.assertTrue(res.certificate.certified, res.certificate.note)
    self.assertGreater(res.certificate.sampled_tokens, 0)
    radius = res.certificate.radius
    self.assertTrue(np.all(np.isfinite(radius)) and np.all(radius >= 0))
    self.assertGreater(radius.max(), 0)
    self.assertEqual((res.prompt.context_tokens, res.prompt.question_tokens),
                     (len(PROMPT) + 1, 0))  # + BOS
    # The shipped calibration is SmolLM2's: it refuses this model and says why.
    self.assertIsNone(res.certificate.calibrated_radius)
    if os.path.isdir(generate.DEFAULT_CALIBRATION):
      self.assertIn("model: this calibration was made for 'smollm2'",
                    res.certificate.calibration_note)
    self.assertIsNone(res.evaluation)
    norm = res.certificate.out_norm  # ||o_hat|| of every call: the radius's scale
    self.assertEqual(norm.shape, radius.shape)
    self.assertTrue(np.all(norm > 0))
    out = generate_report.format_result(res, self.tok)
    self.assertIn("median r", out)
    self.assertIn("median r/||o_hat||", out)
    rel = np.median(radius / norm)
    self.assertIn(f"relative to the call's ||o_hat||: median {generate_report._g(rel)}", out)
    self.assertIn("calibrated radius: not available", out)
    self.assertIn("no end-of-turn token", out)

  @pytest.mark.slow  # 41 s cold on the 2-core CI machine (2026-12-01)
  def test_poisson_tail_streaming_evaluate(self):
    res = self._run(regime="streaming", evaluate=True, chunk=32)
    self._check_shapes(res)
    self.assertEqual(res.prompt.question_rule, "the prompt's last line")
    self.assertEqual(res.prompt.question_text, "where does the fox sleep?")
    self.assertEqual(res.prompt.context_tokens, len(CONTEXT) + 2)  # BOS and the line break
    self.assertEqual(res.prompt.question_tokens, len("where does the fox sleep?"))
    self.assertEqual(res.run.chunk, 32)
    self.assertTrue(res.certificate.certified, res.certificate.note)
    self.assertEqual(res.evaluation.true_error.shape, res.certificate.radius.shape)
    self.assertEqual(res.evaluation.rel_error.shape, res.certificate.radius.shape)
    self.assertGreater(res.evaluation.true_error.max(), 0)
    out = generate_report.format_result(res, self.tok)
    for column in ("median ||e||", "covered", "median r/||o||", "covered"):
      self.assertIn(column, out)

  def test_streaming_question_by_tokens(self):
    ctx, question, rule, applied = prompt_encoding.split_prompt(self.tok, CONTEXT, chat=False,
                                                         question_tokens=0)
    self.assertLen(question, prompt_encoding.FALLBACK_QUESTION_TOKENS)  # one line: its last tokens
    self.assertIn("one line", rule)
    self.assertFalse(applied)
    ctx, question, rule, _ = prompt_encoding.split_prompt(self.tok, PROMPT, chat=False,
                                                   question_tokens=5)
    self.assertEqual(self.tok.decode(question), "leep?")
    self.assertLen(ctx + question, len(PROMPT) + 1)
    self.assertIn("question_tokens", rule)

  def test_full_and_deterministic_designs_are_flagged_uncertified(self):
    budgets = {}
    for design, note in (("full", "evicts nothing"), ("snapkv", "NOT a certificate"),
                         ("uniform_random", "NOT a certificate")):
      res = self._run(design=design, max_new_tokens=2)
      budgets[design] = res.run.budget
      self._check_shapes(res, 2)
      self.assertFalse(res.certificate.certified, design)
      self.assertIn(note, res.certificate.note)
      # 0 by construction, not "no error"
      np.testing.assert_array_equal(res.certificate.radius, 0.0)
      self.assertIsNone(res.certificate.calibrated_radius)
      out = generate_report.format_result(res, self.tok)
      self.assertIn(note, out)
      self.assertNotIn("median r", out)
    self.assertEqual(budgets, {"full": 1.0, "snapkv": 0.25, "uniform_random": 0.25})

  def test_no_sampled_tail_is_not_a_certificate(self):
    # floor(0.1 x 145) = 14 tokens < the certainty set of 20: nothing is sampled.
    res = self._run(budget=0.1, max_new_tokens=2)
    self.assertFalse(res.certificate.certified)
    self.assertEqual(res.certificate.sampled_tokens, 0)
    self.assertIn("sampled no tail token", res.certificate.note)
    self.assertIn("certainty set of 20", res.certificate.note)
    # The budget it suggests is computed from the prompt (models.text.hint).
    self.assertRegex(res.certificate.note, r"For one: --budget=0\.\d+ or more \(computed from "
                                           r"this prompt")
    self.assertEqual(res.certificate.hint, res.certificate.note.split("For one: ")[1][:len(
        res.certificate.hint)])

  def test_hint_is_the_smallest_grid_budget_reaching_the_target(self):
    design = registry.make("poisson_tail", 0.25, n_sink=4, window=16)
    ids = self.tok.encode(PROMPT)
    key = jax.random.PRNGKey(0)
    found = hint.certifying_budget(self.params, self.config, ids, design, key)
    self.assertIsNotNone(found.budget)
    self.assertGreaterEqual(found.share, hint.TARGET)
    below = hint.certifying_budget(self.params, self.config, ids, design, key,
                                   start=found.budget - 0.015, target=hint.TARGET)
    self.assertEqual(below.budget, found.budget)  # the grid point below it falls short
    self.assertIn(f"--budget={found.budget:g} or more", hint.describe(found))
    # A prompt no longer than the certainty set keeps every token at any budget.
    short = hint.certifying_budget(self.params, self.config, ids[:20], design, key)
    self.assertEqual((short.budget, short.share), (None, 0.0))
    self.assertIn("no budget up to 1", hint.describe(short))

  def test_hint_evicts_with_the_runs_allocation(self):
    # The hint's share is the share under the per-head allocation the run uses (before:
    # computed for uniform budgets whatever the allocation). With pyramid budgets the target
    # is reached only where the schedule falls back to uniform targets (a kept fraction
    # above about 0.51, as kvpress's PyramidKV), much later than with uniform ones.
    ids = self.tok.encode(PROMPT)
    key = jax.random.PRNGKey(0)
    design, pyramid = registry.make_with_allocation("poisson_tail+pyramid", 0.25, n_sink=4,
                                                    window=16)
    uniform = hint.certifying_budget(self.params, self.config, ids, design, key).budget
    self.assertLess(uniform, 0.5)
    got = hint.certifying_budget(self.params, self.config, ids, design, key, allocation=pyramid)
    self.assertGreater(got.budget, 0.5)
    design, cert = registry.make_with_allocation("poisson_tail+cert", 0.25, n_sink=4, window=16)
    got = hint.certifying_budget(self.params, self.config, ids, design, key, allocation=cert)
    self.assertIsNotNone(got.budget)
    tokens = jax.numpy.asarray(ids, jax.numpy.int32)[None]
    _, caches = prefill_lib.prefill(self.params, tokens, tokens >= 0, config=self.config,
                                    capacity=len(ids), chunk=len(ids), design=design)
    args = decode.allocation_args(self.params, self.config, cert)
    shares = [float(hint._share(eviction.evict(  # pylint: disable=protected-access
        design, caches, k, budget=jax.numpy.float32(got.budget), **args)[0]))
              for k in jax.random.split(key, hint.DRAWS)]
    self.assertAlmostEqual(float(np.mean(shares)), got.share, places=6)

  def test_stops_at_the_end_of_turn_token(self):
    free = self._run(stops=())
    self.assertFalse(free.answer.stopped_at_eos)
    stop = int(free.answer.token_ids[3])
    first = int(np.flatnonzero(free.answer.token_ids == stop)[0])
    cut = self._run(stops=(stop,))
    self.assertTrue(cut.answer.stopped_at_eos)
    self.assertEqual(cut.answer.stop_id, stop)
    self._check_shapes(cut, first)
    np.testing.assert_array_equal(cut.answer.token_ids, free.answer.token_ids[:first])
    # same seed, same calls
    np.testing.assert_allclose(cut.certificate.radius, free.certificate.radius[:first])
    self.assertIn("stopped at the end-of-turn token", generate_report.format_result(cut, self.tok))

  def test_streaming_needs_two_tokens(self):
    class NoBos(test_util.CharTokenizer):
      def encode(self, text, add_bos=False):
        return super().encode(text, add_bos=False)

    with self.assertRaisesRegex(ValueError, "prompt: the streaming regime .* at least 2 tokens"):
      prompt_encoding.split_prompt(NoBos(), "a", chat=False)

  def test_truncate_at_stop(self):
    kept, stopped, stop = answer_text.truncate_at_stop(np.array([5, 7, 2, 9, 0]), (0, 2))
    np.testing.assert_array_equal(kept, [5, 7])
    self.assertEqual((stopped, stop), (True, 2))
    kept, stopped, stop = answer_text.truncate_at_stop(np.array([5, 7]), (2,))
    np.testing.assert_array_equal(kept, [5, 7])
    self.assertEqual((stopped, stop), (False, None))
    kept, stopped, _ = answer_text.truncate_at_stop(np.array([2, 7]), (2,))
    self.assertEqual((kept.size, stopped), (0, True))
    kept, stopped, _ = answer_text.truncate_at_stop(np.array([2, 7]), ())
    self.assertEqual((kept.size, stopped), (2, False))

  def test_bad_arguments_name_the_argument(self):
    cases = (
        (dict(prompt=""), "prompt must be a non-empty str"),
        (dict(prompt="  \n"), "prompt must be a non-empty str"),
        (dict(budget=0.0), r"budget must be a fraction in \(0, 1\]"),
        (dict(budget=1.5), r"budget must be a fraction in \(0, 1\]"),
        (dict(budget=True), "budget must be"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(delta=0.0), r"delta .* must be in \(0, 1\)"),
        (dict(delta=1.0), r"delta .* must be in \(0, 1\)"),
        (dict(design="nope"), r"design: unknown design 'nope'; choose from \['full', "
                              r".*'poisson_tail'.*\+allocation"),
        (dict(design="snapkv+nope"), r"design: unknown allocation 'nope' in 'snapkv\+nope'"),
        (dict(regime="offline"), r"regime must be one of \['question_aware', 'streaming'\]"),
        (dict(seed=1.5), "seed must be an int"),
        (dict(chunk=0), "chunk must be an int >= 1"),
        (dict(regime="streaming", question_tokens=len(PROMPT) + 1),
         rf"question_tokens must be in \[0, {len(PROMPT)}\]"),  # one token (BOS + chars) stays
    )
    for kw, pattern in cases:
      kw = dict(kw)
      prompt = kw.pop("prompt", PROMPT)
      with self.subTest(kw=kw, prompt=prompt):
        with self.assertRaisesRegex(ValueError, pattern):
          generate.generate_text(prompt, **self.model, settings=generate.TextSettings(**kw))

  def test_read_prompt_needs_exactly_one_source(self):
    for args, got in (((None, None), "neither"), (("hi", "f.txt"), "--prompt and --prompt_file")):
      with self.assertRaisesRegex(ValueError, "exactly one of --prompt and --prompt_file, got "
                                  + got):
        generate_report.read_prompt(*args)
    path = os.path.join(test_util.temp_dir(self), "p.txt")
    with open(path, "w") as f:
      f.write(PROMPT)
    self.assertEqual(generate_report.read_prompt(None, path), PROMPT)
    self.assertEqual(generate_report.read_prompt("hi", None), "hi")
    with self.assertRaisesRegex(ValueError, "--prompt_file=.*cannot read"):
      generate_report.read_prompt(None, path + ".missing")

  def test_design_names_are_the_accepted_ones(self):
    self.assertEqual(generate.design_names()[0], "full")
    for name in generate.design_names()[1:]:
      generate.check_arguments(PROMPT, generate.TextSettings(design=name, budget=0.5,
                                                             max_new_tokens=1, delta=0.1))


class TokenizerTest(absltest.TestCase):

  def test_stop_ids_from_eos_token_and_end_of_turn_strings(self):
    tok = model_loading.HFTokenizer(_tiny_dir(self, eos_token="?"))
    self.assertEqual(answer_text.stop_ids(tok), (tok.backend.token_to_id("?"),))
    self.assertEqual(answer_text.stop_ids(model_loading.HFTokenizer(_tiny_dir(self))), ())

    class Backend:
      def token_to_id(self, s):
        return {"<|im_end|>": 2, "<|endoftext|>": 0}.get(s)

    class GgufLike:
      eos_id = 2
      backend = Backend()

    self.assertEqual(answer_text.stop_ids(GgufLike()), (0, 2))  # SmolLM2-Instruct's

    class Digits(GgufLike):  # token i decodes to str(i); 2 ends the turn
      decode = staticmethod(lambda ids: "".join(str(i) for i in ids))

    # What a task scores: the turn only, not digits generated after its end.
    self.assertEqual(answer_text.answer(Digits(), np.array([5, 7, 2, 9, 3])), "57")
    self.assertEqual(answer_text.answer(Digits(), [5, 7]), "57")

  def test_chat_template_wraps_context_and_question(self):
    template = ("{% for m in messages %}q: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}a:{% endif %}")
    tok = model_loading.HFTokenizer(_tiny_dir(self, chat_template=template))
    ctx, question, _, applied = prompt_encoding.split_prompt(tok, PROMPT, chat=True)
    self.assertTrue(applied)
    self.assertTrue(tok.decode(ctx[1:]).startswith("q: the quick"))  # after BOS
    self.assertEqual(tok.decode(question), "where does the fox sleep?\na:")
    _, _, _, applied = prompt_encoding.split_prompt(tok, PROMPT, chat=False)
    self.assertFalse(applied)
    plain = model_loading.HFTokenizer(_tiny_dir(self))  # no template: plain text
    _, question, _, applied = prompt_encoding.split_prompt(plain, PROMPT, chat=True)
    self.assertFalse(applied)
    self.assertEqual(plain.decode(question), "where does the fox sleep?")
    # One line, by tokens: the question is the prompt's own, the template's opening context.
    one = "where?"
    ctx, question, _, _ = prompt_encoding.split_prompt(tok, one, chat=True)
    self.assertEqual(tok.decode(ctx[1:]), "q: ")
    self.assertEqual(tok.decode(question), "where?\na:")
    ctx, question, _, _ = prompt_encoding.split_prompt(tok, one, chat=True, question_tokens=2)
    self.assertEqual(tok.decode(question), "e?\na:")
    with self.assertRaisesRegex(ValueError, r"question_tokens must be in \[0, 6\]"):
      prompt_encoding.split_prompt(tok, one, chat=True, question_tokens=7)  # into "q: "


class CalibrationTest(absltest.TestCase):

  def test_summary_of_no_decode_step_is_empty(self):
    # An answer that stops at its first token has no decode step: radius [0, layers, heads].
    s = generate_certificate.summarize(np.zeros((0, 2, 4)))
    self.assertEqual((s.median.shape, s.max.shape), ((0,), (0,)))
    s = generate_certificate.summarize(np.arange(16.0).reshape(2, 2, 4))
    np.testing.assert_array_equal(s.median, [3.5, 11.5])
    np.testing.assert_array_equal(s.max, [7.0, 15.0])

  def test_settings_are_the_validity_studys(self):
    from experiments.lib.validity import collect as validity_collect  # pylint: disable=g-import-not-at-top
    plan = validity_collect.Plan()
    for module in (generate, generate_certificate):  # the defaults and the calibration check
      self.assertEqual((module.N_SINK, module.WINDOW, module.CHUNK),
                       (plan.n_sink, plan.window, plan.chunk))

  @absltest.skipUnless(os.path.isdir(generate_certificate.DEFAULT_CALIBRATION),
                       "the committed calibration artifact is not in this checkout")
  def test_shipped_calibration_applies_only_where_it_was_made(self):
    raw = np.full((3, 2, 4), 0.5)
    run = _shipped_run(regime="question_aware", budget=0.25)
    kw = dict(calibration=SHIPPED, context_tokens=1100)
    cal, note, in_range = generate_certificate.calibrated(raw, run, **kw)
    self.assertEqual(cal.shape, raw.shape)
    self.assertTrue(np.all(cal > 0))
    self.assertIs(in_range, True)
    self.assertIn("method, section 10", note)
    self.assertIn("fitted on contexts of 1040-1156 tokens", note)
    self.assertFalse(note.startswith("WARNING"))
    # A budget between fitted ones (0.25, 0.5) mixes theirs and says so; outside them
    # (fitted 0.125-0.5) there is none.
    cal_03, note, _ = generate_certificate.calibrated(raw, run._replace(budget=0.3), **kw)
    self.assertEqual(cal_03.shape, raw.shape)
    self.assertIn("between the fitted budgets 0.25 and 0.5", note)
    for change, field in ((dict(budget=0.6), "budget"), (dict(delta=0.2), "delta"),
                          (dict(design_name="poisson_flat"), "design"),
                          (dict(model_name="other"), "model"), (dict(window=8), "window"),
                          (dict(model_name=None), "model_name"),
                          (dict(dtype="bfloat16"), "fitted on float32 weights and caches"),
                          (dict(calibration="/nonexistent"), "no calibration artifact")):
      where = {k: v for k, v in change.items() if k in kw}
      changed = run._replace(**{k: v for k, v in change.items() if k not in kw})
      cal, note, in_range = generate_certificate.calibrated(raw, changed, **dict(kw, **where))
      self.assertIsNone(cal, change)
      self.assertIsNone(in_range, change)
      self.assertIn(field, note)
    with self.assertRaisesRegex(ValueError, "context_tokens"):
      generate_certificate.calibrated(raw, run, **dict(kw, context_tokens=0))

  @absltest.skipUnless(os.path.isdir(generate_certificate.DEFAULT_CALIBRATION),
                       "the committed calibration artifact is not in this checkout")
  def test_shipped_calibration_outside_its_context_range_warns(self):
    raw = np.full((3, 2, 4), 0.5)
    run = _shipped_run(regime="streaming", budget=0.125)
    inside, _, in_range = generate_certificate.calibrated(raw, run, calibration=SHIPPED,
                                                          context_tokens=1040)
    self.assertIs(in_range, True)
    for n in (272, 1039, 1157, 2064):  # a 256-token unit's prompt; just outside; 2,048
      with self.subTest(context_tokens=n):
        cal, note, in_range = generate_certificate.calibrated(raw, run, calibration=SHIPPED,
                                                              context_tokens=n)
        self.assertIs(in_range, False)
        np.testing.assert_array_equal(cal, inside)  # still the calibrated radius
        self.assertTrue(note.startswith("WARNING: "), note)
        self.assertIn("fitted on contexts of 1040-1156 tokens from sources agent_memory, "
                      "kv_retrieval, multi_needle, passkey, text, variable_tracking", note)
        self.assertIn(f"this prompt has {n} tokens, so its coverage is not established here",
                      note)

  @absltest.skipUnless(os.path.isdir(generate_certificate.DEFAULT_CALIBRATION),
                       "the committed calibration artifact is not in this checkout")
  def test_shipped_calibration_records_its_range_and_sources(self):
    from certkv_jax.calibration import robust  # pylint: disable=g-import-not-at-top
    from experiments.lib.validity import collect as validity_collect  # pylint: disable=g-import-not-at-top
    cal = robust.load(generate_certificate.DEFAULT_CALIBRATION)
    self.assertEqual(cal.format_version, 2)
    self.assertEqual(cal.data, ("agent_memory", "kv_retrieval", "multi_needle", "passkey",
                                "text", "variable_tracking"))
    self.assertEqual(cal.context_range, (1040, 1156))
    # The range is that of the prompts (context + question) of the units it was fitted
    # on (poisson_tail at 1,024 tokens, both regimes), and excludes the other contexts'.
    units = os.path.join(os.path.dirname(generate_certificate.DEFAULT_CALIBRATION), "units")
    if not os.path.isdir(units):
      self.skipTest("the committed validity units are not in this checkout")
    by_context = {}
    for name in sorted(os.listdir(units)):
      path = os.path.join(units, name)
      meta = validity_collect.unit_meta(path)
      if meta["design"] != "poisson_tail":
        continue
      arrays, _ = validity_collect.load_unit(path)
      lo, hi = by_context.get(meta["context_len"], (np.inf, -np.inf))
      by_context[meta["context_len"]] = (min(lo, arrays["n_prompt"].min()),
                                         max(hi, arrays["n_prompt"].max()))
    self.assertEqual(by_context[1024], cal.context_range)
    for context in (256, 2048):
      lo, hi = by_context[context]
      self.assertFalse(cal.covers_context(int(lo)) or cal.covers_context(int(hi)), context)

  @absltest.skipUnless(os.path.isdir(os.path.join(os.path.dirname(
      generate_certificate.DEFAULT_CALIBRATION), "units")), "no committed validity units")
  def test_shipped_calibration_refits_bit_for_bit_from_its_units(self):
    from certkv_jax.calibration import robust  # pylint: disable=g-import-not-at-top
    from experiments.lib.validity import calls as validity_calls  # pylint: disable=g-import-not-at-top
    shipped = robust.load(generate_certificate.DEFAULT_CALIBRATION)
    units = os.path.join(os.path.dirname(generate_certificate.DEFAULT_CALIBRATION), "units")
    paths = [os.path.join(units, n) for n in sorted(os.listdir(units))
             if n.startswith("c1024_") and "_poisson_tail_" in n]
    self.assertLen(paths, 12)  # 2 regimes x 6 sources
    calls = validity_calls.load_calls(paths)
    refit = validity_calls.fit_binned(calls, design="poisson_tail", data=shipped.data,
                                      context_len=1024, budgets=shipped.budgets,
                                      deltas=shipped.deltas)
    for k in ("scales", "edges", "n_calls"):
      self.assertEqual(getattr(refit, k).tobytes(), getattr(shipped, k).tobytes(), k)
    for k in ("regimes", "budgets", "deltas", "data", "context_range", "model", "design"):
      self.assertEqual(getattr(refit, k), getattr(shipped, k), k)


class CommandTest(absltest.TestCase):
  """``python -m experiments.generate`` in a child process (jax import, one compile)."""

  def _command(self, *args):
    return subprocess.run([sys.executable, "-m", "experiments.generate", *args],
                          cwd=test_util.ROOT, capture_output=True, text=True, timeout=600,
                          check=False)

  @pytest.mark.slow
  def test_profile_dir_writes_a_trace(self):
    model_dir = _tiny_dir(self)
    trace = os.path.join(test_util.temp_dir(self, "generate_trace_"), "trace")
    done = self._command(f"--model={model_dir}", f"--prompt={PROMPT}", "--max_new_tokens=3",
                         "--regime=streaming", "--evaluate", f"--profile_dir={trace}")
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    self.assertIn("design poisson_tail at budget 0.25; regime streaming", done.stdout)
    self.assertIn("median r", done.stdout)
    self.assertIn(f"profile of one generate call (after a warm-up call) in {trace}",
                  done.stdout)
    files = [f for _, _, names in os.walk(trace) for f in names]
    self.assertTrue(any(f.endswith(".xplane.pb") for f in files), files)

  @pytest.mark.slow
  def test_prompt_flags_are_exclusive(self):
    done = self._command("--prompt=hi", "--prompt_file=/dev/null")
    self.assertNotEqual(done.returncode, 0)
    self.assertIn("give exactly one of --prompt and --prompt_file", done.stderr)


if __name__ == "__main__":
  absltest.main()
