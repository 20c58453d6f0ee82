r"""Sharded decoding benchmark: per-device memory and step time for (data, model, seq) meshes.

For each mesh shape it runs ``models.decode.generate`` as ``models.sharding.generate``
places it (prefill, one
eviction, greedy decode with a certificate per step, evicting after every
step) on a random Llama-family model, and reports

* per-device bytes of the caches and of the parameters, read from the
  arrays' ``addressable_shards`` (what each device actually holds), against
  the one-device totals: caches should be 1/N per device for an N-device mesh,
  parameters ``1/model`` of the attention and MLP weights plus the
  replicated embedding, head and norms;
* XLA's compiled per-device memory (arguments, outputs, temporaries) where the
  backend reports it;
* the wall time of the whole generate call (median of ``--repeats``) and per
  generated token;
* agreement with one device (max |logit difference|, same tokens).

On fake CPU devices (``--fake_devices=N`` sets
``--xla_force_host_platform_device_count=N`` before jax starts) the devices
share the host's cores, so the times say nothing about speed-up: the memory
accounting and the agreement are what this measures there. On a multi-GPU
host or a TPU slice leave ``--fake_devices`` at 0.

The command (its ``--fake_devices`` must take effect before jax starts):
``python -m experiments.bench_sharding --fake_devices=8
--out=experiments/results/bench_sharding_cpu.md``.
"""

import dataclasses
import json
import os
import platform
import statistics
import time

import jax
from jax.sharding import PartitionSpec as P
import numpy as np

from certkv_jax.kv import distributed
from experiments.lib import design_defaults
from experiments.lib import plan_flags
from experiments.lib import results_io
from models import decode
from models import llama
from models import sharding
from models.config import LlamaConfig


def parse_mesh(text: str) -> tuple:
  """``"2x4x1"`` -> (2, 4, 1); ValueError naming the flag otherwise."""
  parts = text.lower().split("x")
  if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
    raise ValueError(f"--meshes entries must be data x model x seq with ints >= 1, e.g. "
                     f"2x4x1; got {text!r}")
  return tuple(int(p) for p in parts)


def _leaf_bytes(tree) -> tuple:
  """(total bytes, max bytes on one device) of a tree of jax arrays."""
  total = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree))
  per = distributed.per_device_bytes(tree)
  return total, max(per.values())


