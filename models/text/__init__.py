"""Text in, answer and per-step certificate out (``python -m experiments.generate``):
:func:`~models.text.generate.generate_text` and its helpers."""
