"""Collection of the damage study (``python -m experiments.damage``): resumable units.

Two kinds of unit, each written atomically to ``OUT/units/<name>.npz`` with a
fingerprint of what its numbers depend on (a unit whose fingerprint no longer
matches the plan is recomputed):

* ``text_<i>``: text segment ``i`` (``context_len`` tokens of the built-in
  text) streamed through the full and the evicted model
  (:func:`experiments.lib.damage.tokens.token_damage`): per-token KL, NLL
  increase, the evicted model's entropy, each (layer, head)'s radius and the
  head-mean warning signals per layer.
* ``task_<setting>``: ``num_examples`` seeded examples of one task setting in
  the streaming regime, generated greedily with the full cache and twice with
  the design (independent keys): per example each run's answer and
  correctness, mean log-probability, and per decode step the KL of the
  evicted run's next-token distribution against the full run's (defined
  while both have generated the same tokens so far: ``same_prefix``), the
  radius per (layer, head) and the head-mean signals per layer.

The head projection norms ``||W_o^h||`` of the model (spectral and RMS,
``certkv_jax.certificate.damage``) are written to ``OUT/norms.npz``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import certificate
from certkv_jax.certificate import damage
from experiments.lib import batching
from experiments.lib import design_defaults
from experiments.lib import plan_flags
from experiments.lib import results_io
from experiments.lib import tasks as tasks_lib
from experiments.lib.damage import tokens as damage_tokens
from experiments.lib.streaming_loss.core import StreamConfig
from experiments.lib.validity import collect as validity_collect
from models.text import answer_text
from certkv_jax.attention.certified import SIGNAL_FIELDS

FORMAT_VERSION = 1
# Task settings: name -> (task, options). Each family has an easier and a harder
# setting where the full cache itself fails on a real share of examples (attribution
# needs inherent failures). Measured with the full cache on SmolLM2 at 1,024 tokens
# (12 examples, seed 123): multi_needle 4 / 8 needles 0.75 / 0.50, agent_memory 5 / 9
# distractors 0.75 / 0.83. variable_tracking is 0/12 even at one hop (the model keeps
# writing the filler) and is not used.
TASK_SETTINGS = {
    "multi_needle_n4": ("multi_needle", {"num_needles": 4}),
    "multi_needle_n8": ("multi_needle", {"num_needles": 8}),
    "agent_memory_d5": ("agent_memory", {"num_distractors": 5}),
    "agent_memory_d9": ("agent_memory", {"num_distractors": 9}),
}
AGENT_MEMORY = ("agent_memory_d5", "agent_memory_d9")  # the agent-memory regime of gating


# The reduced plan of --quick and of the quick suite (run_all).
QUICK = dict(context_len=256, chunk=32, text_segments=3, train_segments=2, num_examples=4,
             settings=("multi_needle_n4", "agent_memory_d5"), n_steps=8, max_batch=4)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the damage study runs (each setting a flag of ``experiments/damage.py``)."""

  model: str = "smollm2"
  design: str = plan_flags.setting("poisson_floor", "Randomized design (certkv_jax.designs.registry).")
  budget: float = plan_flags.setting(0.25, "Budget: fraction in (0, 1) of the tokens seen.")
  context_len: int = plan_flags.setting(1024, "Context length in tokens.")
  chunk: int = plan_flags.setting(128, "Streaming chunk (tokens per eviction).")
  n_sink: int = 4
  window: int = 16
  n_steps: int = plan_flags.setting(10, "Decode steps per task example.")
  delta: float = 0.05
  text_segments: int = plan_flags.setting(7, "Text segments (built-in text).")
  train_segments: int = plan_flags.setting(
      4, "Segments the predictor is fitted on (the first ones); the rest are held out.")
  settings: tuple = plan_flags.setting(tuple(TASK_SETTINGS),
                                       f"Task settings: {sorted(TASK_SETTINGS)}.")
  num_examples: int = plan_flags.setting(16, "Examples per task setting.")
  max_batch: int = plan_flags.setting(8, "Rows per generation call.")
  seed: int = plan_flags.setting(0, "Seed of tasks and designs.")

  def check(self) -> "Plan":
    ints = dict(context_len=(64, None), chunk=(1, None), n_sink=(0, None), window=(1, None),
                n_steps=(1, None), text_segments=(2, None), train_segments=(1, None),
                num_examples=(2, None), max_batch=(1, None))
    for name, (lo, hi) in ints.items():
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if self.train_segments >= self.text_segments:
      raise ValueError(f"train_segments ({self.train_segments}) must be < text_segments "
                       f"({self.text_segments}): the rest are the held-out texts")
    if not 0.0 < self.budget < 1.0:
      raise ValueError(f"budget must be a fraction in (0, 1), got {self.budget!r}")
    if not 0.0 < self.delta < 1.0:
      raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
    bad = [s for s in self.settings if s not in TASK_SETTINGS]
    if bad or not self.settings:
      raise ValueError(f"settings must be a non-empty subset of {sorted(TASK_SETTINGS)}, "
                       f"got {list(self.settings)}")
    if self.chunk > self.context_len:
      raise ValueError(f"chunk ({self.chunk}) must be <= context_len ({self.context_len})")
    # names a design
    design_defaults.make_design(self.design, self.budget, self.n_sink, self.window)
    return self

  def units(self) -> list[str]:
    return ([f"text_{i}" for i in range(self.text_segments)]
            + [f"task_{s}" for s in self.settings])


