"""Makes the tiny Hugging Face checkpoints and reference logits in tests/fixtures/.

Run once, by hand, from the repository root:

    pip install torch==2.13.0 transformers==5.24.0   # made with these (CPU build)
    python scripts/make_hf_fixtures.py

torch and transformers are used ONLY here; the tests read the committed
safetensors, config.json and reference logits with numpy/JAX. The versions used
are also written to each fixture's ``reference.json``.

Fixtures (random weights, fixed seeds):

* ``tiny_llama``: LlamaForCausalLM, untied embeddings, Llama 3 ``rope_scaling``
  (with a short original context so that the scaling changes frequencies),
  saved in bfloat16 (what real checkpoints ship); the reference runs the same
  bfloat16-rounded weights in float32.
* ``tiny_qwen2``: Qwen2ForCausalLM (q/k/v biases), tied embeddings, float32,
  saved in sharded form (``model-0000i-of-0000n.safetensors`` + index json).

Each gets ``reference.npz``: ``tokens`` [2, 12] int32, ``mask`` [2, 12] bool
(the second row right-padded to length 7) and ``logits`` [2, 12, vocab]
float32 from the eager PyTorch implementation.
"""

from __future__ import annotations

import json
import os
import platform
import sys

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              hidden_act="silu", rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def _tokens():
  rng = np.random.default_rng(1234)
  tokens = rng.integers(0, COMMON["vocab_size"], size=(2, 12)).astype(np.int32)
  mask = np.ones((2, 12), bool)
  mask[1, 7:] = False
  tokens[1, 7:] = 0  # padding id
  return tokens, mask


def _make(name, model_cls, config, save_dtype, shard_size):
  torch.manual_seed(0)
  model = model_cls(config).eval()
  with torch.no_grad():  # larger-than-default weights so that logits are O(1)
    for pname, p in model.named_parameters():
      if "norm" in pname:
        p.uniform_(0.8, 1.2)
      elif p.ndim == 2:
        p.normal_(0.0, 0.08)
      else:
        p.normal_(0.0, 0.05)  # q/k/v biases
  model = model.to(save_dtype)
  out = os.path.join(OUT, name)
  os.makedirs(out, exist_ok=True)
  for f in os.listdir(out):
    os.remove(os.path.join(out, f))
  model.save_pretrained(out, safe_serialization=True, max_shard_size=shard_size)
  gen = os.path.join(out, "generation_config.json")
  if os.path.exists(gen):
    os.remove(gen)
  # Reference from the checkpoint as saved, reloaded in float32 (casting the live model
  # back would also round RoPE's inv_freq buffer through bfloat16).
  model = model_cls.from_pretrained(out, dtype=torch.float32,
                                    attn_implementation="eager").eval()
  tokens, mask = _tokens()
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(tokens).long(),
                   attention_mask=torch.from_numpy(mask).long()).logits.float().numpy()
  np.savez_compressed(os.path.join(out, "reference.npz"), tokens=tokens, mask=mask,
                      logits=logits.astype(np.float32))
  info = {
      "made_by": "scripts/make_hf_fixtures.py",
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "numpy": np.__version__,
      "python": platform.python_version(),
      "model_class": model_cls.__name__,
      "saved_dtype": str(save_dtype).replace("torch.", ""),
      "attn_implementation": "eager",
      "reference_dtype": "float32",
  }
  with open(os.path.join(out, "reference.json"), "w") as f:
    json.dump(info, f, indent=1, sort_keys=True)
    f.write("\n")
  print(name, sorted(os.listdir(out)), "logits", logits.shape, float(np.abs(logits).max()))


def main():
  llama = transformers.LlamaConfig(
      **COMMON, tie_word_embeddings=False, attention_bias=False,
      rope_theta=10000.0,
      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
      attn_implementation="eager")
  _make("tiny_llama", transformers.LlamaForCausalLM, llama, torch.bfloat16, "10GB")
  qwen = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1000000.0,
                                  use_sliding_window=False, attn_implementation="eager")
  _make("tiny_qwen2", transformers.Qwen2ForCausalLM, qwen, torch.float32, "150KB")
  print("python", sys.version.split()[0], "torch", torch.__version__, "transformers",
        transformers.__version__)


if __name__ == "__main__":
  main()