def _memory(compiled) -> dict:
  """XLA's per-device memory of the compiled generate (absent where unsupported)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    m = None
  if m is None:
    return {}
  return {"xla_argument_bytes": int(m.argument_size_in_bytes),
          "xla_output_bytes": int(m.output_size_in_bytes),
          "xla_temp_bytes": int(m.temp_size_in_bytes)}


def run_one(shape, config, params, inputs, gen: decode.GenerationConfig, ref,
            repeats: int) -> dict:
  """Compiles ``models.decode.generate`` (``inputs``: host ``(tokens, mask)``) for one
  mesh, times it, reads its memory."""
  mesh = distributed.make_mesh(*shape)
  tokens, mask = inputs
  t0 = time.perf_counter()
  # As models.sharding.generate places them: params sharded, rows split over data.
  sharding.check_model(config, mesh, batch=tokens.shape[0], capacity=gen.capacity)
  placed = sharding.shard_params(params, config, mesh)
  args = [sharding.global_array(x, mesh, P(distributed.DATA) if x.ndim == 2 else P())
          for x in (tokens, mask, np.asarray(jax.random.PRNGKey(0)))]
  with jax.set_mesh(mesh):
    jitted = getattr(decode.generate, "__wrapped__", decode.generate)  # the jax.jit object
    compiled = jitted.lower(placed, *args, config=config, gen=gen).compile()
  gen_out = jax.block_until_ready(compiled(placed, *args))
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(placed, *args))
    times.append(time.perf_counter() - t0)
  cache_total, cache_dev = _leaf_bytes(gen_out.caches)
  param_total, param_dev = _leaf_bytes(placed)
  row = {
      "mesh": "x".join(map(str, shape)), "devices": int(mesh.devices.size),
      "cache_bytes_total": cache_total, "cache_bytes_per_device": cache_dev,
      "cache_fraction_per_device": cache_dev / cache_total,
      "param_bytes_total": param_total, "param_bytes_per_device": param_dev,
      "compile_and_first_call_s": first, "generate_s": statistics.median(times),
      "ms_per_token": 1e3 * statistics.median(times) / gen.n_steps,
      "same_tokens": bool(np.array_equal(np.asarray(gen_out.tokens), np.asarray(ref.tokens))),
      "max_logit_diff": float(np.max(np.abs(np.asarray(gen_out.logits)
                                            - np.asarray(ref.logits)))),
  }
  row.update(_memory(compiled))
  return row


def render(rows, device, setup) -> str:
  mib = lambda b: f"{b / 2**20:.3f}"
  lines = [f"# Sharded decoding on {device}", "", setup, "",
           "| mesh (d x m x s) | devices | cache MiB total | cache MiB / device | fraction | "
           "params MiB / device | XLA temp MiB / device | generate s | ms / token | "
           "same tokens | max logit diff |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    temp = r.get("xla_temp_bytes")
    lines.append(
        f"| {r['mesh']} | {r['devices']} | {mib(r['cache_bytes_total'])} | "
        f"{mib(r['cache_bytes_per_device'])} | {r['cache_fraction_per_device']:.4f} | "
        f"{mib(r['param_bytes_per_device'])} | {'-' if temp is None else mib(temp)} | "
        f"{r['generate_s']:.3f} | {r['ms_per_token']:.1f} | {r['same_tokens']} | "
        f"{r['max_logit_diff']:.2e} |")
  lines += ["", "Cache bytes per device include the per-head counters (``n_seen``, "
            "``n_dropped``), replicated over seq; the slot arrays are exactly 1/N per device. "
            "XLA temp is the compiled program's per-device scratch (gathered eviction "
            "metadata, logits, attention temporaries).",
            "", "Times on fake CPU devices share the host's cores: they measure the "
            "overhead of the partitioned program, not a speed-up. On fake devices a seq "
            "axis is slow because every device repeats the eviction on its heads' gathered "
            "metadata, and all devices share the same cores."]
  return "\n".join(lines) + "\n"


def _check_bounds(bounds) -> None:
  for name, v, lo in bounds:
    if v < lo:
      raise ValueError(f"--{name} must be >= {lo}, got {v}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`run_and_report` measures; each setting is a flag of ``python -m
  experiments.bench_sharding``."""

  meshes: tuple = plan_flags.setting(("1x1x1", "8x1x1", "2x4x1", "1x2x4", "1x1x8"),
                                     "Mesh shapes data x model x seq.")
  batch: int = plan_flags.setting(8, "Prompts.")
  prompt_len: int = plan_flags.setting(192, "Prompt tokens.")
  capacity: int = plan_flags.setting(256, "Cache slots per (layer, row, KV head).")
  n_steps: int = plan_flags.setting(8, "Decode steps.")
  design: str = plan_flags.setting("poisson_tail", "Design name "
                                   "(certkv_jax.designs.registry).")
  budget: float = plan_flags.setting(0.5, "Budget fraction.")
  repeats: int = plan_flags.setting(3, "Timed repetitions (median).")
  fake_devices: int = plan_flags.setting(0, "Fake CPU devices (0: the real devices); read "
                                         "before jax starts.")

  def check(self) -> "Plan":
    _check_bounds((("batch", self.batch, 1), ("prompt_len", self.prompt_len, 1),
                   ("capacity", self.capacity, 1), ("n_steps", self.n_steps, 1),
                   ("repeats", self.repeats, 1), ("fake_devices", self.fake_devices, 0),
                   ("budget", self.budget, 0.0)))
    if self.budget > 1.0:
      raise ValueError(f"--budget must be <= 1, got {self.budget}")
    return self


