"""Opening GGUF files and reading their metadata (for ``gguf_loader`` and
``tokenizer``); ``gguf`` is imported only when a file is opened."""

from __future__ import annotations

import os


def open_gguf(path: str):
  """A ``gguf.GGUFReader`` for ``path`` (clear error if the file is missing)."""
  import gguf  # pylint: disable=g-import-not-at-top
  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file {path!r} does not exist")
  return gguf.GGUFReader(path)


def metadata(reader, key: str, default=None):
  """A metadata value (scalar, string or list) of a GGUF file; ``default`` if absent."""
  field = reader.fields.get(key)
  if field is None:
    return default
  return field.contents()
