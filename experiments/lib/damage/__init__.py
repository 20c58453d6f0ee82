"""The damage study (``python -m experiments.damage``): output damage vs the certificate.

:mod:`.tokens` (per-token damage of streaming eviction), :mod:`.collect`
(resumable units), :mod:`.analysis` (token tables, the learned predictor, the
scores) and :mod:`.report` (``summary.json``, ``report.md``, plots).
"""