@dataclasses.dataclass(frozen=True)
class Model:
  """The random Llama-family model's shape; each setting is a flag of ``python -m
  experiments.bench_sharding``."""

  n_layers: int = plan_flags.setting(4, "Decoder layers.")
  hidden: int = plan_flags.setting(256, "Residual width.")
  n_heads: int = plan_flags.setting(8, "Query heads.")
  n_kv_heads: int = plan_flags.setting(8, "KV heads.")
  head_dim: int = plan_flags.setting(32, "Head dimension.")
  ffn_dim: int = plan_flags.setting(512, "MLP width.")
  vocab: int = plan_flags.setting(512, "Vocabulary size.")

  def check(self) -> "Model":
    _check_bounds((("n_layers", self.n_layers, 1), ("hidden", self.hidden, 1),
                   ("n_heads", self.n_heads, 1), ("n_kv_heads", self.n_kv_heads, 1),
                   ("head_dim", self.head_dim, 2), ("ffn_dim", self.ffn_dim, 1),
                   ("vocab", self.vocab, 2)))
    return self

  def config(self) -> LlamaConfig:
    return LlamaConfig(vocab_size=self.vocab, hidden=self.hidden, n_layers=self.n_layers,
                       n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                       head_dim=self.head_dim, ffn_dim=self.ffn_dim)


def run_and_report(plan: Plan, config: LlamaConfig, *, out=None) -> list[dict]:
  """The command: generates on a random model of ``config`` for every mesh of
  ``plan.meshes`` (``"2x4x1"``: data x model x seq), measures each (:func:`run_one`),
  writes the markdown table to ``out`` (JSONL rows beside it, resumable); returns the
  rows."""
  shapes = [parse_mesh(m) for m in plan.meshes]
  batch, prompt_len, capacity = plan.batch, plan.prompt_len, plan.capacity
  if prompt_len > capacity:
    raise ValueError(f"--prompt_len ({prompt_len}) must be <= --capacity ({capacity})")
  for shape in shapes:  # fail fast, before any compile
    if int(np.prod(shape)) > jax.device_count():
      raise ValueError(f"mesh {shape} needs {int(np.prod(shape))} devices, "
                       f"{jax.device_count()} available (use --fake_devices on CPU)")
    sharding.check_model(config, jax.sharding.AbstractMesh(shape, distributed.AXES),
                         batch=batch, capacity=capacity)
  device = (f"{jax.device_count()} x {jax.devices()[0].device_kind} ({jax.default_backend()}"
            f"{', fake' if plan.fake_devices else ''}), {platform.machine()}, "
            f"jax {jax.__version__}")
  setup = (f"Model: {config.n_layers} layers, hidden {config.hidden}, {config.n_heads} heads / "
           f"{config.n_kv_heads} KV heads x {config.head_dim}, ffn {config.ffn_dim}; batch "
           f"{batch}, prompt {prompt_len}, capacity {capacity}, "
           f"{plan.n_steps} decode steps, design {plan.design} at budget {plan.budget}, "
           "evicting after every step, certificate statistics every step.")
  print(device, "\n", setup, flush=True)
  params = llama.init_params(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.vocab_size, (batch, prompt_len)).astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  gen = decode.GenerationConfig(
      n_steps=plan.n_steps, design=design_defaults.make_design(plan.design, plan.budget),
      capacity=capacity, evict_each_step=True, return_logits=True)
  ref = decode.generate(params, tokens, mask, jax.random.PRNGKey(0), config=config, gen=gen)
  results = None
  if out:
    results = results_io.JsonlResults(os.path.splitext(out)[0] + ".jsonl",
                                      ("mesh", "setup"))
  rows = []
  progress = results_io.Progress(len(shapes))
  for shape in shapes:
    name = "x".join(map(str, shape))
    if results is not None and results.has(mesh=name, setup=setup):
      rows.append(next(r for r in results.rows if r["mesh"] == name and r["setup"] == setup))
      progress.step()
      continue
    row = run_one(shape, config, params, (tokens, mask), gen, ref, plan.repeats)
    row["setup"] = setup
    print(json.dumps(row), progress.step(), flush=True)
    rows.append(row)
    if results is not None:
      results.add(row)
      results_io.atomic_write_text(out, render(rows, device, setup))
  if out:
    results_io.atomic_write_text(out, render(rows, device, setup))
  print(render(rows, device, setup))
  return rows
