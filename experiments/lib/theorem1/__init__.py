"""Theorem 1 on a real model's cache (``python -m experiments.theorem1``): :mod:`.experiment`."""
