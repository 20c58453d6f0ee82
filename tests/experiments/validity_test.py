"""The validity study (experiments.lib.validity) and the calibrate command, on tiny models."""

import json
import os
import subprocess
import sys

from absl import flags
from absl.testing import absltest
import jax
import numpy as np
import pytest

from certkv_jax.calibration import robust
from certkv_jax.certificate import signals as signals_lib
from experiments.lib import model_loading
from experiments.lib.validity import calls as validity_calls
from experiments.lib.validity import collect as validity_collect
from experiments.lib.validity import report as validity_report
from experiments.lib.validity import run as validity_run
from models import decode
from tests import test_util

TEXT = ("the quick brown fox jumps over the lazy dog. " * 40)


def _plan(**kw):
  base = dict(designs=("poisson_tail",), regimes=("question_aware", "streaming"),
              budgets=(0.25, 0.5), data=("text", "passkey"), context_lens=(64,),
              num_examples=2, n_steps=2, question_len=4, window=4, n_sink=2, chunk=16,
              model="tiny")
  base.update(kw)
  return validity_collect.Plan(**base)


class PlanTest(absltest.TestCase):

  def test_bad_values_name_the_flag(self):
    for kw, flag in ((dict(designs=("snapkv",)), "--designs"), (dict(data=("nope",)), "--data"),
                     (dict(budgets=(1.0,)), "--budgets"), (dict(regimes=("x",)), "--regimes"),
                     (dict(context_lens=(4,)), "--context_lens"),
                     (dict(num_examples=0), "--num_examples"),
                     (dict(designs_at=((128, ("poisson_tail",)),)), "designs_at")):
      with self.subTest(flag=flag):
        with self.assertRaisesRegex(ValueError, flag):
          _plan(**kw).check()

  def test_units_respect_subsets(self):
    plan = _plan(designs=("poisson_tail", "attention_proportional"), context_lens=(64, 128),
                 designs_at=((128, ("poisson_tail",)),), data_at=((128, ("text",)),)).check()
    units = plan.units()
    self.assertNotIn((64, "streaming", "attention_proportional", "text"), units)
    self.assertIn((64, "question_aware", "attention_proportional", "passkey"), units)
    self.assertEqual([u for u in units if u[0] == 128],
                     [(128, "question_aware", "poisson_tail", "text"),
                      (128, "streaming", "poisson_tail", "text")])

  def test_pad_groups_add_units_without_touching_finished_ones(self):
    base = _plan(context_lens=(64, 128)).check()
    grown = _plan(context_lens=(64, 128), groups_at=(
        (128, ("kv_retrieval", "multi_needle"), ("poisson_tail",)),
        (256, ("agent_memory",), ("poisson_tail",)))).check()
    new = [u for u in grown.units() if u not in base.units()]
    self.assertEqual(grown.units()[:len(base.units())], base.units())
    self.assertEqual(set(new), {(c, r, "poisson_tail", s)
                                for c, s in ((128, "kv_retrieval"), (128, "multi_needle"),
                                             (256, "agent_memory"))
                                for r in ("question_aware", "streaming")})
    for u in base.units():  # a finished run's units keep their fingerprints
      self.assertEqual(validity_collect.unit_fingerprint(base, u, "sha"),
                       validity_collect.unit_fingerprint(grown, u, "sha"))
    self.assertEqual(grown.pad_group_of((128, "streaming", "poisson_tail", "multi_needle")),
                     ("kv_retrieval", "multi_needle"))
    self.assertEqual(grown.pad_groups(128), [("text", "passkey"),
                                             ("kv_retrieval", "multi_needle")])
    self.assertEqual(grown.all_context_lens, (64, 128, 256))
    with self.assertRaisesRegex(ValueError, "not in this plan"):
      grown.pad_group_of((256, "streaming", "poisson_tail", "text"))
    for groups, msg in ((((128, ("text",), ("poisson_tail",)),), "planned twice"),
                        (((128, ("nope",), ("poisson_tail",)),), "unknown data source"),
                        (((128, ("passkey",), ("snapkv",)),), "not a randomized"),
                        (((128, (), ("poisson_tail",)),), "non-empty"),
                        (((128, ("passkey",)),), r"\(context, data sources, designs\)")):
      with self.subTest(msg=msg):
        with self.assertRaisesRegex(ValueError, msg):
          _plan(context_lens=(64, 128), groups_at=groups).check()

  def test_text_examples_are_consecutive_and_checked(self):
    tok = test_util.CharTokenizer()
    exs = validity_collect.text_examples(tok, "abcdefghij" * 10, 2, 20, 3)
    self.assertLen(exs, 2)
    self.assertEqual(exs[0].context_ids[0], 1)  # BOS
    self.assertLen(exs[0].context_ids, 20)
    self.assertEqual(tok.decode(exs[0].question_ids), tok.decode(
        tok.encode("abcdefghij" * 10, add_bos=False)[19:22]))
    self.assertEqual(exs[1].meta["segment"], 1)
    with self.assertRaisesRegex(ValueError, "too few"):
      validity_collect.text_examples(tok, "abc", 2, 20, 3, source="short.txt")


