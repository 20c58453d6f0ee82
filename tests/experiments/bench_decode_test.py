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
from unittest import mock

from absl import flags
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import certkv_jax
from certkv_jax.attention.offset import AttentionConfig
from certkv_jax.kv import cache as cache_lib
from certkv_jax.kv import memory as memory_lib
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib.bench import decode as bench_decode
from experiments.lib.bench import decode_report as bench_decode_report
from models import forward
from models import llama
from tests import test_util


SCRIPT = os.path.join(test_util.ROOT, "scripts", "device_check.sh")
TINY_PLAN = ["--contexts=64", "--batches=1", "--repeats=3", "--designs=poisson_tail,h2o",
             "--budgets=0.25,0.5", "--n_sink=2", "--window=4", "--evict_every=1",
             "--layer_loop=scan"]
# A step's time over its floor (bytes / the streaming bandwidth measured in the same run)
# cannot fall far below 1: each is a median of per-round ratios, and on the shared 2-core
# machine a round's probe and step can each be off by some 10-20%; on the tiny model a
# step's fixed per-operation costs make it several times its floor.
FLOOR_TOLERANCE = 0.8


def _command(out, *extra):
  return subprocess.run([sys.executable, "-m", "experiments.bench_decode", f"--out={out}",
                         *extra], cwd=test_util.ROOT, capture_output=True, text=True,
                        timeout=1200, check=False)


