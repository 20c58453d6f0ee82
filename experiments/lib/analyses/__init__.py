"""Analyses of the suite's rows (``experiments.lib.suite.rows``) against method, section 7's claims.

One module per analysis: :mod:`.coverage` (experiment 2), :mod:`.assumption2`
(experiment 3), :mod:`.failures` (experiments 4-6: failure prediction,
attribution, gated recomputation) and :mod:`.regimes` (experiment 8), with
their shared helpers in :mod:`.common`. Each ``*_analysis`` function takes the
rows (and a plot directory) and returns a JSON-able dict, its markdown section
(``"md"``) and its claim rows (``"claims"``: claim, paper, ours, verdict from
:func:`experiments.lib.stats.verdict`); :mod:`experiments.lib.suite.report`
assembles them into ``report.md``.
"""
