"""Chunked prefill (models/prefill.py) against the one-shot ``forward_chunk`` prefill.

Tiny random Llama (``test_util.tiny_config``), float32: last logits, the
caches' keys, values, slots and positions, and a design's statistics agree to
``RTOL``/``ATOL`` (summation order differs chunk by chunk), for a chunk that
divides the prompt and one that does not, over right-padded rows of
different lengths whose length modulo the chunk is below the observation
window (so a layout padding the last chunk would shorten the window).
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from certkv_jax.designs import registry
from certkv_jax.kv import caches as caches_lib
from certkv_jax import layer as layer_lib
from models import forward
from models import prefill as prefill_lib
from tests import test_util

RTOL, ATOL = 1e-5, 1e-5  # float32
WINDOW = 8
FIELDS = ("k", "v", "v_sq", "pos", "valid", "log_pi", "n_seen", "n_dropped")
STATISTICS = ("acc", "last", "obs")


def _design():
  return registry.make("snapkv", 0.5, n_sink=4, window=WINDOW)


def _prompt(config, lengths, n):
  """Right-padded [len(lengths), n] random tokens and their mask."""
  tokens = jax.random.randint(jax.random.PRNGKey(n), (len(lengths), n), 0, config.vocab_size)
  mask = np.arange(n)[None] < np.array(lengths)[:, None]
  return tokens.astype(jnp.int32), jnp.asarray(mask)


def _one_shot(params, config, tokens, mask, capacity, design):
  caches = caches_lib.init_caches(config, tokens.shape[0], capacity)
  logits, caches, _, _ = forward.forward_chunk(
      params, config, tokens, mask, caches,
      settings=layer_lib.Settings(design=design, certificate=False))
  last = jnp.sum(mask, axis=1) - 1
  return logits[jnp.arange(tokens.shape[0]), last], caches


class PrefillTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = test_util.tiny_config()
    cls.params = test_util.tiny_params(cls.config)

  def _assert_same(self, got, want, design):
    (logits, caches), (ref_logits, ref) = got, want
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    for f in FIELDS + (STATISTICS if design is not None else ()):
      np.testing.assert_allclose(getattr(caches, f), getattr(ref, f), rtol=RTOL, atol=ATOL,
                                 err_msg=f)

  @parameterized.named_parameters(
      # 37 = 2 * 16 + 5: the last 16-token chunk of a row would hold 5 < WINDOW real queries.
      ("chunk_not_dividing_design", 37, (37, 26), 16, True),
      ("chunk_dividing_design", 32, (32, 19), 8, True),
      ("chunk_not_dividing_no_design", 37, (37, 26), 16, False),
      # The short row's first two chunks are all padding, its last one partly.
      ("row_shorter_than_chunk", 37, (37, 5), 16, True),
      ("chunk_longer_than_prompt", 12, (12, 9), 16, True),
  )
  def test_equals_one_shot(self, n, lengths, chunk, with_design):
    design = _design() if with_design else None
    tokens, mask = _prompt(self.config, lengths, n)
    capacity = n + 3
    got = prefill_lib.prefill(self.params, tokens, mask, config=self.config,
                              capacity=capacity, chunk=chunk, design=design)
    want = _one_shot(self.params, self.config, tokens, mask, capacity, design)
    self._assert_same(got, want, design)
    np.testing.assert_array_equal(got[1].n_seen[:, :, 0], [lengths] * self.config.n_layers)

  def test_window_would_be_short_with_padding_last(self):
    """The check above has teeth: chunks padded at the end (as streaming feeds them) give
    a row whose last chunk holds fewer real queries than the window another ``obs``."""
    design, n, chunk = _design(), 37, 16
    tokens, mask = _prompt(self.config, (37, 26), n)
    pad = 3 * chunk - n
    t = jnp.pad(tokens, ((0, 0), (0, pad))).reshape(2, 3, chunk)
    v = jnp.pad(mask, ((0, 0), (0, pad))).reshape(2, 3, chunk)
    caches = caches_lib.init_caches(self.config, 2, n)
    for i in range(3):
      _, caches, _, _ = forward.forward_chunk(
          self.params, self.config, t[:, i], v[:, i], caches,
          settings=layer_lib.Settings(design=design, certificate=False))
    _, ref = _one_shot(self.params, self.config, tokens, mask, n, design)
    self.assertFalse(np.allclose(caches.obs[:, 0], ref.obs[:, 0], rtol=RTOL, atol=ATOL))

  def test_bad_arguments_raise(self):
    tokens, mask = _prompt(self.config, (10,), 10)
    call = lambda **kw: prefill_lib.prefill(self.params, tokens, mask, config=self.config,
                                            **kw)
    with self.assertRaisesRegex(ValueError, r"chunk must be an int >= max\(1, "):
      call(capacity=10, chunk=0)
    with self.assertRaisesRegex(ValueError, r"chunk must be an int >= .* = 8, got 4"):
      call(capacity=10, chunk=4, design=_design())
    with self.assertRaisesRegex(ValueError, r"capacity must be an int >= the prompt's length "
                                r"10 .*got 9"):
      call(capacity=9, chunk=4)


if __name__ == "__main__":
  absltest.main()
