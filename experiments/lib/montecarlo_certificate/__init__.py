"""Synthetic Monte Carlo of every design (``python -m experiments.montecarlo_certificate``): :mod:`.experiment`."""
