"""Per-call records for the validity study (method, sections 5, 6 and 10).

The validity study asks where the certificate holds: for every decode call
(step, layer, batch row, query head) of an evaluation-mode run it keeps the
certificate's statistics (``V_hat``, ``b_hat``), the true error from the
shadow full cache, the Assumption-2 audit (``R``, ``m``, ``|T|``) and the
online warning signals computed from the kept set alone
(:mod:`certkv_jax.certificate.signals`). Unlike the suite's rows, which keep a small sample
of calls, every call is kept: the split-conformal calibration
(:mod:`certkv_jax.calibration`) needs them all.

A *unit* is one (context length, regime, design, data source): one jitted
evaluation-mode call (in slices of ``max_batch`` rows sharing one compile)
over every (budget, example) row. Its arrays go to one ``.npz`` file under
``DIR/units/``, written atomically; a rerun skips the units already there, so
an interrupted run resumes where it stopped.

Data sources are the seeded tasks of :mod:`experiments.lib.tasks` and
natural text (:func:`text_examples`): a segment of a text file as the
context, the next tokens of the same text as the "question", so that the
decode continues the text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from experiments.lib import batching
from experiments.lib import design_defaults
from experiments.lib import model_loading
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib import tasks as tasks_lib
from models.text import answer_text

TEXT = "text"  # the data-source name of natural-text examples
# experiments/data/gpl-3.0.txt (this file is experiments/lib/validity/collect.py)
DEFAULT_TEXT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data",
    "gpl-3.0.txt")
REGIMES = ("question_aware", "streaming")
# Per-call arrays kept from a decode.Generation ([steps, layers, batch, heads]).
CALL_FIELDS = ("true_error", "rel_error", "var_hat", "range_hat", "ratio", "tail_m", "tail_n")
SIGNAL_FIELDS = ("ess", "max_tail_weight", "range_ratio", "entropy", "r_hat", "tail_mass")
FORMAT_VERSION = 1


def _int(name: str, form: str, entry: str, text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--{name} entries must be {form}, got {entry!r} ({text!r} is not an "
                     "int)") from None


def parse_examples_at(entries) -> tuple:
  """``["2048:2"]`` -> ``((2048, 2),)``."""
  out = []
  for e in entries:
    parts = e.split(":")
    if len(parts) != 2:
      raise ValueError(f"--examples_at entries must be CONTEXT:N, got {e!r}")
    out.append(tuple(_int("examples_at", "CONTEXT:N", e, p) for p in parts))
  return tuple(out)


def _parse_subsets(name: str):
  """The parser of ``--designs_at`` / ``--data_at``: ``["2048:a+b"]`` -> ``((2048, ("a",
  "b")),)``."""
  def parse(entries) -> tuple:
    out = []
    for e in entries:
      c, sep, rest = e.partition(":")
      if not sep or not rest:
        raise ValueError(f"--{name} entries must be CONTEXT:A+B, got {e!r}")
      out.append((_int(name, "CONTEXT:A+B", e, c), tuple(rest.split("+"))))
    return tuple(out)
  return parse


def parse_groups_at(entries) -> tuple:
  """``["1024:passkey+text:poisson_tail"]`` -> ``((1024, ("passkey", "text"),
  ("poisson_tail",)),)``."""
  form = "CONTEXT:DATA1+DATA2:DESIGN1+DESIGN2"
  out = []
  for e in entries:
    parts = e.split(":")
    if len(parts) != 3 or not all(parts):
      raise ValueError(f"--groups_at entries must be {form}, got {e!r}")
    out.append((_int("groups_at", form, e, parts[0]), tuple(parts[1].split("+")),
                tuple(parts[2].split("+"))))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What :func:`collect` runs; each setting is a flag of ``python -m experiments.validity``.
  Validated by :meth:`check` (errors name the flag). ``max_units``, ``default_design``,
  ``calib_context`` and ``transfer`` say how :mod:`experiments.lib.validity.run` runs and
  analyses the units; they are not part of any unit's fingerprint."""

  designs: tuple = plan_flags.setting(
      ("poisson_tail", "poisson_defensive", "poisson_envelope", "attention_proportional"),
      "Randomized designs.")
  regimes: tuple = plan_flags.setting(REGIMES, "Regimes.")
  budgets: tuple = plan_flags.setting((0.125, 0.25, 0.5), "Budgets (fractions in (0, 1)).")
  data: tuple = plan_flags.setting((TEXT, "passkey", "kv_retrieval", "variable_tracking"),
                                   "Data sources: 'text' and/or task names.")
  context_lens: tuple = plan_flags.setting((1024,), "Context lengths.")
  num_examples: int = plan_flags.setting(6, "Examples per data source.")
  n_steps: int = plan_flags.setting(8, "Decode steps per example.")
  question_len: int = 16  # text examples: continuation tokens given as the "question"
  n_sink: int = design_defaults.N_SINK
  window: int = design_defaults.WINDOW
  chunk: int = 64
  seed: int = plan_flags.setting(0, "Seed of tasks and designs.")
  model: str = model_loading.DEFAULT_MODEL  # recorded; --model names the checkpoint
  max_batch: Optional[int] = plan_flags.setting(
      None, "Rows per call (unset: a unit's whole batch).")
  question_aware_only: tuple = ("attention_proportional",)
  examples_at: tuple = plan_flags.setting(
      (), "Fewer examples at some contexts: CONTEXT:N entries.", parse=parse_examples_at)
  designs_at: tuple = plan_flags.setting(
      (), "A subset of designs at some contexts: CONTEXT:D1+D2.",
      parse=_parse_subsets("designs_at"))
  data_at: tuple = plan_flags.setting(
      (), "A subset of data sources at some contexts: CONTEXT:S1+S2.",
      parse=_parse_subsets("data_at"))
  groups_at: tuple = plan_flags.setting(
      (), "Further units padded among themselves (so that adding them keeps a finished "
      "run's units): CONTEXT:DATA1+DATA2:DESIGN1+DESIGN2.", parse=parse_groups_at)
  max_units: Optional[int] = plan_flags.setting(
      None, "Stop after this many units (unset: all); rerun resumes.")
  default_design: str = plan_flags.setting("poisson_tail",
                                           "Design of the default certified setting.")
  calib_context: Optional[int] = plan_flags.setting(
      None, "Context length the calibrations are fitted at (unset: the largest planned "
      "context <= 1024, else the shortest).")
  transfer: Optional[str] = None  # --transfer_calibration: another study's artifact

  def check(self) -> "Plan":
    if self.transfer is not None and (not isinstance(self.transfer, str) or not self.transfer):
      raise ValueError(f"--transfer_calibration must be an artifact's path, got "
                       f"{self.transfer!r}")
    for d in self.designs:  # only randomized designs have a certificate
      if d not in design_defaults.names(randomized=True):
        raise ValueError(f"--designs: {d!r} is not a randomized design; choose from "
                         f"{sorted(design_defaults.names(randomized=True))}")
    for r in self.regimes:
      if r not in REGIMES:
        raise ValueError(f"--regimes: unknown regime {r!r}; choose from {list(REGIMES)}")
    for b in self.budgets:
      if not 0.0 < float(b) < 1.0:
        raise ValueError(f"--budgets entries must be fractions in (0, 1), got {b}")
    for s in self.data:
      if s != TEXT and s not in tasks_lib.TASKS:
        raise ValueError(f"--data: unknown data source {s!r}; choose from "
                         f"{[TEXT] + list(tasks_lib.TASKS)}")
    for c in self.context_lens:
      if not isinstance(c, int) or c < tasks_lib.MIN_CONTEXT_LEN:
        raise ValueError(f"--context_lens entries must be ints >= {tasks_lib.MIN_CONTEXT_LEN}, "
                         f"got {c!r}")
    for name, v, lo in (("num_examples", self.num_examples, 1), ("n_steps", self.n_steps, 1),
                        ("question_len", self.question_len, 1), ("chunk", self.chunk, 1),
                        ("n_sink", self.n_sink, 0), ("window", self.window, 0)):
      if not isinstance(v, int) or v < lo:
        raise ValueError(f"--{name} must be an int >= {lo}, got {v!r}")
    for name, v, lo in (("max_batch", self.max_batch, 1), ("max_units", self.max_units, 0),
                        ("calib_context", self.calib_context, 1)):
      if v is not None and (not isinstance(v, int) or v < lo):
        raise ValueError(f"--{name} must be an int >= {lo} or unset, got {v!r}")
    for c, n in self.examples_at:
      if c not in self.all_context_lens or not isinstance(n, int) or n < 1:
        raise ValueError(f"examples_at: ({c}, {n}) must name a planned context length and "
                         "a positive int")
    for name, pairs, allowed in (("designs_at", self.designs_at, self.designs),
                                 ("data_at", self.data_at, self.data)):
      for c, subset in pairs:
        if c not in self.context_lens or not subset or not set(subset) <= set(allowed):
          raise ValueError(f"{name}: ({c}, {subset}) must name a planned context length and "
                           f"a non-empty subset of {list(allowed)}")
    for entry in self.groups_at:
      if len(entry) != 3:
        raise ValueError(f"groups_at: entries must be (context, data sources, designs), got "
                         f"{entry!r}")
      c, data, designs = entry
      if not isinstance(c, int) or c < tasks_lib.MIN_CONTEXT_LEN or not data or not designs:
        raise ValueError(f"groups_at: ({c}, {data}, {designs}) needs an int context >= "
                         f"{tasks_lib.MIN_CONTEXT_LEN} and non-empty data sources and designs")
      for s in data:
        if s != TEXT and s not in tasks_lib.TASKS:
          raise ValueError(f"groups_at: unknown data source {s!r}; choose from "
                           f"{[TEXT] + list(tasks_lib.TASKS)}")
      for d in designs:
        if d not in design_defaults.names(randomized=True):
          raise ValueError(f"groups_at: {d!r} is not a randomized design; choose from "
                           f"{sorted(design_defaults.names(randomized=True))}")
    keys = [u for u in self.units()]
    dup = sorted({u for u in keys if keys.count(u) > 1})
    if dup:
      raise ValueError(f"groups_at: units planned twice (a data source in two pad groups of "
                       f"one context): {dup[:4]}")
    return self

  @property
  def all_context_lens(self) -> tuple:
    """The main contexts and those of ``groups_at``, sorted."""
    return tuple(sorted(set(self.context_lens) | {g[0] for g in self.groups_at}))

  def pad_groups(self, context_len: int) -> list[tuple]:
    """The pad groups at ``context_len``: tuples of data sources padded together (the
    main plan's, if it has this context, first)."""
    out = []
    if context_len in self.context_lens:
      out.append(tuple(dict(self.data_at).get(context_len, self.data)))
    out += [tuple(g[1]) for g in self.groups_at if g[0] == context_len]
    return out

  def pad_group_of(self, unit) -> tuple:
    """The data sources padded with ``unit``'s (they set its padded shape)."""
    c, _, d, s = unit
    if c in self.context_lens:
      main = dict(self.data_at).get(c, self.data)
      if s in main and d in dict(self.designs_at).get(c, self.designs):
        return tuple(main)
    for gc, data, designs in self.groups_at:
      if gc == c and s in data and d in designs:
        return tuple(data)
    raise ValueError(f"unit {unit} is not in this plan")

  def examples_for(self, context_len: int) -> int:
    return dict(self.examples_at).get(context_len, self.num_examples)

  def units(self) -> list[tuple[int, str, str, str]]:
    """(context_len, regime, design, data) in run order (short contexts first)."""
    groups = [(c, dict(self.data_at).get(c, self.data), dict(self.designs_at).get(c, self.designs))
              for c in sorted(self.context_lens)]
    groups += sorted(self.groups_at, key=lambda g: g[0])
    return [(c, regime, d, s) for c, data, designs in groups for regime in self.regimes
            for d in designs
            if regime == "question_aware" or d not in self.question_aware_only
            for s in data]


