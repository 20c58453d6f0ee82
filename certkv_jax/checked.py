"""Checked mode: the bad-input checks of method, section 9 ("Bad input"), under ``jit``.

Elsewhere values are checked only when concrete; these wrappers add the same
checks as ``checkify`` checks, leaving the unchecked programs unchanged::

    f = checked.checked(checked.checked_offset_attention)   # jitted, checkified
    err, res = f(q, k, v, log_pi, mask)
    err.throw()   # ValueError naming the argument, if a check failed
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from certkv_jax import _validate
from certkv_jax.attention import offset
from certkv_jax import certificate
from certkv_jax.kv import cache as cache_lib

Array = jax.Array

# The checks here (``checkify.check``); ``errors=`` can add e.g. ``checkify.nan_checks``.
ERRORS = checkify.user_checks


def _first_bad(x, ok):
  """The first entry of ``x`` where ``ok`` (same shape) is False; x's first if none."""
  if not jnp.size(x):
    return jnp.float32(jnp.nan)
  return jnp.ravel(x)[jnp.argmin(jnp.ravel(ok))]


def check_attention_inputs(q, k, v, log_pi, mask, *, allow_empty_rows: bool = False) -> None:
  """Checkify checks of the inputs of ``certkv_jax.offset_attention``.

  ``q`` finite; ``k``, ``v`` (None to skip) and ``log_pi <= 0`` finite on
  valid slots; every ``mask`` row has a valid slot unless ``allow_empty_rows``.
  """
  q, k, log_pi, mask = (jnp.asarray(x) for x in (q, k, log_pi, mask))
  v = None if v is None else jnp.asarray(v)
  offset._check_shapes(q, k, v, log_pi, mask)  # pylint: disable=protected-access
  n_q = _validate.nonfinite_count(q)
  checkify.check(n_q == 0, "q has {n} NaN/inf entries; q must be finite everywhere", n=n_q)
  arrays = (("k", k, 1), ("log_pi", log_pi, 0))
  if v is not None:
    arrays = (("k", k, 1), ("v", v, 1), ("log_pi", log_pi, 0))
  for name, x, value_axes in arrays:
    n_bad = _validate.nonfinite_count(x, mask, value_axes)
    checkify.check(n_bad == 0, f"{name} has {{n}} NaN/inf entries on valid slots (mask True); "
                   f"{name} must be finite there", n=n_bad)
  lp = jnp.where(mask, log_pi.astype(jnp.float32), 0.0)
  n_pos = jnp.sum(lp > 0, dtype=jnp.int32)
  checkify.check(n_pos == 0, "log_pi must be <= 0 (a log probability, pi in (0, 1]) on every "
                 "valid slot (mask True); found {n} entries > 0, max {m}", n=n_pos,
                 m=jnp.max(jnp.where(jnp.isnan(lp), 0.0, lp)))
  if not allow_empty_rows:
    empty = ~jnp.any(mask, axis=-1)
    n_empty = jnp.sum(empty, dtype=jnp.int32)
    first = jnp.argmax(jnp.ravel(empty)) if empty.ndim else jnp.int32(0)
    checkify.check(n_empty == 0, "mask has {n} rows with no valid slot (all False; first at "
                   "flat row {i}); every row needs >= 1 valid slot", n=n_empty, i=first)


def check_delta(delta, name: str = "delta") -> None:
  """Checkify check that every entry of ``delta`` is in (0, 1) (NaN fails)."""
  d = jnp.asarray(delta, jnp.float32)
  ok = (d > 0.0) & (d < 1.0)
  n_bad = jnp.sum(~ok, dtype=jnp.int32)
  checkify.check(n_bad == 0, f"{name} must be in (0, 1); got {{n}} entries outside, first "
                 "{x}", n=n_bad, x=_first_bad(d, ok))


def check_no_overflow(caches, name: str = "cache") -> None:
  """Checkify check that no cache (``KVCache`` of any leading shape) dropped a token on append."""
  dropped = jnp.sum(caches.n_dropped, dtype=jnp.int32)
  checkify.check(dropped == 0, f"{name} overflow: {{n}} appended tokens found no free slot "
                 f"(capacity {caches.capacity} per head; n_dropped must stay 0): raise the "
                 "capacity to hold the kept tokens plus each appended chunk", n=dropped)


def checked_offset_attention(q, k, v, log_pi, mask, *, allow_empty_rows: bool = False,
                             **kwargs) -> offset.OffsetAttentionResult:
  """``certkv_jax.offset_attention`` with :func:`check_attention_inputs`; same result, bit for bit.

  A given ``value_sqnorm`` is checked too: finite and >= 0 on valid slots.
  """
  check_attention_inputs(q, k, v, log_pi, mask, allow_empty_rows=allow_empty_rows)
  if kwargs.get("value_sqnorm") is not None:
    sq = jnp.asarray(kwargs["value_sqnorm"])
    n_bad = _validate.nonfinite_count(sq, mask)
    checkify.check(n_bad == 0, "value_sqnorm has {n} NaN/inf entries on valid slots (mask "
                   "True); it must be finite there", n=n_bad)
    n_neg = jnp.sum(jnp.asarray(mask) & (sq < 0), dtype=jnp.int32)
    checkify.check(n_neg == 0, "value_sqnorm must be >= 0 (a squared norm) on every valid "
                   "slot; found {n} entries < 0", n=n_neg)
  return offset.offset_attention(q, k, v, log_pi, mask, **kwargs)


def checked_attention_probs(q, k, log_pi, mask, *, allow_empty_rows: bool = False,
                            scale: Optional[float] = None) -> Array:
  """``certkv_jax.attention_probs`` with :func:`check_attention_inputs` (no ``v``)."""
  check_attention_inputs(q, k, None, log_pi, mask, allow_empty_rows=allow_empty_rows)
  return offset.attention_probs(q, k, log_pi, mask, scale=scale)


def checked_certificate_radius(result, delta, form: str = "bernstein") -> Array:
  """``certkv_jax.certificate_radius`` with :func:`check_delta`.

  The statistics are not checked: NaN marks a call left out of a subsampled certificate.
  """
  check_delta(delta)
  return certificate.certificate_radius(result, delta, form)


def checked_radius_from_stats(var_hat, range_hat, delta, form: str = "bernstein") -> Array:
  """``certkv_jax.certificate.radius_from_stats`` with :func:`check_delta`."""
  check_delta(delta)
  return certificate.radius_from_stats(var_hat, range_hat, delta, form)


def checked_append(cache: cache_lib.KVCache, k_new, v_new, new_valid=None) -> cache_lib.KVCache:
  """``certkv_jax.kv.cache.append`` that fails (checkify) if the cache ever dropped a token."""
  new = cache_lib.append(cache, k_new, v_new, new_valid)
  check_no_overflow(new)
  return new


def checked(fn: Callable, *, errors=ERRORS, jit: bool = True, **jit_kwargs) -> Callable:
  """``fn`` with its checkify checks functionalised: returns ``(err, out)``.

  ``jit`` wraps it in ``jax.jit`` with ``jit_kwargs``; ``err.throw()`` raises
  ``checkify.JaxRuntimeError`` (a ValueError) with the first failed check.
  """
  f = checkify.checkify(fn, errors=errors)
  return jax.jit(f, **jit_kwargs) if jit else f


def raising(fn: Callable, *, errors=ERRORS, **jit_kwargs) -> Callable:
  """``fn`` jitted and checkified, raising on a failed check (synchronises with the device)."""
  f = checked(fn, errors=errors, **jit_kwargs)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    err, out = f(*args, **kwargs)
    err.throw()
    return out

  return call
