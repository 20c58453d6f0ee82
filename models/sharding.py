"""Sharded models: Megatron parameter shardings, direct-to-device loading, sharded decoding.

On a mesh from :func:`certkv_jax.kv.distributed.make_mesh` (axes data, model, seq):

* **parameters** (:func:`param_specs`): Megatron-style over ``model``. The
  q/k/v projections and the MLP's gate/up are column-sharded (by whole heads,
  and by the hidden ffn units), the attention output and the MLP's down
  projection are row-sharded, so each block needs one all-reduce after
  attention and one after the MLP (XLA inserts them). Query heads are laid out
  ``[kv head, group]``, so a device holds the query heads of its own KV heads.
  Norms, the embedding and the output head are replicated.
* **loading** (:func:`place_params`, :func:`load_hf_sharded`,
  :func:`load_gguf_sharded`): every parameter is built with
  ``jax.make_array_from_callback``; the callback reads only the block that one
  device holds, straight from the checkpoint (safetensors slices; GGUF rows,
  dequantized row by row), so no host holds a full copy of the model (a
  process reads only the blocks of its own devices).
* **decoding** (:func:`generate`, :func:`generate_streaming`): places the
  inputs and runs ``models.decode``'s jitted functions under
  ``jax.set_mesh(mesh)``, where the caches are sharded batch -> data, KV
  heads -> model, slots -> seq (``certkv_jax.kv.distributed``).

A mesh axis that does not divide what it shards (heads, KV heads, ffn width,
batch, capacity) is a ValueError naming the axis and the size.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from certkv_jax.kv import distributed
from certkv_jax.kv.distributed import DATA
from certkv_jax.kv.distributed import MODEL
from certkv_jax.kv.distributed import SEQ
from models import decode
from models import gguf_loader
from models import hf_loader
from models import param_tree
from models.config import LlamaConfig

# Path inside a layer -> spec of the per-layer tensor (the leading layer axis is added).
_COLUMN = P(None, MODEL)  # [in, out]: output units split (heads / ffn units)
_ROW = P(MODEL, None)  # [in, out]: input units split; outputs are partial sums (all-reduce)
_LAYER_SPECS = {
    ("q_proj", "kernel"): _COLUMN, ("k_proj", "kernel"): _COLUMN,
    ("v_proj", "kernel"): _COLUMN, ("q_proj", "bias"): P(MODEL), ("k_proj", "bias"): P(MODEL),
    ("v_proj", "bias"): P(MODEL), ("o_proj", "kernel"): _ROW, ("o_proj", "bias"): P(None),
    ("mlp", "gate_proj", "kernel"): _COLUMN, ("mlp", "up_proj", "kernel"): _COLUMN,
    ("mlp", "down_proj", "kernel"): _ROW, ("attn_norm", "scale"): P(None),
    ("mlp_norm", "scale"): P(None),
}


def check_model(config: LlamaConfig, mesh, batch: Optional[int] = None,
                capacity: Optional[int] = None) -> None:
  """Checks that the mesh divides what it shards.

  Raises:
    ValueError naming the mesh axis and the size it does not divide: ``model``
    for n_heads, n_kv_heads and ffn_dim; ``data`` for the batch; ``seq`` for
    the cache capacity.
  """
  distributed.check_mesh(mesh)
  distributed.check_divisible("n_heads", config.n_heads, mesh, MODEL)
  distributed.check_divisible("n_kv_heads", config.n_kv_heads, mesh, MODEL)
  distributed.check_divisible("ffn_dim", config.ffn_dim, mesh, MODEL)
  if batch is not None:
    distributed.check_divisible("batch", batch, mesh, DATA)
  if capacity is not None:
    distributed.check_divisible("capacity", capacity, mesh, SEQ)


def param_specs(config: LlamaConfig) -> dict:
  """``{"params": ...}`` tree of ``PartitionSpec``\\ s (Megatron over ``model``)."""
  tree: dict = {}

  def put(path, spec):
    node = tree
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = spec

  for path in param_tree.top_shapes(config):
    put(path, P())
  for path in param_tree.layer_shapes(config):
    put(("layers",) + path, P(None, *_LAYER_SPECS[path]))
  return {"params": tree}


def param_shardings(config: LlamaConfig, mesh) -> dict:
  """``{"params": ...}`` tree of ``NamedSharding``\\ s on ``mesh``."""
  check_model(config, mesh)
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(config),
                                is_leaf=lambda x: isinstance(x, P))


def _leaves_with_paths(config: LlamaConfig):
  """(tree path, per-tensor path, layered?, global shape) of every parameter."""
  out = []
  for path, shape in param_tree.top_shapes(config).items():
    out.append((("params",) + path, path, False, tuple(shape)))
  for path, shape in param_tree.layer_shapes(config).items():
    out.append((("params", "layers") + path, path, True, (config.n_layers,) + tuple(shape)))
  return out


Reader = Callable[[tuple, Optional[int], tuple], np.ndarray]


def place_params(config: LlamaConfig, mesh, read: Reader) -> dict:
  """Builds the parameter tree on ``mesh``, one device block at a time.

  Args:
    config: the model config.
    mesh: a mesh from ``certkv_jax.kv.distributed.make_mesh``.
    read: ``read(path, layer, index) -> np.ndarray``: the block ``index`` (a
      tuple of slices, in ``models.llama``'s ``[in, out]`` layout) of the
      tensor at ``path`` (e.g. ``("q_proj", "kernel")``) of layer ``layer``
      (None for top-level tensors).

  Returns:
    ``{"params": ...}`` of float32 ``jax.Array``\\ s with :func:`param_specs`
    shardings. ``read`` is called only for the blocks of this process's
    devices (once per distinct block).
  """
  shardings = param_shardings(config, mesh)
  tree: dict = {}
  for tree_path, path, layered, shape in _leaves_with_paths(config):
    sharding = shardings
    for p in tree_path:
      sharding = sharding[p]
    cache: dict = {}

    def callback(index, path=path, layered=layered, shape=shape, cache=cache):
      index = tuple(index) + (slice(None),) * (len(shape) - len(index))
      key = tuple((s.start, s.stop, s.step) for s in index)
      if key not in cache:  # replicated blocks are read once, not once per device
        if layered:
          layers = range(shape[0])[index[0]]
          block = np.stack([np.asarray(read(path, i, index[1:]), np.float32) for i in layers])
        else:
          block = np.asarray(read(path, None, index), np.float32)
        want = tuple(len(range(n)[s]) for n, s in zip(shape, index))
        if block.shape != want:
          raise ValueError(f"reader returned shape {block.shape} for block {index} of "
                           f"{'/'.join(path)}, expected {want}")
        cache[key] = block
      return cache[key]

    node = tree
    for p in tree_path[:-1]:
      node = node.setdefault(p, {})
    node[tree_path[-1]] = jax.make_array_from_callback(shape, sharding, callback)
  return tree


def shard_params(params: dict, config: LlamaConfig, mesh) -> dict:
  """Places an in-memory ``{"params": ...}`` tree (numpy or jax arrays) on ``mesh``.

  Each device receives only its block (``jax.make_array_from_callback`` over
  the host arrays); use :func:`load_hf_sharded` / :func:`load_gguf_sharded`
  to avoid the host copy as well.
  """
  def read(path, layer, index):
    node = params["params"] if layer is None else params["params"]["layers"]
    for p in path:
      node = node[p]
    return np.asarray(node[index] if layer is None else node[layer][index])

  return place_params(config, mesh, read)


# --------------------------------------------------------------------------- checkpoint readers


def _transposed_read(x, index, transpose: bool):
  """Block ``index`` of ``x.T`` (if ``transpose``) or ``x``, reading only that block."""
  if transpose:
    return np.asarray(x[index[1], index[0]]).T
  return np.asarray(x[index])


def hf_reader(path: str, config: LlamaConfig) -> Reader:
  """A :func:`place_params` reader of a Hugging Face safetensors checkpoint that
  reads only the requested block of each tensor (safetensors slices)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  del config  # the names come from the checkpoint; shapes are checked by place_params
  where = {}
  for file in hf_loader._weight_files(path):  # pylint: disable=protected-access
    with safe_open(file, framework="np") as f:
      for name in f.keys():
        where[name] = file
  ours = {p: (name, t) for name, (p, t) in hf_loader._LAYER_NAMES.items()}  # pylint: disable=protected-access
  top = {("embed", "embedding"): ("model.embed_tokens.weight", False),
         ("final_norm", "scale"): ("model.norm.weight", False),
         ("lm_head", "kernel"): ("lm_head.weight", True)}

  def read(p, layer, index):
    if layer is None:
      name, transpose = top[p]
    else:
      name, transpose = ours[p]
      name = f"model.layers.{layer}.{name}"
    if name not in where:
      raise ValueError(f"checkpoint {path!r} has no tensor {name!r}")
    with safe_open(where[name], framework="np") as f:
      return _transposed_read(f.get_slice(name), index, transpose).astype(np.float32)

  return read


def load_hf_sharded(path: str, mesh) -> tuple[dict, LlamaConfig]:
  """``hf_loader.load_hf_checkpoint`` straight into the shardings of ``mesh``.

  Returns:
    ``(params, config)`` with :func:`param_specs` shardings.
  """
  with open(os.path.join(path, "config.json")) as f:
    config = hf_loader.config_from_hf(json.load(f))
  return place_params(config, mesh, hf_reader(path, config)), config


def gguf_reader(reader) -> Reader:
  """A :func:`place_params` reader of a GGUF file that dequantizes only the rows
  of the requested block (GGUF quantizes along rows, ``ne0``)."""
  from gguf import quants  # pylint: disable=import-outside-toplevel
  tensors = {t.name: t for t in reader.tensors}
  ours = {p: (name, t) for name, (p, t) in gguf_loader._LAYER_NAMES.items()}  # pylint: disable=protected-access
  top = {("embed", "embedding"): ("token_embd.weight", False),
         ("final_norm", "scale"): ("output_norm.weight", False),
         ("lm_head", "kernel"): ("output.weight", True)}

  class Rows:
    """Lazy 2-D view [rows, ne0] of a GGUF tensor: indexing dequantizes the rows."""

    def __init__(self, t):
      self.t = t

    def __getitem__(self, index):
      rows, cols = index
      data = self.t.data[rows]
      x = np.asarray(quants.dequantize(data, self.t.tensor_type), np.float32)
      return x.reshape(data.shape[0], -1)[:, cols]

  def read(p, layer, index):
    name, transpose = top[p] if layer is None else ours[p]
    if layer is not None:
      name = f"blk.{layer}.{name}"
    if name not in tensors:
      raise ValueError(f"GGUF file has no tensor {name!r}")
    t = tensors[name]
    if len(t.shape) == 1:
      return np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)[index]
    return _transposed_read(Rows(t), index, transpose)

  return read


