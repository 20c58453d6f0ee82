"""The decode benchmark (experiments/bench_decode.py, experiments/lib/bench/decode*.py) on the
tiny model, and the device check script (scripts/device_check.sh), syntax only.

What is checked is the bookkeeping, not the times: every budget and context in the
summary, finite positive ratios, the report and the plot written, one executable per
design for every budget with the ``generate`` layout, compacted caches that hold the
kept tokens, and bad flags failing with the flag's name.
"""

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import types

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax import cache as cache_lib
from experiments.lib import model_loading
from experiments.lib.bench import decode as bench_decode
from experiments.lib.bench import decode_report as bench_decode_report
from tests import test_util

SCRIPT = os.path.join(test_util.ROOT, "scripts", "device_check.sh")
TINY_PLAN = ["--contexts=64", "--batches=1", "--repeats=3", "--designs=poisson_tail,h2o",
             "--budgets=0.25,0.5", "--n_sink=2", "--window=4", "--evict_every=1"]


def _command(out, *extra):
  return subprocess.run([sys.executable, "-m", "experiments.bench_decode", f"--out={out}",
                         *extra], cwd=test_util.ROOT, capture_output=True, text=True,
                        timeout=1200, check=False)


class CommandTest(absltest.TestCase):

  @pytest.mark.slow  # a child process: about 10 compiles of the tiny model's decode step
  def test_tiny_plan_writes_every_budget_and_context(self):
    model = test_util.tiny_hf_dir(tempfile.mkdtemp(prefix="bench_decode_model_"))
    out = tempfile.mkdtemp(prefix="bench_decode_out_")
    done = _command(out, f"--model={model}", "--capacity=full", *TINY_PLAN)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    with open(os.path.join(out, "summary.json")) as f:
      summary = json.load(f)
    with open(os.path.join(out, "results.json")) as f:
      results = json.load(f)
    self.assertTrue(summary["complete"])
    self.assertEqual((summary["design"], summary["certificate"], summary["batch"]),
                     ("poisson_tail", True, 1))
    tables = [summary["ratio_vs_full"]] + [
        t for d in ("poisson_tail", "h2o")
        for t in summary["ratio_vs_full_by_design"][d].values()]
    self.assertLen(tables, 5)  # the headline + 2 designs x with/without the certificate
    for table in tables:
      self.assertEqual(set(table), {"0.25", "0.5"})
      for per_context in table.values():
        self.assertEqual(set(per_context), {"64"})
        for r in per_context.values():
          self.assertTrue(math.isfinite(r) and r > 0, r)
    self.assertGreater(summary["prefill"]["cached_vs_plain"]["64"], 0)
    rows = results["decode"]
    self.assertLen(rows, 1 + 2 * 2 * 2)  # full + designs x budgets x cert
    for r in rows:
      self.assertLen(r["samples"], 3)
      self.assertTrue(all(s > 0 for s in r["samples"]))
      self.assertLessEqual(r["ci"][0], r["median"])
      self.assertLessEqual(r["median"], r["ci"][1])
      self.assertEqual(r["capacity"], r["context"] + bench_decode.WARMUP + 3)  # full layout
      # The budget is traced: the second budget reuses the first one's executable.
      self.assertEqual(r["new_executable"], r["budget"] in (None, 0.25), r)
    self.assertLen(results["prefill"], 2)
    with open(os.path.join(out, "report.md")) as f:
      report = f.read()
    self.assertIn("## Batch 1", report)
    self.assertIn("grouped_attention", report)  # says what the plain forward attends with
    self.assertGreater(os.path.getsize(os.path.join(out, "decode_ms.png")), 1000)

  @pytest.mark.slow  # two compiles of the tiny model's decode step
  def test_compact_layout_allocates_the_kept_tokens(self):
    test_util.ensure_flags_parsed()
    params, config, _ = model_loading.load_model(
        test_util.tiny_hf_dir(tempfile.mkdtemp(prefix="bench_decode_model_")))
    plan = bench_decode.Plan(designs=("poisson_tail",), budgets=(0.25, 0.5), contexts=(64,),
                             batches=(1,), repeats=2, certificate="without", n_sink=2,
                             window=4, evict_every=(1, 4)).check()
    out = tempfile.mkdtemp(prefix="bench_decode_out_")
    results = bench_decode.run(params, config, plan, out, model="tiny", log=lambda _: None)
    full, quarter, quarter4, half, half4 = results["decode"]
    self.assertEqual(plan.steps_per_call, 4)  # every configuration: 4 steps per timed call
    self.assertEqual(full["capacity"], 64 + 4 * plan.n_calls)
    for r, budget, k in ((quarter, 0.25, 1), (half, 0.5, 1), (quarter4, 0.25, 4),
                         (half4, 0.5, 4)):
      self.assertLessEqual(r["kept_tokens"], int(budget * 64))
      self.assertEqual(r["evict_every"], k)
      # The most the design keeps over the 4 * n_calls appended tokens, plus k slack slots.
      self.assertEqual(r["capacity"], bench_decode.compact_capacity(
          r["kept_tokens"], budget, k, 4 * plan.n_calls, 64))
      self.assertEqual(r["capacity"], max(r["kept_tokens"],
                                          int(budget * (64 + 4 * plan.n_calls))) + k)
      self.assertTrue(r["new_executable"])  # each budget and k its own shape
      self.assertTrue(all(s > 0 for s in r["samples"]))  # per step; no token dropped (run)
    with open(os.path.join(out, "summary.json")) as f:
      summary = json.load(f)
    self.assertFalse(summary["certificate"])  # the headline says which setting it is
    self.assertEqual(summary["ratio_vs_full"], summary["ratio_vs_full_by_design"][
        "poisson_tail"]["without_certificate"])
    self.assertEqual(set(summary["ratio_vs_full_amortized"]["every_4"]), {"0.25", "0.5"})
    self.assertEqual(bench_decode_report.label(quarter4), "poisson_tail every 4")
    for r in results["decode"]:  # no batch 1 in a plan: the smallest batch, said in the note
      r["batch"] = 4
    head = bench_decode_report.headline(results)
    self.assertEqual(head["batch"], 4)
    self.assertIn("batch 1 not measured", head["note"])

  def test_bad_flag_fails_naming_it(self):
    done = _command(tempfile.mkdtemp(prefix="bench_decode_out_"), "--budgets=0.25,1.5")
    self.assertNotEqual(done.returncode, 0)
    self.assertIn("--budgets must be fractions in (0, 1)", done.stderr)


