"""Writes a random-weight Hugging Face Llama checkpoint of a real model's shape.

For benchmarks that need a model's shape, not its weights (the device check,
scripts/device_check.sh, has no network and no weights): ``config.json``,
``model.safetensors`` and a ``tokenizer.json``, the directory that
``models.hf_loader.load_hf_checkpoint`` and ``--model=DIR`` of the experiments read.

    python scripts/make_random_checkpoint.py --shape=smollm2-135m --out=/tmp/smollm2_random
    python scripts/make_random_checkpoint.py --shape=llama-1b --out=/tmp/llama_1b --check
    python scripts/make_random_checkpoint.py --shape=smollm2-135m --layers=2 --vocab=512 \\
        --out=/tmp/tiny --check   # a reduced one, for a quick local test

Weights: normals of std 0.02 (norm scales 1), so the forward is numerically sane.
Each tensor is a run of one pool of ``POOL`` normals starting at a random offset,
wrapping around, streamed to the file (the safetensors layout: a length, a JSON
header, the tensors' bytes): drawing the 1.2 billion weights of the 1B shape one by one takes
numpy some 20 s, a large part of the device check's budget, and for timing the
repetition does not matter. The tokenizer is a word-level one whose vocabulary
(``<s>``, ``</s>``, ``<unk>``, then ``t3``, ``t4``, ...) has exactly the model's
vocabulary size: the benchmarks draw random token ids; it only has to load.
Needs numpy and tokenizers; ``--check`` also the repository's loader (safetensors).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import tokenizers

POOL = 1 << 24
STD = 0.02
# Hugging Face config.json fields of each shape (LlamaForCausalLM, tied embeddings).
SHAPES = {
    # SmolLM2-135M (HuggingFaceTB/SmolLM2-135M).
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         intermediate_size=1536, rope_theta=100000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    # Llama-3.2-1B (its Llama 3 RoPE scaling too).
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     intermediate_size=8192, rope_theta=500000.0,
                     max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
}
DTYPES = ("float32", "bfloat16")


def config_json(shape: str, layers=None, vocab=None) -> dict:
  """The ``config.json`` of ``shape``, with ``layers`` / ``vocab`` overridden if given."""
  if shape not in SHAPES:
    raise ValueError(f"--shape must be one of {sorted(SHAPES)}, got {shape!r}")
  cfg = dict(SHAPES[shape])
  for name, key, lo in (("layers", "num_hidden_layers", 1), ("vocab", "vocab_size", 3)):
    val = {"layers": layers, "vocab": vocab}[name]
    if val is not None:
      if val < lo:
        raise ValueError(f"--{name} must be >= {lo}, got {val}")
      cfg[key] = val
  return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
              tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
              bos_token_id=0, eos_token_id=1, **cfg)


def tensor_shapes(cfg: dict) -> dict:
  """Hugging Face tensor name -> shape (``[out, in]`` projections; tied: no lm_head)."""
  h, f = cfg["hidden_size"], cfg["intermediate_size"]
  q = cfg["num_attention_heads"] * cfg["head_dim"]
  kv = cfg["num_key_value_heads"] * cfg["head_dim"]
  shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
        p + "mlp.down_proj.weight": (h, f)})
  return shapes


def _pool_runs(pool, size, rng):
  """Pieces of ``pool`` that make ``size`` values from a random offset on, wrapping."""
  start = int(rng.integers(len(pool)))
  while size > 0:
    piece = pool[start:start + size]
    yield piece
    size -= len(piece)
    start = 0


def _write_safetensors(path, shapes, pool, rng):
  """Streams a safetensors file of ``shapes`` (name -> shape): RMS norm scales (1-D)
  ones, the rest runs of ``pool``; no tensor is built in memory."""
  dtype = {"float32": "F32", "bfloat16": "BF16"}[pool.dtype.name]
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape in shapes.items():
    size = int(np.prod(shape)) * pool.itemsize
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for name, shape in shapes.items():
      if len(shape) == 1:
        f.write(np.ones(shape, pool.dtype).tobytes())
      else:
        for piece in _pool_runs(pool, int(np.prod(shape)), rng):
          f.write(piece.tobytes())
  return offset


def tokenizer_json(vocab_size: int) -> str:
  """A word-level tokenizer of exactly ``vocab_size`` entries (``<s>`` = 0, ``</s>`` = 1)."""
  vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
  vocab.update({f"t{i}": i for i in range(3, vocab_size)})
  tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return tk.to_str()


def write(out: str, cfg: dict, dtype: str = "float32", seed: int = 0) -> int:
  """Writes the checkpoint of ``cfg`` (a :func:`config_json`) into ``out``; its bytes."""
  if dtype not in DTYPES:
    raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
  rng = np.random.default_rng(seed)
  pool = (rng.standard_normal(POOL, dtype=np.float32) * STD)
  if dtype == "bfloat16":
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    pool = pool.astype(ml_dtypes.bfloat16)
  os.makedirs(out, exist_ok=True)
  nbytes = _write_safetensors(os.path.join(out, "model.safetensors"), tensor_shapes(cfg), pool,
                              rng)
  with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
    json.dump(dict(cfg, torch_dtype=dtype), f, indent=1)
  with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
    f.write(tokenizer_json(cfg["vocab_size"]))
  with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)
  return nbytes


def check(out: str) -> str:
  """Loads ``out`` with the repository's loader; a line describing what it read."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from models import hf_loader  # pylint: disable=g-import-not-at-top
  params, config = hf_loader.load_hf_checkpoint(out)
  n = sum(int(np.prod(x.shape)) for x in _leaves(params))
  return (f"loaded {out}: {n / 1e6:.1f}M parameters, {config.n_layers} layers, hidden "
          f"{config.hidden}, heads {config.n_heads}/{config.n_kv_heads}, vocab "
          f"{config.vocab_size}")


def _leaves(tree):
  if isinstance(tree, dict):
    for v in tree.values():
      yield from _leaves(v)
  else:
    yield tree


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
  ap.add_argument("--out", required=True, help="directory to write (created)")
  ap.add_argument("--layers", type=int, help="override the number of layers")
  ap.add_argument("--vocab", type=int, help="override the vocabulary size (>= 3)")
  ap.add_argument("--dtype", default="float32", choices=DTYPES, help="stored dtype")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--check", action="store_true",
                  help="load it back with models.hf_loader.load_hf_checkpoint")
  args = ap.parse_args(argv)
  t0 = time.perf_counter()
  try:
    cfg = config_json(args.shape, args.layers, args.vocab)
  except ValueError as e:
    ap.error(str(e))
  nbytes = write(args.out, cfg, args.dtype, args.seed)
  print(f"wrote {args.out} ({args.shape}, {cfg['num_hidden_layers']} layers, "
        f"{nbytes / 1e9:.2f} GB of {args.dtype} weights) in {time.perf_counter() - t0:.1f}s",
        flush=True)
  if args.check:
    print(check(args.out), f"({time.perf_counter() - t0:.1f}s in all)", flush=True)


if __name__ == "__main__":
  main()
