"""The device check (scripts/device_check.sh) off a GPU, and what it needs from the repository.

The GPU parts cannot run here; what is checked: ``--help`` names every part with its time
limit, the whole run's limit (L_RUN) cuts or skips the parts it has no time for, the script
refuses a CPU backend with one line before writing anything, the random checkpoints of
scripts/make_random_checkpoint.py load through the experiments' loader and run a forward, the
kernel benchmark's tiny CPU plan writes its bandwidth fields, and (slow) a tiny dry run
(DEVICE_CHECK_ALLOW_CPU=1) leaves at most 8 plain files in ``OUT``.
"""

import importlib.util
import json
import os
import subprocess
import sys

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib import model_loading
from models import hf_loader
from models import llama
from tests import test_util

SCRIPT = os.path.join(test_util.ROOT, "scripts", "device_check.sh")
MAKER = os.path.join(test_util.ROOT, "scripts", "make_random_checkpoint.py")
PARTS = ("ckpt_135m", "ckpt_1b", "kernel_tests", "fast_tier_a", "bench_kernels",
         "decode_135m_float32", "decode_135m_bfloat16", "decode_1b_float32",
         "decode_1b_bfloat16")


def setUpModule():
  test_util.ensure_flags_parsed()  # create_tempdir under pytest


