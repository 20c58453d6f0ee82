r"""Prefill benchmark: peak memory and time of the chunked prefill against the one-shot one.

Two ways to fill empty caches with a ``context``-token prompt (no design, no
certificate statistics, nothing evicted; the last token's logits and the caches
returned):

* ``oneshot``: one ``models.forward.forward_chunk`` call on the whole prompt,
  as ``models.decode.generate`` prefills: ``[batch, heads, context, capacity]``
  attention scores per layer and ``[batch, context, vocab]`` logits;
* ``chunked_<c>``: ``models.prefill.prefill`` with ``chunk=c``: a ``lax.scan``
  of ``forward_chunk`` over chunks, ``[batch, heads, c, capacity]`` scores and
  the last chunk's logits only.

The capacity is the context. Each (context, mode) runs in a fresh child process
(``python -m experiments.bench_prefill --_child=...``), so that its memory is
its own: the child loads the model, resets its peak resident set size
(``/proc/self/clear_refs``, Linux) so that loading's transient peak does not
count, compiles the prefill ahead of time (``jit(...).lower().compile()``:
``compile_s``) and calls it ``--repeats`` times (fewer once ``--max_seconds``
of calls have run, at least one). Per row, in MiB:

* ``load_rss_mib``: resident after loading the parameters and the prompt;
* ``compile_peak_rss_mib``, ``run_peak_rss_mib``: the peak while compiling
  and while calling (the high-water mark, ``VmHWM``, reset before each);
* ``peak_rss_mib``: the larger of the two, the configuration's peak;
* ``working_mib``: ``peak_rss_mib - load_rss_mib``, the prefill's own memory
  (scores, activations, the output caches, the executable);
* ``load_peak_rss_mib``: the peak while loading (reading and converting the
  weights), before the reset;
* ``process_peak_rss_mib``: the child's peak over its whole life, loading
  included (the larger of the two peaks: the reset resets ``ru_maxrss`` too).

Without ``clear_refs`` the peaks are the process's ``ru_maxrss``
(``peak_reset`` False). Times: ``median_s`` of the calls and
``tokens_per_s = batch * context / median_s``.

Outputs under ``--out``: ``results.json`` (every row, rewritten atomically as
each finishes; a rerun skips the rows there and retries failed ones),
``summary.json`` (``peak_rss_mib[mode][context]``, ``working_mib``,
``tokens_per_s``, ``median_s``, ``compile_s``, ``device``, ``model``) and
``report.md``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib.bench import flags

CONTEXTS = (1024, 2048, 4096, 8192)
CHUNKS = (512,)
ONESHOT = "oneshot"
KEY_FIELDS = ("model", "batch", "context", "mode")
ROW_PREFIX = "PREFILL_ROW "  # the child's result line on stdout
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


@dataclasses.dataclass(frozen=True)
class Plan:
  """What to measure (each setting a flag of ``experiments/bench_prefill.py``)."""

  contexts: tuple = plan_flags.setting(CONTEXTS, "Prompt lengths (tokens).")
  chunks: tuple = plan_flags.setting(
      CHUNKS, "Chunk sizes of the chunked prefill (those shorter than a context are "
      "measured at it).")
  oneshot_max: int = plan_flags.setting(
      4096, "Largest context also measured one-shot (one-shot at 8k may exhaust memory).")
  batch: int = plan_flags.setting(1, "Prompts per call.")
  repeats: int = plan_flags.setting(3, "Timed calls per configuration.")
  max_seconds: float = plan_flags.setting(
      0.0, "No more timed calls of a configuration after this many seconds of them (at "
      "least one; 0: no limit).")
  seed: int = plan_flags.setting(0, "Seed of the random prompts.")
  child_timeout: float = plan_flags.setting(
      3600.0, "Seconds a configuration's process may run (0: no limit).")

  def check(self, max_positions: Optional[int] = None) -> "Plan":
    """Raises ValueError naming the flag and its allowed values; returns the plan."""
    for flag, vals in (("contexts", self.contexts), ("chunks", self.chunks)):
      if not vals:
        raise ValueError(f"--{flag} must not be empty")
      if len(set(vals)) != len(vals):
        raise ValueError(f"--{flag} has duplicates: {list(vals)}")
    hi = max_positions if max_positions is not None else 1 << 20
    for c in self.contexts:
      flags.check_int("contexts", c, 1, hi)
    for c in self.chunks:
      flags.check_int("chunks", c, 1, 1 << 20)
    flags.check_int("oneshot_max", self.oneshot_max, 0, 1 << 20)
    flags.check_int("batch", self.batch, 1, 4096)
    flags.check_int("repeats", self.repeats, 1, 10000)
    flags.check_int("seed", self.seed, 0)
    for flag in ("max_seconds", "child_timeout"):
      v = getattr(self, flag)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"--{flag} must be a number >= 0, got {v!r}")
    return self

  def configurations(self) -> list[tuple[int, str, Optional[int]]]:
    """``(context, mode, chunk)`` in order: per context, one-shot (up to
    ``oneshot_max``) then each chunk shorter than the context."""
    out = []
    for context in self.contexts:
      if context <= self.oneshot_max:
        out.append((context, ONESHOT, None))
      out += [(context, f"chunked_{c}", c) for c in self.chunks if c < context]
    return out


def plan_from_flags(fv) -> Plan:
  """The checked :class:`Plan` of the flags."""
  return plan_flags.plan_from_flags(Plan, fv)


# --- the child: one configuration ------------------------------------------------------------

def _status_mib(field: str) -> Optional[float]:
  """``VmRSS`` / ``VmHWM`` of this process in MiB (None off Linux)."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) / 1024.0
  except OSError:
    pass
  return None