class PlanTest(absltest.TestCase):

  def test_bad_values_name_the_flag_and_range(self):
    ctx = r"--contexts must be ints in \[n_sink \+ window \+ 1 = 21, 100\]"
    for kw, msg in ((dict(designs=("nope",)), "--designs: unknown design"),
                    (dict(designs=("full",)), "--designs: unknown design"),
                    (dict(budgets=(0.0,)), r"--budgets must be fractions in \(0, 1\)"),
                    (dict(budgets=(1,)), r"--budgets must be fractions in \(0, 1\)"),
                    (dict(contexts=(20,)), ctx),
                    (dict(contexts=(128,)), ctx),
                    (dict(contexts=(64, 64)), "--contexts has duplicates"),
                    (dict(batches=(0,)), r"--batches must be an int in \[1, 4096\]"),
                    (dict(batches=()), "--batches must not be empty"),
                    (dict(repeats=0), r"--repeats must be an int in \[1, 10000\]"),
                    (dict(window=0), r"--window must be an int in \[1, inf\]"),
                    (dict(n_sink=-1), r"--n_sink must be an int in \[0, inf\]"),
                    (dict(certificate="maybe"), "--certificate must be one of"),
                    (dict(capacity="huge"), "--capacity must be one of"),
                    (dict(max_seconds=-1), "--max_seconds must be >= 0"),
                    (dict(evict_every=(0,)), r"--evict_every must be an int in \[1, 4096\]"),
                    (dict(evict_every=(4, 4)), "--evict_every has duplicates"),
                    (dict(evict_every=(3, 4)), "--evict_every values must divide the largest")):
      with self.subTest(msg=msg):
        with self.assertRaisesRegex(ValueError, msg):
          bench_decode.Plan(**dict(dict(contexts=(64,)), **kw)).check(max_positions=100)
    self.assertEqual(bench_decode.Plan().check(max_positions=8192).certificate_modes,
                     (False, True))

  def test_flags_are_parsed_and_quick_keeps_the_flags_given(self):
    fv = dict(designs=["h2o"], budgets=["0.5"], contexts=["64"], batches=["1"],
              evict_every=["1", "8"], repeats=3,
              certificate="with", capacity="compact", n_sink=4, window=16, seed=0,
              max_seconds=0.0, quick=True)
    getter = lambda name: types.SimpleNamespace(present=name == "designs")  # fv[name].present
    plan = bench_decode.plan_from_flags(_Flags(fv, getter))
    self.assertEqual(plan.designs, ("h2o",))  # given: kept
    self.assertEqual(plan.evict_every, bench_decode.QUICK["evict_every"])
    self.assertEqual(plan.contexts, bench_decode.QUICK["contexts"])  # not given: quick's
    with self.assertRaisesRegex(ValueError, "--contexts must be ints"):
      bench_decode.plan_from_flags(_Flags(dict(fv, contexts=["1k"], quick=False), getter))

  def test_median_interval(self):
    three = bench_decode.median_interval([3.0, 1.0, 2.0])
    self.assertEqual((three["median"], three["lo"], three["hi"], three["level"]),
                     (2.0, 1.0, 3.0, 0.75))  # [min, max] covers the median 1 - 2^(1-n)
    eleven = bench_decode.median_interval(np.arange(11.0))
    self.assertEqual((eleven["lo"], eleven["hi"]), (1.0, 9.0))  # x_(2), x_(10)
    self.assertGreaterEqual(eleven["level"], 0.95)


