"""Checks of a model's token inputs: prompts, their masks, token ids.

Every bad input gets a ValueError that names the argument and the allowed
range (method, section 9, "Bad input"). Shape checks (an empty prompt, a
prompt longer than the model's context) are static and also run inside
``jit``. Value checks (token ids, mask rows) need the arrays' values, so they
run only when the arrays are concrete; inside ``jit`` they are skipped, and
the model then computes on whatever it was given:

* a token id ``>= vocab_size`` embeds as NaN (``jnp.take``'s fill value for
  an out-of-range gather): ``LlamaModel`` gives NaN logits for the whole row;
  ``models.decode`` gives NaN logits at the prompt's last token (greedy
  decoding emits token 0), then finite, wrong ones, because the NaN keys
  empty every attention row that reads them (out 0; see
  ``certkv_jax.offset_attention`` and method, section 9, "Bad input");
* a negative id wraps around (``-1`` reads the vocabulary's last token);
* a mask row that is all False makes ``models.decode`` decode that row from
  the logits of its first, padded column, computed with nothing to attend to;
* a mask that is not right-padded (a True after a False) makes
  ``models.decode`` decode from the logits of column ``n_real - 1``, which is
  then not the row's last real token.

So call :func:`check_prompt` where the arrays are still concrete (before the
jitted call) to get the value checks.
"""

from __future__ import annotations

import numbers
from typing import Optional

import jax.numpy as jnp
import numpy as np

from certkv_jax import _checks
from models.config import LlamaConfig


def check_tokens(tokens, *, config: Optional[LlamaConfig] = None, name: str = "tokens") -> None:
  """Checks ``[batch, len]`` int token ids: non-empty, ids in ``[0, vocab_size)``.

  Args:
    tokens: [batch, len] int token ids (padding included: pad with a valid id,
      e.g. 0, since padded columns are embedded too).
    config: the model's config; its ``vocab_size`` bounds the ids (None skips
      the id check).
    name: the argument's name in the messages.

  Raises:
    ValueError naming ``name``: not a 2-d int array, batch or length 0, or
    (when ``tokens`` is concrete) an id outside ``[0, vocab_size)``, naming
    the first such id and where it is.
  """
  shape, dtype = jnp.shape(tokens), jnp.result_type(tokens)
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{name} must be an int [batch, len] array, got {dtype} {shape}")
  if shape[0] == 0:
    raise ValueError(f"{name} has batch size 0 (shape {shape}); it needs >= 1 row")
  if shape[1] == 0:
    raise ValueError(f"{name} is empty (length 0, shape {shape}); a prompt needs >= 1 token")
  if config is None:
    return
  ids = _checks.concrete_array(tokens)
  if ids is None:
    return
  bad = (ids < 0) | (ids >= config.vocab_size)
  if bad.any():
    row, col = (int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{name} holds token id {int(ids[row, col])} at row {row}, column {col} "
                     f"({int(bad.sum())} ids out of range); ids must be in [0, "
                     f"{config.vocab_size}) (vocab_size), padding included")


def check_prompt(tokens, mask, *, config: Optional[LlamaConfig], n_steps: int,
                 name: str = "tokens", mask_name: Optional[str] = None,
                 max_positions: Optional[int] = None,
                 allow_empty_rows: bool = False) -> None:
  """Checks a right-padded ``[batch, len]`` prompt, its mask and ``n_steps``.

  Args:
    tokens: [batch, len] int token ids, right-padded per row.
    mask: [batch, len] bool, True on real tokens.
    config: the model's config (its ``vocab_size`` bounds the ids); None skips
      the id check.
    n_steps: tokens to decode after the prompt, an int >= 1.
    name: the prompt argument's name in messages (``"context"``, ``"question"``).
    mask_name: the mask's name; default ``"mask"`` for ``"tokens"``, else
      ``name + "_mask"``.
    max_positions: the model's context length: the longest prompt row plus
      ``n_steps`` must fit in it. None takes ``config.max_positions`` (None
      there too: unknown, unchecked).
    allow_empty_rows: accept mask rows with no real token (a streaming
      context may be empty for some rows); the question or prompt whose last
      token's logits are decoded must not.

  Raises:
    ValueError naming the argument and the allowed range: shapes or dtypes,
    an empty prompt, ``n_steps < 1``, a prompt longer than ``max_positions``;
    and, when the arrays are concrete: a token id outside ``[0, vocab_size)``,
    a mask row with no real token, a mask row that is not right-padded.
  """
  if mask_name is None:
    mask_name = "mask" if name == "tokens" else f"{name}_mask"
  check_tokens(tokens, config=config, name=name)
  shape = jnp.shape(tokens)
  if jnp.shape(mask) != shape or jnp.result_type(mask) != jnp.bool_:
    raise ValueError(f"{mask_name} must be bool with {name}'s shape {shape}; got "
                     f"{jnp.result_type(mask)} {jnp.shape(mask)}")
  if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps < 1:
    raise ValueError(f"n_steps must be an int >= 1, got {n_steps!r}")
  m = _checks.concrete_array(mask)
  if m is not None:
    empty = ~m.any(axis=1)
    if empty.any() and not allow_empty_rows:
      rows = np.flatnonzero(empty)
      raise ValueError(f"{mask_name} row {int(rows[0])} is all False ({rows.size} such rows): "
                       f"every row of {name} needs >= 1 real token")
    holes = m[:, 1:] & ~m[:, :-1]  # a True right after a False
    if holes.any():
      row, col = (int(i) for i in np.argwhere(holes)[0])
      raise ValueError(f"{mask_name} row {row} is not right-padded (True at column "
                       f"{col + 1} after a False): real tokens must come first in each row")
  if max_positions is None and config is not None:
    max_positions = config.max_positions
  if max_positions is not None:
    max_positions = _checks.check_positive_int("max_positions", max_positions)
    longest = shape[1] if m is None else int(m.sum(axis=1).max())
    if longest + n_steps > max_positions:
      what = "padded length" if m is None else "longest row"
      raise ValueError(f"{name} is too long for the model's context: {what} {longest} + "
                       f"n_steps {n_steps} = {longest + n_steps} positions > max_positions "
                       f"{max_positions}; the prompt must be at most "
                       f"{max_positions - n_steps} tokens")
