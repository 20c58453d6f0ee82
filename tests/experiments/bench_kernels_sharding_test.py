"""The benchmark libraries (experiments/lib/bench/kernels.py, sharding.py) at tiny sizes.

What is checked is the bookkeeping, not the times: the tables and rows are
written, the sharded run on a one-device mesh agrees with the plain one, a
rerun resumes, and bad arguments fail naming the flag.
"""

import json
import os

from absl.testing import absltest
import jax
import pytest

from experiments.lib.bench import kernels as bench_kernels
from experiments.lib.bench import sharding as bench_sharding
from models.config import LlamaConfig
from tests import test_util


def setUpModule():
  test_util.ensure_flags_parsed()  # create_tempdir under pytest


class BenchKernelsTest(absltest.TestCase):

  def test_rows_and_table(self):
    out = os.path.join(self.create_tempdir().full_path, "bench.md")
    plan = bench_kernels.Plan(lengths=(32,), head_dims=(8,), batch=1, groups=2,
                              dtype="float32", repeats=1, pallas=False, iters=2, probe_mb=1)
    rows = bench_kernels.run_and_report(plan, out=out)
    (row,) = rows
    self.assertEqual((row["n"], row["d"], row["dtype"], row["iters"]), (32, 8, "float32", 2))
    methods = {"plain", "offset", "xla_offset", "stats_stored", "stats_stored_exact",
               "stats_bound", "stats_exact"}
    self.assertEqual(set(row["seconds"]), methods)
    lo, hi, _ = row["stats_over_offset_interval"]
    self.assertTrue(lo <= row["stats_over_offset"] <= hi)
    self.assertEqual(row["ratio_to_plain"]["plain"], 1.0)
    self.assertTrue(all(t > 0 for t in row["seconds"].values()))
    # Bytes a call reads: q [1, 2, 8], k and v [1, 32, 8] float32, offsets [1, 32] float32.
    self.assertEqual(row["bytes"], 4 * (2 * 8 + 2 * 32 * 8 + 32))
    self.assertEqual(row["probe_bytes"], 2**20)
    self.assertGreater(row["bandwidth_gbps"], 0)
    self.assertEqual(set(row["gbps"]), methods)
    for m in methods:
      self.assertAlmostEqual(row["gbps"][m], row["bytes"] / row["seconds"][m] / 1e9)
      self.assertAlmostEqual(row["fraction_of_bandwidth"][m],
                             row["gbps"][m] / row["bandwidth_gbps"])
    text = open(out).read()
    self.assertIn("| 32 | 8 |", text)
    self.assertIn("| 32 | 8 | stats_stored |", text)
    with open(os.path.splitext(out)[0] + ".json") as f:
      saved = json.load(f)
    self.assertEqual(saved["rows"], json.loads(json.dumps(rows)))
    self.assertEqual(saved["jax"], jax.__version__)
    self.assertEqual(saved["plan"]["lengths"], [32])

  def test_bfloat16_adds_the_values_read_as_stored(self):
    out = os.path.join(self.create_tempdir().full_path, "bench.md")
    plan = bench_kernels.Plan(lengths=(32,), head_dims=(8,), batch=1, groups=2,
                              dtype="bfloat16", repeats=1, pallas=False, iters=2, probe_mb=1)
    (row,) = bench_kernels.run_and_report(plan, out=out)
    self.assertLessEqual({"xla_offset_split", "stats_stored_exact_split"}, set(row["seconds"]))
    for name in bench_kernels.SPLIT_RATIOS:
      lo, hi, _ = row[f"{name}_interval"]
      self.assertTrue(0 < lo <= row[name] <= hi)
    self.assertIn("`xla_offset_split / xla_offset`", open(out).read())

  def test_bad_plans(self):
    for kw, flag in ((dict(lengths=(0,)), "--lengths must be positive"),
                     (dict(splits=(0,)), "--splits must be positive"),
                     (dict(tilings=("64:0:4",)), "--tilings entries must be"),
                     (dict(tilings=("64:8:4:fast",)), "--tilings entries must be"),
                     (dict(tilings=("64:8",)), "--tilings entries must be"),
                     (dict(batch=0), "--batch must be an int >= 1"),
                     (dict(iters=-1), r"--iters must be an int in \[0, 1000\]"),
                     (dict(dtype="float16"), "--dtype must be bfloat16 or float32")):
      with self.assertRaisesRegex(ValueError, flag):
        bench_kernels.run_and_report(bench_kernels.Plan(**dict(
            dict(lengths=(8,), head_dims=(8,), batch=1, groups=1, dtype="float32",
                 repeats=1), **kw)))

  def test_defaults_by_backend(self):
    plan = bench_kernels.Plan().resolve()
    want = bench_kernels.DEFAULTS["accelerator" if bench_kernels.on_accelerator() else "cpu"]
    self.assertEqual((plan.lengths, plan.batch), (want["lengths"], want["batch"]))
    gpu = bench_kernels.DEFAULTS["accelerator"]  # bytes dominate: 64 rows x 32k keys x d 128
    self.assertTrue(gpu["batch"] >= 64 and 32768 in gpu["lengths"] and 128 in gpu["head_dims"])

  @pytest.mark.slow  # the Pallas kernel interpreted: about 30 s on the 2-core machine
  def test_pallas_split_sweep(self):
    out = os.path.join(self.create_tempdir().full_path, "bench.md")
    plan = bench_kernels.Plan(lengths=(256,), head_dims=(16,), batch=1, groups=2,
                              dtype="bfloat16", repeats=1, pallas=True, splits=(2, 8),
                              tilings=("32:4:8:3:split",), iters=1, probe_mb=1)
    (row,) = bench_kernels.run_and_report(plan, out=out)
    self.assertEqual(row["default_block_sizes"], {"block_k": 64, "num_splits": 1})
    split, tiled = row["sweep"]  # 8 splits of 64-key tiles do not fit 256 keys
    self.assertEqual((split["num_splits"], split["padded_slots"]), (2, 0))
    self.assertEqual((tiled["label"], tiled["num_warps"], tiled["num_stages"],
                      tiled["split_values"]), ("k32s4w8n3v", 8, 3, True))
    self.assertGreater(row["pallas_fraction"], 0)
    self.assertEqual(row["pallas_gbps"], row["gbps"]["pallas_stats_bound"])
    self.assertEqual(row["default_tiling"], "k64s1w4n3v")  # bfloat16: values as stored
    self.assertLessEqual({"pallas_stats_k64s2w4n3v", "pallas_offset_k32s4w8n3v"},
                         set(row["seconds"]))
    self.assertIn("| 256 | 16 | k32s4w8n3v | 0 |", open(out).read())


