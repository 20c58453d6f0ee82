"""Timing of the benchmark's configurations: interleaved round-robin calls, medians
per step with their order-statistic intervals, compile time from the first call."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax

from experiments.lib.stats import intervals

WARMUP = 2  # the first call (compile) and one more before the timed calls
LEVEL = 0.95


def median_interval(samples) -> dict:
  """Median of ``samples`` and its order-statistic interval at ``LEVEL``:
  ``{median, lo, hi, level}`` (``experiments.lib.stats.intervals.median_interval``)."""
  return intervals.median_interval(samples, LEVEL)


def _memo(cache: dict, key, make):
  """``cache[key]``, made by ``make()`` the first time (one jitted function per key: jax
  keeps its executables per argument shape)."""
  if key not in cache:
    cache[key] = make()
  return cache[key]


@dataclasses.dataclass
class _Timed:
  """One timed configuration of a cell and its measurements."""

  row: dict
  call: object  # () -> seconds of one call (a call updates its own carry)
  steps: int = 1  # decode steps per call (evict_every): times are per step
  first_s: Optional[float] = None  # the first call: compile + run
  samples: list = dataclasses.field(default_factory=list)


def _timed_call(fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


def _stepper(fn, params, carry, budget):
  state = {"carry": carry}

  def call():
    (state["carry"], _), dt = _timed_call(fn, params, state["carry"], budget)
    return dt
  return call, state


def _round_robin(timed: list, repeats: int, warm: int = WARMUP - 1, log=None):
  """The first call (unless made already), ``warm`` more, then ``repeats`` rounds of one
  call of each configuration, the first of a round rotating. ``log``: given, says each
  first call's seconds (compile and run) as it ends."""
  for t in timed:
    if t.first_s is None:
      t.first_s = t.call()
      if log:
        log(f"  first call {t.first_s:.1f} s: {_label(t.row)}")
    for _ in range(warm):
      t.call()
  for r in range(repeats):
    for i in range(len(timed)):
      t = timed[(i + r) % len(timed)]
      t.samples.append(t.call())


def _label(row: dict) -> str:
  keys = ("part", "design", "certificate", "budget", "evict_every", "layer_loop", "method", "bytes")
  return " ".join(f"{k}={row[k]}" for k in keys if row.get(k) is not None)


def _finish(t: _Timed, scale: float) -> dict:
  """The row of ``t``: samples and median per step (a call's time / ``t.steps``) times
  ``scale``, and the compile time (the first call minus a steady call) in seconds."""
  per = scale / t.steps
  ci = median_interval([s * per for s in t.samples])
  return dict(t.row, samples=[s * per for s in t.samples], median=ci["median"],
              ci=[ci["lo"], ci["hi"]], ci_level=ci["level"], first_call=t.first_s * scale,
              compile_s=max(t.first_s - ci["median"] / per, 0.0))
