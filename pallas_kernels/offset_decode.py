"""Fused decode kernel: offset attention + certificate statistics in one pass.

One program per KV head of one sequence (``B`` rows) and its ``G`` query rows;
keys are swept in tiles with ``reference.online_update``, partials per split-K
split are merged by ``reference.combine`` (method, section 9). Offsets are
``-log pi`` (``-inf`` marks an empty slot); an optional ragged length skips
tiles. Backends: ``"triton"`` (GPU, tile loop in the kernel) and ``"mosaic"``
(TPU, tile loop as the last grid axis); ``interpret=True`` runs either on CPU.
Precision: ``precision.product_operands``; statistics are float32; with
``KernelConfig.split_values`` bfloat16 values multiply as stored (two bfloat16
products per tile, ``reference.split_matmul``) instead of as a float32 copy.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import precision as precision_lib
from pallas_kernels import reference
from pallas_kernels.config import KernelConfig

__all__ = ["BACKENDS", "BlockSizes", "ChunkKV", "KernelConfig", "decode_partials",
           "default_backend", "device_cores", "num_stages", "offset_chunk_attention",
           "offset_decode_attention",
           "offset_decode_reference", "pad_slots"]

BACKENDS = ("triton", "mosaic")
_STATS = ("m", "z", "s0", "s2", "r1", "rv")  # per-row scalar statistics


# Fewer tiles per split and a program's fixed cost dominates.
MIN_TILES_PER_SPLIT = 4
# Programs per core the default split count aims at: one program per core leaves a
# streaming kernel latency-bound (experiments/results/gpu_h100).
PROGRAMS_PER_CORE = 8
DEFAULT_CORES = 132  # an H100/H200's SMs, for devices that report no core count


def device_cores() -> int:
  """The default device's core count (SMs on a GPU), ``DEFAULT_CORES`` if unknown."""
  cores = getattr(jax.devices()[0], "core_count", None)
  return int(cores) if isinstance(cores, int) and cores > 0 else DEFAULT_CORES


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the key axis.

  Attributes:
    block_k: keys per tile; Triton: a power of two >= 16, Mosaic: a multiple
      of 128 (the lane width).
    num_splits: split-K partitions of the cache (flash-decoding).
  """

  block_k: int = 128
  num_splits: int = 1

  @classmethod
  def get_default(cls, n: int, batch_rows: int = 1, backend: str = "triton",
                  cores: Optional[int] = None) -> "BlockSizes":
    """On GPU 64-key tiles (128-key tiles were far slower on an H100:
    experiments/results/gpu_h100) and
    enough splits for ``PROGRAMS_PER_CORE`` programs per core (``cores``, default
    :func:`device_cores`), each keeping at least ``MIN_TILES_PER_SPLIT`` tiles;
    on TPU 512-key tiles and one split."""
    block_k = 64 if backend == "triton" else 512 if n >= 4096 else 128
    tiles = -(-n // block_k)
    splits = 1
    if backend == "triton":
      cores = device_cores() if cores is None else cores
      wanted = -(-PROGRAMS_PER_CORE * cores // max(batch_rows, 1))
      splits = max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT))
      if n % block_k == 0:  # a split count dividing the tiles needs no padded copy
        fit = max(s for s in range(1, splits + 1) if tiles % s == 0)
        splits = fit if 2 * fit >= splits else splits
    return cls(block_k=block_k, num_splits=splits)

  def validate(self, backend: str) -> None:
    if not isinstance(self.block_k, int) or self.block_k < 1:
      raise ValueError(f"block_k must be a positive int, got {self.block_k!r}")
    if not isinstance(self.num_splits, int) or self.num_splits < 1:
      raise ValueError(f"num_splits must be a positive int, got {self.num_splits!r}")
    if backend == "triton" and (self.block_k < 16 or self.block_k & (self.block_k - 1)):
      raise ValueError(f"block_k must be a power of two >= 16 for Triton, got {self.block_k}")
    if backend == "mosaic" and self.block_k % 128:
      raise ValueError(f"block_k must be a multiple of 128 for Mosaic (TPU lanes), "
                       f"got {self.block_k}")


def _tile_update(carry, q, k_tile, v_tile, off_row, off_col, first_index, length, scale,
                 with_stats, stacked, split_values):
  """One tile: logits, validity (offset and length), online update; offsets come
  as ``off_row`` [1, bk] and ``off_col`` [bk, 1]."""
  block_k = k_tile.shape[0]
  kt, qt, precision = precision_lib.product_operands(k_tile, q)
  s = jax.lax.dot_general(qt, kt, (((1,), (1,)), ((), ())), precision=precision,
                          preferred_element_type=jnp.float32)  # [G, bk]
  idx_row = first_index + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  idx_col = first_index + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
  valid = (off_row != -jnp.inf) & (idx_row < length)  # [1, bk]: -inf marks an empty slot
  valid_col = (off_col != -jnp.inf) & (idx_col < length)  # [bk, 1]
  l = s * scale + jnp.where(valid, off_row, 0.0)
  w = reference.one_minus_pi(jnp.where(valid, off_row, 0.0))
  return reference.online_update(
      carry, l, v_tile, w, valid, valid_col,
      options=reference.UpdateOptions(precision=jax.lax.Precision.HIGHEST,
                                      second_order=with_stats, stacked_matmul=stacked,
                                      split_values=split_values))


def _rows_of(refs):
  return reference.Partials(
      m=refs[0][0], z=refs[1][0], acc=refs[6][...], c=refs[8][...], s0=refs[2][0],
      s1=refs[7][...], s2=refs[3][0], r1=refs[4][0], rv=refs[5][0])


def _store(refs, p):
  for ref, name in zip(refs[:6], _STATS):
    ref[0] = getattr(p, name)
  refs[6][...] = p.acc
  refs[7][...] = p.s1
  refs[8][...] = p.c


def _triton_kernel(len_ref, q_ref, k_ref, v_ref, off_ref, offc_ref, *out_refs, scale,
                   block_k, split_len, with_stats, split_values):
  """grid = (B, splits); loops over the tiles of this split."""
  split = pl.program_id(1)
  q = q_ref[...]
  rows, dv = q.shape[0], v_ref.shape[-1]
  length = len_ref[...]
  start = split * split_len
  n_tiles = jnp.clip(pl.cdiv(length - start, block_k), 0, split_len // block_k)

  def body(t, carry):
    sl = pl.ds(t * block_k, block_k)
    return _tile_update(carry, q, k_ref[sl, :], v_ref[sl, :], off_ref[:, sl], offc_ref[sl, :],
                        start + t * block_k, length, scale, with_stats, False, split_values)

  carry = jax.lax.fori_loop(0, n_tiles, body, reference.empty_partials((rows,), dv))
  _store(out_refs, carry)


def _mosaic_kernel(len_ref, q_ref, k_ref, v_ref, off_ref, offc_ref, *out_refs, scale,
                   block_k, tiles_per_split, with_stats, split_values):
  """grid = (B, splits, tiles); accumulates in the resident output block."""
  b, split, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, dv = q_ref.shape[0], v_ref.shape[-1]
  first = (split * tiles_per_split + t) * block_k
  length = len_ref[b]

  @pl.when(t == 0)
  def _init():
    _store(out_refs, reference.empty_partials((rows,), dv))

  @pl.when(first < length)
  def _accumulate():
    carry = _rows_of(out_refs)
    q = q_ref[...]
    _store(out_refs, _tile_update(carry, q, k_ref[...], v_ref[...], off_ref[...],
                                  offc_ref[...], first, length, scale, with_stats, True,
                                  split_values))


def _out_shapes(batch, splits, rows, dv):
  scalar = jax.ShapeDtypeStruct((batch, splits, 1, rows), jnp.float32)
  vector = jax.ShapeDtypeStruct((batch, splits, rows, dv), jnp.float32)
  return [scalar] * len(_STATS) + [vector, vector, vector]


def decode_partials(q, k, v, offset, lengths=None, *, scale: float, config: KernelConfig,
                    with_stats: bool = True):
  """Partial statistics per split, ``Partials`` with rows [B, splits, G].

  Args: as :func:`offset_decode_attention` (``range_mode`` unused); n must be a
    multiple of ``block_k * num_splits`` (:func:`pad_slots`), else ValueError.
  """
  batch, rows, d = q.shape
  n, dv = k.shape[1], v.shape[-1]
  backend = config.backend or default_backend()
  block_sizes = config.block_sizes
  if block_sizes is None:
    block_sizes = BlockSizes.get_default(n, batch, backend)
  interpret, debug = config.interpret, config.debug
  bk, splits = block_sizes.block_k, block_sizes.num_splits
  if n % (bk * splits):
    raise ValueError(f"cache length {n} must be a multiple of block_k * num_splits = "
                     f"{bk * splits}; pad with pad_slots()")
  split_len = n // splits
  if lengths is None:
    lengths = jnp.full((batch,), n, jnp.int32)
  off3 = offset.astype(jnp.float32)[:, None, :]  # [B, 1, n]: slots along lanes
  offc = offset.astype(jnp.float32)[:, :, None]  # [B, n, 1]: slots along sublanes
  out_shape = _out_shapes(batch, splits, rows, dv)
  if backend == "triton":
    kernel = functools.partial(_triton_kernel, scale=scale, block_k=bk, split_len=split_len,
                               with_stats=with_stats, split_values=config.split_values)
    outs = pl.pallas_call(
        kernel,
        grid=(batch, splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, s: (b,)),
            pl.BlockSpec((None, rows, d), lambda b, s: (b, 0, 0)),
            pl.BlockSpec((None, split_len, d), lambda b, s: (b, s, 0)),
            pl.BlockSpec((None, split_len, dv), lambda b, s: (b, s, 0)),
            pl.BlockSpec((None, 1, split_len), lambda b, s: (b, 0, s)),
            pl.BlockSpec((None, split_len, 1), lambda b, s: (b, s, 0)),
        ],
        out_specs=[pl.BlockSpec((None, None, 1, rows), lambda b, s: (b, s, 0, 0))] * len(_STATS)
        + [pl.BlockSpec((None, None, rows, dv), lambda b, s: (b, s, 0, 0))] * 3,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=num_stages(config, v.dtype)),
        interpret=interpret,
        debug=debug,
        name="certkv_offset_decode",
    )(lengths.astype(jnp.int32), q, k, v, off3, offc)
  elif backend == "mosaic":
    tiles = split_len // bk
    kernel = functools.partial(_mosaic_kernel, scale=scale, block_k=bk, tiles_per_split=tiles,
                               with_stats=with_stats, split_values=config.split_values)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, splits, tiles),
        in_specs=[
            pl.BlockSpec((None, rows, d), lambda b, s, t, lens: (b, 0, 0)),
            pl.BlockSpec((None, bk, d), lambda b, s, t, lens: (b, s * tiles + t, 0)),
            pl.BlockSpec((None, bk, dv), lambda b, s, t, lens: (b, s * tiles + t, 0)),
            pl.BlockSpec((None, 1, bk), lambda b, s, t, lens: (b, 0, s * tiles + t)),
            pl.BlockSpec((None, bk, 1), lambda b, s, t, lens: (b, s * tiles + t, 0)),
        ],
        out_specs=[pl.BlockSpec((None, None, 1, rows), lambda b, s, t, lens: (b, s, 0, 0))]
        * len(_STATS)
        + [pl.BlockSpec((None, None, rows, dv), lambda b, s, t, lens: (b, s, 0, 0))] * 3,
    )
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        debug=debug,
        name="certkv_offset_decode",
    )(lengths.astype(jnp.int32), q, k, v, off3, offc)
  else:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  scalars = {name: o[:, :, 0, :] for name, o in zip(_STATS, outs[:6])}
  return reference.Partials(acc=outs[6], s1=outs[7], c=outs[8], **scalars)


def num_stages(config: KernelConfig, dtype) -> int:
  """Triton's pipeline stages: ``config.num_stages``, else 3 where bfloat16 values multiply
  as stored (the H100 sweep's fastest with statistics) and 2 otherwise."""
  if config.num_stages is not None:
    return config.num_stages
  return 3 if config.split_values and dtype == jnp.bfloat16 else 2


def pad_slots(n: int, block_sizes: BlockSizes) -> int:
  """Slots to append so that n is a multiple of block_k * num_splits."""
  unit = block_sizes.block_k * block_sizes.num_splits
  return (-n) % unit


def default_backend() -> str:
  """The kernel backend for the default JAX device ("triton" on CPU, for interpret)."""
  return "mosaic" if jax.default_backend() == "tpu" else "triton"


def _checks_lengths(jitted):
  """Checks ``lengths`` (None or int [B] in [0, n]) before the jitted call, where its
  values are still concrete (inside, a length out of range would act clipped)."""
  signature = inspect.signature(jitted)

  @functools.wraps(jitted)
  def call(*args, **kwargs):
    given = signature.bind(*args, **kwargs).arguments
    lengths, batch, n = given.get("lengths"), jnp.shape(given["q"])[0], jnp.shape(given["k"])[1]
    if lengths is not None:
      if jnp.shape(lengths) != (batch,) or not jnp.issubdtype(jnp.result_type(lengths),
                                                               jnp.integer):
        raise ValueError(f"lengths must be int [B] = ({batch},), got "
                         f"{jnp.result_type(lengths)} {jnp.shape(lengths)}")
      if not isinstance(lengths, jax.core.Tracer) and (
          (np.asarray(lengths) < 0) | (np.asarray(lengths) > n)).any():
        raise ValueError(f"lengths must be in [0, n={n}], got {np.asarray(lengths)}")
    return jitted(*args, **kwargs)

  return call


def _slot_validity(offset, lengths):
  """[B, n] bool: a slot counts unless its offset is ``-inf`` (empty) or it is past its
  length; a NaN or negative offset (pi > 1) stays in, to show as the XLA path shows it."""
  valid = offset != -jnp.inf
  if lengths is not None:
    valid &= jnp.arange(offset.shape[1])[None, :] < lengths[:, None]
  return valid


def _resolve(config: KernelConfig, n: int, batch: int) -> KernelConfig:
  """``config`` with its backend and block sizes defaulted and checked."""
  backend = config.backend or default_backend()
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  block_sizes = config.block_sizes
  if block_sizes is None:
    block_sizes = BlockSizes.get_default(n, batch, backend)
  block_sizes.validate(backend)
  return dataclasses.replace(config, backend=backend, block_sizes=block_sizes)


def _cache_partials(q, k, v, offset, lengths, *, scale, config, with_stats=True):
  """Pads q [B, R, d] and the slots to the tiling, runs the kernel, merges the
  splits into ``reference.Partials`` with rows [B, R]."""
  rows, n = q.shape[1], k.shape[1]
  rows_pad = rows
  if config.backend == "triton":
    rows_pad = max(16, 1 << (rows - 1).bit_length())  # Triton dots need >= 16 rows
  extra = pad_slots(n, config.block_sizes)
  if lengths is None and extra:  # the padded tiles are skipped, not only masked
    lengths = jnp.full((q.shape[0],), n, jnp.int32)
  parts = decode_partials(
      jnp.pad(q, ((0, 0), (0, rows_pad - rows), (0, 0))),
      jnp.pad(k, ((0, 0), (0, extra), (0, 0))), jnp.pad(v, ((0, 0), (0, extra), (0, 0))),
      jnp.pad(offset.astype(jnp.float32), ((0, 0), (0, extra)), constant_values=-jnp.inf),
      lengths, scale=scale, config=config, with_stats=with_stats)
  parts = jax.tree_util.tree_map(lambda x: x[:, :, :rows], parts)
  return reference.combine(parts, axis=1)


def _exact_cache_range(q, k, v, offset, lengths, scale, fin):
  """Exact b_hat over the cache slots for q [B, R, d]: one XLA pass after the kernel."""
  valid = _slot_validity(offset, lengths)[:, None, :]
  off = jnp.where(valid, offset[:, None, :], 0.0)
  l = reference.slot_logits(q, k, off, valid, scale)
  return reference.exact_range(l, v, reference.one_minus_pi(off), valid, fin.out, fin.lse)


@_checks_lengths
@functools.partial(jax.jit, static_argnames=("scale", "config", "with_stats"))
def offset_decode_attention(q, k, v, offset, lengths=None, *, scale: Optional[float] = None,
                            config: KernelConfig = KernelConfig(), with_stats: bool = True):
  """Fused offset attention with certificate statistics (decode, GQA group).

  Args:
    q: [B, G, d] query rows sharing one KV head per b.
    k: [B, n, d]; v: [B, n, dv] (float32 or bfloat16; float32 accumulation).
    offset: [B, n] float32 ``-log pi`` (0 for certain tokens, ``-inf`` for empty
      slots).
    lengths: optional [B] int ragged valid lengths in [0, n] (slots beyond are ignored).
    scale: logit scale (default 1/sqrt(d)).
    config: :class:`KernelConfig` (static); range_mode "exact" adds one XLA
      pass over the keys for b_hat (method, section 5).
    with_stats: False computes the offset attention alone (var_hat and
      range_hat zero).

  Returns:
    ``reference.Reference(out [B, G, dv] float32, lse [B, G], var_hat [B, G],
    range_hat [B, G])``.

  Raises:
    ValueError: on mismatched shapes or an unknown range_mode or backend.
  """
  batch, rows, d = q.shape
  n = k.shape[1]
  if k.shape[0] != batch or v.shape[:2] != k.shape[:2] or k.shape[2] != d:
    raise ValueError(f"expected q [B, G, d], k [B, n, d], v [B, n, dv]; got q {q.shape}, "
                     f"k {k.shape}, v {v.shape}")
  if offset.shape != (batch, n):
    raise ValueError(f"offset must be [B, n] = {(batch, n)}, got {offset.shape}")
  if config.range_mode not in ("exact", "bound"):
    raise ValueError(f"range_mode must be 'exact' or 'bound', got {config.range_mode!r}")
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  config = _resolve(config, n, batch)
  fin = reference.finalize(_cache_partials(
      q, k, v, offset, lengths, scale=scale, config=config, with_stats=with_stats))
  if config.range_mode == "bound" or not with_stats:
    rng = fin.range_bound
  else:
    rng = _exact_cache_range(q, k, v, offset, lengths, scale, fin)
  return reference.Reference(fin.out, fin.lse, fin.var_hat, rng)


def offset_decode_reference(q, k, v, offset, lengths=None, *, scale: Optional[float] = None,
                            range_mode: str = "exact"):
  """The pure-jnp reference for :func:`offset_decode_attention` (same layout)."""
  valid = _slot_validity(offset, lengths)
  log_pi = jnp.where(valid, -offset, 0.0)
  return reference.grouped_reference(q, k, v, log_pi, valid, scale=scale,
                                     config=reference.ReferenceConfig(range_mode=range_mode))


class ChunkKV(NamedTuple):
  """A prefill chunk's own k [B, t, d], v [B, t, dv] and optional valid [B, t]."""

  k: jax.Array
  v: jax.Array
  valid: Optional[jax.Array] = None


@_checks_lengths
@functools.partial(jax.jit, static_argnames=("scale", "config"))
def offset_chunk_attention(q, k, v, offset, chunk: ChunkKV, lengths=None, *,
                           scale: Optional[float] = None,
                           config: KernelConfig = KernelConfig()):
  """Chunk (multi-query) variant for streaming prefill.

  The ``t`` queries attend over the cache with its offsets (the fused kernel,
  ``t * G`` rows per KV head) and causally over the chunk, whose certain tokens
  (``w = 0``) add nothing to the variance; ``reference.combine`` merges both.

  Args:
    q: [B, t, G, d] chunk queries (G query heads per KV head).
    k, v, offset, lengths: the cache, as in :func:`offset_decode_attention`.
    chunk: :class:`ChunkKV`, the chunk's own keys, values and validity.
    scale, config: as in :func:`offset_decode_attention`.

  Returns:
    ``reference.Reference`` with rows [B, t, G].
  """
  batch, t, groups, d = q.shape
  k_chunk, v_chunk, chunk_valid = chunk
  if k_chunk.shape != (batch, t, d) or v_chunk.shape[:2] != (batch, t):
    raise ValueError(f"chunk.k must be [B, t, d] = {(batch, t, d)} and chunk.v [B, t, dv]; "
                     f"got {k_chunk.shape}, {v_chunk.shape}")
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  rows = q.reshape(batch, t * groups, d)
  config = _resolve(config, k.shape[1], batch)
  rows_n = t * groups
  cache_parts = _cache_partials(rows, k, v, offset, lengths, scale=scale, config=config)
  # Row (i, g) sees chunk tokens j <= i.
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]  # [t, t]
  causal = jnp.repeat(causal, groups, axis=0)[None]  # [1, t*G, t]
  if chunk_valid is not None:
    causal = causal & chunk_valid[:, None, :]
  l_chunk = reference.slot_logits(rows, k_chunk, 0.0, causal, scale)
  own = reference.online_update(
      reference.empty_partials((batch, rows_n), v_chunk.shape[-1]), l_chunk, v_chunk,
      jnp.zeros((1, 1, t), jnp.float32), causal, valid_col=jnp.any(causal, axis=-2)[..., None],
      options=reference.UpdateOptions(precision=jax.lax.Precision.HIGHEST))
  total = reference.combine(
      jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b], 1), cache_parts, own), 1)
  fin = reference.finalize(total)
  if config.range_mode == "bound":
    rng = fin.range_bound
  else:
    rng = _exact_cache_range(rows, k, v, offset, lengths, scale, fin)
  shape = (batch, t, groups)
  return reference.Reference(fin.out.reshape(shape + (-1,)), fin.lse.reshape(shape),
                             fin.var_hat.reshape(shape), rng.reshape(shape))
