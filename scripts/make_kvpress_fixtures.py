"""Makes the NVIDIA kvpress reference selections in tests/fixtures/kvpress/.

Run once, by hand, from the repository root (CPU only):

    pip install torch==2.13.0 kvpress==0.5.5 transformers==5.2.0
    python scripts/make_kvpress_fixtures.py

Made with: torch 2.13.0+cpu, kvpress 0.5.5, transformers 5.2.0 (kvpress 0.5.5
requires ``transformers>=4.56,<5.3``; 5.2.0 is the newest allowed), Python
3.11. The exact versions are also written to ``tests/fixtures/kvpress/reference.json``.
torch, transformers and kvpress are used ONLY here; the parity test
(tests/models_kvpress_parity_test.py) reads the fixture with numpy.

What it does: loads the tiny random Llama checkpoint of tests/fixtures/tiny_llama
(made by scripts/make_hf_fixtures.py) in float32 with eager attention (kvpress's
ObservedAttentionPress needs the attention weights, which only the eager
implementation returns; the same model is used for every press), and prefills
one fixed random token sequence (``N_TOKENS`` tokens, seed ``SEED``) under each
press at compression ratios 0.5 and 0.75. kvpress compresses each layer's cache
in a forward hook right after that layer's attention, during the prefill only,
so each layer's selection depends on the full-cache prefill (later layers are
not affected by earlier layers' compression). For every (press, ratio, layer)
the script records:

* ``scores`` [n_kv_heads, n]: what the press's ``score`` method returned (eager attention)
  (higher = kept), captured by wrapping ``score``;
* ``kept`` [n_kv_heads, n_kept]: the positions actually kept, read from the
  compressed cache: every row of the compressed keys is matched to the unique
  row of the uncompressed keys it equals (exact equality; the script checks
  that each match is unique and that the kept set equals ``topk(scores)``).

Presses and their settings (kvpress defaults unless stated):

* ``StreamingLLMPress(n_sink=4)``
* ``SnapKVPress(window_size=16, kernel_size=5)``: the window is set to 16
  (default 64) so that at ratio 0.75 on 128 tokens the budget (32 tokens) still
  exceeds the window and the pooled scores choose 16 tokens; with the default
  window of 64 the 0.75 budget would fall inside the window.
* ``SnapKVPress()`` (defaults window_size=64, kernel_size=5), as case
  ``snapkv_default``: at ratio 0.5 the budget (64) equals the window; at 0.75
  the budget (32) is smaller than the window and kvpress keeps 32 window tokens
  chosen by ``topk`` among equal scores (max + 1).
* ``TOVAPress()``
* ``KnormPress()``
* ``ObservedAttentionPress()``
* ``KeyDiffPress()`` (cosine distance of each key to the mean unit key)

Output: ``tests/fixtures/kvpress/reference.npz`` (``tokens`` [1, n] int32 and,
per case ``{press}_{ratio}``, ``{case}/kept`` [n_layers, n_kv_heads, n_kept]
int32 sorted and ``{case}/scores`` [n_layers, n_kv_heads, n] float32) and
``reference.json`` (versions, settings, budgets, and per case
``sdpa_same_kept``: whether the same press on the same model with sdpa
attention, where SnapKV and TOVA recompute the window attention themselves,
kept the same positions).
"""

from __future__ import annotations

import json
import os
import platform
import sys

import numpy as np
import torch
import transformers
import kvpress
from importlib import metadata

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CHECKPOINT = os.path.join(ROOT, "tests", "fixtures", "tiny_llama")
OUT = os.path.join(ROOT, "tests", "fixtures", "kvpress")

N_TOKENS = 128
SEED = 20260401
RATIOS = (0.5, 0.75)
SNAPKV_WINDOW = 16
SNAPKV_KERNEL = 5
STREAMING_N_SINK = 4


def presses(ratio):
  return {
      "streaming_llm": kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=STREAMING_N_SINK),
      "snapkv": kvpress.SnapKVPress(compression_ratio=ratio, window_size=SNAPKV_WINDOW,
                                    kernel_size=SNAPKV_KERNEL),
      # kvpress's defaults (window 64, kernel 5): at 0.75 the budget (32) is
      # smaller than the window, where kvpress and our design differ on purpose.
      "snapkv_default": kvpress.SnapKVPress(compression_ratio=ratio),
      "tova": kvpress.TOVAPress(compression_ratio=ratio),
      "knorm": kvpress.KnormPress(compression_ratio=ratio),
      "observed_attention": kvpress.ObservedAttentionPress(compression_ratio=ratio),
      "keydiff": kvpress.KeyDiffPress(compression_ratio=ratio),
  }


def _match_rows(full, kept):
  """Indices i such that kept[j] == full[i] exactly; each match must be unique."""
  eq = (kept[:, None, :] == full[None, :, :]).all(-1)  # [n_kept, n]
  counts = eq.sum(1)
  if not (counts == 1).all():
    raise RuntimeError(f"compressed key rows do not match unique rows: counts {counts}")
  return eq.float().argmax(1)


