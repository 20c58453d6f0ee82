"""Makes the NVIDIA kvpress reference selections in tests/fixtures/kvpress/.

Run once, by hand, from the repository root (CPU only):

    pip install torch==2.13.0 kvpress==0.5.5 transformers==5.2.0
    python scripts/make_kvpress_fixtures.py

Made with: torch 2.13.0+cpu, kvpress 0.5.5, transformers 5.2.0 (kvpress 0.5.5
requires ``transformers>=4.56,<5.3``; 5.2.0 is the newest allowed), Python
3.11. The exact versions are also written to ``tests/fixtures/kvpress/reference.json``.
torch, transformers and kvpress are used ONLY here; the parity test
(tests/models/kvpress_parity_test.py) reads the fixture with numpy.

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

AdaKV cases (per-head budgets), case ``adakv_{inner}_{ratio}``:
``AdaKVPress(press, alpha_safeguard=0.2)`` (the default) around
``SnapKVPress(window_size=16, kernel_size=5)`` (``adakv_snapkv``),
``TOVAPress()`` (``adakv_tova``; TOVA is a ``ScorerPress``, so AdaKV accepts
it), ``KnormPress()`` (``adakv_knorm``) and ``KeyDiffPress()``
(``adakv_keydiff``), at ratios 0.5 and 0.75; and ``AdaKVPress(KnormPress(),
alpha_safeguard=0.9)`` (``adakv_knorm_alpha0.9``), where the safeguard binds
(some heads keep exactly ``n_safe``; with 0.2 every head here keeps far more
than ``n_safe``, which then only protects window tokens). ``AdaKVPress`` refuses eager
attention ("eager mode not supported"), so these cases run on the same
checkpoint loaded with sdpa attention (SnapKV and TOVA then recompute the
window attention from the queries themselves). Per (layer, batch row) AdaKV
keeps, for every KV head, its ``n_safe = int(n_kept * alpha_safeguard)`` (at
least 1) highest scores (set to the dtype's max), then prunes the
``n_kv_heads * (n - n_kept)`` lowest scores of all heads flattened. It does
not shrink the cache: it stores the pruned positions in
``module.masked_key_indices = (batch, head, seq)``, read here right after
``compress`` returns. Per AdaKV case the script records:

* ``kept_mask`` [n_layers, n_kv_heads, n] bool (True = kept), the complement
  of ``masked_key_indices``;
* ``scores`` [n_layers, n_kv_heads, n] float32: what the inner press's
  ``score`` returned (sdpa attention), copied before AdaKV's in-place
  ``scatter_`` of the safeguard maxima;

and checks that the pruned indices are distinct, that each layer keeps
``n_kv_heads * n_kept`` positions, each head at least ``n_safe``, and that
apart from each head's ``n_safe`` highest kept scores no pruned position
scores above a kept one (the selection is a flattened top-k up to ties).

Output: ``tests/fixtures/kvpress/reference.npz`` (``tokens`` [1, n] int32 and,
per case ``{press}_{ratio}``, ``{case}/kept`` [n_layers, n_kv_heads, n_kept]
int32 sorted and ``{case}/scores`` [n_layers, n_kv_heads, n] float32; per
AdaKV case ``{case}/kept_mask`` and ``{case}/scores`` as above) and
``reference.json`` (versions, settings, budgets, and per case
``sdpa_same_kept``: whether the same press on the same model with sdpa
attention, where SnapKV and TOVA recompute the window attention themselves,
kept the same positions; per AdaKV case ``attn_implementation`` "sdpa",
``alpha_safeguard``, ``n_safe``, ``kept_per_head`` [n_layers][n_kv_heads]
and ``scores_max_abs_diff_vs_eager``: the largest difference between the
inner press's sdpa scores and its eager scores of the single-press case).
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
from kvpress.utils import compute_n_kept
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
ADAKV_INNER = ("snapkv", "tova", "knorm", "keydiff")  # the inner presses of AdaKVPress
ADAKV_ALPHA = 0.2  # kvpress's default alpha_safeguard
ADAKV_BINDING_ALPHA = 0.9  # case adakv_knorm_alpha0.9: a safeguard that binds


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


def adakv_presses(ratio):
  """{case name: (inner press name, AdaKVPress)}."""
  out = {f"adakv_{name}": (name, kvpress.AdaKVPress(presses(ratio)[name],
                                                    alpha_safeguard=ADAKV_ALPHA))
         for name in ADAKV_INNER}
  # A safeguard that binds: with alpha 0.2 every head keeps far more than its
  # n_safe here, so the safeguard only ever protects window tokens; with 0.9
  # (n_safe 57 of 64, 28 of 32) some Knorm heads keep exactly n_safe.
  out["adakv_knorm_alpha0.9"] = ("knorm", kvpress.AdaKVPress(
      presses(ratio)["knorm"], alpha_safeguard=ADAKV_BINDING_ALPHA))
  return out


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


def run_adakv(model, tokens, press):
  """(kept_mask [L, H, n] bool, scores [L, H, n] float32, n_safe) of an AdaKVPress."""
  n_layers = model.config.num_hidden_layers
  captured = {}
  inner = press.press
  orig_score = inner.score
  orig_compress = press.compress

  def score(module, hidden_states, keys, values, attentions, kwargs):
    s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
    # a copy: AdaKVPress scatters the safeguard maxima into s in place afterwards
    captured.setdefault(module.layer_idx, {})["scores"] = s.detach().clone()
    return s

  def compress(module, hidden_states, keys, values, attentions, kwargs):
    out = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
    b, h, q = module.masked_key_indices
    captured.setdefault(module.layer_idx, {})["masked"] = (b.clone(), h.clone(), q.clone())
    captured[module.layer_idx]["shape"] = tuple(keys.shape[:3])
    return out

  inner.score = score
  press.compress = compress
  cache = transformers.DynamicCache(config=model.config)
  with torch.no_grad(), press(model):
    model(input_ids=tokens, past_key_values=cache, use_cache=True)
  ratio = press.compression_ratio
  masks, scores_all = [], []
  n_safe = None
  for layer in range(n_layers):
    bsz, h_kv, n = captured[layer]["shape"]
    n_kept = compute_n_kept(n, ratio)
    n_safe = max(1, int(n_kept * press.alpha_safeguard)) if n_kept > 0 else 0
    b, h, q = captured[layer]["masked"]
    if bsz != 1 or not (b == 0).all():
      raise RuntimeError(f"layer {layer}: expected one batch row")
    mask = torch.ones(h_kv, n, dtype=torch.bool)
    mask[h, q] = False
    scores = captured[layer]["scores"][0].float()  # [h_kv, n]
    n_pruned = h_kv * (n - n_kept)
    if h.numel() != n_pruned or int((~mask).sum()) != n_pruned:
      raise RuntimeError(f"layer {layer}: pruned indices are not {n_pruned} distinct positions")
    per_head = mask.sum(-1)
    if int(per_head.sum()) != h_kv * n_kept or (per_head < n_safe).any():
      raise RuntimeError(f"layer {layer}: kept per head {per_head.tolist()}")
    # Up to ties, a flattened top-k after each head's n_safe safeguard: apart
    # from each head's n_safe highest kept scores, no pruned score is above a kept one.
    rest = []
    for hh in range(h_kv):
      kept_s = scores[hh][mask[hh]].sort(descending=True).values
      rest.append(kept_s[n_safe:])
    rest = torch.cat(rest)
    if rest.numel() and scores[~mask].numel() and scores[~mask].max() > rest.min():
      raise RuntimeError(f"layer {layer}: a pruned score is above a non-safeguard kept score")
    masks.append(mask.numpy())
    scores_all.append(scores.numpy().astype(np.float32))
  return np.stack(masks), np.stack(scores_all), n_safe


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
  # AdaKV (per-head budgets): sdpa only (AdaKVPress refuses eager attention).
  for ratio in RATIOS:
    for name, (inner_name, press) in adakv_presses(ratio).items():
      case = f"{name}_{ratio}"
      kept_mask, scores, n_safe = run_adakv(sdpa, tokens, press)
      arrays[f"{case}/kept_mask"] = kept_mask
      arrays[f"{case}/scores"] = scores
      inner = press.press
      eager_scores = arrays[f"{inner_name}_{ratio}/scores"]
      cases[case] = {"press": type(press).__name__, "inner_press": type(inner).__name__,
                     "compression_ratio": ratio, "attn_implementation": "sdpa",
                     "alpha_safeguard": press.alpha_safeguard,
                     "settings": {k: v for k, v in vars(inner).items()
                                  if isinstance(v, (int, float, str))},
                     "n_kept": compute_n_kept(scores.shape[-1], ratio),
                     "n_safe": n_safe,
                     "kept_per_head": kept_mask.sum(-1).tolist(),
                     "scores_max_abs_diff_vs_eager":
                         float(np.abs(scores - eager_scores).max())}
      print(case, "kept per head:", cases[case]["kept_per_head"], "n_safe", n_safe,
            "scores vs eager", cases[case]["scores_max_abs_diff_vs_eager"])
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
