"""Builds the decoder's parameter tree from per-layer tensors (for checkpoint loaders).

Loaders translate their checkpoint's names into paths of ``models.llama``'s
tree (``("q_proj", "kernel")`` inside a layer, ``("embed", "embedding")`` at
the top) and hand them here; shapes, completeness and the stacking of layers
on a leading axis are checked in this one place.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from models import precision
from models.config import LlamaConfig


def layer_shapes(config: LlamaConfig) -> dict:
  """Path inside ``layers`` -> shape of one layer's parameter (as configured)."""
  c = config
  q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  shapes = {
      ("attn_norm", "scale"): (c.hidden,),
      ("mlp_norm", "scale"): (c.hidden,),
      ("q_proj", "kernel"): (c.hidden, q),
      ("k_proj", "kernel"): (c.hidden, kv),
      ("v_proj", "kernel"): (c.hidden, kv),
      ("o_proj", "kernel"): (q, c.hidden),
      ("mlp", "gate_proj", "kernel"): (c.hidden, c.ffn_dim),
      ("mlp", "up_proj", "kernel"): (c.hidden, c.ffn_dim),
      ("mlp", "down_proj", "kernel"): (c.ffn_dim, c.hidden),
  }
  if c.qkv_bias:
    shapes.update({("q_proj", "bias"): (q,), ("k_proj", "bias"): (kv,),
                   ("v_proj", "bias"): (kv,)})
  if c.out_bias:
    shapes[("o_proj", "bias")] = (c.hidden,)
  return shapes


def top_shapes(config: LlamaConfig) -> dict:
  """Path at the top of the tree -> shape (``lm_head`` only when untied)."""
  c = config
  shapes = {("embed", "embedding"): (c.vocab_size, c.hidden), ("final_norm", "scale"): (c.hidden,)}
  if not c.tie_embeddings:
    shapes[("lm_head", "kernel")] = (c.hidden, c.vocab_size)
  return shapes


def check_shape(name: str, x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
  """``x`` if its shape is ``shape``; else a ValueError naming the tensor."""
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)} "
                     "from the model config")
  return x


def assemble(top: dict, layers: Sequence[dict], config: LlamaConfig, dtype=np.float32) -> dict:
  """``{"params": ...}`` from top-level and per-layer ``path -> array`` dicts, the
  matrices in ``dtype`` and the rest float32 (``models.precision.stored_dtype``).

  Raises:
    ValueError listing missing or unexpected parameters, or a wrong shape.
  """
  want_layer, want_top = layer_shapes(config), top_shapes(config)
  if len(layers) != config.n_layers:
    raise ValueError(f"got {len(layers)} layers, config says n_layers={config.n_layers}")
  missing = [f"/".join(p) for p in want_top if p not in top]
  for i, layer in enumerate(layers):
    missing += [f"layer {i}: {'/'.join(p)}" for p in want_layer if p not in layer]
    extra = [p for p in layer if p not in want_layer]
    if extra:
      raise ValueError(f"layer {i} has parameters the config does not expect: {extra}")
  extra = [p for p in top if p not in want_top]
  if extra:
    raise ValueError(f"parameters the config does not expect: {extra}")
  if missing:
    raise ValueError(f"checkpoint is missing tensors: {missing[:8]}"
                     f"{' ...' if len(missing) > 8 else ''}")
  tree: dict = {}

  def put(path, value):
    node = tree
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = jnp.asarray(value)

  for path, shape in want_top.items():
    put(path, check_shape("/".join(path), np.asarray(top[path]), shape).astype(
        precision.stored_dtype(path, dtype)))
  for path, shape in want_layer.items():
    put(("layers",) + path, np.stack([
        check_shape(f"layer {i}: {'/'.join(path)}", np.asarray(layer[path]), shape).astype(
            precision.stored_dtype(path, dtype))
        for i, layer in enumerate(layers)]))
  return {"params": tree}