def _maxrss_mib() -> float:
  kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return kib / (1 << 20) if sys.platform == "darwin" else kib / 1024.0  # bytes on macOS


def _reset_peak() -> bool:
  """Resets this process's ``VmHWM`` to its current RSS; False where that is unavailable."""
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
    return _status_mib("VmHWM") is not None
  except OSError:
    return False


def _peak_mib(reset: bool) -> float:
  return _status_mib("VmHWM") if reset else _maxrss_mib()


def device_name() -> str:
  import jax  # pylint: disable=g-import-not-at-top
  d = jax.devices()[0]
  return (f"{d.device_kind} ({jax.default_backend()}), {platform.machine()}, "
          f"{os.cpu_count()} CPUs, jax {jax.__version__}")


def _prefill_fn(mode: str, config, context: int, chunk: Optional[int]):
  """The jitted ``(params, tokens, mask) -> (last logits, caches)`` of ``mode``."""
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from certkv_jax.kv import caches as caches_lib  # pylint: disable=g-import-not-at-top
  from certkv_jax import layer as layer_lib  # pylint: disable=g-import-not-at-top
  from models import forward  # pylint: disable=g-import-not-at-top
  from models import prefill  # pylint: disable=g-import-not-at-top
  if mode != ONESHOT:
    return jax.jit(functools.partial(prefill.prefill, config=config, capacity=context,
                                     chunk=chunk))

  def oneshot(params, tokens, mask):  # as models.decode.generate prefills
    caches = caches_lib.init_caches(config, tokens.shape[0], context)
    logits, caches, _, _ = forward.forward_chunk(params, config, tokens, mask, caches,
                                                 settings=layer_lib.Settings(certificate=False))
    last = jnp.sum(mask, axis=1) - 1
    return logits[jnp.arange(tokens.shape[0]), last], caches
  return jax.jit(oneshot)