def unit_path(out: str, unit: str) -> str:
  return os.path.join(out, "units", f"{unit}.npz")


def fingerprint(plan: Plan, unit: str, text_sha: str) -> str:
  keys = dict(plan.__dict__)
  keys.pop("settings"), keys.pop("text_segments"), keys.pop("train_segments")
  if unit.startswith("task_"):
    keys["task"] = TASK_SETTINGS[unit[5:]]
  else:
    keys["text"] = text_sha
    for k in ("num_examples", "max_batch", "n_steps"):
      keys.pop(k)
  blob = json.dumps(dict(unit=unit, version=FORMAT_VERSION, **keys), sort_keys=True,
                    default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


# The unit file format is the validity study's (arrays + a JSON ``meta`` entry).
save_npz = validity_collect.save_npz
load_npz = validity_collect.load_unit


def head_norms(params, config) -> dict:
  """``{"spectral": [L, H], "rms": [L, H]}`` output-projection gains per (layer, head)."""
  w_o = params["params"]["layers"]["o_proj"]["kernel"]
  return {"spectral": np.asarray(damage.head_output_norms(w_o, config.n_heads, config.head_dim,
                                                          "spectral")),
          "rms": np.asarray(damage.head_output_norms(w_o, config.n_heads, config.head_dim,
                                                     "frobenius_rms"))}


def text_segment(tok, text: str, plan: Plan, i: int) -> list[int]:
  """Segment ``i`` of the built-in text: ``context_len`` consecutive tokens (BOS first)."""
  exs = validity_collect.text_examples(tok, text, plan.text_segments, plan.context_len, 1)
  return exs[i].context_ids


def run_text_unit(params, config, ids: Sequence[int], plan: Plan, key) -> dict:
  design = design_defaults.make_design(plan.design, plan.budget, plan.n_sink, plan.window)
  tokens = jnp.asarray([list(ids)], jnp.int32)
  mask = jnp.ones(tokens.shape, bool)
  stream = StreamConfig(chunk=plan.chunk, design=design, delta=plan.delta)
  out = damage_tokens.token_damage(params, tokens, mask, key, config=config, stream=stream)
  if int(out.n_dropped.sum()):
    raise RuntimeError(f"{int(out.n_dropped.sum())} tokens found no cache slot "
                       "; the damage numbers would be wrong")
  arrays = {k: np.asarray(getattr(out, k)[0]) for k in ("kl", "dnll", "scored",
                                                         "entropy_evicted")}
  arrays["radius"] = np.asarray(out.radius[0], np.float32)  # [n, L, H]
  arrays["true_error"] = np.asarray(out.true_error[0], np.float32)
  for k in SIGNAL_FIELDS:
    arrays["sig_" + k] = np.asarray(out.signals[k][0], np.float32)  # [n, L]
  return arrays


def _generate(params, config, examples, design: str, plan: Plan, key, shape) -> dict:
  """Greedy streaming generation over ``examples`` in equal slices of ``max_batch``."""
  parts = []
  size = min(plan.max_batch, len(examples))
  unit = batching.UnitCall(design=design, regime="streaming", n_steps=plan.n_steps,
                             chunk=plan.chunk, n_sink=plan.n_sink, window=plan.window,
                             shape=shape, max_budget=plan.budget, return_logits=True)
  for c, start in enumerate(range(0, len(examples), size)):
    idx = list(range(start, min(start + size, len(examples))))
    n_real = len(idx)
    idx += [idx[-1]] * (size - n_real)
    gen = batching.run_batch(params, config, [examples[i] for i in idx],
                               [plan.budget] * size, jax.random.fold_in(key, c), unit)
    part = {"tokens": np.asarray(gen.tokens)[:n_real],
            "logprobs": np.asarray(gen.logprobs)[:n_real],
            "logp": np.asarray(jax.nn.log_softmax(gen.logits.astype(jnp.float32),
                                                  axis=-1))[:n_real]}
    if design != "full":
      r = certificate.radius_from_stats(gen.var_hat, gen.range_hat, plan.delta)
      part["radius"] = np.transpose(np.asarray(r, np.float32), (2, 0, 1, 3))[:n_real]
      for k in SIGNAL_FIELDS:  # [S, L, b, H] -> [b, S, L]
        a = np.mean(np.asarray(getattr(gen, k), np.float32), axis=-1)
        part["sig_" + k] = np.transpose(a, (2, 0, 1))[:n_real]
      if int(np.asarray(gen.n_dropped).sum()):
        raise RuntimeError("tokens found no cache slot; the damage numbers would be wrong")
    parts.append(part)
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def run_task_unit(params, config, tok, setting: str, plan: Plan, key) -> dict:
  task, kw = TASK_SETTINGS[setting]
  examples = tasks_lib.make_task(task, tok, plan.num_examples, plan.context_len, plan.seed,
                                 **kw)
  shape = batching.pad_shape(examples)
  full = _generate(params, config, examples, "full", plan, key, shape)
  arrays = {"full_correct": np.asarray([ex.score(answer_text.answer(tok, t))
                                        for ex, t in zip(examples, full["tokens"])]),
            "full_tokens": full["tokens"], "full_logprobs": full["logprobs"]}
  for run in (0, 1):
    ev = _generate(params, config, examples, plan.design, plan, jax.random.fold_in(key, 1 + run),
                   shape)
    same = np.concatenate([np.ones((len(examples), 1), bool),
                           np.cumprod(ev["tokens"][:, :-1] == full["tokens"][:, :-1],
                                      axis=1).astype(bool)], axis=1)
    kl = np.sum(np.exp(full["logp"]) * (full["logp"] - ev["logp"]), axis=-1)
    arrays.update({
        f"run{run}_correct": np.asarray([ex.score(answer_text.answer(tok, t))
                                         for ex, t in zip(examples, ev["tokens"])]),
        f"run{run}_tokens": ev["tokens"], f"run{run}_logprobs": ev["logprobs"],
        f"run{run}_kl": kl.astype(np.float32), f"run{run}_same_prefix": same,
        f"run{run}_radius": ev["radius"]})
    for k in SIGNAL_FIELDS:
      arrays[f"run{run}_sig_{k}"] = ev["sig_" + k]
  arrays["answer"] = np.asarray([ex.answer for ex in examples])
  return arrays


def collect(params, config, tok, plan: Plan, out: str, *, text: str, log=print,
            max_units: Optional[int] = None) -> list[str]:
  """Runs every missing or stale unit of ``plan`` into ``out``; returns the unit names."""
  plan.check()
  os.makedirs(os.path.join(out, "units"), exist_ok=True)
  norms = head_norms(params, config)
  save_npz(os.path.join(out, "norms.npz"), norms, {"model": plan.model})
  text_sha = hashlib.sha256(text.encode()).hexdigest()[:16]
  units = plan.units()

  def stale(u):
    p = unit_path(out, u)
    return (not os.path.exists(p) or validity_collect.unit_meta(p).get("fingerprint")
            != fingerprint(plan, u, text_sha))

  todo = [u for u in units if stale(u)]
  progress = results_io.Progress(len(units), len(units) - len(todo))
  log(f"damage: {len(todo)} of {len(units)} units to run; unit files in {out}/units")
  for u in results_io.limit_units(todo, max_units, log):
    t0 = time.time()
    key = jax.random.fold_in(jax.random.PRNGKey(plan.seed), units.index(u))
    if u.startswith("text_"):
      arrays = run_text_unit(params, config, text_segment(tok, text, plan, int(u[5:])), plan,
                             key)
      what = f"{int(arrays['scored'].sum())} tokens"
    else:
      arrays = run_task_unit(params, config, tok, u[5:], plan, key)
      what = (f"{plan.num_examples} examples, full-cache accuracy "
              f"{arrays['full_correct'].mean():.2f}, evicted "
              f"{arrays['run0_correct'].mean():.2f}")
    seconds = time.time() - t0
    save_npz(unit_path(out, u), arrays, {"unit": u, "fingerprint": fingerprint(plan, u, text_sha),
                                         "seconds": round(seconds, 2), "plan": plan.__dict__})
    log(f"{progress.step()} {u}: {what} in {seconds:.0f}s (compile included)")
  return units
