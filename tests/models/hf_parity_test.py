"""Parity with Hugging Face transformers on tiny random Llama and Qwen2 checkpoints.

The checkpoints and the reference logits in tests/fixtures/ were made by
scripts/make_hf_fixtures.py (torch 2.13.0+cpu, transformers 5.24.0, eager
attention, float32; versions also in each fixture's reference.json). No torch
at test time. Measured max abs error over real tokens: 1.2e-6 (tiny_llama),
9.5e-7 (tiny_qwen2).
"""

import functools
import json
import os
import shutil
import tempfile
import types

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from models import gguf_loader
from models import hf_loader
from models import llama
from models import rope
from tests import test_util

FIXTURES = test_util.FIXTURES


@functools.lru_cache(maxsize=None)
def _forward(config):
  return jax.jit(llama.LlamaModel(config).apply)


def _load(name):
  path = os.path.join(FIXTURES, name)
  params, config = hf_loader.load_hf_checkpoint(path)
  ref = np.load(os.path.join(path, "reference.npz"))
  return params, config, ref


_GGUF_META = {"general.architecture": "llama", "llama.embedding_length": 256,
              "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
              "llama.block_count": 1, "llama.feed_forward_length": 512,
              "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 100}


def _gguf_reader(meta):
  """A stand-in for gguf.GGUFReader holding ``meta`` and no output matrix (tied)."""
  return types.SimpleNamespace(
      fields={k: types.SimpleNamespace(contents=lambda v=v: v) for k, v in meta.items()},
      tensors=[types.SimpleNamespace(name=n) for n in ("token_embd.weight",
                                                      "output_norm.weight")])


class HFParityTest(parameterized.TestCase):

  @parameterized.parameters("tiny_llama", "tiny_qwen2")
  def test_logits_match_transformers(self, name):
    params, config, ref = _load(name)
    logits = np.asarray(_forward(config)(params, ref["tokens"], ref["mask"]))
    self.assertEqual(logits.shape, ref["logits"].shape)
    self.assertEqual(logits.dtype, np.float32)
    err = np.abs(logits - ref["logits"])[ref["mask"]]
    self.assertLess(err.max(), 1e-4)

  def test_configs_read(self):
    _, llama_cfg, _ = _load("tiny_llama")
    self.assertEqual(llama_cfg.rope_scaling, "llama3")
    self.assertEqual(llama_cfg.rope_original_max_positions, 64)
    self.assertFalse(llama_cfg.tie_embeddings)
    self.assertFalse(llama_cfg.qkv_bias)
    self.assertEqual(llama_cfg.rope_layout, "half")
    qwen_params, qwen_cfg, _ = _load("tiny_qwen2")  # sharded checkpoint
    self.assertTrue(qwen_cfg.tie_embeddings)
    self.assertTrue(qwen_cfg.qkv_bias)
    self.assertEqual(qwen_cfg.rope_theta, 1e6)
    self.assertNotIn("lm_head", qwen_params["params"])
    self.assertEqual(qwen_params["params"]["layers"]["q_proj"]["bias"].shape, (2, 64))

  def test_padding_content_does_not_matter(self):
    params, config, ref = _load("tiny_llama")
    forward = _forward(config)
    tokens = ref["tokens"].copy()
    tokens[~ref["mask"]] = 99
    np.testing.assert_allclose(np.asarray(forward(params, tokens, ref["mask"]))[ref["mask"]],
                               np.asarray(forward(params, ref["tokens"], ref["mask"]))[ref["mask"]],
                               atol=1e-6)

  def test_interleaved_layout_with_permuted_rows_is_the_same_model(self):
    # What llama.cpp's converter does to Q/K (GGUF): permute rows, rotate interleaved.
    params, config, ref = _load("tiny_qwen2")
    rows = rope.half_to_interleaved_rows
    layers = dict(params["params"]["layers"])
    for proj, heads in (("q_proj", config.n_heads), ("k_proj", config.n_kv_heads)):
      perm = rows(heads, config.head_dim)
      layers[proj] = {"kernel": layers[proj]["kernel"][..., perm],
                      "bias": layers[proj]["bias"][..., perm]}
    permuted = {"params": {**params["params"], "layers": layers}}
    out = _forward(config.replace(rope_layout="interleaved"))(permuted, ref["tokens"],
                                                              ref["mask"])
    err = np.abs(np.asarray(out) - ref["logits"])[ref["mask"]]
    self.assertLess(err.max(), 1e-4)


class HFLoaderErrorsTest(absltest.TestCase):

  def _config(self):
    with open(os.path.join(FIXTURES, "tiny_llama", "config.json")) as f:
      return json.load(f)

  def test_unknown_architecture(self):
    cfg = self._config()
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with self.assertRaisesRegex(ValueError, "architectures.*GPT2LMHeadModel"):
      hf_loader.config_from_hf(cfg)

  def test_transformers4_style_mistral_config(self):
    cfg = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96,
           "vocab_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": 4096,
           "rope_scaling": {"type": "linear", "factor": 2.0}, "hidden_act": "silu"}
    c = hf_loader.config_from_hf(cfg)
    self.assertEqual((c.sliding_window, c.rope_theta, c.rope_scaling, c.rope_factor),
                     (4096, 1e6, "linear", 2.0))
    self.assertEqual((c.head_dim, c.tie_embeddings, c.qkv_bias), (16, False, False))
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    cfg["use_sliding_window"] = True
    with self.assertRaisesRegex(ValueError, "use_sliding_window"):
      hf_loader.config_from_hf(cfg)
    cfg["use_sliding_window"] = False  # Qwen2 configs carry a window they do not use
    self.assertIsNone(hf_loader.config_from_hf(cfg).sliding_window)

  def test_unsupported_rope_type(self):
    cfg = self._config()
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with self.assertRaisesRegex(ValueError, "rope type 'yarn'"):
      hf_loader.config_from_hf(cfg)

  def test_rope_parameters_and_rope_scaling_that_disagree_are_refused(self):
    cfg = self._config()  # transformers 5's rope_parameters (llama3) beside a linear one
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    with self.assertRaisesRegex(ValueError, r"rope_parameters \('llama3'\) and rope_scaling "
                                r"\('linear'\) disagree"):
      hf_loader.config_from_hf(cfg)  # before: rope_parameters won silently
    cfg["rope_scaling"] = dict(cfg["rope_parameters"])  # the same settings twice: fine
    self.assertEqual(hf_loader.config_from_hf(cfg).rope_scaling, "llama3")

  def test_a_missing_llama3_rope_field_is_named(self):
    cfg = self._config()  # transformers 5's rope_parameters, llama3
    del cfg["rope_parameters"]["low_freq_factor"]
    with self.assertRaisesRegex(ValueError, r"rope_scaling.low_freq_factor is missing"):
      hf_loader.config_from_hf(cfg)  # before: KeyError

  def test_partial_rotary_gguf_is_refused(self):
    meta = dict(_GGUF_META)
    self.assertEqual(gguf_loader.config_from_gguf(_gguf_reader(meta)).head_dim, 64)
    meta["llama.rope.dimension_count"] = 32  # 32 of 64: before, all 64 rotated silently
    with self.assertRaisesRegex(ValueError, r"rope.dimension_count \(32\) differs"):
      gguf_loader.config_from_gguf(_gguf_reader(meta))

  def test_gguf_rope_scaling_is_read_as_llama_cpp_reads_it(self):
    # llama.cpp: no type means linear, the factor from rope.scaling.factor or the
    # older rope.scale_linear; type none turns scaling off. Before, a factor was ignored.
    for extra, want in (({}, (None, 1.0)),
                        ({"llama.rope.scaling.factor": 4.0}, ("linear", 4.0)),
                        ({"llama.rope.scale_linear": 4.0}, ("linear", 4.0)),
                        ({"llama.rope.scaling.type": "linear",
                          "llama.rope.scaling.factor": 2.0}, ("linear", 2.0)),
                        ({"llama.rope.scaling.type": "none",
                          "llama.rope.scaling.factor": 4.0}, (None, 1.0))):
      c = gguf_loader.config_from_gguf(_gguf_reader({**_GGUF_META, **extra}))
      self.assertEqual((c.rope_scaling, c.rope_factor), want, msg=str(extra))
    with self.assertRaisesRegex(ValueError, r"rope.scaling.type 'yarn' is not supported"):
      gguf_loader.config_from_gguf(_gguf_reader({**_GGUF_META,
                                                 "llama.rope.scaling.type": "yarn"}))

  def test_missing_files(self):
    with tempfile.TemporaryDirectory() as d:
      with self.assertRaisesRegex(FileNotFoundError, "config.json"):
        hf_loader.load_hf_checkpoint(d)
      with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(self._config(), f)
      with self.assertRaisesRegex(FileNotFoundError, "model.safetensors"):
        hf_loader.load_hf_checkpoint(d)

  def test_a_tensor_in_two_shards_is_refused(self):
    # Before, the shard read last overwrote the copy the index names.
    from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
    src = os.path.join(FIXTURES, "tiny_qwen2")
    with tempfile.TemporaryDirectory() as d:
      shutil.copytree(src, d, dirs_exist_ok=True)
      first, second = (os.path.join(d, f"model-0000{i}-of-00002.safetensors") for i in (1, 2))
      name = next(iter(load_file(first)))
      save_file({**load_file(second), name: np.zeros_like(load_file(first)[name])}, second)
      with self.assertRaisesRegex(ValueError, f"tensor '{name}' is stored in more than one"):
        hf_loader.load_hf_checkpoint(d)

  def test_shape_mismatch_and_missing_tensor(self):
    config = hf_loader.config_from_hf(self._config())
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    tensors = load_file(os.path.join(FIXTURES, "tiny_llama", "model.safetensors"))
    bad = dict(tensors)
    bad["model.layers.1.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    with self.assertRaisesRegex(ValueError, "k_proj.weight.*shape"):
      hf_loader.params_from_tensors(bad, config)
    del bad["model.layers.1.self_attn.k_proj.weight"]
    with self.assertRaisesRegex(ValueError, "missing tensors.*k_proj"):
      hf_loader.params_from_tensors(bad, config)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.q_proj.bias"] = np.zeros((64,), np.float32)
    with self.assertRaisesRegex(ValueError, "q_proj.bias"):
      hf_loader.params_from_tensors(bad, config)


if __name__ == "__main__":
  absltest.main()
