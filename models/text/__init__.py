"""Text in, answer and per-step certificate out (the command:
``python -m experiments.generate``).

:mod:`.generate` (:func:`~models.text.generate.generate_text` and its
:class:`~models.text.generate.TextSettings`), :mod:`.certificate` (what the
radii mean, the calibrated radius), :mod:`.prompt_encoding` (the prompt as a
regime feeds it), :mod:`.answer_text` (stop ids, whole characters) and
:mod:`.report` (the command's input, printout and run).
"""
