"""The validity study (``python -m experiments.validity``): where the certificate holds.

:mod:`.collect` (per-call records, resumable units), :mod:`.calls` (the flat
per-call table and its calibration folds), :mod:`.report` (cells, signals,
``summary.json``, ``report.md``) and :mod:`.run` (the study: collect, analyse,
write the report and the default calibration artifact).
"""