class CommandTest(absltest.TestCase):

  @pytest.mark.slow  # a child process: about 10 compiles of the tiny model's decode step
  def test_tiny_plan_writes_every_budget_and_context(self):
    model = test_util.tiny_hf_dir(test_util.temp_dir(self, "bench_decode_model_"))
    out = test_util.temp_dir(self, "bench_decode_out_")
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
        test_util.tiny_hf_dir(test_util.temp_dir(self, "bench_decode_model_")))
    plan = bench_decode.Plan(designs=("poisson_tail",), budgets=(0.25, 0.5), contexts=(64,),
                             batches=(1,), repeats=2, certificate="without", n_sink=2,
                             window=4, evict_every=(1, 4), layer_loop=("scan",)).check()
    out = test_util.temp_dir(self, "bench_decode_out_")
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
    self.assertEqual(summary["evict_every"], 1)
    # Only amortized rows timed: the per-design tables are those of k = 4.
    only4 = dict(results, decode=[r for r in results["decode"]
                                  if r["design"] == "full" or r["evict_every"] == 4])
    s4 = bench_decode_report.summarize(only4)
    self.assertEqual(s4["evict_every"], 4)
    self.assertEqual(s4["ratio_vs_full"]["0.25"], {"64": quarter4["ratio_vs_full"]})
    self.assertEqual(s4["ratio_vs_full_amortized"], {})
    self.assertEqual(bench_decode_report.label(quarter4), "poisson_tail every 4")
    for r in results["decode"]:  # no batch 1 in a plan: the smallest batch, said in the note
      r["batch"] = 4
    head = bench_decode_report.headline(results)
    self.assertEqual(head["batch"], 4)
    self.assertIn("batch 1 not measured", head["note"])

  @pytest.mark.slow  # 4 compiles of the tiny model's decode step (2 configurations x 2 loops)
  def test_floor_and_layer_loops(self):
    test_util.ensure_flags_parsed()
    params, config, _ = model_loading.load_model(
        test_util.tiny_hf_dir(test_util.temp_dir(self, "bench_decode_model_")))
    plan = bench_decode.Plan(designs=("h2o",), budgets=(0.25,), contexts=(32,), batches=(1,),
                             repeats=3, certificate="with", n_sink=2, window=4,
                             evict_every=(1,), plain_prefill=False, compile_repeats=2).check()
    self.assertEqual(plan.layer_loop, ("scan", "unrolled"))  # the default: both
    out = test_util.temp_dir(self, "bench_decode_out_")
    with mock.patch.object(bench_decode.jax, "clear_caches", wraps=jax.clear_caches) as cleared:
      results = bench_decode.run(params, config, plan, out, model="tiny", log=lambda _: None)
    # Each compile-alone try starts from cleared caches: the module-level jitted functions
    # the step calls are traced again (2 tries x (4 steps + 2 evictions)), not read from
    # the timed calls' trace cache.
    self.assertGreaterEqual(cleared.call_count, 2 * (4 + 2))
    with open(os.path.join(out, "summary.json")) as f:
      summary = json.load(f)
    self.assertEqual(summary["layer_loop"], "unrolled")
    self.assertEqual(set(summary["bandwidth_gbps"]), {"32"})
    self.assertGreater(summary["bandwidth_gbps"]["32"], 0)
    self.assertEqual(set(summary["floor_multiple"]), {"full", "h2o"})
    self.assertEqual(summary["floor_multiple"]["full"].keys(), {"1.0"})
    self.assertEqual(summary["floor_multiple"]["h2o"].keys(), {"0.25"})
    for table in (summary["floor_multiple"], summary["layer_loop_ratio"]):
      for per_budget in table.values():
        for per_context in per_budget.values():
          self.assertEqual(set(per_context), {"32"})
    for r in results["decode"]:
      self.assertGreaterEqual(r["floor_multiple"], FLOOR_TOLERANCE, r)
      self.assertGreater(r["scan_over_unrolled"], 0)
    self.assertLen(results["decode"], 2 * 2)  # (full, h2o) x (scan, unrolled)
    for r in results["decode"]:  # --compile_repeats=2: two fresh compiles of each step
      self.assertLen(r["compile_samples_s"], 2)
      self.assertEqual(r["compile_min_s"], min(r["compile_samples_s"]))
      self.assertGreater(r["compile_min_s"], 0)
      if r["design"] == "full":
        self.assertNotIn("eviction_compile_samples_s", r)
      else:  # and the design's eviction alone
        self.assertLen(r["eviction_compile_samples_s"], 2)
        self.assertEqual(r["eviction_compile_min_s"], min(r["eviction_compile_samples_s"]))
        self.assertGreater(r["eviction_compile_min_s"], 0)
    self.assertEqual(set(summary["compile_min_s"]), {"full", "h2o+certificate"})
    self.assertEqual(set(summary["eviction_compile_min_s"]), {"h2o+certificate"})
    self.assertEqual([r["method"] for r in results["prefill"]], ["cached"])  # no plain
    with open(os.path.join(out, "report.md")) as f:
      report = f.read()
    self.assertIn("Scan over unrolled", report)
    self.assertIn("over its floor", report)
    self.assertIn("trace + lowering + compilation alone, the fastest of 2 (interleaved, each "
                  "from a fresh jit with JAX's caches cleared", report)
    self.assertTrue(all(r["compile_traces_cleared"] for r in results["decode"]))
    # Rows of runs made before the caches were cleared say that their tracing is not counted.
    old = [{k: v for k, v in r.items() if k != "compile_traces_cleared"}
           for r in results["decode"]]
    self.assertIn("most of the tracing is not counted", bench_decode_report.fresh_compiles(old))
    self.assertIn("its eviction alone, compiled the same way", report)
    # The weights' matrix-vector products alone: bytes as the floor counts them. The tiny
    # model's weights can sit in cache and beat the streaming probe (0.74 of the floor in a
    # clean-clone CI run), so only a positive multiple is asserted, not the steps' tolerance.
    (bw,) = results["bandwidth"]
    self.assertEqual(bw["matvec_bytes"], bench_decode.matvec_bytes(
        bench_decode.forward.unstack_layers(params, config), config))
    self.assertGreater(bw["matvec_floor_multiple"], 0)
    self.assertEqual(set(summary["matvec_floor_multiple"]), {"32"})
    self.assertIn("Matrix-vector floor", report)
    # The full cache's attention alone: its keys' and values' bytes, over their floor.
    caches = certkv_jax.kv.caches.init_caches(config, 1, 32 + plan.n_calls * plan.steps_per_call)
    self.assertEqual(bw["attention_bytes"], caches.k.nbytes + caches.v.nbytes)
    self.assertGreaterEqual(bw["attention_floor_multiple"], FLOOR_TOLERANCE)
    self.assertEqual(set(summary["attention_floor_multiple"]), {"32"})
    self.assertIn("Attention floor", report)
    self.assertRegex(report, r"batch 1 n=32: [0-9.]+ = [0-9.]+ \+ [0-9.]+ \+ -?[0-9.]+")

  def test_bad_flag_fails_naming_it(self):
    done = _command(test_util.temp_dir(self, "bench_decode_out_"), "--budgets=0.25,1.5")
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
                    (dict(evict_every=(3, 4)), "--evict_every values must divide the largest"),
                    (dict(layer_loop=("while",)), r"--layer_loop must be a list of \['scan'"),
                    (dict(layer_loop=()), "--layer_loop must not be empty"),
                    (dict(prefill_chunk=-1), r"--prefill_chunk must be an int in \[0, inf\]"),
                    (dict(compile_repeats=-1), r"--compile_repeats must be an int in \[0, 100\]")):
      with self.subTest(msg=msg):
        with self.assertRaisesRegex(ValueError, msg):
          bench_decode.Plan(**dict(dict(contexts=(64,)), **kw)).check(max_positions=100)
    self.assertEqual(bench_decode.Plan().check(max_positions=8192).certificate_modes,
                     (False, True))

  def test_flags_are_parsed_and_quick_keeps_the_flags_given(self):
    def parse(*argv):
      fv = flags.FlagValues()
      plan_flags.define_flags(bench_decode.Plan, fv)
      flags.DEFINE_bool("quick", False, "Quick.", flag_values=fv)
      fv(["bench_decode", *argv])
      return bench_decode.plan_from_flags(fv)

    plan = parse("--designs=h2o", "--quick", "--layer_loop=unrolled", "--noplain_prefill")
    self.assertEqual(plan.designs, ("h2o",))  # given: kept
    self.assertEqual((plan.layer_loop, plan.plain_prefill), (("unrolled",), False))
    self.assertEqual(plan.evict_every, bench_decode.QUICK["evict_every"])
    self.assertEqual(plan.contexts, bench_decode.QUICK["contexts"])  # not given: quick's
    self.assertEqual(parse("--contexts=64,128").contexts, (64, 128))
    with self.assertRaisesRegex(ValueError, "--contexts entries must be ints"):
      parse("--contexts=1k")

  def test_chunked_prefill_matches_one_call(self):
    # A 40-token prompt in chunks of 16 (16 + 16 + 8, the last right-padded) against one
    # call: the same last logits and caches up to float32 summation order.
    config = test_util.tiny_config()
    params = test_util.tiny_params(config)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, config.vocab_size)
    mask = jnp.ones((2, 40), bool)
    design = certkv_jax.designs.registry.make("h2o", 0.5)
    for d in (None, design):
      one = bench_decode._prefill_fn(config, d, 48)(params, tokens, mask)
      chunked = bench_decode._prefill_fn(config, d, 48, chunk=16)(params, tokens, mask)
      jax.tree_util.tree_map(
          lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), one, chunked)

  def test_median_interval(self):
    three = bench_decode.median_interval([3.0, 1.0, 2.0])
    self.assertEqual((three["median"], three["lo"], three["hi"], three["level"]),
                     (2.0, 1.0, 3.0, 0.75))  # [min, max] covers the median 1 - 2^(1-n)
    eleven = bench_decode.median_interval(np.arange(11.0))
    self.assertEqual((eleven["lo"], eleven["hi"]), (1.0, 9.0))  # x_(2), x_(10)
    self.assertGreaterEqual(eleven["level"], 0.95)


