"""Online warning signals of one attention call, from the kept set alone (method, section 10).

Per call, without the full cache, they say when the certificate's own
ingredients look fragile: ``ess``, ``max_tail_weight``, ``range_ratio``,
``entropy``, ``r_hat`` (a kept-set stand-in for Assumption 2's ratio) and
``tail_mass``, with ``V_hat`` and ``b_hat`` from ``pallas_kernels.reference``.
:func:`signals` is one call; :func:`signals_batched` maps it over leading dims.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate
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
  pc, pic, mc = (_validate.concrete_array(x) for x in (p, pi, mask))
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

  # V_hat, b_hat by the reference code: logits log p give softmax p, centred at o_hat.
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
    p: [n] offset-attention probabilities (:func:`certkv_jax.attention_probs`),
      0 on invalid slots.
    pi: [n] inclusion probabilities in (0, 1] (1 on the certainty set), read
      only where ``mask``.
    mask: [n] bool, True for slots that hold a kept token.
    v: [n, dv] values.
    o_hat: [dv] the call's output, the centre of the variance sums (any centre
      gives the same statistics up to rounding; this one the least rounding).

  Returns :class:`Signals` of scalars; ValueError naming the argument for wrong
  shapes/dtypes and, outside jit, ``p`` outside [0, 1] or ``pi`` outside (0, 1]
  on a valid slot.
  """
  p, pi, mask, v, o_hat = (jnp.asarray(x) for x in (p, pi, mask, v, o_hat))
  _check(p, pi, mask, v, o_hat, lead_ndim=0)
  return _signals_one_jit(p, pi, mask, v, o_hat)


def signals_batched(p, pi, mask, v, o_hat) -> Signals:
  """:func:`signals` over leading dimensions (``jax.vmap`` of the one-call code).

  ``p``, ``pi``, ``mask`` [..., n], ``v`` [..., n, dv] and ``o_hat`` [..., dv]
  broadcast by numpy rules (e.g. v [b, h_kv, 1, n, dv] against p [b, h_kv, g, n]);
  the fields of the result have the broadcast leading shape.
  """
  p, pi, mask, v, o_hat = (jnp.asarray(x) for x in (p, pi, mask, v, o_hat))
  lead, n, dv = _check(p, pi, mask, v, o_hat)
  size = math.prod(lead)

  def flat(x, core):
    return jnp.broadcast_to(x, lead + core).reshape((size,) + core)

  out = _signals_vmap_jit(flat(p, (n,)), flat(pi, (n,)), flat(mask, (n,)),
                               flat(v, (n, dv)), flat(o_hat, (dv,)))
  return jax.tree_util.tree_map(lambda x: x.reshape(lead), out)