def measure(spec: dict, log: Callable[[str], None] = print) -> dict:
  """Measures one configuration in this process: the child's work.

  Args:
    spec: ``model``, ``batch``, ``context``, ``mode``, ``chunk``, ``repeats``,
      ``max_seconds``, ``seed`` (:func:`child_spec`).
    log: progress lines.

  Returns:
    The row: the spec's key fields and the measurements (module docstring).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments.lib import model_loading  # pylint: disable=g-import-not-at-top
  context, batch, mode = spec["context"], spec["batch"], spec["mode"]
  t0 = time.perf_counter()
  params, config, _ = model_loading.load_model(spec["model"])
  params = jax.block_until_ready(jax.device_put(params))
  key = jax.random.fold_in(jax.random.PRNGKey(spec["seed"]), context)
  tokens = jax.random.randint(key, (batch, context), 0, config.vocab_size, jnp.int32)
  mask = jnp.ones((batch, context), bool)
  gc.collect()
  load_s = time.perf_counter() - t0
  load_rss = _status_mib("VmRSS") or _maxrss_mib()
  load_peak = _status_mib("VmHWM") or _maxrss_mib()  # a reset resets ru_maxrss too
  reset = _reset_peak()
  fn = _prefill_fn(mode, config, context, spec["chunk"])
  t0 = time.perf_counter()
  compiled = fn.lower(params, tokens, mask).compile()
  compile_s = time.perf_counter() - t0
  compile_peak = _peak_mib(reset)
  log(f"  {mode} context {context}: loaded in {load_s:.0f} s ({load_rss:.0f} MiB), compiled "
      f"in {compile_s:.1f} s")
  _reset_peak()
  samples, spent = [], 0.0
  for i in range(spec["repeats"]):
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(params, tokens, mask))
    samples.append(time.perf_counter() - t0)
    del out  # one output alive at a time
    spent += samples[-1]
    log(f"  call {i + 1}/{spec['repeats']}: {samples[-1]:.2f} s")
    if spec["max_seconds"] and spent >= spec["max_seconds"] and i + 1 < spec["repeats"]:
      log(f"  --max_seconds={spec['max_seconds']} reached after {i + 1} calls")
      break
  run_peak = _peak_mib(reset)
  peak = max(compile_peak, run_peak)
  median = statistics.median(samples)
  return dict(
      {k: spec[k] for k in KEY_FIELDS}, chunk=spec["chunk"], capacity=context,
      peak_reset=reset, load_rss_mib=load_rss, load_peak_rss_mib=load_peak,
      compile_peak_rss_mib=compile_peak, run_peak_rss_mib=run_peak, peak_rss_mib=peak,
      working_mib=peak - load_rss, process_peak_rss_mib=max(load_peak, peak, _maxrss_mib()),
      compile_s=compile_s, samples_s=samples, median_s=median,
      tokens_per_s=batch * context / median, device=device_name())


def child_spec(plan: Plan, model: str, context: int, mode: str, chunk: Optional[int]) -> dict:
  return dict(model=model, batch=plan.batch, context=context, mode=mode, chunk=chunk,
              repeats=plan.repeats, max_seconds=plan.max_seconds, seed=plan.seed)


def in_child(spec: dict, timeout: Optional[float] = None) -> dict:
  """:func:`measure` in a fresh ``python -m experiments.bench_prefill --_child=...``
  process (its progress on this process's stderr); raises RuntimeError if it fails."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  cmd = [sys.executable, "-m", "experiments.bench_prefill", "--_child=" + json.dumps(spec)]
  try:
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                          timeout=timeout or None, check=False)
  except subprocess.TimeoutExpired as err:
    raise RuntimeError(f"timed out after {timeout} s (--child_timeout)") from err
  rows = [l[len(ROW_PREFIX):] for l in done.stdout.splitlines() if l.startswith(ROW_PREFIX)]
  if done.returncode != 0 or not rows:
    why = " (killed: out of memory?)" if done.returncode in (-9, 137) else ""
    raise RuntimeError(f"child exited with {done.returncode}{why}; its log is above")
  return json.loads(rows[-1])


def child_main(spec_json: str) -> None:
  """The child's entry point: measures ``spec_json`` and prints the row on stdout."""
  row = measure(json.loads(spec_json), log=lambda s: print(s, file=sys.stderr, flush=True))
  print(ROW_PREFIX + json.dumps(results_io.json_safe(row)), flush=True)


# --- the parent: every configuration, outputs ------------------------------------------------

