"""Streaming language-model loss under eviction (``python -m experiments.perplexity``).

:mod:`.core` (the jitted streaming pass), :mod:`.experiment` (segments, units,
rows) and :mod:`.report` (the design x budget table).
"""