def text_examples(tok, text: str, num_examples: int, context_len: int, question_len: int,
                  *, source: str = DEFAULT_TEXT) -> list[tasks_lib.Example]:
  """Consecutive, non-overlapping text segments as examples.

  Example ``i`` has the next ``context_len`` tokens of ``text`` (after the
  tokenizer's BOS, if it adds one) as its context and the following
  ``question_len`` tokens as its question; its answer is the decoded text of
  the ``question_len`` tokens after those (scored as an exact prefix; text
  continuation accuracy is not a task score and is not reported as one).

  Raises:
    ValueError naming ``source`` and the counts when the text is too short.
  """
  prefix = list(tok.encode(""))
  body = list(tok.encode(text, add_bos=False))
  per = context_len - len(prefix) + 2 * question_len
  need = num_examples * per
  if context_len - len(prefix) < 2 or len(body) < need:
    raise ValueError(f"text {source}: {len(body)} tokens, too few for {num_examples} examples "
                     f"of {context_len} context + {question_len} question + {question_len} "
                     f"answer tokens ({need} needed); use fewer examples or a shorter context")
  out = []
  for i in range(num_examples):
    seg = body[i * per:(i + 1) * per]
    n_ctx = context_len - len(prefix)
    ctx, qst, ans = seg[:n_ctx], seg[n_ctx:n_ctx + question_len], seg[n_ctx + question_len:]
    out.append(tasks_lib.Example(context_ids=prefix + ctx, question_ids=qst,
                                 answer=tok.decode(ans), task=TEXT,
                                 meta={"segment": i, "source": os.path.basename(source)},
                                 metric="exact_prefix"))
  return out


