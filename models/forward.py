"""The forward pass of a chunk of new tokens through the model and its caches.

:func:`forward_chunk` runs the layers (attention through ``certkv_jax.layer``).
Its ``"scan"`` loop compiles one layer over stacked weights and caches, copying
each layer's slice; ``"unrolled"`` reads per-layer buffers in place.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from certkv_jax.attention import certified
from certkv_jax.kv import caches as caches_lib
from certkv_jax.kv.caches import Caches
from certkv_jax import layer
from models.config import LlamaConfig
from models import llama
from models.llama import Block
from models.llama import LlamaModel

Array = jax.Array


LAYER_LOOPS = ("scan", "unrolled")


class Forwarded(NamedTuple):
  """What :func:`forward_chunk` returns."""

  logits: Array  # [batch, t, vocab] float32
  caches: Caches  # in the form given
  stats: Optional[certified.ChunkStats]  # fields [t, n_layers, batch, n_heads]
  shadow: Optional[Caches]  # the shadow with the chunk appended, or None


def unstack_layers(params, config: LlamaConfig):
  """``params`` with ``layers`` split into per-layer trees, q, k and v fused
  (``llama.fuse_qkv``), for ``layer_loop="unrolled"``; call it once, outside ``jit``."""
  layers = params["params"]["layers"]
  if isinstance(layers, (tuple, list)):
    return params
  n = jax.tree_util.tree_leaves(layers)[0].shape[0]
  split = tuple(llama.fuse_qkv(llama.layer_params(params, i), config) for i in range(n))
  return {**params, "params": {**params["params"], "layers": split}}


def stack_layers(params):
  """The inverse of :func:`unstack_layers` (stacked params are returned as they are)."""
  layers = params["params"]["layers"]
  if not isinstance(layers, (tuple, list)):
    return params
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                   *[llama.unfuse_qkv(l) for l in layers])
  return {**params, "params": {**params["params"], "layers": stacked}}


def _check_layer_loop(params, config: LlamaConfig, caches, layer_loop: str) -> None:
  """Checks ``layer_loop`` against the forms of ``params`` and ``caches``."""
  if layer_loop not in LAYER_LOOPS:
    raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
  layers = params["params"]["layers"]
  unstacked = isinstance(layers, (tuple, list))
  if unstacked and len(layers) != config.n_layers:
    raise ValueError(f"params has {len(layers)} unstacked layers, config says n_layers="
                     f"{config.n_layers}")
  caches_lib.check_caches(caches)
  if caches.n_layers != config.n_layers:
    raise ValueError(f"caches has {caches.n_layers} layers, config says n_layers="
                     f"{config.n_layers}")
  if layer_loop == "scan" and (unstacked or caches.per_layer):
    raise ValueError("layer_loop='scan' needs stacked params and caches; unstacked ones "
                     "(unstack_layers, Caches.unstack) take layer_loop='unrolled'")


@functools.partial(jax.jit, static_argnames=("config", "settings", "layer_loop"))
def forward_chunk(params, config: LlamaConfig, tokens, valid, caches: Caches, *,
                  settings: layer.Settings = layer.Settings(),
                  shadow: Optional[Caches] = None, layer_loop: str = "scan"):
  """Runs a chunk of new tokens through the model with caches.

  Args:
    params: ``{"params": ...}`` of :class:`models.llama.LlamaModel`, ``layers``
      stacked or per layer (:func:`unstack_layers`, ``"unrolled"`` only).
    config: the model config.
    tokens: [batch, t] int token ids.
    valid: [batch, t] bool, False on (right) padding (no slot, no position).
    caches: ``certkv_jax.kv.caches.Caches`` (``init_caches``), stacked or per layer
      (``"unrolled"`` only); returned in the same form.
    settings: ``layer.Settings``: the design whose ``update`` folds the chunk's
      attention into the slot statistics, ``observe`` (a prompt chunk; decode
      steps pass False) and the certificate: a ``certified.Subsample(layers,
      heads)`` (True: all; the others report NaN; the logits do not change) or
      None (the same softmax, ``None`` stats). Its ``scale`` must be None (the
      model's own).
    shadow: evaluation mode: never-evicted caches receiving the same keys and
      values; the stats then include the true error.
    layer_loop: ``"scan"`` or ``"unrolled"`` (module docstring); pass unstacked
      params and caches to ``"unrolled"`` where the calls repeat.

  Returns:
    A :class:`Forwarded` ``(logits, caches, stats, shadow)``.

  Raises:
    ValueError: ``layer_loop`` not in ``LAYER_LOOPS``; unstacked params or
      caches with ``"scan"`` or with a layer count other than ``config.n_layers``;
      a ``config.sliding_window`` (not applied here).
    TypeError: ``caches`` not a ``Caches``.
  """
  _check_layer_loop(params, config, caches, layer_loop)
  if config.sliding_window is not None:
    raise ValueError(f"config.sliding_window={config.sliding_window}: the cached path attends "
                     "to every cached token and applies no sliding window; pass "
                     "config.replace(sliding_window=None), the same model while a sequence "
                     f"stays within {config.sliding_window} tokens")
  if settings.scale is not None:
    raise ValueError(f"settings.scale must be None here (the model's 1/sqrt(head_dim)), got "
                     f"{settings.scale!r}")
  sub = settings.certificate
  if sub is not None:
    certified.check_certificate_subsample(config, True, sub.layers, sub.heads)
  model = LlamaModel(config)
  top = {"params": {k: v for k, v in params["params"].items() if k != "layers"}}
  x = model.apply(top, tokens, method=LlamaModel.embed_tokens)
  layers = params["params"]["layers"]
  given = caches, shadow
  if layer_loop == "unrolled":  # per-layer buffers, each updated in place
    caches = caches.unstack()
    shadow = None if shadow is None else shadow.unstack()
  caches, slots = caches.reserve(valid)
  shadow_slots = None
  if shadow is not None:
    shadow, shadow_slots = shadow.reserve(valid)

  def body(carry, xs):
    x, caches, shadow = carry
    layer_params, i = xs
    block, variables = Block(config), {"params": layer_params}
    with jax.named_scope("qkv"):
      q, k, v = block.apply(variables, x, slots.positions, method=Block.qkv)
    paired = None if shadow is None else (shadow, shadow_slots)
    out, caches, shadow, stats, _, _ = layer.attend_layer(q, k, v, caches, i, slots,
                                                          shadow=paired, settings=settings)
    with jax.named_scope("mlp"):
      x = block.apply(variables, x, out, method=Block.finish)
    return (x, caches, shadow), stats

  carry = (x, caches, shadow)
  if layer_loop == "scan":  # caches in the carry are updated in place (scanned ones are copied)
    carry, stats = jax.lax.scan(body, carry,
                                (layers, jnp.arange(config.n_layers, dtype=jnp.int32)))
  else:
    per_layer = []
    for i in range(config.n_layers):
      layer_params = layers[i] if isinstance(layers, (tuple, list)) else (
          jax.tree_util.tree_map(lambda a, i=i: a[i], layers))
      carry, s = body(carry, (layer_params, i))
      per_layer.append(s)
    stats = layer.stack_stats(per_layer)
  x, caches, shadow = carry
  caches = caches if given[0].per_layer else caches.stack()  # returned in the form given
  if shadow is not None and not given[1].per_layer:
    shadow = shadow.stack()
  if stats is not None:  # [n_layers, batch, n_heads, t] -> [t, n_layers, batch, n_heads]
    stats = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, -1, 0), stats)
  return Forwarded(model.apply(top, x, method=LlamaModel.head), caches, stats, shadow)
