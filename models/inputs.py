"""Checks of a model's token inputs: prompts, their masks, token ids.

Bad inputs raise a ValueError naming the argument (method, section 9, "Bad
input"); value checks need concrete arrays (call :func:`check_prompt` before
``jit``). Unchecked, an id ``>= vocab_size`` gives NaN logits, a negative one wraps.
"""

from __future__ import annotations

import numbers
from typing import Optional

import jax.numpy as jnp
import numpy as np

from certkv_jax import _validate
from models.config import LlamaConfig


def check_tokens(tokens, *, config: Optional[LlamaConfig] = None, name: str = "tokens") -> None:
  """Checks ``[batch, len]`` int token ids: non-empty, ids (padding too) in
  ``[0, config.vocab_size)`` when concrete; raises ValueError naming ``name``."""
  shape, dtype = jnp.shape(tokens), jnp.result_type(tokens)
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{name} must be an int [batch, len] array, got {dtype} {shape}")
  if shape[0] == 0:
    raise ValueError(f"{name} has batch size 0 (shape {shape}); it needs >= 1 row")
  if shape[1] == 0:
    raise ValueError(f"{name} is empty (length 0, shape {shape}); a prompt needs >= 1 token")
  if config is None:
    return
  ids = _validate.concrete_array(tokens)
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
    tokens, mask: [batch, len] int ids and bool (True on real tokens).
    config: bounds the ids by ``vocab_size``; None skips the id check.
    n_steps: tokens to decode after the prompt, an int >= 1.
    max_positions: longest row + ``n_steps`` must fit (default
      ``config.max_positions``; None: unchecked).
    allow_empty_rows: accept rows with no real token (a streaming context).

  Raises:
    ValueError naming the argument: bad shapes or dtypes, an empty prompt,
    ``n_steps < 1``, too long a prompt; when concrete, a bad id, an empty or
    not right-padded mask row.
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
  m = _validate.concrete_array(mask)
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
    max_positions = _validate.check_positive_int("max_positions", max_positions)
    longest = shape[1] if m is None else int(m.sum(axis=1).max())
    if longest + n_steps > max_positions:
      what = "padded length" if m is None else "longest row"
      raise ValueError(f"{name} is too long for the model's context: {what} {longest} + "
                       f"n_steps {n_steps} = {longest + n_steps} positions > max_positions "
                       f"{max_positions}; the prompt must be at most "
                       f"{max_positions - n_steps} tokens")
