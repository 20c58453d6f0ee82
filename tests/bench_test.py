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
                              dtype="float32", repeats=1, pallas=False)
    rows = bench_kernels.run_and_report(plan, out=out)
    (row,) = rows
    self.assertEqual((row["n"], row["d"], row["dtype"]), (32, 8, "float32"))
    self.assertEqual(set(row["seconds"]),
                     {"plain", "offset", "xla_offset", "stats_stored", "stats_stored_exact",
                      "stats_bound", "stats_exact"})
    lo, hi, _ = row["stats_over_offset_interval"]
    self.assertTrue(lo <= row["stats_over_offset"] <= hi)
    self.assertEqual(row["ratio_to_plain"]["plain"], 1.0)
    self.assertTrue(all(t > 0 for t in row["seconds"].values()))
    self.assertIn("| 32 | 8 |", open(out).read())
    with open(os.path.splitext(out)[0] + ".json") as f:
      self.assertEqual(json.load(f)["rows"], json.loads(json.dumps(rows)))
    with self.assertRaisesRegex(ValueError, "--lengths must be positive"):
      bench_kernels.run_and_report(bench_kernels.Plan(lengths=(0,), head_dims=(8,), batch=1,
                                                      groups=1, dtype="float32", repeats=1))


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


if __name__ == "__main__":
  absltest.main()