def make_examples(tok, plan: Plan, context_len: int, text: str,
                  text_source: str = DEFAULT_TEXT, data: Optional[Sequence[str]] = None) -> dict:
  """data source -> examples at ``context_len`` (seeded; text from ``text``) for the
  sources ``data`` (default: the main plan's at that context)."""
  n = plan.examples_for(context_len)
  out = {}
  for s in data if data is not None else dict(plan.data_at).get(context_len, plan.data):
    if s == TEXT:
      out[s] = text_examples(tok, text, n, context_len, plan.question_len, source=text_source)
    else:
      out[s] = tasks_lib.make_task(s, tok, n, context_len, plan.seed)
  return out


def unit_path(out_dir: str, unit) -> str:
  c, regime, d, s = unit
  return os.path.join(out_dir, "units", f"c{c}_{regime}_{d}_{s}.npz")


def unit_fingerprint(plan: Plan, unit, text_sha: str) -> str:
  """What a unit's numbers depend on: its own keys and the plan's settings at its context
  (the other data sources of its pad group set the common padded shape), not the rest
  of the plan, so that a plan can grow or shrink by whole units, or by pad groups, and
  keep its finished ones."""
  c, regime, d, s = unit
  blob = json.dumps(dict(
      unit=[c, regime, d, s], examples=plan.examples_for(c),
      data=list(plan.pad_group_of(unit)), budgets=list(plan.budgets),
      n_steps=plan.n_steps, question_len=plan.question_len, n_sink=plan.n_sink,
      window=plan.window, chunk=plan.chunk, seed=plan.seed, model=plan.model,
      max_batch=plan.max_batch or 0,  # unset hashes as 0 did, keeping committed units
      text=text_sha, version=FORMAT_VERSION), sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _gen_arrays(gen, n_real: int) -> dict:
  out = {"tokens": np.asarray(gen.tokens)[:n_real], "logprobs": np.asarray(gen.logprobs)[:n_real]}
  for k in CALL_FIELDS + SIGNAL_FIELDS:
    a = getattr(gen, k, None)
    if a is not None:
      out[k] = np.asarray(a, np.float32)[:, :, :n_real]
  return out


def run_unit(params, config, examples, design: str, regime: str, key, plan: Plan,
             shape: Optional[dict] = None) -> dict:
  """A unit's per-call arrays ``[steps, layers, rows, heads]`` over its rows
  (every budget of ``plan`` x example), in equal-shape slices of ``plan.max_batch`` rows.

  ``shape`` (:func:`experiments.lib.batching.pad_shape` of every data source at
  this context) pads all units of a context alike, so that the data sources of
  one (design, regime) share a compile.
  """
  rows = [(b, i) for b in plan.budgets for i in range(len(examples))]
  exs = [examples[i] for _, i in rows]
  row_b = [b for b, _ in rows]
  size = plan.max_batch or len(rows)
  unit = batching.UnitCall(design=design, regime=regime, n_steps=plan.n_steps,
                             chunk=plan.chunk, n_sink=plan.n_sink, window=plan.window,
                             shape=shape or batching.pad_shape(exs), max_budget=max(row_b))
  parts = []
  for c, start in enumerate(range(0, len(rows), size)):
    idx = list(range(start, min(start + size, len(rows))))
    n_real = len(idx)
    idx += [idx[-1]] * (min(size, len(rows)) - n_real)  # equal shapes: one compile
    gen = batching.run_batch(params, config, [exs[i] for i in idx], [row_b[i] for i in idx],
                               key if c == 0 else jax.random.fold_in(key, c), unit)
    parts.append(_gen_arrays(gen, n_real))
  out = {k: np.concatenate([p[k] for p in parts], axis=0 if k in ("tokens", "logprobs") else 2)
         for k in parts[0]}
  out["budget"] = np.asarray(row_b, np.float32)
  out["example"] = np.asarray([i for _, i in rows], np.int32)
  return out


def save_npz(path: str, arrays: dict, meta: dict) -> None:
  """Writes ``arrays`` and the JSON ``meta`` to ``path`` atomically (read by :func:`load_unit`)."""
  buf = io.BytesIO()
  np.savez_compressed(buf, meta=np.asarray(json.dumps(meta, sort_keys=True)), **arrays)
  results_io.atomic_write(path, lambda f: f.write(buf.getvalue()), binary=True)


def load_unit(path: str) -> tuple[dict, dict]:
  """``(arrays, meta)`` of a unit file."""
  with np.load(path, allow_pickle=False) as z:
    arrays = {k: z[k] for k in z.files if k != "meta"}
    meta = json.loads(str(z["meta"]))
  return arrays, meta


def unit_meta(path: str) -> dict:
  """A unit file's metadata only (its arrays are not read)."""
  with np.load(path, allow_pickle=False) as z:
    return json.loads(str(z["meta"]))


def collect(params, config, tok, plan: Plan, out_dir: str, *, text: str,
            text_source: str = DEFAULT_TEXT, log: Callable[[str], None] = print) -> list[str]:
  """Runs every unit whose file is missing (up to ``plan.max_units``); returns the paths
  of all unit files.

  A unit file written by a different plan (its fingerprint differs) is an
  error, not silently mixed in: use another ``out_dir``.
  """
  plan.check()
  text_sha = hashlib.sha256(text.encode()).hexdigest()
  os.makedirs(os.path.join(out_dir, "units"), exist_ok=True)
  units = plan.units()
  for u in units:
    p = unit_path(out_dir, u)
    if os.path.exists(p):
      got, want = load_unit(p)[1].get("fingerprint"), unit_fingerprint(plan, u, text_sha)
      if got != want:
        raise ValueError(f"{p} was written by another plan (fingerprint {got} != {want}: "
                         "other examples, budgets, steps, seed, model or text); use a new "
                         "--out directory")
  todo = [u for u in units if not os.path.exists(unit_path(out_dir, u))]
  progress = results_io.Progress(len(units), len(units) - len(todo))
  log(f"validity: {len(todo)} of {len(units)} units to run; unit files in {out_dir}/units")
  examples, shapes = {}, {}
  for unit in results_io.limit_units(todo, plan.max_units, log):
    c, regime, d, s = unit
    group = (c, plan.pad_group_of(unit))
    if group not in examples:
      examples[group] = make_examples(tok, plan, c, text, text_source, data=group[1])
      shapes[group] = batching.pad_shape([e for v in examples[group].values() for e in v])
    exs = examples[group][s]
    key = jax.random.fold_in(jax.random.PRNGKey(plan.seed), _unit_seed(unit))
    t0 = time.time()
    arrays = run_unit(params, config, exs, d, regime, key, plan, shapes[group])
    seconds = time.time() - t0
    correct = [bool(exs[int(i)].score(answer_text.answer(tok, t)))
               for t, i in zip(arrays["tokens"], arrays["example"])]
    arrays["correct"] = np.asarray(correct)
    arrays["n_prompt"] = np.asarray([len(exs[int(i)].context_ids) + len(exs[int(i)].question_ids)
                                     for i in arrays["example"]], np.int32)
    meta = dict(fingerprint=unit_fingerprint(plan, unit, text_sha), context_len=c,
                regime=regime, design=d, data=s,
                model=plan.model, seconds=round(seconds, 2), format_version=FORMAT_VERSION,
                n_layers=int(config.n_layers), n_heads=int(config.n_heads),
                n_kv_heads=int(config.n_kv_heads))
    save_npz(unit_path(out_dir, unit), arrays, meta)
    n_calls = arrays["true_error"].size
    log(f"{progress.step()} c{c}/{regime}/{d}/{s}: {len(correct)} rows, {n_calls} calls in "
        f"{seconds:.0f}s (compile included)")
  return [unit_path(out_dir, u) for u in units if os.path.exists(unit_path(out_dir, u))]


def _unit_seed(unit) -> int:
  """A stable per-unit seed (Python's ``hash`` of strings is salted per process)."""
  digest = hashlib.sha256(repr(unit).encode()).digest()
  return int.from_bytes(digest[:4], "little") % (2 ** 31)
