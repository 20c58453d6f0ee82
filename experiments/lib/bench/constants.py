"""Large arrays that a jitted function computes from no input (XLA may fold them).

XLA's constant folding evaluates, at compile time, every operation whose
operands are all constants; a large one (a cumulative sum over every cache
slot of caches made inside the function, say) can take seconds to minutes
of compile time, more after the GPU pipeline unrolls a loop around it.
:func:`constant_arrays` finds them before compiling: it walks the function's
closed jaxpr and marks every value computed from no function argument, and
reports each such array above a size with its shape, dtype and source line.

Marked values (``_State``): an argument (or anything it reaches) is *live*;
``iota``, broadcasts and the reshapes and slices of those are *generated*
(XLA keeps them as cheap iotas and broadcasts; a ``jnp.arange`` compared
with a traced input is the remedy, not the problem); any other op whose
operands are all marked is *constant* and is reported when it is larger than
``min_bytes``, as is every closed-over literal. Scan and while carries are
iterated to a fixed point (a carry is constant only if the body keeps it so),
and a loop's first iteration is also checked with its initial carry, as XLA
sees it once it unrolls the loop (the GPU pipeline unrolls short ones); a
``cond`` output is constant only when its index and every branch's output
are. Sub-jaxprs of other higher-order primitives (``jit``, ``custom_jvp``,
``remat``, ...) are walked with their operands' marks.

It lives beside the benchmark because its use is there: a decode step that
holds such an array compiles slowly (the check is cheap, a trace, no compile);
``tests/models/decode_constants_test.py`` holds the decode steps to it.
"""

from __future__ import annotations

import collections
import enum
import functools
from typing import NamedTuple

import jax

from jax._src import core
from jax._src import source_info_util

MIN_BYTES = 64 * 1024

# Cheap generators (XLA does not fold them beyond 32 elements) and the ops that only
# reshape, broadcast or retype an array: they keep their operand's mark without a report.
_GENERATORS = frozenset({"iota", "broadcast_in_dim"})
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                         "transpose", "convert_element_type", "copy", "copy_p", "rev",
                         "device_put"})
# Ops that pick elements of their first operand (the others are indices): a slice of an
# iota or a broadcast is one too.
_SELECT = frozenset({"slice", "dynamic_slice", "gather"})


class _State(enum.IntEnum):
  """How a value depends on the function's arguments (ordered: live wins)."""

  GENERATED = 0  # iota / broadcast of a literal: no input, cheap
  CONSTANT = 1  # computed from no input
  LIVE = 2  # depends on an argument


class Offender(NamedTuple):
  """One array over the limit that depends on no argument."""

  shape: tuple
  dtype: str
  nbytes: int
  primitive: str  # the op that computes it ("literal" for a closed-over constant)
  source: str  # file:line (function) of the user code that made it

  def __str__(self):
    return (f"{self.dtype}{list(self.shape)} ({self.nbytes / 1024:.0f} KiB) from "
            f"{self.primitive} at {self.source}")


def _nbytes(aval) -> int:
  shape = getattr(aval, "shape", None)
  if shape is None:
    return 0
  try:
    itemsize = aval.dtype.itemsize
  except (AttributeError, TypeError):  # an extended dtype (PRNG keys)
    itemsize = 8
  size = 1
  for d in shape:
    size *= int(d)
  return size * itemsize


def _source(eqn, where: str) -> str:
  """The eqn's user source line, or ``where`` (the enclosing eqn's) when jax's own
  functions traced it (``jnp.cumsum``'s inner ``jit``)."""
  return source_info_util.summarize(eqn.source_info) or where


def _closed(j):
  """``(jaxpr, consts)`` of a ClosedJaxpr or a Jaxpr."""
  if isinstance(j, core.ClosedJaxpr):
    return j.jaxpr, list(j.consts)
  return j, []