def _read_results(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _key(row: dict) -> tuple:
  return tuple(row[k] for k in KEY_FIELDS)


def _print(line: str) -> None:
  print(line, flush=True)  # progress shows when stdout is a file too


def run(plan: Plan, out: str, *, model: str, runner: Optional[Callable[[dict], dict]] = None,
        log=_print) -> dict:
  """Measures every configuration of ``plan`` not yet in ``out/results.json`` and writes
  the outputs after each; returns the summary.

  Args:
    plan: a checked :class:`Plan`.
    out: the output directory.
    model: ``--model`` ('smollm2' or a Hugging Face checkpoint directory).
    runner: ``spec -> row``; default :func:`in_child` (a fresh process per row).
      Tests pass :func:`measure` (in this process; its peaks then are this
      process's).
    log: progress lines.
  """
  from experiments.lib import model_loading  # pylint: disable=g-import-not-at-top
  source = model_loading.ModelSource(model)
  plan.check(source.config.max_positions)
  name = source.name
  runner = runner or (lambda spec: in_child(spec, plan.child_timeout))
  path = os.path.join(out, "results.json")
  old = _read_results(path)
  results = dict(model=name, model_spec=model, plan=dataclasses.asdict(plan),
                 rows=list(old.get("rows", [])), failed=[], complete=False)
  done = {_key(r) for r in results["rows"]}
  todo = [c for c in plan.configurations()
          if (name, plan.batch, c[0], c[1]) not in done]
  n_all = len(plan.configurations())
  progress = results_io.Progress(n_all, done=n_all - len(todo))
  if len(todo) < n_all:
    log(f"{n_all - len(todo)} of {n_all} configurations already in {path}: skipped")
  for context, mode, chunk in todo:
    spec = child_spec(plan, model, context, mode, chunk)
    log(f"context {context}, {mode}: measuring ...")
    try:
      row = runner(spec)
    except RuntimeError as err:
      results["failed"].append(dict(context=context, mode=mode, chunk=chunk, error=str(err)))
      log(f"context {context}, {mode}: FAILED: {err}")
      write_outputs(results, out)
      continue
    row["model"] = name
    results["rows"].append(row)
    log(f"{progress.step()}: context {context}, {mode}: peak {row['peak_rss_mib']:.0f} MiB "
        f"(working {row['working_mib']:.0f} MiB), compile {row['compile_s']:.1f} s, "
        f"median {row['median_s']:.2f} s, {row['tokens_per_s']:.0f} tokens/s")
    write_outputs(results, out)
  results["complete"] = not results["failed"]
  return write_outputs(results, out)


def summarize(results: dict) -> dict:
  """``summary.json``: per measure, ``table[mode][str(context)]`` of the rows of the
  results' model and the plan's batch."""
  plan = results["plan"]
  rows = [r for r in results["rows"]
          if r["model"] == results["model"] and r["batch"] == plan["batch"]]
  rows.sort(key=lambda r: (r["context"], r["mode"] != ONESHOT, r.get("chunk") or 0))
  table = lambda field: _table(rows, field)
  devices = sorted({r["device"] for r in rows})
  return dict(model=results["model"], device=devices[0] if len(devices) == 1 else devices,
              batch=plan["batch"], complete=results["complete"],
              modes=sorted({r["mode"] for r in rows}, key=lambda m: (m != ONESHOT, m)),
              contexts=sorted({r["context"] for r in rows}),
              peak_rss_mib=table("peak_rss_mib"), working_mib=table("working_mib"),
              load_rss_mib=table("load_rss_mib"),
              process_peak_rss_mib=table("process_peak_rss_mib"),
              tokens_per_s=table("tokens_per_s"), median_s=table("median_s"),
              compile_s=table("compile_s"),
              failed=[dict(context=f["context"], mode=f["mode"]) for f in results["failed"]])


def _table(rows, field) -> dict:
  out = {}
  for r in rows:
    out.setdefault(r["mode"], {})[str(r["context"])] = r[field]
  return out


def report(results: dict, summary: dict) -> str:
  """``report.md``: the command, the device and one line per row."""
  plan = results["plan"]
  lines = [
      "# Prefill: chunked vs one-shot, peak memory and time", "",
      f"Model `{summary['model']}`, batch {summary['batch']}, device: {summary['device']}.",
      "", "```",
      f"python -m experiments.bench_prefill --out=<dir> --model={results['model_spec']} "
      f"--contexts={','.join(map(str, plan['contexts']))} "
      f"--chunks={','.join(map(str, plan['chunks']))} --oneshot_max={plan['oneshot_max']} "
      f"--batch={plan['batch']} --repeats={plan['repeats']} --max_seconds={plan['max_seconds']}",
      "```", "",
      "Each row is a fresh process. Peak: the resident high-water mark while compiling and "
      "calling, reset after loading the model; working: the peak minus the resident memory "
      "after loading (the prefill's own scores, activations, output caches and executable); "
      "process peak: the child's whole life, loading the weights included. Capacity = context; no "
      "design, no certificate statistics.", "",
      "| context | mode | peak RSS (MiB) | working (MiB) | process peak (MiB) | compile (s) | "
      "median (s) | calls | tokens/s |",
      "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  rows = sorted(results["rows"], key=lambda r: (r["context"], r["mode"] != ONESHOT,
                                                r.get("chunk") or 0))
  for r in rows:
    lines.append(f"| {r['context']} | {r['mode']} | {r['peak_rss_mib']:.0f} | "
                 f"{r['working_mib']:.0f} | {r['process_peak_rss_mib']:.0f} | "
                 f"{r['compile_s']:.1f} | {r['median_s']:.2f} | {len(r['samples_s'])} | "
                 f"{r['tokens_per_s']:.0f} |")
  work = summary["working_mib"]
  for mode in summary["modes"]:
    if mode == ONESHOT or ONESHOT not in work:
      continue
    both = [c for c in work[ONESHOT] if c in work[mode]]
    if both:
      lines += ["", f"One-shot / {mode} working memory: " + ", ".join(
          f"{c}: {work[ONESHOT][c] / max(work[mode][c], 1e-9):.1f}x" for c in both) + "."]
  if summary["failed"]:
    lines += ["", "Failed: " + ", ".join(f"context {f['context']} {f['mode']}"
                                         for f in summary["failed"]) + " (rerun to retry)."]
  return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: str) -> dict:
  """Writes ``results.json``, ``summary.json`` and ``report.md`` atomically; returns the
  summary."""
  summary = summarize(results)
  dump = lambda obj: json.dumps(results_io.json_safe(obj), indent=1, sort_keys=True,
                                allow_nan=False) + "\n"
  results_io.atomic_write_text(os.path.join(out, "results.json"), dump(results))
  results_io.atomic_write_text(os.path.join(out, "summary.json"), dump(summary))
  results_io.atomic_write_text(os.path.join(out, "report.md"), report(results, summary))
  return summary