class FloorTest(absltest.TestCase):

  def test_floor_bytes(self):
    config = test_util.tiny_config()  # untied: a step reads one embedding row
    emb = np.zeros((config.vocab_size, config.hidden), np.float32)
    params = {"params": {"embed": {"embedding": emb}, "w": np.zeros((10,), np.float32)}}
    weights = emb.nbytes // config.vocab_size + 40
    self.assertEqual(bench_decode.weight_bytes(params, config), weights)
    tied = config.replace(tie_embeddings=True)
    self.assertEqual(bench_decode.weight_bytes(params, tied), emb.nbytes + 40)
    caches = config.n_layers * 3 * config.n_kv_heads  # batch 3
    kv = 2 * config.head_dim * 4
    self.assertEqual(bench_decode.floor_bytes(params, config, None, 7, 3),
                     weights + caches * 7 * kv)
    design = certkv_jax.designs.poisson_tail(
        0.5, certain=certkv_jax.designs.CertaintySet(n_sink=1, window=2))
    self.assertEqual(bench_decode.floor_bytes(params, config, design, 7, 3),
                     weights + caches * 7 * memory_lib.slot_bytes(design, config.head_dim))
    # v_sq (4 bytes a slot) is read by the certificate, whichever design runs it.
    self.assertEqual(bench_decode.floor_bytes(params, config, design, 7, 3, certificate=False),
                     weights + caches * 7 * (memory_lib.slot_bytes(design, config.head_dim) - 4))
    snapkv = certkv_jax.designs.snapkv(0.5)
    for cert, extra in ((None, 0), (False, 0), (True, 4)):
      self.assertEqual(
          bench_decode.floor_bytes(params, config, snapkv, 7, 3, certificate=cert),
          weights + caches * 7 * (memory_lib.slot_bytes(snapkv, config.head_dim) + extra))

  def test_matvec_probe_reads_what_the_floor_counts(self):
    config = test_util.tiny_config()  # untied: the embedding is not a matvec
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(config.vocab_size, config.hidden)).astype(np.float32)
    w = rng.normal(size=(config.hidden, 5)).astype(np.float32)
    norm = rng.normal(size=(config.hidden,)).astype(np.float32)
    params = {"params": {"embed": {"embedding": emb}, "layers": ({"w": w, "norm": norm},)}}
    self.assertEqual(bench_decode.matvec_bytes(params, config), w.nbytes + norm.nbytes)
    got = bench_decode._matvec_fn(config, 2)(params)
    np.testing.assert_allclose(got, 2 * w.sum() + norm.sum(), rtol=1e-5)
    tied = config.replace(tie_embeddings=True)
    self.assertEqual(bench_decode.matvec_bytes(params, tied), emb.nbytes + w.nbytes + norm.nbytes)
    np.testing.assert_allclose(bench_decode._matvec_fn(tied, 2)(params),
                               2 * (emb.sum() + w.sum()) + norm.sum(), rtol=1e-4)

  def test_attention_probe_is_the_full_caches_softmax_attention(self):
    config = test_util.tiny_config()
    rng = np.random.default_rng(1)
    caches = certkv_jax.kv.caches.init_caches(config, 2, 6)
    n_valid = 4  # slots 4 and 5 empty: masked out
    k = rng.normal(size=caches.k.shape).astype(np.float32)
    v = rng.normal(size=caches.v.shape).astype(np.float32)
    caches = caches.replace(
        k=jnp.asarray(k), v=jnp.asarray(v), valid=caches.valid.at[..., :n_valid].set(True),
        pos=jnp.broadcast_to(jnp.arange(6, dtype=caches.pos.dtype), caches.pos.shape),
        log_pi=jnp.zeros_like(caches.log_pi))
    args = bench_decode.attention_inputs(caches, config, n_valid, jax.random.PRNGKey(0))
    per_layer, qg, positions = args
    self.assertLen(per_layer, config.n_layers)
    self.assertEqual(qg.shape, (2, config.n_kv_heads, config.n_heads // config.n_kv_heads, 1,
                                config.head_dim))
    np.testing.assert_array_equal(positions, [[n_valid], [n_valid]])
    got = bench_decode._attention_fn()(*args)
    q, want = np.asarray(qg)[:, :, :, 0], 0.0  # [b, h, g, d]
    for layer in range(config.n_layers):  # each layer's output is the next one's query
      logits = np.einsum("bhgd,bhnd->bhgn", q, k[layer, ..., :n_valid, :]) / np.sqrt(
          config.head_dim)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      q = np.einsum("bhgn,bhnd->bhgd", p, v[layer, ..., :n_valid, :])
      want += q.sum()
    self.assertGreater(config.n_layers, 1)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    self.assertEqual(bench_decode.attention_bytes(caches), k.nbytes + v.nbytes)

  def test_matvec_probe_multiplies_every_kernel_of_the_model(self):
    config = test_util.tiny_config()
    rng = np.random.default_rng(3)
    qkv = rng.normal(size=(config.hidden, 2, 3, 4)).astype(np.float32)  # a fused projection
    params = {"params": {"layers": ({"qkv_proj": {"kernel": qkv}},)}}
    want = (np.ones((2, config.hidden), np.float32) @ qkv.reshape(config.hidden, -1)).sum()
    np.testing.assert_allclose(bench_decode._matvec_fn(config, 2)(params), want, rtol=1e-5)
    # The model's own per-layer params: one product per kernel, the fused qkv_proj included.
    model = llama.LlamaModel(config)
    real = forward.unstack_layers(
        model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)), config)
    kernels = [w for w in jax.tree_util.tree_leaves(real) if w.ndim >= 2]
    self.assertTrue(any(w.ndim == 4 for w in kernels))  # qkv_proj
    jaxpr = jax.make_jaxpr(bench_decode._matvec_fn(config, 2))(real)
    products = [e for _, e in test_util.equations(jaxpr.jaxpr)
                if e.primitive.name == "dot_general"]
    self.assertLen(products, len(kernels) - (0 if config.tie_embeddings else 1))

  def test_probes_make_iters_passes_in_one_call_with_nothing_hoisted(self):
    config = test_util.tiny_config()
    model = llama.LlamaModel(config)
    params = forward.unstack_layers(
        model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)), config)
    caches = certkv_jax.kv.caches.init_caches(config, 2, 6)
    caches = caches.replace(
        k=jax.random.normal(jax.random.PRNGKey(1), caches.k.shape),
        v=jax.random.normal(jax.random.PRNGKey(2), caches.v.shape),
        valid=caches.valid.at[..., :4].set(True),
        pos=jnp.broadcast_to(jnp.arange(6, dtype=caches.pos.dtype), caches.pos.shape))
    att_args = bench_decode.attention_inputs(caches, config, 4, jax.random.PRNGKey(3))
    buf = jnp.arange(10, dtype=jnp.float32)
    for name, make, args in (("read", bench_decode._read_fn, (buf,)),
                             ("matvec", lambda i: bench_decode._matvec_fn(config, 2, i),
                              (params,)),
                             ("attention", bench_decode._attention_fn, att_args)):
      with self.subTest(name):
        one, three = float(make(1)(*args)), float(make(3)(*args))
        np.testing.assert_allclose(three, 3 * one, rtol=1e-5)
        # All the work is in the loop's body: the entry computation only starts it (a
        # hoisted read or product would be a fusion, dot or reduce there).
        text = make(3).lower(*args).compile().as_text()
        entry = text[text.index("\nENTRY"):]
        self.assertNotRegex(entry, r"= [^=]*\b(fusion|dot|reduce|convolution|custom-call)\(")
        self.assertIn("while", entry)

  def test_attention_probe_reads_values_as_the_step_does(self):
    config = test_util.tiny_config()
    caches = certkv_jax.kv.caches.init_caches(config, 1, 6, jnp.bfloat16)
    args = bench_decode.attention_inputs(caches, config, 4, jax.random.PRNGKey(0))
    float32_products = lambda split: sum(  # probabilities times values, per layer
        1 for _, e in test_util.equations(jax.make_jaxpr(bench_decode._attention_fn(
            1, AttentionConfig(split_values=split)))(*args).jaxpr)
        if e.primitive.name == "dot_general"
        and all(v.aval.dtype == jnp.float32 for v in e.invars))
    self.assertEqual(float32_products(False), config.n_layers)  # a float32 copy of the values
    self.assertEqual(float32_products(True), 0)  # the values multiplied as stored

  def test_matvec_probe_chains_each_product_on_the_latest_of_its_width(self):
    config = test_util.tiny_config()
    rng = np.random.default_rng(2)
    w1 = rng.normal(size=(config.hidden, 5)).astype(np.float32)
    w2 = rng.normal(size=(5, 3)).astype(np.float32)
    params = {"params": {"layers": ({"a": w1}, {"b": w2})}}
    y1 = np.ones((2, config.hidden), np.float32) @ w1
    x2 = y1 / np.sqrt(np.mean(y1 * y1, axis=-1, keepdims=True) + 1e-6)
    want = y1.sum() + (x2 @ w2).sum()  # unchained, w2 would see ones: 2 * w2.sum()
    np.testing.assert_allclose(bench_decode._matvec_fn(config, 2)(params), want, rtol=1e-5)
    self.assertGreater(abs(want - (y1.sum() + 2 * w2.sum())), 1e-3)

  def test_summary_and_report_from_rows(self):
    row = lambda design, budget, loop, ms, fm, ratio: dict(
        context=64, batch=1, design=design, certificate=design != "full", budget=budget,
        evict_every=1, layer_loop=loop, capacity=70, kept_tokens=64, new_executable=True,
        samples=[ms], median=ms, ci=[ms, ms], ci_level=0.5, compile_s=1.0, first_call=2.0,
        ratio_vs_full=ms / 2.0, ratio_vs_full_ci=[0.4, 0.6], floor_multiple=fm,
        floor_multiple_ci=[fm, fm], scan_over_unrolled=ratio, scan_over_unrolled_ci=[1, 3])
    results = dict(model="tiny", device="cpu", complete=True, cells_done=[[64, 1]],
                   cells_skipped=[], warmup_calls=2, prefill=[],
                   plan=dict(designs=["h2o"], budgets=[0.25], certificate="with",
                             capacity="compact", repeats=1, evict_every=[1],
                             layer_loop=["scan", "unrolled"]),
                   bandwidth=[dict(context=64, batch=1, bytes=100, samples=[1e-8], gbps=10.0)],
                   decode=[row("full", None, "scan", 4.0, 2.0, 2.0),
                           row("full", None, "unrolled", 2.0, 1.2, 2.0),
                           row("h2o", 0.25, "scan", 3.0, 1.9, 3.0),
                           row("h2o", 0.25, "unrolled", 1.0, 1.1, 3.0)])
    summary = bench_decode_report.summarize(results)
    self.assertEqual(summary["layer_loop"], "unrolled")
    self.assertEqual(summary["bandwidth_gbps"], {"64": 10.0})
    self.assertEqual(summary["floor_multiple"], {"full": {"1.0": {"64": 1.2}},
                                                 "h2o": {"0.25": {"64": 1.1}}})
    self.assertEqual(summary["layer_loop_ratio"], {"full": {"1.0": {"64": 2.0}},
                                                   "h2o": {"0.25": {"64": 3.0}}})
    self.assertEqual(summary["ratio_vs_full"], {"0.25": {"64": 0.5}})  # the unrolled rows
    report = bench_decode_report.render(results, summary)
    self.assertIn("| h2o+certificate [unrolled] | 0.25 | 0.50 [0.40, 0.60] / 1.10x |", report)
    self.assertIn("batch 1 n=64: 10.0", report)


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
    for part in ("tests/pallas_kernels/offset_decode_test.py::KernelTest", "-m experiments.bench_kernels",
                 "-m experiments.bench_decode"):
      self.assertIn(part, text)


if __name__ == "__main__":
  absltest.main()
