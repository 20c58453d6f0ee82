"""Input validation shared by the public functions.

Shape checks always run (shapes are static under ``jit``). Value checks (finite
scores, probabilities in range) run when the argument is concrete, i.e. outside
``jit``; traced values cannot raise, so inside ``jit`` the functions document
what they return instead (and never silently repair an input; method, section
9, "Bad input"). ``certkv_jax.checked`` runs the same checks under ``jit`` with
``jax.experimental.checkify``.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
  """True when ``x`` has a value now (not a tracer inside jit/vmap/grad)."""
  if isinstance(x, jax.core.Tracer):
    return False
  return True


def concrete_array(x):
  """``np.asarray(x)`` when ``x`` is concrete, else None."""
  if not is_concrete(x):
    return None
  return np.asarray(x)


def check_finite(name: str, x) -> None:
  arr = concrete_array(x)
  if arr is not None and not np.all(np.isfinite(arr.astype(np.float64))):
    bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr.astype(np.float64))))
    raise ValueError(f"{name} must be finite; found {bad} non-finite entries")


def nonfinite_count(x, mask=None, value_axes: int = 0):
  """Number of NaN/inf entries of ``x`` that a masked computation reads.

  Works on concrete arrays and on tracers (the checked mode,
  ``certkv_jax.checked``, calls it under ``jit``).

  Args:
    x: [..., n, *value] array; its last ``value_axes`` axes are per-slot values
      (e.g. 1 for keys [..., n, d]), the axis before them the slots.
    mask: optional [..., n] bool whose leading dims broadcast against ``x``'s;
      None counts every entry. With a mask, an entry counts when its slot is
      True in at least one mask row that broadcasts onto it (slots that every
      row masks out are never read, so they may hold anything).
    value_axes: number of trailing per-slot value axes of ``x``.

  Returns:
    int32 scalar array.
  """
  x = jnp.asarray(x)
  bad = ~jnp.isfinite(x)
  if mask is not None:
    mask = jnp.asarray(mask).astype(bool)
    lead = x.shape[:x.ndim - value_axes]  # [..., n]
    joint = jnp.broadcast_shapes(lead, mask.shape)
    rank = len(joint)
    padded = (1,) * (rank - len(lead)) + tuple(lead)
    read = jnp.broadcast_to(mask, joint)
    axes = tuple(i for i in range(rank) if padded[i] == 1 and joint[i] > 1)
    if axes:
      read = jnp.any(read, axis=axes, keepdims=True)
    bad = bad & read.reshape(lead + (1,) * value_axes)
  return jnp.sum(bad, dtype=jnp.int32)


def check_finite_where(name: str, x, mask=None, value_axes: int = 0) -> None:
  """Raises ValueError if concrete ``x`` has NaN/inf entries that are read.

  The fast path is one ``jnp.isfinite(x).all()``; the masked count
  (:func:`nonfinite_count`) runs only when that fails. Returns without
  checking when ``x`` or ``mask`` is a tracer (inside ``jit``/``vmap``);
  concrete arrays used inside a trace are checked at trace time and add
  nothing to the traced program.
  """
  if not is_concrete(x) or (mask is not None and not is_concrete(mask)):
    return
  # Concrete arrays closed over inside a jit trace: evaluate now, do not stage.
  with jax.ensure_compile_time_eval():
    if bool(jnp.isfinite(x).all()):
      return
    bad = int(nonfinite_count(x, mask, value_axes))
  if bad:
    where = "" if mask is None else " on valid slots (mask True)"
    raise ValueError(f"{name} has {bad} NaN/inf entries{where}; {name} must be finite "
                     f"{'everywhere' if mask is None else 'there'}")


def check_in_range(name: str, x, lo, hi, *, lo_open=False, hi_open=False) -> None:
  """Checks lo <(=) x <(=) hi for a concrete scalar or array."""
  arr = concrete_array(x)
  if arr is None:
    return
  arr = arr.astype(np.float64)
  ok = np.isfinite(arr)
  ok &= (arr > lo) if lo_open else (arr >= lo)
  ok &= (arr < hi) if hi_open else (arr <= hi)
  if not np.all(ok):
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    shown = arr if arr.ndim == 0 else arr[~ok].ravel()[:5]
    raise ValueError(f"{name} must be in {left}{lo}, {hi}{right}; got {shown}")


def check_positive_int(name: str, x, *, minimum: int = 1) -> int:
  if isinstance(x, bool) or not isinstance(x, numbers.Integral):
    raise TypeError(f"{name} must be an int >= {minimum}, got {x!r}")
  if x < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {x}")
  return int(x)


def check_nonneg_int(name: str, x) -> int:
  return check_positive_int(name, x, minimum=0)


def check_where(x, mask, ok, message: str, worst) -> None:
  """Raises ``message`` (formatted with ``worst`` of the failures' values) unless ``ok``
  holds for ``x`` on every slot where ``mask`` is True; skipped unless both are concrete."""
  xc, mk = concrete_array(x), concrete_array(mask)
  if xc is None or mk is None:
    return
  xb, mkb = np.broadcast_arrays(xc.astype(np.float64), mk.astype(bool))
  valid = xb[mkb]
  if valid.size and not ok(valid).all():
    raise ValueError(message.format(worst(valid)))


def check_design(design, name: str = "design", *, optional: bool = False) -> None:
  """A TypeError naming ``name`` unless ``design`` is an eviction design (``evict`` and
  ``init`` methods; None too where ``optional``): a name string is the usual mistake."""
  if design is None and optional:
    return
  if not (callable(getattr(design, "evict", None)) and callable(getattr(design, "init", None))):
    raise TypeError(f"{name} must be an eviction design (certkv_jax.designs.registry.make(name, "
                    f"budget)){' or None' if optional else ''}, got {type(design).__name__} "
                    f"{design!r}")


def check_allocation(allocation) -> None:
  """A TypeError unless ``allocation`` is None or a callable per-head allocation."""
  if allocation is not None and (isinstance(allocation, str) or not callable(allocation)):
    raise TypeError("allocation must be None or a certkv_jax.designs.allocation object "
                    f"(AdaKV(), Pyramid(), ...), got {type(allocation).__name__} {allocation!r}")