def run_press(model, tokens, press):
  n_layers = model.config.num_hidden_layers
  captured = {}
  orig_score = press.score
  orig_compress = press.compress

  def score(module, hidden_states, keys, values, attentions, kwargs):
    s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
    captured.setdefault(module.layer_idx, {})["scores"] = s.detach().clone()
    return s

  def compress(module, hidden_states, keys, values, attentions, kwargs):
    captured.setdefault(module.layer_idx, {})["keys"] = keys.detach().clone()
    return orig_compress(module, hidden_states, keys, values, attentions, kwargs)

  press.score = score
  press.compress = compress
  cache = transformers.DynamicCache(config=model.config)
  with torch.no_grad(), press(model):
    model(input_ids=tokens, past_key_values=cache, use_cache=True)
  kept_all, scores_all = [], []
  for layer in range(n_layers):
    full = captured[layer]["keys"][0]  # [h_kv, n, d]
    comp = cache.layers[layer].keys[0]  # [h_kv, n_kept, d]
    scores = captured[layer]["scores"][0].float()  # [h_kv, n]
    kept_layer = []
    for h in range(full.shape[0]):
      idx = _match_rows(full[h], comp[h]).sort().values
      top = scores[h].topk(comp.shape[1]).indices.sort().values
      if not torch.equal(idx, top):
        raise RuntimeError(f"layer {layer} head {h}: kept rows differ from topk(scores)")
      kept_layer.append(idx.numpy().astype(np.int32))
    kept_all.append(np.stack(kept_layer))
    scores_all.append(scores.numpy().astype(np.float32))
  return np.stack(kept_all), np.stack(scores_all)


def load(attn_implementation):
  model = transformers.AutoModelForCausalLM.from_pretrained(
      CHECKPOINT, dtype=torch.float32, attn_implementation=attn_implementation)
  return model.eval()


def main():
  torch.manual_seed(0)
  model = load("eager")
  # Cross-check: presses that do not need the attention weights recompute them
  # (SnapKV/TOVA) when the attention implementation returns none (sdpa).
  sdpa = load("sdpa")
  # The checkpoint's config was written by transformers 5.24.0; check that this
  # transformers version builds the same model (llama3 RoPE scaling included) by
  # reproducing the committed reference logits of scripts/make_hf_fixtures.py.
  ref = np.load(os.path.join(CHECKPOINT, "reference.npz"))
  with torch.no_grad():
    logits = model(input_ids=torch.from_numpy(ref["tokens"].astype(np.int64)),
                   attention_mask=torch.from_numpy(ref["mask"].astype(np.int64))).logits
  ref_err = float(np.abs(logits.numpy() - ref["logits"])[ref["mask"]].max())
  if ref_err > 1e-4:
    raise RuntimeError(f"this transformers does not reproduce the tiny_llama reference: {ref_err}")
  rng = np.random.default_rng(SEED)
  tokens_np = rng.integers(3, model.config.vocab_size, size=(1, N_TOKENS)).astype(np.int32)
  tokens = torch.from_numpy(tokens_np.astype(np.int64))
  arrays = {"tokens": tokens_np}
  cases = {}
  for ratio in RATIOS:
    for name, press in presses(ratio).items():
      case = f"{name}_{ratio}"
      kept, scores = run_press(model, tokens, press)
      arrays[f"{case}/kept"] = kept
      arrays[f"{case}/scores"] = scores
      cases[case] = {"press": type(press).__name__, "compression_ratio": ratio,
                     "settings": {k: v for k, v in vars(press).items()
                                  if isinstance(v, (int, float, str))},
                     "n_kept": int(kept.shape[-1])}
      if name != "observed_attention":
        kept_sdpa, _ = run_press(sdpa, tokens, presses(ratio)[name])
        cases[case]["sdpa_same_kept"] = bool(np.array_equal(kept, kept_sdpa))
      print(case, "kept per head:", kept.shape[-1], cases[case].get("sdpa_same_kept"))
  os.makedirs(OUT, exist_ok=True)
  np.savez_compressed(os.path.join(OUT, "reference.npz"), **arrays)
  meta = {
      "made_by": "scripts/make_kvpress_fixtures.py",
      "checkpoint": "tests/fixtures/tiny_llama",
      "attn_implementation": "eager",
      "dtype": "float32",
      "n_tokens": N_TOKENS,
      "seed": SEED,
      "cases": cases,
      "python": platform.python_version(),
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "kvpress": metadata.version("kvpress"),
      "numpy": np.__version__,
      "tiny_llama_reference_logits_max_abs_err": ref_err,
  }
  with open(os.path.join(OUT, "reference.json"), "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
  print(json.dumps(meta, indent=1, sort_keys=True), file=sys.stderr)


if __name__ == "__main__":
  main()
