"""Checked mode: the bad-input checks of method, section 9 ("Bad input"), under ``jit``.

The public functions check argument values only when the arrays are concrete
(outside ``jit`` and ``vmap``). Traced bad values run through and give the
results that the docstrings and method, section 9 describe (NaN or infinite
radii, outputs of 0, silently dropped tokens). This module adds the same
checks as ``jax.experimental.checkify`` checks, which do run under ``jit``::

    from certkv_jax import checked

    f = checked.checked(checked.checked_offset_attention)   # jitted, checkified
    err, res = f(q, k, v, log_pi, mask)
    err.throw()   # ValueError naming the argument, if a check failed

The checks live only in these wrappers. The unchecked functions are unchanged:
their jitted programs contain no check and give bit-identical results whether
or not this module is used, and a checked wrapper returns exactly what its
unchecked function returns. A function with checks must be staged through
``checkify.checkify`` (:func:`checked` does it, with ``jit``); called eagerly,
a failing check raises ``checkify.JaxRuntimeError`` (a ValueError) at once;
staged under plain ``jit`` without ``checkify`` it fails at trace time.

What is checked (each message names the argument and the allowed range):

* :func:`check_attention_inputs`: ``q`` finite; ``k``, ``v``, ``log_pi``
  finite on valid slots; ``log_pi <= 0`` there; every ``mask`` row has a
  valid slot (an all-False row is a defined result of
  ``certkv_jax.offset_attention``, out 0, but in a model it means a bug).
* :func:`check_delta`: every ``delta`` in (0, 1), NaN excluded.
* :func:`check_no_overflow`: no cache has dropped a token on append
  (``KVCache.n_dropped == 0``; method, section 9, "Capacity and overflow").
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from certkv_jax import _checks
from certkv_jax import attention
from certkv_jax import cache as cache_lib
from certkv_jax import certificate

Array = jax.Array

# The checkify error set of this module's checks (``checkify.check`` calls).
# ``errors=`` can add checkify's automatic checks (e.g. ``checkify.nan_checks``),
# which instrument every operation instead of the inputs.
ERRORS = checkify.user_checks


def _first_bad(x, ok):
  """The first entry of ``x`` where ``ok`` (same shape) is False; x's first if none."""
  if not jnp.size(x):
    return jnp.float32(jnp.nan)
  return jnp.ravel(x)[jnp.argmin(jnp.ravel(ok))]


def check_attention_inputs(q, k, v, log_pi, mask, *, allow_empty_rows: bool = False) -> None:
  """Checkify checks of the inputs of ``certkv_jax.offset_attention``.

  Shapes and dtypes are checked statically (ValueError/TypeError at trace
  time, as in ``offset_attention``).

  Args:
    q: [..., d] queries; must be finite.
    k: [..., n, d] keys; finite on valid slots.
    v: [..., n, dv] values (None to skip, for ``attention_probs``); finite on
      valid slots.
    log_pi: [..., n] log inclusion probabilities; finite and <= 0 on valid slots.
    mask: [..., n] bool.
    allow_empty_rows: accept mask rows with no valid slot (their result is
      defined: out 0, lse -inf).
  """
  q, k, log_pi, mask = (jnp.asarray(x) for x in (q, k, log_pi, mask))
  v = None if v is None else jnp.asarray(v)
  attention._check_shapes(q, k, v, log_pi, mask)  # pylint: disable=protected-access
  n_q = _checks.nonfinite_count(q)
  checkify.check(n_q == 0, "q has {n} NaN/inf entries; q must be finite everywhere", n=n_q)
  arrays = (("k", k, 1), ("log_pi", log_pi, 0))
  if v is not None:
    arrays = (("k", k, 1), ("v", v, 1), ("log_pi", log_pi, 0))
  for name, x, value_axes in arrays:
    n_bad = _checks.nonfinite_count(x, mask, value_axes)
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
  """Checkify check that no cache dropped a token on append.

  Args:
    caches: a ``KVCache`` of any leading shape (one head, or the stacked
      ``[n_layers, batch, n_kv_heads]`` caches of ``certkv_jax.caches``).
    name: how the message names the caches.
  """
  dropped = jnp.sum(caches.n_dropped, dtype=jnp.int32)
  checkify.check(dropped == 0, f"{name} overflow: {{n}} appended tokens found no free slot "
                 f"(capacity {caches.capacity} per head; n_dropped must stay 0): raise the "
                 "capacity to hold the kept tokens plus each appended chunk", n=dropped)