def _maker():
  spec = importlib.util.spec_from_file_location("make_random_checkpoint", MAKER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _script(env=None, *args, timeout=120):
  full = {k: v for k, v in os.environ.items() if k != "DEVICE_CHECK_ALLOW_CPU"}
  full.update(env or {}, PYTHON=sys.executable)
  return subprocess.run(["bash", SCRIPT, *args], cwd=test_util.ROOT, env=full,
                        capture_output=True, text=True, timeout=timeout, check=False)


class ScriptTest(absltest.TestCase):

  def test_help_names_every_part_and_limit(self):
    done = _script(None, "--help")
    self.assertEqual(done.returncode, 0, done.stderr)
    for part in PARTS + ("fast_tier_a/b/c", "tests/pallas_kernels/offset_decode_test.py::KernelTest",
                         "-m experiments.bench_kernels", "-m experiments.bench_decode",
                         "--splits=", "--contexts=8192", "tests/certkv_jax/designs/priority_sampling_test.py"):
      self.assertIn(part, done.stdout)
    self.assertRegex(done.stdout, r"bench_kernels +\d+s")
    bad = _script(None, "--bogus")
    self.assertEqual(bad.returncode, 2)
    self.assertIn("unknown argument --bogus", bad.stderr)

  def test_bad_settings_are_refused_before_anything_runs(self):
    out = os.path.join(self.create_tempdir().full_path, "device_out")
    for env, named in ((dict(L_FAST="60s"), "L_FAST must be a whole number of seconds"),
                       (dict(L_RUN="0"), "L_RUN must be a whole number of seconds"),
                       (dict(BATCH_1B="4,0"), "BATCH_1B must be batch sizes > 0"),
                       (dict(DECODE_DTYPES="float16"), "DECODE_DTYPES must list float32"),
                       (dict(ONLY="bench_kernels,decode_2b"), "ONLY: 'decode_2b' names no part")):
      with self.subTest(env=env):
        done = _script(dict(env, OUT=out))
        self.assertEqual(done.returncode, 2)
        (line,) = done.stderr.strip().splitlines()
        self.assertIn(named, line)
        self.assertFalse(os.path.exists(out))  # nothing run, nothing written

  def test_a_part_at_its_limit_is_interrupted_so_pytest_writes_its_junit(self):
    with open(SCRIPT) as f:
      text = f.read()
    self.assertIn('timeout -s INT -k 10 "$limit" "$@"', text)  # the one place parts run
    self.assertNotRegex(text, r"timeout (-k|-s (TERM|KILL))")  # SIGTERM: pytest writes nothing

  def test_the_run_limit_cuts_and_skips_parts(self):
    out = os.path.join(self.create_tempdir().full_path, "device_out")
    env = {"OUT": out, "DEVICE_CHECK_ALLOW_CPU": "1", "ONLY": "ckpt_135m,bench_kernels"}
    # 12 s: the backend check leaves under 5 s once the 10 s to stop a part are set aside.
    done = _script(dict(env, L_RUN="12"))
    self.assertEqual(done.returncode, 1, done.stdout[-3000:] + done.stderr[-3000:])
    with open(os.path.join(out, "parts.json")) as f:
      parts = json.load(f)
    for name in ("ckpt_135m", "bench_kernels"):
      self.assertEqual((parts[name]["status"], parts[name]["limit"]), ("no_time", 0))
      self.assertIn("L_RUN=12s was spent", parts[name]["note"])
    # 45 s: the checkpoint's 60 s limit is cut to what is left of the run less those 10 s,
    # and the decode benchmark stops itself at half of the limit its part gets.
    done = _script(dict(env, ONLY="decode_135m_bfloat16", L_RUN="45"))
    with open(os.path.join(out, "parts.json")) as f:
      parts = json.load(f)
    self.assertLessEqual(parts["ckpt_135m"]["limit"], 35)
    limit = parts["decode_135m_bfloat16"]["limit"]
    self.assertBetween(limit, 5, 35)
    self.assertIn(f"(limit {limit}s)", done.stdout)
    self.assertIn(f"--max_seconds={limit // 2}\n", done.stdout)
    for name in ("ckpt_135m", "decode_135m_bfloat16"):
      self.assertLessEqual(parts[name]["seconds"], parts[name]["limit"] + 10)
    self.assertLessEqual(parts["_run"]["seconds"], 45)

  def test_refuses_without_an_accelerator(self):
    if jax.default_backend() in ("gpu", "tpu"):
      self.skipTest("this machine has an accelerator: the script would run")
    out = os.path.join(self.create_tempdir().full_path, "device_out")
    done = _script({"OUT": out})
    self.assertEqual(done.returncode, 2)
    (line,) = done.stderr.strip().splitlines()
    self.assertIn("refusing to run: jax.default_backend() is 'cpu'", line)
    self.assertEqual(done.stdout, "")
    self.assertFalse(os.path.exists(out))  # nothing written

  @pytest.mark.slow  # a child process per part: about 90 s on the 2-core machine
  def test_tiny_dry_run_layout(self):
    out = os.path.join(self.create_tempdir().full_path, "device_out")
    scratch = self.create_tempdir().full_path
    # An earlier run's files in a SCRATCH and OUT given again are not this run's results.
    os.makedirs(os.path.join(scratch, "work", "parts"))
    with open(os.path.join(scratch, "work", "parts", "kernel_tests.json"), "w") as f:
      f.write('{"seconds": 1, "rc": 0, "status": "ok", "limit": 1, "note": ""}')
    os.makedirs(out)
    with open(os.path.join(out, "fast_tier.xml"), "w") as f:
      f.write("<testsuites/>")
    done = _script({"OUT": out, "SCRATCH": scratch, "DEVICE_CHECK_ALLOW_CPU": "1",
                    "ONLY": "ckpt_135m,bench_kernels,decode_135m_bfloat16"}, timeout=600)
    self.assertEqual(done.returncode, 0, done.stdout[-3000:] + done.stderr[-3000:])
    self.assertEqual(sorted(os.listdir(out)), ["bench_kernels.json", "bench_kernels.md",
                                               "decode.md", "device_check.tar.gz",
                                               "parts.json"])
    with open(os.path.join(out, "parts.json")) as f:
      parts = json.load(f)
    self.assertTrue(parts["_run"]["tiny"])
    self.assertNotIn("kernel_tests", parts)
    with open(os.path.join(out, "decode.md")) as f:
      self.assertIn("weights and caches in bfloat16", f.read())
    for name in ("ckpt_135m", "bench_kernels", "decode_135m_bfloat16"):
      self.assertEqual(parts[name]["status"], "ok")
      self.assertLessEqual(parts[name]["seconds"], parts[name]["limit"])


class RandomCheckpointTest(absltest.TestCase):

  def test_reduced_checkpoint_loads_and_runs(self):
    directory = os.path.join(self.create_tempdir().full_path, "ckpt")
    done = subprocess.run([sys.executable, MAKER, "--shape=smollm2-135m", "--layers=2",
                           "--vocab=96", f"--out={directory}"], capture_output=True,
                          text=True, timeout=300, check=False)
    self.assertEqual(done.returncode, 0, done.stderr)
    params, config, tok = model_loading.load_model(directory)
    self.assertEqual((config.n_layers, config.hidden, config.n_heads, config.n_kv_heads,
                      config.head_dim, config.ffn_dim, config.vocab_size),
                     (2, 576, 9, 3, 64, 1536, 96))
    self.assertTrue(config.tie_embeddings)
    self.assertEqual((config.rope_theta, config.max_positions), (100000.0, 8192))
    self.assertEqual(tok.vocab_size, 96)
    self.assertEqual(tok.encode("t5 t95"), [0, 5, 95])  # <s> added
    emb = np.asarray(params["params"]["embed"]["embedding"])
    self.assertBetween(float(emb.std()), 0.015, 0.025)
    logits = llama.LlamaModel(config).apply(params, jnp.asarray([tok.encode("t5 t6 t7")]))
    self.assertEqual(logits.shape, (1, 4, 96))
    self.assertTrue(bool(jnp.all(jnp.isfinite(logits))))

  def test_shapes(self):
    maker = _maker()
    small = hf_loader.config_from_hf(maker.config_json("smollm2-135m"))
    self.assertEqual((small.n_layers, small.vocab_size), (30, 49152))
    big = hf_loader.config_from_hf(maker.config_json("llama-1b"))
    self.assertEqual((big.n_layers, big.hidden, big.n_heads, big.n_kv_heads, big.head_dim,
                      big.ffn_dim, big.vocab_size), (16, 2048, 32, 8, 64, 8192, 128256))
    self.assertTrue(big.tie_embeddings)
    self.assertGreaterEqual(big.max_positions, 16384)
    shapes = maker.tensor_shapes(maker.config_json("llama-1b"))
    self.assertBetween(sum(int(np.prod(s)) for s in shapes.values()), 1.2e9, 1.3e9)
    self.assertNotIn("lm_head.weight", shapes)  # tied
    with self.assertRaisesRegex(ValueError, "--layers must be >= 1"):
      maker.config_json("llama-1b", layers=0)
    with self.assertRaisesRegex(ValueError, "--shape must be one of"):
      maker.config_json("gpt2")


class KernelBenchCommandTest(absltest.TestCase):

  def test_tiny_cpu_plan_writes_bandwidth(self):
    out = os.path.join(self.create_tempdir().full_path, "bk.md")
    done = subprocess.run(
        [sys.executable, "-m", "experiments.bench_kernels", "--lengths=64", "--head_dims=8",
         "--batch=1", "--groups=2", "--repeats=1", "--iters=2", "--probe_mb=1",
         "--dtype=float32", f"--out={out}"],
        cwd=test_util.ROOT, capture_output=True, text=True, timeout=300, check=False)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    self.assertIn(f"jax {jax.__version__}", done.stdout)
    with open(os.path.splitext(out)[0] + ".json") as f:
      saved = json.load(f)
    (row,) = saved["rows"]
    self.assertFalse(saved["plan"]["pallas"])  # not in the CPU plan
    self.assertNotIn("pallas_offset", row["seconds"])
    self.assertGreater(row["bandwidth_gbps"], 0)
    self.assertGreater(row["gbps"]["stats_stored"], 0)
    self.assertGreater(row["fraction_of_bandwidth"]["offset"], 0)
    text = open(out).read()
    self.assertIn("probe GB/s", text)
    # One round: the median's interval is the single sample, coverage 0 (said, not ">= 95%").
    self.assertEqual(row["stats_over_offset_interval"][2], 0.0)
    self.assertIn("coverage 0.000 with 1 rounds", text)


if __name__ == "__main__":
  absltest.main()