class _Flags:
  """The two things ``plan_from_flags`` reads of absl's FlagValues."""

  def __init__(self, values, getter):
    self._values, self._getter = values, getter

  def __getattr__(self, name):
    return self._values[name]

  def __getitem__(self, name):
    return self._getter(name)


class CompactTest(absltest.TestCase):

  def test_kept_slots_move_to_the_front(self):
    c = certkv_jax.init_cache(8, 2)
    k = jnp.arange(12.0).reshape(6, 2)
    c = cache_lib.append(c, k, k + 100.0)
    keep = jnp.array([True, False, False, True, False, True, False, False])
    c = cache_lib.keep_only(c, keep, jnp.full((8,), -0.5))
    caches = jax.tree_util.tree_map(lambda x: x[None, None, None], c)  # [layers, batch, kv]
    small = cache_lib.compact(caches, 4)
    self.assertEqual(small.k.shape, (1, 1, 1, 4, 2))
    np.testing.assert_array_equal(small.pos[0, 0, 0], [0, 3, 5, -1])
    np.testing.assert_array_equal(small.valid[0, 0, 0], [True, True, True, False])
    np.testing.assert_array_equal(small.k[0, 0, 0, :3], k[jnp.array([0, 3, 5])])
    np.testing.assert_array_equal(small.log_pi[0, 0, 0], [-0.5, -0.5, -0.5, 0.0])
    self.assertEqual(int(small.n_seen[0, 0, 0]), 6)
    with self.assertRaisesRegex(ValueError, "keeps 3 tokens, more than the capacity 2"):
      cache_lib.compact(caches, 2)
    one = cache_lib.compact(c, 3)  # one head's cache: the same gather
    np.testing.assert_array_equal(one.pos, [0, 3, 5])
    np.testing.assert_array_equal(one.v, small.v[0, 0, 0, :3])
    big = cache_lib.compact(c, 10)  # grown: empty slots as init_cache makes them
    self.assertEqual(big.k.shape, (10, 2))
    np.testing.assert_array_equal(big.pos, [0, 3, 5] + [-1] * 7)
    np.testing.assert_array_equal(big.valid, [True] * 3 + [False] * 7)
    np.testing.assert_array_equal(big.k[3:], 0.0)
    for bad in (0, -1, 2.0, True):
      with self.assertRaisesRegex(ValueError, r"capacity must be an int >= 1"):
        cache_lib.compact(c, bad)


class DeviceScriptTest(absltest.TestCase):

  def test_syntax_and_parts(self):
    subprocess.run(["bash", "-n", SCRIPT], check=True)
    with open(SCRIPT) as f:
      text = f.read()
    header = re.match(r"#![^\n]*\n((?:#[^\n]*\n)+)", text).group(1).splitlines()
    self.assertBetween(len(header), 5, 10)
    self.assertIn("set -euo pipefail", text)
    self.assertIn('OUT="${OUT:-./device_out}"', text)
    for part in ("tests/kernels_test.py::KernelTest", "-m experiments.bench_kernels",
                 "-m experiments.bench_decode"):
      self.assertIn(part, text)


if __name__ == "__main__":
  absltest.main()