class BenchShardingTest(absltest.TestCase):

  CONFIG = LlamaConfig(n_layers=1, hidden=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32,
                       vocab_size=32)
  KW = dict(batch=1, prompt_len=22, capacity=24, n_steps=2, design="poisson_tail", budget=0.5,
            repeats=1)  # capacity >= the default certainty set (4 sinks + 16 recent)

  def _run(self, meshes, out=None, **kw):
    plan = bench_sharding.Plan(meshes=tuple(meshes), **dict(self.KW, **kw))
    return bench_sharding.run_and_report(plan, self.CONFIG, out=out)

  @pytest.mark.slow  # 42 s cold on the 2-core CI machine (2026-12-01)
  def test_one_device_mesh_matches_and_resumes(self):
    out = os.path.join(self.create_tempdir().full_path, "shard.md")
    (row,) = self._run(["1x1x1"], out=out)
    self.assertEqual((row["mesh"], row["devices"]), ("1x1x1", 1))
    self.assertTrue(row["same_tokens"])
    self.assertLess(row["max_logit_diff"], 1e-5)
    self.assertEqual(row["cache_fraction_per_device"], 1.0)  # one device holds it all
    self.assertIn("| 1x1x1 | 1 |", open(out).read())
    again = self._run(["1x1x1"], out=out)
    self.assertEqual(again, [row])  # resumed from the JSONL rows, not rerun

  def test_bad_arguments(self):
    self.assertEqual(bench_sharding.parse_mesh("2x4x1"), (2, 4, 1))
    for bad in ("2x4", "0x1x1", "ax1x1"):
      with self.assertRaisesRegex(ValueError, "--meshes"):
        bench_sharding.parse_mesh(bad)
    n = jax.device_count() + 1
    with self.assertRaisesRegex(ValueError, f"needs {n} devices"):
      self._run([f"1x1x{n}"])
    with self.assertRaisesRegex(ValueError, "--prompt_len"):
      self._run(["1x1x1"], prompt_len=25)
    with self.assertRaisesRegex(ValueError, "--batch must be >= 1"):
      bench_sharding.Plan(batch=0).check()
    with self.assertRaisesRegex(ValueError, "--head_dim must be >= 2"):
      bench_sharding.Model(head_dim=1).check()

  def test_model_flags_give_the_scripts_config(self):
    """The defaults of the script's hand-written model flags, before they came from Model."""
    self.assertEqual(bench_sharding.Model().config(),
                     LlamaConfig(vocab_size=512, hidden=256, n_layers=4, n_heads=8,
                                 n_kv_heads=8, head_dim=32, ffn_dim=512))


if __name__ == "__main__":
  absltest.main()