def load_gguf_sharded(path: str, mesh):
  """``gguf_loader.load_gguf`` straight into the shardings of ``mesh``.

  Returns:
    ``(params, config, reader)``.
  """
  reader = gguf_loader.open_gguf(path)
  config = gguf_loader.config_from_gguf(reader)
  return place_params(config, mesh, gguf_reader(reader)), config, reader


def load_smollm2_sharded(mesh):
  """SmolLM2-135M-Instruct on ``mesh``: ``(params, config, tokenizer)``."""
  from models import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  params, config, reader = load_gguf_sharded(gguf_loader.smollm2_path(), mesh)
  return params, config, tokenizer_lib.tokenizer_from_gguf(reader)


# --------------------------------------------------------------------------- decoding


def global_array(x, mesh, spec: P) -> jax.Array:
  """A host array (identical on every process) as a global ``jax.Array`` on
  ``mesh`` with ``spec``; each process supplies only its devices' blocks."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def _is_placed(params, mesh) -> bool:
  leaves = jax.tree_util.tree_leaves(params)
  return all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
             and x.sharding.mesh == mesh for x in leaves)


def _prepare(mesh, params, config, batch, capacity, host_arrays):
  check_model(config, mesh, batch=batch, capacity=capacity)
  if not _is_placed(params, mesh):
    params = shard_params(params, config, mesh)
  placed = []
  for x in host_arrays:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      placed.append(x)  # already global (multi-process)
    elif isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = global_array(np.asarray(jax.random.key_data(x)), mesh, P())  # a typed key
      placed.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(x)))
    else:
      x = np.asarray(x)
      placed.append(global_array(x, mesh, P(DATA) if x.ndim == 2 else P()))
  return params, placed


def _sized(gen: decode.GenerationConfig, budget, **shapes) -> decode.GenerationConfig:
  """``gen`` with its capacity set as ``models.decode`` sets it when None (the
  mesh's ``seq`` axis must divide it, so it is needed before the call)."""
  if not isinstance(gen, decode.GenerationConfig):
    raise TypeError(f"gen must be a GenerationConfig, got {type(gen).__name__}")
  if gen.layer_loop == "unrolled" and gen.design is not None and gen.evict_each_step:
    raise ValueError("gen.layer_loop='unrolled' with evict_each_step is not supported on a "
                     "mesh (its eviction takes the stacked caches): use layer_loop='scan'")
  return decode._sized(gen, dict(shapes, budget=budget))  # pylint: disable=protected-access


def generate(mesh, params, tokens, mask, key, *, config: LlamaConfig,
             gen: decode.GenerationConfig, budget=None) -> decode.Generation:
  """``models.decode.generate`` on ``mesh``: same arguments and result.

  ``gen`` is a ``models.decode.GenerationConfig``; a ``gen.capacity`` of None
  is sized here as ``models.decode`` sizes it (``certkv_jax.designs.budgets.capacity``),
  and the mesh's ``seq`` axis must divide the capacity. ``budget`` is passed
  through (traced, as in ``models.decode.generate``). Params not yet on
  ``mesh`` are placed with :func:`shard_params`; tokens and mask are split
  over data, the key replicated. The result is a tree of global arrays
  (caches sharded batch -> data, KV heads -> model, slots -> seq); in a
  multi-process run read them with
  ``jax.experimental.multihost_utils.process_allgather``.
  """
  gen = _sized(gen, budget, tokens=tokens)
  params, (tokens, mask, key) = _prepare(mesh, params, config, np.shape(tokens)[0],
                                         gen.capacity, (tokens, mask, key))
  with jax.set_mesh(mesh):
    return decode.generate(params, tokens, mask, key, config=config, gen=gen, budget=budget)


def generate_streaming(mesh, params, context, question, key, *, config: LlamaConfig,
                       gen: decode.GenerationConfig, budget=None) -> decode.Generation:
  """``models.decode.generate_streaming`` on ``mesh``: same arguments and result
  (``context`` and ``question`` are ``(tokens, mask)`` pairs; ``gen.chunk``
  required; capacity, placement and result as in :func:`generate`)."""
  pair = decode._pair  # pylint: disable=protected-access
  (context, context_mask), (question, question_mask) = (pair(context, "context"),
                                                        pair(question, "question"))
  gen = _sized(gen, budget, context=context, question=question)
  params, arrays = _prepare(mesh, params, config, np.shape(context)[0], gen.capacity,
                            (context, context_mask, question, question_mask, key))
  context, context_mask, question, question_mask, key = arrays
  with jax.set_mesh(mesh):
    return decode.generate_streaming(params, (context, context_mask), (question, question_mask),
                                     key, config=config, gen=gen, budget=budget)


def replicate(x):
  """A host copy of a (possibly multi-process) global array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def cache_bytes_per_device(caches) -> dict:
  """``{device id: bytes}`` of the caches on this process's devices."""
  return distributed.per_device_bytes(caches)


__all__ = ["check_model", "param_specs", "param_shardings", "place_params", "shard_params",
           "hf_reader", "gguf_reader", "load_hf_sharded", "load_gguf_sharded",
           "load_smollm2_sharded", "global_array", "generate", "generate_streaming",
           "replicate", "cache_bytes_per_device"]