def checked_offset_attention(q, k, v, log_pi, mask, *, allow_empty_rows: bool = False,
                             **kwargs) -> attention.OffsetAttentionResult:
  """``certkv_jax.offset_attention`` with :func:`check_attention_inputs`.

  Keyword arguments other than ``allow_empty_rows`` go to ``offset_attention``;
  the result is the same as the unchecked call's, bit for bit. Stored value
  norms (``value_sqnorm``), when given, are checked too: finite and >= 0 on
  valid slots.
  """
  check_attention_inputs(q, k, v, log_pi, mask, allow_empty_rows=allow_empty_rows)
  if kwargs.get("value_sqnorm") is not None:
    sq = jnp.asarray(kwargs["value_sqnorm"])
    n_bad = _checks.nonfinite_count(sq, mask)
    checkify.check(n_bad == 0, "value_sqnorm has {n} NaN/inf entries on valid slots (mask "
                   "True); it must be finite there", n=n_bad)
    n_neg = jnp.sum(jnp.asarray(mask) & (sq < 0), dtype=jnp.int32)
    checkify.check(n_neg == 0, "value_sqnorm must be >= 0 (a squared norm) on every valid "
                   "slot; found {n} entries < 0", n=n_neg)
  return attention.offset_attention(q, k, v, log_pi, mask, **kwargs)


def checked_attention_probs(q, k, log_pi, mask, *, allow_empty_rows: bool = False,
                            scale: Optional[float] = None) -> Array:
  """``certkv_jax.attention_probs`` with :func:`check_attention_inputs` (no ``v``)."""
  check_attention_inputs(q, k, None, log_pi, mask, allow_empty_rows=allow_empty_rows)
  return attention.attention_probs(q, k, log_pi, mask, scale=scale)


def checked_certificate_radius(result, delta, form: str = "bernstein") -> Array:
  """``certkv_jax.certificate_radius`` with :func:`check_delta`.

  The statistics are not checked: a NaN ``var_hat`` marks a call left out of a
  subsampled certificate (``models.decode``); check the attention inputs with
  :func:`checked_offset_attention` instead.
  """
  check_delta(delta)
  return certificate.certificate_radius(result, delta, form)


def checked_radius_from_stats(var_hat, range_hat, delta, form: str = "bernstein") -> Array:
  """``certkv_jax.certificate.radius_from_stats`` with :func:`check_delta`."""
  check_delta(delta)
  return certificate.radius_from_stats(var_hat, range_hat, delta, form)


def checked_append(cache: cache_lib.KVCache, k_new, v_new, new_valid=None) -> cache_lib.KVCache:
  """``certkv_jax.cache.append`` that fails (checkify) if any token was dropped.

  The check reads the cache's cumulative ``n_dropped`` after the append, so a
  cache that overflowed earlier fails too. Works per head and under ``vmap``
  (e.g. ``certkv_jax.caches.over_heads(checked_append)``).
  """
  new = cache_lib.append(cache, k_new, v_new, new_valid)
  check_no_overflow(new)
  return new


def checked(fn: Callable, *, errors=ERRORS, jit: bool = True, **jit_kwargs) -> Callable:
  """``fn`` with its checkify checks functionalised: returns ``(err, out)``.

  Args:
    fn: a function that calls the ``check_*`` / ``checked_*`` functions here
      (or any ``checkify.check``).
    errors: checkify error set (default :data:`ERRORS`, the user checks).
    jit: wrap the checkified function in ``jax.jit``.
    **jit_kwargs: passed to ``jax.jit`` (e.g. ``static_argnames``).

  Returns:
    A function with ``fn``'s arguments that returns ``(err, out)``;
    ``err.throw()`` raises ``checkify.JaxRuntimeError`` (a ValueError) with
    the first failed check's message, ``err.get()`` returns it or None.
  """
  f = checkify.checkify(fn, errors=errors)
  return jax.jit(f, **jit_kwargs) if jit else f


def raising(fn: Callable, *, errors=ERRORS, **jit_kwargs) -> Callable:
  """``fn`` jitted and checkified, raising on a failed check and returning ``out``.

  Each call waits for the error value, i.e. synchronises with the device.
  """
  f = checked(fn, errors=errors, **jit_kwargs)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    err, out = f(*args, **kwargs)
    err.throw()
    return out

  return call