class SyntheticCallsTest(absltest.TestCase):

  def test_sharpness_floor_leaves_out_calls_with_no_error(self):
    # Half the calls exact (error 0): sharpness is over covered calls with an error, as
    # stats.sharpness and the cells' own sharpness take it (r / 0 was inf before).
    rng = np.random.default_rng(0)
    n = 4000
    v = rng.uniform(0.5, 1.5, n)
    r = np.asarray(validity_calls.certificate.radius_from_stats(v, np.zeros(n), 0.05))
    e = r * rng.uniform(0, 0.6, n)
    e[: n // 2] = 0.0
    cols = dict(true_error=e, var_hat=v, range_hat=np.zeros(n), design=np.full(n, "d"),
                context_len=np.full(n, 1024), data=np.array(["a", "b"] * (n // 2)),
                regime=np.full(n, "streaming"), budget=np.full(n, 0.5),
                n_prompt=np.full(n, 1040), layer=np.zeros(n, int), kv_head=np.zeros(n, int))
    floor = validity_run.sharpness_floor(validity_calls.Calls(cols, 1, 1, 1, "m"), "d", 1024,
                                         (0.5,))
    self.assertEqual(floor["cells"], 2)
    self.assertTrue(np.isfinite(floor["sharpness_median"]))
    self.assertBetween(floor["sharpness_median"], 1.0, 5.0)

  def test_calibrated_on_names_the_sources_the_fit_had(self):
    # Source c has calls at 256 tokens only: a fit at 1,024 never saw it, so its label
    # must not name it (before: the labels listed every other source of the study).
    rng = np.random.default_rng(1)
    n = 3000
    data = np.array(["a", "b", "c"] * (n // 3))
    cols = dict(true_error=rng.uniform(0, 1, n), var_hat=rng.uniform(0.01, 1, n),
                range_hat=rng.uniform(0.01, 1, n), design=np.full(n, "d"),
                context_len=np.where(data == "c", 256, 1024), data=data,
                regime=np.full(n, "streaming"), budget=np.full(n, 0.5),
                n_prompt=np.where(data == "c", 270, 1040), layer=np.zeros(n, int),
                kv_head=np.zeros(n, int))
    calls = validity_calls.Calls(cols, 1, 1, 1, "m")
    _, label, fitted = validity_report.scheme_radii(calls, "d", ("a", "b", "c"), 1024, (0.5,),
                                                     (0.05,))["calibrated"]
    self.assertEqual(set(label[data == "a"]), {"b"})
    self.assertEqual(set(label[data == "c"]), {"a+b"})
    self.assertNotIn(("b", "c"), fitted)

  """Fit and score on a made-up call table (2 layers, 1 KV head, two text sources)."""

  def _calls(self, budgets):
    rng = np.random.default_rng(0)
    n = 2000
    cols = dict(true_error=rng.uniform(0, 1, n), var_hat=rng.uniform(0.01, 1, n),
                range_hat=rng.uniform(0.01, 1, n), layer=rng.integers(0, 2, n),
                kv_head=np.zeros(n, int),
                # float32, as the unit files store it: 0.1 is 0.10000000149 here
                budget=np.asarray(rng.choice(budgets, n), np.float32).astype(np.float64),
                design=np.full(n, "poisson_tail"), data=rng.choice(["text", "passkey"], n),
                context_len=np.full(n, 1024), regime=np.full(n, "streaming"),
                n_prompt=np.full(n, 1040))
    return validity_calls.Calls(cols, 2, 3, 1, "smollm2")

  def test_per_head_fit_at_budgets_float32_cannot_hold(self):
    calls = self._calls([0.1, 0.3])
    calib = validity_calls.fit_fold(calls, design="poisson_tail", data=("text",),
                                    context_len=1024, budgets=(0.1, 0.3))
    self.assertEqual(tuple(calib.budgets), (0.1, 0.3))

  def test_calls_at_a_budget_not_scored_are_nan(self):
    calls = self._calls([0.125, 0.25])
    calib = validity_calls.fit_fold(calls, design="poisson_tail", data=("text",),
                                    context_len=1024, budgets=(0.125, 0.25))
    r = validity_calls.calibrated_radii(calls, calib, 0.05, (0.125,))
    at = np.abs(calls["budget"] - 0.125) < 1e-6
    self.assertTrue(np.isfinite(r[at]).all())
    self.assertTrue(np.isnan(r[~at]).all())  # before: whatever np.empty held


class SignalsInGenerationTest(absltest.TestCase):

  @pytest.mark.slow  # 78 s cold on the 2-core CI machine (2026-12-01)
  def test_evaluation_mode_reports_signals(self):
    config = test_util.tiny_config()
    params = test_util.tiny_params(config)
    from certkv_jax import designs  # pylint: disable=g-import-not-at-top
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 40), 2, config.vocab_size)
    mask = np.ones((2, 40), bool)
    gen = decode.generate(params, tokens, mask, jax.random.PRNGKey(1), config=config,
                          gen=decode.GenerationConfig(
                              n_steps=3, design=designs.poisson_tail(
                                  0.5, certain=designs.CertaintySet(n_sink=2, window=4)),
                              capacity=48, evaluate=True))
    shape = gen.var_hat.shape  # [steps, layers, batch, heads]
    for k in signals_lib.Signals._fields:
      if k in ("var_hat", "range_hat"):
        continue
      a = np.asarray(getattr(gen, k))
      self.assertEqual(a.shape, shape, k)
      self.assertTrue(np.all(np.isfinite(a)), k)
    ess = np.asarray(gen.ess)
    self.assertTrue(np.all(ess >= 1.0 - 1e-4))
    self.assertTrue(np.all(np.asarray(gen.range_ratio) <= 1.0 + 1e-4))
    plain = decode.generate(params, tokens, mask, jax.random.PRNGKey(1), config=config,
                            gen=decode.GenerationConfig(
                                n_steps=3, design=designs.poisson_tail(
                                    0.5, certain=designs.CertaintySet(n_sink=2, window=4)),
                                capacity=48))
    self.assertIsNone(plain.ess)  # normal mode computes no signals
    np.testing.assert_array_equal(plain.tokens, gen.tokens)


class FlagsTest(absltest.TestCase):
  """``python -m experiments.validity``'s flags give the Plan the hand-written flags did
  (the expected Plans were printed by the code before the flags came from the Plan; its
  max_batch=0 is now unset, None)."""

  def _plan(self, *argv):
    from experiments import validity  # pylint: disable=g-import-not-at-top
    fv = flags.FlagValues()
    validity.define_flags(fv)
    fv(["validity", "--out=/tmp/x", *argv])
    return validity.plan_from_flags(fv)

  def test_quick_with_structured_entries(self):
    plan = self._plan("--quick", "--examples_at=256:2", "--designs_at=256:poisson_tail",
                      "--groups_at=256:kv_retrieval+multi_needle:poisson_tail", "--n_steps=3")
    self.assertEqual(plan, validity_collect.Plan(
        designs=("poisson_tail", "poisson_defensive"), data=("text", "passkey"),
        context_lens=(256,), num_examples=3, n_steps=3, model="smollm2",
        examples_at=((256, 2),), designs_at=((256, ("poisson_tail",)),),
        groups_at=((256, ("kv_retrieval", "multi_needle"), ("poisson_tail",)),)))

  def test_the_long_study_command(self):
    plan = self._plan(
        "--context_lens=4096,8000", "--designs=poisson_tail,poisson_floor",
        "--data=text,passkey,multi_needle", "--num_examples=2", "--examples_at=8000:1",
        "--designs_at=4096:poisson_tail,8000:poisson_tail", "--data_at=8000:text+passkey",
        "--groups_at=4096:text:poisson_floor", "--calib_context=4096",
        "--default_design=poisson_tail", "--max_batch=1", "--max_units=5",
        "--transfer_calibration=experiments/results/validity/calibration", "--budgets=0.25,0.5")
    self.assertEqual(plan, validity_collect.Plan(
        designs=("poisson_tail", "poisson_floor"), budgets=(0.25, 0.5),
        data=("text", "passkey", "multi_needle"), context_lens=(4096, 8000), num_examples=2,
        model="smollm2", max_batch=1, examples_at=((8000, 1),),
        designs_at=((4096, ("poisson_tail",)), (8000, ("poisson_tail",))),
        data_at=((8000, ("text", "passkey")),), groups_at=((4096, ("text",), ("poisson_floor",)),),
        max_units=5, default_design="poisson_tail", calib_context=4096,
        transfer="experiments/results/validity/calibration"))

  def test_defaults(self):
    self.assertEqual(self._plan(), validity_collect.Plan())
    self.assertIsNone(validity_collect.Plan().max_batch)

  def test_bad_entries_name_the_flag_and_form(self):
    for arg, msg in (("--examples_at=x", "--examples_at entries must be CONTEXT:N, got 'x'"),
                     ("--examples_at=a:2", "--examples_at entries must be CONTEXT:N"),
                     ("--designs_at=1024", "--designs_at entries must be CONTEXT:A\\+B"),
                     ("--data_at=x:text", "--data_at entries must be CONTEXT:A\\+B"),
                     ("--groups_at=1024:text", "--groups_at entries must be CONTEXT:DATA1"),
                     ("--max_batch=0", "--max_batch must be an int >= 1 or unset")):
      with self.subTest(arg=arg):
        with self.assertRaisesRegex(ValueError, msg):
          self._plan(arg)

  def test_unset_max_batch_keeps_the_fingerprint_of_0(self):
    """Committed unit files were fingerprinted with max_batch=0 (the value printed by the
    code before max_batch was Optional)."""
    unit = (64, "streaming", "poisson_tail", "passkey")
    self.assertEqual(validity_collect.unit_fingerprint(_plan(), unit, "sha"), "536bc5639d130386")
    self.assertEqual(validity_collect.unit_fingerprint(_plan(max_batch=3), unit, "sha"),
                     "2e0cd3c25a966ee9")

  def test_calibrate_plan_is_the_collect_plan_of_its_flags(self):
    from experiments.lib.validity import calibrate as calibrate_lib  # pylint: disable=g-import-not-at-top
    from experiments.lib import plan_flags  # pylint: disable=g-import-not-at-top
    fv = flags.FlagValues()
    plan_flags.define_flags(calibrate_lib.Plan, fv)
    fv(["calibrate", "--data=text,passkey", "--regimes=question_aware", "--budgets=0.5",
        "--deltas=0.05", "--context_len=48", "--num_examples=2", "--n_steps=2", "--n_bins=2"])
    cal = plan_flags.plan_from_flags(calibrate_lib.Plan, fv)
    self.assertEqual((cal.deltas, cal.n_bins, cal.scheme, cal.seed), ((0.05,), 2, "binned", 1))
    self.assertEqual(cal.collect_plan("tiny"), validity_collect.Plan(
        designs=("poisson_tail",), regimes=("question_aware",), budgets=(0.5,),
        data=("text", "passkey"), context_lens=(48,), num_examples=2, n_steps=2, seed=1,
        model="tiny", question_aware_only=()))


class ValidityEndToEndTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    test_util.ensure_flags_parsed()
    cls.model_dir = test_util.tiny_hf_dir(test_util.temp_dir(cls, "validity_model_"))
    cls.model = model_loading.load_model(cls.model_dir)

  @pytest.mark.slow  # 186 s cold on the 2-core CI machine (2026-12-01)
  def test_run_writes_summary_artifact_and_resumes(self):
    out = self.create_tempdir().full_path
    plan = _plan()
    logs = []
    summary = validity_run.run(*self.model, plan, out, text=TEXT, log=logs.append)
    with open(os.path.join(out, "summary.json")) as f:
      on_disk = json.load(f)
    self.assertEqual(on_disk["default"]["design"], "poisson_tail")
    self.assertEqual(on_disk["default"]["radius"], "calibrated")
    self.assertEqual(on_disk["default"]["calibrated_on"], ["passkey", "text"])
    self.assertEqual(on_disk["default"]["artifact"], "calibration")
    cells = on_disk["cells"]
    # raw cells: 2 budgets x 2 regimes x 2 data; calibrated: the same, held out.
    self.assertLen([c for c in cells if c["radius"] == "raw"], 8)
    cal = [c for c in cells if c["radius"] == "calibrated"]
    self.assertLen(cal, 8)
    smoothed = [c for c in cells if c["radius"] == "smoothed"]  # the same cells, uncalibrated
    self.assertLen(smoothed, 8)
    for r, w in zip([c for c in cells if c["radius"] == "raw"], smoothed):
      self.assertEqual((r["budget"], r["regime"], r["data"]), (w["budget"], w["regime"], w["data"]))
      # never a smaller radius, so never less coverage
      self.assertGreaterEqual(w["coverage"]["0.05"], r["coverage"]["0.05"])
    for c in cells:
      for key in ("design", "radius", "budget", "regime", "data", "held_out", "context_len",
                  "n_calls", "coverage", "coverage_ci", "sharpness", "m_median", "R_median"):
        self.assertIn(key, c)
      self.assertEqual(set(c["coverage"]), {"0.01", "0.05", "0.1"})
      lo, hi = c["coverage_ci"]["0.05"]
      self.assertLessEqual(lo, c["coverage"]["0.05"] + 1e-12)
      self.assertGreaterEqual(hi, c["coverage"]["0.05"] - 1e-12)
    for c in cal + on_disk["alternative_cells"]:  # never scored by its own data
      self.assertNotIn(c["data"], c["calibrated_on"])
    self.assertLen(on_disk["alternative_cells"], 16)  # 2 schemes x 8 cells
    self.assertEqual([c["coverage"] for c in summary["cells"]],
                     [c["coverage"] for c in on_disk["cells"]])
    self.assertTrue(os.path.exists(os.path.join(out, "report.md")))
    calib = robust.load(os.path.join(out, "calibration"))
    self.assertEqual(calib.design, "poisson_tail")
    self.assertEqual(calib.data, ("passkey", "text"))
    with self.assertRaisesRegex(ValueError, "design"):
      calib.radius(np.ones(2), robust.Calls("tiny", "poisson_envelope", "streaming", 0.25,
                                            0.05))
    # A rerun resumes: nothing left to run, the same cells.
    logs.clear()
    again = validity_run.run(*self.model, plan, out, text=TEXT, log=logs.append)
    self.assertIn("0 of 4 units to run", logs[0])
    self.assertEqual(again["cells"], summary["cells"])
    # Another plan in the same directory is an error, not a silent mix.
    with self.assertRaisesRegex(ValueError, "another plan"):
      validity_run.run(*self.model, _plan(n_steps=3), out, text=TEXT, log=logs.append)
    # A pad group grows the run: only its units run, and the analysis takes them in.
    logs.clear()
    grown = validity_run.run(*self.model, _plan(groups_at=((64, ("kv_retrieval",),
                                                            ("poisson_tail",)),)),
                             out, text=TEXT, log=logs.append)
    self.assertIn("2 of 6 units to run", logs[0])
    self.assertEqual(grown["default"]["calibrated_on"], ["kv_retrieval", "passkey", "text"])
    raw = lambda cells: [c for c in cells if c["radius"] == "raw" and c["data"] != "kv_retrieval"]
    self.assertEqual(raw(grown["cells"]), raw(summary["cells"]))  # old units untouched
    self.assertEqual({(r["radius"], r["context_len"]) for r in grown["by_context"]},
                     {("raw", 64), ("smoothed", 64), ("calibrated", 64)})
    # Another study (another context, a source the artifact never saw) scores this
    # study's artifact unchanged: its cells are the binned radius of every call.
    artifact = os.path.join(out, "calibration")
    out2 = self.create_tempdir().full_path
    other = validity_run.run(*self.model, _plan(data=("text", "variable_tracking"),
                                                context_lens=(80,), transfer=artifact),
                             out2, text=TEXT, log=logs.append)
    t = other["transfer"]
    self.assertEqual(t["data"], ["kv_retrieval", "passkey", "text"])
    self.assertLen(t["cells"], 8)  # 2 budgets x 2 regimes x 2 data
    self.assertEqual({c["held_out"] for c in t["cells"] if c["data"] == "text"}, {False})
    self.assertEqual({c["held_out"] for c in t["cells"] if c["data"] != "text"}, {True})
    calls = validity_calls.load_calls(
        [validity_collect.unit_path(out2, u) for u in _plan(
            data=("text", "variable_tracking"), context_lens=(80,)).units()])
    cal = robust.load(artifact)
    r = validity_calls.binned_radii(calls, cal, 0.05, (0.25, 0.5))
    for c in t["cells"]:
      m = ((calls["regime"] == c["regime"]) & (calls["data"] == c["data"])
           & (np.abs(calls["budget"] - c["budget"]) < 1e-6))
      self.assertAlmostEqual(c["coverage"]["0.05"],
                             float(np.mean(calls["true_error"][m] <= r[m])), places=12)
    self.assertEqual({(x["radius"], x["context_len"]) for x in t["by_context"]},
                     {("raw", 80), ("transferred", 80)})
    with open(os.path.join(out2, "report.md")) as f:
      self.assertIn("A calibration fitted elsewhere", f.read())

  @pytest.mark.slow  # 62 s cold on the 2-core CI machine (2026-12-01)
  def test_calibrated_radii_scale_the_raw_radius(self):
    out = self.create_tempdir().full_path
    plan = _plan(regimes=("question_aware",))
    paths = validity_collect.collect(*self.model, plan, out, text=TEXT, log=lambda s: None)
    calls = validity_calls.load_calls(paths)
    self.assertEqual(len(calls), 2 * 2 * 2 * 2 * calls.n_layers * calls.n_heads)
    calib = validity_calls.fit_fold(calls, design="poisson_tail", data=("text",),
                                    context_len=64, budgets=plan.budgets)
    cal = validity_calls.calibrated_radii(calls, calib, 0.05, plan.budgets)
    raw = validity_calls.raw_radii(calls, 0.05)
    for b_i, b in enumerate(plan.budgets):
      m = calls["budget"] == b
      scale = calib.scales[b_i, calib.deltas.index(0.05)][calls["layer"][m],
                                                          calls["kv_head"][m]]
      with np.errstate(invalid="ignore"):  # an infinite scale gives an infinite radius
        expected = np.where(np.isinf(scale), np.inf, scale * raw[m])
      np.testing.assert_allclose(cal[m], expected, rtol=1e-6)
    # In-sample (the calibration's own calls): coverage is at least the conformal level
    # within each (budget, group), so at least 1 - delta pooled.
    text = calls.where(data="text")
    self.assertGreaterEqual(np.mean(calls["true_error"][text] <= cal[text]), 0.95)


class CalibrateCommandTest(absltest.TestCase):

  @pytest.mark.slow  # a child process: jax import and one compile
  def test_calibrate_writes_a_loadable_binned_calibration(self):
    model_dir = test_util.tiny_hf_dir(test_util.temp_dir(self, "calibrate_model_"))
    text = os.path.join(model_dir, "text.txt")
    with open(text, "w") as f:
      f.write(TEXT)
    out = test_util.temp_dir(self, "calibrate_out_")
    cmd = [sys.executable, "-m", "experiments.calibrate", f"--out={out}",
           f"--model={model_dir}", "--data=text,passkey", "--regimes=question_aware",
           "--budgets=0.5", "--deltas=0.05", "--context_len=48", "--num_examples=2",
           "--n_steps=2", f"--text={text}", "--n_bins=2"]
    done = subprocess.run(cmd, cwd=test_util.ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    self.assertIn("binned calibration of poisson_tail", done.stdout)
    cal = robust.load(os.path.join(out, "calibration"))
    self.assertEqual(cal.data, ("passkey", "text"))
    self.assertEqual(cal.scales.shape, (1, 1, 1, 2))
    again = subprocess.run(cmd, cwd=test_util.ROOT, capture_output=True, text=True,
                           timeout=600, check=False)
    self.assertNotEqual(again.returncode, 0)  # refuses to overwrite
    self.assertIn("--overwrite", again.stderr)
    # It records the prompt lengths (context + question) of its calls, and --from_units
    # re-fits the same artifact from the unit files alone (no model).
    units = [validity_collect.load_unit(os.path.join(out, "units", n))[0]
             for n in sorted(os.listdir(os.path.join(out, "units")))]
    n_prompt = np.concatenate([u["n_prompt"] for u in units])
    self.assertEqual(cal.context_range, (int(n_prompt.min()), int(n_prompt.max())))
    self.assertIn(f"contexts of {cal.fitted_on().split('contexts of ')[1]}", done.stdout)
    refit = subprocess.run(
        [sys.executable, "-m", "experiments.calibrate", f"--out={out}", "--from_units",
         "--model=/nonexistent", "--data=text,passkey", "--regimes=question_aware",
         "--budgets=0.5", "--deltas=0.05", "--context_len=48", "--n_bins=2", "--overwrite"],
        cwd=test_util.ROOT, capture_output=True, text=True, timeout=600, check=False)
    self.assertEqual(refit.returncode, 0, refit.stderr[-3000:])
    back = robust.load(os.path.join(out, "calibration"))
    np.testing.assert_array_equal(back.scales, cal.scales)
    self.assertEqual(back.context_range, cal.context_range)


class ClusterIntervalTest(absltest.TestCase):

  def test_interval_contains_the_estimate_and_widens_with_dependence(self):
    rng = np.random.default_rng(0)
    clusters = np.repeat(np.arange(20), 50)
    independent = rng.random(1000) < 0.9
    dependent = np.repeat(rng.random(20) < 0.9, 50)  # whole clusters hit or miss
    lo_i, hi_i = validity_report.cluster_ratio_ci(independent, clusters)
    lo_d, hi_d = validity_report.cluster_ratio_ci(dependent, clusters)
    self.assertLessEqual(lo_i, independent.mean())
    self.assertGreaterEqual(hi_i, independent.mean())
    self.assertGreater(hi_d - lo_d, 2 * (hi_i - lo_i))


if __name__ == "__main__":
  absltest.main()
