"""The experiment suite (method, sections 7 and 8; ``python -m experiments.run_all``).

:mod:`.settings` (what runs, and the flags the suite's scripts share),
:mod:`.rows` (the per-example rows every analysis reads), :mod:`.report`
(``report.md``), :mod:`.regime` (what a run was against the paper's setting, and
the committed longer runs beside each claim), :mod:`.progress` (one progress line
for the whole job) and :mod:`.runner` (``run_all``'s plans and run); the analyses
themselves are in :mod:`experiments.lib.analyses`.
"""
