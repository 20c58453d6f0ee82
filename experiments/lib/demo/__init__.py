"""The SmolLM2 demo (``python -m experiments.demo_smollm2``): :mod:`.experiment`."""
