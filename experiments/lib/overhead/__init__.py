"""Time and memory per decode step (``python -m experiments.overhead``): :mod:`.experiment`."""
