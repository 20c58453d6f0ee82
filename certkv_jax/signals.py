"""Online warning signals of one attention call, from the kept set alone.

The conformal scale (:mod:`certkv_jax.calibration`) fixes the certificate's
level on average; these signals say, per call and without the full cache,
when the certificate's own ingredients look fragile. All of them are functions
of what the cache holds: the offset-attention probabilities ``p`` over kept
slots (softmax of ``s_i - log pi_i``, 0 on invalid slots), the inclusion
probabilities ``pi`` (1 on the certainty set), the values and the output.

Per call (one query, one KV head), with the kept tail ``T_S = {i in S: pi_i < 1}``
and ``w_i = 1 - pi_i``:

* ``ess = 1 / sum_S p_i^2`` -- effective sample size of the offset weights
  (Kish), in ``[1, |S|]``; small when a few slots carry the output.
* ``max_tail_weight = max_{T_S} w_i p_i`` -- the largest tail term's weight.
* ``range_ratio = b_hat / sqrt(V_hat)`` -- in ``[0, 1]`` (``b_hat^2`` is one
  of the terms that sum to ``V_hat``); near 1 when one tail slot dominates the
  variance, i.e. the Gaussian part of the Bernstein radius is unreliable.
  Defined as 0 when ``V_hat = 0`` (then ``b_hat = 0`` too, in exact arithmetic).
* ``entropy = -sum_S p_i log p_i`` (nats; ``0 log 0 = 0``).
* ``r_hat = m_hat * max_{T_S} p_i`` -- a kept-set stand-in for the
  Assumption-2 ratio ``R = m max_T a_i / (pi_i sum_C a_j)`` (method, section 6,
  which needs the full cache): ``p_i = (a_i / pi_i) / sum_S a_j / pi_j`` and
  the Hajek denominator estimates ``sum_C a_j``. The design's expected tail
  size ``m`` is not visible from the kept set, so ``m_hat = |T_S|``, the
  number of kept tail slots (its realisation; ``E|T_S| = m``).
* ``tail_mass = sum_{T_S} p_i``.

``var_hat`` and ``range_hat`` (the certificate statistics ``V_hat``, ``b_hat``)
come from the one implementation of method, section 4 in
``pallas_kernels.reference`` (the same code behind
:func:`certkv_jax.offset_attention`), fed with ``log p`` as the logits.

Write for one call, lift with vmap: :func:`signals` is one call,
:func:`signals_batched` maps it over any leading dimensions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _checks
from pallas_kernels import reference

Array = jax.Array


class Signals(NamedTuple):
  """Warning signals of one call (leading dims ``...`` when batched). float32."""

  ess: Array  # [...] 1 / sum p^2; 0 for a call with no valid slot
  max_tail_weight: Array  # [...] max over kept tail of (1 - pi) p; 0 without tail
  range_ratio: Array  # [...] b_hat / sqrt(V_hat) in [0, 1]; 0 when V_hat = 0
  entropy: Array  # [...] -sum p log p (nats)
  r_hat: Array  # [...] (number of kept tail slots) * max over kept tail of p
  tail_mass: Array  # [...] sum over kept tail of p
  var_hat: Array  # [...] V_hat = sum (1 - pi) p^2 ||v - o_hat||^2
  range_hat: Array  # [...] b_hat = max over kept tail of (1 - pi) p ||v - o_hat||


def _check(p, pi, mask, v, o_hat, lead_ndim=None):
  """Shape/dtype checks (always) and value checks (when concrete)."""
  for name, x, core in (("p", p, 1), ("pi", pi, 1), ("mask", mask, 1), ("v", v, 2),
                        ("o_hat", o_hat, 1)):
    if x.ndim < core or (lead_ndim is not None and x.ndim != core + lead_ndim):
      want = f"exactly {core}" if lead_ndim == 0 else f"at least {core}"
      raise ValueError(f"{name} must have {want} dims, got shape {x.shape}")
  n, dv = p.shape[-1], v.shape[-1]
  for name, x in (("pi", pi), ("mask", mask)):
    if x.shape[-1] != n:
      raise ValueError(f"{name} must have n={n} slots on its last axis like p; got {x.shape}")
  if v.shape[-2] != n:
    raise ValueError(f"v must have n={n} slots on axis -2 like p; got {v.shape}")
  if o_hat.shape[-1] != dv:
    raise ValueError(f"o_hat must have dv={dv} entries on its last axis like v; got "
                     f"{o_hat.shape}")
  if mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be bool, got dtype {mask.dtype}")
  for name, x in (("p", p), ("pi", pi), ("v", v), ("o_hat", o_hat)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {x.dtype}")
  try:
    lead = jnp.broadcast_shapes(p.shape[:-1], pi.shape[:-1], mask.shape[:-1], v.shape[:-2],
                                o_hat.shape[:-1])
  except ValueError as err:
    raise ValueError(f"leading dims must broadcast: p {p.shape}, pi {pi.shape}, mask "
                     f"{mask.shape}, v {v.shape}, o_hat {o_hat.shape}") from err
  pc, pic, mc = (_checks.concrete_array(x) for x in (p, pi, mask))
  if pc is not None and pic is not None and mc is not None:
    pc, pic, mc = np.broadcast_arrays(pc.astype(np.float64), pic.astype(np.float64), mc)
    if not np.all((pc[mc] >= 0) & (pc[mc] <= 1)):
      raise ValueError("p must be in [0, 1] (probabilities) on every valid slot; found "
                       f"{pc[mc][~((pc[mc] >= 0) & (pc[mc] <= 1))][:5]}")
    ok = (pic[mc] > 0) & (pic[mc] <= 1)
    if not np.all(ok):
      raise ValueError(f"pi must be in (0, 1] on every valid slot; found {pic[mc][~ok][:5]}")
  return tuple(lead), n, dv


def _signals_one(p, pi, mask, v, o_hat) -> Signals:
  """Signals of one call: p, pi, mask [n]; v [n, dv]; o_hat [dv]. Unchecked."""
  dv = v.shape[-1]
  p = jnp.where(mask, p.astype(jnp.float32), 0.0)  # [n]
  pi = pi.astype(jnp.float32)
  tail = mask & (pi < 1.0)  # [n] kept tail slots
  w = jnp.where(mask, 1.0 - pi, 0.0)  # [n]
  sum_p2 = jnp.sum(p * p)
  ess = jnp.where(sum_p2 > 0, 1.0 / jnp.where(sum_p2 > 0, sum_p2, 1.0), 0.0)
  safe_p = jnp.where(p > 0, p, 1.0)
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(safe_p), 0.0))
  tail_p = jnp.where(tail, p, 0.0)
  max_tail_weight = jnp.max(w * tail_p, initial=0.0)
  r_hat = jnp.sum(tail).astype(jnp.float32) * jnp.max(tail_p, initial=0.0)
  tail_mass = jnp.sum(tail_p)

  # V_hat and b_hat by the reference implementation (one formula, one place):
  # with logits log p, its softmax is p itself; o_hat is the centre of the
  # second-order sums, and the statistics are taken about sum_S p_i v_i.
  l = jnp.where(mask & (p > 0), jnp.log(safe_p), -jnp.inf)[None, :]  # [1, n]
  valid = mask[None, :]  # [1, n]
  hp = jax.lax.Precision.HIGHEST
  fin = reference.finalize(reference.online_update(
      reference.empty_partials((1,), dv), l, v, w[None, :], valid,
      options=reference.UpdateOptions(precision=hp, center=o_hat.astype(jnp.float32)[None, :])))
  var_hat = fin.var_hat[0]
  range_hat = reference.exact_range(l, v, w[None, :], valid, fin.out, fin.lse)[0]
  sd = jnp.sqrt(var_hat)
  range_ratio = jnp.where(sd > 0, range_hat / jnp.where(sd > 0, sd, 1.0), 0.0)
  return Signals(ess=ess, max_tail_weight=max_tail_weight, range_ratio=range_ratio,
                 entropy=entropy, r_hat=r_hat, tail_mass=tail_mass, var_hat=var_hat,
                 range_hat=range_hat)


# Compiled once per shape: eager op-by-op dispatch of the body costs seconds.
_signals_one_jit = jax.jit(_signals_one)
_signals_vmap_jit = jax.jit(jax.vmap(_signals_one))


def signals(p, pi, mask, v, o_hat) -> Signals:
  """Warning signals of one attention call (one query, one head).

  Args:
    p: [n] offset-attention probabilities over the slots (e.g.
      :func:`certkv_jax.attention_probs`); 0 on invalid slots.
    pi: [n] inclusion probabilities in (0, 1] (``exp(log_pi)`` of the cache;
      1 on the certainty set). Read only where ``mask``.
    mask: [n] bool, True for slots that hold a kept token.
    v: [n, dv] values.
    o_hat: [dv] the call's output ``sum_i p_i v_i``, used as the centre of
      the variance sums (any centre gives the same statistics up to rounding;
      this one makes the rounding smallest).

  Returns:
    :class:`Signals` of scalars.

  Raises:
    ValueError naming the argument for wrong shapes/dtypes and, outside jit,
    ``p`` outside [0, 1] or ``pi`` outside (0, 1] on a valid slot.
  """
  p, pi, mask, v, o_hat = (jnp.asarray(x) for x in (p, pi, mask, v, o_hat))
  _check(p, pi, mask, v, o_hat, lead_ndim=0)
  return _signals_one_jit(p, pi, mask, v, o_hat)


def signals_batched(p, pi, mask, v, o_hat) -> Signals:
  """:func:`signals` over leading dimensions (``jax.vmap`` of the one-call code).

  Args:
    p, pi, mask: [..., n]; v: [..., n, dv]; o_hat: [..., dv]. Leading dims
      broadcast (numpy rules), e.g. v [b, h_kv, 1, n, dv] against the GQA
      group p [b, h_kv, g, n].

  Returns:
    :class:`Signals` with fields of the broadcast leading shape ``[...]``.
  """
  p, pi, mask, v, o_hat = (jnp.asarray(x) for x in (p, pi, mask, v, o_hat))
  lead, n, dv = _check(p, pi, mask, v, o_hat)
  size = math.prod(lead)

  def flat(x, core):
    return jnp.broadcast_to(x, lead + core).reshape((size,) + core)

  out = _signals_vmap_jit(flat(p, (n,)), flat(pi, (n,)), flat(mask, (n,)),
                               flat(v, (n, dv)), flat(o_hat, (dv,)))
  return jax.tree_util.tree_map(lambda x: x.reshape(lead), out)
