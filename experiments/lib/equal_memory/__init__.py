"""Designs at equal memory (``python -m experiments.equal_memory``).

:mod:`.experiment` (variants, segments, units, rows) and :mod:`.report`
(paired differences, calibrated coverage, the table, summary.json, the plot).
"""
