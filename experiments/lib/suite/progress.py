"""One progress line for a job of several stages (``python -m experiments.run_all``).

Each stage of the job logs through :meth:`JobProgress.stage`; the lines its
``results_io.Progress`` writes (``[done/total] elapsed ..s, ETA ..s what``) are
rewritten as one line for the whole job::

    [stage 2/6 Theorem 1: 3/4] theorem1/snapkv: 12s | job 5 min 3 s, ETA ~9 min

and every other line of a stage is prefixed with its stage. The job's ETA weighs
the stages by their expected shares of its time (``weights``) and takes its pace
from the work done in this invocation (a resumed stage's finished units do not
count as pace), so it covers every stage still to come, not only the current one.
"""

from __future__ import annotations

import math
import re
import time
from typing import Callable, Sequence

# results_io.Progress.step(): "[done/total] elapsed Ns, ETA Ns"
_STEP = re.compile(r"\[(\d+)/(\d+)\] elapsed \d+s, ETA \S+s ?(.*)", re.S)


def duration(seconds: float) -> str:
  """``"45 s"``, ``"12 min 5 s"`` or ``"?"`` (not a number yet)."""
  if not math.isfinite(seconds):
    return "?"
  seconds = max(0, int(round(seconds)))
  return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"


class JobProgress:
  """Rewrites the stages' progress lines into the job's (see the module docstring).

  Args:
    stages: ``(name, weight)`` of each stage in the order they run; weights are
      their expected shares of the job's time (any positive scale).
    log: where the lines go.
    clock: seconds (tests pass a fake one).
  """

  def __init__(self, stages: Sequence[tuple[str, float]], log: Callable[[str], None],
               clock: Callable[[], float] = time.time):
    if not stages or any(w <= 0 for _, w in stages):
      raise ValueError(f"stages must be (name, weight > 0) pairs, got {stages!r}")
    total = float(sum(w for _, w in stages))
    self.names = [n for n, _ in stages]
    self.weights = {n: w / total for n, w in stages}
    self.log, self.clock, self.t0 = log, clock, clock()
    self.done = {}  # stage -> fraction done
    self.done_at_start = {}  # stage -> fraction done before this invocation ran it
    self.current = None

  def stage(self, name: str) -> Callable[[str], None]:
    """The log function of stage ``name``; the stages before it count as finished."""
    i = self.names.index(name)
    for prev in self.names[:i]:
      self.done_at_start.setdefault(prev, 1.0)  # nothing seen of it: nothing ran here
      self.done[prev] = 1.0
    self.current = name
    label = f"stage {i + 1}/{len(self.names)} {name}"

    def log(line: str) -> None:
      m = _STEP.fullmatch(line)
      if not m:
        self.log(f"[{label}] {line}")
        return
      done, total, what = int(m.group(1)), int(m.group(2)), m.group(3)
      self.done_at_start.setdefault(name, (done - 1) / total)
      self.done[name] = done / total
      self.log(f"[{label}: {done}/{total}] {what} | job {duration(self.elapsed())}, "
               f"ETA ~{duration(self.eta())}")
    return log

  def elapsed(self) -> float:
    return self.clock() - self.t0

  def fraction(self) -> float:
    """The job's share done (stages weighed by their weights)."""
    return sum(self.weights[n] * f for n, f in self.done.items())

  def eta(self) -> float:
    """Seconds left: the weight still to do at the pace of this invocation's work."""
    ran = sum(self.weights[n] * (f - self.done_at_start.get(n, f))
              for n, f in self.done.items())
    if ran <= 0:
      return float("nan")
    return self.elapsed() / ran * (1.0 - self.fraction())
