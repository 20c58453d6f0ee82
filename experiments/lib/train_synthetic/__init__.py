"""A small Llama trained on synthetic key-value retrieval (``python -m experiments.train_synthetic``): :mod:`.experiment`."""