class _Walker:
  """Marks the values of a jaxpr and collects the offenders."""

  def __init__(self, min_bytes: int):
    self.min_bytes = min_bytes
    self.found = collections.OrderedDict()  # (source, primitive, shape, dtype) -> Offender

  def report(self, aval, primitive: str, source: str):
    n = _nbytes(aval)
    if n > self.min_bytes:
      off = Offender(tuple(int(d) for d in aval.shape), str(aval.dtype), n, primitive, source)
      self.found.setdefault((source, primitive, off.shape, off.dtype), off)

  def walk(self, jaxpr, consts: list, in_states: list, record: bool, where: str = "") -> list:
    """The marks of ``jaxpr``'s outputs given its inputs' (``consts`` closed over);
    ``where``: the source of the eqn that holds ``jaxpr``."""
    env = {}
    for v in jaxpr.constvars[:len(consts)]:
      env[v] = _State.CONSTANT
      if record:
        self.report(v.aval, "literal", "a closed-over constant")
    for v, s in zip(jaxpr.invars, in_states):
      env[v] = s

    def read(v):
      if isinstance(v, core.Literal):
        return _State.GENERATED
      return env.get(v, _State.LIVE)

    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      outs = self.eqn(eqn, ins, record, _source(eqn, where))
      for v, s in zip(eqn.outvars, outs):
        env[v] = s
    return [read(v) for v in jaxpr.outvars]

  def eqn(self, eqn, ins: list, record: bool, where: str) -> list:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name == "scan":
      outs = self.scan(eqn, ins, record, where)
    elif name == "while":
      outs = self.while_loop(eqn, ins, record, where)
    elif name == "cond":
      outs = self.cond(eqn, ins, record, where)
    else:
      sub = self.subjaxpr(eqn)
      if sub is not None:
        jaxpr, consts = _closed(sub)
        outs = self.walk(jaxpr, consts, ins, record, where)
      elif not ins:
        outs = [_State.GENERATED if name in _GENERATORS else _State.CONSTANT] * n_out
      else:
        worst = max(ins)
        if worst == _State.LIVE:
          outs = [_State.LIVE] * n_out
        elif name in _SHAPE_ONLY:
          outs = [worst] * n_out
        elif name in _SELECT:
          outs = [ins[0]] * n_out
        else:
          outs = [_State.CONSTANT] * n_out
      if record and sub is None and name not in _SHAPE_ONLY | _SELECT | _GENERATORS:
        for v, s in zip(eqn.outvars, outs):
          if s == _State.CONSTANT:
            self.report(v.aval, name, where)
    return outs

  @staticmethod
  def subjaxpr(eqn):
    """The one sub-jaxpr that maps the eqn's operands to its results, if any."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
      j = eqn.params.get(key)
      if isinstance(j, (core.ClosedJaxpr, core.Jaxpr)):
        inner, _ = _closed(j)
        if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
          return j
    return None

  def _fixed_point(self, body, consts, fixed: list, carry: list, rest: list, n_carry: int):
    """Carry marks at the loop's fixed point: a carry stays constant only if the body
    returns it constant from constant carries (marks only rise, so this ends)."""
    while True:
      outs = self.walk(body, consts, fixed + carry + rest, record=False)
      new = [max(c, o) for c, o in zip(carry, outs[:n_carry])]
      if new == carry:
        return carry
      carry = new

  def scan(self, eqn, ins, record, where):
    p = eqn.params
    body, consts = _closed(p["jaxpr"])
    nc, nk = p["num_consts"], p["num_carry"]
    fixed, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    if record:  # the first iteration, as XLA sees it once it unrolls or peels the loop
      self.walk(body, consts, fixed + carry + xs, record, where)
    carry = self._fixed_point(body, consts, fixed, carry, xs, nk)
    outs = self.walk(body, consts, fixed + carry + xs, record, where)
    return carry + outs[nk:]

  def while_loop(self, eqn, ins, record, where):
    p = eqn.params
    cond, cond_consts = _closed(p["cond_jaxpr"])
    body, body_consts = _closed(p["body_jaxpr"])
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cfix, bfix, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
    if record:  # the first iteration (an unrolled or peeled loop)
      self.walk(body, body_consts, bfix + carry, record, where)
    carry = self._fixed_point(body, body_consts, bfix, carry, [], len(carry))
    self.walk(body, body_consts, bfix + carry, record, where)
    (pred,) = self.walk(cond, cond_consts, cfix + carry, record, where)
    # A trip count that depends on an argument makes every carry live.
    return [max(c, pred) if pred == _State.LIVE else c for c in carry]

  def cond(self, eqn, ins, record, where):
    index, ops = ins[0], ins[1:]
    outs = None
    for branch in eqn.params["branches"]:
      jaxpr, consts = _closed(branch)
      b = self.walk(jaxpr, consts, ops, record, where)
      outs = b if outs is None else [max(x, y) for x, y in zip(outs, b)]
    return [max(o, _State.CONSTANT) if index != _State.LIVE else _State.LIVE for o in outs]


def constant_arrays(fn, *args, min_bytes: int = MIN_BYTES, **kwargs) -> list[Offender]:
  """Every array of more than ``min_bytes`` that ``fn`` computes from no argument.

  Args:
    fn: a function, ``jax.jit``-wrapped or not, traced (not compiled) with
      ``args`` (arrays or ``jax.ShapeDtypeStruct``) and ``kwargs`` (static for a
      function that is not jitted); or a ``ClosedJaxpr`` (then no ``args``).
    min_bytes: the size limit (default 64 KiB).

  Returns:
    The offenders in program order, one per (source line, op, shape, dtype): the
    closed-over literals and the computed arrays; empty when there are none.

  Raises:
    TypeError naming ``fn`` when it is neither a function nor a ClosedJaxpr;
    ValueError naming ``min_bytes`` when it is not an int >= 0.
  """
  if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
    raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
  if isinstance(fn, core.ClosedJaxpr):
    closed = fn
  elif hasattr(fn, "trace"):
    closed = fn.trace(*args, **kwargs).jaxpr
  elif callable(fn):  # e.g. a wrapper around a jitted function; kwargs stay static
    closed = jax.make_jaxpr(functools.partial(fn, **kwargs))(*args)
  else:
    raise TypeError(f"fn must be a function or a ClosedJaxpr, got {fn!r}")
  walker = _Walker(min_bytes)
  jaxpr, consts = _closed(closed)
  walker.walk(jaxpr, consts, [_State.LIVE] * len(jaxpr.invars), record=True)
  return list(walker.found.values())


def describe(offenders: list) -> str:
  """One line per offender (for an assertion message)."""
  return "\n".join(str(o) for o in offenders) or "none"
